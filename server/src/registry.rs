//! A registry: one JSON file per record in a directory, written crash-safe (temporary file,
//! fsync, rename, fsync of the directory), so after any crash each record is either the old one
//! or the new one, never a torn mix. Generic over what it stores ([`Record`]): the volumes
//! (`record`), the snapshots and the file intents (`snapshot`) each have one.

use serde::Serialize;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Write};
use std::path::PathBuf;

/// What a registry stores: a serializable record named by its id.
pub trait Record: Serialize + serde::de::DeserializeOwned {
    /// What the records are, for messages ("volume", "snapshot").
    const KIND: &'static str;
    /// A record that cannot be read is a load error, left where it is, rather than moved
    /// aside: for records whose loss would free what they claim (a volume's NVMe window,
    /// device and backing file) for the next create to take and erase.
    const UNREADABLE_STOPS_LOAD: bool = false;
    /// The format this build writes, as each file's `format` (absent: 1, every record written
    /// before the field). Raised when an older build would misread a record of this one (drop
    /// a field that claims something, read a value otherwise); a file of a higher format than
    /// the build's stops the load, whatever the record, and stays where it is.
    const FORMAT: u64;
    fn id(&self) -> &str;
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
    #[error(
        "the record {} of a {kind} cannot be read ({why}): it stays where it is, and nothing \
         starts until it is repaired or moved out of the registry by hand (its volume's NVMe \
         window, device and backing file are then no longer claimed)",
        path.display()
    )]
    Unreadable {
        kind: &'static str,
        path: PathBuf,
        why: String,
    },
    #[error(
        "the record {} of a {kind} has format {format}, newer than this build's {known}: a \
         newer ublkd wrote it, and this one could misread it; nothing starts (downgrade \
         refused) and the file stays as it is",
        path.display()
    )]
    NewerFormat {
        kind: &'static str,
        path: PathBuf,
        format: u64,
        known: u64,
    },
    #[error("cannot read the registry directory {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
}

/// The key of each file's format, beside the record's own fields.
const FORMAT_KEY: &str = "format";

#[derive(Debug)]
pub struct Registry<R> {
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

impl<R> Clone for Registry<R> {
    fn clone(&self) -> Self {
        Self {
            dir: self.dir.clone(),
            _records: std::marker::PhantomData,
        }
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
        let mut value = serde_json::to_value(rec).map_err(|e| err(io::Error::other(e)))?;
        if let Some(map) = value.as_object_mut() {
            map.insert(FORMAT_KEY.to_owned(), R::FORMAT.into());
        }
        let body = serde_json::to_vec_pretty(&value).map_err(|e| err(io::Error::other(e)))?;
        crate::seam::registry_put(|| format!("put of {} {}", R::KIND, rec.id()), &tmp, &body)
            .map_err(err)?;
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
        crate::seam::registry_remove(|| format!("removal of {} {id}", R::KIND)).map_err(err)?;
        match fs::remove_file(self.path(id)) {
            Ok(()) => self.sync_dir().map_err(err),
            Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(err(e)),
        }
    }

    fn sync_dir(&self) -> io::Result<()> {
        File::open(&self.dir)?.sync_all()
    }

    /// All records, sorted by id. Unparseable files are moved aside (or, for records whose
    /// type says so, stop the load), temp files removed.
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
                // Never read as a record; one that cannot be removed is tried again next load.
                let _ = fs::remove_file(&path);
                report.stale_temp += 1;
                continue;
            }
            let Some(id) = name.strip_suffix(".json") else {
                continue;
            };
            let parsed = match fs::read(&path).map_err(|e| Unread::Bad(e.to_string())) {
                Ok(bytes) => parse::<R>(&bytes, id),
                Err(e) => Err(e),
            };
            let parsed = match parsed {
                Err(Unread::Newer(format)) => {
                    return Err(RegistryError::NewerFormat {
                        kind: R::KIND,
                        path,
                        format,
                        known: R::FORMAT,
                    })
                }
                Err(Unread::Bad(why)) => Err(why),
                Ok(r) => Ok(r),
            };
            match parsed {
                Ok(r) => records.push(r),
                Err(why) if R::UNREADABLE_STOPS_LOAD => {
                    return Err(RegistryError::Unreadable {
                        kind: R::KIND,
                        path,
                        why,
                    })
                }
                Err(_) => {
                    let aside = path.with_extension("json.corrupt");
                    // Reported (and logged by the caller) either way; not moved, it is
                    // reported again at the next load.
                    let _ = fs::rename(&path, &aside);
                    report.corrupt.push(aside);
                }
            }
        }
        records.sort_by(|a, b| a.id().cmp(b.id()));
        Ok((records, report))
    }
}

/// Why a registry file is not a record.
enum Unread {
    /// Written by a newer build: its format.
    Newer(u64),
    /// Unreadable, and why.
    Bad(String),
}

/// The record in `bytes`, a file named for `id`: its format checked (absent: 1), then read.
fn parse<R: Record>(bytes: &[u8], id: &str) -> Result<R, Unread> {
    let bad = |e: &dyn std::fmt::Display| Unread::Bad(e.to_string());
    let mut value: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| bad(&e))?;
    let format = value
        .as_object_mut()
        .and_then(|m| m.remove(FORMAT_KEY))
        .map_or(Some(1), |f| f.as_u64())
        .ok_or_else(|| bad(&"its format is not a number"))?;
    if format > R::FORMAT {
        return Err(Unread::Newer(format));
    }
    let r: R = serde_json::from_value(value).map_err(|e| bad(&e))?;
    if r.id() != id {
        return Err(bad(&format!("it names {:?}", r.id())));
    }
    Ok(r)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A record of the smallest kind: the registry knows nothing of what it stores.
    #[derive(Debug, Clone, PartialEq, Serialize, serde::Deserialize)]
    struct Note {
        id: String,
        size_bytes: u64,
    }

    impl Record for Note {
        const KIND: &'static str = "note";
        const FORMAT: u64 = 3;
        fn id(&self) -> &str {
            &self.id
        }
    }

    fn rec(id: &str) -> Note {
        Note {
            id: id.into(),
            size_bytes: 1 << 30,
        }
    }

    /// Each file says its format; one of a newer format than the build's stops the load and
    /// stays as it is (a downgrade never misreads or moves aside what a newer ublkd wrote),
    /// and a file without one is read as format 1.
    #[test]
    fn a_record_of_a_newer_format_stops_the_load_and_stays() {
        let dir = tempfile::tempdir().unwrap();
        let reg: Registry<Note> = Registry::open_dir(dir.path().to_owned()).unwrap();
        reg.put(&rec("a")).unwrap();
        let written: serde_json::Value =
            serde_json::from_slice(&fs::read(dir.path().join("a.json")).unwrap()).unwrap();
        assert_eq!(written["format"], Note::FORMAT);
        fs::write(
            dir.path().join("old.json"),
            r#"{"id":"old","size_bytes":1}"#,
        )
        .unwrap();
        let (all, _) = reg.load().unwrap();
        assert_eq!(
            all.len(),
            2,
            "a record without a format is format 1: {all:?}"
        );
        let newer = format!(
            r#"{{"id":"b","size_bytes":1,"format":{}}}"#,
            Note::FORMAT + 1
        );
        fs::write(dir.path().join("b.json"), &newer).unwrap();
        match reg.load() {
            Err(RegistryError::NewerFormat {
                format,
                known,
                path,
                ..
            }) => {
                assert_eq!((format, known), (Note::FORMAT + 1, Note::FORMAT));
                assert_eq!(path, dir.path().join("b.json"));
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            fs::read_to_string(dir.path().join("b.json")).unwrap(),
            newer
        );
    }

    #[test]
    fn put_load_replace_remove() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::<Note>::open_dir(dir.path().join("registry")).unwrap();
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
        reg.remove("a").unwrap();
        reg.remove("a").unwrap();
        assert_eq!(reg.load().unwrap().0.len(), 1);
    }

    #[test]
    fn torn_and_interrupted_writes_never_load_as_records() {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::<Note>::open_dir(dir.path().join("registry")).unwrap();
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
