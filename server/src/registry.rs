//! The registries: one JSON file per volume under `<state_dir>/registry/` (and per snapshot
//! under `<state_dir>/snapshots/`), written crash-safe (temporary file, fsync, rename, fsync of
//! the directory), so after any crash each record is either the old one or the new one, never
//! a torn mix.
//!
//! Spec choices are the dataplane's own enums, stored by name (`"auto"`, `"per_io"`, `"on"`):
//! the very strings releases before them wrote, so their files load unchanged.

use crate::snapshot::SnapshotId;
use crate::volume_id::VolumeId;
use serde::{Deserialize, Serialize};
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::{Path, PathBuf};
use ublkd_dataplane::{DevId, IoPath, QosLimits, Toggle};

/// A volume's backend as stored.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "lowercase")]
pub enum BackendRecord {
    Null,
    Ram,
    File {
        path: PathBuf,
        create: bool,
    },
    /// An NVMe namespace char device; `length` 0 means to the end of the namespace.
    Nvme {
        device: PathBuf,
        offset: u64,
        length: u64,
        /// Served as found: never erased at creation or growth (absent in older records).
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        keep_data: bool,
    },
}

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
}

/// Where a cloned volume's first contents came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "lowercase")]
pub enum SourceRecord {
    Snapshot(SnapshotId),
    Volume(VolumeId),
}

/// What a registry stores: a serializable record named by its id.
pub trait Record: Serialize + serde::de::DeserializeOwned {
    /// What the records are, for messages ("volume", "snapshot").
    const KIND: &'static str;
    fn id(&self) -> &str;
}

impl Record for VolumeRecord {
    const KIND: &'static str = "volume";
    fn id(&self) -> &str {
        self.id.as_str()
    }
}

/// Errors of the registry, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum RegistryError {
    #[error("cannot create the registry directory {path}")]
    CreateDir {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("cannot write the record of {kind} {id}")]
    Write {
        kind: &'static str,
        id: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot remove the record of {kind} {id}")]
    Remove {
        kind: &'static str,
        id: String,
        #[source]
        source: io::Error,
    },
    #[error("cannot read the registry directory {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

#[derive(Debug)]
pub struct Registry<R = VolumeRecord> {
    dir: PathBuf,
    _records: std::marker::PhantomData<fn() -> R>,
}

/// What loading found besides good records.
#[derive(Debug, Default)]
pub struct LoadReport {
    /// Files that did not parse, moved aside as `<name>.corrupt`.
    pub corrupt: Vec<PathBuf>,
    /// Leftover temporary files of interrupted writes, removed.
    pub stale_temp: usize,
}

impl Registry<VolumeRecord> {
    /// The volume registry under `state_dir`.
    pub fn open(state_dir: &Path) -> Result<Self, RegistryError> {
        Self::open_dir(state_dir.join("registry"))
    }
}

impl<R: Record> Registry<R> {
    pub fn open_dir(dir: PathBuf) -> Result<Self, RegistryError> {
        fs::create_dir_all(&dir).map_err(|source| RegistryError::CreateDir {
            path: dir.clone(),
            source,
        })?;
        Ok(Self {
            dir,
            _records: std::marker::PhantomData,
        })
    }

    fn path(&self, id: &str) -> PathBuf {
        self.dir.join(format!("{id}.json"))
    }

    /// Writes (or replaces) `rec` atomically and durably.
    pub fn put(&self, rec: &R) -> Result<(), RegistryError> {
        let err = |source| RegistryError::Write {
            kind: R::KIND,
            id: rec.id().to_owned(),
            source,
        };
        let tmp = self.dir.join(format!(".{}.json.tmp", rec.id()));
        let body = serde_json::to_vec_pretty(rec).map_err(|e| err(io::Error::other(e)))?;
        let mut f = OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .open(&tmp)
            .map_err(err)?;
        f.write_all(&body).map_err(err)?;
        f.sync_all().map_err(err)?;
        drop(f);
        fs::rename(&tmp, self.path(rec.id())).map_err(err)?;
        self.sync_dir().map_err(err)
    }

    /// Removes the record of `id` durably; a missing record is not an error.
    pub fn remove(&self, id: &str) -> Result<(), RegistryError> {
        let err = |source| RegistryError::Remove {
            kind: R::KIND,
            id: id.to_owned(),
            source,
        };
        match fs::remove_file(self.path(id)) {
            Ok(()) => self.sync_dir().map_err(err),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(err(e)),
        }
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    /// All records, sorted by id. Unparseable files are moved aside, temp files removed.
    pub fn load(&self) -> Result<(Vec<R>, LoadReport), RegistryError> {
        let read_err = |source| RegistryError::Read {
            path: self.dir.clone(),
            source,
        };
        let mut records = Vec::new();
        let mut report = LoadReport::default();
        for entry in fs::read_dir(&self.dir).map_err(read_err)? {
            let path = entry.map_err(read_err)?.path();
            let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
                continue;
            };
            if name.starts_with('.') && name.ends_with(".tmp") {
                let _ = fs::remove_file(&path);
                report.stale_temp += 1;
                continue;
            }
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = fs::read(&path)
                .ok()
                .and_then(|b| serde_json::from_slice::<R>(&b).ok())
                .filter(|r| r.id() == id);
            match parsed {
                Some(r) => records.push(r),
                None => {
                    let aside = path.with_extension("json.corrupt");
                    let _ = fs::rename(&path, &aside);
                    report.corrupt.push(aside);
                }
            }
        }
        records.sort_by(|a, b| a.id().cmp(b.id()));
        Ok((records, report))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rec(id: &str) -> VolumeRecord {
        VolumeRecord {
            id: VolumeId::parse(id).unwrap(),
            size_bytes: 1 << 30,
            block_size: 4096,
            backend: BackendRecord::File {
                path: "/srv/v.img".into(),
                create: true,
            },
            queues: 1,
            queue_depth: 128,
            io_path: IoPath::Auto,
            zero_copy: Toggle::Auto,
            poll: Toggle::Auto,
            created_unix_ms: 1,
            dev_id: Some(DevId(3)),
            deleting: false,
            qos: QosLimits::default(),
            source: None,
        }
    }

    #[test]
    fn put_load_replace_remove() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(dir.path()).unwrap();
        reg.put(&rec("b")).unwrap();
        reg.put(&rec("a")).unwrap();
        let mut a2 = rec("a");
        a2.size_bytes = 2 << 30;
        reg.put(&a2).unwrap();
        let (all, report) = reg.load().unwrap();
        assert_eq!(
            all.iter().map(|r| r.id.as_str()).collect::<Vec<_>>(),
            ["a", "b"]
        );
        assert_eq!(all[0].size_bytes, 2 << 30);
        assert!(report.corrupt.is_empty());
        reg.remove(&VolumeId::parse("a").unwrap()).unwrap();
        reg.remove(&VolumeId::parse("a").unwrap()).unwrap();
        assert_eq!(reg.load().unwrap().0.len(), 1);
    }

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

    #[test]
    fn records_of_earlier_releases_load_as_typed_choices() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(dir.path()).unwrap();
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
        // Written back, a record reads the same to the release before: same names.
        reg.put(&all[0]).unwrap();
        let again: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.path().join("registry/f1.json")).unwrap())
                .unwrap();
        let before: serde_json::Value = serde_json::from_str(OLD_RECORDS[0].1).unwrap();
        assert_eq!(again, before);
        // A choice no release wrote is a corrupt record, moved aside, not a guess.
        let bad = OLD_RECORDS[2].1.replace("\"auto\"", "\"sideways\"");
        fs::write(dir.path().join("registry/r1.json"), bad).unwrap();
        let (all, report) = reg.load().unwrap();
        assert_eq!(all.len(), 2);
        assert_eq!(report.corrupt.len(), 1);
    }

    #[test]
    fn torn_and_interrupted_writes_never_load_as_volumes() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::open(dir.path()).unwrap();
        reg.put(&rec("good")).unwrap();
        let vols = dir.path().join("registry");
        // A crash mid-write leaves a temp file: the old record (none here) stands.
        fs::write(vols.join(".half.json.tmp"), b"{\"id\": \"ha").unwrap();
        // A torn record (e.g. written by something that did not rename) is moved aside.
        let full = serde_json::to_vec(&rec("torn")).unwrap();
        fs::write(vols.join("torn.json"), &full[..full.len() / 2]).unwrap();
        // A record whose id does not match its file name is not trusted either.
        fs::write(
            vols.join("other.json"),
            serde_json::to_vec(&rec("x")).unwrap(),
        )
        .unwrap();
        let (all, report) = reg.load().unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0].id, "good");
        assert_eq!(report.stale_temp, 1);
        assert_eq!(report.corrupt.len(), 2);
        assert!(vols.join("torn.json.corrupt").exists());
        assert!(!vols.join(".half.json.tmp").exists());
    }
}
