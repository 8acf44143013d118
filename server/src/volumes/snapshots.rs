//! Snapshots and clones of file volumes, by reflink.
//!
//! The copy is one FICLONE of the backing file, taken with the volume drained: the dataplane
//! holds the volume's new requests in its workers and waits until none is with the backend, so
//! the copy holds every write the volume acknowledged and none it had not. Draining was chosen
//! over ublk's QUIESCE_DEV because QUIESCE_DEV hands the device to user recovery (every queue's
//! commands aborted and fetched again, START/END_USER_RECOVERY), a takeover costing tens of
//! milliseconds and failing the volume if anything goes wrong, where draining costs the clone's
//! own time and touches no kernel state. FICLONE flushes the source's dirty pages and locks
//! both inodes, so it is one point in time against the backend's own writes too.

use super::plane::Plane;
use super::pool::blocking;
use super::pool::now_ms;
use super::table::Table;
use crate::backend::BackendRecord;
use crate::error::VolumeError;
use crate::hooks::{fault_point, Point};
use crate::record::SourceRecord;
use crate::record::VolumeRecord;
use crate::registry::Registry;
use crate::snapshot::{snapshot_path, SNAPSHOT_DIR};
use crate::snapshot::{FileIntent, SnapshotId, SnapshotRecord};
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, FileTypeExt};
use std::path::Path;
use std::path::PathBuf;
use std::time::Instant;
use tokio::sync::Mutex;

/// The snapshots, and the file intents (clones and new file volumes whose backing file is
/// being made): what a snapshot, a clone or a new file volume's file is made with.
#[derive(Debug)]
pub(super) struct Snaps {
    pub(super) registry: Registry<SnapshotRecord>,
    /// Every snapshot; its lock is held only to read or record.
    pub(super) map: Mutex<BTreeMap<SnapshotId, SnapshotRecord>>,
    /// Snapshot ids being taken, and of which volume: reserved while their copy is made.
    pub(super) taking: std::sync::Mutex<BTreeMap<SnapshotId, VolumeId>>,
    pub(super) intents: Registry<FileIntent>,
}

impl Snaps {
    pub(super) fn new(registry: Registry<SnapshotRecord>, intents: Registry<FileIntent>) -> Self {
        Snaps {
            registry,
            map: Mutex::new(BTreeMap::new()),
            taking: std::sync::Mutex::new(BTreeMap::new()),
            intents,
        }
    }
}

/// Loads the snapshot registry (at start, before volumes are restored).
/// Returns whether every snapshot record could be read (stray copies are removed only then).
pub(super) async fn load_snapshots(snaps: &Snaps) -> Result<bool, VolumeError> {
    let (records, report) = snaps.registry.load()?;
    for path in &report.corrupt {
        tracing::warn!(path = %path.display(), "unreadable snapshot record moved aside");
    }
    let mut map = snaps.map.lock().await;
    for r in records {
        map.insert(r.id.clone(), r);
    }
    Ok(report.corrupt.is_empty())
}

/// At start, after the volumes' records are loaded: removes the copies in the snapshot
/// directories beside the file volumes' backing files that no snapshot record names, left by a
/// snapshot that died before its record (review L12, issue 55: only a retry of the same id
/// removed them, and their reflinked blocks diverge from the volume's over time). Only ublkd
/// writes there; a file that cannot be removed is logged and left for the next start.
pub(super) async fn remove_stray_copies(table: &Table, snaps: &Snaps) {
    let named: std::collections::BTreeSet<PathBuf> = (snaps.map.lock().await)
        .values()
        .map(|r| r.path.clone())
        .collect();
    let dirs: std::collections::BTreeSet<PathBuf> = (table.lock().await)
        .values()
        .filter_map(|v| match &v.record.backend {
            BackendRecord::File { path, .. } => path.parent().map(|d| d.join(SNAPSHOT_DIR)),
            _ => None,
        })
        .chain(named.iter().filter_map(|p| p.parent().map(Path::to_owned)))
        .collect();
    let removed = blocking(move || {
        let mut removed = Vec::new();
        for dir in dirs {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for path in entries.flatten().map(|e| e.path()) {
                let copy = path.extension().is_some_and(|e| e == "img")
                    && path
                        .file_stem()
                        .and_then(|s| s.to_str())
                        .is_some_and(|s| SnapshotId::parse(s).is_ok());
                if !copy || named.contains(&path) {
                    continue;
                }
                match std::fs::remove_file(&path) {
                    Ok(()) => removed.push(path),
                    Err(e) => {
                        tracing::warn!(path = %path.display(), error = %e, "a stray snapshot copy could not be removed: tried again at the next start");
                    }
                }
            }
        }
        Ok::<_, VolumeError>(removed)
    })
    .await
    .unwrap_or_default();
    for path in removed {
        tracing::warn!(path = %path.display(), "removed the copy of a snapshot that died before its record");
    }
}

/// Takes snapshot `id` of file volume `source`; the existing one if `id` was already taken
/// of the same volume.
pub(super) async fn create_snapshot(
    table: &Table,
    plane: &Plane,
    snaps: &Snaps,
    id: SnapshotId,
    source: VolumeId,
) -> Result<SnapshotRecord, VolumeError> {
    // The volume's lock orders the snapshot with its delete and resize. The snapshots' lock
    // is held only to check and to record: the drain, the reflink and its fsyncs run
    // without it, so one volume's slow snapshot holds up no other volume's. The id is
    // reserved meanwhile (`snapshots_taking`).
    let _op = table.op_lock(&source).await;
    {
        let snapshots = snaps.map.lock().await;
        if let Some(existing) = snapshots.get(&id) {
            if existing.source == source {
                return Ok(existing.clone());
            }
            return Err(VolumeError::SnapshotConflict {
                id,
                source_volume: existing.source.clone(),
            });
        }
        let mut taking = snaps
            .taking
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(other) = taking.get(&id) {
            // Another volume's snapshot of this id is being taken (the same volume's would
            // wait for the volume's lock).
            return Err(VolumeError::SnapshotConflict {
                id,
                source_volume: other.clone(),
            });
        }
        taking.insert(id.clone(), source.clone());
    }
    let taken = take_snapshot(table, plane, snaps, &id, &source).await;
    snaps
        .taking
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .remove(&id);
    taken
}

/// The copy and the record of snapshot `id` of `source`, whose id is reserved.
async fn take_snapshot(
    table: &Table,
    plane: &Plane,
    snaps: &Snaps,
    id: &SnapshotId,
    source: &VolumeId,
) -> Result<SnapshotRecord, VolumeError> {
    let id = id.clone();
    let source = source.clone();
    let vol = table.get(&source).await?;
    let backing = file_backing(&vol)?;
    let path = snapshot_path(&backing, &id);
    // The directory made, and the copy of an earlier try of this id that died before its
    // record removed (no record names it: checked above, under the snapshots lock; only
    // ublkd writes here), on the blocking pool.
    let target = path.clone();
    let stale = blocking(move || {
        if let Some(dir) = target.parent() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .map_err(|source| VolumeError::WriteSnapshot {
                    path: dir.to_owned(),
                    source,
                })?;
        }
        if !target.exists() {
            return Ok(false);
        }
        std::fs::remove_file(&target)
            .map(|()| true)
            .map_err(|source| VolumeError::WriteSnapshot {
                path: target,
                source,
            })
    })
    .await?;
    if stale {
        tracing::warn!(snapshot = %id, path = %path.display(), "removed the copy of an interrupted snapshot");
    }
    let started = Instant::now();
    reflink_drained(plane, &vol, &backing, &path).await?;
    fault_point(Point::SnapshotAfterReflink);
    let record = SnapshotRecord {
        id: id.clone(),
        source,
        size_bytes: vol.record.size_bytes,
        path: path.clone(),
        created_unix_ms: now_ms(),
    };
    let (registry, stored) = (snaps.registry.clone(), record.clone());
    if let Err(e) = blocking(move || registry.put(&stored)).await {
        // A copy left behind is removed by the next try of this id, or the next start (no
        // record names it).
        let _ = super::pool::unlink(path).await; // the error is the put's, above
        return Err(e);
    }
    tracing::info!(snapshot = %id, volume = %record.source, took_ms = started.elapsed().as_millis() as u64, "snapshot taken");
    snaps.map.lock().await.insert(id, record.clone());
    Ok(record)
}

/// Deletes snapshot `id` and its copy; Ok(false) if it did not exist and `allow_missing`.
pub(super) async fn delete_snapshot(
    snaps: &Snaps,
    id: &SnapshotId,
    allow_missing: bool,
) -> Result<bool, VolumeError> {
    // Taken out of the map for the time of the removal: the snapshots' lock is not held across
    // the unlink and the registry's fsync (review A14/L7, issue 55), and no clone starts from
    // a snapshot being deleted. Put back if the removal fails.
    let Some(record) = snaps.map.lock().await.remove(id) else {
        if allow_missing {
            return Ok(false);
        }
        return Err(VolumeError::LookupSnapshot(id.clone()));
    };
    // Unlinking a copy frees its extents, and the record's removal fsyncs: both on the
    // blocking pool, not on one of the runtime's two threads.
    let (path, registry, key) = (record.path.clone(), snaps.registry.clone(), id.clone());
    let removed = blocking(move || {
        match std::fs::remove_file(&path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(VolumeError::WriteSnapshot { path, source }),
        }
        registry.remove(key.as_str()).map_err(VolumeError::from)
    })
    .await;
    if let Err(e) = removed {
        snaps.map.lock().await.insert(id.clone(), record);
        return Err(e);
    }
    Ok(true)
}

/// Snapshots, by id, optionally only `id` or only those of volume `source`.
pub(super) async fn list_snapshots(
    snaps: &Snaps,
    id: Option<&str>,
    source: Option<&str>,
) -> Vec<SnapshotRecord> {
    snaps
        .map
        .lock()
        .await
        .values()
        .filter(|s| id.is_none_or(|i| s.id.as_str() == i))
        .filter(|s| source.is_none_or(|v| s.source.as_str() == v))
        .cloned()
        .collect()
}

/// Makes a clone's backing file (record.source set, file backend): a reflink of the
/// snapshot's copy, or of the source volume's backing file taken drained, grown to the
/// clone's size. Returns the file made (the caller removes it if the create fails later).
pub(super) async fn make_clone_file(
    table: &Table,
    plane: &Plane,
    snaps: &Snaps,
    record: &VolumeRecord,
) -> Result<Option<PathBuf>, VolumeError> {
    let (Some(src), BackendRecord::File { path, .. }) = (&record.source, &record.backend) else {
        return Ok(None);
    };
    if path.exists() {
        if !has_file_intent(snaps, &record.id, path) {
            return Err(VolumeError::CloneTargetExists { path: path.clone() });
        }
        // Made by an earlier try of this create that died before the volume's record.
        std::fs::remove_file(path).map_err(|source| VolumeError::PrepareBackingFile {
            path: path.clone(),
            source,
        })?;
        tracing::warn!(volume = %record.id, path = %path.display(), "removed the backing file of an interrupted clone");
    }
    begin_file_intent(snaps, &record.id, path).await?;
    let source_size = match src {
        SourceRecord::Snapshot(sid) => {
            let snap = snaps
                .map
                .lock()
                .await
                .get(sid)
                .cloned()
                .ok_or_else(|| VolumeError::LookupSnapshot(sid.clone()))?;
            check_clone_size(record.size_bytes, snap.size_bytes)?;
            let (from, to) = (snap.path.clone(), path.clone());
            blocking(move || reflink_file(&from, &to)).await?;
            snap.size_bytes
        }
        SourceRecord::Volume(vid) => {
            // validate::spec refuses this; the check here keeps it refused whoever calls.
            if *vid == record.id {
                return Err(VolumeError::ValidateRequest(format!(
                    "volume {vid} cannot be cloned from itself"
                )));
            }
            // The create holds `vid`'s operation lock (`Volumes::op_locks`).
            let vol = table.get(vid).await?;
            let backing = file_backing(&vol)?;
            check_clone_size(record.size_bytes, vol.record.size_bytes)?;
            reflink_drained(plane, &vol, &backing, path).await?;
            vol.record.size_bytes
        }
    };
    fault_point(Point::CloneAfterReflink);
    if record.size_bytes > source_size {
        let (file, size) = (path.clone(), record.size_bytes);
        let grown = blocking(move || {
            let grow = || {
                let f = OpenOptions::new().write(true).open(&file)?;
                f.set_len(size)?;
                f.sync_all()
            };
            grow().map_err(|source| VolumeError::PrepareBackingFile { path: file, source })
        })
        .await;
        if let Err(e) = grown {
            // A file left behind keeps its clone intent: the next try or start removes it.
            let _ = super::pool::unlink(path.clone()).await; // the grow's error is the caller's
            return Err(e);
        }
    }
    Ok(Some(path.clone()))
}

/// Whether an intent of volume `id` names `path` (a file an interrupted create made).
fn has_file_intent(snaps: &Snaps, id: &VolumeId, path: &Path) -> bool {
    snaps
        .intents
        .load()
        .is_ok_and(|(all, _)| all.iter().any(|i| &i.id == id && i.path == path))
}

/// The file at `path` is ublkd's until volume `id`'s record names it: its intent is written
/// (on the blocking pool) before the file is made.
pub(super) async fn begin_file_intent(
    snaps: &Snaps,
    id: &VolumeId,
    path: &Path,
) -> Result<(), VolumeError> {
    let (intents, intent) = (
        snaps.intents.clone(),
        FileIntent {
            id: id.clone(),
            path: path.to_owned(),
        },
    );
    blocking(move || intents.put(&intent)).await
}

/// The clone's file is the volume's now (or gone): its intent goes (on the blocking pool).
pub(super) async fn end_file_intent(snaps: &Snaps, id: &VolumeId) {
    let (intents, key) = (snaps.intents.clone(), id.clone());
    if let Err(e) = blocking(move || intents.remove(key.as_str())).await {
        // Harmless: the next start finds the volume's record and drops the intent then.
        tracing::warn!(volume = %id, error = %crate::error::chain(&e), "clone intent not removed");
    }
}

/// At start, after the volumes' records are loaded: an intent whose volume has a record is
/// done; one without names the file of a create (or clone) that died before its record,
/// removed now.
pub(super) async fn finish_file_intents(table: &Table, snaps: &Snaps) -> Result<(), VolumeError> {
    let (intents, _) = snaps.intents.load()?;
    let map = table.lock().await;
    for intent in intents {
        if !map.contains_key(&intent.id) {
            match std::fs::remove_file(&intent.path) {
                Ok(()) => {
                    tracing::warn!(volume = %intent.id, path = %intent.path.display(), "removed the backing file of an interrupted create")
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(source) => {
                    return Err(VolumeError::PrepareBackingFile {
                        path: intent.path,
                        source,
                    })
                }
            }
        }
        let (intents, key) = (snaps.intents.clone(), intent.id.clone());
        blocking(move || intents.remove(key.as_str())).await?;
    }
    Ok(())
}

/// Reflinks `vol`'s backing file to `to` with the volume drained for the instant of the
/// clone (a volume not being served has no I/O to drain).
async fn reflink_drained(
    plane: &Plane,
    vol: &Volume,
    backing: &Path,
    to: &Path,
) -> Result<(), VolumeError> {
    let drain = match (&vol.device, plane.handle()) {
        (Some(d), Ok(h)) => Some((h, d.dev_id)),
        _ => None,
    };
    let (from, to) = (backing.to_owned(), to.to_owned());
    blocking(move || {
        let Some((h, dev)) = drain else {
            return reflink_file(&from, &to);
        };
        h.drain_device(dev)?;
        let r = reflink_file(&from, &to);
        // Always resumed, whatever the clone did; a failed resume is the worse error.
        h.resume_device(dev)?;
        r
    })
    .await
}

/// The backing file of a file volume; refused for other backends and for block devices.
fn file_backing(vol: &Volume) -> Result<PathBuf, VolumeError> {
    let refuse = |backend| VolumeError::SnapshotBackend {
        id: vol.record.id.clone(),
        backend,
    };
    match &vol.record.backend {
        BackendRecord::File { path, .. } => {
            let is_device = std::fs::metadata(path).is_ok_and(|m| m.file_type().is_block_device());
            if is_device {
                return Err(refuse("block device"));
            }
            Ok(path.clone())
        }
        // Every other kind: only a file can be copied by reflink.
        other => Err(refuse(other.kind().name())),
    }
}

fn check_clone_size(size: u64, source_size: u64) -> Result<(), VolumeError> {
    if size < source_size {
        return Err(VolumeError::CloneTooSmall { size, source_size });
    }
    Ok(())
}

/// Makes `to` (which must not exist) a reflink of `from`, durably: written under a temporary
/// name, fsynced, renamed, directory fsynced. Nothing is left behind on failure, and nothing
/// is ever copied byte by byte.
fn reflink_file(from: &Path, to: &Path) -> Result<(), VolumeError> {
    let write_err = |source| VolumeError::WriteSnapshot {
        path: to.to_owned(),
        source,
    };
    let dir = to.parent().unwrap_or(Path::new("/"));
    let name = to.file_name().map(|n| n.to_string_lossy().into_owned());
    let tmp = dir.join(format!(".{}.tmp", name.unwrap_or_default()));
    let src = File::open(from).map_err(|source| VolumeError::WriteSnapshot {
        path: from.to_owned(),
        source,
    })?;
    // An earlier try's temporary copy, if any (none is the usual case); one that cannot be
    // removed makes create_new below fail with the reason.
    let _ = std::fs::remove_file(&tmp);
    let dst = OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&tmp)
        .map_err(write_err)?;
    let done = share_blocks(&dst, &src)
        .map_err(|source| reflink_error(dir, source))
        .and_then(|()| dst.sync_all().map_err(write_err))
        .and_then(|()| {
            crate::sys::rename_noreplace(&tmp, to).map_err(|e| {
                if e.kind() == std::io::ErrorKind::AlreadyExists {
                    VolumeError::CloneTargetExists {
                        path: to.to_owned(),
                    }
                } else {
                    write_err(e)
                }
            })
        })
        .and_then(|()| {
            File::open(dir)
                .and_then(|d| d.sync_all())
                .map_err(write_err)
        });
    if done.is_err() {
        // The error is the caller's; a temporary copy left is removed by the next try.
        let _ = std::fs::remove_file(&tmp);
    }
    done
}

/// FICLONE; in the simulator (test builds), whose files live on tmpfs, a copy stands in for it:
/// the same contents at the same instant, which is all the volume manager relies on.
fn share_blocks(dst: &File, src: &File) -> std::io::Result<()> {
    crate::seam::share_blocks(dst, src)
}

/// A refused reflink: FAILED_PRECONDITION naming the file system when it cannot share blocks.
fn reflink_error(dir: &Path, source: std::io::Error) -> VolumeError {
    let unsupported = matches!(
        source.raw_os_error(),
        Some(libc::EOPNOTSUPP | libc::EXDEV | libc::EINVAL | libc::ENOTTY | libc::ENOSYS)
    );
    if unsupported {
        VolumeError::ReflinkUnsupported {
            dir: dir.to_owned(),
            fs: crate::sys::fs_type_name(dir).unwrap_or("a file system"),
            source,
        }
    } else {
        VolumeError::WriteSnapshot {
            path: dir.to_owned(),
            source,
        }
    }
}
