//! A volume as the server keeps it across restarts: the record in the volume registry
//! (`<state_dir>/registry/`, one JSON file per volume), from which a restart brings it back.
//!
//! Spec choices are the dataplane's own enums, stored by name (`"auto"`, `"per_io"`, `"on"`;
//! `"per-io"`, the notation's spelling, is read too):
//! the very strings releases before them wrote, so their files load unchanged.

use crate::backend::BackendRecord;
use crate::registry::{Record, Registry, RegistryError};
use crate::snapshot::SnapshotId;
use crate::volume_id::VolumeId;
use serde::{Deserialize, Serialize};
use std::path::Path;
use ublkd_dataplane::{DevId, IoPath, QosLimits, Toggle};

/// Everything needed to bring a volume back.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VolumeRecord {
    pub id: VolumeId,
    pub size_bytes: u64,
    pub block_size: u32,
    pub backend: BackendRecord,
    pub queues: u16,
    pub queue_depth: u16,
    pub io_path: IoPath,
    pub created_unix_ms: i64,
    /// The kernel device id: chosen before the device is created, so after a crash at any
    /// point the next start finds (and takes over) the device this record made.
    pub dev_id: Option<DevId>,
    /// A delete was started: the next start finishes it.
    #[serde(default)]
    pub deleting: bool,
    /// With `deleting`: the delete takes the backing file too (asked by its caller).
    #[serde(default, skip_serializing_if = "is_false")]
    pub delete_backing: bool,
    /// Absent in records written before zero copy could be chosen: auto.
    #[serde(default)]
    pub zero_copy: Toggle,
    #[serde(default)]
    pub poll: Toggle,
    /// I/O limits (absent: unlimited); changed live by SetVolumeQos.
    #[serde(default, skip_serializing_if = "QosLimits::is_unlimited")]
    pub qos: QosLimits,
    /// What a cloned volume's backing file was reflinked from when it was created.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<SourceRecord>,
    /// The Kubernetes claim it was made for, when the CSI driver said (absent in older
    /// records, and for volumes made by hand).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claim: Option<ClaimRecord>,
    /// Settings lowered at creation to fit this node (`fit_to_node`), with what was asked.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub adjustments: Vec<Adjustment>,
    /// Bytes of an NVMe namespace that must be erased before they are served: set with the
    /// record of a new window (or of its growth) and cleared once the erase is done, so that a
    /// crash in between is finished by the next start, never served unerased.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub erase_pending: Option<EraseRange>,
}

/// `[from, to)`: a byte range of an NVMe namespace.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EraseRange {
    pub from: u64,
    pub to: u64,
}

/// A setting ublkd may lower to fit its node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AdjustedSetting {
    Queues,
    QueueDepth,
}

/// One setting lowered at creation: asked `requested`, got `applied`, the node's limit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Adjustment {
    pub setting: AdjustedSetting,
    pub requested: u32,
    pub applied: u32,
}

/// A PersistentVolumeClaim and its PersistentVolume, by name; each checked to be a Kubernetes
/// object name (`validate::claim`), empty when the driver did not know it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClaimRecord {
    pub namespace: String,
    pub name: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub persistent_volume: String,
}

/// Where a cloned volume's first contents came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "lowercase")]
pub enum SourceRecord {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

#[cfg(test)]
impl VolumeRecord {
    /// A record with the choices a test does not care about at their plain values (one queue
    /// of 64, auto everything, no limits), for the tests and the simulator.
    pub fn example(id: VolumeId, size_bytes: u64, backend: BackendRecord) -> VolumeRecord {
        VolumeRecord {
            id,
            size_bytes,
            block_size: 4096,
            backend,
            queues: 1,
            queue_depth: 64,
            io_path: IoPath::Auto,
            created_unix_ms: 0,
            dev_id: None,
            deleting: false,
            delete_backing: false,
            zero_copy: Toggle::Auto,
            poll: Toggle::Auto,
            qos: QosLimits::default(),
            source: None,
            claim: None,
            adjustments: Vec::new(),
            erase_pending: None,
        }
    }
}

impl Record for VolumeRecord {
    const KIND: &'static str = "volume";
    const UNREADABLE_STOPS_LOAD: bool = true;
    /// 2: the first with `format` (issue 56); 1 is every record before it, read unchanged.
    const FORMAT: u64 = 2;
    fn id(&self) -> &str {
        self.id.as_str()
    }
}

/// serde's `skip_serializing_if` for a flag that is off.
fn is_false(b: &bool) -> bool {
    !b
}

/// The volume registry under `state_dir`.
pub fn volume_registry(state_dir: &Path) -> Result<Registry<VolumeRecord>, RegistryError> {
    Registry::open_dir(state_dir.join("registry"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    /// Records as the releases that stored these choices as strings wrote them (copied from a
    /// registry directory of that release), and one from before zero copy and polling existed.
    const OLD_RECORDS: [(&str, &str); 3] = [
        (
            "f1",
            r#"{
  "id": "f1",
  "size_bytes": 16777216,
  "block_size": 4096,
  "backend": {
    "kind": "file",
    "path": "/srv/roots/f1.img",
    "create": true
  },
  "queues": 2,
  "queue_depth": 128,
  "io_path": "per_io",
  "created_unix_ms": 1764500000000,
  "dev_id": 4,
  "deleting": false,
  "zero_copy": "off",
  "poll": "auto"
}"#,
        ),
        (
            "n1",
            r#"{
  "id": "n1",
  "size_bytes": 1073741824,
  "block_size": 512,
  "backend": {
    "kind": "nvme",
    "device": "/dev/ng0n1",
    "offset": 1048576,
    "length": 0
  },
  "queues": 1,
  "queue_depth": 64,
  "io_path": "batch",
  "created_unix_ms": 1764500000001,
  "dev_id": null,
  "deleting": true,
  "zero_copy": "on",
  "poll": "on"
}"#,
        ),
        (
            "r1",
            r#"{"id":"r1","size_bytes":4096,"block_size":4096,"backend":{"kind":"ram"},"queues":1,"queue_depth":128,"io_path":"auto","created_unix_ms":5,"dev_id":0}"#,
        ),
    ];

    /// The registry the build of b69c0a8 wrote (tests/fixtures/registry-b69c0a8): every
    /// field of every record reads as it meant, and the snapshot too.
    #[test]
    fn the_registry_of_b69c0a8_loads_field_by_field() {
        let fixtures =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/registry-b69c0a8");
        let dir = tempfile::tempdir().unwrap();
        for sub in ["registry", "snapshots"] {
            fs::create_dir_all(dir.path().join(sub)).unwrap();
            for f in fs::read_dir(fixtures.join(sub)).unwrap() {
                let f = f.unwrap().path();
                let body = fs::read_to_string(&f)
                    .unwrap()
                    .replace("@ROOT@", "/srv/roots")
                    .replace("@NVME@", "/dev/ng0n1");
                fs::write(dir.path().join(sub).join(f.file_name().unwrap()), body).unwrap();
            }
        }
        let (all, report) = volume_registry(dir.path()).unwrap().load().unwrap();
        assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
        let by = |id: &str| all.iter().find(|r| r.id.as_str() == id).unwrap();
        let file = by("up-file");
        assert_eq!(
            file.backend,
            BackendRecord::File {
                path: "/srv/roots/up-file.img".into(),
                create: true
            }
        );
        assert_eq!(
            (file.size_bytes, file.queue_depth, file.io_path, file.dev_id),
            (64 << 20, 64, IoPath::Batch, Some(DevId(40)))
        );
        assert_eq!(file.qos.write_bytes_per_sec, 100 << 20);
        assert_eq!(file.claim.as_ref().map(|c| c.name.as_str()), Some("data"));
        let nvme = by("up-nvme");
        assert_eq!(
            nvme.backend,
            BackendRecord::Nvme {
                device: "/dev/ng0n1".into(),
                offset: 0,
                length: 64 << 20,
                keep_data: false,
                identity: None,
            }
        );
        assert_eq!((nvme.io_path, nvme.zero_copy), (IoPath::PerIo, Toggle::Off));
        let null = by("up-null");
        assert_eq!(
            (null.block_size, null.queues, null.poll),
            (512, 2, Toggle::Off)
        );
        assert_eq!(null.adjustments.len(), 1);
        let snaps: crate::registry::Registry<crate::snapshot::SnapshotRecord> =
            crate::registry::Registry::open_dir(dir.path().join("snapshots")).unwrap();
        let (snaps, report) = snaps.load().unwrap();
        assert!(report.corrupt.is_empty());
        assert_eq!(snaps.len(), 1);
        assert_eq!(snaps[0].source.as_str(), "up-file");
    }

    #[test]
    fn records_of_earlier_releases_load_as_typed_choices() {
        let dir = tempfile::tempdir().unwrap();
        let reg = volume_registry(dir.path()).unwrap();
        for (id, body) in OLD_RECORDS {
            fs::write(dir.path().join("registry").join(format!("{id}.json")), body).unwrap();
        }
        let (all, report) = reg.load().unwrap();
        assert!(report.corrupt.is_empty(), "{:?}", report.corrupt);
        let got: Vec<_> = all
            .iter()
            .map(|r| (r.id.as_str(), r.io_path, r.zero_copy, r.poll, r.deleting))
            .collect();
        assert_eq!(
            got,
            [
                ("f1", IoPath::PerIo, Toggle::Off, Toggle::Auto, false),
                ("n1", IoPath::Batch, Toggle::On, Toggle::On, true),
                ("r1", IoPath::Auto, Toggle::Auto, Toggle::Auto, false),
            ]
        );
        // Written back, a record reads the same to the release before: same names, and the
        // format it is now written in beside them.
        reg.put(&all[0]).unwrap();
        let mut again: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.path().join("registry/f1.json")).unwrap())
                .unwrap();
        let format = again.as_object_mut().and_then(|m| m.remove("format"));
        assert_eq!(format, Some(VolumeRecord::FORMAT.into()));
        let before: serde_json::Value = serde_json::from_str(OLD_RECORDS[0].1).unwrap();
        assert_eq!(again, before);
        // A choice no release wrote is an unreadable record, not a guess: the load stops,
        // naming it, and the file stays where it is (issue 55, review M3: moved aside, the
        // record took its volume's claims with it).
        let bad = OLD_RECORDS[2].1.replace("\"auto\"", "\"sideways\"");
        let path = dir.path().join("registry/r1.json");
        fs::write(&path, &bad).unwrap();
        let refused = reg.load();
        assert!(
            matches!(&refused, Err(RegistryError::Unreadable { path: p, .. }) if *p == path),
            "{refused:?}"
        );
        assert_eq!(
            fs::read_to_string(&path).unwrap(),
            bad,
            "the record stays as it was"
        );
    }
}
