//! A volume's id: a DNS label, so it can name a Kubernetes object, a file and a metric label
//! alike. Only [`VolumeId::parse`] makes one, so every id the server holds passed the rule,
//! including those read back from the registry.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct VolumeId(String);

/// An id that breaks the rule; carries the offending text, cut to 80 characters.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "volume id {0:?} must be 1-63 characters of a-z, 0-9 and '-', starting and ending with a \
     letter or digit"
)]
pub struct BadVolumeId(pub String);

impl VolumeId {
    /// 1-63 of `[a-z0-9-]`, starting and ending with a letter or digit.
    pub fn parse(id: &str) -> Result<Self, BadVolumeId> {
        if ublkd_proto::is_volume_id(id) {
            Ok(VolumeId(id.to_owned()))
        } else {
            // Echoed in the error: cut, since the client's input may be any length.
            let mut shown: String = id.chars().take(80).collect();
            if shown.len() < id.len() {
                shown.push('…');
            }
            Err(BadVolumeId(shown))
        }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for VolumeId {
    type Error = BadVolumeId;
    fn try_from(s: String) -> Result<Self, BadVolumeId> {
        VolumeId::parse(&s)
    }
}

impl From<VolumeId> for String {
    fn from(id: VolumeId) -> String {
        id.0
    }
}

impl std::borrow::Borrow<str> for VolumeId {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl std::ops::Deref for VolumeId {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Quoted, as the string it is: error messages show `volume "db-1"`.
impl fmt::Debug for VolumeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl PartialEq<str> for VolumeId {
    fn eq(&self, other: &str) -> bool {
        self.0 == other
    }
}

impl PartialEq<&str> for VolumeId {
    fn eq(&self, other: &&str) -> bool {
        self.0 == *other
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_follow_the_dns_label_rule() {
        for ok in ["a", "db-1", "0", &"x".repeat(63)] {
            assert_eq!(VolumeId::parse(ok).map(String::from), Ok(ok.to_owned()));
        }
        for bad in ["", "-a", "a-", "A", "a_b", "a.b", "é", &"x".repeat(64)] {
            assert!(VolumeId::parse(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn stored_ids_are_checked_when_read_back() {
        let id: VolumeId = serde_json::from_str("\"db-1\"").unwrap();
        assert_eq!(id, "db-1");
        assert_eq!(serde_json::to_string(&id).unwrap(), "\"db-1\"");
        assert!(serde_json::from_str::<VolumeId>("\"../etc\"").is_err());
    }

    #[test]
    fn messages_quote_the_id_and_cut_long_input() {
        let id = VolumeId::parse("db-1").unwrap();
        assert_eq!(format!("volume {id:?}"), "volume \"db-1\"");
        let e = VolumeId::parse(&"Z".repeat(500)).unwrap_err();
        assert!(e.to_string().len() < 300, "{e}");
    }
}
