//! The dataplane's errors, named for the step that failed, and the classes callers act on.

use crate::backend::BackendError;
use crate::ctrl::CtrlError;
use crate::device::SpecError;
use crate::features::Features;
use crate::ids::{DevId, QueueId};
use crate::ring::RingError;
use crate::worker::WorkerError;
use std::path::PathBuf;

/// The error classes callers act on; the server maps them to gRPC codes in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    Internal,
}

/// Errors of the dataplane's control surface, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("invalid device spec")]
    Spec(#[from] SpecError),
    #[error("opening the backend failed")]
    Backend(#[from] BackendError),
    #[error("ublk control command failed")]
    Ctrl(#[from] CtrlError),
    #[error("the ublk driver offers no user recovery (missing {missing}): a device would not outlive a restart of its server")]
    NoUserRecovery {
        features: Features,
        missing: Features,
    },
    #[error("the kernel granted flags {granted:#x}, missing {missing:#x}")]
    FlagsRefused { granted: u64, missing: u64 },
    #[error("cannot open {path}")]
    OpenCharDevice {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("worker could not attach queue {q_id}")]
    Attach {
        q_id: QueueId,
        #[source]
        source: WorkerError,
    },
    #[error("worker did not answer the attach of queue {q_id} in time")]
    AttachTimeout { q_id: QueueId },
    #[error("the previous server of device {0} did not let go in time")]
    ReleaseTimeout(DevId),
    #[error("device {0} is half taken over and a queue is stuck in the kernel: the next ublkd start takes it over")]
    RecoveryStuck(DevId),
    #[error("no device {0}")]
    NoSuchDevice(DevId),
    #[error("queues of device {0} did not stop within the timeout")]
    StopTimeout(DevId),
    #[error("the workers did not confirm device {0} drained within the timeout; it was resumed")]
    DrainTimeout(DevId),
    #[error("cannot start worker threads")]
    Spawn(#[source] std::io::Error),
    #[error("the dataplane has shut down")]
    Gone,
    #[error(
        "the control thread did not answer a read within {0:?}: it is busy with a slow command"
    )]
    ControlBusy(std::time::Duration),
    #[error("device {dev_id} is still served by process {pid}")]
    Busy { dev_id: DevId, pid: i32 },
    #[error("device {0} is already served by this process")]
    AlreadyOwned(DevId),
    #[error("device {dev_id} cannot be recovered: {why}")]
    NotRecoverable { dev_id: DevId, why: String },
    #[error("bytes {start}..{end} of {path} are already used by device {dev_id}")]
    Overlap {
        path: PathBuf,
        start: u64,
        end: u64,
        dev_id: DevId,
    },
}

impl DataplaneError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            DataplaneError::Spec(SpecError::Unsupported(_)) => ErrorKind::FailedPrecondition,
            DataplaneError::Spec(_) => ErrorKind::InvalidArgument,
            DataplaneError::Backend(BackendError::Memory { .. }) => ErrorKind::ResourceExhausted,
            DataplaneError::Backend(BackendError::CannotErase { .. }) => {
                ErrorKind::FailedPrecondition
            }
            DataplaneError::Backend(BackendError::EraseFailed { .. }) => ErrorKind::Unavailable,
            DataplaneError::Backend(BackendError::CannotGrow { .. }) => {
                ErrorKind::FailedPrecondition
            }
            DataplaneError::Backend(BackendError::Open { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                ErrorKind::NotFound
            }
            DataplaneError::Backend(_) => ErrorKind::InvalidArgument,
            DataplaneError::Ctrl(CtrlError::Open { .. })
            | DataplaneError::NoUserRecovery { .. } => ErrorKind::FailedPrecondition,
            DataplaneError::Ctrl(CtrlError::Timeout { .. }) => ErrorKind::Unavailable,
            DataplaneError::NoSuchDevice(_) => ErrorKind::NotFound,
            DataplaneError::Busy { .. } | DataplaneError::NotRecoverable { .. } => {
                ErrorKind::FailedPrecondition
            }
            DataplaneError::AlreadyOwned(_) => ErrorKind::AlreadyExists,
            DataplaneError::Overlap { .. } => ErrorKind::FailedPrecondition,
            DataplaneError::Attach {
                source: WorkerError::Full | WorkerError::Ring(RingError::NoFixedSlot),
                ..
            } => ErrorKind::ResourceExhausted,
            DataplaneError::Gone
            | DataplaneError::ControlBusy(_)
            | DataplaneError::ReleaseTimeout(_)
            | DataplaneError::AttachTimeout { .. }
            | DataplaneError::DrainTimeout(_) => ErrorKind::Unavailable,
            DataplaneError::RecoveryStuck(_) => ErrorKind::FailedPrecondition,
            // What no caller can correct: the kernel or this process went wrong.
            DataplaneError::Ctrl(
                CtrlError::Ring(_) | CtrlError::Command { .. } | CtrlError::ShortReply { .. },
            )
            | DataplaneError::FlagsRefused { .. }
            | DataplaneError::OpenCharDevice { .. }
            | DataplaneError::Attach { .. }
            | DataplaneError::StopTimeout(_)
            | DataplaneError::Spawn(_) => ErrorKind::Internal,
        }
    }
}
