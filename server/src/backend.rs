//! Each backend kind as the server holds it, in one file: its record (the registry's `backend`),
//! made from a request (checked here), and what it becomes: the dataplane's spec, the API's
//! form, `ublkd run`'s spec, its pool. A new kind is a variant of [`BackendRecord`] (and, with
//! a pool, of [`Pool`]); the compiler then stops at each of this file's matches, and at
//! `capacity`'s measure of a pool.

use crate::config::Settings;
use crate::error::{truncate, VolumeError};
use serde::{Deserialize, Serialize};
use std::path::{Component, Path, PathBuf};
use ublkd_dataplane::{BackendSpec, Window};
use ublkd_proto::v1;
use ublkd_proto::v1::get_capacity_request::Backend as CapacityRequest;
use ublkd_proto::v1::volume_spec::Backend as Request;

/// The longest path accepted (PATH_MAX, counting the terminating NUL).
pub const MAX_PATH_BYTES: usize = 4095;

/// A volume's backend as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BackendRecord {
    Null,
    Ram,
    File {
        path: PathBuf,
        create: bool,
    },
    /// An NVMe namespace char device; `length` 0 means to the end of the namespace.
    Nvme {
        device: PathBuf,
        offset: u64,
        length: u64,
        /// Served as found: never erased at creation or growth (absent in older records).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        keep_data: bool,
        /// The namespace's identity, read by Identify at create (absent in records written
        /// before it was kept, and filled in at their first restore): `device` is only the
        /// name this boot gave it. Nothing is served or erased on a namespace of another
        /// identity.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        identity: Option<ublkd_dataplane::NamespaceIdentity>,
    },
}

impl BackendRecord {
    /// Its kind, whose name is the record's `kind` tag (a test holds the two together).
    pub fn kind(&self) -> ublkd_proto::BackendKind {
        use ublkd_proto::BackendKind as K;
        match self {
            BackendRecord::Null => K::Null,
            BackendRecord::Ram => K::Ram,
            BackendRecord::File { .. } => K::File,
            BackendRecord::Nvme { .. } => K::Nvme,
        }
    }

    /// A record of `kind`, for the tests that go over every kind.
    #[cfg(test)]
    pub fn example(kind: ublkd_proto::BackendKind) -> BackendRecord {
        use ublkd_proto::BackendKind as K;
        match kind {
            K::Null => BackendRecord::Null,
            K::Ram => BackendRecord::Ram,
            K::File => BackendRecord::File {
                path: "/srv/v.img".into(),
                create: false,
            },
            K::Nvme => BackendRecord::Nvme {
                device: "/dev/ng0n1".into(),
                offset: 1 << 20,
                length: 1 << 20,
                keep_data: false,
                identity: None,
            },
        }
    }

    /// The record a CreateVolume's `backend` asks for, checked against the node's settings.
    pub fn from_request(b: Option<&Request>, s: &Settings) -> Result<BackendRecord, VolumeError> {
        let invalid = |m: String| Err(VolumeError::ValidateRequest(m));
        Ok(match b {
            None => {
                return invalid(format!(
                    "backend is required: {}",
                    ublkd_proto::BackendKind::all_names()
                ))
            }
            Some(Request::Null(_)) => BackendRecord::Null,
            Some(Request::Ram(_)) => BackendRecord::Ram,
            Some(Request::File(f)) => BackendRecord::File {
                path: backing_path(&f.path, f.create, &s.allowed_roots)?,
                create: f.create,
            },
            Some(Request::Nvme(n)) => {
                // A namespace named by its identity alone: the volume manager finds its device.
                let device = match (n.device.as_str(), n.identity.as_str()) {
                    ("", id) if !id.is_empty() => PathBuf::new(),
                    (device, _) => nvme_device(device)?,
                };
                if n.offset_bytes
                    .unwrap_or(0)
                    .checked_add(n.length_bytes)
                    .is_none()
                {
                    return invalid("nvme window offset + length overflows".into());
                }
                if n.keep_data && !s.limits.allow_keep_data {
                    return Err(VolumeError::AdmitKeepData);
                }
                let identity = match n.identity.as_str() {
                    "" => None,
                    text => Some(text.parse().map_err(
                        |e: ublkd_dataplane::ParseIdentityError| {
                            VolumeError::ValidateRequest(e.to_string())
                        },
                    )?),
                };
                BackendRecord::Nvme {
                    device,
                    // Unset: placed by the volume manager (`places_window`).
                    offset: n.offset_bytes.unwrap_or(0),
                    length: n.length_bytes,
                    keep_data: n.keep_data,
                    identity,
                }
            }
        })
    }

    /// The dataplane's backend that serves it; a RAM volume keeps its pages in `ram_file`.
    pub fn spec(&self, ram_file: PathBuf) -> BackendSpec {
        match self {
            BackendRecord::Null => BackendSpec::Null,
            BackendRecord::Ram => BackendSpec::Ram {
                path: Some(ram_file),
            },
            BackendRecord::File { path, .. } => BackendSpec::File { path: path.clone() },
            BackendRecord::Nvme {
                device,
                offset,
                length,
                keep_data,
                // Checked against the path before anything is served (`volumes::namespace`);
                // the kernel is given the path.
                identity: _,
            } => BackendSpec::Nvme {
                path: device.clone(),
                window: (*offset != 0 || *length != 0).then_some(Window {
                    offset: *offset,
                    len: *length,
                }),
                keep_data: *keep_data,
            },
        }
    }

    /// Its API form.
    pub fn proto(&self) -> Request {
        match self {
            BackendRecord::Null => Request::Null(v1::NullBackend {}),
            BackendRecord::Ram => Request::Ram(v1::RamBackend {}),
            BackendRecord::File { path, create } => Request::File(v1::FileBackend {
                path: path.display().to_string(),
                create: *create,
            }),
            BackendRecord::Nvme {
                device,
                offset,
                length,
                keep_data,
                identity,
            } => Request::Nvme(v1::NvmeBackend {
                device: device.display().to_string(),
                offset_bytes: Some(*offset),
                length_bytes: *length,
                keep_data: *keep_data,
                identity: identity
                    .as_ref()
                    .map(ToString::to_string)
                    .unwrap_or_default(),
            }),
        }
    }

    /// The pool it takes its bytes from, where the node watches one per volume (a namespace:
    /// the allowed roots and the RAM directory are pools whether used or not).
    pub fn own_pool(&self) -> Option<Pool> {
        match self {
            BackendRecord::Nvme { device, .. } => Some(Pool::Nvme(device.clone())),
            BackendRecord::Null | BackendRecord::Ram | BackendRecord::File { .. } => None,
        }
    }
}

/// The dataplane spec `ublkd run` serves for a backend of the API, with no registry: RAM in
/// anonymous memory, an NVMe window of length 0 to `size`; None for an NVMe window with no
/// offset (nothing places it).
pub fn run_spec(b: &Request, size: u64) -> Option<BackendSpec> {
    Some(match b {
        Request::Null(_) => BackendSpec::Null,
        Request::Ram(_) => BackendSpec::Ram { path: None },
        Request::File(f) => BackendSpec::File {
            path: f.path.clone().into(),
        },
        Request::Nvme(n) => BackendSpec::Nvme {
            path: n.device.clone().into(),
            window: match (n.offset_bytes?, n.length_bytes) {
                (0, 0) => None,
                (offset, len) => Some(Window {
                    offset,
                    len: if len == 0 { size } else { len },
                }),
            },
            keep_data: false,
        },
    })
}

/// One pool new volumes take their bytes from: what GetCapacity measures, and what the
/// `ublkd_capacity_*` metrics report, one series each.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pool {
    /// A file system holding backing files: one of the allowed roots.
    File(std::path::PathBuf),
    /// The RAM directory.
    Ram,
    /// An NVMe namespace, by its generic char device.
    Nvme(std::path::PathBuf),
}

impl Pool {
    /// Its backend kind (the metrics label it by its name).
    pub fn kind(&self) -> ublkd_proto::BackendKind {
        use ublkd_proto::BackendKind as K;
        match self {
            Pool::File(_) => K::File,
            Pool::Ram => K::Ram,
            Pool::Nvme(_) => K::Nvme,
        }
    }

    /// Where it is: the root, the RAM directory or the namespace's device.
    pub fn place<'a>(&'a self, settings: &'a crate::config::Settings) -> &'a Path {
        match self {
            Pool::File(p) | Pool::Nvme(p) => p,
            Pool::Ram => &settings.ram_dir,
        }
    }

    /// The pool a GetCapacity request names: a root by its path inside the allowed roots, the
    /// RAM directory, a namespace by path or by identity (a StorageClass may name it so on
    /// every node).
    pub fn of_request(b: Option<&CapacityRequest>, s: &Settings) -> Result<Pool, VolumeError> {
        Ok(match b {
            None => {
                return Err(VolumeError::ValidateRequest(format!(
                    "backend is required: {}",
                    ublkd_proto::BackendKind::pool_names()
                )))
            }
            Some(CapacityRequest::File(f)) => Pool::File(capacity_root(&f.root, &s.allowed_roots)?),
            Some(CapacityRequest::Ram(_)) => Pool::Ram,
            Some(CapacityRequest::Nvme(n)) => {
                match n.device.parse::<ublkd_dataplane::NamespaceIdentity>() {
                    Ok(id) => Pool::Nvme(
                        ublkd_dataplane::find_namespace(&id)
                            .ok_or(VolumeError::NamespaceNotFound(id))?,
                    ),
                    Err(_) => Pool::Nvme(nvme_device(&n.device)?),
                }
            }
        })
    }
}

/// An NVMe namespace's char device: an absolute path under /dev.
pub fn nvme_device(raw: &str) -> Result<PathBuf, VolumeError> {
    let device = PathBuf::from(raw);
    if raw.len() > MAX_PATH_BYTES || !device.is_absolute() || !device.starts_with("/dev") {
        return Err(VolumeError::ValidateRequest(format!(
            "nvme device {:?} must be a path under /dev, e.g. /dev/ng0n1",
            truncate(raw)
        )));
    }
    Ok(device)
}

/// Resolves the directory a capacity query names: absolute, no `..`, an existing directory
/// inside one of `roots` after following symlinks.
pub fn capacity_root(raw: &str, roots: &[PathBuf]) -> Result<PathBuf, VolumeError> {
    let shown = truncate(raw);
    let path = Path::new(raw);
    if raw.is_empty() || raw.len() > MAX_PATH_BYTES || !path.is_absolute() {
        return Err(VolumeError::ValidateRequest(format!(
            "root {shown:?} must be an absolute path"
        )));
    }
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(VolumeError::ValidateRequest(format!(
            "root {shown:?} must not contain '..'"
        )));
    }
    let Ok(real) = path.canonicalize() else {
        return Err(VolumeError::BackingPathMissing(format!(
            "root {shown:?} does not exist"
        )));
    };
    let inside = roots
        .iter()
        .filter_map(|r| r.canonicalize().ok())
        .any(|r| real.starts_with(r));
    if !inside {
        return Err(VolumeError::BackingPathOutsideRoots(shown));
    }
    if !real.is_dir() {
        return Err(VolumeError::ValidateRequest(format!(
            "root {shown:?} is not a directory"
        )));
    }
    Ok(real)
}

/// Resolves a backing-file path: absolute, no `..`, and after following symlinks inside one of
/// `roots`. A missing file is accepted only with `create`, and then its directory must resolve
/// inside a root. Returns the resolved path.
pub fn backing_path(raw: &str, create: bool, roots: &[PathBuf]) -> Result<PathBuf, VolumeError> {
    let invalid = |m: String| Err(VolumeError::ValidateRequest(m));
    if raw.len() > MAX_PATH_BYTES {
        return invalid(format!(
            "backing path of {} bytes is longer than {MAX_PATH_BYTES}: {:?}",
            raw.len(),
            truncate(raw)
        ));
    }
    let shown = truncate(raw);
    let raw_full = raw;
    let raw = shown.as_str();
    let path = Path::new(raw_full);
    if raw_full.is_empty() || !path.is_absolute() {
        return invalid(format!("backing path {raw:?} must be absolute"));
    }
    if path.components().any(|c| matches!(c, Component::ParentDir)) {
        return invalid(format!("backing path {raw:?} must not contain '..'"));
    }
    let roots: Vec<PathBuf> = roots.iter().filter_map(|r| r.canonicalize().ok()).collect();
    let inside = |p: &Path| roots.iter().any(|r| p.starts_with(r));
    let outside = || Err(VolumeError::BackingPathOutsideRoots(raw.to_owned()));
    // Snapshots' copies live there: a volume over one would write into a snapshot.
    let in_snapshots = |p: &Path| {
        p.components()
            .any(|c| c.as_os_str() == crate::snapshot::SNAPSHOT_DIR)
    };
    let snapshot_dir = || {
        invalid(format!(
            "backing path {raw:?} is inside a {} directory, which holds snapshots",
            crate::snapshot::SNAPSHOT_DIR
        ))
    };
    if in_snapshots(path) {
        return snapshot_dir();
    }
    match path.canonicalize() {
        Ok(real) => {
            if in_snapshots(&real) {
                snapshot_dir()
            } else if inside(&real) {
                Ok(real)
            } else {
                outside()
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
                return invalid(format!("backing path {raw:?} has no file name"));
            };
            let Ok(parent) = parent.canonicalize() else {
                return Err(VolumeError::BackingPathMissing(format!(
                    "directory of backing path {raw:?} does not exist"
                )));
            };
            if !inside(&parent) {
                return outside();
            }
            if in_snapshots(&parent) {
                return snapshot_dir();
            }
            if path.symlink_metadata().is_ok() {
                // A dangling symlink: where it would point is unknown territory.
                return outside();
            }
            if !create {
                return Err(VolumeError::BackingPathMissing(format!(
                    "backing file {raw:?} does not exist (set create to make it)"
                )));
            }
            Ok(parent.join(name))
        }
        Err(e) => invalid(format!("backing path {raw:?}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every kind is stored under its own name, reaches the dataplane as the backend of its
    /// name, and goes back to the API as the `oneof` field of that name.
    #[test]
    fn each_kind_is_served_and_reported_as_itself() {
        for kind in ublkd_proto::BackendKind::ALL {
            let record = BackendRecord::example(kind);
            assert_eq!(record.kind(), kind);
            let spec = record.spec(PathBuf::from("/dev/shm/ublkd/v.ram"));
            assert_eq!(spec.kind(), kind.name());
            assert_eq!(ublkd_proto::BackendKind::of(&record.proto()), kind);
            // The registry's `kind` tag is the kind's one name.
            let json = serde_json::to_value(&record).unwrap();
            assert_eq!(json["kind"], kind.name(), "{json}");
        }
    }

    /// `ublkd run` serves every kind as the dataplane's backend of its name; an NVMe window
    /// of length 0 runs to the device's size, and one with no offset has nothing to place it.
    #[test]
    fn ublkd_run_serves_each_kind_and_places_no_window() {
        for kind in ublkd_proto::BackendKind::ALL {
            let b = BackendRecord::example(kind).proto();
            let spec = run_spec(&b, 1 << 20).map(|s| s.kind());
            assert_eq!(spec, Some(kind.name()), "{b:?}");
        }
        let nvme = |offset, len| {
            let n = v1::NvmeBackend {
                device: "/dev/ng0n1".into(),
                offset_bytes: offset,
                length_bytes: len,
                keep_data: false,
                identity: String::new(),
            };
            match run_spec(&Request::Nvme(n), 1 << 20) {
                Some(BackendSpec::Nvme { window, .. }) => Some(window.map(|w| (w.offset, w.len))),
                _ => None,
            }
        };
        assert_eq!(nvme(Some(0), 0), Some(None));
        assert_eq!(nvme(Some(4096), 0), Some(Some((4096, 1 << 20))));
        assert_eq!(nvme(Some(4096), 8192), Some(Some((4096, 8192))));
        assert_eq!(nvme(None, 8192), None);
    }
}
