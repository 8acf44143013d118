//! Reading what the snapshot run left: per volume size, the time of each `create-snapshot` and
//! `create-volume --from-snapshot` and how much the file system's used space grew with it.

use super::control::parse_latencies;
use super::recovery::{read_trimmed, teardown_of};
use crate::bench::cases::{SNAPSHOT_GIB, SNAPSHOT_REPEATS, SNAPSHOT_RUN};
use std::path::Path;

/// One timed call: ublkctl end to end, and the growth of the file system's used bytes over it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Timed {
    pub ms: f64,
    pub growth_kib: f64,
}

/// What the snapshot run measured for volumes of one size.
#[derive(Debug, Clone, PartialEq)]
pub struct SnapSize {
    pub gib: u64,
    /// `create-volume` of the volume, empty, on a new sparse backing file (ms).
    pub create_ms: Result<f64, String>,
    /// Each `create-snapshot` of it, after the fill.
    pub snapshot: Result<Vec<Timed>, String>,
    /// Each `create-volume --from-snapshot` of those snapshots.
    pub clone: Result<Vec<Timed>, String>,
    /// Extents of the backing file after the fill (filefrag).
    pub extents: Option<u64>,
}

/// The snapshot run.
#[derive(Debug, Clone, PartialEq)]
pub struct Snapshots {
    /// Each `ublkctl node-info` (ms): what any call costs.
    pub noop_ms: Result<Vec<f64>, String>,
    pub sizes: Vec<SnapSize>,
    /// Whether `xfs_info` showed `reflink=1`, when it ran.
    pub reflink: Option<bool>,
    pub teardown: Option<String>,
}

/// Lines `ID NS USED_BEFORE USED_AFTER` (used bytes by df), checking there are `expected`.
fn parse_timed(text: &str, expected: usize) -> Result<Vec<Timed>, String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let f: Vec<&str> = line.split_whitespace().collect();
        let [_, ns, u0, u1] = f.as_slice() else {
            return Err(format!("odd timing line {line:?}"));
        };
        let ns = ns
            .parse::<u64>()
            .map_err(|_| format!("odd timing line {line:?}"))?;
        let (Ok(u0), Ok(u1)) = (u0.parse::<i64>(), u1.parse::<i64>()) else {
            return Err(format!("df gave no used bytes around the call: {line:?}"));
        };
        out.push(Timed {
            ms: ns as f64 / 1e6,
            growth_kib: (u1 - u0) as f64 / 1024.0,
        });
    }
    if out.len() != expected {
        return Err(format!(
            "{} of {expected} calls timed (the guest ended early?)",
            out.len()
        ));
    }
    Ok(out)
}

/// The extent count in filefrag's answer (`PATH: 4093 extents found`).
fn parse_extents(text: &str) -> Option<u64> {
    let (_, tail) = text.trim().rsplit_once(": ")?;
    tail.split_whitespace().next()?.parse().ok()
}

/// Reads `dir/SNAPSHOT_RUN`: `error`, `fs.txt` (xfs_info), `noop.ns`, and per size label `Ng`:
/// `Ng.error`, `create.Ng.ns`, `extents.Ng`, `snapshot.Ng.ns`, `snapshot.Ng.error`,
/// `clone.Ng.ns`, `clone.Ng.error`; `teardown_error`.
pub fn collect_snapshots(dir: &Path) -> Snapshots {
    let d = dir.join(SNAPSHOT_RUN);
    let read = |name: &str| read_trimmed(&d, name);
    let run_error = if !d.is_dir() {
        Some("did not run (the guest ended early)".to_owned())
    } else {
        read("error")
    };
    let noop_ms = match &run_error {
        Some(e) => Err(e.clone()),
        None => parse_latencies(&read("noop.ns").unwrap_or_default(), SNAPSHOT_REPEATS)
            .map_err(|e| format!("ublkctl node-info: {e}")),
    };
    let sizes = SNAPSHOT_GIB
        .iter()
        .map(|&gib| {
            let s = format!("{gib}g");
            let size_error = run_error.clone().or_else(|| read(&format!("{s}.error")));
            let create_ms = match (&run_error, read(&format!("create.{s}.ns"))) {
                (Some(e), _) => Err(e.clone()),
                (None, Some(t)) => parse_latencies(&t, 1).map(|v| v[0]),
                (None, None) => Err(size_error
                    .clone()
                    .unwrap_or_else(|| "not timed (the guest ended early?)".to_owned())),
            };
            let timed = |op: &str| match (size_error.clone(), read(&format!("{op}.{s}.error"))) {
                (Some(e), _) | (None, Some(e)) => Err(e),
                (None, None) => parse_timed(
                    &read(&format!("{op}.{s}.ns")).unwrap_or_default(),
                    SNAPSHOT_REPEATS,
                ),
            };
            let snapshot = timed("snapshot");
            // A clone needs its snapshot: when those failed, that is why there is no clone.
            let clone = match (&snapshot, timed("clone")) {
                (Err(e), Err(_)) if size_error.is_none() => {
                    Err(format!("no snapshot to clone: {e}"))
                }
                (_, clone) => clone,
            };
            SnapSize {
                gib,
                create_ms,
                snapshot,
                clone,
                extents: read(&format!("extents.{s}")).and_then(|t| parse_extents(&t)),
            }
        })
        .collect();
    Snapshots {
        noop_ms,
        sizes,
        reflink: read("fs.txt").map(|t| t.contains("reflink=1")),
        teardown: teardown_of(&d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn timings_growth_and_extents_parse() {
        let lines = "snap-1g-1 41500000 1000000 1004096\nsnap-1g-2 40000000 1004096 1004096\n";
        assert_eq!(
            parse_timed(lines, 2),
            Ok(vec![
                Timed {
                    ms: 41.5,
                    growth_kib: 4.0
                },
                Timed {
                    ms: 40.0,
                    growth_kib: 0.0
                },
            ])
        );
        assert!(parse_timed(lines, 3).is_err_and(|e| e.contains("2 of 3")));
        assert!(parse_timed("snap-1g-1 41500000 - 5\n", 1).is_err_and(|e| e.contains("df")));
        assert!(parse_timed("snap-1g-1 41500000\n", 1).is_err());
        // Space can be given back (XFS trims its reservations): growth may be negative.
        assert_eq!(
            parse_timed("c 1000000 8192 4096\n", 1).map(|v| v[0].growth_kib),
            Ok(-4.0)
        );

        assert_eq!(
            parse_extents("/tmp/r/roots/src-16g.img: 4093 extents found\n"),
            Some(4093)
        );
        assert_eq!(parse_extents("/x/a b.img: 1 extent found"), Some(1));
        assert_eq!(
            parse_extents("filefrag: /x: No such file or directory"),
            None
        );
    }

    #[test]
    fn snapshot_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-snap-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let s = collect_snapshots(&dir);
        assert!(s.noop_ms.is_err_and(|e| e.contains("did not run")));
        assert_eq!(s.sizes.len(), SNAPSHOT_GIB.len());
        assert!(s.sizes[0].clone.is_err());

        let d = dir.join(SNAPSHOT_RUN);
        fs::create_dir_all(&d).expect("mkdir");
        let write = |name: &str, text: &str| fs::write(d.join(name), text).expect("write");
        let three = |op: &str, s: &str| -> String {
            (1..=3)
                .map(|k| format!("{op}-{s}-{k} {} 100 4196\n", k * 10_000_000))
                .collect()
        };
        write("fs.txt", "meta-data=/dev/loop0 ... reflink=1 bigtime=1\n");
        write("noop.ns", "8000000\n9000000\n7000000\n");
        write("create.1g.ns", "30000000\n");
        write("extents.1g", "/t/roots/src-1g.img: 3000 extents found\n");
        write("snapshot.1g.ns", &three("snap", "1g"));
        write("clone.1g.ns", &three("clone", "1g"));
        write("create.16g.ns", "31000000\n");
        write(
            "snapshot.16g.error",
            "create-snapshot snap-16g-1 failed (exit 1): not supported\n",
        );
        let s = collect_snapshots(&dir);
        assert_eq!(s.noop_ms, Ok(vec![8.0, 9.0, 7.0]));
        assert_eq!(s.reflink, Some(true));
        let one = &s.sizes[0];
        assert_eq!((one.gib, one.create_ms.clone()), (1, Ok(30.0)));
        assert_eq!(one.extents, Some(3000));
        assert_eq!(
            one.snapshot
                .as_ref()
                .map(|v| (v.len(), v[1].ms, v[1].growth_kib)),
            Ok((3, 20.0, 4.0))
        );
        assert_eq!(one.clone.as_ref().map(|v| v[2].ms), Ok(30.0));
        let big = &s.sizes[1];
        assert_eq!(big.create_ms, Ok(31.0));
        assert!(big
            .snapshot
            .clone()
            .is_err_and(|e| e.contains("not supported")));
        assert!(big
            .clone
            .clone()
            .is_err_and(|e| e.starts_with("no snapshot to clone: create-snapshot snap-16g-1")));
        assert_eq!(s.teardown, None);

        write(
            "16g.error",
            "fio writing 256 MiB into src-16g failed (exit 1): ENOSPC\n",
        );
        let s = collect_snapshots(&dir);
        assert!(s.sizes[1]
            .clone
            .clone()
            .is_err_and(|e| e.starts_with("fio writing")));
        write(
            "error",
            "no XFS with reflink for the volumes: mkfs.xfs: bad option\n",
        );
        let s = collect_snapshots(&dir);
        assert!(s.sizes[0]
            .create_ms
            .clone()
            .is_err_and(|e| e.contains("mkfs.xfs")));
        assert!(s.noop_ms.is_err_and(|e| e.contains("mkfs.xfs")));
        let _ = fs::remove_dir_all(&dir);
    }
}
