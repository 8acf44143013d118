//! What this node can still provide, per backend: the answer to GetCapacity, which the CSI
//! driver turns into CSIStorageCapacity objects so the scheduler only sends a volume to a node
//! it fits on.

use crate::error::VolumeError;
use crate::record::BackendRecord;
use crate::volume::Volume;
use std::path::Path;
use ublkd_dataplane::DataplaneError;
use ublkd_proto::v1;

/// Capacity for a file backend under `root` (already resolved inside the allowed roots):
/// the file system's available bytes less what existing volumes there may still write into
/// their sparse backing files.
fn file_capacity(root: &Path, volumes: &[Volume]) -> Result<(u64, u64), VolumeError> {
    let (avail, total) =
        ublkd_dataplane::fs_space(root).map_err(|source| VolumeError::ReadCapacity {
            path: root.to_owned(),
            source,
        })?;
    let promised: u64 = volumes
        .iter()
        .filter_map(|v| match &v.record.backend {
            BackendRecord::File { path, .. } if path.starts_with(root) => {
                Some(v.record.size_bytes.saturating_sub(owned_bytes(path)))
            }
            _ => None,
        })
        .sum();
    Ok((avail.saturating_sub(promised), total))
}

/// Bytes of a backing file that writing over needs no new space for: the extents it alone
/// holds. Blocks shared by reflink with a snapshot, a clone or an origin are allocated anew
/// when written, so they are still to be promised (issue 22, item 9). Without FIEMAP (tmpfs),
/// nothing can be shared: the allocated blocks.
fn owned_bytes(path: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let Ok(f) = std::fs::File::open(path) else {
        return 0;
    };
    crate::sys::exclusive_bytes(&f).unwrap_or_else(|_| f.metadata().map_or(0, |m| m.blocks() * 512))
}

/// Capacity for RAM volumes: the RAM directory's size less every RAM volume's whole size (they
/// may all fill up; tmpfs pages are never overcommitted here), within what is free now.
fn ram_capacity(ram_dir: &Path, volumes: &[Volume]) -> Result<(u64, u64), VolumeError> {
    // Made with the first RAM volume otherwise; its file system is what is measured.
    std::fs::create_dir_all(ram_dir).map_err(|source| VolumeError::ReadCapacity {
        path: ram_dir.to_owned(),
        source,
    })?;
    let (avail, total) =
        ublkd_dataplane::fs_space(ram_dir).map_err(|source| VolumeError::ReadCapacity {
            path: ram_dir.to_owned(),
            source,
        })?;
    let promised: u64 = volumes
        .iter()
        .filter(|v| v.record.backend == BackendRecord::Ram)
        .map(|v| v.record.size_bytes)
        .sum();
    Ok((avail.min(total.saturating_sub(promised)), total))
}

/// The namespace behind `device`: its size, block size and the extents no volume covers.
fn nvme_capacity(
    device: &Path,
    volumes: &[Volume],
) -> Result<(u64, Vec<crate::windows::Extent>), VolumeError> {
    crate::hooks::delay_point_blocking("capacity:identify");
    let ns = ublkd_dataplane::identify_namespace(device)
        .map_err(|e| VolumeError::Dataplane(DataplaneError::from(e)))?;
    let records = volumes.iter().map(|v| &v.record);
    let claims = crate::windows::claims(device, records, None);
    Ok((
        ns.size_bytes,
        crate::windows::free(&claims, ns.size_bytes, u64::from(ns.block_size)),
    ))
}

/// GetCapacity for the backend `req` names, with the node's volumes as they are now.
pub fn capacity(
    req: &v1::GetCapacityRequest,
    volumes: &[Volume],
    settings: &crate::config::Settings,
) -> Result<v1::Capacity, VolumeError> {
    use v1::get_capacity_request::Backend;
    let (available, total, extents) = match &req.backend {
        None => {
            return Err(VolumeError::ValidateRequest(
                "backend is required: file, ram or nvme".into(),
            ))
        }
        Some(Backend::File(f)) => {
            let root = crate::validate::capacity_root(&f.root, &settings.allowed_roots)?;
            let (a, t) = file_capacity(&root, volumes)?;
            (a, t, Vec::new())
        }
        Some(Backend::Ram(_)) => {
            let (a, t) = ram_capacity(&settings.ram_dir, volumes)?;
            (a, t, Vec::new())
        }
        Some(Backend::Nvme(n)) => {
            let device = crate::validate::nvme_device(&n.device)?;
            let (t, free) = nvme_capacity(&device, volumes)?;
            (free.iter().map(|e| e.len).sum(), t, free)
        }
    };
    let largest = if extents.is_empty() {
        available
    } else {
        extents.iter().map(|e| e.len).max().unwrap_or(0)
    };
    let left = settings.limits.max_volumes.saturating_sub(volumes.len());
    Ok(v1::Capacity {
        available_bytes: available,
        maximum_volume_bytes: largest.min(settings.limits.max_volume_size_bytes),
        total_bytes: total,
        volumes_left: u32::try_from(left).unwrap_or(u32::MAX),
        free_extents: extents
            .into_iter()
            .map(|e| v1::Extent {
                offset_bytes: e.offset,
                length_bytes: e.len,
            })
            .collect(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_volume(id: &str, path: &Path, size: u64) -> Volume {
        Volume {
            record: crate::record::VolumeRecord {
                id: crate::volume_id::VolumeId::parse(id).unwrap(),
                size_bytes: size,
                block_size: 4096,
                backend: BackendRecord::File {
                    path: path.to_owned(),
                    create: true,
                },
                queues: 1,
                queue_depth: 8,
                io_path: Default::default(),
                created_unix_ms: 0,
                dev_id: None,
                deleting: false,
                zero_copy: Default::default(),
                poll: Default::default(),
                qos: Default::default(),
                source: None,
            },
            state: crate::volume::State::Ready,
            device: None,
            message: String::new(),
        }
    }

    #[test]
    fn file_capacity_holds_back_what_sparse_volumes_may_still_write() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().canonicalize().unwrap();
        let settings = crate::config::Settings {
            allowed_roots: vec![root.clone()],
            ..Default::default()
        };
        let req = |r: &Path| v1::GetCapacityRequest {
            backend: Some(v1::get_capacity_request::Backend::File(v1::FileCapacity {
                root: r.display().to_string(),
            })),
        };
        let empty = capacity(&req(&root), &[], &settings).unwrap();
        assert!(empty.total_bytes > 0 && empty.available_bytes <= empty.total_bytes);
        // A 64 MiB sparse backing file: nothing written yet, all of it promised.
        let f = root.join("v.img");
        std::fs::File::create(&f)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let vols = [file_volume("v", &f, 64 << 20)];
        let with = capacity(&req(&root), &vols, &settings).unwrap();
        let held = empty.available_bytes.saturating_sub(with.available_bytes);
        // The file system may move by a few blocks meanwhile.
        assert!(
            (60 << 20..=68 << 20).contains(&held),
            "held back {held} bytes for a 64 MiB volume"
        );
        assert_eq!(with.volumes_left as usize, settings.limits.max_volumes - 1);
        // Outside the roots, missing, relative: refused with their own errors.
        assert!(matches!(
            capacity(&req(Path::new("/")), &[], &settings),
            Err(VolumeError::BackingPathOutsideRoots(_))
        ));
        assert!(matches!(
            capacity(&req(&root.join("nope")), &[], &settings),
            Err(VolumeError::BackingPathMissing(_))
        ));
        assert!(matches!(
            capacity(&v1::GetCapacityRequest { backend: None }, &[], &settings),
            Err(VolumeError::ValidateRequest(_))
        ));
    }
}
