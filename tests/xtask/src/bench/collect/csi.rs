//! Reading what the CSI run left: per-volume times to a mounted file system, and the sequential
//! and parallel stage totals.

use super::control::parse_latencies;
use crate::bench::cases::{CSI_PARALLEL, CSI_RUN, CSI_VOLUMES};
use std::fs;
use std::path::Path;

/// What the CSI run measured; each part a value or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub struct Csi {
    /// CreateVolume to published and mounted, per volume, in ms: ext4, then xfs.
    pub ext4_ms: Result<Vec<f64>, String>,
    pub xfs_ms: Result<Vec<f64>, String>,
    /// `CSI_PARALLEL` stages one at a time, and all at once: total ms each.
    pub stage_seq_ms: Result<f64, String>,
    pub stage_par_ms: Result<f64, String>,
    pub teardown: Option<String>,
}

/// Reads `dir/CSI_RUN`: `error`, `ext4.ns` and `xfs.ns` (one NS per volume), `stage_seq.ns`
/// and `stage_par.ns` (one NS total each), `teardown_error`.
pub fn collect_csi(dir: &Path) -> Csi {
    let d = dir.join(CSI_RUN);
    let read = |name: &str| {
        fs::read_to_string(d.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    let teardown = read("teardown_error").map(|t| t.replace('\n', "; "));
    let why = if !d.is_dir() {
        Some("did not run (the guest ended early)".to_owned())
    } else {
        read("error").map(|e| e.replace('\n', "; "))
    };
    let times = |name: &str| match &why {
        Some(w) => Err(w.clone()),
        None => parse_latencies(&read(name).unwrap_or_default(), CSI_VOLUMES),
    };
    let total = |name: &str| match &why {
        Some(w) => Err(w.clone()),
        None => parse_latencies(&read(name).unwrap_or_default(), 1).map(|v| v[0]),
    };
    let _ = CSI_PARALLEL;
    Csi {
        ext4_ms: times("ext4.ns"),
        xfs_ms: times("xfs.ns"),
        stage_seq_ms: total("stage_seq.ns"),
        stage_par_ms: total("stage_par.ns"),
        teardown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csi_run_files_are_read_or_explained() {
        let dir = std::env::temp_dir().join(format!("xtask-csi-{}", std::process::id()));
        let d = dir.join(CSI_RUN);
        fs::create_dir_all(&d).unwrap();
        let lines: String = (1..=CSI_VOLUMES)
            .map(|i| format!("{}\n", i * 1_000_000))
            .collect();
        fs::write(d.join("ext4.ns"), &lines).unwrap();
        fs::write(d.join("xfs.ns"), "5000000\n").unwrap();
        fs::write(d.join("stage_seq.ns"), "4000000000\n").unwrap();
        fs::write(d.join("stage_par.ns"), "2000000000\n").unwrap();
        let c = collect_csi(&dir);
        assert_eq!(c.ext4_ms.as_ref().map(Vec::len), Ok(CSI_VOLUMES));
        assert!(c.xfs_ms.is_err(), "one of fifty is not a result");
        assert_eq!(c.stage_seq_ms, Ok(4000.0));
        assert_eq!(c.stage_par_ms, Ok(2000.0));
        fs::write(d.join("error"), "pvc-ext4-003: mkfs failed\n").unwrap();
        assert_eq!(
            collect_csi(&dir).stage_par_ms,
            Err("pvc-ext4-003: mkfs failed".into())
        );
        let _ = fs::remove_dir_all(&dir);
    }
}
