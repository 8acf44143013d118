//! The CSI run in the report: `results.json` entries and their table.

use super::{alone_table, percentile, Entry, Side, Unit};
use crate::bench::cases::{CSI_PARALLEL, CSI_RUN, CSI_VOLUMES, OURS_NAME};
use crate::bench::collect::csi::Csi;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// Entries, in table order: p50/p99 to mounted per file system, the two stage totals, and the
/// parallel total against the sequential one (below 1: parallel is faster).
pub fn csi_entries(c: &Csi) -> Vec<Entry> {
    let side = |value: Result<f64, String>| Side {
        name: OURS_NAME,
        value,
        teardown: c.teardown.as_deref(),
    };
    let pct = |ms: &Result<Vec<f64>, String>, p| {
        ms.clone()
            .and_then(|v| percentile(&v, p).ok_or_else(|| "no volumes timed".to_owned()))
    };
    let mut out = Vec::new();
    for (fs, ms) in [("ext4", &c.ext4_ms), ("xfs", &c.xfs_ms)] {
        for p in [50, 99] {
            out.push(Entry::alone(
                format!("CSI CreateVolume to mounted {fs} p{p}"),
                side(pct(ms, p)),
                Unit::Ms,
            ));
        }
    }
    out.push(Entry::alone(
        format!("CSI {CSI_PARALLEL} stages one at a time"),
        side(c.stage_seq_ms.clone()),
        Unit::Ms,
    ));
    out.push(Entry::compare(
        format!("CSI {CSI_PARALLEL} stages in parallel vs one at a time"),
        side(c.stage_par_ms.clone()),
        Side {
            name: "one at a time",
            value: c.stage_seq_ms.clone(),
            teardown: None,
        },
        Unit::Ms,
    ));
    out
}

pub fn csi_table(entries: &[Entry], c: &Csi) -> String {
    let mut s = alone_table(entries);
    if let (Ok(seq), Ok(par)) = (&c.stage_seq_ms, &c.stage_par_ms) {
        let _ = writeln!(
            s,
            "parallel stages finish {:.2}x faster in total",
            seq / par
        );
    }
    let _ = writeln!(
        s,
        "note: each CSI call is one `ublkd-csi ctl` process (its start-up included) against a \
         ublkd-csi in front of ublkd; to mounted = CreateVolume + NodeStageVolume (mkfs, mount) \
         + NodePublishVolume (bind mount), {CSI_VOLUMES} file volumes per file system (ext4 64 MiB, \
         xfs 320 MiB); stages are of fresh ext4 volumes (mkfs included). p50/p99 by nearest rank."
    );
    s
}

pub fn csi_raw_json(c: &Csi) -> Value {
    let ok = |r: &Result<Vec<f64>, String>| match r {
        Ok(v) => json!(v),
        Err(e) => json!({ "error": e }),
    };
    let one = |r: &Result<f64, String>| match r {
        Ok(v) => json!(v),
        Err(e) => json!({ "error": e }),
    };
    json!({
        "run": CSI_RUN,
        "ext4_ms": ok(&c.ext4_ms),
        "xfs_ms": ok(&c.xfs_ms),
        "stage_seq_ms": one(&c.stage_seq_ms),
        "stage_par_ms": one(&c.stage_par_ms),
        "teardown_error": c.teardown,
    })
}
