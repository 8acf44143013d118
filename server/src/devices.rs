//! What the volume manager asks of the kernel's ublk devices, as one trait: the dataplane's
//! `Handle` (and the kernel's device list and holders) in ublkd, an in-memory kernel in the
//! host tests of `volumes`, so that the order of create, delete, resize and restore steps and
//! their undo on failure are tested without a kernel.
//!
//! Every method may block (a ublk control command, a file open): the manager calls them on
//! tokio's blocking pool.

use std::path::Path;
use ublkd_dataplane::stats::CleanupStep;
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceInfo, DeviceSpec, DeviceStats, Erase, Features, Growth, Handle,
    KernelDevice, Namespace, NamespaceIdentity, QosLimits, WorkerSnapshot,
};

/// The kernel's ublk devices as the volume manager uses them.
pub trait Devices: std::fmt::Debug + Send + Sync + 'static {
    /// What the kernel's ublk driver offers.
    fn features(&self) -> Features;
    /// The ids of every ublk device in the kernel, served by us or not.
    fn kernel_device_ids(&self) -> Vec<DevId>;
    /// Every ublk device in the kernel, with what the kernel knows of it.
    fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError>;
    /// Whether something holds block device `dev` exclusively: a mount in any mount
    /// namespace, a device-mapper or md holder, or an exclusive opener.
    fn held_elsewhere(&self, dev: &Path) -> bool;
    /// The size and block size of the NVMe namespace behind generic char device `device`.
    fn identify_namespace(&self, device: &Path) -> Result<Namespace, DataplaneError>;
    /// The processes (`name (pid)`) other than ublkd holding block device `dev` open: a
    /// raw-block user that did not ask for O_EXCL (a VM, a database) is seen only so.
    fn opened_by(&self, dev: &Path) -> Vec<String>;
    /// Why the host itself seems to use the namespace at `device`, or None.
    fn namespace_host_use(&self, device: &Path) -> Result<Option<String>, DataplaneError>;
    /// The generic char device of the namespace with `identity`, wherever this boot named it.
    fn find_namespace(&self, identity: &NamespaceIdentity) -> Option<std::path::PathBuf>;
    /// Makes `len` bytes of `device`'s namespace at `offset` unreadable, serving nothing: an
    /// erase a crash interrupted, finished before the range is served again.
    fn erase_window(&self, device: &Path, offset: u64, len: u64) -> Result<Erase, DataplaneError>;
    /// Creates and starts a device for `spec`.
    fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError>;
    /// Takes over the kernel's device `spec.dev_id` (a crash or upgrade left it).
    fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError>;
    /// Stops and deletes a device this dataplane serves.
    fn delete_device(&self, dev_id: DevId) -> Result<(), DataplaneError>;
    /// Deletes a device in the kernel that this dataplane does not serve.
    fn delete_foreign_device(&self, dev_id: DevId) -> Result<(), DataplaneError>;
    /// Grows a device to `size`; `growth` says whether an NVMe window's new blocks are erased
    /// by the dataplane or were erased already (`erase_window`).
    fn resize_device(
        &self,
        dev_id: DevId,
        size: u64,
        growth: Growth,
    ) -> Result<DeviceInfo, DataplaneError>;
    fn set_qos(&self, dev_id: DevId, limits: QosLimits) -> Result<DeviceInfo, DataplaneError>;
    /// Holds a device's new requests until its in-flight ones finished (a snapshot's instant).
    fn drain_device(&self, dev_id: DevId) -> Result<(), DataplaneError>;
    fn resume_device(&self, dev_id: DevId) -> Result<(), DataplaneError>;
    fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError>;
    fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError>;
    fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError>;
    fn control_cleanup_errors(&self) -> Result<Vec<(CleanupStep, u64)>, DataplaneError>;
    /// Deletes every device (a clean exit with `on_exit = delete`).
    fn shutdown(&self) -> Result<(), DataplaneError>;
    /// Leaves every device to the next ublkd (a clean exit with `on_exit = keep`).
    fn shutdown_keep(&self) -> Result<(), DataplaneError>;
}

impl Devices for Handle {
    fn features(&self) -> Features {
        Handle::features(self)
    }

    fn kernel_device_ids(&self) -> Vec<DevId> {
        ublkd_dataplane::kernel_device_ids()
    }

    fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError> {
        Handle::kernel_devices(self)
    }

    /// Tried with an exclusive open of our own, closed at once; reading our own mountinfo would
    /// miss mounts in other namespaces (the CSI driver's pod, a container's).
    fn held_elsewhere(&self, dev: &Path) -> bool {
        use std::os::unix::fs::OpenOptionsExt;
        match std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_EXCL)
            .open(dev)
        {
            Ok(_) => false,
            Err(e) => e.raw_os_error() == Some(libc::EBUSY),
        }
    }

    /// Every process's open files, as `/proc/*/fd` shows them (only the processes of
    /// ublkd's PID namespace: in a container without the host's, none of the host's).
    fn opened_by(&self, dev: &Path) -> Vec<String> {
        use std::os::unix::fs::MetadataExt;
        let Ok(rdev) = std::fs::metadata(dev).map(|m| m.rdev()) else {
            return Vec::new();
        };
        let own = std::process::id().to_string();
        let Ok(procs) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        let mut by = Vec::new();
        for p in procs.flatten() {
            let pid = p.file_name().to_string_lossy().into_owned();
            if pid == own || !pid.bytes().all(|b| b.is_ascii_digit()) {
                continue;
            }
            let Ok(fds) = std::fs::read_dir(p.path().join("fd")) else {
                continue;
            };
            let holds = fds.flatten().any(|fd| {
                std::fs::metadata(fd.path()).is_ok_and(|m| {
                    use std::os::unix::fs::FileTypeExt;
                    m.file_type().is_block_device() && m.rdev() == rdev
                })
            });
            if holds {
                let comm = std::fs::read_to_string(p.path().join("comm")).unwrap_or_default();
                by.push(format!("{} ({pid})", comm.trim()));
            }
        }
        by
    }

    fn identify_namespace(&self, device: &Path) -> Result<Namespace, DataplaneError> {
        Ok(ublkd_dataplane::identify_namespace(device)?)
    }

    fn find_namespace(&self, identity: &NamespaceIdentity) -> Option<std::path::PathBuf> {
        ublkd_dataplane::find_namespace(identity)
    }

    fn namespace_host_use(&self, device: &Path) -> Result<Option<String>, DataplaneError> {
        Ok(ublkd_dataplane::namespace_host_use(device)?)
    }

    fn erase_window(&self, device: &Path, offset: u64, len: u64) -> Result<Erase, DataplaneError> {
        Ok(ublkd_dataplane::erase_window(device, offset, len)?)
    }

    fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        Handle::add_device(self, spec)
    }

    fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        Handle::recover_device(self, spec)
    }

    fn delete_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        Handle::delete_device(self, dev_id)
    }

    fn delete_foreign_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        Handle::delete_foreign_device(self, dev_id)
    }

    fn resize_device(
        &self,
        dev_id: DevId,
        size: u64,
        growth: Growth,
    ) -> Result<DeviceInfo, DataplaneError> {
        Handle::resize_device(self, dev_id, size, growth)
    }

    fn set_qos(&self, dev_id: DevId, limits: QosLimits) -> Result<DeviceInfo, DataplaneError> {
        Handle::set_qos(self, dev_id, limits)
    }

    fn drain_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        Handle::drain_device(self, dev_id)
    }

    fn resume_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        Handle::resume_device(self, dev_id)
    }

    fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError> {
        Handle::stats(self, dev_id)
    }

    fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError> {
        Handle::stats_all(self)
    }

    fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError> {
        Handle::worker_stats(self)
    }

    fn control_cleanup_errors(&self) -> Result<Vec<(CleanupStep, u64)>, DataplaneError> {
        Handle::control_cleanup_errors(self)
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        Handle::shutdown(self)
    }

    fn shutdown_keep(&self) -> Result<(), DataplaneError> {
        Handle::shutdown_keep(self)
    }
}
