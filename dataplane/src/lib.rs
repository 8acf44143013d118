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

pub mod backend;
pub mod ctrl;
pub mod device;
pub mod features;
pub mod handle;
pub mod hooks;
pub mod ring;
pub mod stats;
pub mod sys;
mod worker;

pub use backend::{BackendSpec, Window};
pub use ctrl::{ControlDevice, CtrlError};
pub use device::{DeviceSpec, IoPath, SpecError, Toggle};
pub use features::Features;
pub use handle::{
    kernel_device_ids, Config, DataplaneError, DeviceInfo, DeviceStats, ErrorKind, Handle,
    KernelDevice, KernelState, WorkerSnapshot,
};
pub use stats::{OpKind, StatsSnapshot};
