//! The ublkd dataplane: everything that touches the kernel's ublk driver.
//!
//! What it is: pinned worker threads (one per CPU it is given) that own io_uring rings and serve the
//! ublk queues of every volume mapped to their CPU; the ublk control protocol on
//! `/dev/ublk-control`; and the storage backends behind each volume.
//!
//! What it is not: it knows nothing of gRPC, tokio or Prometheus. The daemon in `server/` drives it
//! through a narrow handle and reads its statistics.
//!
//! `unsafe` lives only in [`sys`] (kernel UAPI layouts and thin syscall wrappers) and the ring
//! module; every other module is safe code.
// Unsafe code only in the `sys` and `ring` modules, each block with its SAFETY comment.
#![deny(unsafe_code)]

mod backend;
mod ctrl;
mod device;
mod features;
mod handle;
mod ids;
// Fault hooks: compiled in always (each hook is a constant `false` without the feature), public
// only to the tests that arm them.
#[cfg(feature = "test-hooks")]
pub mod hooks;
#[cfg(not(feature = "test-hooks"))]
mod hooks;
mod placement;
mod poll;
mod qos;
mod reply;
#[allow(unsafe_code)]
mod ring;
pub mod stats;
#[allow(unsafe_code)]
mod sys;
mod worker;

pub use backend::{
    erase_window, find_namespace, identify_namespace, namespace_host_use, BackendError,
    BackendSpec, Erase, Growth, Namespace, NamespaceIdentity, ParseIdentityError, Window,
};
pub use ctrl::{ControlDevice, CtrlError};
pub use device::{DeviceSpec, IoPath, KernelShape, SpecError, Toggle, DEFAULT_MAX_IO_BYTES};
pub use features::Features;
pub use handle::{
    block_device, kernel_device_ids, Config, DataplaneError, DeviceInfo, DeviceStats, ErrorKind,
    Handle, KernelDevice, KernelState, WorkerSnapshot,
};
pub use ids::{DevId, QueueId, Tag};
pub use placement::{PlacementPolicy, PlacementReason, QueuePlacement};
pub use poll::{PollReason, DEDICATED_SPIN};
pub use qos::QosLimits;
pub use ring::{iowq_limits, IOWQ_MAX_BOUNDED, IOWQ_MAX_UNBOUNDED};
pub use stats::{Latency, OpKind, StatsSnapshot};

/// Bytes of the file system holding `path`: `(available, total)` (statvfs).
pub fn fs_space(path: &std::path::Path) -> std::io::Result<(u64, u64)> {
    sys::os::fs_space(path)
}
