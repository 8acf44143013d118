//! Bringing the registry's volumes back at start: take over the devices that survived, create
//! the others again, finish interrupted deletes.

use super::plane::Plane;
use super::pool::blocking;
use super::snapshots::Snaps;
use super::store::Store;
use super::table::Table;
use super::{create, delete, erase, snapshots};
use crate::config::Settings;
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::volume::{State, Volume};
use crate::volume_id::VolumeId;
use std::collections::BTreeMap;
use std::time::Duration;
use std::time::Instant;
use ublkd_dataplane::stats::Histogram;
use ublkd_dataplane::{DataplaneError, DevId, DeviceInfo, KernelDevice};

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
    pub(super) fn record(&self, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        self.durations.observe_shared(&RECOVERY_BOUNDS_NS, ns);
    }
}

/// Loads the registry: every volume appears (as RECOVERING) before any is brought up, so
/// clients see the whole node at once. `restore` then brings them up.
pub(super) async fn load(table: &Table, store: &Store, snaps: &Snaps) -> Result<(), VolumeError> {
    let snapshots_readable = snapshots::load_snapshots(snaps).await?;
    let (records, report) = store.registry().load()?;
    for path in &report.corrupt {
        tracing::warn!(path = %path.display(), "unreadable volume record moved aside");
    }
    let mut map = table.lock().await;
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
    drop(map);
    snapshots::finish_file_intents(table, snaps).await?;
    // A copy whose record could not be read is not a stray: kept for a person to look at.
    if snapshots_readable {
        snapshots::remove_stray_copies(table, snaps).await;
    }
    Ok(())
}

/// Brings every loaded volume up: takes over its kernel device when one survived (a crash
/// or an upgrade: mounts and open files stay), creates it again otherwise (a reboot), and
/// finishes deletes that a crash interrupted. Volumes that cannot come up are FAILED with the
/// reason.
/// Returns the volumes that failed; [`Volumes::restore_again`] retries them.
pub(super) async fn restore(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    recoveries: &RecoveryStats,
) -> Vec<VolumeId> {
    let ids: Vec<VolumeId> = table.lock().await.keys().cloned().collect();
    restore_ids(table, store, plane, snaps, settings, recoveries, ids).await
}

/// Tries again to restore the volumes `ids` that are still FAILED (a takeover that failed
/// half way resumes where it stopped: the device stayed quiesced, nothing was deleted).
/// Returns those that failed again.
pub(super) async fn restore_again(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    recoveries: &RecoveryStats,
    ids: Vec<VolumeId>,
) -> Vec<VolumeId> {
    let map = table.lock().await;
    let ids: Vec<VolumeId> = ids
        .into_iter()
        .filter(|id| map.get(id).is_some_and(|v| v.state == State::Failed))
        .collect();
    drop(map);
    restore_ids(table, store, plane, snaps, settings, recoveries, ids).await
}

async fn restore_ids(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    recoveries: &RecoveryStats,
    ids: Vec<VolumeId>,
) -> Vec<VolumeId> {
    let mut failed = Vec::new();
    let kernel: BTreeMap<DevId, KernelDevice> = match plane.handle() {
        Ok(h) => blocking(move || h.kernel_devices())
            .await
            .unwrap_or_default()
            .into_iter()
            .map(|d| (d.dev_id, d))
            .collect(),
        Err(_) => BTreeMap::new(),
    };
    for id in ids {
        // One volume at a time, each under its own operation lock: the map is locked only
        // to read the record and to store the outcome, so the API stays responsive.
        let _op = table.op_lock(&id).await;
        let Some(vol) = table.lock().await.get(&id).cloned() else {
            continue;
        };
        let started = Instant::now();
        // Admitted as a create is: a limit lowered since (or an upgrade that counts memory
        // otherwise) leaves the volumes past it FAILED with the reason, not ublkd OOM-killed
        // in a loop while it restores them.
        let admitted = match vol.record.deleting {
            true => Ok(()),
            false => admit_memory(table, settings, &vol.record).await,
        };
        let outcome = match admitted {
            Ok(()) => restore_one(table, store, plane, snaps, settings, &vol.record, &kernel).await,
            Err(e) => Err(e),
        };
        let mut map = table.lock().await;
        match outcome {
            Ok(None) => {
                map.remove(&id);
                tracing::info!(volume = %id, "interrupted delete finished");
            }
            Ok(Some((info, recovered))) => {
                if recovered {
                    recoveries.record(started.elapsed());
                }
                tracing::info!(
                    volume = %id,
                    device = %info.block_device.display(),
                    recovered,
                    took_ms = started.elapsed().as_millis() as u64,
                    "volume serving again"
                );
                let Some(v) = map.get_mut(&id) else {
                    continue;
                };
                let moved = v.record.dev_id != Some(info.dev_id);
                v.record.dev_id = Some(info.dev_id);
                v.record.erase_pending = None;
                v.state = State::Ready;
                v.device = Some(info);
                v.message.clear();
                // Made again under another id (its own was taken): recorded off the map
                // lock. Should that fail, the next start looks for the device under the
                // old id and makes it again; the volume says so meanwhile.
                if moved {
                    let record = v.record.clone();
                    drop(map);
                    if let Err(e) = store.put(&record).await {
                        let why = crate::error::chain(&e);
                        tracing::error!(volume = %id, error = %why, "the device id a restored volume got could not be recorded");
                        table
                            .set_message(&id, &format!("its new device id is not recorded ({why})"))
                            .await;
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

/// Whether `record` fits ublkd's memory limit next to the volumes that hold memory now (served,
/// being made or deleted; not those still to restore, nor FAILED ones).
async fn admit_memory(
    table: &Table,
    settings: &Settings,
    record: &VolumeRecord,
) -> Result<(), VolumeError> {
    let map = table.lock().await;
    let holding = map
        .values()
        .filter(|v| v.record.id != record.id)
        .filter(|v| !matches!(v.state, State::Recovering | State::Failed))
        .map(|v| &v.record);
    let limit = settings.memory_limit;
    if let Some(left) = crate::capacity::memory_left(limit, holding) {
        let need = crate::capacity::memory_bytes(record);
        if need > left {
            return Err(VolumeError::AdmitMemoryLimit { need, left });
        }
    }
    Ok(())
}

/// Ok(None): the volume was being deleted and now is gone. Ok(Some((device, recovered))).
async fn restore_one(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    record: &VolumeRecord,
    kernel: &BTreeMap<DevId, KernelDevice>,
) -> Result<Option<(DeviceInfo, bool)>, VolumeError> {
    let handle = plane.handle()?;
    // An NVMe window's namespace where it is this boot (found by its identity), or nothing is
    // served or erased: the volume is FAILED with the reason.
    let record = &super::namespace::relocate(table, store, plane, record).await?;
    let existing = record
        .dev_id
        .and_then(|id| kernel.get(&id))
        .filter(|d| !d.owned);
    if record.deleting {
        if let Some(dev) = existing {
            // The delete that a crash interrupted was admitted when nothing held the device;
            // whatever opened it since is not to be pulled from under. The record keeps its
            // mark and the volume is FAILED with the reason: a delete asked again (with
            // `force` if the opener may lose it) finishes it.
            let device = ublkd_dataplane::block_device(dev.dev_id);
            delete::refuse_if_held(plane, &record.id, &device, false).await?;
            let (h, id) = (handle.clone(), dev.dev_id);
            blocking(move || h.delete_foreign_device(id)).await?;
        }
        delete::erase_deleted_window(table, plane, record).await?;
        delete::remove_backing_file(record).await?;
        delete::forget_file_intent(snaps, &record.id).await?;
        delete::remove_ram_file(&settings.ram_dir, record);
        store.remove(&record.id).await?;
        return Ok(None);
    }
    if let (Some(pending), Some(device)) =
        (record.erase_pending, crate::windows::nvme_device(record))
    {
        // The window (or its growth) was recorded and the process died before its erase
        // was known done. The erase comes before the device appears and before a device's
        // size reaches the growth: a surviving device that big proves it done; otherwise
        // it is done now, before anything serves those blocks.
        // Only a device that is this record's by every parameter it shows proves it: any
        // unowned device with the recorded id (another ublk server's) proves nothing
        // (review L9, issue 55).
        let done = existing.is_some_and(|d| {
            d.size_bytes >= record.size_bytes
                && d.queues == record.queues
                && d.queue_depth == record.queue_depth
        });
        if !done {
            tracing::info!(volume = %record.id, from = pending.from, to = pending.to,
                "finishing an erase the crash interrupted before the window is served");
            erase::erase_range(
                table,
                plane,
                &record.id,
                device,
                pending,
                "interrupted erase",
            )
            .await?;
        }
        // Known erased on disk before the device serves: a pending erase left recorded
        // while the tenant writes would wipe those writes at the next start without a
        // surviving device.
        let mut erased = record.clone();
        erased.erase_pending = None;
        store.put(&erased).await?;
        if let Some(v) = table.lock().await.get_mut(&record.id) {
            v.record.erase_pending = None;
        }
    }
    if existing.is_some() {
        let spec = crate::convert::device_spec(record, &settings.ram_dir);
        let h = handle.clone();
        match blocking(move || h.recover_device(spec)).await {
            Ok(info) => return Ok(Some((info, true))),
            Err(VolumeError::Dataplane(DataplaneError::NotRecoverable { dev_id, why })) => {
                tracing::warn!(volume = %record.id, %dev_id, why, "device cannot be taken over: creating it again");
                let h = handle.clone();
                if let Err(e) = blocking(move || h.delete_foreign_device(dev_id)).await {
                    // The device is made again under another id; this one stays an
                    // orphan (`ublkctl orphans`, `ublkd_orphan_devices`).
                    tracing::warn!(volume = %record.id, %dev_id, error = %crate::error::chain(&e), "the device that cannot be taken over could not be deleted: left as an orphan");
                }
            }
            Err(e) => return Err(e),
        }
    }
    // A restored volume holds its tenant's data: nothing more is erased.
    create::bring_up(table, plane, settings, record)
        .await
        .map(|i| Some((i, false)))
}
