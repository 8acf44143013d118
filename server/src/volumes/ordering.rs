//! The order of each change's steps, against an in-memory kernel (`FakeKernel`): what the
//! registry held when each device call was made, and what a failed step leaves behind. These
//! are the rules crash safety rests on (a record before its device, a delete's mark before the
//! device goes, a new size recorded before it is applied), checked without a kernel; the VM
//! tests kill a real ublkd at the same points. With the same kernel: what the manager keeps of the
//! CSI driver's report of volumes no PersistentVolume names.

use super::Volumes;
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::devices::Devices;
use crate::error::VolumeError;
use crate::record::{volume_registry, VolumeRecord};
use crate::registry::Registry;
use crate::volume::State;
use crate::volume_id::VolumeId;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use ublkd_dataplane::stats::CleanupStep;
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceInfo, DeviceSpec, DeviceStats, Features, Growth, IoPath,
    KernelDevice, KernelState, PlacementReason, PollReason, QosLimits, QueuePlacement,
    WorkerSnapshot,
};

/// A device call that can be made to fail once, or to be where the process dies.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Call {
    Add,
    Recover,
    Delete,
    Resize,
}

/// Where in a device call the process dies: before the kernel acts, or after it has acted
/// and before the caller hears of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum When {
    Before,
    After,
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
    /// The call at which the process dies, before or after its effect (see `FakeKernel::dies`).
    dies: Option<(Call, When)>,
    /// Each call as it was made, with what the registry said of its device then.
    log: Vec<String>,
    /// The next failing call also breaks the registry directory: every write after it fails.
    breaks_registry: bool,
}

/// The kernel's ublk devices in memory. Each call is logged with the record that names its
/// device as the registry directory held it at that moment (`-` when none did).
#[derive(Debug)]
struct FakeKernel {
    registry: PathBuf,
    k: Mutex<Kernel>,
    /// Told when the call armed in `Kernel::dies` is reached.
    died: tokio::sync::Notify,
}

impl FakeKernel {
    fn new(state_dir: &Path) -> Arc<Self> {
        Arc::new(FakeKernel {
            registry: state_dir.join("registry"),
            k: Mutex::new(Kernel::default()),
            died: tokio::sync::Notify::new(),
        })
    }

    /// A kill -9 at `call` (`when`): the calling thread stops there for good, so nothing of the
    /// change after that point ever runs; the test then starts a new manager over what is left.
    fn dies(&self, call: Call, when: When) {
        let armed = {
            let mut k = self.kernel();
            let hit = k.dies == Some((call, when));
            if hit {
                k.dies = None;
            }
            hit
        };
        if armed {
            self.died.notify_one();
            loop {
                std::thread::park();
            }
        }
    }

    /// What the kernel keeps of a dead process's devices: each stays, quiesced, nobody's.
    fn process_died(&self) {
        for (_, owned) in self.kernel().devices.values_mut() {
            *owned = false;
        }
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
        let mut k = self.kernel();
        if k.fail.remove(&call) {
            if std::mem::take(&mut k.breaks_registry) {
                // A file where the directory was: no record can be written there any more.
                let broken = self.registry.with_extension("broken");
                std::fs::rename(&self.registry, &broken)
                    .and_then(|()| std::fs::write(&self.registry, b"not a directory"))
                    .unwrap_or_else(|e| panic!("breaking the registry: {e}"));
            }
            return Err(DataplaneError::Gone);
        }
        Ok(())
    }

    fn log(&self) -> Vec<String> {
        std::mem::take(&mut self.kernel().log)
    }
}

/// A device as a fake kernel serves it (the simulator's too).
pub(super) fn info(dev_id: DevId, spec: &DeviceSpec) -> DeviceInfo {
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

    fn identify_namespace(&self, _: &Path) -> Result<ublkd_dataplane::Namespace, DataplaneError> {
        Err(DataplaneError::Gone)
    }

    fn find_namespace(&self, _: &ublkd_dataplane::NamespaceIdentity) -> Option<PathBuf> {
        None
    }

    fn namespace_host_use(&self, _: &Path) -> Result<Option<String>, DataplaneError> {
        Ok(None)
    }

    fn opened_by(&self, _: &Path) -> Vec<String> {
        Vec::new()
    }

    fn erase_window(
        &self,
        _: &Path,
        _: u64,
        _: u64,
    ) -> Result<ublkd_dataplane::Erase, DataplaneError> {
        Err(DataplaneError::Gone)
    }

    fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let dev_id = spec.dev_id.unwrap_or(DevId(0));
        self.note("add", dev_id);
        self.failing(Call::Add)?;
        self.dies(Call::Add, When::Before);
        let i = info(dev_id, &spec);
        self.kernel().devices.insert(dev_id, (i.clone(), true));
        self.dies(Call::Add, When::After);
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
        self.dies(Call::Delete, When::Before);
        let removed = self.kernel().devices.remove(&dev_id);
        self.dies(Call::Delete, When::After);
        match removed {
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

    fn resize_device(
        &self,
        dev_id: DevId,
        size: u64,
        _: Growth,
    ) -> Result<DeviceInfo, DataplaneError> {
        self.note("resize", dev_id);
        self.failing(Call::Resize)?;
        self.dies(Call::Resize, When::Before);
        let resized = {
            let mut k = self.kernel();
            let (i, _) = k
                .devices
                .get_mut(&dev_id)
                .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
            i.spec.size_bytes = size;
            i.clone()
        };
        self.dies(Call::Resize, When::After);
        Ok(resized)
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
    let id = VolumeId::parse(id).unwrap_or_else(|e| panic!("{id}: {e}"));
    VolumeRecord {
        queue_depth: 128,
        ..VolumeRecord::example(id, size_bytes, BackendRecord::Null)
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
    assert!(v.delete(&id("a"), false, false, false).await.is_err());
    assert_eq!(kernel.log(), ["delete 0: a size=67108864 deleting"]);
    let a = v.get(&id("a")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.state, State::Failed, "{}", a.message);
    assert!(
        on_disk(dir.path())[0].deleting,
        "the mark stays for the next start"
    );

    assert_eq!(
        v.delete(&id("a"), false, false, false).await.ok(),
        Some(true)
    );
    assert_eq!(kernel.log(), ["delete 0: a size=67108864 deleting"]);
    assert!(on_disk(dir.path()).is_empty());
    assert!(kernel.kernel_device_ids().is_empty());
}

#[tokio::test]
async fn a_held_device_is_not_deleted_from_under_its_holder() {
    let (dir, kernel, v) = with_volume_a().await;
    kernel.kernel().held.insert(DevId(0));
    let refused = v.delete(&id("a"), false, false, false).await;
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

/// The CSI driver's report of volumes no PV names: ids of no volume are kept out, each report
/// replaces the last and says which ids are new, and a volume deleted since drops out of what
/// is shown. Nothing is done to a reported volume.
#[tokio::test]
async fn a_report_of_volumes_without_pv_keeps_only_volumes_here_and_replaces_the_last() {
    let (_dir, kernel, v) = with_volume_a().await;
    v.create(record("b", 64 * MIB), false)
        .await
        .unwrap_or_else(|e| panic!("create b: {e}"));
    kernel.log();

    let new = v.report_without_pv(vec![id("a"), id("gone")]).await;
    assert_eq!(new, [id("a")], "an id of no volume here is not kept");
    assert_eq!(v.without_pv().await, [id("a")]);

    let new = v.report_without_pv(vec![id("a"), id("b")]).await;
    assert_eq!(new, [id("b")], "only b is new in the second report");
    assert_eq!(v.without_pv().await, [id("a"), id("b")]);

    assert_eq!(
        v.delete(&id("b"), false, false, false).await.ok(),
        Some(true)
    );
    assert_eq!(
        v.without_pv().await,
        [id("a")],
        "a deleted volume drops out"
    );

    let new = v.report_without_pv(Vec::new()).await;
    assert!(new.is_empty());
    assert!(v.without_pv().await.is_empty(), "an empty report clears it");
    assert_eq!(
        kernel.log(),
        ["delete 1: b size=67108864 deleting"],
        "the reports made no device call; only b's delete did"
    );
    assert_eq!(kernel.kernel_device_ids(), [DevId(0)], "a is served still");
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

/// A refused resize whose old record cannot be written back: the next start would apply the
/// size the caller was told failed, so the volume says so, and the failure is counted.
#[tokio::test]
async fn a_rollback_that_cannot_be_written_is_said_and_counted() {
    let (_dir, kernel, v) = with_volume_a().await;
    {
        let mut k = kernel.kernel();
        k.fail.insert(Call::Resize);
        k.breaks_registry = true;
    }
    assert!(v.resize(&id("a"), 256 * MIB).await.is_err());
    let a = v.get(&id("a")).await.unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(a.record.size_bytes, 64 * MIB, "the map has the old size");
    assert!(
        a.message.contains("refused change is still recorded"),
        "the volume says what the next start will do: {:?}",
        a.message
    );
    assert_eq!(v.rollback_failures(), 1);
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
        kernel.process_died();
        let mut k = kernel.kernel();
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

/// Runs `body`, a change killed inside it, on a runtime of its own that is let go of without
/// waiting: the dead change's thread never returns, and a failed assertion must not leave the
/// runtime to a drop that waits for it; the panic goes on after.
fn after_a_kill(body: impl std::future::Future<Output = ()>) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    let checked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| rt.block_on(body)));
    rt.shutdown_background();
    if let Err(panic) = checked {
        std::panic::resume_unwind(panic);
    }
}

/// A delete that takes the backing file too and dies at its device step (before the device
/// goes, or after): the mark says so, and the next start finishes the delete, file included.
#[test]
fn a_delete_that_dies_takes_its_backing_file_at_the_next_start() {
    for when in [When::Before, When::After] {
        after_a_kill(async {
            let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
            let kernel = FakeKernel::new(dir.path());
            let dying = Arc::new(volumes(dir.path(), &kernel));
            let file = dir.path().join("a.img");
            let mut a = record("a", 64 * MIB);
            a.backend = BackendRecord::File {
                path: file.clone(),
                create: true,
            };
            dying
                .create(a, false)
                .await
                .unwrap_or_else(|e| panic!("create: {e}"));
            assert!(file.exists(), "the backing file was made");
            kernel.kernel().dies = Some((Call::Delete, when));
            let v = Arc::clone(&dying);
            tokio::spawn(async move { v.delete(&id("a"), false, true, false).await.map(drop) });
            tokio::time::timeout(std::time::Duration::from_secs(30), kernel.died.notified())
                .await
                .unwrap_or_else(|_| panic!("{when:?}: the delete never reached the kernel"));
            let marked = on_disk(dir.path());
            assert!(
                marked[0].deleting && marked[0].delete_backing,
                "{when:?}: {marked:?}"
            );
            drop(dying);
            kernel.process_died();

            let v = volumes(dir.path(), &kernel);
            v.load().await.unwrap_or_else(|e| panic!("load: {e}"));
            assert!(v.restore().await.is_empty(), "{when:?}");
            assert!(
                on_disk(dir.path()).is_empty(),
                "{when:?}: the delete finished"
            );
            assert!(kernel.kernel_device_ids().is_empty(), "{when:?}");
            assert!(
                !file.exists(),
                "{when:?}: the backing file went with the delete"
            );
        });
    }
}

/// What a kill -9 inside a change leaves, once the next start has restored it: the same set of
/// devices in the kernel as records name, each serving at its recorded size, no record still
/// marked for deletion; and the change itself either done or never begun, as its point says.
/// The VM test `crashes_inside_create_resize_and_delete_leave_registry_and_kernel_agreeing`
/// kills a real ublkd at the same points (its `abort_at` names in the comments).
#[test]
fn a_kill_at_any_step_of_a_change_leaves_registry_and_kernel_agreeing_after_the_restart() {
    #[derive(Debug, Clone, Copy)]
    enum Op {
        Create,
        Resize,
        Delete,
    }
    let points = [
        ("create:after_record", Op::Create, Call::Add, When::Before),
        ("create:after_device", Op::Create, Call::Add, When::After),
        (
            "resize:after_record",
            Op::Resize,
            Call::Resize,
            When::Before,
        ),
        ("resize:after_device", Op::Resize, Call::Resize, When::After),
        ("delete:after_mark", Op::Delete, Call::Delete, When::Before),
        ("delete:after_device", Op::Delete, Call::Delete, When::After),
    ];
    for (point, op, call, when) in points {
        after_a_kill(async {
            let dir = tempfile::tempdir().unwrap_or_else(|e| panic!("{e}"));
            let kernel = FakeKernel::new(dir.path());
            let dying = Arc::new(volumes(dir.path(), &kernel));
            // A bystander that no change touches, and the volume the change is about.
            for name in ["other", "a"] {
                if matches!(op, Op::Create) && name == "a" {
                    continue;
                }
                dying
                    .create(record(name, 64 * MIB), false)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: create {name}: {e}"));
            }
            kernel.kernel().dies = Some((call, when));
            let v = Arc::clone(&dying);
            let answered = Arc::new(std::sync::atomic::AtomicBool::new(false));
            let told = Arc::clone(&answered);
            tokio::spawn(async move {
                // Whatever it would answer, it must never get to: the process dies inside it.
                let _unreachable = match op {
                    Op::Create => v.create(record("a", 64 * MIB), false).await.map(drop),
                    Op::Resize => v.resize(&id("a"), 96 * MIB).await.map(drop),
                    Op::Delete => v.delete(&id("a"), false, false, false).await.map(drop),
                };
                told.store(true, std::sync::atomic::Ordering::SeqCst);
            });
            tokio::time::timeout(std::time::Duration::from_secs(30), kernel.died.notified())
                .await
                .unwrap_or_else(|_| panic!("{point}: the change never reached its kill point"));
            drop(dying);
            kernel.process_died();

            let v = volumes(dir.path(), &kernel);
            v.load()
                .await
                .unwrap_or_else(|e| panic!("{point}: load: {e}"));
            let failed = v.restore().await;
            assert!(failed.is_empty(), "{point}: {failed:?} did not come back");

            let records = on_disk(dir.path());
            let recorded: BTreeSet<DevId> = records.iter().filter_map(|r| r.dev_id).collect();
            let devices: BTreeSet<DevId> = kernel.kernel_device_ids().into_iter().collect();
            assert_eq!(
                recorded, devices,
                "{point}: one device per record, no other"
            );
            assert_eq!(
                recorded.len(),
                records.len(),
                "{point}: every record has a device"
            );
            for r in &records {
                assert!(
                    !r.deleting,
                    "{point}: {} is still marked for deletion",
                    r.id
                );
                let vol = v
                    .get(&r.id)
                    .await
                    .unwrap_or_else(|e| panic!("{point}: {e}"));
                assert_eq!(
                    vol.state,
                    State::Ready,
                    "{point}: {}: {}",
                    r.id,
                    vol.message
                );
                let served = kernel
                    .kernel()
                    .devices
                    .get(&r.dev_id.unwrap_or(DevId(u32::MAX)))
                    .map(|(i, owned)| (i.spec.size_bytes, *owned));
                assert_eq!(
                    served,
                    Some((r.size_bytes, true)),
                    "{point}: {} served at its recorded size",
                    r.id
                );
            }
            let sizes: BTreeMap<String, u64> = records
                .iter()
                .map(|r| (r.id.as_str().to_owned(), r.size_bytes))
                .collect();
            let expected: &[(&str, u64)] = match op {
                // Recorded before its device: the volume exists after the restart.
                Op::Create => &[("a", 64 * MIB), ("other", 64 * MIB)],
                // Recorded before it was applied: the new size holds.
                Op::Resize => &[("a", 96 * MIB), ("other", 64 * MIB)],
                // Marked before the device went: the restart finishes it.
                Op::Delete => &[("other", 64 * MIB)],
            };
            let expected: BTreeMap<String, u64> = expected
                .iter()
                .map(|(n, s)| ((*n).to_owned(), *s))
                .collect();
            assert_eq!(sizes, expected, "{point}");
            assert!(
                !answered.load(std::sync::atomic::Ordering::SeqCst),
                "{point}: the change went on after the process died"
            );
        });
    }
}
