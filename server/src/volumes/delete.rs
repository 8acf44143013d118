//! Deleting a volume: its record marked (with whether its backing file goes too), its device
//! (refused while held open), its NVMe window erased, its backing file (when asked) and RAM
//! file, its record, in that order, so that a crash at any step after the mark leaves a record
//! the next start finishes deleting.

use super::plane::Plane;
use super::pool::blocking;
use super::snapshots::Snaps;
use super::store::Store;
use super::table::Table;
use super::{erase, namespace};
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::error::VolumeError;
use crate::hooks::{fault_point, Point};
use crate::record::VolumeRecord;
use crate::volume::State;
use crate::volume_id::VolumeId;
use ublkd_dataplane::DataplaneError;

/// How a delete goes: Ok(false) when the volume did not exist and `allow_missing` is set; with
/// `delete_backing`, a file volume's backing file goes too; without `force`, a device some
/// process holds open (not exclusively: a VM's disk, a database's raw device) is refused.
#[derive(Debug, Clone, Copy)]
pub(super) struct How {
    pub allow_missing: bool,
    pub delete_backing: bool,
    pub force: bool,
}

/// Deletes volume `id`, as `how` says.
pub(super) async fn delete(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    id: &VolumeId,
    how: How,
) -> Result<bool, VolumeError> {
    let How {
        allow_missing,
        delete_backing,
        force,
    } = how;
    let _op = table.op_lock(id).await;
    let Some(vol) = table.lock().await.get(id).cloned() else {
        return if allow_missing {
            Ok(false)
        } else {
            Err(VolumeError::LookupVolume(id.clone()))
        };
    };
    // The kernel device the record names: the one served, or one left in the kernel that
    // is not served right now (a FAILED takeover, a RECOVERING volume), still mounted
    // perhaps. Either is checked for holders and deleted before the record and the file.
    let served = vol
        .device
        .as_ref()
        .map(|i| (i.dev_id, i.block_device.clone()));
    // Without a dataplane the kernel is still asked: a device it has cannot be deleted
    // then, and the delete fails rather than leave it behind.
    let kernel = || {
        let ids = match &plane.running() {
            Some(devices) => devices.kernel_device_ids(),
            None => ublkd_dataplane::kernel_device_ids(),
        };
        vol.record
            .dev_id
            .filter(|d| ids.contains(d))
            .map(|d| (d, ublkd_dataplane::block_device(d)))
    };
    let device = served.clone().or_else(kernel);
    if let Some((_, block_device)) = &device {
        refuse_if_held(plane, id, block_device, force).await?;
    }
    table.set_state(id, State::Deleting, "").await;
    // Persist the intent before anything is destroyed: a crash during the delete is finished
    // by the next start, the backing file included when it was asked for.
    let mut record = vol.record.clone();
    record.deleting = true;
    record.delete_backing = delete_backing && matches!(record.backend, BackendRecord::File { .. });
    store.put(&record).await?;
    fault_point(Point::DeleteAfterMark);
    if let Some((dev_id, _)) = device {
        let handle = plane.handle()?;
        let deleted = blocking(move || match handle.delete_device(dev_id) {
            // Not the dataplane's (nor being taken over): the kernel's alone when the
            // kernel still has it. An earlier try whose STOP_DEV or DEL_DEV failed took it
            // out of the dataplane's maps and left it there.
            Err(DataplaneError::NoSuchDevice(_))
                if handle.kernel_device_ids().contains(&dev_id) =>
            {
                handle.delete_foreign_device(dev_id)
            }
            other => other,
        })
        .await;
        match deleted {
            Ok(()) => {}
            // A device already gone while deleting: an earlier try took it down (its
            // STOP_DEV outlasted the timeout, then DEL_DEV_ASYNC finished it), so this one
            // is done. Without this a delete that failed once could never succeed.
            Err(VolumeError::Dataplane(DataplaneError::NoSuchDevice(_))) => {
                tracing::info!(volume = %id, dev_id = %dev_id, "device already gone: delete finishes");
            }
            Err(e) => {
                table
                    .set_state(id, State::Failed, &crate::error::chain(&e))
                    .await;
                return Err(e);
            }
        }
        fault_point(Point::DeleteAfterDevice);
    }
    // A deleted tenant's NVMe blocks are erased before its window is free again, so that no
    // later volume (a keep_data one included) reads them. Until then the record stays
    // (marked): a retry, or the next start, finishes the delete.
    if let Err(e) = erase_deleted_window(table, plane, &vol.record).await {
        table
            .set_state(id, State::Failed, &crate::error::chain(&e))
            .await;
        return Err(e);
    }
    // The backing file goes before the record: should its removal fail, the record (and
    // the volume, with the reason) stays, and a retry of the delete finishes it.
    if let Err(e) = remove_backing_file(&record).await {
        table
            .set_state(id, State::Failed, &crate::error::chain(&e))
            .await;
        return Err(e);
    }
    if let Err(e) = forget_file_intent(snaps, id).await {
        table
            .set_state(id, State::Failed, &crate::error::chain(&e))
            .await;
        return Err(e);
    }
    // A RAM volume's memory goes before its record: a crash in between leaves a record
    // whose restore finds an empty file, never a file a later volume of the id would read.
    remove_ram_file(&settings.ram_dir, &vol.record);
    store.remove(id).await?;
    table.lock().await.remove(id);
    Ok(true)
}

/// Removes any file intent of volume `id` before its record goes (review L6, issue 55): an
/// intent left behind (its removal failed after the create, "harmless" while the record
/// lives) would otherwise name, at the next start, a file this delete keeps, and that start
/// would remove it as an interrupted create's.
pub(super) async fn forget_file_intent(snaps: &Snaps, id: &VolumeId) -> Result<(), VolumeError> {
    let (intents, id) = (snaps.intents.clone(), id.clone());
    blocking(move || intents.remove(id.as_str())).await
}

/// Removes the backing file of `record`, marked for deletion with `delete_backing` (nothing
/// otherwise; a file already gone is no error).
pub(super) async fn remove_backing_file(record: &VolumeRecord) -> Result<(), VolumeError> {
    let (true, BackendRecord::File { path, .. }) = (record.delete_backing, &record.backend) else {
        return Ok(());
    };
    let p = path.clone();
    // Unlinking a large file frees its extents: seconds, on the blocking pool.
    blocking(move || match std::fs::remove_file(&p) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(VolumeError::RemoveBackingFile { path: p, source: e })
        }
        _ => Ok(()),
    })
    .await
}

/// Erases the NVMe window of volume `record`, which is being deleted (nothing for other
/// backends, nor for a `keep_data` volume, which never owned the erase of what it found).
pub(super) async fn erase_deleted_window(
    table: &Table,
    plane: &Plane,
    record: &VolumeRecord,
) -> Result<(), VolumeError> {
    let BackendRecord::Nvme {
        device,
        offset,
        length,
        keep_data: false,
        ..
    } = &record.backend
    else {
        return Ok(());
    };
    let len = match *length {
        0 => namespace::of(plane, record)
            .await?
            .map_or(0, |ns| ns.size_bytes.saturating_sub(*offset)),
        len => len,
    };
    if len == 0 {
        return Ok(());
    }
    let range = crate::record::EraseRange {
        from: *offset,
        to: offset.saturating_add(len),
    };
    erase::erase_range(table, plane, &record.id, device, range, "deleted volume").await
}

/// Refuses to delete `block_device` (volume `id`'s) while something holds it: exclusively (a
/// mount in any namespace, an exclusive opener: deleting it would pull the disk from under
/// them), or, unless `force`, a process that opened it without O_EXCL (review L13, issue 55:
/// its next read would fail).
pub(super) async fn refuse_if_held(
    plane: &Plane,
    id: &VolumeId,
    block_device: &std::path::Path,
    force: bool,
) -> Result<(), VolumeError> {
    if plane.handle()?.held_elsewhere(block_device) {
        return Err(VolumeError::DeleteBusy {
            id: id.clone(),
            device: block_device.to_owned(),
        });
    }
    if force {
        return Ok(());
    }
    // A walk of every process's open files (on the blocking pool), only when it can refuse.
    let (h, dev) = (plane.handle()?, block_device.to_owned());
    let by = blocking(move || Ok::<_, VolumeError>(h.opened_by(&dev))).await?;
    if !by.is_empty() {
        return Err(VolumeError::DeleteOpen {
            id: id.clone(),
            device: block_device.to_owned(),
            by: by.join(", "),
        });
    }
    Ok(())
}

/// Removes a deleted RAM volume's memory file from `ram_dir` (a log line if it cannot).
pub(super) fn remove_ram_file(ram_dir: &std::path::Path, record: &VolumeRecord) {
    if record.backend == BackendRecord::Ram {
        // A step the process may die at like any other (the simulator's seam).
        if !crate::seam::lives() {
            return;
        }
        let path = crate::volume::ram_file(ram_dir, &record.id);
        match std::fs::remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                tracing::error!(volume = %record.id, path = %path.display(), error = %e, "a deleted RAM volume's memory file could not be removed: its pages stay on tmpfs");
            }
            _ => {}
        }
    }
}
