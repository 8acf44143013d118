//! Named nodes: `--node NAME` takes the endpoint and TLS files of a profile in
//! `~/.config/ublkctl/config.toml`, so an operator reaches many nodes without retyping them:
//!
//! ```toml
//! default = "n1"            # the node used when neither --node nor --endpoint is given
//!
//! [nodes.n1]
//! endpoint = "https://n1.example:7443"
//! ca = "/home/me/.config/ublkctl/ca.pem"
//! cert = "/home/me/.config/ublkctl/me.pem"
//! key = "/home/me/.config/ublkctl/me.key"
//! tls_domain = "ublkd.n1"   # optional
//!
//! [nodes.local]
//! endpoint = "unix:///run/ublkd/ublkd.sock"
//! ```
//!
//! A flag or its environment variable wins over the profile, field by field.

use crate::error::Error;
use serde::Deserialize;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// One node's connection settings.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub endpoint: String,
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub tls_domain: Option<String>,
}

/// The profile file.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profiles {
    pub default: Option<String>,
    #[serde(default)]
    pub nodes: BTreeMap<String, Profile>,
}

/// Where the profile file is: `UBLKCTL_CONFIG`, else `$XDG_CONFIG_HOME/ublkctl/config.toml`,
/// else `~/.config/ublkctl/config.toml`.
pub fn path(env: impl Fn(&str) -> Option<String>) -> Option<PathBuf> {
    if let Some(p) = env("UBLKCTL_CONFIG") {
        return Some(PathBuf::from(p));
    }
    let base = env("XDG_CONFIG_HOME")
        .filter(|d| d.starts_with('/'))
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| Path::new(&h).join(".config")))?;
    Some(base.join("ublkctl/config.toml"))
}

impl Profiles {
    /// Reads the profile file; a missing file is no profiles.
    pub fn load(path: &Path) -> Result<Self, Error> {
        match std::fs::read_to_string(path) {
            Ok(text) => {
                toml::from_str(&text).map_err(|e| Error::Usage(format!("{}: {e}", path.display())))
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Self::default()),
            Err(e) => Err(Error::Usage(format!("cannot read {}: {e}", path.display()))),
        }
    }

    /// The profile `--node` names, or the default one when no node and no endpoint were given.
    pub fn pick(
        &self,
        node: Option<&str>,
        endpoint_given: bool,
        path: &Path,
    ) -> Result<Option<&Profile>, Error> {
        let name = match (node, &self.default) {
            (Some(n), _) => n,
            (None, Some(d)) if !endpoint_given => d.as_str(),
            _ => return Ok(None),
        };
        self.nodes.get(name).map(Some).ok_or_else(|| {
            let known: Vec<&str> = self.nodes.keys().map(String::as_str).collect();
            Error::Usage(format!(
                "no node {name:?} in {} (nodes there: {})",
                path.display(),
                if known.is_empty() {
                    "none".to_owned()
                } else {
                    known.join(", ")
                }
            ))
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    const FILE: &str = r#"
default = "n1"

[nodes.n1]
endpoint = "https://n1:7443"
ca = "/c/ca.pem"
cert = "/c/me.pem"
key = "/c/me.key"

[nodes.local]
endpoint = "unix:///run/ublkd/ublkd.sock"
"#;

    #[test]
    fn profiles_are_read_and_picked_by_name_or_default() {
        let p: Profiles = toml::from_str(FILE).unwrap();
        let f = Path::new("/x/config.toml");
        assert_eq!(
            p.pick(Some("local"), false, f).unwrap().unwrap().endpoint,
            "unix:///run/ublkd/ublkd.sock"
        );
        let n1 = p.pick(None, false, f).unwrap().unwrap();
        assert_eq!(n1.ca.as_deref(), Some(Path::new("/c/ca.pem")));
        assert!(
            p.pick(None, true, f).unwrap().is_none(),
            "--endpoint wins over the default"
        );
        let e = p.pick(Some("n9"), false, f).unwrap_err().to_string();
        assert!(
            e.contains("no node \"n9\"") && e.contains("local, n1"),
            "{e}"
        );
        assert!(toml::from_str::<Profiles>("[nodes.a]\nendpoint = \"x\"\nport = 1\n").is_err());
    }

    #[test]
    fn the_file_is_found_where_the_user_keeps_config() {
        let env = |vars: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                vars.iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| (*v).to_owned())
            }
        };
        assert_eq!(
            path(env(&[("UBLKCTL_CONFIG", "/etc/u.toml"), ("HOME", "/h")])),
            Some(PathBuf::from("/etc/u.toml"))
        );
        assert_eq!(
            path(env(&[("XDG_CONFIG_HOME", "/x"), ("HOME", "/h")])),
            Some(PathBuf::from("/x/ublkctl/config.toml"))
        );
        assert_eq!(
            path(env(&[("HOME", "/h")])),
            Some(PathBuf::from("/h/.config/ublkctl/config.toml"))
        );
        assert_eq!(path(env(&[])), None);
    }
}
