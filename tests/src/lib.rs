//! Helpers shared by ublkd's integration tests.
//!
//! What it is: small utilities for tests that run inside the test VM (reading sysfs, running
//! guest tools such as fio and mkfs, finding the project's binaries). What it is not: a fake
//! kernel. Tests that need `ublk_drv` are built only with the `vm` feature and run against the
//! real driver inside QEMU (`cargo xtask vm-test`).

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// True inside the harness's guest (set by its /init).
pub fn in_vm() -> bool {
    std::env::var_os("UBLKD_VM").is_some()
}

/// Reads a sysfs (or any small text) file, trimmed.
pub fn read_trimmed(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_owned())
}

/// Runs a command, failing with its stderr when it exits non-zero; returns stdout.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs fio with `args` plus JSON output and returns the parsed report.
pub fn fio_json(args: &[&str]) -> Result<serde_json::Value> {
    let out = run(Command::new("fio").args(args).arg("--output-format=json"))?;
    // fio may print notes before the JSON document.
    let start = out.find('{').context("fio printed no JSON")?;
    serde_json::from_str(&out[start..]).context("parsing fio's JSON")
}

/// Total bytes read plus written over all jobs of a fio JSON report.
pub fn fio_total_bytes(report: &serde_json::Value) -> u64 {
    report["jobs"]
        .as_array()
        .map(|jobs| {
            jobs.iter()
                .map(|j| {
                    j["read"]["io_bytes"].as_u64().unwrap_or(0)
                        + j["write"]["io_bytes"].as_u64().unwrap_or(0)
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Total error count over all jobs of a fio JSON report.
pub fn fio_errors(report: &serde_json::Value) -> u64 {
    report["jobs"]
        .as_array()
        .map(|jobs| jobs.iter().map(|j| j["error"].as_u64().unwrap_or(0)).sum())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_report_totals_add_up_over_jobs() {
        let report = serde_json::json!({
            "jobs": [
                {"error": 0, "read": {"io_bytes": 4096}, "write": {"io_bytes": 8192}},
                {"error": 5, "read": {"io_bytes": 1}, "write": {"io_bytes": 0}},
            ]
        });
        assert_eq!(fio_total_bytes(&report), 4096 + 8192 + 1);
        assert_eq!(fio_errors(&report), 5);
    }
}
