//! Snapshots of file volumes as the server keeps them: the record (one JSON file each, in the
//! snapshot registry) and the id.
//!
//! A snapshot is a reflink copy of a volume's backing file, made with the volume drained, in
//! `.ublkd-snapshots/` beside that file (a reflink never crosses file systems). It shares every
//! block with the volume until either is written, so taking one costs neither time nor space
//! that grows with the volume.

use crate::registry::Record;
use crate::volume_id::VolumeId;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Directory, beside a backing file, that holds the snapshots of the volumes in its directory.
pub const SNAPSHOT_DIR: &str = ".ublkd-snapshots";

/// A snapshot's id: the same rule as a volume id (a DNS label), a type of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
pub struct SnapshotId(VolumeId);

impl SnapshotId {
    /// 1-63 of `[a-z0-9-]`, starting and ending with a letter or digit; the error names it.
    pub fn parse(id: &str) -> Result<Self, String> {
        VolumeId::parse(id)
            .map(SnapshotId)
            .map_err(|e| e.to_string().replacen("volume id", "snapshot id", 1))
    }

    pub fn as_str(&self) -> &str {
        self.0.as_str()
    }
}

impl std::fmt::Display for SnapshotId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::borrow::Borrow<str> for SnapshotId {
    fn borrow(&self) -> &str {
        self.as_str()
    }
}

/// One snapshot as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SnapshotRecord {
    pub id: SnapshotId,
    /// The volume it was taken of (which may since have been deleted).
    pub source: VolumeId,
    /// The volume's size when it was taken.
    pub size_bytes: u64,
    /// The copy.
    pub path: PathBuf,
    pub created_unix_ms: i64,
}

impl Record for SnapshotRecord {
    const KIND: &'static str = "snapshot";
    const FORMAT: u64 = 2;
    fn id(&self) -> &str {
        self.id.as_str()
    }
}

/// A backing file being made, a clone's or a new file volume's: the file at `path` is ublkd's
/// own until volume `id`'s record names it. Written before the reflink or the file's creation
/// and removed once the volume's record is (or the file is gone), so a crash in between leaves
/// a file that a retry of the same create, or the next start, knows to remove, and never a
/// user's file mistaken for one.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileIntent {
    pub id: VolumeId,
    pub path: PathBuf,
}

impl Record for FileIntent {
    const KIND: &'static str = "file intent";
    const FORMAT: u64 = 2;
    fn id(&self) -> &str {
        self.id.as_str()
    }
}

/// Where the snapshot `id` of a volume backed by `backing` lives.
pub fn snapshot_path(backing: &Path, id: &SnapshotId) -> PathBuf {
    let dir = backing.parent().unwrap_or(Path::new("/"));
    dir.join(SNAPSHOT_DIR).join(format!("{id}.img"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshot_ids_follow_the_volume_rule_and_name_themselves() {
        assert_eq!(SnapshotId::parse("snap-1").unwrap().as_str(), "snap-1");
        let e = SnapshotId::parse("Snap_1").unwrap_err();
        assert!(e.starts_with("snapshot id \"Snap_1\""), "{e}");
    }

    #[test]
    fn snapshots_live_beside_the_backing_file() {
        let id = SnapshotId::parse("s1").unwrap();
        assert_eq!(
            snapshot_path(Path::new("/srv/ublkd/v1.img"), &id),
            Path::new("/srv/ublkd/.ublkd-snapshots/s1.img")
        );
    }

    #[test]
    fn records_round_trip_through_json() {
        let r = SnapshotRecord {
            id: SnapshotId::parse("s1").unwrap(),
            source: VolumeId::parse("v1").unwrap(),
            size_bytes: 1 << 30,
            path: "/srv/.ublkd-snapshots/s1.img".into(),
            created_unix_ms: 5,
        };
        let back: SnapshotRecord =
            serde_json::from_slice(&serde_json::to_vec(&r).unwrap()).unwrap();
        assert_eq!(back, r);
    }
}
