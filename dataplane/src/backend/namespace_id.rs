//! An NVMe namespace's identity: what names the same namespace whatever `/dev/ngXnY` the kernel
//! gave it this boot (controllers are numbered in probe order, which changes between boots).
//! From Identify: the NGUID, else the EUI-64, else the subsystem's NQN with the namespace id
//! (a controller that reports neither global id still has a unique NQN per subsystem).
//!
//! Written as Linux's `/dev/disk/by-id` names do: `nguid.<32 hex>`, `eui.<16 hex>`, and
//! `nsid.<n>.<subsystem NQN>` for the fallback.

use std::fmt;
use std::str::FromStr;

/// A namespace's identity (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(into = "String", try_from = "String")
)]
pub enum NamespaceIdentity {
    Nguid([u8; 16]),
    Eui64([u8; 8]),
    Subsystem { nqn: String, nsid: u32 },
}

impl NamespaceIdentity {
    /// The identity Identify gives: the NGUID when it is not all zeroes, else the EUI-64, else
    /// the subsystem's NQN (when the controller reports one) with the namespace id.
    pub fn from_identify(nguid: [u8; 16], eui64: [u8; 8], nqn: &str, nsid: u32) -> Option<Self> {
        if nguid != [0; 16] {
            return Some(Self::Nguid(nguid));
        }
        if eui64 != [0; 8] {
            return Some(Self::Eui64(eui64));
        }
        let nqn = nqn.trim_matches(|c: char| c == '\0' || c.is_whitespace());
        (!nqn.is_empty()).then(|| Self::Subsystem {
            nqn: nqn.to_owned(),
            nsid,
        })
    }
}

impl fmt::Display for NamespaceIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let hex = |f: &mut fmt::Formatter<'_>, bytes: &[u8]| {
            bytes.iter().try_for_each(|b| write!(f, "{b:02x}"))
        };
        match self {
            Self::Nguid(b) => {
                f.write_str("nguid.")?;
                hex(f, b)
            }
            Self::Eui64(b) => {
                f.write_str("eui.")?;
                hex(f, b)
            }
            Self::Subsystem { nqn, nsid } => write!(f, "nsid.{nsid}.{nqn}"),
        }
    }
}

/// Why a text is not a namespace identity.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0:?} is not a namespace identity (nguid.<32 hex>, eui.<16 hex> or nsid.<n>.<nqn>)")]
pub struct ParseIdentityError(pub String);

impl FromStr for NamespaceIdentity {
    type Err = ParseIdentityError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || ParseIdentityError(s.chars().take(300).collect());
        fn bytes<const N: usize>(hex: &str) -> Option<[u8; N]> {
            if hex.len() != 2 * N || !hex.is_ascii() {
                return None;
            }
            let mut out = [0u8; N];
            for (i, o) in out.iter_mut().enumerate() {
                *o = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).ok()?;
            }
            Some(out)
        }
        if let Some(h) = s.strip_prefix("nguid.") {
            return bytes(h).map(Self::Nguid).ok_or_else(bad);
        }
        if let Some(h) = s.strip_prefix("eui.") {
            return bytes(h).map(Self::Eui64).ok_or_else(bad);
        }
        let rest = s.strip_prefix("nsid.").ok_or_else(bad)?;
        let (nsid, nqn) = rest.split_once('.').ok_or_else(bad)?;
        let nsid = nsid.parse().map_err(|_| bad())?;
        if nqn.is_empty() || nqn.len() > 223 || nqn.chars().any(char::is_control) {
            return Err(bad());
        }
        Ok(Self::Subsystem {
            nqn: nqn.to_owned(),
            nsid,
        })
    }
}

impl From<NamespaceIdentity> for String {
    fn from(id: NamespaceIdentity) -> String {
        id.to_string()
    }
}

impl TryFrom<String> for NamespaceIdentity {
    type Error = ParseIdentityError;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_prefers_nguid_then_eui64_then_the_subsystem_and_round_trips() {
        let nguid = [0x11; 16];
        let eui = [0x22; 8];
        let nqn = "nqn.2019-08.org.qemu:ublkd-swapA\0\0";
        let a = NamespaceIdentity::from_identify(nguid, eui, nqn, 1);
        assert_eq!(a, Some(NamespaceIdentity::Nguid(nguid)));
        let b = NamespaceIdentity::from_identify([0; 16], eui, nqn, 1);
        assert_eq!(b, Some(NamespaceIdentity::Eui64(eui)));
        let c = NamespaceIdentity::from_identify([0; 16], [0; 8], nqn, 3);
        assert_eq!(
            c.as_ref().map(ToString::to_string).as_deref(),
            Some("nsid.3.nqn.2019-08.org.qemu:ublkd-swapA")
        );
        assert_eq!(
            NamespaceIdentity::from_identify([0; 16], [0; 8], "\0", 1),
            None
        );
        for id in [a, b, c].into_iter().flatten() {
            assert_eq!(id.to_string().parse::<NamespaceIdentity>(), Ok(id.clone()));
        }
        assert_eq!(
            "eui.2222222222222222".parse::<NamespaceIdentity>(),
            Ok(NamespaceIdentity::Eui64(eui))
        );
        for bad in [
            "",
            "eui.12",
            "eui.zz22222222222222",
            "nguid.11",
            "nsid.x.nqn",
            "nsid.1.",
        ] {
            assert!(bad.parse::<NamespaceIdentity>().is_err(), "{bad:?}");
        }
    }
}
