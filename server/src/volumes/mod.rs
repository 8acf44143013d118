//! The volume manager: the registry of desired volumes and the dataplane devices serving them.
//!
//! Two kinds of lock: each volume's operation lock orders the changes of that volume (create,
//! delete, resize, QoS, restore, adopt: one at a time per volume, different volumes in parallel);
//! the map lock is held only to read or record, never across a registry write or a ublk
//! control command, so Get, List and `/metrics` never wait for a slow change. Dataplane calls
//! (which block on the control thread) run on tokio's blocking pool.

mod create;
mod delete;
mod erase;
mod namespace;
mod orphans;
mod qos;
mod resize;
mod restore;
mod snapshots;

#[cfg(test)]
mod ordering;
#[cfg(test)]
mod sim;

use crate::config::Settings;
use crate::devices::Devices;
use crate::error::VolumeError;
use crate::record::{BackendRecord, VolumeRecord};
use crate::registry::Registry;
use crate::snapshot::{FileIntent, SnapshotId, SnapshotRecord};
use crate::volume::{ram_file, State, Volume};
use crate::volume_id::VolumeId;
use std::collections::{BTreeMap, HashMap};

use std::sync::{Arc, PoisonError, Weak};
use std::time::Duration;
use tokio::sync::{Mutex, OwnedMutexGuard};
use ublkd_dataplane::stats::{CleanupStep, Histogram};
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceStats, Features, KernelDevice, QosLimits, WorkerSnapshot,
};

/// Upper bounds (nanoseconds) of the recovery-duration histogram: 10 ms to 10 s.
pub const RECOVERY_BOUNDS_NS: [u64; 10] = [
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
    2_500_000_000,
    5_000_000_000,
    10_000_000_000,
];

/// Device take-overs after a restart or crash, and how long each took (several restores may
/// record at once).
#[derive(Debug, Default)]
pub struct RecoveryStats {
    pub durations: Histogram<11>,
}

impl RecoveryStats {
    fn record(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.durations.observe_shared(&RECOVERY_BOUNDS_NS, ns);
    }
}

#[derive(Debug)]
pub struct Volumes {
    /// The kernel's devices (the dataplane in ublkd); None when the kernel has no ublk.
    handle: Option<Arc<dyn Devices>>,
    no_ublk: String,
    registry: Registry<VolumeRecord>,
    snapshot_registry: Registry<SnapshotRecord>,
    /// Clones and new file volumes whose backing file is being made (`FileIntent`).
    intents: Registry<FileIntent>,
    /// Every snapshot; its lock is held only to read or record.
    snapshots: Mutex<BTreeMap<SnapshotId, SnapshotRecord>>,
    /// Snapshot ids being taken, and of which volume: reserved while their copy is made.
    snapshots_taking: std::sync::Mutex<BTreeMap<SnapshotId, VolumeId>>,
    settings: Arc<Settings>,
    inner: Mutex<BTreeMap<VolumeId, Volume>>,
    /// Each volume's operation lock, while anyone holds or waits for it.
    ops: std::sync::Mutex<HashMap<VolumeId, Weak<Mutex<()>>>>,
    pub recoveries: RecoveryStats,
    /// Refused changes whose record could not be put back (`ublkd_volume_rollback_failures_total`).
    pub rollback_failures: std::sync::atomic::AtomicU64,
    /// The dataplane's clean-up failures and unpinned workers as last logged, by worker (its
    /// CPU, or `control`) and step: `check_workers` logs what rose since.
    cleanup_seen: std::sync::Mutex<BTreeMap<(String, &'static str), u64>>,
    /// The volumes no PersistentVolume names, as the CSI driver last reported them
    /// (`orphans::report_without_pv`); never acted on.
    without_pv: std::sync::Mutex<std::collections::BTreeSet<VolumeId>>,
}

/// Two records describe the same volume if everything but bookkeeping matches.
fn same_spec(a: &VolumeRecord, b: &VolumeRecord) -> bool {
    VolumeRecord {
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        delete_backing: false,
        erase_pending: None,
        ..a.clone()
    } == VolumeRecord {
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        delete_backing: false,
        erase_pending: None,
        ..b.clone()
    }
}

fn now_ms() -> i64 {
    crate::seam::now_ms()
}

/// Runs blocking work (dataplane calls, file system calls) on tokio's blocking pool.
async fn blocking<T: Send + 'static, E: Send + 'static>(
    f: impl FnOnce() -> Result<T, E> + Send + 'static,
) -> Result<T, VolumeError>
where
    VolumeError: From<E>,
{
    crate::seam::blocking(f)
        .await
        .map_err(|e| VolumeError::JoinDataplaneTask(e.to_string()))?
        .map_err(VolumeError::from)
}

/// Removes file `path` on the blocking pool (an unlink frees the file's extents: seconds for a
/// large one).
async fn unlink(path: std::path::PathBuf) -> Result<(), VolumeError> {
    blocking(move || {
        std::fs::remove_file(&path)
            .map_err(|source| VolumeError::RemoveBackingFile { path, source })
    })
    .await
}

impl Volumes {
    /// Starts over the given dataplane (None when the kernel has no ublk: every volume call then
    /// fails with FAILED_PRECONDITION, but the daemon still answers).
    pub fn new(
        handle: Result<Arc<dyn Devices>, DataplaneError>,
        registry: Registry<VolumeRecord>,
        snapshot_registry: Registry<SnapshotRecord>,
        intents: Registry<FileIntent>,
        settings: Arc<Settings>,
    ) -> Self {
        let (handle, no_ublk) = match handle {
            Ok(h) => (Some(h), String::new()),
            Err(e) => (None, crate::error::chain(&e)),
        };
        Self {
            handle,
            no_ublk,
            registry,
            snapshot_registry,
            intents,
            snapshots: Mutex::new(BTreeMap::new()),
            snapshots_taking: std::sync::Mutex::new(BTreeMap::new()),
            settings,
            inner: Mutex::new(BTreeMap::new()),
            ops: std::sync::Mutex::new(HashMap::new()),
            recoveries: RecoveryStats::default(),
            rollback_failures: std::sync::atomic::AtomicU64::new(0),
            cleanup_seen: std::sync::Mutex::new(BTreeMap::new()),
            without_pv: std::sync::Mutex::new(Default::default()),
        }
    }

    // The changes and the questions the service asks, each owned by its room's file.

    /// Creates the volume `record` describes; with `place_window`, ublkd chooses its NVMe
    /// window's offset (the first free extent that fits).
    pub async fn create(
        &self,
        record: VolumeRecord,
        place_window: bool,
    ) -> Result<Volume, VolumeError> {
        create::create(self, record, place_window).await
    }

    /// Deletes volume `id`; Ok(false) when it did not exist and `allow_missing` was set. With
    /// `delete_backing`, a file volume's backing file goes too.
    pub async fn delete(
        &self,
        id: &VolumeId,
        allow_missing: bool,
        delete_backing: bool,
        force: bool,
    ) -> Result<bool, VolumeError> {
        delete::delete(self, id, allow_missing, delete_backing, force).await
    }

    /// Grows volume `id` to `size` bytes (a volume never shrinks).
    pub async fn resize(&self, id: &VolumeId, size: u64) -> Result<Volume, VolumeError> {
        resize::resize(self, id, size).await
    }

    /// Replaces a volume's I/O limits: recorded first (a restart applies them), then handed to
    /// the dataplane if the volume is being served. A volume not being served (FAILED, or
    /// waiting for recovery) keeps them for when it is.
    pub async fn set_qos(&self, id: &VolumeId, qos: QosLimits) -> Result<Volume, VolumeError> {
        qos::set_qos(self, id, qos).await
    }

    /// ublk devices in the kernel that no registered volume owns.
    pub async fn orphans(&self) -> Vec<KernelDevice> {
        orphans::orphans(self).await
    }

    /// Replaces the CSI driver's report of the volumes no PersistentVolume names. Ids of no
    /// volume here are kept out (the driver's view may be a moment old).
    /// Returns the ids that were not in the last report.
    pub async fn report_without_pv(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        orphans::report_without_pv(self, ids).await
    }

    /// The volumes no PersistentVolume names, from the driver's last report, of those that
    /// still exist.
    pub async fn without_pv(&self) -> Vec<VolumeId> {
        orphans::without_pv(self).await
    }

    /// Takes over orphan device `dev_id` as volume `record` (whose spec was checked).
    pub async fn adopt(&self, dev_id: DevId, record: VolumeRecord) -> Result<Volume, VolumeError> {
        orphans::adopt(self, dev_id, record).await
    }

    /// Deletes orphan device `dev_id`.
    pub async fn delete_orphan(&self, dev_id: DevId) -> Result<(), VolumeError> {
        orphans::delete_orphan(self, dev_id).await
    }

    /// Takes snapshot `id` of file volume `source`; the existing one if `id` was already taken
    /// of the same volume.
    pub async fn create_snapshot(
        &self,
        id: SnapshotId,
        source: VolumeId,
    ) -> Result<SnapshotRecord, VolumeError> {
        snapshots::create_snapshot(self, id, source).await
    }

    /// Deletes snapshot `id` and its copy; Ok(false) if it did not exist and `allow_missing`.
    pub async fn delete_snapshot(
        &self,
        id: &SnapshotId,
        allow_missing: bool,
    ) -> Result<bool, VolumeError> {
        snapshots::delete_snapshot(self, id, allow_missing).await
    }

    /// Snapshots, by id, optionally only `id` or only those of volume `source`.
    pub async fn list_snapshots(
        &self,
        id: Option<&str>,
        source: Option<&str>,
    ) -> Vec<SnapshotRecord> {
        snapshots::list_snapshots(self, id, source).await
    }

    /// Loads the registry: every volume appears (as RECOVERING) before any is brought up, so
    /// clients see the whole node at once. `restore` then brings them up.
    pub async fn load(&self) -> Result<(), VolumeError> {
        restore::load(self).await
    }

    /// Brings every loaded volume up: takes over its kernel device when one survived (a crash
    /// or an upgrade: mounts and open files stay), creates it again otherwise (a reboot), and
    /// finishes deletes that a crash interrupted. Volumes that cannot come up are FAILED with the
    /// reason.
    /// Returns the volumes that failed; [`Volumes::restore_again`] retries them.
    pub async fn restore(&self) -> Vec<VolumeId> {
        restore::restore(self).await
    }

    /// Tries again to restore the volumes `ids` that are still FAILED (a takeover that failed
    /// half way resumes where it stopped: the device stayed quiesced, nothing was deleted).
    /// Returns those that failed again.
    pub async fn restore_again(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        restore::restore_again(self, ids).await
    }

    /// Waits for volume `id`'s operation lock; changes of `id` run one at a time while it is
    /// held. Locks nobody holds any more are dropped from the table on the way.
    async fn op_lock(&self, id: &VolumeId) -> OwnedMutexGuard<()> {
        crate::seam::schedule_point().await;
        let lock = {
            let mut ops = self.ops.lock().unwrap_or_else(PoisonError::into_inner);
            ops.retain(|_, w| w.strong_count() > 0);
            match ops.get(id).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(Mutex::new(()));
                    ops.insert(id.clone(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// The operation locks of `id` and of `other` (when given and not `id`), taken in id
    /// order: whoever takes two takes them in the same order, so no two changes wait for each
    /// other.
    async fn op_locks(&self, id: &VolumeId, other: Option<&VolumeId>) -> Vec<OwnedMutexGuard<()>> {
        let mut ids: Vec<&VolumeId> = std::iter::once(id).chain(other).collect();
        ids.sort();
        ids.dedup();
        let mut held = Vec::with_capacity(ids.len());
        for id in ids {
            held.push(self.op_lock(id).await);
        }
        held
    }

    fn handle(&self) -> Result<Arc<dyn Devices>, VolumeError> {
        self.handle
            .clone()
            .ok_or_else(|| VolumeError::OpenDataplane(self.no_ublk.clone()))
    }

    pub fn features(&self) -> Option<Features> {
        self.handle.as_ref().map(|h| h.features())
    }

    /// Why this node serves no volumes (the dataplane could not start: no ublk driver, or one
    /// without user recovery); None while it serves.
    pub fn dataplane_error(&self) -> Option<&str> {
        self.handle.is_none().then_some(self.no_ublk.as_str())
    }

    /// Writes `record` to the registry on the blocking pool: a write and two fsyncs, which
    /// must not hold one of the runtime's two threads.
    async fn put_record(&self, record: &VolumeRecord) -> Result<(), VolumeError> {
        let (registry, record) = (self.registry.clone(), record.clone());
        blocking(move || registry.put(&record)).await
    }

    /// Removes volume `id`'s record on the blocking pool (an unlink and an fsync).
    async fn remove_record(&self, id: &VolumeId) -> Result<(), VolumeError> {
        let (registry, id) = (self.registry.clone(), id.clone());
        blocking(move || registry.remove(id.as_str())).await
    }

    /// Puts `old` back, in the registry and the map, after a change (`refused`) that was
    /// recorded and then refused. Should the registry write fail too, the next start would apply the refused
    /// change: the volume says so in its message, with a log line and a count.
    async fn roll_back(&self, old: &VolumeRecord, refused: &VolumeRecord) {
        let put = self.put_record(old).await;
        let mut map = self.inner.lock().await;
        let Some(v) = map.get_mut(&old.id) else {
            return;
        };
        v.record = old.clone();
        if let Err(e) = put {
            // The disk still has the refused record, whose window the next start serves: the
            // map keeps claiming it, or a create could place another volume there meanwhile.
            v.record.backend = refused.backend.clone();
            let why = crate::error::chain(&e);
            self.rollback_failures
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            tracing::error!(volume = %old.id, error = %why, "a refused change could not be taken back from the registry: the next start applies it");
            v.message = format!(
                "a refused change is still recorded ({why}): the next start applies it unless \
                 the change is made again"
            );
        }
    }

    /// Sets a volume's message (its state unchanged) if it still exists.
    pub(super) async fn set_message(&self, id: &VolumeId, message: &str) {
        if let Some(v) = self.inner.lock().await.get_mut(id) {
            v.message = message.to_owned();
        }
    }

    /// Sets a volume's state (and message) if it still exists.
    pub(super) async fn set_state(&self, id: &VolumeId, state: State, message: &str) {
        if let Some(v) = self.inner.lock().await.get_mut(id) {
            v.state = state;
            v.message = message.to_owned();
        }
    }

    /// The lowest ublk device id that neither the kernel nor any record uses.
    fn free_dev_id(&self, map: &BTreeMap<VolumeId, Volume>) -> Result<DevId, VolumeError> {
        let used: std::collections::BTreeSet<DevId> = self
            .handle()?
            .kernel_device_ids()
            .into_iter()
            .chain(map.values().filter_map(|v| v.record.dev_id))
            .collect();
        (0..u32::from(u16::MAX))
            .map(DevId)
            .find(|id| !used.contains(id))
            .ok_or(VolumeError::AllocateDevId)
    }

    fn remove_ram_file(&self, record: &VolumeRecord) {
        if record.backend == BackendRecord::Ram {
            // A step the process may die at like any other (the simulator's seam).
            if !crate::seam::lives() {
                return;
            }
            let path = ram_file(&self.settings.ram_dir, &record.id);
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    tracing::error!(volume = %record.id, path = %path.display(), error = %e, "a deleted RAM volume's memory file could not be removed: its pages stay on tmpfs");
                }
                _ => {}
            }
        }
    }

    /// The daemon's settings, as this manager was made with.
    pub fn settings(&self) -> Arc<Settings> {
        Arc::clone(&self.settings)
    }

    pub async fn get(&self, id: &VolumeId) -> Result<Volume, VolumeError> {
        self.inner
            .lock()
            .await
            .get(id)
            .cloned()
            .ok_or_else(|| VolumeError::LookupVolume(id.clone()))
    }

    pub async fn list(&self) -> Vec<Volume> {
        self.inner.lock().await.values().cloned().collect()
    }

    pub async fn stats(&self, id: &VolumeId) -> Result<DeviceStats, VolumeError> {
        let vol = self.get(id).await?;
        let info = vol.device.ok_or_else(|| VolumeError::NotServing {
            id: id.clone(),
            state: vol.state.name(),
        })?;
        let handle = self.handle()?;
        blocking(move || handle.stats(info.dev_id)).await
    }

    /// Stats of every volume with a device, for the metrics collector (never blocks on the lock
    /// for long: it copies the list first).
    pub async fn all_stats(&self) -> Vec<(Volume, Option<DeviceStats>)> {
        let vols = self.list().await;
        let Some(handle) = self.handle.clone() else {
            return vols.into_iter().map(|v| (v, None)).collect();
        };
        let mut stats: BTreeMap<DevId, DeviceStats> =
            tokio::task::spawn_blocking(move || handle.stats_all().unwrap_or_default())
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|s| (s.dev_id, s))
                .collect();
        vols.into_iter()
            .map(|v| {
                let st = v.device.as_ref().and_then(|d| stats.remove(&d.dev_id));
                (v, st)
            })
            .collect()
    }
    /// Marks FAILED (with the reason, and a log line) every READY volume one of whose queues
    /// lost its worker to a fatal ring error. Run periodically; cheap (no control command).
    pub async fn check_workers(&self) {
        for (vol, stats) in self.all_stats().await {
            let Some((errno, why)) = stats.and_then(|s| worker_failure(&s.total)) else {
                continue;
            };
            let mut map = self.inner.lock().await;
            let Some(v) = map.get_mut(&vol.record.id) else {
                continue;
            };
            if v.state != State::Ready {
                continue;
            }
            let err = std::io::Error::from_raw_os_error(errno as i32);
            v.state = State::Failed;
            v.message = format!(
                "{why}: {err}; I/O waits until ublkd is restarted and takes the device over"
            );
            tracing::error!(volume = %v.record.id, errno, why, "volume FAILED");
        }
    }

    /// Logs every dataplane clean-up step that failed since the last call (each failure is
    /// also in `ublkd_worker_cleanup_errors_total`), and once each worker that runs unpinned.
    /// Run periodically, with `check_workers`.
    pub async fn check_cleanup(&self) {
        let workers = self.workers().await;
        let control = self.control_cleanup_errors().await;
        let counts = workers
            .iter()
            .flat_map(|w| {
                let cpu = w.cpu.to_string();
                let unpinned = u64::from(!w.pinned);
                std::iter::once((cpu.clone(), "unpinned", unpinned)).chain(
                    w.cleanup_errors
                        .iter()
                        .map(move |&(step, n)| (cpu.clone(), step.name(), n)),
                )
            })
            .chain(
                control
                    .iter()
                    .map(|&(step, n)| ("control".to_owned(), step.name(), n)),
            );
        let mut seen = self
            .cleanup_seen
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for (worker, step, n) in counts {
            let last = seen.insert((worker.clone(), step), n).unwrap_or(0);
            if n <= last {
                continue;
            }
            if step == "unpinned" {
                tracing::warn!(
                    worker = %worker,
                    "a dataplane worker could not be pinned to its CPU: it serves, but the \
                     placement its volumes report is not the one in force"
                );
            } else {
                tracing::warn!(
                    worker = %worker,
                    step,
                    failures = n - last,
                    total = n,
                    "a dataplane clean-up step failed"
                );
            }
        }
    }

    pub async fn control_cleanup_errors(&self) -> Vec<(CleanupStep, u64)> {
        let Some(handle) = self.handle.clone() else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || handle.control_cleanup_errors().unwrap_or_default())
            .await
            .unwrap_or_default()
    }

    pub async fn workers(&self) -> Vec<WorkerSnapshot> {
        let Some(handle) = self.handle.clone() else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || handle.worker_stats().unwrap_or_default())
            .await
            .unwrap_or_default()
    }

    /// On a clean exit: keep every device (quiesced) for the next ublkd, or delete them; the
    /// registry keeps the volumes either way.
    pub async fn shutdown(&self) -> Result<(), VolumeError> {
        let mut map = self.inner.lock().await;
        if let Some(handle) = self.handle.clone() {
            for vol in map.values_mut() {
                vol.device = None;
            }
            match self.settings.on_exit {
                crate::config::OnExit::Keep => blocking(move || handle.shutdown_keep()).await?,
                crate::config::OnExit::Delete => blocking(move || handle.shutdown()).await?,
            }
        }
        Ok(())
    }
}

/// Why a volume's queues can no longer serve it, from its statistics: a stopped worker, or a
/// request whose completion the kernel refused (it hangs until a takeover reissues it).
fn worker_failure(total: &ublkd_dataplane::stats::StatsSnapshot) -> Option<(u64, &'static str)> {
    if total.worker_failed_errno != 0 {
        return Some((
            total.worker_failed_errno,
            "the dataplane worker serving this volume stopped",
        ));
    }
    (total.commit_refused_errno != 0).then_some((
        total.commit_refused_errno,
        "the kernel refused the completion of one of this volume's requests, which cannot \
         complete from this process",
    ))
}

fn is_id_taken(e: &DataplaneError) -> bool {
    use std::error::Error;
    let mut cur: Option<&dyn Error> = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            return io.raw_os_error() == Some(17); // EEXIST
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use std::time::Duration;

    /// A stopped worker, or a request whose completion the kernel refused (review L8), each
    /// fails the volume with its own reason; neither is nothing.
    #[test]
    fn a_refused_commit_is_a_reason_to_fail_the_volume() {
        let mut total = ublkd_dataplane::StatsSnapshot::default();
        assert_eq!(worker_failure(&total), None);
        total.commit_refused_errno = 22;
        let (errno, why) = worker_failure(&total).unwrap();
        assert_eq!(errno, 22);
        assert!(why.contains("refused the completion"), "{why}");
        total.worker_failed_errno = 5;
        assert!(worker_failure(&total).unwrap().1.contains("worker"));
    }

    fn volumes(dir: &std::path::Path) -> Volumes {
        Volumes::new(
            Err(DataplaneError::Gone),
            crate::record::volume_registry(dir).unwrap(),
            Registry::open_dir(dir.join("snapshots")).unwrap(),
            Registry::open_dir(dir.join("intents")).unwrap(),
            Arc::new(Settings::default()),
        )
    }

    #[tokio::test]
    async fn changes_of_one_volume_wait_for_each_other_and_of_two_do_not() {
        let dir = tempfile::tempdir().unwrap();
        let v = volumes(dir.path());
        let (a, b) = (VolumeId::parse("a").unwrap(), VolumeId::parse("b").unwrap());
        let held = v.op_lock(&a).await;
        let same = tokio::time::timeout(Duration::from_millis(50), v.op_lock(&a)).await;
        assert!(same.is_err(), "a second change of a waits");
        let other = tokio::time::timeout(Duration::from_millis(50), v.op_lock(&b)).await;
        assert!(other.is_ok(), "a change of b does not wait for a");
        drop(other);
        // The map stays readable while a change holds its volume.
        assert!(tokio::time::timeout(Duration::from_millis(50), v.list())
            .await
            .is_ok());
        drop(held);
        let again = tokio::time::timeout(Duration::from_millis(50), v.op_lock(&a)).await;
        assert!(again.is_ok(), "free again once released");
        drop(again);
        // Unheld locks leave the table.
        let _c = v.op_lock(&VolumeId::parse("c").unwrap()).await;
        assert_eq!(v.ops.lock().unwrap().len(), 1);
    }
}
