//! The snapshot run in the report: snapshot and clone times per volume size (`results.json`
//! entries; the larger sizes against the smallest, since the times must not grow with size),
//! the file system's growth with each, the table and the raw numbers.

use super::{fmt_value, percentile, round, Entry, Side, Unit};
use crate::bench::cases::{
    OURS_NAME, SNAPSHOT_FILL_MIB, SNAPSHOT_FS_GIB, SNAPSHOT_REPEATS, SNAPSHOT_RUN,
};
use crate::bench::collect::snapshot::{SnapSize, Snapshots, Timed};
use serde_json::{json, Value};
use std::fmt::Write as _;

fn median(values: Result<Vec<f64>, String>) -> Result<f64, String> {
    values.and_then(|v| percentile(&v, 50).ok_or_else(|| "no calls timed".to_owned()))
}

fn times(t: &Result<Vec<Timed>, String>) -> Result<f64, String> {
    median(t.clone().map(|v| v.iter().map(|x| x.ms).collect()))
}

fn growth(t: &Result<Vec<Timed>, String>) -> Result<f64, String> {
    median(t.clone().map(|v| v.iter().map(|x| x.growth_kib).collect()))
}

/// The medians of one size: (create, snapshot, clone) in ms.
fn size_ms(z: &SnapSize) -> [(&'static str, Result<f64, String>); 3] {
    [
        ("create-volume", z.create_ms.clone()),
        ("snapshot", times(&z.snapshot)),
        ("clone", times(&z.clone)),
    ]
}

/// Entries, in table order: `ublkctl-node-info` (the floor of a call), then per size
/// `create-volume-Ng` (empty, sparse), `snapshot-Ng` and `clone-Ng` (medians, ms), and
/// `snapshot-Ng-df-growth` and `clone-Ng-df-growth` (KiB). Times of every size but the first
/// are compared with the first's (ratio: how much longer).
pub fn snapshot_entries(s: &Snapshots) -> Vec<Entry> {
    let side = |value: Result<f64, String>| Side {
        name: OURS_NAME,
        value,
        teardown: s.teardown.as_deref(),
    };
    let mut out = vec![Entry::alone(
        "ublkctl-node-info".into(),
        side(median(s.noop_ms.clone())),
        Unit::Ms,
    )];
    let base = s.sizes.first().map(|z| (z.gib, size_ms(z)));
    for z in &s.sizes {
        for (i, (op, ms)) in size_ms(z).into_iter().enumerate() {
            let case = format!("{op}-{}g", z.gib);
            out.push(match &base {
                Some((gib, base)) if *gib != z.gib => {
                    let peer = format!("{gib} GiB");
                    Entry::compare(
                        case,
                        side(ms),
                        Side {
                            name: &peer,
                            value: base[i].1.clone(),
                            teardown: None,
                        },
                        Unit::Ms,
                    )
                }
                _ => Entry::alone(case, side(ms), Unit::Ms),
            });
        }
        for (op, t) in [("snapshot", &z.snapshot), ("clone", &z.clone)] {
            out.push(Entry::alone(
                format!("{op}-{}g-df-growth", z.gib),
                side(growth(t)),
                Unit::KiB,
            ));
        }
    }
    out
}

/// One line per size (extents, medians of create, snapshot and clone, and df growth), the larger
/// sizes against the smallest, the floor of a call, every distinct failure, and what it means.
pub fn snapshot_table(entries: &[Entry], s: &Snapshots) -> String {
    let mut t = String::new();
    let _ = writeln!(
        t,
        "{:<8} {:>8} {:>10} {:>10} {:>10} {:>14} {:>14}",
        "size", "extents", "create ms", "snap ms", "clone ms", "snap growth", "clone growth"
    );
    let cell = |v: &Result<f64, String>, d: usize| match v {
        Ok(x) => format!("{x:.d$}"),
        Err(_) => "FAILED".to_owned(),
    };
    for z in &s.sizes {
        let [(_, create), (_, snap), (_, clone)] = size_ms(z);
        let kib = |v: Result<f64, String>| match v {
            Ok(x) => format!("{x:.0} KiB"),
            Err(_) => "FAILED".to_owned(),
        };
        let _ = writeln!(
            t,
            "{:<8} {:>8} {:>10} {:>10} {:>10} {:>14} {:>14}",
            format!("{} GiB", z.gib),
            z.extents.map_or_else(|| "-".to_owned(), |n| n.to_string()),
            cell(&create, 2),
            cell(&snap, 2),
            cell(&clone, 2),
            kib(growth(&z.snapshot)),
            kib(growth(&z.clone)),
        );
    }
    for e in entries.iter().filter(|e| e.ratio.is_some()) {
        let _ = writeln!(t, "{} vs {}: x{}", e.case, e.peer, fmt_value(e.ratio, 2));
    }
    let _ = writeln!(
        t,
        "ublkctl node-info (the floor of any call): {} ms",
        cell(&median(s.noop_ms.clone()), 2)
    );
    let mut errors: Vec<&str> = Vec::new();
    for e in entries.iter().filter_map(|e| e.error.as_deref()) {
        if !errors.contains(&e) {
            errors.push(e);
        }
    }
    for e in errors {
        let _ = writeln!(t, "    ! {e}");
    }
    let _ = writeln!(
        t,
        "note: file volumes on XFS (reflink=1{}, {SNAPSHOT_FS_GIB} GiB on a loop device over a \
         sparse file in the guest's tmpfs); each volume created empty on a sparse file, then \
         {SNAPSHOT_FILL_MIB} MiB written by fio (randwrite 64k across the volume) and synced. \
         {SNAPSHOT_REPEATS} create-snapshot calls per volume, each followed by a create-volume \
         --from-snapshot; medians shown. Times are ublkctl end to end, its start-up included \
         (node-info is that floor); a clone includes making its ublk device, as create-volume \
         does. Growth: df's used bytes after the call minus before (synced).",
        match s.reflink {
            Some(true) => "",
            Some(false) => "? xfs_info did not show it",
            None => "? not checked",
        }
    );
    t
}

/// The snapshot run's raw numbers for `raw.json`: every call, not only the medians.
pub fn snapshot_raw_json(s: &Snapshots) -> Value {
    let calls = |t: &Result<Vec<Timed>, String>| match t {
        Ok(v) => json!(v
            .iter()
            .map(|x| json!({"ms": round(x.ms, 3), "df_growth_kib": x.growth_kib}))
            .collect::<Vec<_>>()),
        Err(e) => json!({ "error": e }),
    };
    let one = |r: &Result<f64, String>| match r {
        Ok(v) => json!(round(*v, 3)),
        Err(e) => json!({ "error": e }),
    };
    let sizes: Vec<Value> = s
        .sizes
        .iter()
        .map(|z| {
            json!({
                "gib": z.gib,
                "extents": z.extents,
                "create_volume_ms": one(&z.create_ms),
                "snapshots": calls(&z.snapshot),
                "clones": calls(&z.clone),
            })
        })
        .collect();
    json!({
        "run": SNAPSHOT_RUN,
        "fs_gib": SNAPSHOT_FS_GIB,
        "fill_mib": SNAPSHOT_FILL_MIB,
        "reflink": s.reflink,
        "node_info_ms": match &s.noop_ms {
            Ok(v) => json!(v.iter().map(|x| round(*x, 3)).collect::<Vec<_>>()),
            Err(e) => json!({ "error": e }),
        },
        "sizes": sizes,
        "teardown_error": s.teardown,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::cases::SNAPSHOT_GIB;

    fn timed(ms: [f64; 3], kib: f64) -> Result<Vec<Timed>, String> {
        Ok(ms
            .iter()
            .map(|&ms| Timed {
                ms,
                growth_kib: kib,
            })
            .collect())
    }

    fn snapshots_ok() -> Snapshots {
        Snapshots {
            noop_ms: Ok(vec![8.0, 7.0, 9.0]),
            sizes: SNAPSHOT_GIB
                .iter()
                .map(|&gib| SnapSize {
                    gib,
                    create_ms: Ok(30.0),
                    // The 16 GiB volume's snapshots take 10 % longer.
                    snapshot: timed(
                        [20.0, 40.0, 30.0].map(|x| x * (1.0 + gib as f64 / 160.0)),
                        4.0,
                    ),
                    clone: timed([50.0, 60.0, 55.0], 8.0),
                    extents: Some(3000 + gib),
                })
                .collect(),
            reflink: Some(true),
            teardown: None,
        }
    }

    #[test]
    fn snapshot_entries_are_medians_and_the_larger_size_against_the_smaller() {
        let s = snapshots_ok();
        let entries = snapshot_entries(&s);
        let got: Vec<(&str, Option<f64>, &str, &str)> = entries
            .iter()
            .map(|e| {
                (
                    e.case.as_str(),
                    e.ours.map(|x| round(x, 3)),
                    e.peer.as_str(),
                    e.unit.name(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("ublkctl-node-info", Some(8.0), "none", "ms"),
                ("create-volume-1g", Some(30.0), "none", "ms"),
                ("snapshot-1g", Some(30.188), "none", "ms"),
                ("clone-1g", Some(55.0), "none", "ms"),
                ("snapshot-1g-df-growth", Some(4.0), "none", "KiB"),
                ("clone-1g-df-growth", Some(8.0), "none", "KiB"),
                ("create-volume-16g", Some(30.0), "1 GiB", "ms"),
                ("snapshot-16g", Some(33.0), "1 GiB", "ms"),
                ("clone-16g", Some(55.0), "1 GiB", "ms"),
                ("snapshot-16g-df-growth", Some(4.0), "none", "KiB"),
                ("clone-16g-df-growth", Some(8.0), "none", "KiB"),
            ]
        );
        assert!(entries.iter().all(|e| e.error.is_none()));
        let snap16 = &entries[7];
        assert_eq!(snap16.peer_value.map(|x| round(x, 3)), Some(30.188));
        assert_eq!(snap16.ratio.map(|x| round(x, 4)), Some(1.0932));
        assert_eq!(entries[8].ratio, Some(1.0));

        let table = snapshot_table(&entries, &s);
        assert!(table.contains("16 GiB"), "{table}");
        assert!(table.contains("snapshot-16g vs 1 GiB: x1.09"), "{table}");
        assert!(
            table.contains("node-info (the floor of any call): 8.00 ms"),
            "{table}"
        );
        assert!(!table.contains("reflink=1?"), "{table}");
        let raw = snapshot_raw_json(&s);
        assert_eq!(raw["run"], "ublkd-snapshot");
        assert_eq!(raw["sizes"][1]["gib"], 16);
        assert_eq!(raw["sizes"][0]["clones"][1]["ms"], 60.0);
        assert_eq!(raw["sizes"][0]["extents"], 3001);
    }

    #[test]
    fn snapshot_failures_give_null_values_and_an_error() {
        let mut s = snapshots_ok();
        s.sizes[0].snapshot = Err("create-snapshot snap-1g-1 failed (exit 1): no reflink".into());
        s.sizes[0].clone = Err("no snapshot to clone: create-snapshot snap-1g-1 failed".into());
        s.reflink = Some(false);
        let entries = snapshot_entries(&s);
        let find = |case: &str| {
            entries
                .iter()
                .find(|e| e.case == case)
                .unwrap_or_else(|| panic!("no {case}"))
        };
        assert_eq!(find("snapshot-1g").ours, None);
        assert!(find("snapshot-1g")
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ublkd: create-snapshot snap-1g-1")));
        // The larger size stands, but without the smaller there is nothing to compare with.
        let big = find("snapshot-16g");
        assert_eq!((big.ours, big.ratio), (Some(33.0), None));
        assert!(big
            .error
            .as_deref()
            .is_some_and(|e| e.contains("1 GiB: create-snapshot")));
        assert_eq!(find("snapshot-1g-df-growth").ours, None);
        let table = snapshot_table(&entries, &s);
        assert!(table.contains("FAILED"), "{table}");
        assert!(
            table.contains("reflink=1? xfs_info did not show it"),
            "{table}"
        );
        let raw = snapshot_raw_json(&s);
        assert!(raw["sizes"][0]["snapshots"]["error"].is_string());
    }
}
