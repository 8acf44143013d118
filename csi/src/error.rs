//! The driver's errors, named for what failed, and the one place they become CSI status codes
//! (the codes the CSI spec assigns to each case, which the sidecars act on: UNAVAILABLE and
//! ABORTED are retried, RESOURCE_EXHAUSTED sends the scheduler to another node).

use std::path::PathBuf;
use tonic::{Code, Status};

#[derive(Debug, thiserror::Error)]
pub enum CsiError {
    #[error("{0} is required")]
    MissingField(&'static str),
    #[error("{0}")]
    BadParameter(String),
    #[error("unsupported volume capability: {0}")]
    UnsupportedCapability(String),
    #[error("{0}")]
    OutOfRange(String),
    #[error("this node ({node}) is not among the topologies the request allows")]
    TopologyExcludesNode { node: String },
    #[error(
        "node {node} has no room for {size} bytes (the largest volume that fits: {available})"
    )]
    NoRoom {
        node: String,
        size: u64,
        available: u64,
    },
    #[error("volume {0:?} does not exist")]
    VolumeNotFound(String),
    #[error("volume {id:?} is {state}, not ready yet: try again")]
    VolumeNotReady { id: String, state: &'static str },
    #[error("volume {id:?} has failed: {message}")]
    VolumeFailed { id: String, message: String },
    #[error("volume {name:?} exists with a different size ({existing} bytes)")]
    VolumeMismatch { name: String, existing: u64 },
    #[error("an operation on volume {0:?} is already in progress")]
    OperationPending(String),
    #[error("{} is outside the kubelet directory {}", path.display(), kubelet.display())]
    PathOutsideKubelet { path: PathBuf, kubelet: PathBuf },
    #[error("{} does not exist", .0.display())]
    PathMissing(PathBuf),
    #[error("volume {id:?} is not at {}", path.display())]
    VolumeNotAtPath { id: String, path: PathBuf },
    #[error("{} holds {found}, not {wanted}: a file system is never formatted over", device.display())]
    ForeignFileSystem {
        device: PathBuf,
        found: String,
        wanted: &'static str,
    },
    #[error("volume {id:?} is single-writer and already published at {}", path.display())]
    PublishedElsewhere { id: String, path: PathBuf },
    #[error("{} already has {device} mounted, not this volume", path.display())]
    PathTaken { path: PathBuf, device: String },
    #[error("cannot read {} (nothing was written to it)", device.display())]
    DeviceUnreadable {
        device: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// No file system was recognised on the device, and its ends are not zeroes: it holds
    /// something, so it is not formatted.
    #[error(
        "{} is not blank: non-zero bytes at offset {offset}, and no file system was \
         recognised on it: it is not formatted",
        device.display()
    )]
    DeviceNotBlank { device: PathBuf, offset: u64 },
    /// No file system was recognised on the device, and one of its ends could not be read to
    /// check that it is blank (nor, likely, could blkid read it).
    #[error("{} is not formatted: its {what} could not be read", device.display())]
    BlankCheckRead {
        device: PathBuf,
        what: &'static str,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "encryption luks2 needs a key: the StorageClass's {which} must name a Secret with an \
         entry \"key\""
    )]
    EncryptionKeyMissing { which: &'static str },
    #[error("the key does not open {}: wrong key (nothing was written)", device.display())]
    EncryptionKeyRefused { device: PathBuf },
    #[error("the mapping {name} is open on {}, not on this volume's device", device.display())]
    MappingTaken { name: String, device: PathBuf },
    #[error("{command} failed: {output}")]
    Command { command: String, output: String },
    #[error("{step} {}", path.display())]
    Io {
        step: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("starting token {0:?} is not one this driver gave out")]
    BadToken(String),
    #[error(
        "{what} {id:?} does not exist on this node (a clone or a restore is made on its \
         source's node)"
    )]
    SourceNotFound { what: &'static str, id: String },
    /// The source of a clone, a restore or a snapshot cannot be copied.
    #[error("{0}")]
    SourceUnsupported(String),
    #[error("volume {name:?} exists with another content source")]
    SourceMismatch { name: String },
    #[error("snapshot {name:?} exists, of volume {source_volume:?}")]
    SnapshotMismatch { name: String, source_volume: String },
    #[error("the limits of volume {id:?} cannot be recorded on its PersistentVolume: {why}")]
    LimitsNotRecorded { id: String, why: String },
    #[error("the limits of volume {id:?} are recorded; node {node} has not applied them yet")]
    LimitsPending { id: String, node: String },
    #[error("node {node} could not apply the limits of volume {id:?}: {why}")]
    LimitsRefused {
        id: String,
        node: String,
        why: String,
    },
    #[error("cannot tell which node holds volume {id:?}: {why}")]
    NodesUnreachable { id: String, why: String },
    #[error("{0}")]
    Unimplemented(&'static str),
    #[error(transparent)]
    Ublkd(#[from] crate::ublkd::UblkdError),
}

impl CsiError {
    pub fn code(&self) -> Code {
        use CsiError as E;
        match self {
            E::MissingField(_)
            | E::BadParameter(_)
            | E::UnsupportedCapability(_)
            | E::PathOutsideKubelet { .. } => Code::InvalidArgument,
            E::OutOfRange(_) => Code::OutOfRange,
            E::TopologyExcludesNode { .. } | E::NoRoom { .. } => Code::ResourceExhausted,
            E::VolumeNotFound(_) | E::PathMissing(_) | E::VolumeNotAtPath { .. } => Code::NotFound,
            E::VolumeNotReady { .. } | E::DeviceUnreadable { .. } | E::BlankCheckRead { .. } => {
                Code::Unavailable
            }
            E::VolumeFailed { .. }
            | E::PublishedElsewhere { .. }
            | E::ForeignFileSystem { .. }
            | E::DeviceNotBlank { .. } => Code::FailedPrecondition,
            E::VolumeMismatch { .. }
            | E::PathTaken { .. }
            | E::SourceMismatch { .. }
            | E::SnapshotMismatch { .. } => Code::AlreadyExists,
            E::SourceNotFound { .. } => Code::NotFound,
            E::SourceUnsupported(_) => Code::InvalidArgument,
            E::LimitsRefused { .. } | E::EncryptionKeyMissing { .. } => Code::FailedPrecondition,
            E::LimitsNotRecorded { .. } | E::LimitsPending { .. } => Code::Unavailable,
            E::EncryptionKeyRefused { .. } => Code::PermissionDenied,
            E::MappingTaken { .. } => Code::AlreadyExists,
            E::NodesUnreachable { .. } => Code::Unavailable,
            E::OperationPending(_) | E::BadToken(_) => Code::Aborted,
            E::Command { .. } | E::Io { .. } => Code::Internal,
            E::Unimplemented(_) => Code::Unimplemented,
            // ublkd's own code says what went wrong (NOT_FOUND, RESOURCE_EXHAUSTED, ...); a
            // ublkd that cannot be reached is UNAVAILABLE, which the sidecars retry.
            E::Ublkd(crate::ublkd::UblkdError::Call(s)) => s.code(),
            E::Ublkd(crate::ublkd::UblkdError::Connect(_)) => Code::Unavailable,
        }
    }
}

impl CsiError {
    /// A ublkd error of a call that copies a source (a clone, a restore, a snapshot). ublkd's
    /// FAILED_PRECONDITION there says the source cannot be copied (no file to reflink, a file
    /// system that cannot reflink, or not the source's), which the CSI spec calls
    /// INVALID_ARGUMENT ("source incompatible or not supported"): the caller must use another
    /// source, retrying changes nothing. The driver checks first that the source is a file
    /// volume and READY, so a transient state never lands here. Other codes stay ublkd's.
    pub fn from_copy(e: crate::ublkd::UblkdError) -> CsiError {
        match e {
            crate::ublkd::UblkdError::Call(s) if s.code() == Code::FailedPrecondition => {
                CsiError::SourceUnsupported(format!("ublkd: {}", s.message()))
            }
            other => CsiError::Ublkd(other),
        }
    }
}

impl From<CsiError> for Status {
    fn from(e: CsiError) -> Status {
        let code = e.code();
        // Every refusal in the driver's own log too: the kubelet's event is cut short, and
        // "the node plugin's log says why" is what the troubleshooting guide promises.
        if code == Code::Internal {
            tracing::error!(error = %ublkd_client::cause_chain(&e), "internal error");
        } else {
            tracing::warn!(?code, error = %ublkd_client::cause_chain(&e), "call refused");
        }
        Status::new(code, ublkd_client::cause_chain(&e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_error_has_the_code_the_spec_gives_it() {
        use CsiError as E;
        let table = [
            (E::MissingField("name"), Code::InvalidArgument),
            (
                E::TopologyExcludesNode { node: "n".into() },
                Code::ResourceExhausted,
            ),
            (E::VolumeNotFound("v".into()), Code::NotFound),
            (
                E::VolumeNotReady {
                    id: "v".into(),
                    state: "recovering",
                },
                Code::Unavailable,
            ),
            (
                E::VolumeMismatch {
                    name: "v".into(),
                    existing: 1,
                },
                Code::AlreadyExists,
            ),
            (E::OperationPending("v".into()), Code::Aborted),
            (E::BadToken("x".into()), Code::Aborted),
            (E::OutOfRange("x".into()), Code::OutOfRange),
            (
                E::SourceNotFound {
                    what: "snapshot",
                    id: "s".into(),
                },
                Code::NotFound,
            ),
            (E::SourceMismatch { name: "v".into() }, Code::AlreadyExists),
            (
                E::SnapshotMismatch {
                    name: "s".into(),
                    source_volume: "v".into(),
                },
                Code::AlreadyExists,
            ),
            (
                E::LimitsRefused {
                    id: "v".into(),
                    node: "n".into(),
                    why: "not here".into(),
                },
                Code::FailedPrecondition,
            ),
            (
                E::LimitsPending {
                    id: "v".into(),
                    node: "n".into(),
                },
                Code::Unavailable,
            ),
            (
                E::EncryptionKeyRefused {
                    device: "/dev/ublkb0".into(),
                },
                Code::PermissionDenied,
            ),
            (
                E::DeviceNotBlank {
                    device: "/dev/ublkb0".into(),
                    offset: 1024,
                },
                Code::FailedPrecondition,
            ),
            (
                E::BlankCheckRead {
                    device: "/dev/ublkb0".into(),
                    what: "last MiB",
                    source: std::io::Error::from_raw_os_error(libc::EIO),
                },
                Code::Unavailable,
            ),
            (
                E::NodesUnreachable {
                    id: "v".into(),
                    why: "10.0.0.1: refused".into(),
                },
                Code::Unavailable,
            ),
            (
                E::Ublkd(crate::ublkd::UblkdError::Call(Status::resource_exhausted(
                    "full",
                ))),
                Code::ResourceExhausted,
            ),
        ];
        for (e, code) in table {
            assert_eq!(e.code(), code, "{e}");
        }
    }

    #[test]
    fn a_source_ublkd_cannot_copy_is_an_invalid_argument() {
        use crate::ublkd::UblkdError;
        let e = CsiError::from_copy(UblkdError::Call(Status::failed_precondition(
            "/srv is on ext4, which cannot reflink",
        )));
        assert_eq!(e.code(), Code::InvalidArgument);
        assert!(e.to_string().contains("cannot reflink"), "{e}");
        for code in [Code::NotFound, Code::AlreadyExists, Code::ResourceExhausted] {
            let e = CsiError::from_copy(UblkdError::Call(Status::new(code, "x")));
            assert_eq!(e.code(), code, "other codes stay ublkd's");
        }
    }
}
