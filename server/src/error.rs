//! The server's errors, and the one place where they become gRPC statuses.

use crate::registry::RegistryError;
use crate::snapshot::SnapshotId;
use crate::volume_id::{BadVolumeId, VolumeId};
use std::path::PathBuf;
use tonic::{Code, Status};
use ublkd_dataplane::{DataplaneError, DevId, ErrorKind};

/// What of a client's string is echoed in an error or a log line: at most 80 characters.
pub fn truncate(s: &str) -> String {
    let mut out: String = s.chars().take(80).collect();
    if out.len() < s.len() {
        out.push('…');
    }
    out
}

/// Errors of volume operations, named for the step that failed; `code()` below is the one
/// place they become gRPC codes.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// The request broke a rule of the API (the message names the field).
    #[error("{0}")]
    ValidateRequest(String),
    #[error(transparent)]
    ValidateVolumeId(#[from] BadVolumeId),
    #[error("backing path {0:?} is outside the allowed roots")]
    BackingPathOutsideRoots(String),
    /// The backing path, or its directory, does not exist (the message says which).
    #[error("{0}")]
    BackingPathMissing(String),
    #[error("volume {0:?} does not exist")]
    LookupVolume(VolumeId),
    #[error(
        "no orphan ublk device {0} (devices of registered volumes are deleted with DeleteVolume)"
    )]
    LookupOrphan(DevId),
    #[error("volume {0:?} already exists with a different spec")]
    CreateConflict(VolumeId),
    #[error("volume {0:?} already exists")]
    AdoptConflict(VolumeId),
    #[error("the node already has {0} volumes, the configured maximum")]
    AdmitVolumeLimit(usize),
    #[error(
        "the volume may hold {need} bytes of ublkd's memory (copy buffers, RAM pages) and {left} \
         are left under ublkd's memory limit: raise the limit, or ask for fewer queues, a \
         smaller depth or a smaller RAM volume"
    )]
    AdmitMemoryLimit { need: u64, left: u64 },
    #[error(
        "growing needs {need} bytes and {left} are left in {} after what its volumes may \
         still write",
        root.display()
    )]
    AdmitFileSpace { root: PathBuf, need: u64, left: u64 },
    #[error("backing file {} is in use by volume {by:?}", path.display())]
    AdmitBackingInUse { path: PathBuf, by: VolumeId },
    #[error(
        "bytes {start}..{end} of {} are already used by volume {by:?} (its record owns them, \
         whatever its state)",
        device.display()
    )]
    AdmitWindowOverlap {
        device: PathBuf,
        start: u64,
        end: u64,
        by: VolumeId,
    },
    #[error(
        "keep_data is not allowed on this node (limits.allow_keep_data): a new window's earlier \
         blocks are always erased"
    )]
    AdmitKeepData,
    #[error("no free extent of {} holds a window of {len} bytes", device.display())]
    AdmitNoExtent { device: PathBuf, len: u64 },
    #[error(
        "window {offset}+{len} runs past the end of {} ({namespace} bytes) or is smaller than the volume",
        device.display()
    )]
    AdmitWindowPastEnd {
        device: PathBuf,
        offset: u64,
        len: u64,
        namespace: u64,
    },
    #[error(
        "erase of bytes {from}..{to} of {} for volume {id:?} refused: {why}",
        device.display()
    )]
    EraseOutsideClaim {
        id: VolumeId,
        device: PathBuf,
        from: u64,
        to: u64,
        why: &'static str,
    },
    #[error(
        "{} is namespace {found}, not the volume's namespace {recorded} (NVMe names follow probe \
         order and can change at boot): nothing was served or erased there",
        device.display()
    )]
    NamespaceIdentity {
        device: PathBuf,
        recorded: ublkd_dataplane::NamespaceIdentity,
        found: String,
    },
    #[error(
        "{} looks like the host's own disk ({why}): no volume takes a window of it unless \
         limits.allow_used_namespaces lists it",
        device.display()
    )]
    NamespaceInUse { device: PathBuf, why: String },
    #[error("no NVMe namespace of this node has identity {0}")]
    NamespaceNotFound(ublkd_dataplane::NamespaceIdentity),
    #[error("no free ublk device id")]
    AllocateDevId,
    #[error("backing file {}", path.display())]
    PrepareBackingFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("backing file {} holds {len} bytes, fewer than {size}", path.display())]
    GrowBackingFile { path: PathBuf, len: u64, size: u64 },
    #[error("volume {id:?} is {from} bytes: shrinking to {to} is refused (it would cut off data)")]
    ResizeShrink { id: VolumeId, from: u64, to: u64 },
    #[error(
        "volume {id:?} is busy: {} is held (mounted, in some mount namespace, or opened \
         exclusively); unmount it first",
        device.display()
    )]
    DeleteBusy { id: VolumeId, device: PathBuf },
    #[error(
        "volume {id:?} is open: {} is held by {by} (a raw-block user, without O_EXCL); stop it \
         first, or delete with force",
        device.display()
    )]
    DeleteOpen {
        id: VolumeId,
        device: PathBuf,
        by: String,
    },
    #[error("cannot read the free space of {}", path.display())]
    ReadCapacity {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot remove backing file {}", path.display())]
    RemoveBackingFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The volume has no device to act on (it is not READY).
    #[error("volume {id:?} has no device ({state})")]
    NotServing { id: VolumeId, state: &'static str },
    #[error("no usable ublk driver (modprobe ublk_drv; user recovery needed): {0}")]
    OpenDataplane(String),
    #[error("dataplane")]
    Dataplane(#[from] DataplaneError),
    #[error("registry")]
    Registry(#[from] RegistryError),
    #[error("dataplane task failed: {0}")]
    JoinDataplaneTask(String),
    #[error("volume task failed: {0}")]
    JoinVolumeTask(String),
    #[error("snapshot {0} does not exist")]
    LookupSnapshot(SnapshotId),
    #[error("snapshot {id} already exists, of volume {source_volume:?}")]
    SnapshotConflict {
        id: SnapshotId,
        source_volume: VolumeId,
    },
    #[error(
        "volume {id:?} is a {backend} volume: snapshots and clones are of file volumes only \
         (RAM and NVMe volumes have no file to reflink)"
    )]
    SnapshotBackend { id: VolumeId, backend: &'static str },
    #[error(
        "{} is on {fs}, which cannot reflink: snapshots and clones need a file system that \
         shares blocks (XFS made with reflink=1, btrfs) with source and copy on the same one; \
         nothing was copied",
        dir.display()
    )]
    ReflinkUnsupported {
        dir: PathBuf,
        fs: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error("backing file {} of the clone already exists", path.display())]
    CloneTargetExists { path: PathBuf },
    #[error("a clone of {source_size} bytes cannot be a volume of {size} bytes (smaller)")]
    CloneTooSmall { size: u64, source_size: u64 },
    #[error("cannot make the copy {}", path.display())]
    WriteSnapshot {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("a deadline of {0:?} leaves no time to do the work; nothing was changed")]
    CheckDeadline(std::time::Duration),
}

impl VolumeError {
    /// The gRPC code a client gets for this error.
    pub fn code(&self) -> Code {
        use VolumeError as E;
        match self {
            E::ValidateRequest(_) | E::ValidateVolumeId(_) => Code::InvalidArgument,
            E::BackingPathOutsideRoots(_) => Code::PermissionDenied,
            E::BackingPathMissing(_) | E::LookupVolume(_) | E::LookupOrphan(_) => Code::NotFound,
            E::CreateConflict(_) | E::AdoptConflict(_) | E::SnapshotConflict { .. } => {
                Code::AlreadyExists
            }
            E::LookupSnapshot(_) => Code::NotFound,
            E::CloneTooSmall { .. } => Code::InvalidArgument,
            E::AdmitWindowPastEnd { .. } => Code::InvalidArgument,
            E::AdmitKeepData => Code::PermissionDenied,
            E::SnapshotBackend { .. }
            | E::ReflinkUnsupported { .. }
            | E::CloneTargetExists { .. } => Code::FailedPrecondition,
            E::WriteSnapshot { .. } => Code::Internal,
            E::AdmitVolumeLimit(_)
            | E::AdmitMemoryLimit { .. }
            | E::AdmitFileSpace { .. }
            | E::AllocateDevId
            | E::AdmitNoExtent { .. } => Code::ResourceExhausted,
            E::AdmitBackingInUse { .. }
            | E::AdmitWindowOverlap { .. }
            | E::PrepareBackingFile { .. }
            | E::GrowBackingFile { .. }
            | E::ResizeShrink { .. }
            | E::DeleteBusy { .. }
            | E::DeleteOpen { .. }
            | E::NamespaceIdentity { .. }
            | E::NamespaceNotFound(_)
            | E::NamespaceInUse { .. }
            | E::NotServing { .. }
            | E::OpenDataplane(_) => Code::FailedPrecondition,
            E::Dataplane(e) => dataplane_code(e.kind()),
            E::Registry(_)
            | E::JoinDataplaneTask(_)
            | E::JoinVolumeTask(_)
            | E::RemoveBackingFile { .. }
            | E::EraseOutsideClaim { .. }
            | E::ReadCapacity { .. } => Code::Internal,
            E::CheckDeadline(_) => Code::DeadlineExceeded,
        }
    }
}

/// The gRPC code for each kind of dataplane error.
fn dataplane_code(kind: ErrorKind) -> Code {
    match kind {
        ErrorKind::InvalidArgument => Code::InvalidArgument,
        ErrorKind::NotFound => Code::NotFound,
        ErrorKind::AlreadyExists => Code::AlreadyExists,
        ErrorKind::FailedPrecondition => Code::FailedPrecondition,
        ErrorKind::ResourceExhausted => Code::ResourceExhausted,
        ErrorKind::Unavailable => Code::Unavailable,
        ErrorKind::Internal => Code::Internal,
    }
}

/// An error and its causes, joined: what a person needs to act on it.
pub fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        let msg = s.to_string();
        if !out.ends_with(&msg) {
            out.push_str(": ");
            out.push_str(&msg);
        }
        cur = s.source();
    }
    out
}

/// The longest status message sent: it travels in an HTTP/2 header, and a client's oversized
/// input echoed whole would break the response ("h2 protocol error") instead of explaining it.
pub const MAX_MESSAGE_BYTES: usize = 1024;

/// `m` cut to [`MAX_MESSAGE_BYTES`] at a character boundary.
pub fn bounded(mut m: String) -> String {
    if m.len() > MAX_MESSAGE_BYTES {
        let mut end = MAX_MESSAGE_BYTES - 3;
        while !m.is_char_boundary(end) {
            end -= 1;
        }
        m.truncate(end);
        m.push('…');
    }
    m
}

impl From<VolumeError> for Status {
    fn from(e: VolumeError) -> Status {
        let code = e.code();
        let message = bounded(chain(&e));
        if code == Code::Internal {
            tracing::error!(error = %message, "internal error");
        }
        Status::new(code, message)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(s: &str) -> VolumeId {
        VolumeId::parse(s).unwrap()
    }

    fn snap(s: &str) -> SnapshotId {
        SnapshotId::parse(s).unwrap()
    }

    #[test]
    fn errors_map_to_codes_and_keep_their_cause() {
        let s: Status = VolumeError::LookupVolume(id("x")).into();
        assert_eq!(s.code(), Code::NotFound);
        assert_eq!(s.message(), "volume \"x\" does not exist");
        let io = std::io::Error::from_raw_os_error(2);
        let s: Status = VolumeError::PrepareBackingFile {
            path: "/v.img".into(),
            source: io,
        }
        .into();
        assert_eq!(s.code(), Code::FailedPrecondition);
        assert!(s.message().starts_with("backing file /v.img: No such file"));
        let s: Status = VolumeError::from(ublkd_dataplane::DataplaneError::Spec(
            ublkd_dataplane::SpecError::SizeZero,
        ))
        .into();
        assert_eq!(s.code(), Code::InvalidArgument);
    }

    #[test]
    fn every_error_has_its_code() {
        let io = || std::io::Error::from_raw_os_error(5);
        use VolumeError as E;
        let table: Vec<(VolumeError, Code)> = vec![
            (E::ValidateRequest("x".into()), Code::InvalidArgument),
            (
                E::ValidateVolumeId(BadVolumeId("X".into())),
                Code::InvalidArgument,
            ),
            (
                E::BackingPathOutsideRoots("/etc".into()),
                Code::PermissionDenied,
            ),
            (E::BackingPathMissing("x".into()), Code::NotFound),
            (E::LookupVolume(id("v")), Code::NotFound),
            (E::LookupOrphan(DevId(3)), Code::NotFound),
            (E::CreateConflict(id("v")), Code::AlreadyExists),
            (E::AdoptConflict(id("v")), Code::AlreadyExists),
            (E::AdmitVolumeLimit(9), Code::ResourceExhausted),
            (
                E::AdmitMemoryLimit { need: 2, left: 1 },
                Code::ResourceExhausted,
            ),
            (E::AllocateDevId, Code::ResourceExhausted),
            (
                E::AdmitBackingInUse {
                    path: "/v".into(),
                    by: id("w"),
                },
                Code::FailedPrecondition,
            ),
            (
                E::PrepareBackingFile {
                    path: "/v".into(),
                    source: io(),
                },
                Code::FailedPrecondition,
            ),
            (
                E::GrowBackingFile {
                    path: "/v".into(),
                    len: 1,
                    size: 2,
                },
                Code::FailedPrecondition,
            ),
            (
                E::ResizeShrink {
                    id: id("v"),
                    from: 2,
                    to: 1,
                },
                Code::FailedPrecondition,
            ),
            (
                E::DeleteBusy {
                    id: id("v"),
                    device: "/dev/ublkb0".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                E::RemoveBackingFile {
                    path: "/v".into(),
                    source: io(),
                },
                Code::Internal,
            ),
            (
                E::NotServing {
                    id: id("v"),
                    state: "failed",
                },
                Code::FailedPrecondition,
            ),
            (E::OpenDataplane("x".into()), Code::FailedPrecondition),
            (
                E::Registry(RegistryError::Write {
                    kind: "volume",
                    id: "v".into(),
                    source: io(),
                }),
                Code::Internal,
            ),
            (E::LookupSnapshot(snap("s")), Code::NotFound),
            (
                E::SnapshotConflict {
                    id: snap("s"),
                    source_volume: id("v"),
                },
                Code::AlreadyExists,
            ),
            (
                E::SnapshotBackend {
                    id: id("v"),
                    backend: "ram",
                },
                Code::FailedPrecondition,
            ),
            (
                E::ReflinkUnsupported {
                    dir: "/srv".into(),
                    fs: "ext4",
                    source: io(),
                },
                Code::FailedPrecondition,
            ),
            (
                E::CloneTargetExists { path: "/v".into() },
                Code::FailedPrecondition,
            ),
            (
                E::CloneTooSmall {
                    size: 1,
                    source_size: 2,
                },
                Code::InvalidArgument,
            ),
            (
                E::WriteSnapshot {
                    path: "/s".into(),
                    source: io(),
                },
                Code::Internal,
            ),
            (E::JoinDataplaneTask("x".into()), Code::Internal),
            (E::JoinVolumeTask("x".into()), Code::Internal),
            (
                E::ReadCapacity {
                    path: "/srv".into(),
                    source: io(),
                },
                Code::Internal,
            ),
            (
                E::CheckDeadline(std::time::Duration::from_nanos(1)),
                Code::DeadlineExceeded,
            ),
        ];
        for (e, code) in table {
            assert_eq!(e.code(), code, "{e:?}");
            assert_eq!(Status::from(e).code(), code);
        }
        let kinds = [
            (ErrorKind::InvalidArgument, Code::InvalidArgument),
            (ErrorKind::NotFound, Code::NotFound),
            (ErrorKind::AlreadyExists, Code::AlreadyExists),
            (ErrorKind::FailedPrecondition, Code::FailedPrecondition),
            (ErrorKind::ResourceExhausted, Code::ResourceExhausted),
            (ErrorKind::Unavailable, Code::Unavailable),
            (ErrorKind::Internal, Code::Internal),
        ];
        for (kind, code) in kinds {
            assert_eq!(dataplane_code(kind), code, "{kind:?}");
        }
    }

    #[test]
    fn messages_are_bounded() {
        let long = "é".repeat(5000);
        let s: Status = VolumeError::ValidateRequest(long).into();
        assert!(
            s.message().len() <= MAX_MESSAGE_BYTES,
            "{}",
            s.message().len()
        );
        assert!(s.message().ends_with('…'));
    }
}
