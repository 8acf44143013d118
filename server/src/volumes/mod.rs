//! The volume manager: the registry of desired volumes and the dataplane devices serving them.
//!
//! One lock orders every change; dataplane calls (which block on the control thread) run on
//! tokio's blocking pool so the RPC threads never stall.

use crate::config::Settings;
use crate::error::VolumeError;
use crate::registry::{BackendRecord, Registry, VolumeRecord};
use crate::volume::{ram_file, State, Volume};
use crate::volume_id::VolumeId;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::Mutex;
use ublkd_dataplane::{
    DataplaneError, DevId, DeviceInfo, DeviceSpec, DeviceStats, Features, Handle, KernelDevice,
    WorkerSnapshot,
};

/// Upper bounds (seconds) of the recovery-duration histogram.
pub const RECOVERY_BOUNDS: [f64; 10] = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

/// Counters of device take-overs after a restart or crash.
#[derive(Debug, Default)]
pub struct RecoveryStats {
    pub total: AtomicU64,
    pub buckets: [AtomicU64; 11],
    pub sum_ns: AtomicU64,
}

impl RecoveryStats {
    fn record(&self, took: Duration) {
        self.total.fetch_add(1, Ordering::Relaxed);
        let secs = took.as_secs_f64();
        let b = RECOVERY_BOUNDS
            .iter()
            .position(|&ub| secs <= ub)
            .unwrap_or(RECOVERY_BOUNDS.len());
        self.buckets[b].fetch_add(1, Ordering::Relaxed);
        self.sum_ns
            .fetch_add(took.as_nanos() as u64, Ordering::Relaxed);
    }
}

#[derive(Debug)]
pub struct Volumes {
    handle: Option<Handle>,
    no_ublk: String,
    registry: Registry,
    settings: Arc<Settings>,
    inner: Mutex<BTreeMap<VolumeId, Volume>>,
    pub recoveries: RecoveryStats,
}

/// Test hook: `UBLKD_FAULT_POINT=<point>` makes ublkd die (abort, no cleanup, as kill -9) when it
/// reaches `<point>`, e.g. `create:after_device`. Used by the crash-consistency tests.
fn fault_point(point: &str) {
    if cfg!(feature = "test-hooks") && std::env::var("UBLKD_FAULT_POINT").is_ok_and(|p| p == point)
    {
        eprintln!("ublkd: fault point {point} reached: aborting");
        std::process::abort();
    }
}

/// Two records describe the same volume if everything but bookkeeping matches.
fn same_spec(a: &VolumeRecord, b: &VolumeRecord) -> bool {
    VolumeRecord {
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        ..a.clone()
    } == VolumeRecord {
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        ..b.clone()
    }
}

fn now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as i64)
}

async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, DataplaneError> + Send + 'static,
) -> Result<T, VolumeError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| VolumeError::JoinDataplaneTask(e.to_string()))?
        .map_err(VolumeError::from)
}

impl Volumes {
    /// Starts over the given dataplane (None when the kernel has no ublk: every volume call then
    /// fails with FAILED_PRECONDITION, but the daemon still answers).
    pub fn new(
        handle: Result<Handle, DataplaneError>,
        registry: Registry,
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
            settings,
            inner: Mutex::new(BTreeMap::new()),
            recoveries: RecoveryStats::default(),
        }
    }

    fn handle(&self) -> Result<Handle, VolumeError> {
        self.handle
            .clone()
            .ok_or_else(|| VolumeError::OpenDataplane(self.no_ublk.clone()))
    }

    pub fn features(&self) -> Option<Features> {
        self.handle.as_ref().map(Handle::features)
    }

    /// Loads the registry: every volume appears (as RECOVERING) before any is brought up, so
    /// clients see the whole node at once. `restore` then brings them up.
    pub async fn load(&self) -> Result<(), VolumeError> {
        let (records, report) = self.registry.load()?;
        for path in &report.corrupt {
            tracing::warn!(path = %path.display(), "unreadable volume record moved aside");
        }
        let mut map = self.inner.lock().await;
        for record in records {
            map.insert(
                record.id.clone(),
                Volume {
                    record,
                    state: State::Recovering,
                    device: None,
                    message: String::new(),
                },
            );
        }
        Ok(())
    }

    /// Brings every loaded volume up: takes over its kernel device when one survived (a crash
    /// or an upgrade: mounts and open files stay), creates it again otherwise (a reboot), and
    /// finishes deletes that a crash interrupted. Volumes that cannot come up are FAILED with the
    /// reason.
    /// Returns the volumes that failed; [`Volumes::restore_again`] retries them.
    pub async fn restore(&self) -> Vec<VolumeId> {
        let ids: Vec<VolumeId> = self.inner.lock().await.keys().cloned().collect();
        self.restore_ids(ids).await
    }

    /// Tries again to restore the volumes `ids` that are still FAILED (a takeover that failed
    /// half way resumes where it stopped: the device stayed quiesced, nothing was deleted).
    /// Returns those that failed again.
    pub async fn restore_again(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        let map = self.inner.lock().await;
        let ids: Vec<VolumeId> = ids
            .into_iter()
            .filter(|id| map.get(id).is_some_and(|v| v.state == State::Failed))
            .collect();
        drop(map);
        self.restore_ids(ids).await
    }

    async fn restore_ids(&self, ids: Vec<VolumeId>) -> Vec<VolumeId> {
        let mut failed = Vec::new();
        let kernel: BTreeMap<DevId, KernelDevice> = match self.handle() {
            Ok(h) => blocking(move || h.kernel_devices())
                .await
                .unwrap_or_default()
                .into_iter()
                .map(|d| (d.dev_id, d))
                .collect(),
            Err(_) => BTreeMap::new(),
        };
        for id in ids {
            let mut map = self.inner.lock().await;
            let Some(vol) = map.get(&id).cloned() else {
                continue;
            };
            let started = Instant::now();
            let outcome = self.restore_one(&vol.record, &kernel).await;
            match outcome {
                Ok(None) => {
                    map.remove(&id);
                    tracing::info!(volume = %id, "interrupted delete finished");
                }
                Ok(Some((info, recovered))) => {
                    if recovered {
                        self.recoveries.record(started.elapsed());
                    }
                    tracing::info!(
                        volume = %id,
                        device = %info.block_device.display(),
                        recovered,
                        took_ms = started.elapsed().as_millis() as u64,
                        "volume serving again"
                    );
                    if let Some(v) = map.get_mut(&id) {
                        v.record.dev_id = Some(info.dev_id);
                        v.state = State::Ready;
                        v.device = Some(info);
                        v.message.clear();
                        if let Err(e) = self.registry.put(&v.record) {
                            tracing::warn!(volume = %id, error = %crate::error::chain(&e), "cannot update record");
                        }
                    }
                }
                Err(e) => {
                    let message = crate::error::chain(&e);
                    tracing::error!(volume = %id, error = %message, "volume could not be restored; retrying");
                    if let Some(v) = map.get_mut(&id) {
                        v.state = State::Failed;
                        v.message = message;
                    }
                    failed.push(id);
                }
            }
        }
        failed
    }

    /// Ok(None): the volume was being deleted and now is gone. Ok(Some((device, recovered))).
    async fn restore_one(
        &self,
        record: &VolumeRecord,
        kernel: &BTreeMap<DevId, KernelDevice>,
    ) -> Result<Option<(DeviceInfo, bool)>, VolumeError> {
        let handle = self.handle()?;
        let existing = record
            .dev_id
            .and_then(|id| kernel.get(&id))
            .filter(|d| !d.owned);
        if record.deleting {
            if let Some(dev) = existing {
                let (h, id) = (handle.clone(), dev.dev_id);
                blocking(move || h.delete_foreign_device(id)).await?;
            }
            self.registry.remove(&record.id)?;
            self.remove_ram_file(record);
            return Ok(None);
        }
        if existing.is_some() {
            let spec = crate::convert::device_spec(record, &self.settings.ram_dir);
            let h = handle.clone();
            match blocking(move || h.recover_device(spec)).await {
                Ok(info) => return Ok(Some((info, true))),
                Err(VolumeError::Dataplane(DataplaneError::NotRecoverable { dev_id, why })) => {
                    tracing::warn!(volume = %record.id, %dev_id, why, "device cannot be taken over: creating it again");
                    let h = handle.clone();
                    let _ = blocking(move || h.delete_foreign_device(dev_id)).await;
                }
                Err(e) => return Err(e),
            }
        }
        self.bring_up(record).await.map(|i| Some((i, false)))
    }

    /// Creates the device for `record`, with its recorded kernel id when it has one (and any
    /// free id if something else took that one meanwhile; the caller records the id it got).
    async fn bring_up(&self, record: &VolumeRecord) -> Result<DeviceInfo, VolumeError> {
        let handle = self.handle()?;
        let spec = crate::convert::device_spec(record, &self.settings.ram_dir);
        let h = handle.clone();
        let s = spec.clone();
        match blocking(move || h.add_device(s)).await {
            Err(VolumeError::Dataplane(e)) if spec.dev_id.is_some() && is_id_taken(&e) => {
                let spec = DeviceSpec {
                    dev_id: None,
                    ..spec
                };
                blocking(move || handle.add_device(spec)).await
            }
            other => other,
        }
    }

    /// The lowest ublk device id that neither the kernel nor any record uses.
    fn free_dev_id(&self, map: &BTreeMap<VolumeId, Volume>) -> Result<DevId, VolumeError> {
        self.handle()?;
        let used: std::collections::BTreeSet<DevId> = ublkd_dataplane::kernel_device_ids()
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
            let _ = std::fs::remove_file(ram_file(&self.settings.ram_dir, &record.id));
        }
    }

    pub async fn create(&self, mut record: VolumeRecord) -> Result<Volume, VolumeError> {
        let mut map = self.inner.lock().await;
        if let Some(existing) = map.get(&record.id) {
            if same_spec(&existing.record, &record) {
                return Ok(existing.clone());
            }
            return Err(VolumeError::CreateConflict(record.id));
        }
        if map.len() >= self.settings.limits.max_volumes {
            return Err(VolumeError::AdmitVolumeLimit(map.len()));
        }
        if let BackendRecord::File { path, .. } = &record.backend {
            if let Some(other) = map.values().find(
                |v| matches!(&v.record.backend, BackendRecord::File { path: p, .. } if p == path),
            ) {
                return Err(VolumeError::AdmitBackingInUse {
                    path: path.clone(),
                    by: other.record.id.clone(),
                });
            }
        }
        self.handle()?;
        let created_file = self.prepare_backing_file(&record)?;
        record.created_unix_ms = now_ms();
        record.dev_id = Some(self.free_dev_id(&map)?);
        fault_point("create:before_record");
        // The record (with the device id it will get) goes first: a crash from here on leaves a
        // registered volume whose device the next start takes over or creates, never a device
        // nobody owns.
        self.registry.put(&record)?;
        fault_point("create:after_record");
        match self.bring_up(&record).await {
            Ok(info) => {
                fault_point("create:after_device");
                record.dev_id = Some(info.dev_id);
                self.registry.put(&record)?;
                let vol = Volume::ready(record, info);
                map.insert(vol.record.id.clone(), vol.clone());
                Ok(vol)
            }
            Err(e) => {
                let _ = self.registry.remove(&record.id);
                if let (Some(path), BackendRecord::File { .. }) = (created_file, &record.backend) {
                    let _ = std::fs::remove_file(path);
                }
                self.remove_ram_file(&record);
                Err(e)
            }
        }
    }

    /// Creates a missing backing file when asked to; returns its path if this call created it.
    fn prepare_backing_file(&self, record: &VolumeRecord) -> Result<Option<PathBuf>, VolumeError> {
        let BackendRecord::File { path, create } = &record.backend else {
            return Ok(None);
        };
        if !*create || path.exists() {
            return Ok(None);
        }
        let err = |source| VolumeError::PrepareBackingFile {
            path: path.clone(),
            source,
        };
        let f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(err)?;
        f.set_len(record.size_bytes).map_err(err)?;
        f.sync_all().map_err(err)?;
        Ok(Some(path.clone()))
    }

    /// Deletes volume `id`; Ok(false) when it did not exist and `allow_missing` was set.
    pub async fn delete(&self, id: &VolumeId, allow_missing: bool) -> Result<bool, VolumeError> {
        let mut map = self.inner.lock().await;
        let Some(vol) = map.get_mut(id) else {
            return if allow_missing {
                Ok(false)
            } else {
                Err(VolumeError::LookupVolume(id.clone()))
            };
        };
        if let Some(info) = &vol.device {
            if let Some(at) = mounted_at(&info.block_device) {
                return Err(VolumeError::DeleteMounted {
                    id: id.clone(),
                    device: info.block_device.clone(),
                    at,
                });
            }
            let handle = self.handle()?;
            let dev_id = info.dev_id;
            vol.state = State::Deleting;
            // Persist the intent: a crash during the delete is finished by the next start.
            let mut record = vol.record.clone();
            record.deleting = true;
            self.registry.put(&record)?;
            fault_point("delete:after_mark");
            if let Err(e) = blocking(move || handle.delete_device(dev_id)).await {
                vol.state = State::Failed;
                vol.message = crate::error::chain(&e);
                return Err(e);
            }
            fault_point("delete:after_device");
        }
        self.registry.remove(id)?;
        if let Some(vol) = map.remove(id) {
            self.remove_ram_file(&vol.record);
        }
        Ok(true)
    }

    pub async fn resize(&self, id: &VolumeId, size: u64) -> Result<Volume, VolumeError> {
        let mut map = self.inner.lock().await;
        let vol = map
            .get_mut(id)
            .ok_or_else(|| VolumeError::LookupVolume(id.clone()))?;
        crate::validate::size(size, vol.record.block_size, &self.settings)?;
        if size < vol.record.size_bytes {
            return Err(VolumeError::ResizeShrink {
                id: id.clone(),
                from: vol.record.size_bytes,
                to: size,
            });
        }
        if size == vol.record.size_bytes {
            return Ok(vol.clone());
        }
        let Some(info) = vol.device.clone() else {
            return Err(VolumeError::NotServing {
                id: id.clone(),
                state: vol.state.name(),
            });
        };
        if let BackendRecord::File { path, create } = &vol.record.backend {
            let len = std::fs::metadata(path)
                .map_err(|source| VolumeError::PrepareBackingFile {
                    path: path.clone(),
                    source,
                })?
                .len();
            if len < size {
                if !create || !path.is_file() {
                    return Err(VolumeError::GrowBackingFile {
                        path: path.clone(),
                        len,
                        size,
                    });
                }
                let f = std::fs::OpenOptions::new()
                    .write(true)
                    .open(path)
                    .and_then(|f| f.set_len(size).and_then(|()| f.sync_all()));
                f.map_err(|source| VolumeError::PrepareBackingFile {
                    path: path.clone(),
                    source,
                })?;
            }
        }
        let handle = self.handle()?;
        // The new size is recorded first: after a crash the next start applies it.
        let mut record = vol.record.clone();
        record.size_bytes = size;
        self.registry.put(&record)?;
        fault_point("resize:after_record");
        match blocking(move || handle.resize_device(info.dev_id, size)).await {
            Ok(updated) => {
                fault_point("resize:after_device");
                vol.record = record;
                vol.device = Some(updated);
                Ok(vol.clone())
            }
            Err(e) => {
                let _ = self.registry.put(&vol.record);
                Err(e)
            }
        }
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
            let Some(errno) = stats
                .map(|s| s.total.worker_failed_errno)
                .filter(|&e| e != 0)
            else {
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
                "the dataplane worker serving this volume stopped: {err}; \
                 I/O waits until ublkd is restarted and takes the device over"
            );
            tracing::error!(volume = %v.record.id, errno, "a dataplane worker stopped: volume FAILED");
        }
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

    /// ublk devices in the kernel that no registered volume owns.
    pub async fn orphans(&self) -> Vec<KernelDevice> {
        let Some(handle) = self.handle.clone() else {
            return Vec::new();
        };
        let map = self.inner.lock().await;
        let known: std::collections::BTreeSet<DevId> =
            map.values().filter_map(|v| v.record.dev_id).collect();
        drop(map);
        blocking(move || handle.kernel_devices())
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|d| !d.owned && !known.contains(&d.dev_id))
            .collect()
    }

    /// Takes over orphan device `dev_id` as volume `record` (whose spec was checked).
    pub async fn adopt(
        &self,
        dev_id: DevId,
        mut record: VolumeRecord,
    ) -> Result<Volume, VolumeError> {
        let orphan = self
            .orphans()
            .await
            .into_iter()
            .find(|d| d.dev_id == dev_id)
            .ok_or(VolumeError::LookupOrphan(dev_id))?;
        let mut map = self.inner.lock().await;
        if map.contains_key(&record.id) {
            return Err(VolumeError::AdoptConflict(record.id));
        }
        if record.size_bytes == 0 {
            record.size_bytes = orphan.size_bytes;
        }
        record.dev_id = Some(dev_id);
        record.created_unix_ms = now_ms();
        self.prepare_backing_file(&record)?;
        let handle = self.handle()?;
        let spec = crate::convert::device_spec(&record, &self.settings.ram_dir);
        let started = Instant::now();
        let info = blocking(move || handle.recover_device(spec)).await?;
        self.recoveries.record(started.elapsed());
        self.registry.put(&record)?;
        let vol = Volume::ready(record, info);
        map.insert(vol.record.id.clone(), vol.clone());
        Ok(vol)
    }

    /// Deletes orphan device `dev_id`.
    pub async fn delete_orphan(&self, dev_id: DevId) -> Result<(), VolumeError> {
        if !self.orphans().await.iter().any(|d| d.dev_id == dev_id) {
            return Err(VolumeError::LookupOrphan(dev_id));
        }
        let handle = self.handle()?;
        blocking(move || handle.delete_foreign_device(dev_id)).await
    }
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

/// Where `dev` is mounted, if it is (read from /proc/self/mountinfo by device number).
fn mounted_at(dev: &std::path::Path) -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let rdev = std::fs::metadata(dev).ok()?.rdev();
    let (major, minor) = (
        (rdev >> 8) & 0xfff,
        (rdev & 0xff) | ((rdev >> 12) & 0xfff00),
    );
    let want = format!("{major}:{minor}");
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    info.lines().find_map(|l| {
        let mut f = l.split(' ');
        let dev = f.nth(2)?;
        let _root = f.next()?;
        let at = f.next()?;
        (dev == want).then(|| at.to_owned())
    })
}
