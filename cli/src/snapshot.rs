//! Snapshots of file volumes on the command line: `create-snapshot`, `delete-snapshot`,
//! `list-snapshots`, the `--from-snapshot`/`--from-volume` source of `create-volume`, their
//! requests and how a snapshot reads as text and JSON. No I/O happens here.

use clap::{Args, Subcommand};
use ublkd_proto::units::format_size;
use ublkd_proto::v1::{
    volume_spec::Source, CreateSnapshotRequest, DeleteSnapshotRequest, ListSnapshotsRequest,
    Snapshot,
};

use crate::writer::{fields, or_dash, table, Align};

/// The snapshot commands, one call each.
#[derive(Debug, Subcommand)]
pub enum SnapshotCall {
    /// Take an instant copy of a file volume by reflink and show it
    ///
    /// The volume's queues are drained for the instant of the clone, so the copy is crash
    /// consistent; it shares every block with the volume until either is written.
    CreateSnapshot {
        /// Snapshot id: 1-63 of [a-z0-9-], starting and ending with a letter or digit
        id: String,
        /// The file volume to copy
        #[arg(long, value_name = "VOL")]
        volume: String,
    },
    /// Delete a snapshot; volumes cloned from it are not affected
    DeleteSnapshot {
        /// Snapshot id
        id: String,
        /// Succeed when no such snapshot exists
        #[arg(long)]
        allow_missing: bool,
    },
    /// List the node's snapshots
    ListSnapshots {
        /// Only the snapshots of this volume
        #[arg(long, value_name = "VOL")]
        volume: Option<String>,
    },
}

/// The request of `create-snapshot ID --volume VOL`.
pub fn create_request(id: &str, volume: &str) -> CreateSnapshotRequest {
    CreateSnapshotRequest {
        id: id.to_owned(),
        source_volume_id: volume.to_owned(),
    }
}

/// The request of `delete-snapshot ID [--allow-missing]`.
pub fn delete_request(id: &str, allow_missing: bool) -> DeleteSnapshotRequest {
    DeleteSnapshotRequest {
        id: id.to_owned(),
        allow_missing,
    }
}

/// The request of `list-snapshots [--volume VOL]`; an empty filter matches every snapshot.
pub fn list_request(volume: Option<&str>) -> ListSnapshotsRequest {
    ListSnapshotsRequest {
        id: String::new(),
        source_volume_id: volume.unwrap_or_default().to_owned(),
    }
}

/// Where a new volume's contents come from (`create-volume` only): a clone by reflink.
#[derive(Debug, Args)]
#[command(next_help_heading = "Initial contents")]
pub struct SourceArgs {
    /// Start as a copy of this snapshot (file volumes: the backing file must not exist yet and
    /// be on the snapshot's file system; --size at least the snapshot's)
    #[arg(long, value_name = "ID", conflicts_with = "from_volume")]
    pub from_snapshot: Option<String>,

    /// Start as a copy of this file volume, taken with its queues drained (as --from-snapshot,
    /// without keeping a snapshot)
    #[arg(long, value_name = "VOL")]
    pub from_volume: Option<String>,
}

impl SourceArgs {
    /// The spec's `source`; `None` for an empty volume.
    pub fn to_source(&self) -> Option<Source> {
        match (&self.from_snapshot, &self.from_volume) {
            (Some(id), _) => Some(Source::FromSnapshot(id.clone())),
            (None, Some(id)) => Some(Source::FromVolume(id.clone())),
            (None, None) => None,
        }
    }
}

/// A volume's source as text (`snapshot s1`, `volume db`).
pub fn source_text(source: &Source) -> String {
    match source {
        Source::FromSnapshot(id) => format!("snapshot {id}"),
        Source::FromVolume(id) => format!("volume {id}"),
    }
}

fn created_text(s: &Snapshot) -> String {
    s.created.map_or_else(|| "-".into(), |t| t.to_string())
}

/// One snapshot, field by field (`create-snapshot`).
pub fn snapshot_text(s: &Snapshot) -> String {
    fields(&[
        ("id", s.id.clone()),
        ("volume", or_dash(&s.source_volume_id)),
        (
            "size",
            format!("{} ({} bytes)", format_size(s.size_bytes), s.size_bytes),
        ),
        ("created", created_text(s)),
        ("path", or_dash(&s.path)),
        ("ready", if s.ready { "yes" } else { "no" }.into()),
    ])
}

/// The `list-snapshots` table.
pub fn snapshots_table(snapshots: &[Snapshot], with_header: bool) -> String {
    use Align::Left;
    let rows: Vec<Vec<String>> = snapshots
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                or_dash(&s.source_volume_id),
                format_size(s.size_bytes),
                created_text(s),
                or_dash(&s.path),
            ]
        })
        .collect();
    table(
        &[
            ("ID", Left),
            ("VOLUME", Left),
            ("SIZE", Left),
            ("CREATED", Left),
            ("PATH", Left),
        ],
        &rows,
        with_header,
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::{json, Value};

    fn snapshot_json(s: &Snapshot) -> String {
        crate::api_json::pretty(s, "Snapshot").unwrap()
    }
    fn snapshots_json(snapshots: &[Snapshot]) -> String {
        let list = ublkd_proto::v1::ListSnapshotsResponse {
            snapshots: snapshots.to_vec(),
        };
        crate::api_json::pretty(&list, "ListSnapshotsResponse").unwrap()
    }
    use crate::args::{Call, Cli, Command};
    use clap::Parser;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("ublkctl").chain(args.iter().copied()))
    }

    fn snapshot_call(args: &[&str]) -> Result<SnapshotCall, clap::Error> {
        match parse(args)?.command {
            Command::Call(Call::Snapshot(s)) => Ok(s),
            other => panic!("parsed as {other:?}"),
        }
    }

    fn sample() -> Snapshot {
        let mut s = Snapshot {
            id: "db-monday".into(),
            source_volume_id: "db".into(),
            size_bytes: 10 << 30,
            created: None,
            path: "/srv/db.img.snap-db-monday".into(),
            ready: true,
        };
        // The cli does not depend on prost-types; reach the Timestamp through the field.
        s.created.get_or_insert_with(Default::default).seconds = 1_700_000_000;
        s
    }

    #[test]
    fn create_snapshot_names_the_volume() {
        let SnapshotCall::CreateSnapshot { id, volume } =
            snapshot_call(&["create-snapshot", "s1", "--volume", "db"]).unwrap()
        else {
            panic!()
        };
        let req = create_request(&id, &volume);
        assert_eq!(
            (req.id.as_str(), req.source_volume_id.as_str()),
            ("s1", "db")
        );
        let err = parse(&["create-snapshot", "s1"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(err.to_string().contains("--volume"), "{err}");
    }

    #[test]
    fn delete_and_list_snapshot_requests() {
        let SnapshotCall::DeleteSnapshot { id, allow_missing } =
            snapshot_call(&["delete-snapshot", "s1", "--allow-missing"]).unwrap()
        else {
            panic!()
        };
        assert_eq!(
            delete_request(&id, allow_missing),
            delete_request("s1", true)
        );
        assert!(!delete_request("s1", false).allow_missing);

        let SnapshotCall::ListSnapshots { volume } =
            snapshot_call(&["list-snapshots", "--volume", "db"]).unwrap()
        else {
            panic!()
        };
        assert_eq!(list_request(volume.as_deref()).source_volume_id, "db");
        assert_eq!(list_request(None), ListSnapshotsRequest::default());
    }

    fn create_volume_source(extra: &[&str]) -> Result<Option<Source>, clap::Error> {
        let mut args = vec![
            "create-volume",
            "v",
            "--size",
            "1G",
            "--backend",
            "file:/srv/v.img",
        ];
        args.extend_from_slice(extra);
        match parse(&args)?.command {
            Command::Call(Call::CreateVolume(c)) => Ok(c.to_request().spec.unwrap().source),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn create_volume_takes_one_source() {
        assert_eq!(create_volume_source(&[]).unwrap(), None);
        assert_eq!(
            create_volume_source(&["--from-snapshot", "s1"]).unwrap(),
            Some(Source::FromSnapshot("s1".into()))
        );
        assert_eq!(
            create_volume_source(&["--from-volume", "db"]).unwrap(),
            Some(Source::FromVolume("db".into()))
        );
        let err =
            create_volume_source(&["--from-snapshot", "s1", "--from-volume", "db"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ArgumentConflict);
        assert_eq!(err.exit_code(), 2);
    }

    #[test]
    fn adopt_device_takes_no_source() {
        let err = parse(&[
            "adopt-device",
            "3",
            "v",
            "--backend",
            "ram",
            "--from-volume",
            "db",
        ])
        .unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::UnknownArgument);
    }

    #[test]
    fn snapshot_renders() {
        let expected = "\
id:      db-monday
volume:  db
size:    10 GiB (10737418240 bytes)
created: 2023-11-14T22:13:20Z
path:    /srv/db.img.snap-db-monday
ready:   yes";
        assert_eq!(snapshot_text(&sample()), expected);
        let j: Value = serde_json::from_str(&snapshot_json(&sample())).unwrap();
        assert_eq!(
            j,
            json!({
                "id": "db-monday",
                "source_volume_id": "db",
                "size_bytes": 10u64 << 30,
                "created": "2023-11-14T22:13:20Z",
                "path": "/srv/db.img.snap-db-monday",
                "ready": true,
            })
        );
    }

    #[test]
    fn snapshot_table_lines_up() {
        let mut other = sample();
        other.id = "s2".into();
        other.source_volume_id = "scratch-1".into();
        other.size_bytes = 1536 << 20;
        other.created = None;
        other.path = "/srv/s2".into();
        let expected = "\
ID         VOLUME     SIZE     CREATED               PATH
db-monday  db         10 GiB   2023-11-14T22:13:20Z  /srv/db.img.snap-db-monday
s2         scratch-1  1.5 GiB  -                     /srv/s2";
        assert_eq!(snapshots_table(&[sample(), other], true), expected);
        assert_eq!(
            snapshots_table(&[], true),
            "ID  VOLUME  SIZE  CREATED  PATH"
        );
        assert_eq!(snapshots_table(&[], false), "");
        let list: Value = serde_json::from_str(&snapshots_json(&[sample()])).unwrap();
        assert_eq!(list["snapshots"][0]["path"], "/srv/db.img.snap-db-monday");
        let empty: Value = serde_json::from_str(&snapshots_json(&[])).unwrap();
        assert_eq!(empty, json!({ "snapshots": [] }));
    }

    #[test]
    fn sources_render() {
        let s = Source::FromSnapshot("s1".into());
        assert_eq!(source_text(&s), "snapshot s1");
        let v = Source::FromVolume("db".into());
        assert_eq!(source_text(&v), "volume db");
    }
}
