//! NVMe windows: which part of a namespace each volume's record claims, whatever the volume's
//! state (READY, RECOVERING, FAILED: a record not served right now still owns its blocks), and
//! where a new window goes when ublkd places it. Pure functions over the records; the volume
//! manager calls them under its map lock, so two creates never take the same extent.

use crate::backend::BackendRecord;
use crate::record::VolumeRecord;
use crate::volume_id::VolumeId;
use std::path::{Path, PathBuf};
use ublkd_dataplane::NamespaceIdentity;

/// A byte range of a namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    pub offset: u64,
    pub len: u64,
}

/// The ranges of `0..size` that no window covers, each cut to whole blocks of `block` bytes
/// (a window's edges may fall mid-block only if its volume was made unchecked). Windows of
/// length 0 reach the end.
pub fn free_extents(size: u64, block: u64, windows: &[Extent]) -> Vec<Extent> {
    let block = block.max(1);
    let mut used: Vec<(u64, u64)> = windows
        .iter()
        .map(|w| {
            let end = if w.len == 0 {
                size
            } else {
                w.offset.saturating_add(w.len).min(size)
            };
            (w.offset.min(size), end)
        })
        .filter(|(a, b)| a < b)
        .collect();
    used.sort_unstable();
    let mut free = Vec::new();
    let mut at = 0u64;
    for (a, b) in used.into_iter().chain([(size, size)]) {
        if a > at {
            let start = at.next_multiple_of(block);
            let end = a - a % block;
            if end > start {
                free.push(Extent {
                    offset: start,
                    len: end - start,
                });
            }
        }
        at = at.max(b);
    }
    free
}

/// One record's claim on a namespace: `[start, end)`, `end` None reaching the namespace's end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub id: VolumeId,
    pub start: u64,
    pub end: Option<u64>,
}

impl Claim {
    fn overlaps(&self, start: u64, end: Option<u64>) -> bool {
        let before = |a_end: Option<u64>, b_start: u64| a_end.is_some_and(|e| e <= b_start);
        !(before(end, self.start) || before(self.end, start))
    }
}

/// The same namespace, whatever path names it (`/dev/ng0n1` and a symlink to it).
pub fn same_device(a: &Path, b: &Path) -> bool {
    let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
    a == b || real(a) == real(b)
}

/// The windows the records (other than `except`) claim on the namespace at `device` whose
/// identity is `identity`: a record is on it when both identities are known and equal, else
/// when its path names the same device (a record whose path is this boot's name of another
/// namespace is not, and one not yet found again at its new name still is, by identity).
pub fn claims<'a>(
    device: &Path,
    identity: Option<&NamespaceIdentity>,
    records: impl Iterator<Item = &'a VolumeRecord>,
    except: Option<&VolumeId>,
) -> Vec<Claim> {
    records
        .filter(|r| Some(&r.id) != except)
        .filter_map(|r| match &r.backend {
            BackendRecord::Nvme {
                device: d,
                offset,
                length,
                identity: i,
                ..
            } if match (identity, i) {
                (Some(a), Some(b)) => a == b,
                _ => same_device(d, device),
            } =>
            {
                Some(Claim {
                    id: r.id.clone(),
                    start: *offset,
                    end: (*length != 0).then(|| offset.saturating_add(*length)),
                })
            }
            _ => None,
        })
        .collect()
}

/// The first claim that `[start, start + len)` (`len` 0: to the end) overlaps.
pub fn overlap(claims: &[Claim], start: u64, len: u64) -> Option<&Claim> {
    let end = (len != 0).then(|| start.saturating_add(len));
    claims.iter().find(|c| c.overlaps(start, end))
}

/// The extents of a namespace of `ns_bytes` in blocks of `block` that no claim covers: what
/// GetCapacity reports, and where new windows go.
pub fn free(claims: &[Claim], ns_bytes: u64, block: u64) -> Vec<Extent> {
    let used: Vec<Extent> = claims
        .iter()
        .map(|c| Extent {
            offset: c.start,
            len: c.end.map_or(0, |e| e.saturating_sub(c.start).max(1)),
        })
        .collect();
    free_extents(ns_bytes, block, &used)
}

/// Where a window of `len` bytes goes: the first free extent that holds it.
pub fn place(claims: &[Claim], ns_bytes: u64, block: u64, len: u64) -> Option<u64> {
    free(claims, ns_bytes, block)
        .into_iter()
        .find(|e| e.len >= len)
        .map(|e| e.offset)
}

/// The namespace of an NVMe record.
pub fn nvme_device(r: &VolumeRecord) -> Option<&PathBuf> {
    match &r.backend {
        BackendRecord::Nvme { device, .. } => Some(device),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn x(offset: u64, len: u64) -> Extent {
        Extent { offset, len }
    }

    #[test]
    fn free_extents_are_the_gaps_between_windows_in_whole_blocks() {
        assert_eq!(free_extents(100, 1, &[]), vec![x(0, 100)]);
        assert_eq!(
            free_extents(100, 1, &[x(10, 20), x(50, 10)]),
            vec![x(0, 10), x(30, 20), x(60, 40)]
        );
        // Overlapping and unsorted windows, one reaching the end (length 0).
        assert_eq!(
            free_extents(100, 1, &[x(70, 0), x(20, 30), x(10, 20)]),
            vec![x(0, 10), x(50, 20)]
        );
        // Whole blocks only.
        assert_eq!(
            free_extents(4096 * 4, 4096, &[x(4096, 100)]),
            vec![x(0, 4096), x(8192, 8192)]
        );
        // Full, and windows past the end.
        assert!(free_extents(100, 1, &[x(0, 0)]).is_empty());
        assert_eq!(free_extents(100, 1, &[x(200, 10)]), vec![x(0, 100)]);
    }

    fn rec(id: &str, offset: u64, length: u64) -> VolumeRecord {
        VolumeRecord {
            id: VolumeId::parse(id).unwrap(),
            size_bytes: length.max(4096),
            block_size: 4096,
            backend: BackendRecord::Nvme {
                device: "/dev/ng9n9".into(),
                offset,
                length,
                keep_data: false,
                identity: None,
            },
            queues: 1,
            queue_depth: 32,
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
        }
    }

    /// Every record counts, whatever its volume's state; the overlap names it (issue 22,
    /// item 4).
    #[test]
    fn windows_overlap_any_record_and_new_ones_go_in_the_first_gap_that_fits() {
        const M: u64 = 1 << 20;
        let records = [
            rec("a", 0, 16 * M),
            rec("b", 32 * M, 16 * M),
            rec("c", 96 * M, 0),
        ];
        let me = VolumeId::parse("new").unwrap();
        let cl = claims(Path::new("/dev/ng9n9"), None, records.iter(), Some(&me));
        assert_eq!(cl.len(), 3);
        assert_eq!(
            overlap(&cl, 8 * M, 16 * M).map(|c| c.id.to_string()),
            Some("a".into())
        );
        assert_eq!(
            overlap(&cl, 16 * M, 16 * M),
            None,
            "touching is not overlapping"
        );
        assert_eq!(
            overlap(&cl, 40 * M, 0).map(|c| c.id.to_string()),
            Some("b".into())
        );
        assert_eq!(
            overlap(&cl, 200 * M, M).map(|c| c.id.to_string()),
            Some("c".into())
        );
        // Placement: first gap that holds the size.
        assert_eq!(place(&cl, 256 * M, 4096, 16 * M), Some(16 * M));
        assert_eq!(place(&cl, 256 * M, 4096, 17 * M), Some(48 * M));
        assert_eq!(place(&cl, 256 * M, 4096, 49 * M), None, "c reaches the end");
        // A record does not collide with itself (a resize of it).
        let a = VolumeId::parse("a").unwrap();
        let others = claims(Path::new("/dev/ng9n9"), None, records.iter(), Some(&a));
        assert_eq!(overlap(&others, 0, 32 * M), None);
        // Another namespace's windows do not count.
        assert!(claims(Path::new("/dev/ng8n8"), None, records.iter(), Some(&me)).is_empty());
    }
}
