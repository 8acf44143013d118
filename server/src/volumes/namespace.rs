//! Which NVMe namespace a record's window is on: the record keeps the namespace's identity
//! (Identify's NGUID, EUI-64, or subsystem NQN and namespace id), and the char device path is
//! only the name this boot gave it. Every step that serves or erases a window checks the path
//! against the identity first; a restore finds the namespace wherever it now is, or leaves the
//! volume FAILED with nothing served or erased.

use super::plane::Plane;
use super::pool::blocking;
use super::store::Store;
use super::table::Table;
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use std::path::{Path, PathBuf};
use ublkd_dataplane::{Namespace, NamespaceIdentity};

/// The namespace an NVMe record's window lies in (None for other backends), checked against
/// the identity the record keeps: a path that names another namespace now is refused.
pub(super) async fn of(
    plane: &Plane,
    record: &VolumeRecord,
) -> Result<Option<Namespace>, VolumeError> {
    let Some((device, recorded)) = nvme(record) else {
        return Ok(None);
    };
    let ns = identify(plane, device).await?;
    check(device, recorded, &ns)?;
    Ok(Some(ns))
}

/// For a new volume: its namespace found by identity when the request names it so (no path),
/// identified, checked against an identity the request gave, and the identity recorded.
pub(super) async fn adopt_identity(
    table: &Table,
    plane: &Plane,
    settings: &Settings,
    record: &mut VolumeRecord,
) -> Result<Option<Namespace>, VolumeError> {
    let Some((device, recorded)) = nvme(record) else {
        return Ok(None);
    };
    let device = match (device.as_os_str().is_empty(), recorded) {
        (true, Some(identity)) => find(plane, identity).await?,
        _ => device.to_owned(),
    };
    let ns = identify(plane, &device).await?;
    check(&device, recorded, &ns)?;
    host_use(table, plane, settings, &device, ns.identity.as_ref()).await?;
    if let BackendRecord::Nvme {
        device: d,
        identity,
        ..
    } = &mut record.backend
    {
        *d = device;
        if identity.is_none() {
            identity.clone_from(&ns.identity);
        }
    }
    Ok(Some(ns))
}

/// At restore: the record's namespace where it is now. Its recorded path when that still holds
/// it; else the path that does (the record and the map are updated, and the log says so); a
/// record without an identity (written before identities were kept) gets the one its path
/// holds. Err when no namespace has the identity: nothing may be served or erased.
pub(super) async fn relocate(
    table: &Table,
    store: &Store,
    plane: &Plane,
    record: &VolumeRecord,
) -> Result<VolumeRecord, VolumeError> {
    let Some((device, recorded)) = nvme(record) else {
        return Ok(record.clone());
    };
    let here = identify(plane, device).await;
    let (path, found) = match (recorded, here) {
        (None, Ok(ns)) => (device.to_owned(), ns.identity),
        (None, Err(e)) => return Err(e),
        (Some(id), Ok(ns)) if ns.identity.as_ref() == Some(id) => return Ok(record.clone()),
        (Some(id), here) => {
            let now = match &here {
                Ok(ns) => ns
                    .identity
                    .as_ref()
                    .map_or("unidentified".into(), ToString::to_string),
                Err(e) => crate::error::chain(e),
            };
            let path = find(plane, id).await?;
            tracing::warn!(volume = %record.id, recorded = %device.display(), now = %path.display(),
                identity = %id, elsewhere = now, "the volume's namespace has another name this boot: served from its new name");
            (path, Some(id.clone()))
        }
    };
    let mut moved = record.clone();
    if let BackendRecord::Nvme {
        device, identity, ..
    } = &mut moved.backend
    {
        *device = path;
        identity.clone_from(&found);
    }
    if moved == *record {
        return Ok(moved);
    }
    store.put(&moved).await?;
    if let Some(v) = table.lock().await.get_mut(&record.id) {
        v.record.backend = moved.backend.clone();
    }
    Ok(moved)
}

/// Refuses a namespace the host itself seems to use (its disk has holders, partitions, a
/// mount, an exclusive opener, or starts with a partition table or file system), unless the
/// configuration allows it or a record already claims a window of it: ublkd's own volumes
/// are what the disk holds then.
async fn host_use(
    table: &Table,
    plane: &Plane,
    settings: &Settings,
    device: &Path,
    identity: Option<&NamespaceIdentity>,
) -> Result<(), VolumeError> {
    if settings.limits.allows_used_namespace(device, identity) {
        return Ok(());
    }
    let claimed = {
        let map = table.lock().await;
        let records = map.values().map(|v| &v.record);
        !crate::windows::claims(device, identity, records, None).is_empty()
    };
    if claimed {
        return Ok(());
    }
    let (d, handle) = (device.to_owned(), plane.handle()?);
    match blocking(move || handle.namespace_host_use(&d)).await? {
        Some(why) => Err(VolumeError::NamespaceInUse {
            device: device.to_owned(),
            why,
        }),
        None => Ok(()),
    }
}

/// Refuses `device` when it is not the namespace `recorded` names (nothing to compare when the
/// record has no identity yet).
fn check(
    device: &Path,
    recorded: Option<&NamespaceIdentity>,
    ns: &Namespace,
) -> Result<(), VolumeError> {
    match recorded {
        Some(id) if ns.identity.as_ref() != Some(id) => Err(VolumeError::NamespaceIdentity {
            device: device.to_owned(),
            recorded: id.clone(),
            found: ns
                .identity
                .as_ref()
                .map_or_else(|| "without an identity".into(), ToString::to_string),
        }),
        _ => Ok(()),
    }
}

/// Whether `device` is, right now, the namespace `recorded` names: what every erase checks.
pub(super) async fn verify(
    plane: &Plane,
    device: &Path,
    recorded: Option<&NamespaceIdentity>,
) -> Result<(), VolumeError> {
    if recorded.is_none() {
        return Ok(());
    }
    let ns = identify(plane, device).await?;
    check(device, recorded, &ns)
}

fn nvme(record: &VolumeRecord) -> Option<(&Path, Option<&NamespaceIdentity>)> {
    match &record.backend {
        BackendRecord::Nvme {
            device, identity, ..
        } => Some((device.as_path(), identity.as_ref())),
        _ => None,
    }
}

/// Identify, on the blocking pool (an ioctl).
async fn identify(plane: &Plane, device: &Path) -> Result<Namespace, VolumeError> {
    let (device, handle) = (device.to_owned(), plane.handle()?);
    blocking(move || handle.identify_namespace(&device)).await
}

/// The char device of the namespace with `identity`, on the blocking pool (one Identify per
/// namespace of the node).
async fn find(plane: &Plane, identity: &NamespaceIdentity) -> Result<PathBuf, VolumeError> {
    let (id, handle) = (identity.clone(), plane.handle()?);
    let found = blocking(move || Ok::<_, VolumeError>(handle.find_namespace(&id))).await?;
    found.ok_or_else(|| VolumeError::NamespaceNotFound(identity.clone()))
}
