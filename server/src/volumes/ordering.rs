//! The order of each change's steps, against an in-memory kernel (`FakeKernel`): what the
//! registry held when each device call was made, and what a failed step leaves behind. These
//! are the rules crash safety rests on (a record before its device, a delete's mark before the
//! device goes, a new size recorded before it is applied), checked without a kernel; the VM
//! tests kill a real ublkd at the same points.

use super::Volumes;
use crate::config::Settings;
use crate::devices::Devices;
use crate::error::VolumeError;
use crate::record::{volume_registry, BackendRecord, VolumeRecord};
use crate::registry::Registry;
use crate::volume::State;
use crate::volume_id::VolumeId;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use ublkd_dataplane::stats::CleanupStep;
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceInfo, DeviceSpec, DeviceStats, Features, IoPath, KernelDevice,
    KernelState, PlacementReason, PollReason, QosLimits, QueuePlacement, Toggle, WorkerSnapshot,
};

/// A device call that can be made to fail once.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Call {
    Add,
    Recover,
    Delete,
    Resize,
}

#[derive(Debug, Default)]
struct Kernel {
    /// Devices in the kernel, and whether this dataplane serves them.
    devices: BTreeMap<DevId, (DeviceInfo, bool)>,
    /// Devices something else holds open exclusively (a mount).
    held: BTreeSet<DevId>,
    /// Calls that fail the next time they are made.
    fail: BTreeSet<Call>,
    /// Devices a take-over refuses (`NotRecoverable`): they must be made again.
    not_recoverable: BTreeSet<DevId>,
    /// Each call as it was made, with what the registry said of its device then.
    log: Vec<String>,
}

/// The kernel's ublk devices in memory. Each call is logged with the record that names its
/// device as the registry directory held it at that moment (`-` when none did).
#[derive(Debug)]
struct FakeKernel {
    registry: PathBuf,
    k: Mutex<Kernel>,
}

impl FakeKernel {
    fn new(state_dir: &Path) -> Arc<Self> {
        Arc::new(FakeKernel {
            registry: state_dir.join("registry"),
            k: Mutex::new(Kernel::default()),
        })
    }

    fn kernel(&self) -> std::sync::MutexGuard<'_, Kernel> {
        self.k
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The record on disk that names `dev_id`: `size=N` and `deleting` when it is marked.
    fn on_disk(&self, dev_id: DevId) -> String {
        let Ok(dir) = std::fs::read_dir(&self.registry) else {
            return "-".into();
        };
        for entry in dir.flatten() {
            let Ok(text) = std::fs::read_to_string(entry.path()) else {
                continue;
            };
            let Ok(r) = serde_json::from_str::<VolumeRecord>(&text) else {
                continue;
            };
            if r.dev_id == Some(dev_id) {
                let mark = if r.deleting { " deleting" } else { "" };
                return format!("{} size={}{mark}", r.id, r.size_bytes);
            }
        }
        "-".into()
    }

    fn note(&self, call: &str, dev_id: DevId) {
        let line = format!("{call} {dev_id}: {}", self.on_disk(dev_id));
        self.kernel().log.push(line);
    }

    /// Fails (as a dataplane that stopped) if `call` was armed to.
    fn failing(&self, call: Call) -> Result<(), DataplaneError> {
        if self.kernel().fail.remove(&call) {
            return Err(DataplaneError::Gone);
        }
        Ok(())
    }

    fn log(&self) -> Vec<String> {
        std::mem::take(&mut self.kernel().log)
    }
}

fn info(dev_id: DevId, spec: &DeviceSpec) -> DeviceInfo {
    DeviceInfo {
        dev_id,
        spec: spec.clone(),
        io_path: IoPath::PerIo,
        flags: 0,
        zero_copy: false,
        polled: false,
        poll_reason: PollReason::NotOffered,
        copy_queues: 0,
        every_request_by_copy: false,
        placement: QueuePlacement::Spread,
        placement_reason: PlacementReason::Asked,
        queue_cpus: Vec::new(),
        erased: None,
        block_device: ublkd_dataplane::block_device(dev_id),
        char_device: PathBuf::from(format!("/dev/ublkc{dev_id}")),
    }
}

impl Devices for FakeKernel {
    fn features(&self) -> Features {
        Features::default()
    }

    fn kernel_device_ids(&self) -> Vec<DevId> {
        self.kernel().devices.keys().copied().collect()
    }

    fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError> {
        Ok(self
            .kernel()
            .devices
            .values()
            .map(|(i, owned)| KernelDevice {
                dev_id: i.dev_id,
                state: if *owned {
                    KernelState::Live
                } else {
                    KernelState::Quiesced
                },
                flags: 0,
                queues: 1,
                queue_depth: 128,
                pid: 0,
                size_bytes: i.spec.size_bytes,
                owned: *owned,
            })
            .collect())
    }

    fn held_elsewhere(&self, dev: &Path) -> bool {
        let k = self.kernel();
        k.held
            .iter()
            .any(|&d| ublkd_dataplane::block_device(d) == dev)
    }

    fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let dev_id = spec.dev_id.unwrap_or(DevId(0));
        self.note("add", dev_id);
        self.failing(Call::Add)?;
        let i = info(dev_id, &spec);
        self.kernel().devices.insert(dev_id, (i.clone(), true));
        Ok(i)
    }

    fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let dev_id = spec.dev_id.unwrap_or(DevId(0));
        self.note("recover", dev_id);
        self.failing(Call::Recover)?;
        let mut k = self.kernel();
        if k.not_recoverable.contains(&dev_id) {
            return Err(DataplaneError::NotRecoverable {
                dev_id,
                why: "its shape cannot be served (test)".into(),
            });
        }
        match k.devices.get_mut(&dev_id) {
            Some((i, owned)) if !*owned => {
                *owned = true;
                i.spec = spec;
                Ok(i.clone())
            }
            _ => Err(DataplaneError::NoSuchDevice(dev_id)),
        }
    }

    fn delete_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.note("delete", dev_id);
        self.failing(Call::Delete)?;
        match self.kernel().devices.remove(&dev_id) {
            Some((_, true)) => Ok(()),
            Some(other) => {
                self.kernel().devices.insert(dev_id, other);
                Err(DataplaneError::NoSuchDevice(dev_id))
            }
            None => Err(DataplaneError::NoSuchDevice(dev_id)),
        }
    }

    fn delete_foreign_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.note("delete foreign", dev_id);
        match self.kernel().devices.remove(&dev_id) {
            Some(_) => Ok(()),
            None => Err(DataplaneError::NoSuchDevice(dev_id)),
        }
    }

    fn resize_device(&self, dev_id: DevId, size: u64) -> Result<DeviceInfo, DataplaneError> {
        self.note("resize", dev_id);
        self.failing(Call::Resize)?;
        let mut k = self.kernel();
        let (i, _) = k
            .devices
            .get_mut(&dev_id)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        i.spec.size_bytes = size;
        Ok(i.clone())
    }

    fn set_qos(&self, dev_id: DevId, limits: QosLimits) -> Result<DeviceInfo, DataplaneError> {
        let mut k = self.kernel();
        let (i, _) = k
            .devices
            .get_mut(&dev_id)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        i.spec.qos = limits;
        Ok(i.clone())
    }

    fn drain_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.note("drain", dev_id);
        Ok(())
    }

    fn resume_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.note("resume", dev_id);
        Ok(())
    }

    fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError> {
        Ok(DeviceStats {
            dev_id,
            ..DeviceStats::default()
        })
    }

    fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError> {
        Ok(Vec::new())
    }

    fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError> {
        Ok(Vec::new())
    }

    fn control_cleanup_errors(&self) -> Result<Vec<(CleanupStep, u64)>, DataplaneError> {
        Ok(Vec::new())
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        self.kernel().devices.clear();
        Ok(())
    }

    fn shutdown_keep(&self) -> Result<(), DataplaneError> {
        for (_, owned) in self.kernel().devices.values_mut() {
            *owned = false;
        }
        Ok(())
    }
}

const MIB: u64 = 1 << 20;

fn volumes(dir: &Path, kernel: &Arc<FakeKernel>) -> Volumes {
    let settings = Settings {
        state_dir: dir.to_owned(),
        ram_dir: dir.join("ram"),
        ..Settings::default()
    };
    Volumes::new(
        Ok(Arc::clone(kernel) as Arc<dyn Devices>),
        volume_registry(dir).unwrap_or_else(|e| panic!("registry: {e}")),
        Registry::open_dir(dir.join("snapshots")).unwrap_or_else(|e| panic!("snapshots: {e}")),
        Registry::open_dir(dir.join("intents")).unwrap_or_else(|e| panic!("intents: {e}")),
        Arc::new(settings),
    )
}

fn record(id: &str, size_bytes: u64) -> VolumeRecord {
    VolumeRecord {
        id: VolumeId::parse(id).unwrap_or_else(|e| panic!("{id}: {e}")),
        size_bytes,
        block_size: 4096,
        backend: BackendRecord::Null,
        queues: 1,
        queue_depth: 128,
        io_path: IoPath::Auto,
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        zero_copy: Toggle::Auto,
        poll: Toggle::Auto,
        qos: QosLimits::default(),
        source: None,
    }
}

fn id(s: &str) -> VolumeId {
    VolumeId::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn on_disk(dir: &Path) -> Vec<VolumeRecord> {
    volume_registry(dir)
        .and_then(|r| r.load())
        .map(|(records, _)| records)
        .unwrap_or_else(|e| panic!("loading the registry: {e}"))
}

/// A manager over a fresh kernel and state directory, serving one 64 MiB volume `a` on device
/// 0, with the kernel's log emptied.
async fn with_volume_a() -> (tempfile::TempDir, Arc<FakeKernel>, Volumes) {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let kernel = FakeKernel::new(dir.path());
    let v = volumes(dir.path(), &kernel);
    v.create(record("a", 64 * MIB), false)
        .await
        .unwrap_or_else(|e| panic!("create: {e}"));
    kernel.log();
    (dir, kernel, v)
}

#[tokio::test]
async fn a_create_records_its_volume_before_the_device_and_a_failed_one_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let kernel = FakeKernel::new(dir.path());
    let v = volumes(dir.path(), &kernel);

    let made = v.create(record("a", 64 * MIB), false).await;
    let a = made.unwrap_or_else(|e| panic!("create: {e}"));
    assert_eq!(a.state, State::Ready);
    // The device is added while the record naming its id is already on disk.
    assert_eq!(kernel.log(), ["add 0: a size=67108864"]);
    assert_eq!(on_disk(dir.path())[0].dev_id, Some(DevId(0)));

    // The next free id is one nobody (kernel or record) uses; a failed add undoes the record.
    kernel.kernel().fail.insert(Call::Add);
    let failed = v.create(record("b", 64 * MIB), false).await;
    assert!(failed.is_err());
    assert_eq!(kernel.log(), ["add 1: b size=67108864"]);
    assert_eq!(on_disk(dir.path()).len(), 1, "b's record is gone");
    assert!(v.get(&id("b")).await.is_err(), "b is not listed");
    assert_eq!(kernel.kernel_device_ids(), [DevId(0)]);
}

#[tokio::test]
async fn a_delete_marks_the_record_before_the_device_goes_and_a_failed_one_can_be_retried() {
    let (dir, kernel, v) = with_volume_a().await;

    kernel.kernel().fail.insert(Call::Delete);
    assert!(v.delete(&id("a"), false, false).await.is_err());
    assert_eq!(kernel.log(), ["delete 0: a size=67108864 deleting"]);
    let a = v.get(&id("a")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.state, State::Failed, "{}", a.message);
    assert!(
        on_disk(dir.path())[0].deleting,
        "the mark stays for the next start"
    );

    assert_eq!(v.delete(&id("a"), false, false).await.ok(), Some(true));
    assert_eq!(kernel.log(), ["delete 0: a size=67108864 deleting"]);
    assert!(on_disk(dir.path()).is_empty());
    assert!(kernel.kernel_device_ids().is_empty());
}

#[tokio::test]
async fn a_held_device_is_not_deleted_from_under_its_holder() {
    let (dir, kernel, v) = with_volume_a().await;
    kernel.kernel().held.insert(DevId(0));
    let refused = v.delete(&id("a"), false, false).await;
    assert!(
        matches!(refused, Err(VolumeError::DeleteBusy { .. })),
        "{refused:?}"
    );
    assert!(kernel.log().is_empty(), "no device call was made");
    assert!(
        !on_disk(dir.path())[0].deleting,
        "nor was the record marked"
    );
    assert_eq!(kernel.kernel_device_ids(), [DevId(0)]);
}

#[tokio::test]
async fn a_resize_records_the_new_size_first_and_a_failed_one_puts_the_old_back() {
    let (dir, kernel, v) = with_volume_a().await;

    let grown = v.resize(&id("a"), 128 * MIB).await;
    assert_eq!(grown.map(|g| g.record.size_bytes).ok(), Some(128 * MIB));
    assert_eq!(kernel.log(), ["resize 0: a size=134217728"]);

    kernel.kernel().fail.insert(Call::Resize);
    assert!(v.resize(&id("a"), 256 * MIB).await.is_err());
    assert_eq!(kernel.log(), ["resize 0: a size=268435456"]);
    assert_eq!(
        on_disk(dir.path())[0].size_bytes,
        128 * MIB,
        "the old size is back"
    );
    let a = v.get(&id("a")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.record.size_bytes, 128 * MIB);
}

#[tokio::test]
async fn a_restart_takes_over_what_survived_recreates_the_rest_and_finishes_deletes() {
    let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
    let kernel = FakeKernel::new(dir.path());
    {
        let v = volumes(dir.path(), &kernel);
        for name in ["kept", "lost", "going", "stuck"] {
            v.create(record(name, 64 * MIB), false)
                .await
                .unwrap_or_else(|e| panic!("create {name}: {e}"));
        }
        // "going" was being deleted when the daemon died (kill -9: no shutdown).
        let mut going = on_disk(dir.path())
            .into_iter()
            .find(|r| r.id.as_str() == "going")
            .unwrap_or_else(|| panic!("no record of going"));
        going.deleting = true;
        volume_registry(dir.path())
            .and_then(|r| r.put(&going))
            .unwrap_or_else(|e| panic!("{e}"));
    }
    {
        // The dying process's devices are nobody's now; a reboot-like loss took "lost"'s,
        // "stuck"'s cannot be taken over, and the first device made again fails.
        let mut k = kernel.kernel();
        for (_, owned) in k.devices.values_mut() {
            *owned = false;
        }
        k.devices.remove(&DevId(1));
        k.not_recoverable.insert(DevId(3));
        k.fail.insert(Call::Add);
        k.log.clear();
    }

    let v = volumes(dir.path(), &kernel);
    v.load().await.unwrap_or_else(|e| panic!("load: {e}"));
    let failed = v.restore().await;
    assert_eq!(failed, [id("lost")]);
    // One volume at a time, in id order: going, kept, lost, stuck.
    assert_eq!(
        kernel.log(),
        [
            "delete foreign 2: going size=67108864 deleting",
            "recover 0: kept size=67108864",
            "add 1: lost size=67108864",
            "recover 3: stuck size=67108864",
            "delete foreign 3: stuck size=67108864",
            "add 3: stuck size=67108864",
        ]
    );
    let state = |v: Option<crate::volume::Volume>| v.map(|v| (v.state, v.device.is_some()));
    assert!(v.get(&id("going")).await.is_err(), "the delete finished");
    assert_eq!(
        state(v.get(&id("kept")).await.ok()),
        Some((State::Ready, true))
    );
    assert_eq!(
        state(v.get(&id("lost")).await.ok()),
        Some((State::Failed, false))
    );
    assert_eq!(
        state(v.get(&id("stuck")).await.ok()),
        Some((State::Ready, true))
    );
    // Only a take-over counts as a recovery.
    assert_eq!(v.recoveries.durations.load().0.iter().sum::<u64>(), 1);

    assert!(v.restore_again(failed).await.is_empty());
    assert_eq!(kernel.log(), ["add 1: lost size=67108864"]);
    assert_eq!(
        state(v.get(&id("lost")).await.ok()),
        Some((State::Ready, true))
    );
    let records: Vec<String> = on_disk(dir.path())
        .iter()
        .map(|r| r.id.as_str().to_owned())
        .collect();
    assert_eq!(records, ["kept", "lost", "stuck"]);
}
