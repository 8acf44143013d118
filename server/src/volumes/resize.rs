//! Resizing a volume: admitted as a create is (memory, file space, the NVMe window), its
//! backing file grown, the new size recorded, the new range erased, then the device told; a
//! refused resize puts the old record back.

use super::plane::Plane;
use super::pool::blocking;
use super::store::Store;
use super::table::Table;
use super::{create, erase, namespace};
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::error::VolumeError;
use crate::hooks::{fault_point, Point};
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use ublkd_dataplane::Growth;

pub(super) async fn resize(
    table: &Table,
    store: &Store,
    plane: &Plane,
    settings: &Settings,
    id: &VolumeId,
    size: u64,
) -> Result<Volume, VolumeError> {
    let _op = table.op_lock(id).await;
    let vol = table.get(id).await?;
    crate::validate::size(size, vol.record.block_size, settings)?;
    if size < vol.record.size_bytes {
        return Err(VolumeError::ResizeShrink {
            id: id.clone(),
            from: vol.record.size_bytes,
            to: size,
        });
    }
    if size == vol.record.size_bytes {
        return Ok(vol);
    }
    let Some(info) = vol.device.clone() else {
        return Err(VolumeError::NotServing {
            id: id.clone(),
            state: vol.state.name(),
        });
    };
    let handle = plane.handle()?;
    // The new size is recorded first: after a crash the next start applies it.
    let mut record = vol.record.clone();
    record.size_bytes = size;
    // An NVMe window of a fixed length grows with the volume (the dataplane refuses if
    // another volume's window is in the way); the blocks it grows onto may hold a deleted
    // volume's data, erased before the device's size reaches them. Recorded as pending, so
    // that a crash before the erase is done makes the next start erase them.
    if let BackendRecord::Nvme {
        offset,
        length,
        keep_data,
        ..
    } = &mut record.backend
    {
        if *length != 0 && *length < size {
            if !*keep_data {
                record.erase_pending = Some(crate::record::EraseRange {
                    from: offset.saturating_add(*length),
                    to: offset.saturating_add(size),
                });
            }
            *length = size;
        }
    }
    // A resize is admitted as a create is, under the map lock, before anything grows:
    // ublkd's memory (a RAM volume's pages), the file system's free space (what a file
    // volume's growth may take after every other file volume there), and an NVMe window's
    // growth past the namespace's end or into any other record's window (refused served or
    // not: the dataplane only sees the devices it serves right now).
    let namespace = namespace::of(plane, &record).await?;
    {
        let mut map = table.lock().await;
        create::claim_window(&mut record, namespace, false, &map)?;
        create::admit_memory(settings, &record, &map)?;
        crate::capacity::admit_file_growth(
            &vol.record,
            size,
            &settings.allowed_roots,
            map.values().map(|v| &v.record),
        )?;
        // The grown size and window are claimed from here: a create placing a window, or
        // admitting memory or file space, sees them.
        if let Some(v) = map.get_mut(id) {
            v.record = record.clone();
        }
    }
    if let BackendRecord::File { path, create } = &vol.record.backend {
        let (path, create) = (path.clone(), *create);
        if let Err(e) = blocking(move || grow_backing_file(&path, create, size)).await {
            // Nothing was recorded yet: only the map's claim goes back (a refused change
            // writes nothing).
            if let Some(v) = table.lock().await.get_mut(id) {
                v.record = vol.record.clone();
            }
            return Err(e);
        }
    }
    if let Err(e) = store.put(&record).await {
        store.roll_back(table, &vol.record, &record).await;
        return Err(e);
    }
    fault_point(Point::ResizeAfterRecord);
    // The growth's erase, as a new window's: in chunks on the blocking pool, never on the
    // dataplane's control thread, its progress in the volume's message; then recorded
    // done before the device's size reaches it, so no later start erases the tenant's
    // writes there.
    let growth =
        match (record.erase_pending, crate::windows::nvme_device(&record)) {
            (Some(pending), Some(device)) => {
                let erased =
                    match erase::erase_range(table, plane, id, device, pending, "window's growth")
                        .await
                    {
                        Ok(()) => {
                            record.erase_pending = None;
                            store.put(&record).await
                        }
                        Err(e) => Err(e),
                    };
                if let Err(e) = erased {
                    store.roll_back(table, &vol.record, &record).await;
                    return Err(e);
                }
                Growth::Erased
            }
            _ => Growth::Erase,
        };
    match blocking(move || handle.resize_device(info.dev_id, size, growth)).await {
        Ok(updated) => {
            fault_point(Point::ResizeAfterDevice);
            let mut map = table.lock().await;
            let v = map
                .get_mut(id)
                .ok_or_else(|| VolumeError::LookupVolume(id.clone()))?;
            v.record = record;
            v.device = Some(updated);
            Ok(v.clone())
        }
        Err(e) => {
            store.roll_back(table, &vol.record, &record).await;
            Err(e)
        }
    }
}

/// Makes a file volume's backing file hold at least `size` bytes (only a file ublkd may size:
/// one created with `create`).
fn grow_backing_file(path: &std::path::Path, create: bool, size: u64) -> Result<(), VolumeError> {
    let io = |source| VolumeError::PrepareBackingFile {
        path: path.to_owned(),
        source,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len >= size {
        return Ok(());
    }
    if !create || !path.is_file() {
        return Err(VolumeError::GrowBackingFile {
            path: path.to_owned(),
            len,
            size,
        });
    }
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)
        .and_then(|f| f.set_len(size).and_then(|()| f.sync_all()))
        .map_err(io)
}
