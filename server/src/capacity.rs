//! What this node can still provide, per backend: the answer to GetCapacity, which the CSI
//! driver turns into CSIStorageCapacity objects so the scheduler only sends a volume to a node
//! it fits on.

use crate::backend::{BackendRecord, Pool};
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::volume::Volume;
use std::path::Path;
use ublkd_dataplane::DataplaneError;
use ublkd_proto::v1;

/// Capacity for a file backend under `root` (already resolved inside the allowed roots):
/// the file system's available bytes less what existing volumes there may still write into
/// their sparse backing files.
fn file_capacity(root: &Path, volumes: &[Volume]) -> Result<(u64, u64), VolumeError> {
    file_space(root, volumes.iter().map(|v| &v.record))
}

/// `file_capacity` over records: the free bytes under `root` less what the file volumes
/// `records` name there may still write, and the file system's size.
fn file_space<'a>(
    root: &Path,
    records: impl Iterator<Item = &'a VolumeRecord>,
) -> Result<(u64, u64), VolumeError> {
    let (avail, total) =
        ublkd_dataplane::fs_space(root).map_err(|source| VolumeError::ReadCapacity {
            path: root.to_owned(),
            source,
        })?;
    let promised: u64 = records
        .filter_map(|r| match &r.backend {
            BackendRecord::File { path, .. } if path.starts_with(root) => {
                Some(r.size_bytes.saturating_sub(owned_bytes(path)))
            }
            _ => None,
        })
        .sum();
    Ok((avail.saturating_sub(promised), total))
}

/// Whether file volume `record` may grow to `size`: the growth fits what its file system has
/// free after every file volume there (`records`, the volume itself at its current size
/// included) may still write. The pool is the allowed root holding the file, else its
/// directory.
pub fn admit_file_growth<'a>(
    record: &VolumeRecord,
    size: u64,
    roots: &[std::path::PathBuf],
    records: impl Iterator<Item = &'a VolumeRecord>,
) -> Result<(), VolumeError> {
    let BackendRecord::File { path, .. } = &record.backend else {
        return Ok(());
    };
    let Some(root) = roots
        .iter()
        .map(|r| r.as_path())
        .find(|r| path.starts_with(r))
        .or_else(|| path.parent())
    else {
        return Ok(());
    };
    let need = size.saturating_sub(record.size_bytes);
    let (left, _) = file_space(root, records)?;
    if need > left {
        return Err(VolumeError::AdmitFileSpace {
            root: root.to_owned(),
            need,
            left,
        });
    }
    Ok(())
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

/// Whether the file system under `root` clones a file by reflink: one unnamed file (O_TMPFILE,
/// so nothing is left behind if ublkd dies here) cloned into another. A root where this fails
/// refuses snapshots and clones of its file volumes; the node's status says so before a user
/// finds out.
pub fn clones_by_reflink(root: &Path) -> bool {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let unnamed = || {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .custom_flags(libc::O_TMPFILE)
            .mode(0o600)
            .open(root)
    };
    let (Ok(mut src), Ok(dst)) = (unnamed(), unnamed()) else {
        return false;
    };
    src.write_all(&[0u8; 4096]).is_ok() && crate::sys::reflink(&dst, &src).is_ok()
}

/// Bytes of one tag's copy buffer: the dataplane's largest request.
const BUFFER_PER_TAG: u64 = ublkd_dataplane::DEFAULT_MAX_IO_BYTES as u64;

/// What ublkd needs besides its volumes' memory: code, runtime, rings, registry, metrics.
pub const MEMORY_RESERVE: u64 = 256 << 20;

/// The most memory volume `r` can hold in ublkd's cgroup: its copy buffers (one per tag, pinned
/// once the queue copies; with zero copy they appear when a request needs the fallback, so
/// they count whatever the mode) and a RAM volume's pages (tmpfs pages are charged to the
/// cgroup that writes them).
pub fn memory_bytes(r: &VolumeRecord) -> u64 {
    let buffers = buffer_bytes(r.queues, r.queue_depth);
    let pages = if r.backend == BackendRecord::Ram {
        r.size_bytes
    } else {
        0
    };
    buffers.saturating_add(pages)
}

/// The copy buffers of a volume of `queues` x `depth` tags.
fn buffer_bytes(queues: u16, depth: u16) -> u64 {
    u64::from(queues) * u64::from(depth) * BUFFER_PER_TAG
}

/// Memory left for volumes under `limit` (ublkd's cgroup's), after `records` and the reserve;
/// None when there is no limit.
pub fn memory_left<'a>(
    limit: Option<u64>,
    records: impl Iterator<Item = &'a VolumeRecord>,
) -> Option<u64> {
    let used: u64 = records.map(memory_bytes).sum();
    Some(limit?.saturating_sub(MEMORY_RESERVE).saturating_sub(used))
}

/// `memory.max` as cgroup v2 writes it: bytes, or `max` (None).
fn parse_memory_max(text: &str) -> Option<u64> {
    text.trim().parse().ok()
}

/// What ublkd knows of its cgroup's memory limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryLimit {
    /// The smallest `memory.max` of its cgroup v2 and the ancestors.
    Bytes(u64),
    /// cgroup v2, and no `memory.max` on the way up is set.
    Unlimited,
    /// Not found out (cgroup v1, an unreadable `/proc/self/cgroup`): said at start, since
    /// volumes are then admitted as if there were no limit, though one may be enforced.
    Unknown(&'static str),
}

impl MemoryLimit {
    /// The limit volumes are admitted within (None: none known).
    pub fn bytes(self) -> Option<u64> {
        match self {
            MemoryLimit::Bytes(n) => Some(n),
            MemoryLimit::Unlimited | MemoryLimit::Unknown(_) => None,
        }
    }
}

/// The smallest `memory.max` of ublkd's cgroup v2 and its ancestors (a container's, a pod's, a
/// systemd slice's): what an OOM kill would enforce.
pub fn cgroup_memory_limit() -> MemoryLimit {
    let Ok(own) = std::fs::read_to_string("/proc/self/cgroup") else {
        return MemoryLimit::Unknown("/proc/self/cgroup cannot be read");
    };
    let Some(path) = own.lines().find_map(|l| l.strip_prefix("0::")) else {
        return MemoryLimit::Unknown(
            "/proc/self/cgroup has no cgroup v2 entry (cgroup v1, or none mounted): no memory.max to read",
        );
    };
    let mut dir = Path::new("/sys/fs/cgroup").join(path.trim_start_matches('/'));
    let mut least: Option<u64> = None;
    loop {
        let max = std::fs::read_to_string(dir.join("memory.max")).ok();
        if let Some(n) = max.as_deref().and_then(parse_memory_max) {
            least = Some(least.map_or(n, |l| l.min(n)));
        }
        if dir == Path::new("/sys/fs/cgroup") || !dir.pop() {
            return least.map_or(MemoryLimit::Unlimited, MemoryLimit::Bytes);
        }
    }
}

/// Capacity for RAM volumes: the RAM directory's size less every RAM volume's whole size (they
/// may all fill up; tmpfs pages are never overcommitted here), within what is free now.
fn ram_capacity(
    settings: &crate::config::Settings,
    volumes: &[Volume],
) -> Result<(u64, u64), VolumeError> {
    let ram_dir = settings.ram_dir.as_path();
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
    let avail = avail.min(total.saturating_sub(promised));
    // Within ublkd's memory limit too: past it, the OOM kill would stall every volume.
    let left = memory_left(settings.memory_limit, volumes.iter().map(|v| &v.record));
    Ok((left.map_or(avail, |l| avail.min(l)), total))
}

/// The namespace behind `device`: its size, block size and the extents no volume covers.
/// A namespace the host itself seems to use, and that no volume has a window of yet, offers
/// nothing: it is refused with the reason (which `kubectl ublkd check` shows), as a create on
/// it is, unless the configuration allows it.
fn nvme_capacity(
    device: &Path,
    volumes: &[Volume],
    limits: &crate::config::Limits,
) -> Result<(u64, Vec<crate::windows::Extent>), VolumeError> {
    crate::hooks::delay_point_blocking(crate::hooks::Point::CapacityIdentify);
    let ns = ublkd_dataplane::identify_namespace(device)
        .map_err(|e| VolumeError::Dataplane(DataplaneError::from(e)))?;
    let records = volumes.iter().map(|v| &v.record);
    let claims = crate::windows::claims(device, ns.identity.as_ref(), records, None);
    if claims.is_empty() && !limits.allows_used_namespace(device, ns.identity.as_ref()) {
        let used = ublkd_dataplane::namespace_host_use(device)
            .map_err(|e| VolumeError::Dataplane(DataplaneError::from(e)))?;
        if let Some(why) = used {
            return Err(VolumeError::NamespaceInUse {
                device: device.to_owned(),
                why,
            });
        }
    }
    Ok((
        ns.size_bytes,
        crate::windows::free(&claims, ns.size_bytes, u64::from(ns.block_size)),
    ))
}

/// The node's pools: every allowed root, the RAM directory, and every NVMe namespace a volume
/// has a window on (a namespace no volume uses yet has nothing in it to watch), in that order.
pub fn pools(settings: &crate::config::Settings, volumes: &[Volume]) -> Vec<Pool> {
    let mut out: Vec<Pool> = settings
        .allowed_roots
        .iter()
        .map(|r| Pool::File(r.clone()))
        .collect();
    out.push(Pool::Ram);
    let mut namespaces: Vec<Pool> = volumes
        .iter()
        .filter_map(|v| v.record.backend.own_pool())
        .collect();
    namespaces.sort();
    namespaces.dedup();
    out.extend(namespaces);
    out
}

/// `(total, free)` bytes of `pool`, as GetCapacity counts them (`total_bytes`,
/// `available_bytes`).
pub fn pool_space(
    pool: &Pool,
    volumes: &[Volume],
    settings: &crate::config::Settings,
) -> Result<(u64, u64), VolumeError> {
    match pool {
        Pool::File(root) => file_capacity(root, volumes).map(|(a, t)| (t, a)),
        Pool::Ram => ram_capacity(settings, volumes).map(|(a, t)| (t, a)),
        Pool::Nvme(device) => nvme_capacity(device, volumes, &settings.limits)
            .map(|(t, free)| (t, free.iter().map(|e| e.len).sum())),
    }
}

/// How many more volumes the node admits: its volume limit, and within ublkd's memory limit as
/// many volumes of the node's default queues and depth as their copy buffers fit (what the
/// node's CSI volume limit and `volumes_left` tell the scheduler: the chart's 4 GiB holds about
/// 60 volumes of 1 x 128 tags, not the 1024 of `max_volumes`).
pub fn volumes_left(settings: &crate::config::Settings, volumes: &[Volume]) -> usize {
    let by_count = settings.limits.max_volumes.saturating_sub(volumes.len());
    let records = volumes.iter().map(|v| &v.record);
    let Some(memory) = memory_left(settings.memory_limit, records) else {
        return by_count;
    };
    let each = buffer_bytes(settings.defaults.queues, settings.defaults.queue_depth).max(1);
    by_count.min(usize::try_from(memory / each).unwrap_or(usize::MAX))
}

/// GetCapacity for the backend `req` names, with the node's volumes as they are now;
/// `serving`: whether the dataplane runs.
pub fn capacity(
    req: &v1::GetCapacityRequest,
    volumes: &[Volume],
    settings: &crate::config::Settings,
    serving: bool,
) -> Result<v1::Capacity, VolumeError> {
    let pool = Pool::of_request(req.backend.as_ref(), settings)?;
    if !serving {
        // No volume can be made here: nothing is offered, as an answer rather than an error,
        // so that the provisioner replaces the node's CSIStorageCapacity instead of keeping
        // the last one it read.
        return Ok(v1::Capacity::default());
    }
    let (available, total, extents) = match &pool {
        Pool::File(root) => {
            let (a, t) = file_capacity(root, volumes)?;
            (a, t, Vec::new())
        }
        Pool::Ram => {
            let (a, t) = ram_capacity(settings, volumes)?;
            (a, t, Vec::new())
        }
        Pool::Nvme(device) => {
            let (t, free) = nvme_capacity(device, volumes, &settings.limits)?;
            (free.iter().map(|e| e.len).sum(), t, free)
        }
    };
    let largest = if extents.is_empty() {
        available
    } else {
        extents.iter().map(|e| e.len).max().unwrap_or(0)
    };
    let left = volumes_left(settings, volumes);
    let reflink = match &pool {
        Pool::File(root) => clones_by_reflink(root),
        Pool::Ram | Pool::Nvme(_) => false,
    };
    Ok(v1::Capacity {
        reflink,
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

    #[test]
    fn memory_max_reads_as_bytes_or_unlimited() {
        assert_eq!(parse_memory_max("4294967296\n"), Some(4 << 30));
        assert_eq!(parse_memory_max("max\n"), None);
        assert_eq!(parse_memory_max(""), None);
    }

    #[test]
    fn a_volume_holds_its_copy_buffers_and_a_ram_volumes_pages() {
        let rec = |backend, queues, depth| {
            let mut r = file_volume("a", Path::new("/srv/a.img"), 1 << 30).record;
            (r.backend, r.queues, r.queue_depth) = (backend, queues, depth);
            r
        };
        let null = rec(BackendRecord::Null, 2, 128);
        assert_eq!(memory_bytes(&null), 2 * 128 * (512 << 10));
        let ram = rec(BackendRecord::Ram, 1, 128);
        assert_eq!(memory_bytes(&ram), (64 << 20) + (1 << 30));
        assert_eq!(memory_left(None, [&null].into_iter()), None);
        let limit = Some(MEMORY_RESERVE + (1 << 30));
        assert_eq!(
            memory_left(limit, [&null].into_iter()),
            Some((1 << 30) - (128 << 20))
        );
        assert_eq!(memory_left(limit, [&null, &ram].into_iter()), Some(0));
    }

    #[test]
    fn a_root_that_cannot_hold_a_file_does_not_clone() {
        assert!(!clones_by_reflink(Path::new("/nonexistent/ublkd-root")));
    }
    use std::path::PathBuf;

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
                delete_backing: false,
                zero_copy: Default::default(),
                poll: Default::default(),
                qos: Default::default(),
                source: None,
                claim: None,
                adjustments: Vec::new(),
                erase_pending: None,
            },
            state: crate::volume::State::Ready,
            device: None,
            message: String::new(),
        }
    }

    /// `dir` (canonical) as the one allowed root, its `ram` the RAM directory.
    fn settings_in(dir: &Path) -> (PathBuf, crate::config::Settings) {
        let root = dir.canonicalize().unwrap();
        let settings = crate::config::Settings {
            allowed_roots: vec![root.clone()],
            ram_dir: root.join("ram"),
            ..Default::default()
        };
        (root, settings)
    }

    #[test]
    fn the_pools_are_the_roots_the_ram_directory_and_the_namespaces_in_use() {
        let dir = tempfile::tempdir().unwrap();
        let (root, settings) = settings_in(dir.path());
        let mut nvme = file_volume("n", &root.join("x"), 1 << 20);
        nvme.record.backend = BackendRecord::Nvme {
            device: "/dev/ng0n1".into(),
            offset: 0,
            length: 1 << 20,
            keep_data: false,
            identity: None,
        };
        let mut nvme2 = nvme.clone();
        nvme2.record.id = crate::volume_id::VolumeId::parse("n2").unwrap();
        let vols = [file_volume("v", &root.join("v.img"), 1 << 20), nvme, nvme2];
        assert_eq!(
            pools(&settings, &vols),
            [
                Pool::File(root.clone()),
                Pool::Ram,
                Pool::Nvme("/dev/ng0n1".into())
            ]
        );
        // Each pool measured as GetCapacity measures it.
        let (total, free) = pool_space(&Pool::File(root.clone()), &vols[..1], &settings).unwrap();
        let req = v1::GetCapacityRequest {
            backend: Some(v1::get_capacity_request::Backend::File(v1::FileCapacity {
                root: root.display().to_string(),
            })),
        };
        let answer = capacity(&req, &vols[..1], &settings, true).unwrap();
        assert_eq!(total, answer.total_bytes);
        // The file system may move by a few blocks between the two reads.
        assert!(
            free.abs_diff(answer.available_bytes) < 1 << 20,
            "{free} vs {answer:?}"
        );
        let (rt, rf) = pool_space(&Pool::Ram, &[], &settings).unwrap();
        assert!(rt > 0 && rf <= rt);
        assert!(pool_space(&Pool::File(root.join("missing")), &[], &settings).is_err());
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
        let empty = capacity(&req(&root), &[], &settings, true).unwrap();
        assert!(empty.total_bytes > 0 && empty.available_bytes <= empty.total_bytes);
        // A 64 MiB sparse backing file: nothing written yet, all of it promised.
        let f = root.join("v.img");
        std::fs::File::create(&f)
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        let vols = [file_volume("v", &f, 64 << 20)];
        let with = capacity(&req(&root), &vols, &settings, true).unwrap();
        let held = empty.available_bytes.saturating_sub(with.available_bytes);
        // The file system may move by a few blocks meanwhile.
        assert!(
            (60 << 20..=68 << 20).contains(&held),
            "held back {held} bytes for a 64 MiB volume"
        );
        assert_eq!(with.volumes_left as usize, settings.limits.max_volumes - 1);
        // Under a memory limit, as many more as the default volume's copy buffers fit (issue
        // 55: the chart's 4 GiB admits about 60 while the scheduler was told 1024).
        let each = buffer_bytes(settings.defaults.queues, settings.defaults.queue_depth);
        let limited = crate::config::Settings {
            memory_limit: Some(MEMORY_RESERVE + memory_bytes(&vols[0].record) + 7 * each + 1),
            ..settings.clone()
        };
        let with = capacity(&req(&root), &vols, &limited, true).unwrap();
        assert_eq!(with.volumes_left, 7);
        let chart = crate::config::Settings {
            memory_limit: Some(4 << 30),
            ..settings.clone()
        };
        let left = capacity(&req(&root), &[], &chart, true)
            .unwrap()
            .volumes_left;
        assert!(
            (50..70).contains(&left),
            "4 GiB admits {left} volumes of 1 x 128 tags"
        );
        // Outside the roots, missing, relative: refused with their own errors.
        assert!(matches!(
            capacity(&req(Path::new("/")), &[], &settings, true),
            Err(VolumeError::BackingPathOutsideRoots(_))
        ));
        assert!(matches!(
            capacity(&req(&root.join("nope")), &[], &settings, true),
            Err(VolumeError::BackingPathMissing(_))
        ));
        assert!(matches!(
            capacity(
                &v1::GetCapacityRequest { backend: None },
                &[],
                &settings,
                true
            ),
            Err(VolumeError::ValidateRequest(_))
        ));
    }

    #[test]
    fn a_node_without_a_dataplane_offers_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let (root, settings) = settings_in(dir.path());
        use v1::get_capacity_request::Backend;
        for backend in [
            Backend::File(v1::FileCapacity {
                root: root.display().to_string(),
            }),
            Backend::Ram(v1::RamBackend {}),
            // a namespace that is not there: nothing is measured
            Backend::Nvme(v1::NvmeCapacity {
                device: "/dev/ng-none".into(),
            }),
        ] {
            let req = v1::GetCapacityRequest {
                backend: Some(backend),
            };
            let answer = capacity(&req, &[], &settings, false).unwrap();
            assert_eq!(answer, v1::Capacity::default(), "{req:?}");
            assert_eq!((answer.volumes_left, answer.available_bytes), (0, 0));
        }
        // The request is still checked.
        assert!(matches!(
            capacity(
                &v1::GetCapacityRequest { backend: None },
                &[],
                &settings,
                false
            ),
            Err(VolumeError::ValidateRequest(_))
        ));
    }
}
