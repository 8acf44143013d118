//! Creating a volume, end to end: admit it against the others under the map lock (its NVMe
//! window placed or checked, the node's limit, a backing file nobody else owns), prepare its
//! backing file or clone, record it, erase a new NVMe window, bring its device up, settle the
//! map. Adopting an orphan device shares the admit and settle steps.

use super::plane::Plane;
use super::pool::blocking;
use super::pool::now_ms;
use super::snapshots::Snaps;
use super::store::Store;
use super::table::Table;
use super::{delete, erase, snapshots};
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::error::VolumeError;
use crate::hooks::{delay_point, fault_point, Point};
use crate::record::{SourceRecord, VolumeRecord};
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use std::collections::BTreeMap;
use std::path::PathBuf;
use ublkd_dataplane::{DeviceInfo, DeviceSpec};

/// Creates the volume `record` describes; with `place_window`, ublkd chooses its NVMe
/// window's offset (the first free extent that fits).
pub(super) async fn create(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    mut record: VolumeRecord,
    place_window: bool,
) -> Result<Volume, VolumeError> {
    // The namespace's size, block size and identity, read before any lock (an Identify
    // ioctl): to place the window, to refuse one past its end before anything is recorded,
    // and to record which namespace it is (the path is only this boot's name for it).
    let namespace = super::namespace::adopt_identity(table, plane, settings, &mut record).await?;
    // A clone of a volume holds its source's lock too (its reflink is taken drained), and
    // every two locks are taken in id order: two volumes cloning each other at once wait
    // for each other in turn, never each for the other.
    let source = match &record.source {
        Some(SourceRecord::Volume(v)) => Some(v.clone()),
        _ => None,
    };
    let _ops = table.op_locks(&record.id, source.as_ref()).await;
    {
        let mut map = table.lock().await;
        if let Some(existing) = map.get(&record.id) {
            if place_window {
                // A retry of a placed create matches the window it was given: its offset,
                // and its length when the first asked for none (placed to the size).
                if let (
                    BackendRecord::Nvme { offset, length, .. },
                    BackendRecord::Nvme {
                        offset: placed,
                        length: placed_len,
                        ..
                    },
                ) = (&mut record.backend, &existing.record.backend)
                {
                    *offset = *placed;
                    if *length == 0 {
                        *length = *placed_len;
                    }
                }
            }
            if same_spec(&existing.record, &record) {
                return Ok(existing.clone());
            }
            return Err(VolumeError::CreateConflict(record.id));
        }
        admit(settings, &mut record, namespace.clone(), place_window, &map)?;
        record.erase_pending = new_window_erase(&record, namespace);
        plane.handle()?;
        record.created_unix_ms = now_ms();
        record.dev_id = Some(plane.free_dev_id(&map)?);
        // Held as CREATING from here: the id, the device id and the backing file are taken,
        // and readers see the volume coming.
        map.insert(record.id.clone(), Volume::creating(record.clone()));
    }
    let made = match snapshots::make_clone_file(table, plane, snaps, &record).await {
        Ok(clone) => {
            let made = make(table, store, plane, snaps, settings, &mut record).await;
            if let (Err(_), Some(path)) = (&made, &clone) {
                // The create's own error is what the caller needs; a file left behind
                // keeps its intent, so the next start removes it.
                let path = path.clone();
                if super::pool::unlink(path).await.is_ok() {
                    snapshots::end_file_intent(snaps, &record.id).await;
                }
            } else if clone.is_some() {
                // The record names the file now: it is the volume's.
                snapshots::end_file_intent(snaps, &record.id).await;
            }
            made
        }
        Err(e) => {
            // Nothing was made (or what was is removed): the intent has nothing to name.
            if let BackendRecord::File { path, .. } = &record.backend {
                if record.source.is_some() && !path.exists() {
                    snapshots::end_file_intent(snaps, &record.id).await;
                }
            }
            Err(e)
        }
    };
    settle(table, record, made).await
}

/// What a new volume (created or adopted) must not take from the others, checked under the
/// map lock: its NVMe window (placed when `place`), the node's volume limit, and a backing
/// file another record owns under any name.
pub(super) fn admit(
    settings: &Settings,
    record: &mut VolumeRecord,
    namespace: Option<ublkd_dataplane::Namespace>,
    place: bool,
    map: &BTreeMap<VolumeId, Volume>,
) -> Result<(), VolumeError> {
    claim_window(record, namespace, place, map)?;
    if map.len() >= settings.limits.max_volumes {
        return Err(VolumeError::AdmitVolumeLimit(map.len()));
    }
    admit_memory(settings, record, map)?;
    if let BackendRecord::File { path, .. } = &record.backend {
        if let Some(other) = map.values().find(
            |v| matches!(&v.record.backend, BackendRecord::File { path: p, .. } if same_file(p, path)),
        ) {
            return Err(VolumeError::AdmitBackingInUse {
                path: path.clone(),
                by: other.record.id.clone(),
            });
        }
    }
    Ok(())
}

/// Whether `record` fits ublkd's memory limit next to every other record in `map` (its own
/// entry, when it has one, is left out: a resize admits the volume at its new size). Run
/// under the map lock by every path that makes or grows a volume.
pub(super) fn admit_memory(
    settings: &Settings,
    record: &VolumeRecord,
    map: &BTreeMap<VolumeId, Volume>,
) -> Result<(), VolumeError> {
    let others = map
        .values()
        .map(|v| &v.record)
        .filter(|r| r.id != record.id);
    if let Some(left) = crate::capacity::memory_left(settings.memory_limit, others) {
        let need = crate::capacity::memory_bytes(record);
        if need > left {
            return Err(VolumeError::AdmitMemoryLimit { need, left });
        }
    }
    Ok(())
}

/// An NVMe record's window against its namespace and every other record's window on it,
/// whatever their state: placed in the first free extent with `place` (ublkd places it),
/// else refused when it overlaps one, does not fit the namespace or is smaller than the
/// volume. Run under the map lock.
pub(super) fn claim_window(
    record: &mut VolumeRecord,
    namespace: Option<ublkd_dataplane::Namespace>,
    place: bool,
    map: &BTreeMap<VolumeId, Volume>,
) -> Result<(), VolumeError> {
    let size = record.size_bytes;
    let id = record.id.clone();
    let BackendRecord::Nvme {
        device,
        offset,
        length,
        identity,
        ..
    } = &mut record.backend
    else {
        return Ok(());
    };
    let records = map.values().map(|v| &v.record);
    let claims = crate::windows::claims(device, identity.as_ref(), records, Some(&id));
    if let (true, Some(ns)) = (place, namespace.as_ref()) {
        let block = u64::from(ns.block_size.max(1));
        let asked = if *length == 0 { size } else { *length };
        // Checked: a length near u64::MAX rounds past u64::MAX, never to 0 ("to the end").
        // A length below the volume or past the namespace is refused, as an explicit one is.
        let len = asked
            .checked_next_multiple_of(block)
            .filter(|len| *len >= size && *len <= ns.size_bytes)
            .ok_or_else(|| VolumeError::AdmitWindowPastEnd {
                device: device.clone(),
                offset: *offset,
                len: asked,
                namespace: ns.size_bytes,
            })?;
        *offset = crate::windows::place(&claims, ns.size_bytes, block, len).ok_or_else(|| {
            VolumeError::AdmitNoExtent {
                device: device.clone(),
                len,
            }
        })?;
        *length = len;
        return Ok(());
    }
    if let Some(ns) = namespace.as_ref() {
        // Checked arithmetic: a length near u64::MAX must not wrap to "the end".
        let len = if *length == 0 {
            ns.size_bytes.checked_sub(*offset)
        } else {
            Some(*length)
        };
        let fits = len.is_some_and(|len| {
            len >= size
                && offset
                    .checked_add(len)
                    .is_some_and(|end| end <= ns.size_bytes)
        });
        if !fits {
            return Err(VolumeError::AdmitWindowPastEnd {
                device: device.clone(),
                offset: *offset,
                len: *length,
                namespace: ns.size_bytes,
            });
        }
    }
    match crate::windows::overlap(&claims, *offset, *length) {
        Some(c) => Err(VolumeError::AdmitWindowOverlap {
            device: device.clone(),
            start: c.start.max(*offset),
            end: match (c.end, *length) {
                (Some(e), 0) => e,
                (Some(e), len) => e.min(offset.saturating_add(len)),
                (None, 0) => u64::MAX,
                (None, len) => offset.saturating_add(len),
            },
            by: c.id.clone(),
        }),
        None => Ok(()),
    }
}

/// Ends a create or adopt: the CREATING entry becomes the READY volume, or goes.
pub(super) async fn settle(
    table: &Table,
    record: VolumeRecord,
    made: Result<DeviceInfo, VolumeError>,
) -> Result<Volume, VolumeError> {
    let mut map = table.lock().await;
    match made {
        Ok(info) => {
            let vol = Volume::ready(record, info);
            map.insert(vol.record.id.clone(), vol.clone());
            Ok(vol)
        }
        Err(e) => {
            map.remove(&record.id);
            Err(e)
        }
    }
}

/// The slow part of a create: backing file, record, device. Undoes its own steps on failure.
async fn make(
    table: &Table,
    store: &Store,
    plane: &Plane,
    snaps: &Snaps,
    settings: &Settings,
    record: &mut VolumeRecord,
) -> Result<DeviceInfo, VolumeError> {
    // A file this create makes is ublkd's until the create is done: a crash before its
    // record, or inside the undo of a failed create (record gone, file not yet), leaves an
    // intent with no record, and the next start removes the file. Done, the record names
    // it (a clone's file has its own intent).
    let intent = match &record.backend {
        BackendRecord::File { path, create: true } if record.source.is_none() && !path.exists() => {
            snapshots::begin_file_intent(snaps, &record.id, path).await?;
            Some(path.clone())
        }
        _ => None,
    };
    let made = make_steps(table, store, plane, settings, record).await;
    if let Some(path) = intent {
        // A failed create whose file could not be removed keeps its intent: the next
        // start removes the file.
        if made.is_ok() || !path.exists() {
            snapshots::end_file_intent(snaps, &record.id).await;
        }
    }
    made
}

async fn make_steps(
    table: &Table,
    store: &Store,
    plane: &Plane,
    settings: &Settings,
    record: &mut VolumeRecord,
) -> Result<DeviceInfo, VolumeError> {
    let created_file = prepare_backing_file(record).await?;
    let undo = |record: VolumeRecord| undo(store, settings, record, created_file.clone());
    fault_point(Point::CreateBeforeRecord);
    // The record (with the device id it will get) goes first: a crash from here on leaves a
    // registered volume whose device the next start takes over or creates, never a device
    // nobody owns.
    let recorded = store.put(record).await;
    if let Err(e) = recorded {
        undo(record.clone()).await;
        return Err(e);
    }
    fault_point(Point::CreateAfterRecord);
    delay_point(Point::CreateAfterRecord).await;
    // A new volume: an NVMe window's earlier content is erased before its device appears,
    // here, in chunks, off the dataplane's control thread (which every other volume's
    // changes, drains and statistics wait on), with the progress in the volume's message.
    if let (Some(pending), Some(device)) =
        (record.erase_pending, crate::windows::nvme_device(record))
    {
        if let Err(e) =
            erase::erase_range(table, plane, &record.id, device, pending, "new window").await
        {
            undo(record.clone()).await;
            return Err(e);
        }
        // Known erased on disk before anything can write there: a pending erase recorded
        // after the tenant's first write would wipe that write at the next start.
        record.erase_pending = None;
        if let Err(e) = store.put(record).await {
            undo(record.clone()).await;
            return Err(e);
        }
    }
    // A new RAM volume starts empty: memory an earlier volume of this id left (a crash
    // inside its delete) is not its to read.
    if let Err(e) = fresh_ram_file(settings, record) {
        undo(record.clone()).await;
        return Err(e);
    }
    match bring_up(table, plane, settings, record).await {
        Ok(info) => {
            fault_point(Point::CreateAfterDevice);
            // The device id recorded first was taken meanwhile: the one it got is recorded,
            // or the device goes with the rest of the create (a device no record names
            // would serve a window the map no longer claims).
            if record.dev_id != Some(info.dev_id) {
                record.dev_id = Some(info.dev_id);
                if let Err(e) = store.put(record).await {
                    let (h, dev_id) = (plane.handle()?, info.dev_id);
                    if let Err(d) = blocking(move || h.delete_device(dev_id)).await {
                        tracing::error!(volume = %record.id, %dev_id, error = %crate::error::chain(&d), "a failed create's device could not be deleted: left as an orphan");
                    }
                    undo(record.clone()).await;
                    return Err(e);
                }
            }
            Ok(info)
        }
        Err(e) => {
            undo(record.clone()).await;
            Err(e)
        }
    }
}

/// Takes back what a failed create made: its record, the backing file it created, a RAM
/// volume's file, on the blocking pool. The create's own error is what the caller gets; an
/// undo step that fails too is logged: a record left makes the next start bring the volume
/// up, a file left stays (it is not ublkd's to find again).
async fn undo(
    store: &Store,
    settings: &Settings,
    record: VolumeRecord,
    created_file: Option<PathBuf>,
) {
    if let Err(e) = store.remove(&record.id).await {
        tracing::error!(volume = %record.id, error = %crate::error::chain(&e), "a failed create's record could not be removed: the next start brings the volume up");
    }
    if let (Some(path), BackendRecord::File { .. }) = (created_file, &record.backend) {
        let (id, shown) = (record.id.clone(), path.display().to_string());
        if let Err(e) = super::pool::unlink(path).await {
            tracing::warn!(volume = %id, path = shown, error = %crate::error::chain(&e), "a failed create's backing file could not be removed");
        }
    }
    delete::remove_ram_file(&settings.ram_dir, &record);
}

/// Creates the device for `record`, with its recorded kernel id when it has one (and
/// another id no record and no kernel device has, if something else took that one
/// meanwhile; the caller records the id it got). Never erases: the manager erases a new
/// window's range itself (`erase_range`).
pub(super) async fn bring_up(
    table: &Table,
    plane: &Plane,
    settings: &Settings,
    record: &VolumeRecord,
) -> Result<DeviceInfo, VolumeError> {
    let handle = plane.handle()?;
    let spec = crate::convert::device_spec(record, &settings.ram_dir);
    let h = handle.clone();
    let s = spec.clone();
    match blocking(move || h.add_device(s)).await {
        Err(VolumeError::Dataplane(e)) if spec.dev_id.is_some() && is_id_taken(&e) => {
            // Not any id the kernel would pick: one another record names for a device
            // absent now would be taken over as that volume's after a crash.
            let free = plane.free_dev_id(&*table.lock().await)?;
            let spec = DeviceSpec {
                dev_id: Some(free),
                ..spec
            };
            blocking(move || handle.add_device(spec)).await
        }
        other => other,
    }
}

/// Removes what a RAM volume's file holds before a new volume of that id serves it.
fn fresh_ram_file(settings: &Settings, record: &VolumeRecord) -> Result<(), VolumeError> {
    if record.backend != BackendRecord::Ram {
        return Ok(());
    }
    let path = crate::volume::ram_file(&settings.ram_dir, &record.id);
    match std::fs::remove_file(&path) {
        Ok(()) => {
            tracing::warn!(volume = %record.id, path = %path.display(), "an earlier volume's memory file removed before the new volume uses it");
            Ok(())
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(VolumeError::PrepareBackingFile { path, source }),
    }
}

/// Creates a missing backing file when asked to; returns its path if this call created it.
/// On the blocking pool: an fsync.
pub(super) async fn prepare_backing_file(
    record: &VolumeRecord,
) -> Result<Option<PathBuf>, VolumeError> {
    let record = record.clone();
    blocking(move || make_backing_file(&record)).await
}

/// What a new NVMe window must have erased before it is served: the whole window, unless the
/// volume keeps the data it finds. `namespace` is needed for a window "to the end" (length 0).
fn new_window_erase(
    record: &VolumeRecord,
    namespace: Option<ublkd_dataplane::Namespace>,
) -> Option<crate::record::EraseRange> {
    let BackendRecord::Nvme {
        offset,
        length,
        keep_data: false,
        ..
    } = &record.backend
    else {
        return None;
    };
    let to = match (*length, namespace) {
        (0, Some(ns)) => ns.size_bytes,
        // Unknown: the dataplane refuses a window past the namespace's end anyway.
        (0, None) => u64::MAX,
        // Admitted windows end inside their namespace; one that would not is erased to the
        // namespace's end at most, and the erase refuses what leaves the record's claim.
        (len, ns) => offset
            .checked_add(len)
            .unwrap_or(u64::MAX)
            .min(ns.map_or(u64::MAX, |ns| ns.size_bytes)),
    };
    Some(crate::record::EraseRange { from: *offset, to })
}

/// The same file, whatever path names it: equal paths, or one device and inode (a hard link,
/// a bind mount).
fn same_file(a: &std::path::Path, b: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    if a == b {
        return true;
    }
    match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) => x.dev() == y.dev() && x.ino() == y.ino(),
        _ => false,
    }
}

/// The file `record` names, made at its size when it is missing and `create` says so.
fn make_backing_file(record: &VolumeRecord) -> Result<Option<PathBuf>, VolumeError> {
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

fn is_id_taken(e: &ublkd_dataplane::DataplaneError) -> bool {
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

    /// Two records may not share a backing file under two names (issue 22, item 14).
    #[test]
    fn a_hard_link_is_the_same_backing_file() {
        let dir = tempfile::tempdir().unwrap();
        let (a, b, c) = (
            dir.path().join("a.img"),
            dir.path().join("b.img"),
            dir.path().join("c.img"),
        );
        std::fs::write(&a, b"x").unwrap();
        std::fs::hard_link(&a, &b).unwrap();
        std::fs::write(&c, b"x").unwrap();
        assert!(super::same_file(&a, &a));
        assert!(super::same_file(&a, &b), "a hard link names the same file");
        assert!(!super::same_file(&a, &c));
        assert!(!super::same_file(&a, &dir.path().join("missing.img")));
    }
}
