//! Encrypted volumes (`encryption: luks2`): the one file that runs cryptsetup. NodeStage opens
//! the volume's device as a dm-crypt mapping, `/dev/mapper/ublkd-<id>`, with the key in the
//! node-stage Secret (entry `key`), formatting it with LUKS2 first only when it is blank (the
//! same rule as mkfs: [`mount::check_blank`]); the file system, or the pod's block device,
//! lives on the mapping. Unstage closes it; NodeExpand grows it online, with the key from the
//! node-expand Secret. A wrong or missing key fails before anything is written.

use crate::error::CsiError;
use crate::mount;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// The Secret entry that holds the key.
pub const KEY_ENTRY: &str = "key";
/// What blkid calls a LUKS header.
const LUKS_SIGNATURE: &str = "crypto_LUKS";
/// The header's label from format until the first file system is made (or, for block
/// access, the pod is given the mapping): nothing was written through the mapping, whose bytes
/// then decrypt to noise rather than reading as zeroes. Then [`WRITTEN`].
const UNWRITTEN: &str = "ublkd-unwritten";
const WRITTEN: &str = "ublkd";

/// A volume's key, from a Secret's `key` entry. Never printed.
pub struct Key(Vec<u8>);

impl std::fmt::Debug for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Key(..)")
    }
}

impl Key {
    /// The key in `secrets` (the node-stage or node-expand Secret the kubelet passed); `which`
    /// names that Secret's StorageClass parameter for the message.
    pub fn from_secrets(
        secrets: &HashMap<String, String>,
        which: &'static str,
    ) -> Result<Key, CsiError> {
        match secrets.get(KEY_ENTRY) {
            Some(k) if !k.is_empty() => Ok(Key(k.as_bytes().to_vec())),
            _ => Err(CsiError::EncryptionKeyMissing { which }),
        }
    }
}

/// The device-mapper name of volume `id`'s mapping (a volume id is a DNS label).
pub fn mapping_name(id: &str) -> String {
    format!("ublkd-{id}")
}

/// Where volume `id`'s mapping appears.
pub fn mapping_path(id: &str) -> PathBuf {
    Path::new("/dev/mapper").join(mapping_name(id))
}

/// Whether volume `id`'s mapping is open: the kernel's own list of device-mapper devices
/// (`/sys/block/dm-*/dm/name`), which needs neither cryptsetup nor a `/dev/mapper` node. An
/// unencrypted volume never has one.
pub fn is_open(id: &str) -> bool {
    let name = mapping_name(id);
    let Ok(dir) = std::fs::read_dir("/sys/block") else {
        return false;
    };
    dir.flatten()
        .any(|e| std::fs::read_to_string(e.path().join("dm/name")).is_ok_and(|n| n.trim() == name))
}

/// The device volume `id` is served from on this node: its mapping while one is open, else
/// `dev`, its ublk device.
pub fn served(id: &str, dev: PathBuf) -> PathBuf {
    if is_open(id) {
        mapping_path(id)
    } else {
        dev
    }
}

/// Runs cryptsetup with `key` on its standard input (`--key-file=-`), so that the key is never
/// in a file or an argument list.
fn cryptsetup(args: &[&str], key: Option<&Key>) -> Result<std::process::Output, CsiError> {
    let shown = || format!("cryptsetup {}", args.join(" "));
    mount::off_runtime(|| {
        let mut child = Command::new("cryptsetup")
            .args(args)
            .stdin(if key.is_some() {
                Stdio::piped()
            } else {
                Stdio::null()
            })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        if let (Some(key), Some(mut stdin)) = (key, child.stdin.take()) {
            stdin.write_all(&key.0)?;
            // Dropped here: cryptsetup reads the key to the end of its input.
        }
        child.wait_with_output()
    })
    .map_err(|e| CsiError::Command {
        command: shown(),
        output: e.to_string(),
    })
}

/// The output's text for an error: stderr, else stdout, and the exit status.
fn said(out: &std::process::Output) -> String {
    let mut text = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    if text.is_empty() {
        text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    }
    format!("{text} ({})", out.status)
}

/// The device under an active mapping `name`, from `cryptsetup status` (None: not active).
fn active_device(name: &str) -> Result<Option<PathBuf>, CsiError> {
    let out = cryptsetup(&["status", name], None)?;
    match out.status.code() {
        Some(0) => Ok(parse_status_device(&String::from_utf8_lossy(&out.stdout))),
        // 4: "is inactive" (no such mapping).
        Some(4) => Ok(None),
        _ => Err(CsiError::Command {
            command: format!("cryptsetup status {name}"),
            output: said(&out),
        }),
    }
}

/// The `device:` line of `cryptsetup status`.
pub fn parse_status_device(text: &str) -> Option<PathBuf> {
    text.lines()
        .filter_map(|l| l.trim().strip_prefix("device:"))
        .map(|d| PathBuf::from(d.trim()))
        .next()
}

/// An open mapping.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Opened {
    pub path: PathBuf,
    /// Nothing was ever written through it (the header's label is [`UNWRITTEN`]).
    pub unwritten: bool,
}

/// Opens volume `id` on `dev` with `key`; LUKS2-formats `dev` first when it holds nothing
/// ([`mount::check_blank`]). Already open on `dev`: nothing to do. A device with anything
/// else on it is refused; a key the header refuses leaves it untouched.
pub fn open(id: &str, dev: &Path, key: &Key) -> Result<Opened, CsiError> {
    let name = mapping_name(id);
    let path = mapping_path(id);
    if let Some(under) = active_device(&name)? {
        if same_device(&under, dev)? {
            let unwritten = label(dev) == UNWRITTEN;
            return Ok(Opened { path, unwritten });
        }
        return Err(CsiError::MappingTaken {
            name,
            device: under,
        });
    }
    match mount::signature(dev)? {
        Some(t) if t == LUKS_SIGNATURE => {}
        None => {
            mount::check_blank(dev, mount::read_ends(dev)?)?;
            tracing::info!(volume = %id, device = %dev.display(), "formatting with LUKS2");
            format(dev, key)?;
        }
        Some(other) => {
            return Err(CsiError::ForeignFileSystem {
                device: dev.to_owned(),
                found: other,
                wanted: LUKS_SIGNATURE,
            })
        }
    }
    let d = dev.to_string_lossy();
    // No dm-crypt work queues: the ublk device already spreads I/O over its queues, and the
    // queues cost a context switch per request (cryptsetup's --perf-no_*_workqueue).
    let out = cryptsetup(
        &[
            "open",
            "--type",
            "luks2",
            "--key-file=-",
            "--perf-no_read_workqueue",
            "--perf-no_write_workqueue",
            &d,
            &name,
        ],
        Some(key),
    )?;
    match out.status.code() {
        Some(0) => {
            let unwritten = label(dev) == UNWRITTEN;
            Ok(Opened { path, unwritten })
        }
        // 2: "No key available with this passphrase."
        Some(2) => Err(CsiError::EncryptionKeyRefused {
            device: dev.to_owned(),
        }),
        _ => Err(CsiError::Command {
            command: format!("cryptsetup open {d} {name}"),
            output: said(&out),
        }),
    }
}

/// Whether paths `a` and `b` are the same block device.
fn same_device(a: &Path, b: &Path) -> Result<bool, CsiError> {
    Ok(mount::dev_number(a)? == mount::dev_number(b)?)
}

/// LUKS2 on blank `dev`. The key is a Secret's, not a typed passphrase: argon2id is kept to
/// 64 MiB and 1 s, so that a node plugin under a memory limit can open it.
fn format(dev: &Path, key: &Key) -> Result<(), CsiError> {
    let d = dev.to_string_lossy();
    let out = cryptsetup(
        &[
            "luksFormat",
            "--type",
            "luks2",
            "--batch-mode",
            "--key-file=-",
            "--pbkdf",
            "argon2id",
            "--pbkdf-memory",
            "65536",
            "--iter-time",
            "1000",
            "--label",
            UNWRITTEN,
            &d,
        ],
        Some(key),
    )?;
    if out.status.success() {
        Ok(())
    } else {
        Err(CsiError::Command {
            command: format!("cryptsetup luksFormat {d}"),
            output: said(&out),
        })
    }
}

/// The LUKS2 header's label of `dev`; empty where it has none or blkid cannot say (blkid
/// exits 2 for a missing tag), which reads as written: the safe side, where the blank check
/// decides.
fn label(dev: &Path) -> String {
    let d = dev.to_string_lossy();
    match mount::run("blkid", &["-p", "-o", "value", "-s", "LABEL", &d]) {
        Ok(l) => l.trim().to_owned(),
        Err(e) => {
            tracing::info!(device = %d, error = %e, "no LUKS2 label read: taken as written");
            String::new()
        }
    }
}

/// Says in `dev`'s header that data may now be written through its mapping: from here on its
/// bytes are the pod's, never formatted over.
pub fn mark_written(dev: &Path) -> Result<(), CsiError> {
    let d = dev.to_string_lossy();
    mount::run("cryptsetup", &["config", "--label", WRITTEN, &d]).map(drop)
}

/// Closes volume `id`'s mapping, if it is open (after its file system is unmounted).
pub fn close(id: &str) -> Result<(), CsiError> {
    let name = mapping_name(id);
    if !is_open(id) {
        return Ok(());
    }
    let out = cryptsetup(&["close", &name], None)?;
    if out.status.success() {
        tracing::info!(volume = %id, mapping = %name, "encrypted mapping closed");
        Ok(())
    } else {
        Err(CsiError::Command {
            command: format!("cryptsetup close {name}"),
            output: said(&out),
        })
    }
}

/// Grows volume `id`'s open mapping to its device's size; LUKS2 keeps its volume key in the
/// kernel's keyring, so cryptsetup asks for the key again.
pub fn grow(id: &str, key: &Key) -> Result<(), CsiError> {
    let name = mapping_name(id);
    let out = cryptsetup(&["resize", "--key-file=-", &name], Some(key))?;
    match out.status.code() {
        Some(0) => Ok(()),
        Some(2) => Err(CsiError::EncryptionKeyRefused {
            device: mapping_path(id),
        }),
        _ => Err(CsiError::Command {
            command: format!("cryptsetup resize {name}"),
            output: said(&out),
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_or_empty_key_names_the_secret_and_no_key_is_printed() {
        let which = "csi.storage.k8s.io/node-stage-secret-name";
        for secrets in [
            HashMap::new(),
            HashMap::from([("key".to_owned(), String::new())]),
            HashMap::from([("passphrase".to_owned(), "x".to_owned())]),
        ] {
            let e = Key::from_secrets(&secrets, which).unwrap_err();
            assert!(e.to_string().contains(which), "{e}");
            assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        }
        let k = Key::from_secrets(
            &HashMap::from([("key".to_owned(), "s3cret".to_owned())]),
            which,
        )
        .unwrap();
        assert_eq!(format!("{k:?}"), "Key(..)");
    }

    #[test]
    fn the_mapping_is_named_for_the_volume_and_status_names_its_device() {
        assert_eq!(mapping_name("pvc-1"), "ublkd-pvc-1");
        assert_eq!(mapping_path("pvc-1"), Path::new("/dev/mapper/ublkd-pvc-1"));
        let status = "/dev/mapper/ublkd-pvc-1 is active and is in use.\n  type:    LUKS2\n  \
                      cipher:  aes-xts-plain64\n  keysize: 512 bits\n  key location: keyring\n  \
                      device:  /dev/ublkb3\n  sector size:  4096\n";
        assert_eq!(
            parse_status_device(status),
            Some(PathBuf::from("/dev/ublkb3"))
        );
        assert_eq!(parse_status_device("is inactive."), None);
    }
}
