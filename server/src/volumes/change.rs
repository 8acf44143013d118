//! Changes of one volume: create, delete, resize, QoS. Each runs under the volume's operation lock
//! (changes of one volume one at a time, of different volumes in parallel) and holds the map
//! lock only to check and record, never across a registry write or a ublk control command.

use super::{blocking, is_id_taken, now_ms, same_spec, Volumes};
use crate::error::VolumeError;
use crate::hooks::{delay_point, fault_point, Point};
use crate::record::{BackendRecord, SourceRecord, VolumeRecord};
use crate::volume::{State, Volume};
use crate::volume_id::VolumeId;
use std::collections::BTreeMap;
use std::path::PathBuf;
use ublkd_dataplane::{DataplaneError, DeviceInfo, DeviceSpec, Growth, QosLimits};

impl Volumes {
    /// Creates the volume `record` describes; with `place_window`, ublkd chooses its NVMe
    /// window's offset (the first free extent that fits).
    pub async fn create(
        &self,
        mut record: VolumeRecord,
        place_window: bool,
    ) -> Result<Volume, VolumeError> {
        // The namespace's size and block size, read before any lock (an Identify ioctl): to
        // place the window, and to refuse one past its end before anything is recorded.
        let namespace = self.namespace_of(&record).await?;
        // A clone of a volume holds its source's lock too (its reflink is taken drained), and
        // every two locks are taken in id order: two volumes cloning each other at once wait
        // for each other in turn, never each for the other.
        let source = match &record.source {
            Some(SourceRecord::Volume(v)) => Some(v.clone()),
            _ => None,
        };
        let _ops = self.op_locks(&record.id, source.as_ref()).await;
        {
            let mut map = self.inner.lock().await;
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
            self.admit(&mut record, namespace, place_window, &map)?;
            record.erase_pending = new_window_erase(&record, namespace);
            self.handle()?;
            record.created_unix_ms = now_ms();
            record.dev_id = Some(self.free_dev_id(&map)?);
            // Held as CREATING from here: the id, the device id and the backing file are taken,
            // and readers see the volume coming.
            map.insert(record.id.clone(), Volume::creating(record.clone()));
        }
        let made = match self.make_clone_file(&record).await {
            Ok(clone) => {
                let made = self.make(&mut record).await;
                if let (Err(_), Some(path)) = (&made, &clone) {
                    // The create's own error is what the caller needs; a file left behind
                    // keeps its intent, so the next start removes it.
                    if std::fs::remove_file(path).is_ok() {
                        self.end_clone_intent(&record.id);
                    }
                } else if clone.is_some() {
                    // The record names the file now: it is the volume's.
                    self.end_clone_intent(&record.id);
                }
                made
            }
            Err(e) => {
                // Nothing was made (or what was is removed): the intent has nothing to name.
                if let BackendRecord::File { path, .. } = &record.backend {
                    if record.source.is_some() && !path.exists() {
                        self.end_clone_intent(&record.id);
                    }
                }
                Err(e)
            }
        };
        self.settle(record, made).await
    }

    /// What a new volume (created or adopted) must not take from the others, checked under the
    /// map lock: its NVMe window (placed when `place`), the node's volume limit, and a backing
    /// file another record owns under any name.
    pub(super) fn admit(
        &self,
        record: &mut VolumeRecord,
        namespace: Option<ublkd_dataplane::Namespace>,
        place: bool,
        map: &BTreeMap<VolumeId, Volume>,
    ) -> Result<(), VolumeError> {
        Self::claim_window(record, namespace, place, map)?;
        if map.len() >= self.settings.limits.max_volumes {
            return Err(VolumeError::AdmitVolumeLimit(map.len()));
        }
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

    /// The namespace an NVMe record's window lies in (None for other backends).
    pub(super) async fn namespace_of(
        &self,
        record: &VolumeRecord,
    ) -> Result<Option<ublkd_dataplane::Namespace>, VolumeError> {
        let Some(device) = crate::windows::nvme_device(record) else {
            return Ok(None);
        };
        let (device, handle) = (device.clone(), self.handle()?);
        Ok(Some(
            blocking(move || handle.identify_namespace(&device)).await?,
        ))
    }

    /// An NVMe record's window against its namespace and every other record's window on it,
    /// whatever their state: placed in the first free extent with `place` (ublkd places it),
    /// else refused when it overlaps one, does not fit the namespace or is smaller than the
    /// volume. Run under the map lock.
    fn claim_window(
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
            ..
        } = &mut record.backend
        else {
            return Ok(());
        };
        let claims = crate::windows::claims(device, map.values().map(|v| &v.record), Some(&id));
        if let (true, Some(ns)) = (place, namespace) {
            let block = u64::from(ns.block_size.max(1));
            let len = if *length == 0 { size } else { *length }.next_multiple_of(block);
            *offset =
                crate::windows::place(&claims, ns.size_bytes, block, len).ok_or_else(|| {
                    VolumeError::AdmitNoExtent {
                        device: device.clone(),
                        len,
                    }
                })?;
            *length = len;
            return Ok(());
        }
        if let Some(ns) = namespace {
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
        &self,
        record: VolumeRecord,
        made: Result<DeviceInfo, VolumeError>,
    ) -> Result<Volume, VolumeError> {
        let mut map = self.inner.lock().await;
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
    async fn make(&self, record: &mut VolumeRecord) -> Result<DeviceInfo, VolumeError> {
        let created_file = self.prepare_backing_file(record).await?;
        // The create's own error is what the caller gets; an undo step that fails too is
        // logged: a record left makes the next start bring the volume up, a file left stays
        // (it is not ublkd's to find again).
        let undo = |record: &VolumeRecord| {
            if let Err(e) = self.registry.remove(&record.id) {
                tracing::error!(volume = %record.id, error = %crate::error::chain(&e), "a failed create's record could not be removed: the next start brings the volume up");
            }
            if let (Some(path), BackendRecord::File { .. }) = (&created_file, &record.backend) {
                if let Err(e) = std::fs::remove_file(path) {
                    tracing::warn!(volume = %record.id, path = %path.display(), error = %e, "a failed create's backing file could not be removed");
                }
            }
            self.remove_ram_file(record);
        };
        fault_point(Point::CreateBeforeRecord);
        // The record (with the device id it will get) goes first: a crash from here on leaves a
        // registered volume whose device the next start takes over or creates, never a device
        // nobody owns.
        if let Err(e) = self.put_record(record).await {
            undo(record);
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
            if let Err(e) = self
                .erase_range(&record.id, device, pending, "new window")
                .await
            {
                undo(record);
                return Err(e);
            }
            // Known erased on disk before anything can write there: a pending erase recorded
            // after the tenant's first write would wipe that write at the next start.
            record.erase_pending = None;
            if let Err(e) = self.put_record(record).await {
                undo(record);
                return Err(e);
            }
        }
        // A new RAM volume starts empty: memory an earlier volume of this id left (a crash
        // inside its delete) is not its to read.
        if let Err(e) = self.fresh_ram_file(record) {
            undo(record);
            return Err(e);
        }
        match self.bring_up(record).await {
            Ok(info) => {
                fault_point(Point::CreateAfterDevice);
                // The device id recorded first was taken meanwhile: the one it got is recorded,
                // or the device goes with the rest of the create (a device no record names
                // would serve a window the map no longer claims).
                if record.dev_id != Some(info.dev_id) {
                    record.dev_id = Some(info.dev_id);
                    if let Err(e) = self.put_record(record).await {
                        let (h, dev_id) = (self.handle()?, info.dev_id);
                        if let Err(d) = blocking(move || h.delete_device(dev_id)).await {
                            tracing::error!(volume = %record.id, %dev_id, error = %crate::error::chain(&d), "a failed create's device could not be deleted: left as an orphan");
                        }
                        undo(record);
                        return Err(e);
                    }
                }
                Ok(info)
            }
            Err(e) => {
                undo(record);
                Err(e)
            }
        }
    }

    /// Creates the device for `record`, with its recorded kernel id when it has one (and
    /// another id no record and no kernel device has, if something else took that one
    /// meanwhile; the caller records the id it got). Never erases: the manager erases a new
    /// window's range itself (`erase_range`).
    pub(super) async fn bring_up(&self, record: &VolumeRecord) -> Result<DeviceInfo, VolumeError> {
        let handle = self.handle()?;
        let spec = crate::convert::device_spec(record, &self.settings.ram_dir);
        let h = handle.clone();
        let s = spec.clone();
        match blocking(move || h.add_device(s)).await {
            Err(VolumeError::Dataplane(e)) if spec.dev_id.is_some() && is_id_taken(&e) => {
                // Not any id the kernel would pick: one another record names for a device
                // absent now would be taken over as that volume's after a crash.
                let free = self.free_dev_id(&*self.inner.lock().await)?;
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
    fn fresh_ram_file(&self, record: &VolumeRecord) -> Result<(), VolumeError> {
        if record.backend != BackendRecord::Ram {
            return Ok(());
        }
        let path = crate::volume::ram_file(&self.settings.ram_dir, &record.id);
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
        &self,
        record: &VolumeRecord,
    ) -> Result<Option<PathBuf>, VolumeError> {
        let record = record.clone();
        blocking(move || make_backing_file(&record)).await
    }

    /// Deletes volume `id`; Ok(false) when it did not exist and `allow_missing` was set. With
    /// `delete_backing`, a file volume's backing file goes too.
    pub async fn delete(
        &self,
        id: &VolumeId,
        allow_missing: bool,
        delete_backing: bool,
    ) -> Result<bool, VolumeError> {
        let _op = self.op_lock(id).await;
        let Some(vol) = self.inner.lock().await.get(id).cloned() else {
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
            let ids = match &self.handle {
                Some(devices) => devices.kernel_device_ids(),
                None => ublkd_dataplane::kernel_device_ids(),
            };
            vol.record
                .dev_id
                .filter(|d| ids.contains(d))
                .map(|d| (d, ublkd_dataplane::block_device(d)))
        };
        if let Some((dev_id, block_device)) = served.clone().or_else(kernel) {
            let handle = self.handle()?;
            // Something holds the device exclusively: a mount in any namespace, or an
            // exclusive opener. Deleting it would pull the disk from under them.
            if handle.held_elsewhere(&block_device) {
                return Err(VolumeError::DeleteBusy {
                    id: id.clone(),
                    device: block_device,
                });
            }
            self.set_state(id, State::Deleting, "").await;
            // Persist the intent: a crash during the delete is finished by the next start.
            let mut record = vol.record.clone();
            record.deleting = true;
            self.put_record(&record).await?;
            fault_point(Point::DeleteAfterMark);
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
                    self.set_state(id, State::Failed, &crate::error::chain(&e))
                        .await;
                    return Err(e);
                }
            }
            fault_point(Point::DeleteAfterDevice);
        }
        // A deleted tenant's NVMe blocks are erased before its window is free again, so that no
        // later volume (a keep_data one included) reads them. Until then the record stays (marked
        // when it had a device): a retry, or the next start, finishes the delete.
        if let Err(e) = self.erase_deleted_window(&vol.record).await {
            self.set_state(id, State::Failed, &crate::error::chain(&e))
                .await;
            return Err(e);
        }
        // The backing file goes before the record: should its removal fail, the record (and
        // the volume, with the reason) stays, and a retry of the delete finishes it.
        if let (true, BackendRecord::File { path, .. }) = (delete_backing, &vol.record.backend) {
            let p = path.clone();
            // Unlinking a large file frees its extents: seconds, on the blocking pool.
            let removed = blocking(move || match std::fs::remove_file(&p) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    Err(VolumeError::RemoveBackingFile { path: p, source: e })
                }
                _ => Ok(()),
            })
            .await;
            if let Err(e) = removed {
                self.set_state(id, State::Failed, &crate::error::chain(&e))
                    .await;
                return Err(e);
            }
        }
        // A RAM volume's memory goes before its record: a crash in between leaves a record
        // whose restore finds an empty file, never a file a later volume of the id would read.
        self.remove_ram_file(&vol.record);
        self.remove_record(id).await?;
        self.inner.lock().await.remove(id);
        Ok(true)
    }

    /// Erases the NVMe window of volume `record`, which is being deleted (nothing for other
    /// backends, nor for a `keep_data` volume, which never owned the erase of what it found).
    pub(super) async fn erase_deleted_window(
        &self,
        record: &VolumeRecord,
    ) -> Result<(), VolumeError> {
        let BackendRecord::Nvme {
            device,
            offset,
            length,
            keep_data: false,
        } = &record.backend
        else {
            return Ok(());
        };
        let len = match *length {
            0 => self
                .namespace_of(record)
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
        self.erase_range(&record.id, device, range, "deleted volume")
            .await
    }

    /// Erases `range` of NVMe namespace `device` for volume `id`, `ERASE_CHUNK` bytes at a
    /// time on the blocking pool (never on the dataplane's control thread), saying how far it
    /// got in the volume's message; `what` names the range in the log.
    pub(super) async fn erase_range(
        &self,
        id: &VolumeId,
        device: &std::path::Path,
        range: crate::record::EraseRange,
        what: &'static str,
    ) -> Result<(), VolumeError> {
        let handle = self.handle()?;
        let total = range.to.saturating_sub(range.from);
        let started = std::time::Instant::now();
        let mut at = range.from;
        let mut how = None;
        while at < range.to {
            let len = (range.to - at).min(ERASE_CHUNK);
            let (h, d) = (handle.clone(), device.to_owned());
            how = Some(
                blocking(move || {
                    crate::hooks::delay_point_blocking(Point::EraseChunk);
                    h.erase_window(&d, at, len)
                })
                .await?,
            );
            at += len;
            if at < range.to {
                let done = at - range.from;
                self.set_message(
                    id,
                    &format!(
                        "erasing the {what}'s earlier content: {} of {} MiB",
                        done >> 20,
                        total >> 20
                    ),
                )
                .await;
            }
        }
        // The progress goes; a message that says something else stays.
        if let Some(v) = self.inner.lock().await.get_mut(id) {
            if v.message.starts_with("erasing the ") {
                v.message.clear();
            }
        }
        if let Some(how) = how {
            tracing::info!(volume = %id, from = range.from, to = range.to, erase = how.name(),
                took_ms = started.elapsed().as_millis() as u64, "{what}: earlier content erased");
        }
        Ok(())
    }

    pub async fn resize(&self, id: &VolumeId, size: u64) -> Result<Volume, VolumeError> {
        let _op = self.op_lock(id).await;
        let vol = self.get(id).await?;
        crate::validate::size(size, vol.record.block_size, &self.settings)?;
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
        if let BackendRecord::File { path, create } = &vol.record.backend {
            let (path, create) = (path.clone(), *create);
            blocking(move || grow_backing_file(&path, create, size)).await?;
        }
        let handle = self.handle()?;
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
        // Growing past the namespace's end, or into any other record's window, is refused
        // before the new size is recorded, served or not (the dataplane only sees the devices
        // it serves right now).
        let namespace = self.namespace_of(&record).await?;
        {
            let mut map = self.inner.lock().await;
            Self::claim_window(&mut record, namespace, false, &map)?;
            // The grown window is claimed from here: a create placing a window sees it.
            if let Some(v) = map.get_mut(id) {
                v.record = record.clone();
            }
        }
        if let Err(e) = self.put_record(&record).await {
            self.roll_back(&vol.record, &record).await;
            return Err(e);
        }
        fault_point(Point::ResizeAfterRecord);
        // The growth's erase, as a new window's: in chunks on the blocking pool, never on the
        // dataplane's control thread, its progress in the volume's message; then recorded
        // done before the device's size reaches it, so no later start erases the tenant's
        // writes there.
        let growth = match (record.erase_pending, crate::windows::nvme_device(&record)) {
            (Some(pending), Some(device)) => {
                let erased = match self
                    .erase_range(id, device, pending, "window's growth")
                    .await
                {
                    Ok(()) => {
                        record.erase_pending = None;
                        self.put_record(&record).await
                    }
                    Err(e) => Err(e),
                };
                if let Err(e) = erased {
                    self.roll_back(&vol.record, &record).await;
                    return Err(e);
                }
                Growth::Erased
            }
            _ => Growth::Erase,
        };
        match blocking(move || handle.resize_device(info.dev_id, size, growth)).await {
            Ok(updated) => {
                fault_point(Point::ResizeAfterDevice);
                let mut map = self.inner.lock().await;
                let v = map
                    .get_mut(id)
                    .ok_or_else(|| VolumeError::LookupVolume(id.clone()))?;
                v.record = record;
                v.device = Some(updated);
                Ok(v.clone())
            }
            Err(e) => {
                self.roll_back(&vol.record, &record).await;
                Err(e)
            }
        }
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

    /// Replaces a volume's I/O limits: recorded first (a restart applies them), then handed to
    /// the dataplane if the volume is being served. A volume not being served (FAILED, or
    /// waiting for recovery) keeps them for when it is.
    pub async fn set_qos(&self, id: &VolumeId, qos: QosLimits) -> Result<Volume, VolumeError> {
        let _op = self.op_lock(id).await;
        let vol = self.get(id).await?;
        if vol.record.qos == qos {
            return Ok(vol);
        }
        let mut record = vol.record.clone();
        record.qos = qos;
        self.put_record(&record).await?;
        let updated = match vol.device.as_ref() {
            Some(info) => {
                let handle = self.handle()?;
                let dev_id = info.dev_id;
                match blocking(move || handle.set_qos(dev_id, qos)).await {
                    Ok(updated) => Some(updated),
                    Err(e) => {
                        self.roll_back(&vol.record, &record).await;
                        return Err(e);
                    }
                }
            }
            None => None,
        };
        let mut map = self.inner.lock().await;
        let v = map
            .get_mut(id)
            .ok_or_else(|| VolumeError::LookupVolume(id.clone()))?;
        v.record = record;
        if updated.is_some() {
            v.device = updated;
        }
        Ok(v.clone())
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
}

/// How much of a window one erase call covers: small enough that a volume's progress shows and
/// a stop waits little, large enough that the calls cost nothing next to the erase.
const ERASE_CHUNK: u64 = 256 << 20;

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
        (len, _) => offset.saturating_add(len),
    };
    Some(crate::record::EraseRange { from: *offset, to })
}

/// Makes a file volume's backing file hold at least `size` bytes (only a file ublkd may size:
/// one created with `create`).
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
