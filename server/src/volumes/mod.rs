//! The volume manager: the registry of desired volumes and the dataplane devices serving them.
//!
//! Two kinds of lock: each volume's operation lock orders the changes of that volume (create,
//! delete, resize, QoS, restore, adopt: one at a time per volume, different volumes in parallel);
//! the map lock is held only to read or record, never across a registry write or a ublk
//! control command, so Get, List and `/metrics` never wait for a slow change. Dataplane calls
//! (which block on the control thread) run on tokio's blocking pool.
//!
//! A change is given the parts it uses, not the manager: the map and its locks (`Table`), the
//! records (`Store`), the dataplane (`Plane`), the snapshots and file intents (`Snaps`), the
//! settings. A QoS change cannot reach the snapshots; an erase cannot write a record.

mod create;
mod delete;
mod erase;
mod namespace;
mod orphans;
mod plane;
mod pool;
mod qos;
mod resize;
mod restore;
mod snapshots;
mod store;
mod table;

#[cfg(test)]
mod ordering;
#[cfg(test)]
mod sim;

use crate::config::Settings;
use crate::devices::Devices;
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::registry::Registry;
use crate::snapshot::{FileIntent, SnapshotId, SnapshotRecord};
use crate::volume::{State, Volume};
use crate::volume_id::VolumeId;
use plane::Plane;
use pool::blocking;
pub use restore::{RecoveryStats, RECOVERY_BOUNDS_NS};
use snapshots::Snaps;
use std::collections::BTreeMap;
use store::Store;
use table::Table;

use std::sync::Arc;
use ublkd_dataplane::stats::CleanupStep;
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceStats, Features, KernelDevice, QosLimits, WorkerSnapshot,
};

/// The manager, in parts: a change takes only the parts it uses (`Table`, `Store`, `Plane`,
/// the snapshots, the settings), never the whole.
#[derive(Debug)]
pub struct Volumes {
    table: Table,
    store: Store,
    plane: Plane,
    snaps: Snaps,
    settings: Arc<Settings>,
    pub recoveries: RecoveryStats,
    /// The dataplane's clean-up failures and unpinned workers as last logged, by worker (its
    /// CPU, or `control`) and step: `check_workers` logs what rose since.
    cleanup_seen: std::sync::Mutex<BTreeMap<(String, &'static str), u64>>,
    /// The volumes no PersistentVolume names, as the CSI driver last reported them
    /// (`orphans::report_without_pv`); never acted on.
    without_pv: std::sync::Mutex<std::collections::BTreeSet<VolumeId>>,
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
        Self {
            table: Table::default(),
            store: Store::new(registry),
            plane: Plane::new(handle),
            snaps: Snaps::new(snapshot_registry, intents),
            settings,
            recoveries: RecoveryStats::default(),
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
        let (t, s, p, f) = (&self.table, &self.store, &self.plane, &self.snaps);
        create::create(t, s, p, f, &self.settings, record, place_window).await
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
        let (t, s, p, f) = (&self.table, &self.store, &self.plane, &self.snaps);
        let how = delete::How {
            allow_missing,
            delete_backing,
            force,
        };
        delete::delete(t, s, p, f, &self.settings, id, how).await
    }

    /// Grows volume `id` to `size` bytes (a volume never shrinks).
    pub async fn resize(&self, id: &VolumeId, size: u64) -> Result<Volume, VolumeError> {
        resize::resize(
            &self.table,
            &self.store,
            &self.plane,
            &self.settings,
            id,
            size,
        )
        .await
    }

    /// Replaces a volume's I/O limits: recorded first (a restart applies them), then handed to
    /// the dataplane if the volume is being served. A volume not being served (FAILED, or
    /// waiting for recovery) keeps them for when it is.
    pub async fn set_qos(&self, id: &VolumeId, qos: QosLimits) -> Result<Volume, VolumeError> {
        qos::set_qos(&self.table, &self.store, &self.plane, id, qos).await
    }

    /// ublk devices in the kernel that no registered volume owns.
    pub async fn orphans(&self) -> Vec<KernelDevice> {
        orphans::orphans(&self.table, &self.plane).await
    }

    /// Replaces the CSI driver's report of the volumes no PersistentVolume names. Ids of no
    /// volume here are kept out (the driver's view may be a moment old).
    /// Returns the ids that were not in the last report.
    pub async fn report_without_pv(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        orphans::report_without_pv(&self.table, &self.without_pv, ids).await
    }

    /// The volumes no PersistentVolume names, from the driver's last report, of those that
    /// still exist.
    pub async fn without_pv(&self) -> Vec<VolumeId> {
        orphans::without_pv(&self.table, &self.without_pv).await
    }

    /// Takes over orphan device `dev_id` as volume `record` (whose spec was checked).
    pub async fn adopt(&self, dev_id: DevId, record: VolumeRecord) -> Result<Volume, VolumeError> {
        let (t, s, p) = (&self.table, &self.store, &self.plane);
        orphans::adopt(t, s, p, &self.settings, &self.recoveries, dev_id, record).await
    }

    /// Deletes orphan device `dev_id`.
    pub async fn delete_orphan(&self, dev_id: DevId) -> Result<(), VolumeError> {
        orphans::delete_orphan(&self.table, &self.plane, dev_id).await
    }

    /// Takes snapshot `id` of file volume `source`; the existing one if `id` was already taken
    /// of the same volume.
    pub async fn create_snapshot(
        &self,
        id: SnapshotId,
        source: VolumeId,
    ) -> Result<SnapshotRecord, VolumeError> {
        snapshots::create_snapshot(&self.table, &self.plane, &self.snaps, id, source).await
    }

    /// Deletes snapshot `id` and its copy; Ok(false) if it did not exist and `allow_missing`.
    pub async fn delete_snapshot(
        &self,
        id: &SnapshotId,
        allow_missing: bool,
    ) -> Result<bool, VolumeError> {
        snapshots::delete_snapshot(&self.snaps, id, allow_missing).await
    }

    /// Snapshots, by id, optionally only `id` or only those of volume `source`.
    pub async fn list_snapshots(
        &self,
        id: Option<&str>,
        source: Option<&str>,
    ) -> Vec<SnapshotRecord> {
        snapshots::list_snapshots(&self.snaps, id, source).await
    }

    /// Loads the registry: every volume appears (as RECOVERING) before any is brought up, so
    /// clients see the whole node at once. `restore` then brings them up.
    pub async fn load(&self) -> Result<(), VolumeError> {
        restore::load(&self.table, &self.store, &self.snaps).await
    }

    /// Brings every loaded volume up: takes over its kernel device when one survived (a crash
    /// or an upgrade: mounts and open files stay), creates it again otherwise (a reboot), and
    /// finishes deletes that a crash interrupted. Volumes that cannot come up are FAILED with the
    /// reason.
    /// Returns the volumes that failed; [`Volumes::restore_again`] retries them.
    pub async fn restore(&self) -> Vec<VolumeId> {
        restore::restore(
            &self.table,
            &self.store,
            &self.plane,
            &self.snaps,
            &self.settings,
            &self.recoveries,
        )
        .await
    }

    /// Tries again to restore the volumes `ids` that are still FAILED (a takeover that failed
    /// half way resumes where it stopped: the device stayed quiesced, nothing was deleted).
    /// Returns those that failed again.
    pub async fn restore_again(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        let (t, s, p, f) = (&self.table, &self.store, &self.plane, &self.snaps);
        restore::restore_again(t, s, p, f, &self.settings, &self.recoveries, ids).await
    }

    pub fn features(&self) -> Option<Features> {
        self.plane.features()
    }

    /// Why this node serves no volumes (the dataplane could not start: no ublk driver, or one
    /// without user recovery); None while it serves.
    pub fn dataplane_error(&self) -> Option<&str> {
        self.plane.error()
    }

    /// Refused changes whose record could not be put back.
    pub fn rollback_failures(&self) -> u64 {
        self.store
            .rollback_failures
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The daemon's settings, as this manager was made with.
    pub fn settings(&self) -> Arc<Settings> {
        Arc::clone(&self.settings)
    }

    pub async fn get(&self, id: &VolumeId) -> Result<Volume, VolumeError> {
        self.table.get(id).await
    }

    pub async fn list(&self) -> Vec<Volume> {
        self.table.list().await
    }

    pub async fn stats(&self, id: &VolumeId) -> Result<DeviceStats, VolumeError> {
        let vol = self.get(id).await?;
        let info = vol.device.ok_or_else(|| VolumeError::NotServing {
            id: id.clone(),
            state: vol.state.name(),
        })?;
        let handle = self.plane.handle()?;
        blocking(move || handle.stats(info.dev_id)).await
    }

    /// Stats of every volume with a device, for the metrics collector (never blocks on the lock
    /// for long: it copies the list first).
    pub async fn all_stats(&self) -> Vec<(Volume, Option<DeviceStats>)> {
        let vols = self.list().await;
        let Some(handle) = self.plane.running() else {
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
            let mut map = self.table.lock().await;
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
        let Some(handle) = self.plane.running() else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || handle.control_cleanup_errors().unwrap_or_default())
            .await
            .unwrap_or_default()
    }

    pub async fn workers(&self) -> Vec<WorkerSnapshot> {
        let Some(handle) = self.plane.running() else {
            return Vec::new();
        };
        tokio::task::spawn_blocking(move || handle.worker_stats().unwrap_or_default())
            .await
            .unwrap_or_default()
    }

    /// On a clean exit: keep every device (quiesced) for the next ublkd, or delete them; the
    /// registry keeps the volumes either way.
    pub async fn shutdown(&self) -> Result<(), VolumeError> {
        let mut map = self.table.lock().await;
        if let Some(handle) = self.plane.running() {
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
        let held = v.table.op_lock(&a).await;
        let same = tokio::time::timeout(Duration::from_millis(50), v.table.op_lock(&a)).await;
        assert!(same.is_err(), "a second change of a waits");
        let other = tokio::time::timeout(Duration::from_millis(50), v.table.op_lock(&b)).await;
        assert!(other.is_ok(), "a change of b does not wait for a");
        drop(other);
        // The map stays readable while a change holds its volume.
        assert!(tokio::time::timeout(Duration::from_millis(50), v.list())
            .await
            .is_ok());
        drop(held);
        let again = tokio::time::timeout(Duration::from_millis(50), v.table.op_lock(&a)).await;
        assert!(again.is_ok(), "free again once released");
        drop(again);
        // Unheld locks leave the table.
        let _c = v.table.op_lock(&VolumeId::parse("c").unwrap()).await;
        assert_eq!(v.table.op_locks_held(), 1);
    }
}
