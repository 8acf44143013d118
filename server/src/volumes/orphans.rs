//! What nothing owns: ublk devices in the kernel that no registered volume owns (listing,
//! adopting, deleting), and volumes that no Kubernetes PersistentVolume names (the CSI
//! driver's report, kept to be shown; never acted on).

use super::plane::Plane;
use super::pool::blocking;
use super::pool::now_ms;
use super::restore::RecoveryStats;
use super::store::Store;
use super::table::Table;
use super::{create, namespace};
use crate::config::Settings;
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use std::time::Instant;
use ublkd_dataplane::{DevId, DeviceInfo, KernelDevice};

/// ublk devices in the kernel that no registered volume owns.
pub(super) async fn orphans(table: &Table, plane: &Plane) -> Vec<KernelDevice> {
    let Some(handle) = plane.running() else {
        return Vec::new();
    };
    let map = table.lock().await;
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

/// Replaces the CSI driver's report of the volumes no PersistentVolume names. Ids of no
/// volume here are kept out (the driver's view may be a moment old).
/// Returns the ids that were not in the last report.
pub(super) async fn report_without_pv(
    table: &Table,
    without_pv: &std::sync::Mutex<std::collections::BTreeSet<VolumeId>>,
    ids: Vec<VolumeId>,
) -> Vec<VolumeId> {
    let map = table.lock().await;
    let ids: std::collections::BTreeSet<VolumeId> =
        ids.into_iter().filter(|id| map.contains_key(id)).collect();
    drop(map);
    let mut last = without_pv
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let new = ids.difference(&last).cloned().collect();
    *last = ids;
    new
}

/// The volumes no PersistentVolume names, from the driver's last report, of those that
/// still exist.
pub(super) async fn without_pv(
    table: &Table,
    without_pv: &std::sync::Mutex<std::collections::BTreeSet<VolumeId>>,
) -> Vec<VolumeId> {
    let reported = without_pv
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .clone();
    let map = table.lock().await;
    reported
        .into_iter()
        .filter(|id| map.contains_key(id))
        .collect()
}

/// Takes over orphan device `dev_id` as volume `record` (whose spec was checked).
pub(super) async fn adopt(
    table: &Table,
    store: &Store,
    plane: &Plane,
    settings: &Settings,
    recoveries: &RecoveryStats,
    dev_id: DevId,
    mut record: VolumeRecord,
) -> Result<Volume, VolumeError> {
    let _op = table.op_lock(&record.id).await;
    let orphan = orphans(table, plane)
        .await
        .into_iter()
        .find(|d| d.dev_id == dev_id)
        .ok_or(VolumeError::LookupOrphan(dev_id))?;
    if record.size_bytes == 0 {
        record.size_bytes = orphan.size_bytes;
    }
    record.dev_id = Some(dev_id);
    record.created_unix_ms = now_ms();
    let namespace = namespace::of(plane, &record).await?;
    if let (Some(ns), crate::backend::BackendRecord::Nvme { identity, .. }) =
        (&namespace, &mut record.backend)
    {
        if identity.is_none() {
            identity.clone_from(&ns.identity);
        }
    }
    {
        let mut map = table.lock().await;
        if map.contains_key(&record.id) {
            return Err(VolumeError::AdoptConflict(record.id));
        }
        // The same checks as a create: an adopted device must not serve another record's
        // window or backing file.
        create::admit(settings, &mut record, namespace, false, &map)?;
        map.insert(record.id.clone(), Volume::creating(record.clone()));
    }
    let adopted = take_over(store, plane, settings, recoveries, &record).await;
    create::settle(table, record, adopted).await
}

/// The record goes first (review L4, issue 55): written after the takeover, a failed write
/// left a device served that no record named, its window unclaimed for the next placed create
/// to erase. A crash after the write leaves a record whose device the next start takes over; a
/// takeover that fails removes the record again.
async fn take_over(
    store: &Store,
    plane: &Plane,
    settings: &Settings,
    recoveries: &RecoveryStats,
    record: &VolumeRecord,
) -> Result<DeviceInfo, VolumeError> {
    create::prepare_backing_file(record).await?;
    let handle = plane.handle()?;
    store.put(record).await?;
    let spec = crate::convert::device_spec(record, &settings.ram_dir);
    let started = Instant::now();
    match blocking(move || handle.recover_device(spec)).await {
        Ok(info) => {
            recoveries.record(started.elapsed());
            Ok(info)
        }
        Err(e) => {
            if let Err(r) = store.remove(&record.id).await {
                tracing::error!(volume = %record.id, error = %crate::error::chain(&r), "a failed adopt's record could not be removed: the next start takes the device over");
            }
            Err(e)
        }
    }
}

/// Deletes orphan device `dev_id`.
pub(super) async fn delete_orphan(
    table: &Table,
    plane: &Plane,
    dev_id: DevId,
) -> Result<(), VolumeError> {
    if !orphans(table, plane)
        .await
        .iter()
        .any(|d| d.dev_id == dev_id)
    {
        return Err(VolumeError::LookupOrphan(dev_id));
    }
    let handle = plane.handle()?;
    blocking(move || handle.delete_foreign_device(dev_id)).await
}
