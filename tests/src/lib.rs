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

/// Helpers for tests that drive the dataplane in the guest.
pub mod guest {
    use anyhow::{bail, Context, Result};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::{Duration, Instant};
    use ublkd_dataplane::{BackendSpec, Config, DeviceSpec, Handle, IoPath};

    /// Both I/O paths, for tests that must pass on each.
    pub const PATHS: [IoPath; 2] = [IoPath::Batch, IoPath::PerIo];

    /// A dataplane with two workers (CPUs 0 and 1), as the test VM has.
    pub fn dataplane() -> Result<Handle> {
        Ok(Handle::start(Config {
            cpus: vec![0, 1],
            ..Config::default()
        })?)
    }

    pub fn spec(backend: BackendSpec, size: u64, path: IoPath) -> DeviceSpec {
        DeviceSpec {
            size_bytes: size,
            queues: 2,
            queue_depth: 32,
            io_path: path,
            backend,
            ..DeviceSpec::default()
        }
    }

    /// A scratch directory for backing files (tmpfs in the guest).
    pub fn scratch(name: &str) -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("ublkd-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// A sparse backing file of `size` bytes.
    pub fn backing_file(dir: &Path, name: &str, size: u64) -> Result<PathBuf> {
        let path = dir.join(name);
        std::fs::File::create(&path)?.set_len(size)?;
        Ok(path)
    }

    /// Runs fio on `dev` with `args`, failing on any error; returns the JSON report.
    pub fn fio(dev: &Path, args: &[&str]) -> Result<serde_json::Value> {
        let filename = format!("--filename={}", dev.display());
        let mut all = vec![
            "--name=t",
            filename.as_str(),
            "--ioengine=io_uring",
            "--direct=1",
        ];
        all.extend_from_slice(args);
        let report = crate::fio_json(&all)?;
        let errors = crate::fio_errors(&report);
        if errors != 0 {
            bail!("fio reported {errors} errors: {report}");
        }
        Ok(report)
    }

    /// Tasks in uninterruptible sleep (state D), as "pid comm" strings.
    pub fn d_state_tasks() -> Vec<String> {
        let mut out = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in dir.flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ...
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.trim_start()) {
                if rest.starts_with('D') {
                    out.push(stat.split(')').next().unwrap_or("").to_owned() + ")");
                }
            }
        }
        out
    }

    /// Threads of this process.
    pub fn thread_count() -> Result<usize> {
        Ok(std::fs::read_dir("/proc/self/task")?.count())
    }

    /// Names of this process's threads.
    pub fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                    .map(|s| s.trim().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Most threads the dataplane may add beyond its workers: the control thread and each
    /// worker ring's capped io-wq helpers.
    pub fn thread_allowance(workers: usize) -> usize {
        use ublkd_dataplane::ring::{IOWQ_MAX_BOUNDED, IOWQ_MAX_UNBOUNDED};
        1 + workers * (IOWQ_MAX_BOUNDED + IOWQ_MAX_UNBOUNDED) as usize
    }

    /// Open file descriptors of this process.
    pub fn fd_count() -> Result<usize> {
        Ok(std::fs::read_dir("/proc/self/fd")?.count())
    }

    /// ublk character devices present now.
    pub fn ublk_char_devices() -> Result<Vec<String>> {
        let mut v: Vec<String> = std::fs::read_dir("/dev")?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ublkc"))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Waits until `path` no longer exists.
    pub fn wait_gone(path: &Path, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while path.exists() {
            if Instant::now() > deadline {
                bail!("{} still exists after {within:?}", path.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Runs a command, failing with its output when it exits non-zero.
    pub fn sh(cmd: &str) -> Result<String> {
        crate::run(Command::new("sh").arg("-c").arg(cmd)).with_context(|| cmd.to_owned())
    }
}
