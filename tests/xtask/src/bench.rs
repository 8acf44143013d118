//! `cargo xtask bench`: ublkd against its peers, all in one VM boot.
//!
//! Peers: the kernel's selftest server `kublk` (built here from Debian's `linux-source-<x.y>` of
//! the guest kernel, cached per kernel version), the loop driver with direct I/O on the same
//! backing file as ublkd's file backend, and `null_blk` as the ceiling for the null cases. Every
//! case runs the same fio jobs (io_uring, direct, 4 KiB, randread/randwrite at QD32, randread at
//! QD1); server CPU time is sampled from `/proc/PID/stat` around each job and divided by the I/Os
//! the block device completed in the same window (`/sys/block/*/stat`).
//!
//! The guest writes raw results into the run directory; the host turns them into a table and
//! `target/bench/results.json`: a list of `{case, ours, peer, peer_value, ratio, unit}` objects,
//! with `ours: null` and an `error` field for cases that failed. Numbers are never made up: a
//! case that did not run says why, and the command then exits non-zero.
//!
//! After the fio cases, the same boot measures the control plane: `ublkd --config` as a node
//! service, driven by `ublkctl` (both release builds). It records the daemon's RSS with no
//! volumes, times 100 `create-volume` calls of null volumes (the call returns once `/dev/ublkbN`
//! serves I/O, so this is CreateVolume to device ready), records the RSS with those 100 idle
//! volumes, times 100 `delete-volume` calls, and stops the daemon with SIGTERM. Latencies are
//! end to end as seen by `ublkctl`, including its process start-up; they are reported as p50
//! and p99 (nearest rank) in `results.json` with peer `none`.
//!
//! Last comes crash recovery, each run with a fresh daemon (own state directory and socket) that
//! it tears down (volumes deleted, SIGTERM) before the next: for 1, 16 and 64 null volumes, ublkd
//! is killed with SIGKILL (the devices stay, quiesced) and started again, and the time from the
//! new process's exec until `ublkctl list-volumes` shows every volume READY is recorded (polled
//! every 20 ms). Then fio writes to a RAM volume (randwrite 4 KiB, QD16, per-I/O completion
//! latency log) while ublkd is killed and started again; the host takes the longest completion
//! latency from the log as the I/O stall, and fails the case if fio saw an error. Both are `ms`
//! entries with peer `none`.
//!
//! `UBLKD_BENCH_RUNTIME` sets the seconds each fio job measures (default 5);
//! `UBLKD_BENCH_UBLKD` names a ublkd binary to measure instead of building the workspace's
//! (ublkctl is still built). The binary must live outside `/tmp` (the guest mounts a tmpfs there).

use crate::apt::{self, PrivateApt};
use crate::image::{self, Kernel};
use crate::vm::{self, Exit, Vm};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// Default seconds each fio job measures (after one second of ramp).
const DEFAULT_RUNTIME: u64 = 5;
/// Size of ublkd's null device.
const NULL_BYTES: u64 = 1 << 30;
/// Size of the backing file shared by ublkd's file backend and the loop device. It lives on an
/// ext4 file system on the guest's NVMe namespace (1 GiB), so it must leave room for metadata.
const BACKING_BYTES: u64 = 512 << 20;
/// Queues and depth of every ublk device, ours and kublk's.
const QUEUES: u32 = 2;
const DEPTH: u32 = 128;

/// The control-plane run: its directory under the run directory and its name in `raw.json`.
const CONTROL_RUN: &str = "ublkd-control";
/// Volumes the control-plane run creates and deletes.
const CONTROL_VOLUMES: usize = 100;
/// Each of them: a null volume of this size, one queue (the server's default) of this depth.
const CONTROL_SIZE: &str = "64MiB";
const CONTROL_DEPTH: u32 = 32;
/// Where the control-plane daemon serves metrics (the bench never scrapes them).
const CONTROL_METRICS: &str = "127.0.0.1:9581";
/// Guest seconds budgeted for the control-plane run (200 ublkctl calls under TCG, with margin).
const CONTROL_BUDGET_SECS: u64 = 300;

/// The recovery runs: `ublkd-recovery-N` for each number of volumes N, restarted by kill -9.
const RECOVERY_RUN: &str = "ublkd-recovery";
const RECOVERY_VOLUMES: [usize; 3] = [1, 16, 64];
/// Each of them a null volume like the control-plane run's: this size, 1 queue of this depth.
const RECOVERY_SIZE: &str = CONTROL_SIZE;
const RECOVERY_DEPTH: u32 = CONTROL_DEPTH;
/// The I/O stall run: fio on one RAM volume of this size while ublkd is killed and restarted.
const STALL_RUN: &str = "ublkd-stall";
const STALL_SIZE: &str = "128MiB";
/// Seconds fio runs, and seconds after the device's first write that ublkd is killed.
const STALL_RUNTIME_SECS: u64 = 8;
const STALL_KILL_AT_SECS: u64 = 3;
/// Where the recovery and stall daemons serve metrics (never scraped).
const RECOVERY_METRICS: &str = "127.0.0.1:9582";
/// Guest seconds budgeted for the recovery and stall runs (162 ublkctl calls, 4 daemons, 2
/// restarts each, fio), with margin for TCG.
const RECOVERY_BUDGET_SECS: u64 = 400;

/// What serves the block device in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Server {
    /// `ublkd run` with a backend, an I/O path (`per-io` or `batch`), zero copy and polling.
    Ublkd {
        backend: UBackend,
        io_path: &'static str,
        zero_copy: bool,
        poll: bool,
    },
    /// `kublk add -t null`, with `-b` (BATCH_IO) when `batch`, `--auto_zc` when `auto_zc`.
    Kublk { batch: bool, auto_zc: bool },
    /// The loop driver with direct I/O on the backing file.
    Loop,
    /// The kernel's null_blk (`/dev/nullb0`, loaded at boot).
    NullBlk,
    /// fio straight on the NVMe namespace, polled: NVMe passthrough on `/dev/ng0n1`
    /// (io_uring_cmd, hipri, fixed buffers: the limit), or io_uring on `/dev/nvme0n1` (hipri).
    RawNvme { passthru: bool },
}

/// The backend of a `ublkd run`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum UBackend {
    Null,
    File,
    /// The whole guest namespace, `/dev/ng0n1`.
    Nvme,
}

/// One server setup, measured with every workload.
#[derive(Debug, Clone, Copy)]
struct Run {
    id: &'static str,
    server: Server,
}

const fn ublkd(backend: UBackend, io_path: &'static str, zero_copy: bool, poll: bool) -> Server {
    Server::Ublkd {
        backend,
        io_path,
        zero_copy,
        poll,
    }
}

/// In the order they run; each of ours next to its peer so that drift affects both alike.
const RUNS: &[Run] = &[
    Run {
        id: "null_blk",
        server: Server::NullBlk,
    },
    Run {
        id: "ublkd-null-per-io",
        server: ublkd(UBackend::Null, "per-io", false, false),
    },
    Run {
        id: "kublk-null",
        server: Server::Kublk {
            batch: false,
            auto_zc: false,
        },
    },
    Run {
        id: "ublkd-null-batch",
        server: ublkd(UBackend::Null, "batch", false, false),
    },
    Run {
        id: "kublk-null-batch",
        server: Server::Kublk {
            batch: true,
            auto_zc: false,
        },
    },
    Run {
        id: "ublkd-null-per-io-zc",
        server: ublkd(UBackend::Null, "per-io", true, false),
    },
    Run {
        id: "kublk-null-zc",
        server: Server::Kublk {
            batch: false,
            auto_zc: true,
        },
    },
    Run {
        id: "ublkd-null-batch-zc",
        server: ublkd(UBackend::Null, "batch", true, false),
    },
    Run {
        id: "kublk-null-batch-zc",
        server: Server::Kublk {
            batch: true,
            auto_zc: true,
        },
    },
    Run {
        id: "ublkd-file",
        server: ublkd(UBackend::File, "per-io", true, false),
    },
    Run {
        id: "loop-dio",
        server: Server::Loop,
    },
    Run {
        id: "ublkd-file-copy",
        server: ublkd(UBackend::File, "per-io", false, false),
    },
    Run {
        id: "ublkd-nvme-poll",
        server: ublkd(UBackend::Nvme, "batch", true, true),
    },
    Run {
        id: "fio-ng0n1-passthru",
        server: Server::RawNvme { passthru: true },
    },
    Run {
        id: "fio-nvme0n1-hipri",
        server: Server::RawNvme { passthru: false },
    },
    Run {
        id: "ublkd-nvme-irq",
        server: ublkd(UBackend::Nvme, "batch", true, false),
    },
];

/// What a workload reports as its headline number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Metric {
    Iops,
    LatencyUs,
}

/// One fio job, run against every device.
#[derive(Debug, Clone, Copy)]
struct Workload {
    id: &'static str,
    label: &'static str,
    rw: &'static str,
    qd: u32,
    metric: Metric,
}

const WORKLOADS: &[Workload] = &[
    Workload {
        id: "randread-qd32",
        label: "randread qd32",
        rw: "randread",
        qd: 32,
        metric: Metric::Iops,
    },
    Workload {
        id: "randwrite-qd32",
        label: "randwrite qd32",
        rw: "randwrite",
        qd: 32,
        metric: Metric::Iops,
    },
    Workload {
        id: "randread-qd1",
        label: "randread qd1",
        rw: "randread",
        qd: 1,
        metric: Metric::LatencyUs,
    },
];

/// One comparison: our run against a peer's, optionally with server CPU and the null_blk ceiling.
#[derive(Debug, Clone, Copy)]
struct Pair {
    case: &'static str,
    ours: &'static str,
    peer: &'static str,
    peer_name: &'static str,
    /// The peer is a userspace process whose CPU time can be compared with ours.
    cpu: bool,
    /// Report both as fractions of null_blk's IOPS.
    ceiling: bool,
}

const PAIRS: &[Pair] = &[
    Pair {
        case: "null per-io",
        ours: "ublkd-null-per-io",
        peer: "kublk-null",
        peer_name: "kublk",
        cpu: true,
        ceiling: true,
    },
    Pair {
        case: "null batch",
        ours: "ublkd-null-batch",
        peer: "kublk-null-batch",
        peer_name: "kublk",
        cpu: true,
        ceiling: true,
    },
    Pair {
        case: "null per-io zero copy",
        ours: "ublkd-null-per-io-zc",
        peer: "kublk-null-zc",
        peer_name: "kublk --auto_zc",
        cpu: true,
        ceiling: true,
    },
    Pair {
        case: "null batch zero copy",
        ours: "ublkd-null-batch-zc",
        peer: "kublk-null-batch-zc",
        peer_name: "kublk -b --auto_zc",
        cpu: true,
        ceiling: true,
    },
    Pair {
        case: "file",
        ours: "ublkd-file",
        peer: "loop-dio",
        peer_name: "loop",
        cpu: false,
        ceiling: false,
    },
    Pair {
        case: "file zero copy vs copy",
        ours: "ublkd-file",
        peer: "ublkd-file-copy",
        peer_name: "ublkd copy",
        cpu: true,
        ceiling: false,
    },
    Pair {
        case: "nvme polled zc vs ng0n1 passthru",
        ours: "ublkd-nvme-poll",
        peer: "fio-ng0n1-passthru",
        peer_name: "fio ng0n1",
        cpu: false,
        ceiling: false,
    },
    Pair {
        case: "nvme polled zc vs nvme0n1 hipri",
        ours: "ublkd-nvme-poll",
        peer: "fio-nvme0n1-hipri",
        peer_name: "fio nvme0n1",
        cpu: false,
        ceiling: false,
    },
    Pair {
        case: "nvme polled vs interrupt",
        ours: "ublkd-nvme-poll",
        peer: "ublkd-nvme-irq",
        peer_name: "ublkd irq",
        cpu: true,
        ceiling: false,
    },
];
const CEILING_RUN: &str = "null_blk";
const OURS_NAME: &str = "ublkd";
/// The peer of a measurement that has none (the control-plane entries).
const NO_PEER: &str = "none";

/// The unit of a results entry; it also fixes which way the ratio points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    Iops,
    Us,
    CpuPerMio,
    FractionOfNullBlk,
    Ms,
    MiB,
    KiB,
}

impl Unit {
    fn name(self) -> &'static str {
        match self {
            Unit::Iops => "IOPS",
            Unit::Us => "us",
            Unit::CpuPerMio => "cpu_s_per_mio",
            Unit::FractionOfNullBlk => "fraction_of_null_blk",
            Unit::Ms => "ms",
            Unit::MiB => "MiB",
            Unit::KiB => "KiB",
        }
    }

    /// `ours / peer`, except latency, where `peer / ours` so that above 1 is better for us.
    /// CPU per I/O keeps `ours / peer` (below 1 is better for us), and so do the control-plane
    /// units, whose entries have no peer today.
    fn ratio(self, ours: f64, peer: f64) -> Option<f64> {
        let (num, den) = match self {
            Unit::Us => (peer, ours),
            Unit::Iops
            | Unit::CpuPerMio
            | Unit::FractionOfNullBlk
            | Unit::Ms
            | Unit::MiB
            | Unit::KiB => (ours, peer),
        };
        let r = num / den;
        (den > 0.0 && r.is_finite()).then_some(r)
    }

    fn decimals(self) -> usize {
        match self {
            Unit::Iops | Unit::KiB => 0,
            Unit::Us | Unit::MiB => 1,
            Unit::Ms => 2,
            Unit::CpuPerMio | Unit::FractionOfNullBlk => 3,
        }
    }
}

impl From<Metric> for Unit {
    fn from(m: Metric) -> Self {
        match m {
            Metric::Iops => Unit::Iops,
            Metric::LatencyUs => Unit::Us,
        }
    }
}

/// What one fio job against one device measured.
#[derive(Debug, Clone, PartialEq)]
struct Sample {
    iops: f64,
    lat_us: f64,
    /// Server CPU seconds per million I/Os, or why there is none.
    cpu_s_per_mio: Result<f64, String>,
}

impl Sample {
    fn metric(&self, m: Metric) -> f64 {
        match m {
            Metric::Iops => self.iops,
            Metric::LatencyUs => self.lat_us,
        }
    }
}

/// Everything the guest left behind, by run and workload.
#[derive(Debug, Default)]
struct Results {
    samples: BTreeMap<(String, String), Result<Sample, String>>,
    /// Runs whose measurements stand but whose teardown went wrong.
    teardown: BTreeMap<String, String>,
}

impl Results {
    fn get(&self, run: &str, workload: &str) -> Result<Sample, String> {
        self.samples
            .get(&(run.to_owned(), workload.to_owned()))
            .cloned()
            .unwrap_or_else(|| Err("no result".into()))
    }
}

/// One side of a comparison.
#[derive(Debug)]
struct Side<'a> {
    name: &'a str,
    value: Result<f64, String>,
    teardown: Option<&'a str>,
}

/// One line of `results.json`.
#[derive(Debug, Clone, PartialEq)]
struct Entry {
    case: String,
    ours: Option<f64>,
    peer: String,
    peer_value: Option<f64>,
    ratio: Option<f64>,
    unit: Unit,
    error: Option<String>,
}

impl Entry {
    fn compare(case: String, ours: Side<'_>, peer: Side<'_>, unit: Unit) -> Self {
        let mut errors = Vec::new();
        for side in [&ours, &peer] {
            if let Err(e) = &side.value {
                errors.push(format!("{}: {e}", side.name));
            }
            if let Some(t) = side.teardown {
                errors.push(format!("{} teardown: {t}", side.name));
            }
        }
        let ours_v = ours.value.ok();
        let peer_v = peer.value.ok();
        let ratio = match (ours_v, peer_v) {
            (Some(o), Some(p)) => unit.ratio(o, p),
            _ => None,
        };
        Entry {
            case,
            ours: ours_v,
            peer: peer.name.to_owned(),
            peer_value: peer_v,
            ratio,
            unit,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        }
    }

    /// A measurement of ours alone: peer `none`, no peer value, no ratio.
    fn alone(case: String, ours: Side<'_>, unit: Unit) -> Self {
        let mut errors = Vec::new();
        if let Err(e) = &ours.value {
            errors.push(format!("{}: {e}", ours.name));
        }
        if let Some(t) = ours.teardown {
            errors.push(format!("{} teardown: {t}", ours.name));
        }
        Entry {
            case,
            ours: ours.value.ok(),
            peer: NO_PEER.to_owned(),
            peer_value: None,
            ratio: None,
            unit,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        }
    }

    fn to_json(&self) -> Value {
        let d = self.unit.decimals() + 1;
        let mut v = json!({
            "case": self.case,
            "ours": self.ours.map(|x| round(x, d)),
            "peer": self.peer,
            "peer_value": self.peer_value.map(|x| round(x, d)),
            "ratio": self.ratio.map(|x| round(x, 4)),
            "unit": self.unit.name(),
        });
        if let Some(e) = &self.error {
            v["error"] = Value::from(e.as_str());
        }
        v
    }
}

fn round(x: f64, decimals: usize) -> f64 {
    let f = 10f64.powi(i32::try_from(decimals).unwrap_or(6));
    (x * f).round() / f
}

/// Every comparison the bench reports, in table order.
fn entries(results: &Results) -> Vec<Entry> {
    let side = |name: &'static str, run: &'static str, value: Result<f64, String>| Side {
        name,
        value,
        teardown: results.teardown.get(run).map(String::as_str),
    };
    let mut out = Vec::new();
    for pair in PAIRS {
        for wl in WORKLOADS {
            let value = |run| results.get(run, wl.id).map(|s| s.metric(wl.metric));
            out.push(Entry::compare(
                format!("{} {}", pair.case, wl.label),
                side(OURS_NAME, pair.ours, value(pair.ours)),
                side(pair.peer_name, pair.peer, value(pair.peer)),
                wl.metric.into(),
            ));
        }
        if pair.cpu {
            for wl in WORKLOADS {
                let cpu = |run| results.get(run, wl.id).and_then(|s| s.cpu_s_per_mio);
                out.push(Entry::compare(
                    format!("{} {} cpu", pair.case, wl.label),
                    side(OURS_NAME, pair.ours, cpu(pair.ours)),
                    side(pair.peer_name, pair.peer, cpu(pair.peer)),
                    Unit::CpuPerMio,
                ));
            }
        }
        if pair.ceiling {
            for wl in WORKLOADS.iter().filter(|w| w.metric == Metric::Iops) {
                let ceiling = results
                    .get(CEILING_RUN, wl.id)
                    .map(|s| s.iops)
                    .map_err(|e| format!("{CEILING_RUN}: {e}"));
                let fraction = |run| {
                    let iops = results.get(run, wl.id)?.iops;
                    let c = ceiling.clone()?;
                    if c > 0.0 {
                        Ok(iops / c)
                    } else {
                        Err(format!("{CEILING_RUN} did no I/O"))
                    }
                };
                out.push(Entry::compare(
                    format!("{} {} vs null_blk", pair.case, wl.label),
                    side(OURS_NAME, pair.ours, fraction(pair.ours)),
                    side(pair.peer_name, pair.peer, fraction(pair.peer)),
                    Unit::FractionOfNullBlk,
                ));
            }
        }
    }
    out
}

/// Zero copy against copy in daemon memory: `ublkd run` RSS with its one volume idle (2 queues
/// of depth 128), ours = zero copy, peer = copy.
const RSS_PAIRS: &[(&str, &str, &str)] = &[
    (
        "ublkd RSS, one idle file volume, zero copy vs copy",
        "ublkd-file",
        "ublkd-file-copy",
    ),
    (
        "ublkd RSS, one idle null volume, zero copy vs copy",
        "ublkd-null-per-io-zc",
        "ublkd-null-per-io",
    ),
];

fn rss_entries(dir: &Path) -> Vec<Entry> {
    let rss = |run: &str| -> Result<f64, String> {
        let text = fs::read_to_string(dir.join(run).join("status.idle"))
            .map_err(|_| format!("{run}: no /proc status (the run failed?)"))?;
        parse_vmrss(&text).map(|kib| kib / 1024.0)
    };
    RSS_PAIRS
        .iter()
        .map(|&(case, ours, peer)| {
            Entry::compare(
                case.to_owned(),
                Side {
                    name: OURS_NAME,
                    value: rss(ours),
                    teardown: None,
                },
                Side {
                    name: "ublkd copy",
                    value: rss(peer),
                    teardown: None,
                },
                Unit::MiB,
            )
        })
        .collect()
}

/// What the control-plane run measured; each part a value or why there is none.
#[derive(Debug, Clone, PartialEq)]
struct Control {
    /// Daemon RSS (KiB) with no volumes.
    rss_empty_kib: Result<f64, String>,
    /// Daemon RSS (KiB) with all `CONTROL_VOLUMES` volumes idle.
    rss_full_kib: Result<f64, String>,
    /// Each `ublkctl create-volume`, end to end, in ms; all of them or an error.
    create_ms: Result<Vec<f64>, String>,
    /// Each `ublkctl delete-volume`, end to end, in ms; all of them or an error.
    delete_ms: Result<Vec<f64>, String>,
    /// Each `GET /metrics` with all volumes present, in ms.
    scrape_ms: Result<Vec<f64>, String>,
    /// The daemon did not exit 0 within 30 s of SIGTERM.
    teardown: Option<String>,
}

impl Control {
    /// A run that produced no numbers at all.
    fn failed(why: &str, teardown: Option<String>) -> Self {
        Control {
            rss_empty_kib: Err(why.to_owned()),
            rss_full_kib: Err(why.to_owned()),
            create_ms: Err(why.to_owned()),
            delete_ms: Err(why.to_owned()),
            scrape_ms: Err(why.to_owned()),
            teardown,
        }
    }
}

/// Scrapes of `/metrics` timed with every control-plane volume present.
const CONTROL_SCRAPES: usize = 10;

/// The `p`th percentile of `values` by nearest rank: the smallest value that at least `p`
/// percent of them do not exceed (`p` in 1..=100). `None` when `values` is empty.
fn percentile(values: &[f64], p: u32) -> Option<f64> {
    if values.is_empty() || p == 0 || p > 100 {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p as usize * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

/// `VmRSS` in KiB from the text of `/proc/PID/status` (`VmRSS:\t   12345 kB`).
fn parse_vmrss(status: &str) -> Result<f64, String> {
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or("no VmRSS line in /proc/PID/status (process gone?)")?;
    let mut fields = line["VmRSS:".len()..].split_whitespace();
    let (Some(n), Some("kB"), None) = (fields.next(), fields.next(), fields.next()) else {
        return Err(format!("odd VmRSS line {line:?}"));
    };
    n.parse::<u64>()
        .map(|kib| kib as f64)
        .map_err(|_| format!("odd VmRSS line {line:?}"))
}

/// Latencies in ms from lines whose last field is nanoseconds (`NAME [DEVICE] NS`), checking
/// that there are `expected` of them.
fn parse_latencies(text: &str, expected: usize) -> Result<Vec<f64>, String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let ns = line
            .split_whitespace()
            .last()
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(|| format!("odd timing line {line:?}"))?;
        out.push(ns as f64 / 1e6);
    }
    if out.len() != expected {
        return Err(format!(
            "{} of {expected} calls timed (the guest ended early?)",
            out.len()
        ));
    }
    Ok(out)
}

/// Reads what the control-plane run left in `dir/CONTROL_RUN`: `error` (no daemon), `status.0`
/// and `status.full` (copies of `/proc/PID/status`), `create.ns` (`NAME DEVICE NS` per created
/// volume), `create_error`, `delete.ns` (`NAME NS`), `delete_error`, `teardown_error`.
fn collect_control(dir: &Path) -> Control {
    let d = dir.join(CONTROL_RUN);
    let read = |name: &str| {
        fs::read_to_string(d.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    // Several failures (one per volume) read as the first one and a count.
    let first_of = |text: String| {
        let lines: Vec<&str> = text.lines().collect();
        match lines.len() {
            0 | 1 => text.clone(),
            n => format!("{} (and {} more)", lines[0], n - 1),
        }
    };
    let teardown = read("teardown_error").map(|t| t.replace('\n', "; "));
    if !d.is_dir() {
        return Control::failed("did not run (the guest ended early)", teardown);
    }
    if let Some(e) = read("error") {
        return Control::failed(&e, teardown);
    }
    let rss = |name: &str, what: &str| {
        read(name)
            .ok_or_else(|| format!("no /proc status with {what} (the guest ended early?)"))
            .and_then(|s| parse_vmrss(&s))
    };
    let create_ms = match read("create_error") {
        Some(e) => Err(first_of(e)),
        None => parse_latencies(&read("create.ns").unwrap_or_default(), CONTROL_VOLUMES),
    };
    let (rss_full_kib, delete_ms) = match &create_ms {
        Err(e) => {
            let why = format!("not all {CONTROL_VOLUMES} volumes were created: {e}");
            (Err(why.clone()), Err(why))
        }
        Ok(_) => (
            rss("status.full", &format!("{CONTROL_VOLUMES} volumes")),
            match read("delete_error") {
                Some(e) => Err(first_of(e)),
                None => parse_latencies(&read("delete.ns").unwrap_or_default(), CONTROL_VOLUMES),
            },
        ),
    };
    let scrape_ms = match read("scrape_error") {
        Some(e) => Err(e),
        None => parse_latencies(&read("scrape.ns").unwrap_or_default(), CONTROL_SCRAPES),
    };
    Control {
        rss_empty_kib: rss("status.0", "0 volumes"),
        rss_full_kib,
        create_ms,
        delete_ms,
        scrape_ms,
        teardown,
    }
}

/// The control-plane entries of `results.json`, in table order; every one with peer `none`.
fn control_entries(c: &Control) -> Vec<Entry> {
    let entry = |case: String, value: Result<f64, String>, unit| {
        Entry::alone(
            case,
            Side {
                name: OURS_NAME,
                value,
                teardown: c.teardown.as_deref(),
            },
            unit,
        )
    };
    let pct = |ms: &Result<Vec<f64>, String>, p| {
        ms.clone()
            .and_then(|v| percentile(&v, p).ok_or_else(|| "no calls timed".to_owned()))
    };
    let mut out = Vec::new();
    for (call, ms) in [
        ("ublkctl create-volume", &c.create_ms),
        ("ublkctl delete-volume", &c.delete_ms),
    ] {
        for p in [50, 99] {
            out.push(entry(format!("{call} p{p}"), pct(ms, p), Unit::Ms));
        }
    }
    let mib = |kib: &Result<f64, String>| kib.clone().map(|k| k / 1024.0);
    out.push(entry(
        "ublkd RSS, 0 volumes".into(),
        mib(&c.rss_empty_kib),
        Unit::MiB,
    ));
    out.push(entry(
        format!("ublkd RSS, {CONTROL_VOLUMES} idle volumes"),
        mib(&c.rss_full_kib),
        Unit::MiB,
    ));
    let per_volume = match (&c.rss_empty_kib, &c.rss_full_kib) {
        (Ok(empty), Ok(full)) => Ok((full - empty) / CONTROL_VOLUMES as f64),
        (Err(e), _) | (_, Err(e)) => Err(e.clone()),
    };
    out.push(entry(
        "ublkd RSS per idle volume".into(),
        per_volume,
        Unit::KiB,
    ));
    for p in [50, 100] {
        out.push(entry(
            format!("GET /metrics, {CONTROL_VOLUMES} volumes, p{p}"),
            pct(&c.scrape_ms, p),
            Unit::Ms,
        ));
    }
    out
}

/// Entries without a peer as a table: case, our value, unit, and each error below its line.
fn alone_table(entries: &[Entry]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:<34} {:>10}  unit", "case", "ublkd");
    for e in entries {
        let value = match (e.ours, &e.error) {
            (None, Some(_)) => "FAILED".to_owned(),
            (v, _) => fmt_value(v, e.unit.decimals()),
        };
        let _ = writeln!(s, "{:<34} {:>10}  {}", e.case, value, e.unit.name());
        if let Some(err) = &e.error {
            let _ = writeln!(s, "    ! {err}");
        }
    }
    s
}

/// What `results.json` says of the control plane, as a table, with what the numbers include.
fn control_table(entries: &[Entry]) -> String {
    let mut s = alone_table(entries);
    let _ = writeln!(
        s,
        "note: create/delete latencies are as seen by ublkctl, including its start-up (one \
         process per call); create-volume returns when /dev/ublkbN serves I/O. {CONTROL_VOLUMES} \
         null volumes of {CONTROL_SIZE}, 1 queue of depth {CONTROL_DEPTH}; p50/p99 by nearest rank."
    );
    s
}

/// The control-plane run's raw numbers for `raw.json`.
fn control_raw_json(c: &Control) -> Value {
    let mut v = json!({ "run": CONTROL_RUN, "volumes": CONTROL_VOLUMES });
    let mut errors = serde_json::Map::new();
    let mut put = |key: &str, value: Result<Value, &String>| match value {
        Ok(x) => v[key] = x,
        Err(e) => {
            v[key] = Value::Null;
            errors.insert(key.to_owned(), Value::from(e.as_str()));
        }
    };
    let ms_list = |ms: &Vec<f64>| json!(ms.iter().map(|x| round(*x, 3)).collect::<Vec<_>>());
    put("create_ms", c.create_ms.as_ref().map(ms_list));
    put("delete_ms", c.delete_ms.as_ref().map(ms_list));
    put(
        "rss_kib_no_volumes",
        c.rss_empty_kib.as_ref().map(|k| json!(k)),
    );
    put(
        "rss_kib_all_volumes",
        c.rss_full_kib.as_ref().map(|k| json!(k)),
    );
    if !errors.is_empty() {
        v["errors"] = Value::Object(errors);
    }
    if let Some(t) = &c.teardown {
        v["teardown_error"] = Value::from(t.as_str());
    }
    v
}

/// One recovery run: N null volumes, kill -9, ublkd started again.
#[derive(Debug, Clone, PartialEq)]
struct Recovery {
    volumes: usize,
    /// From the new ublkd's exec until `list-volumes` showed all volumes READY, in ms.
    ready_ms: Result<f64, String>,
    /// From the kill -9 until the new ublkd's exec (the old one's exit included), ms.
    kill_to_exec_ms: Option<f64>,
    /// One more `list-volumes` call afterwards, ms: what one poll costs.
    list_call_ms: Option<f64>,
    /// The I/O path the volumes came back on (`IO_PATH_BATCH`, ...), when known.
    io_path: Option<String>,
    /// Deleting the volumes or stopping the daemon went wrong.
    teardown: Option<String>,
}

/// The I/O stall run: fio on a RAM volume across a kill -9 and restart.
#[derive(Debug, Clone, PartialEq)]
struct Stall {
    /// The longest completion latency in fio's per-I/O log (ms), or why there is none.
    max_ms: Result<f64, String>,
    /// When (ms into the fio job, by its log) the slowest I/O completed.
    max_at_ms: Option<f64>,
    /// Completions in the log.
    ios: Option<usize>,
    /// fio's own maximum completion latency (ms), from its JSON report.
    fio_max_ms: Option<f64>,
    /// From fio's launch until the device completed its first write, ms.
    first_write_ms: Option<f64>,
    /// From that first write to the kill -9, ms.
    kill_after_ms: Option<f64>,
    /// From the kill -9 until the new ublkd's exec, ms.
    kill_to_exec_ms: Option<f64>,
    /// From the new ublkd's exec until the volume was READY, ms.
    restart_to_ready_ms: Option<f64>,
    /// From the kill -9 until the volume was READY, ms.
    kill_to_ready_ms: Option<f64>,
    /// One more `list-volumes` call afterwards, ms.
    list_call_ms: Option<f64>,
    io_path: Option<String>,
    teardown: Option<String>,
}

/// The run directory name of the recovery run with `n` volumes.
fn recovery_run(n: usize) -> String {
    format!("{RECOVERY_RUN}-{n}")
}

/// Two `date +%s%N` stamps on one line (`START END`), as ms from the first to the second.
fn parse_span_ms(text: &str) -> Result<f64, String> {
    let f: Vec<&str> = text.split_whitespace().collect();
    let [a, b] = f.as_slice() else {
        return Err(format!("odd timestamps {:?}", text.trim()));
    };
    let (Ok(a), Ok(b)) = (a.parse::<u64>(), b.parse::<u64>()) else {
        return Err(format!("odd timestamps {:?}", text.trim()));
    };
    if b < a {
        return Err(format!("timestamps run backwards: {a} then {b}"));
    }
    Ok((b - a) as f64 / 1e6)
}

/// The longest completion latency in a fio latency log with one line per I/O
/// (`TIME_MS, LATENCY_NS, DIR, BS, OFFSET[, PRIO]`): (latency ms, completion time ms, I/Os).
fn parse_clat_log(text: &str) -> Result<(f64, f64, usize), String> {
    let mut best: Option<(u64, u64)> = None;
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(str::trim);
        let (Some(Ok(t)), Some(Ok(ns))) = (
            f.next().map(str::parse::<u64>),
            f.next().map(str::parse::<u64>),
        ) else {
            return Err(format!("odd fio latency log line {line:?}"));
        };
        n += 1;
        if best.is_none_or(|(_, b)| ns > b) {
            best = Some((t, ns));
        }
    }
    let (t, ns) = best.ok_or("fio's latency log is empty (no I/O completed?)")?;
    Ok((ns as f64 / 1e6, t as f64, n))
}

/// Errors summed over the jobs of fio's JSON report, and the longest write completion
/// latency it reports (ms).
fn parse_fio_stall(text: &str) -> Result<(u64, f64), String> {
    let start = text.find('{').ok_or("no JSON in fio output")?;
    let v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("bad fio JSON: {e}"))?;
    let jobs = v["jobs"].as_array().filter(|j| !j.is_empty());
    let jobs = jobs.ok_or("no job in fio output")?;
    let errors = jobs.iter().map(|j| j["error"].as_u64().unwrap_or(0)).sum();
    let max_ns = jobs
        .iter()
        .filter_map(|j| j["write"]["clat_ns"]["max"].as_f64())
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
        .ok_or("no write completion latency in fio output")?;
    Ok((errors, max_ns / 1e6))
}

/// The I/O path the first volume of a `list-volumes -o json` answer is served on.
fn io_path_in_use(list: &str) -> Option<String> {
    let v: Value = serde_json::from_str(list).ok()?;
    v["volumes"][0]["io_path_in_use"]
        .as_str()
        .map(str::to_owned)
}

/// The nanosecond stamps in `dir/name` (up to the first that is not one); empty without any.
fn read_stamps(dir: &Path, name: &str) -> Vec<u64> {
    read_trimmed(dir, name)
        .map(|t| {
            t.split_whitespace()
                .map_while(|x| x.parse::<u64>().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// ms from stamp `a` to stamp `b`, when both are there and in order.
fn span_ms(a: Option<&u64>, b: Option<&u64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e6),
        _ => None,
    }
}

/// Reads `dir/name` trimmed, if it has anything in it.
fn read_trimmed(dir: &Path, name: &str) -> Option<String> {
    fs::read_to_string(dir.join(name))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The teardown problems of a run directory, first one and a count.
fn teardown_of(d: &Path) -> Option<String> {
    read_trimmed(d, "teardown_error").map(|t| {
        let lines: Vec<&str> = t.lines().collect();
        match lines.len() {
            0 | 1 => t.clone(),
            n => format!("{} (and {} more)", lines[0], n - 1),
        }
    })
}

/// Reads what each recovery run left: `error`, `kill.ns`, `ready.ns` (`START_NS READY_NS`),
/// `poll.ns` (`BEFORE_NS AFTER_NS`), `list.json`, `teardown_error`.
fn collect_recovery(dir: &Path) -> Vec<Recovery> {
    RECOVERY_VOLUMES
        .iter()
        .map(|&n| {
            let d = dir.join(recovery_run(n));
            let ready_ms = if !d.is_dir() {
                Err("did not run (the guest ended early)".to_owned())
            } else if let Some(e) = read_trimmed(&d, "error") {
                Err(e)
            } else {
                read_trimmed(&d, "ready.ns")
                    .ok_or_else(|| "no READY time recorded (the guest ended early?)".to_owned())
                    .and_then(|t| parse_span_ms(&t))
            };
            let kill = read_stamps(&d, "kill.ns");
            let ready = read_stamps(&d, "ready.ns");
            let poll = read_stamps(&d, "poll.ns");
            Recovery {
                volumes: n,
                ready_ms,
                kill_to_exec_ms: span_ms(kill.first(), ready.first()),
                list_call_ms: span_ms(poll.first(), poll.get(1)),
                io_path: read_trimmed(&d, "list.json").and_then(|l| io_path_in_use(&l)),
                teardown: teardown_of(&d),
            }
        })
        .collect()
}

/// Reads what the stall run left: `error`, `fio.rc`, `fio.json`, `fio.log`, `clat.log`,
/// `times.ns` (`FIO_LAUNCH_NS FIRST_WRITE_NS`), `kill.ns`, `ready.ns`, `poll.ns`, `list.json`,
/// `teardown_error`.
fn collect_stall(dir: &Path) -> Stall {
    let d = dir.join(STALL_RUN);
    let read = |name: &str| read_trimmed(&d, name);
    let times = read_stamps(&d, "times.ns");
    let kill = read_stamps(&d, "kill.ns");
    let ready = read_stamps(&d, "ready.ns");
    let poll = read_stamps(&d, "poll.ns");
    let kill_after_ms = span_ms(times.get(1), kill.first());
    let kill_to_exec_ms = span_ms(kill.first(), ready.first());
    let log = read("clat.log").map(|t| parse_clat_log(&t));
    let fio = read("fio.json").map(|t| parse_fio_stall(&t));
    let max_ms = if !d.is_dir() {
        Err("did not run (the guest ended early)".to_owned())
    } else if let Some(e) = read("error") {
        Err(e)
    } else {
        match read("fio.rc").as_deref() {
            None => Err("fio did not run or did not end".to_owned()),
            Some("0") => match (&fio, &log) {
                (None, _) => Err("no fio report".to_owned()),
                (Some(Err(e)), _) => Err(e.clone()),
                (Some(Ok((errors, _))), _) if *errors > 0 => {
                    Err(format!("fio saw {errors} errors across the restart"))
                }
                (_, None) => Err(format!(
                    "no completion latency log from fio: {}",
                    read("fio.log").unwrap_or_default()
                )),
                (_, Some(Err(e))) => Err(e.clone()),
                (_, Some(Ok((ms, at, _)))) => {
                    check_stall(*ms, *at, kill_after_ms, kill_to_exec_ms).map(|()| *ms)
                }
            },
            Some(rc) => {
                let log = read("fio.log").unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                Err(format!(
                    "fio exited with status {rc}: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                ))
            }
        }
    };
    let log = log.and_then(Result::ok);
    Stall {
        max_ms,
        max_at_ms: log.map(|(_, at, _)| at),
        ios: log.map(|(_, _, n)| n),
        fio_max_ms: fio.and_then(Result::ok).map(|(_, ms)| ms),
        first_write_ms: span_ms(times.first(), times.get(1)),
        kill_after_ms,
        kill_to_exec_ms,
        restart_to_ready_ms: span_ms(ready.first(), ready.get(1)),
        kill_to_ready_ms: span_ms(kill.first(), ready.get(1)),
        list_call_ms: span_ms(poll.first(), poll.get(1)),
        io_path: read("list.json").and_then(|l| io_path_in_use(&l)),
        teardown: teardown_of(&d),
    }
}

/// Whether the longest completion latency in fio's log (`max_ms`, completed `at_ms` into the
/// job) can be the stall across the restart: fio's I/O was in flight when ublkd was killed and
/// could not complete before the new one ran, so that I/O lasted at least from the kill to the
/// new exec (`kill_to_exec_ms`), and it completed after the kill, which came `kill_after_ms`
/// after the device's first write (itself after the job's start, fio's time zero).
fn check_stall(
    max_ms: f64,
    at_ms: f64,
    kill_after_ms: Option<f64>,
    kill_to_exec_ms: Option<f64>,
) -> Result<(), String> {
    let (Some(after), Some(gap)) = (kill_after_ms, kill_to_exec_ms) else {
        return Err("no kill or restart time recorded (the guest ended early?)".to_owned());
    };
    if max_ms < gap {
        return Err(format!(
            "fio's longest I/O ({max_ms:.1} ms) is shorter than the time from the kill to the \
             new ublkd ({gap:.1} ms): the log missed the stall"
        ));
    }
    if at_ms < after {
        return Err(format!(
            "fio's longest I/O completed {at_ms:.0} ms into the job, before the kill (at least \
             {after:.0} ms in): the log missed the stall"
        ));
    }
    Ok(())
}

/// The recovery entries of `results.json`, in table order; every one with peer `none`, in ms.
fn recovery_entries(recoveries: &[Recovery], stall: &Stall) -> Vec<Entry> {
    let mut out: Vec<Entry> = recoveries
        .iter()
        .map(|r| {
            Entry::alone(
                format!(
                    "ublkd restart to READY, {} volume{}",
                    r.volumes,
                    if r.volumes == 1 { "" } else { "s" }
                ),
                Side {
                    name: OURS_NAME,
                    value: r.ready_ms.clone(),
                    teardown: r.teardown.as_deref(),
                },
                Unit::Ms,
            )
        })
        .collect();
    out.push(Entry::alone(
        "fio max I/O stall across kill -9".into(),
        Side {
            name: OURS_NAME,
            value: stall.max_ms.clone(),
            teardown: stall.teardown.as_deref(),
        },
        Unit::Ms,
    ));
    out
}

/// The recovery and stall runs' raw numbers for `raw.json`.
fn recovery_raw_json(recoveries: &[Recovery], stall: &Stall) -> Vec<Value> {
    let ms = |x: Option<f64>| x.map(|v| round(v, 3));
    let mut out = Vec::new();
    for r in recoveries {
        let mut v = json!({
            "run": recovery_run(r.volumes),
            "volumes": r.volumes,
            "volume_size": RECOVERY_SIZE,
            "queue_depth": RECOVERY_DEPTH,
            "restart_to_ready_ms": ms(r.ready_ms.as_ref().ok().copied()),
            "kill_to_exec_ms": ms(r.kill_to_exec_ms),
            "list_volumes_call_ms": ms(r.list_call_ms),
            "io_path_in_use": r.io_path,
        });
        if let Err(e) = &r.ready_ms {
            v["error"] = Value::from(e.as_str());
        }
        if let Some(t) = &r.teardown {
            v["teardown_error"] = Value::from(t.as_str());
        }
        out.push(v);
    }
    let mut v = json!({
        "run": STALL_RUN,
        "volume_size": STALL_SIZE,
        "fio": "randwrite 4k qd16 io_uring direct",
        "runtime_s": STALL_RUNTIME_SECS,
        "kill_after_first_write_s": STALL_KILL_AT_SECS,
        "max_clat_ms": ms(stall.max_ms.as_ref().ok().copied()),
        "max_clat_completed_at_ms": stall.max_at_ms,
        "ios_logged": stall.ios,
        "fio_report_max_clat_ms": ms(stall.fio_max_ms),
        "first_write_after_fio_launch_ms": ms(stall.first_write_ms),
        "kill_after_first_write_ms": ms(stall.kill_after_ms),
        "kill_to_exec_ms": ms(stall.kill_to_exec_ms),
        "restart_to_ready_ms": ms(stall.restart_to_ready_ms),
        "kill_to_ready_ms": ms(stall.kill_to_ready_ms),
        "list_volumes_call_ms": ms(stall.list_call_ms),
        "io_path_in_use": stall.io_path,
    });
    if let Err(e) = &stall.max_ms {
        v["error"] = Value::from(e.as_str());
    }
    if let Some(t) = &stall.teardown {
        v["teardown_error"] = Value::from(t.as_str());
    }
    out.push(v);
    out
}

/// What `results.json` says of the recovery runs, as a table, with what the numbers include.
fn recovery_table(entries: &[Entry], recoveries: &[Recovery], stall: &Stall) -> String {
    let mut s = alone_table(entries);
    let mut distinct: Vec<&str> = recoveries
        .iter()
        .filter_map(|r| r.io_path.as_deref())
        .chain(stall.io_path.as_deref())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    let calls: Vec<f64> = recoveries
        .iter()
        .filter_map(|r| r.list_call_ms)
        .chain(stall.list_call_ms)
        .collect();
    let call = percentile(&calls, 50).map_or_else(String::new, |c| {
        format!("; one call took {c:.0} ms here, so READY is seen up to that much late")
    });
    let _ = writeln!(
        s,
        "note: restart to READY runs from the exec of the new ublkd (after kill -9 of the old \
         one) until `ublkctl list-volumes` shows every volume READY, polled every 20 ms \
         (ublkctl's start-up included{call}); null volumes of {RECOVERY_SIZE}, 1 queue of depth \
         {RECOVERY_DEPTH}. The stall is the longest completion latency in fio's per-I/O log \
         (randwrite 4k QD16, {STALL_RUNTIME_SECS} s, on a {STALL_SIZE} RAM volume; ublkd \
         killed {STALL_KILL_AT_SECS} s after the first write and started again as soon as it \
         was gone){}. I/O path: {}.",
        match (stall.kill_to_ready_ms, stall.restart_to_ready_ms) {
            (Some(k), Some(r)) => format!(
                "; there the volume was READY {k:.1} ms after the kill, {r:.1} ms after the exec"
            ),
            _ => String::new(),
        },
        if distinct.is_empty() {
            "unknown".to_owned()
        } else {
            distinct.join(", ")
        }
    );
    s
}

/// `cargo xtask bench`.
pub fn run(ws: &Path) -> Result<ExitCode> {
    let runtime = match std::env::var("UBLKD_BENCH_RUNTIME") {
        Ok(v) => v
            .parse::<u64>()
            .ok()
            .filter(|&s| s > 0)
            .with_context(|| format!("UBLKD_BENCH_RUNTIME={v:?} is not a number of seconds"))?,
        Err(_) => DEFAULT_RUNTIME,
    };
    let kernel = image::prepare(ws)?;
    if apt::which("losetup").is_none() {
        apt::install_packages(&["mount"])?;
    }
    let kublk = ensure_kublk(&kernel).map_err(|e| format!("building kublk failed: {e:#}"));
    if let Err(e) = &kublk {
        eprintln!("xtask: {e}");
    }
    let built = |packages: &[&str]| build_release(ws, packages).map_err(|e| format!("{e:#}"));
    let (ublkd, ublkctl) = match std::env::var_os("UBLKD_BENCH_UBLKD") {
        Some(bin) => (
            absolute_file(Path::new(&bin)).map_err(|e| format!("{e:#}")),
            built(&["ublkctl"]).and_then(|dir| release_bin(&dir, "ublkctl")),
        ),
        None => {
            let dir = built(&["ublkd-server", "ublkctl"]);
            (
                dir.clone().and_then(|d| release_bin(&d, "ublkd")),
                dir.and_then(|d| release_bin(&d, "ublkctl")),
            )
        }
    };
    let mut errors: Vec<&String> = [&ublkd, &ublkctl]
        .into_iter()
        .filter_map(|r| r.as_ref().err())
        .collect();
    errors.dedup();
    for e in errors {
        eprintln!("xtask: {e}");
    }

    let script = guest_script(
        runtime,
        kublk.as_deref().map_err(String::as_str),
        ublkd.as_deref().map_err(String::as_str),
        ublkctl.as_deref().map_err(String::as_str),
    );
    let jobs = (RUNS.len() * WORKLOADS.len()) as u64;
    let timeout = std::env::var("UBLKD_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300 + jobs * (runtime + 45) + CONTROL_BUDGET_SECS + RECOVERY_BUDGET_SECS);
    eprintln!(
        "xtask: bench: {} runs x {} fio jobs of {runtime} s, then {CONTROL_VOLUMES} volumes \
         through ublkctl, then kill -9 recovery, in one boot of {}",
        RUNS.len(),
        WORKLOADS.len(),
        kernel.kver
    );
    let run = Vm::new(ws, &kernel)?
        .timeout_secs(timeout)
        .echo(true)
        .run(&script)?;

    let results = collect(&run.run_dir);
    let control = collect_control(&run.run_dir);
    let recoveries = collect_recovery(&run.run_dir);
    let stall = collect_stall(&run.run_dir);
    let mut entries = entries(&results);
    entries.extend(rss_entries(&run.run_dir));
    let control_entries = control_entries(&control);
    let recovery_entries = recovery_entries(&recoveries, &stall);
    println!();
    println!(
        "bench ({}, fio {runtime} s per job, {:.0} s in the guest):",
        kernel.kver,
        run.wall.as_secs_f64()
    );
    print!("{}", raw_table(&results));
    println!();
    print!("{}", entries_table(&entries));
    println!();
    println!("control plane (ublkd --config, driven by ublkctl):");
    print!("{}", control_table(&control_entries));
    println!();
    println!("recovery (ublkd --config killed with -9 and started again):");
    print!("{}", recovery_table(&recovery_entries, &recoveries, &stall));
    entries.extend(control_entries);
    entries.extend(recovery_entries);

    let out_dir = ws.join("target/bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let json = Value::Array(entries.iter().map(Entry::to_json).collect());
    let path = out_dir.join("results.json");
    fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let raw_path = out_dir.join("raw.json");
    let mut raw = raw_json(&results);
    if let Value::Array(list) = &mut raw {
        list.push(control_raw_json(&control));
        list.extend(recovery_raw_json(&recoveries, &stall));
    }
    fs::write(&raw_path, serde_json::to_string_pretty(&raw)? + "\n")
        .with_context(|| format!("writing {}", raw_path.display()))?;
    println!();
    println!("wrote {} and {}", path.display(), raw_path.display());

    let mut failed = entries.iter().filter(|e| e.error.is_some()).count();
    failed += results.samples.values().filter(|s| s.is_err()).count();
    if run.exit != Exit::Code(0) {
        failed += 1;
        println!(
            "guest {}; console tail:\n{}",
            run.exit,
            run.console_tail(40)
        );
    }
    if failed == 0 {
        let _ = fs::remove_dir_all(&run.run_dir);
        Ok(ExitCode::SUCCESS)
    } else {
        println!(
            "bench: some cases failed; guest logs kept in {}",
            run.run_dir.display()
        );
        Ok(ExitCode::FAILURE)
    }
}

/// `path` made absolute (the guest runs the script elsewhere), if it is a file.
fn absolute_file(path: &Path) -> Result<PathBuf> {
    let abs = path
        .canonicalize()
        .with_context(|| format!("UBLKD_BENCH_UBLKD={}", path.display()))?;
    if !abs.is_file() {
        bail!("UBLKD_BENCH_UBLKD={} is not a file", path.display());
    }
    Ok(abs)
}

/// Builds `packages` in release mode and returns the directory their binaries land in.
fn build_release(ws: &Path, packages: &[&str]) -> Result<PathBuf> {
    eprintln!("xtask: building {} (release)", packages.join(" and "));
    let mut cmd = crate::cargo();
    cmd.current_dir(ws).args(["build", "--release"]);
    for p in packages {
        cmd.args(["--package", p]);
    }
    let status = cmd.status().context("running cargo build --release")?;
    if !status.success() {
        bail!(
            "building {} in release mode failed ({status})",
            packages.join(" and ")
        );
    }
    Ok(ws.join("target/release"))
}

/// `dir/name`, if the build left it there.
fn release_bin(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let bin = dir.join(name);
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} is missing after the build", bin.display()))
    }
}

/// The kublk binary for the guest kernel, built once per kernel version from Debian's sources.
fn ensure_kublk(kernel: &Kernel) -> Result<PathBuf> {
    let dir = image::cache_dir().join("kublk").join(&kernel.kver);
    let bin = dir.join("kublk");
    if bin.is_file() {
        return Ok(bin);
    }
    let (series, upstream) = kernel_series(&kernel.kver)?;
    let mut build_tools = Vec::new();
    if apt::which("gcc").is_none() {
        build_tools.push("gcc");
    }
    if !Path::new("/usr/lib/x86_64-linux-gnu/libc.a").exists() {
        build_tools.push("libc6-dev");
    }
    apt::install_packages(&build_tools)?;

    let apt = PrivateApt::new(&image::cache_dir().join("apt"))?;
    let source = format!("linux-source-{series}");
    let mut versions = find_versions(&apt, &source, &upstream)?;
    if versions.0.is_none() || versions.1.is_none() {
        apt.update()?;
        versions = find_versions(&apt, &source, &upstream)?;
    }
    let source_version = versions
        .0
        .with_context(|| format!("no {source} of version {upstream} in the suites"))?;
    let headers_version = versions
        .1
        .with_context(|| format!("no linux-libc-dev of version {upstream} in the suites"))?;
    eprintln!("xtask: building kublk from {source} {source_version}");

    let work = dir.join("build.tmp");
    let _ = fs::remove_dir_all(&work);
    let debs = work.join("debs");
    let root = work.join("root");
    let src = work.join("src");
    fs::create_dir_all(&root)?;
    fs::create_dir_all(&src)?;
    apt.download(
        &[
            format!("{source}={source_version}"),
            format!("linux-libc-dev={headers_version}"),
            "liburing-dev".to_owned(),
        ],
        &debs,
    )?;
    for entry in fs::read_dir(&debs).with_context(|| format!("reading {}", debs.display()))? {
        let deb = entry?.path();
        apt::run_ok(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    }
    fs::remove_dir_all(&debs)?;

    // Only the selftest and the shared selftest headers out of the 170 MB tarball.
    let usr_src = root.join("usr/src");
    let tarball = fs::read_dir(&usr_src)
        .with_context(|| format!("reading {}", usr_src.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().ends_with(".tar.xz"))
        .with_context(|| format!("no source tarball in {}", usr_src.display()))?;
    let top = tarball
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_suffix(".tar.xz"))
        .context("odd source tarball name")?
        .to_owned();
    let selftests = format!("{top}/tools/testing/selftests");
    apt::run_ok(
        Command::new("tar")
            .arg("-xJf")
            .arg(&tarball)
            .arg("-C")
            .arg(&src)
            .args(["--wildcards", "--no-wildcards-match-slash"])
            .arg(format!("{selftests}/ublk"))
            .arg(format!("{selftests}/*.h")),
    )?;
    fs::remove_file(&tarball)?;

    let ublk_dir = src.join(&selftests).join("ublk");
    let mut sources = Vec::new();
    for entry in
        fs::read_dir(&ublk_dir).with_context(|| format!("reading {}", ublk_dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "c") {
            let text = fs::read_to_string(&path)?;
            // Standalone helpers (metadata_size.c) have their own main; kublk.c is the server.
            if path.file_name().is_some_and(|n| n == "kublk.c") || !text.contains("int main(") {
                sources.push(path);
            }
        }
    }
    sources.sort();
    if !sources.iter().any(|p| p.ends_with("kublk.c")) {
        bail!("no kublk.c in {}", ublk_dir.display());
    }
    let out = work.join("kublk");
    let usr = root.join("usr");
    apt::run_ok(
        Command::new("gcc")
            .args(["-static", "-O3", "-D_GNU_SOURCE", "-Wall"])
            .arg("-isystem")
            .arg(usr.join("include"))
            .arg("-isystem")
            .arg(usr.join("include/x86_64-linux-gnu"))
            .arg("-I")
            .arg(src.join(&selftests))
            .args(&sources)
            .arg("-L")
            .arg(usr.join("lib/x86_64-linux-gnu"))
            .args(["-l:liburing.a", "-lpthread", "-lm", "-o"])
            .arg(&out),
    )?;
    fs::rename(&out, &bin).with_context(|| format!("installing {}", bin.display()))?;
    fs::write(
        dir.join("versions"),
        format!("{source} {source_version}\nlinux-libc-dev {headers_version}\n"),
    )?;
    fs::remove_dir_all(&work)?;
    Ok(bin)
}

/// The versions of the kernel source and uapi headers packages matching `upstream`: the
/// headers of the very same version as the source when offered, else the newest of that release.
fn find_versions(
    apt: &PrivateApt,
    source: &str,
    upstream: &str,
) -> Result<(Option<String>, Option<String>)> {
    let source_version = pick_version(&apt.versions(source)?, upstream);
    let headers = apt.versions("linux-libc-dev")?;
    let headers_version = source_version
        .as_ref()
        .filter(|v| headers.contains(v))
        .cloned()
        .or_else(|| pick_version(&headers, upstream));
    Ok((source_version, headers_version))
}

/// The first (newest) version in `versions` of upstream release `upstream` (`7.3.4-1~bpo13+1`
/// for `7.3.4`).
fn pick_version(versions: &[String], upstream: &str) -> Option<String> {
    versions
        .iter()
        .find(|v| {
            v.strip_prefix(upstream)
                .is_some_and(|rest| rest.starts_with('-') || rest.starts_with('+'))
        })
        .cloned()
}

/// `7.3.4+deb13-amd64` → (`7.3`, `7.3.4`).
fn kernel_series(kver: &str) -> Result<(String, String)> {
    let upstream = kver
        .split(['+', '-'])
        .next()
        .filter(|v| !v.is_empty())
        .with_context(|| format!("odd kernel version {kver:?}"))?;
    let parts: Vec<&str> = upstream.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.parse::<u64>().is_err()) {
        bail!("odd kernel version {kver:?}");
    }
    Ok((format!("{}.{}", parts[0], parts[1]), upstream.to_owned()))
}

/// Shell functions the generated script uses. Each run writes into `$OUT/<run>/`:
/// `error` (setup failed; no numbers), `teardown_error`, and per workload `<wl>.json` (fio),
/// `<wl>.rc` and `<wl>.counters` (`cpu_ticks_before cpu_ticks_after hz ios_before ios_after`,
/// where a tick count is `none` without a server process and `-` when it could not be read).
const SCRIPT_LIB: &str = r#"
OUT="$UBLKD_VM_RUN"
HZ=$(getconf CLK_TCK)
FIO_ENGINE="--ioengine=io_uring --direct=1"
note() { echo "bench: $*"; }
tail_of() { tail -n 5 "$1" 2>/dev/null | tr '\n' ' '; }

# Reads and writes completed by block device $1 (a name under /sys/block).
dev_ios() {
    awk '{ print $1 + $5 }' "/sys/block/$1/stat" 2>/dev/null || echo -
}

# utime + stime, in clock ticks, summed over the processes $1 (space-separated pids).
cpu_ticks() {
    [ -n "$1" ] || { echo none; return; }
    total=0
    for p in $1; do
        v=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | awk '{ print $12 + $13 }')
        [ -n "$v" ] || { echo -; return; }
        total=$((total + v))
    done
    echo "$total"
}

# run_fio RUN DEVICE WORKLOAD RW QD PIDS
run_fio() {
    d="$OUT/$1"
    blk=$(basename "$(readlink -f "$2")")
    ios0=$(dev_ios "$blk"); t0=$(cpu_ticks "$6")
    # shellcheck disable=SC2086
    timeout -k 5 $((RUNTIME + 60)) fio --name="$3" --filename="$2" $FIO_ENGINE --bs=4k --rw="$4" --iodepth="$5" --numjobs=1 --norandommap --time_based \
        --runtime="$RUNTIME" --ramp_time=1 --output-format=json --output="$d/$3.json" \
        > "$d/$3.log" 2>&1
    rc=$?
    t1=$(cpu_ticks "$6"); ios1=$(dev_ios "$blk")
    echo "$rc" > "$d/$3.rc"
    echo "$t0 $t1 $HZ $ios0 $ios1" > "$d/$3.counters"
    note "$1 $3: fio exit $rc, $(awk -v a="$ios0" -v b="$ios1" 'BEGIN { print b - a }') I/Os"
}

# Waits up to 10 s for block device $1 to appear.
wait_blk() {
    i=0
    while [ ! -b "$1" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    [ -b "$1" ]
}

# Waits up to $2 tenths of a second for file $1 to exist.
wait_file() {
    i=0
    while [ ! -e "$1" ] && [ $i -lt "$2" ]; do sleep 0.1; i=$((i + 1)); done
    [ -e "$1" ]
}

fail_case() {
    mkdir -p "$OUT/$1"
    echo "$2" > "$OUT/$1/error"
    note "$1: $2"
}

# stop_ublkd DIR PID [DEVICE]: SIGTERM, then wait for the exit and the device's removal.
stop_ublkd() {
    kill -TERM "$2" 2>/dev/null
    if ! wait_file "$1/exit" 300; then
        echo "did not exit within 30 s of SIGTERM (killed)" >> "$1/teardown_error"
        kill -KILL "$2" 2>/dev/null
        wait_file "$1/exit" 50
    elif [ "$(cat "$1/exit")" != 0 ]; then
        echo "exited with status $(cat "$1/exit") after SIGTERM: $(tail_of "$1/server.err")" \
            >> "$1/teardown_error"
    fi
    if [ -n "${3-}" ]; then
        i=0
        while [ -e "$3" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
        [ -e "$3" ] && echo "$3 still exists after ublkd exited" >> "$1/teardown_error"
    fi
    return 0
}

# ublkd_case RUN ARGS...: start `ublkd run ARGS`, wait for READY, measure, stop.
ublkd_case() {
    run=$1; shift
    d="$OUT/$run"; mkdir -p "$d"
    note "$run: ublkd run $*"
    ( sh -c 'echo $$ > "$0/pid"; exec "$@"' "$d" "$UBLKD" run "$@" \
        > "$d/server.out" 2> "$d/server.err"
      rc=$?; echo "$rc" > "$d/exit.tmp"; mv "$d/exit.tmp" "$d/exit" ) &
    dev=""; i=0
    while [ $i -lt 600 ]; do
        dev=$(sed -n 's|^READY \(/dev/[^ ]*\).*|\1|p' "$d/server.out" 2>/dev/null | head -n 1)
        if [ -n "$dev" ] || [ -e "$d/exit" ]; then break; fi
        sleep 0.1; i=$((i + 1))
    done
    wait_file "$d/pid" 50
    pid=$(cat "$d/pid" 2>/dev/null)
    if [ -z "$dev" ]; then
        if [ -e "$d/exit" ]; then
            fail_case "$run" "ublkd exited with status $(cat "$d/exit") before READY: $(tail_of "$d/server.err")"
        else
            fail_case "$run" "ublkd printed no READY line within 60 s: $(tail_of "$d/server.err")"
            stop_ublkd "$d" "$pid"
        fi
        return
    fi
    if ! wait_blk "$dev"; then
        fail_case "$run" "ublkd said READY $dev, but that is no block device"
        stop_ublkd "$d" "$pid"
        return
    fi
    sleep 1
    cat "/proc/$pid/status" > "$d/status.idle" 2>/dev/null
    run_workloads "$run" "$dev" "$pid"
    stop_ublkd "$d" "$pid" "$dev"
}

# kublk_case RUN ARGS...: `kublk add ARGS`, measure its daemon, `kublk del`.
kublk_case() {
    run=$1; shift
    d="$OUT/$run"; mkdir -p "$d"
    note "$run: kublk add $*"
    if ! timeout 60 "$KUBLK" add "$@" > "$d/server.out" 2> "$d/server.err"; then
        fail_case "$run" "kublk add $* failed: $(tail_of "$d/server.err")"
        return
    fi
    id=$(sed -n 's/^dev id \([0-9][0-9]*\):.*/\1/p' "$d/server.out" | head -n 1)
    pid=$(sed -n 's/.*daemon pid \([0-9][0-9]*\).*/\1/p' "$d/server.out" | head -n 1)
    if [ -z "$id" ] || [ -z "$pid" ]; then
        fail_case "$run" "no dev id or daemon pid in the output of kublk add: $(tail_of "$d/server.out")"
        [ -n "$id" ] && "$KUBLK" del -n "$id" >/dev/null 2>&1
        return
    fi
    if ! wait_blk "/dev/ublkb$id"; then
        fail_case "$run" "kublk added device $id, but /dev/ublkb$id did not appear"
    else
        run_workloads "$run" "/dev/ublkb$id" "$pid"
    fi
    if ! timeout 60 "$KUBLK" del -n "$id" > "$d/del.log" 2>&1; then
        echo "kublk del -n $id failed: $(tail_of "$d/del.log")" >> "$d/teardown_error"
    fi
}

# raw_nvme_case RUN PASSTHRU: fio on the namespace itself, polled: NVMe passthrough on
# /dev/ng0n1 with fixed buffers when PASSTHRU is true, else io_uring on /dev/nvme0n1.
raw_nvme_case() {
    d="$OUT/$1"; mkdir -p "$d"
    if [ "$(cat /sys/block/nvme0n1/queue/io_poll 2>/dev/null)" != 1 ]; then
        fail_case "$1" "/dev/nvme0n1 has no poll queues"
        return
    fi
    if [ "$2" = true ]; then
        note "$1: fio io_uring_cmd on /dev/ng0n1 (hipri, fixedbufs)"
        FIO_ENGINE="--ioengine=io_uring_cmd --cmd_type=nvme --hipri=1 --fixedbufs=1 --registerfiles=1"
        run_workloads "$1" /dev/ng0n1 ""
    else
        note "$1: fio io_uring on /dev/nvme0n1 (hipri)"
        FIO_ENGINE="--ioengine=io_uring --direct=1 --hipri=1 --fixedbufs=1 --registerfiles=1"
        run_workloads "$1" /dev/nvme0n1 ""
    fi
    FIO_ENGINE="--ioengine=io_uring --direct=1"
}

# loop_case RUN FILE: a loop device with direct I/O on FILE.
loop_case() {
    d="$OUT/$1"; mkdir -p "$d"
    note "$1: losetup --direct-io=on $2"
    if ! dev=$(losetup --direct-io=on --find --show "$2" 2> "$d/server.err"); then
        fail_case "$1" "losetup failed: $(tail_of "$d/server.err")"
        return
    fi
    if [ "$(cat "/sys/block/$(basename "$dev")/loop/dio" 2>/dev/null)" != 1 ]; then
        fail_case "$1" "$dev did not switch to direct I/O"
    else
        run_workloads "$1" "$dev" ""
    fi
    losetup -d "$dev" 2>> "$d/teardown_error" || echo "losetup -d $dev failed" >> "$d/teardown_error"
    [ -s "$d/teardown_error" ] || rm -f "$d/teardown_error"
}

nullblk_case() {
    d="$OUT/$1"; mkdir -p "$d"
    note "$1: /dev/nullb0"
    if [ -b /dev/nullb0 ]; then
        run_workloads "$1" /dev/nullb0 ""
    else
        fail_case "$1" "/dev/nullb0 is missing (null_blk not loaded?)"
    fi
}

# ctl_case RUN VOLUMES SIZE DEPTH METRICS: ublkd as a node service (`ublkd --config`), driven
# by ublkctl. Records the daemon's /proc status with no volumes (status.0) and with VOLUMES idle
# null volumes (status.full), and times each create-volume (create.ns: NAME DEVICE NS) and
# delete-volume (delete.ns: NAME NS) end to end, ublkctl's start-up included.
ctl_case() {
    run=$1; n=$2; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/ublkd-bench-ctl"; SOCK="$C/ublkd.sock"
    node_config "$C" "$5"
    note "$run: ublkd --config $C/ublkd.toml, then $n volumes through ublkctl"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    sleep 1
    cat "/proc/$pid/status" > "$d/status.0" 2>/dev/null

    : > "$d/create.ns"
    k=1
    while [ $k -le "$n" ]; do
        name=$(printf 'v%03d' "$k")
        t0=$(date +%s%N)
        dev=$(ctl create-volume "$name" --size "$3" --backend null --depth "$4" 2>> "$d/create.err")
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "create-volume $name failed (exit $rc): $(tail_of "$d/create.err")" > "$d/create_error"
            break
        fi
        # Created: deleted below, whatever else goes wrong.
        echo "$name ${dev:--} $((t1 - t0))" >> "$d/create.ns"
        if [ ! -b "$dev" ]; then
            echo "create-volume $name returned ${dev:-nothing}, which is no block device" > "$d/create_error"
            break
        fi
        k=$((k + 1))
    done
    note "$run: $(wc -l < "$d/create.ns") volumes created"
    sleep 1
    cat "/proc/$pid/status" > "$d/status.full" 2>/dev/null
    # A Prometheus scrape with every volume present (scrape.ns: one NS per scrape), timed
    # inside one process so that no process start (slow over the guest's 9p root) counts.
    python3 - "$5" > "$d/scrape.ns" 2> "$d/scrape_error" <<'PY'
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
# The first name lookup imports codecs from the 9p root: the client's cost, not the server's.
socket.getaddrinfo(host, int(port))
for _ in range(10):
    t0 = time.perf_counter_ns()
    c = socket.create_connection((host, int(port)))
    c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    head = b""
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        head = head or b
    t1 = time.perf_counter_ns()
    if not head.startswith(b"HTTP/1.") or b" 200 " not in head.split(b"\r\n", 1)[0]:
        sys.exit("GET /metrics did not answer 200")
    print(t1 - t0)
PY
    [ -s "$d/scrape_error" ] || rm -f "$d/scrape_error"

    : > "$d/delete.ns"
    while read -r name dev ns; do
        t0=$(date +%s%N)
        ctl delete-volume "$name" > /dev/null 2>> "$d/delete.err"
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "delete-volume $name failed (exit $rc): $(tail_of "$d/delete.err")" >> "$d/delete_error"
            continue
        fi
        echo "$name $((t1 - t0))" >> "$d/delete.ns"
        if [ -e "$dev" ]; then
            echo "$dev still exists after delete-volume $name returned" >> "$d/delete_error"
        fi
    done < "$d/create.ns"
    note "$run: $(wc -l < "$d/delete.ns") volumes deleted"
    stop_ublkd "$d" "$pid"
}

# node_config DIR METRICS: DIR/ublkd.toml, a node-service configuration keeping everything
# (state, roots, RAM files, socket) under DIR; devices are kept on exit (the default).
node_config() {
    mkdir -p "$1/roots"
    cat > "$1/ublkd.toml" <<CONFIG
state_dir = "$1/state"
allowed_roots = ["$1/roots"]
ram_dir = "$1/ram"
on_exit = "keep"

[grpc]
listen = ["unix://$1/ublkd.sock"]

[metrics]
listen = "$2"

[dataplane]
cpus = [0, 1]
CONFIG
}

# spawn_ublkd DIR CONFIG: `ublkd --config CONFIG` in the background, logging to DIR/server.*.
# It writes DIR/pid, then DIR/start.ns (date +%s%N right before the exec), and DIR/exit once the
# process is gone; sets $pid.
spawn_ublkd() {
    rm -f "$1/pid" "$1/start.ns" "$1/exit"
    ( sh -c 'echo $$ > "$0/pid.tmp"; mv "$0/pid.tmp" "$0/pid"; date +%s%N > "$0/start.ns"
             exec "$@"' "$1" "$UBLKD" --config "$2" >> "$1/server.out" 2>> "$1/server.err"
      rc=$?; echo "$rc" > "$1/exit.tmp"; mv "$1/exit.tmp" "$1/exit" ) &
    wait_file "$1/pid" 50
    pid=$(cat "$1/pid" 2>/dev/null)
}

# wait_up RUN DIR: waits up to 60 s for the daemon's socket ($SOCK) to answer node-info; if it
# does not, records why (fail_case), stops the daemon and returns 1.
wait_up() {
    i=0
    while [ $i -lt 600 ] && [ ! -e "$2/exit" ]; do
        if ctl node-info > "$2/node-info.out" 2> "$2/node-info.err"; then return 0; fi
        sleep 0.1; i=$((i + 1))
    done
    if [ -e "$2/exit" ]; then
        fail_case "$1" "ublkd exited with status $(cat "$2/exit") before its socket answered: $(tail_of "$2/server.err")"
    else
        fail_case "$1" "ublkd's socket did not answer node-info within 60 s: $(tail_of "$2/node-info.err") $(tail_of "$2/server.err")"
        stop_ublkd "$2" "$pid"
    fi
    return 1
}

# wait_ready DIR N: polls `list-volumes -o json` every 20 ms until it shows N volumes READY, then
# writes DIR/list.json (that answer), DIR/ready.ns (`START_NS READY_NS`: the daemon's exec and
# the moment that answer arrived) and DIR/poll.ns (`BEFORE_NS AFTER_NS` one more call). Gives up (returns 1, reason in $why) when a volume FAILED,
# the daemon exited, or 60 s passed.
wait_ready() {
    deadline=$(( $(date +%s) + 60 ))
    while :; do
        if ctl list-volumes -o json > "$1/list.tmp" 2>> "$1/list.err"; then
            t1=$(date +%s%N)
            if [ "$(grep -c '"VOLUME_STATE_READY"' "$1/list.tmp")" -eq "$2" ]; then
                mv "$1/list.tmp" "$1/list.json"
                echo "$(cat "$1/start.ns") $t1" > "$1/ready.ns"
                # What one poll costs (ublkctl's start-up included), for reading the above.
                p0=$(date +%s%N)
                ctl list-volumes -o json > /dev/null 2>&1
                echo "$p0 $(date +%s%N)" > "$1/poll.ns"
                return 0
            fi
            if grep -q '"VOLUME_STATE_FAILED"' "$1/list.tmp"; then
                why="a volume FAILED to come back: $(grep '"message"' "$1/list.tmp" | grep -v '""' | head -n 1)"
                return 1
            fi
        fi
        if [ -e "$1/exit" ]; then
            why="the new ublkd exited with status $(cat "$1/exit"): $(tail_of "$1/server.err")"
            return 1
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            why="not all $2 volumes READY within 60 s of the restart: $(grep -c '"VOLUME_STATE_READY"' "$1/list.tmp" 2>/dev/null) READY; $(tail_of "$1/list.err")"
            return 1
        fi
        sleep 0.02
    done
}

# crash_restart DIR CONFIG: kill -9 the daemon ($pid; DIR/kill.ns the moment), wait (polling every
# 10 ms) until it is gone, and start it again at once. Returns 1 (reason in $why) if it does not
# die within 10 s.
crash_restart() {
    date +%s%N > "$1/kill.ns"
    kill -KILL "$pid" 2>/dev/null
    i=0
    while [ ! -e "$1/exit" ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i + 1)); done
    if [ ! -e "$1/exit" ]; then
        why="ublkd did not exit within 10 s of kill -9"
        return 1
    fi
    spawn_ublkd "$1" "$2"
}

# rec_teardown DIR CONFIG: deletes every volume the daemon lists (starting it again first if it
# is gone), checks the devices in DIR/volumes (`NAME DEVICE` lines) are gone, stops the daemon
# with SIGTERM. Problems go to DIR/teardown_error.
rec_teardown() {
    if [ -e "$1/exit" ]; then
        spawn_ublkd "$1" "$2"
        i=0
        while [ $i -lt 100 ] && [ ! -e "$1/exit" ] && ! ctl node-info > /dev/null 2>&1; do
            sleep 0.1; i=$((i + 1))
        done
    fi
    if ! ctl list-volumes -o json > "$1/final.json" 2>> "$1/delete.err"; then
        echo "list-volumes failed before the deletes: $(tail_of "$1/delete.err")" >> "$1/teardown_error"
    fi
    for name in $(sed -n 's/.*"id": "\([^"]*\)".*/\1/p' "$1/final.json" 2>/dev/null); do
        if ! ctl delete-volume "$name" > /dev/null 2>> "$1/delete.err"; then
            echo "delete-volume $name failed: $(tail_of "$1/delete.err")" >> "$1/teardown_error"
        fi
    done
    while read -r name dev; do
        [ -e "$dev" ] && echo "$dev ($name) still exists after the deletes" >> "$1/teardown_error"
    done < "$1/volumes"
    if [ -e "$1/exit" ]; then
        echo "ublkd was not running for the deletes: $(tail_of "$1/server.err")" >> "$1/teardown_error"
    else
        stop_ublkd "$1" "$pid"
    fi
    return 0
}

# rec_case RUN N SIZE DEPTH METRICS: a fresh daemon, N null volumes (1 queue of DEPTH), kill -9,
# start it again; ready.ns times the new process from its exec until list-volumes shows all N
# READY. Then every volume is deleted and the daemon stopped.
rec_case() {
    run=$1; n=$2; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$5"
    note "$run: $n null volumes, kill -9 ublkd, start it again"
    : > "$d/volumes"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    k=1
    while [ $k -le "$n" ]; do
        name=$(printf 'r%03d' "$k")
        if ! dev=$(ctl create-volume "$name" --size "$3" --backend null --queues 1 --depth "$4" \
                2>> "$d/create.err"); then
            fail_case "$run" "create-volume $name failed: $(tail_of "$d/create.err")"
            rec_teardown "$d" "$C/ublkd.toml"
            return
        fi
        echo "$name $dev" >> "$d/volumes"
        k=$((k + 1))
    done
    if ! crash_restart "$d" "$C/ublkd.toml"; then
        fail_case "$run" "$why"
    else
        gone=""
        while read -r name dev; do [ -b "$dev" ] || gone="$gone $dev"; done < "$d/volumes"
        if ! wait_ready "$d" "$n"; then
            fail_case "$run" "$why"
        elif [ -n "$gone" ]; then
            fail_case "$run" "devices gone after kill -9 (they must survive the daemon):$gone"
        fi
    fi
    note "$run: $(cat "$d/ready.ns" 2>/dev/null || echo 'not READY')"
    rec_teardown "$d" "$C/ublkd.toml"
}

# stall_case RUN SIZE RUNTIME KILL_AT METRICS: fio randwrite 4k QD16 on a RAM volume for RUNTIME
# s with a per-I/O completion latency log (clat.log: `MS, NS, DIR, BS, OFFSET` lines); KILL_AT s
# after the device completed its first write, kill -9 ublkd and start it again at once.
# times.ns: `FIO_LAUNCH_NS FIRST_WRITE_NS`; kill.ns, ready.ns, poll.ns as above; fio.json, fio.rc.
stall_case() {
    run=$1; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$5"
    note "$run: fio on a RAM volume for $3 s, kill -9 ublkd $4 s in"
    : > "$d/volumes"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    if ! dev=$(ctl create-volume s1 --size "$2" --backend ram 2>> "$d/create.err"); then
        fail_case "$run" "create-volume s1 failed: $(tail_of "$d/create.err")"
        rec_teardown "$d" "$C/ublkd.toml"
        return
    fi
    echo "s1 $dev" > "$d/volumes"
    if ! wait_blk "$dev"; then
        fail_case "$run" "create-volume returned ${dev:-nothing}, which is no block device"
        rec_teardown "$d" "$C/ublkd.toml"
        return
    fi
    mkdir -p "$C/fio"
    ( timeout -k 5 $(($3 + 60)) fio --name=stall --filename="$dev" --ioengine=io_uring \
        --direct=1 --bs=4k --rw=randwrite --iodepth=16 --numjobs=1 --norandommap --time_based \
        --runtime="$3" --disable_slat=1 --disable_lat=1 --write_lat_log="$C/fio/stall" \
        --log_avg_msec=0 --output-format=json --output="$d/fio.json" > "$d/fio.log" 2>&1
      echo $? > "$d/fio.rc.tmp"; mv "$d/fio.rc.tmp" "$d/fio.rc" ) &
    t0=$(date +%s%N)
    # fio can take seconds to start its job (TCG): count from the device's first write.
    blk=$(basename "$dev"); i=0
    while [ "$(awk '{ print $5 }' "/sys/block/$blk/stat" 2>/dev/null || echo 0)" = 0 ] &&
        [ $i -lt 6000 ] && [ ! -e "$d/fio.rc" ]; do
        sleep 0.01; i=$((i + 1))
    done
    t1=$(date +%s%N)
    echo "$t0 $t1" > "$d/times.ns"
    if [ "$(awk '{ print $5 }' "/sys/block/$blk/stat" 2>/dev/null || echo 0)" = 0 ]; then
        fail_case "$run" "fio wrote nothing to $dev within 60 s: $(tail_of "$d/fio.log")"
    else
        sleep "$4"
        if ! crash_restart "$d" "$C/ublkd.toml"; then
            fail_case "$run" "$why"
        elif ! wait_ready "$d" 1; then
            fail_case "$run" "$why"
        fi
    fi
    if ! wait_file "$d/fio.rc" $((($3 + 70) * 10)); then
        fail_case "$run" "fio did not end within $(($3 + 70)) s"
    fi
    if ! cp "$C/fio/stall_clat.1.log" "$d/clat.log" 2>> "$d/fio.log"; then
        echo "fio wrote no completion latency log" >> "$d/fio.log"
    fi
    note "$run: fio exit $(cat "$d/fio.rc" 2>/dev/null), $(wc -l < "$d/clat.log" 2>/dev/null) I/Os logged"
    rec_teardown "$d" "$C/ublkd.toml"
}

# ublkctl against the control-plane run's daemon; never reads the caller's stdin.
ctl() {
    "$UBLKCTL" --endpoint "unix://$SOCK" "$@" < /dev/null
}

# The backing file for the file cases: ext4 on the NVMe namespace, written out in full so that
# reads reach the device.
prepare_backing() {
    mnt="$TMPDIR/ublkd-bench"
    mkdir -p "$mnt" &&
        mkfs.ext4 -q -F /dev/nvme0n1 &&
        mount /dev/nvme0n1 "$mnt" &&
        dd if=/dev/zero of="$mnt/backing" bs=1M count=$((BACKING_BYTES >> 20)) oflag=direct \
            status=none &&
        BACKING="$mnt/backing"
}
"#;

/// The script the guest runs: every run of `RUNS`, then the control-plane run, each writing its
/// results into the run directory. `kublk`/`ublkd`/`ublkctl` are the binaries, or why they are
/// missing.
fn guest_script(
    runtime: u64,
    kublk: Result<&Path, &str>,
    ublkd: Result<&Path, &str>,
    ublkctl: Result<&Path, &str>,
) -> String {
    let q = |p: &Path| vm::shell_quote(&p.to_string_lossy());
    let mut s = String::from("set -u\n");
    let _ = writeln!(s, "RUNTIME={runtime}");
    let _ = writeln!(s, "BACKING_BYTES={BACKING_BYTES}");
    let _ = writeln!(s, "KUBLK={}", kublk.map(q).unwrap_or_default());
    let _ = writeln!(s, "UBLKD={}", ublkd.map(q).unwrap_or_default());
    let _ = writeln!(s, "UBLKCTL={}", ublkctl.map(q).unwrap_or_default());
    s.push_str("SOCK=\"\"\n");
    s.push_str(SCRIPT_LIB);
    s.push_str("\n# run_workloads RUN DEVICE PIDS\nrun_workloads() {\n");
    for wl in WORKLOADS {
        let _ = writeln!(
            s,
            "    run_fio \"$1\" \"$2\" {} {} {} \"$3\"",
            wl.id, wl.rw, wl.qd
        );
    }
    s.push_str("}\n\n");
    s.push_str("echo \"bench: guest kernel $(uname -r), $(nproc) CPUs\"\n");
    s.push_str(
        "BACKING=\"\"\nif prepare_backing > \"$OUT/backing.log\" 2>&1; then\n    \
         note \"backing file $BACKING ready\"\nelse\n    \
         note \"backing file failed: $(tail_of \"$OUT/backing.log\")\"\nfi\n",
    );
    // The backing file's file system lives on the NVMe namespace: unmount it before the first
    // run that uses the namespace itself.
    let mut unmounted = false;
    let umount = "if [ -n \"$BACKING\" ]; then umount \"$TMPDIR/ublkd-bench\"; BACKING=\"\"; fi\n";
    for run in RUNS {
        let id = run.id;
        let on_namespace = matches!(
            run.server,
            Server::RawNvme { .. }
                | Server::Ublkd {
                    backend: UBackend::Nvme,
                    ..
                }
        );
        if on_namespace && !unmounted {
            s.push_str(umount);
            unmounted = true;
        }
        let line = match run.server {
            Server::NullBlk => format!("nullblk_case {id}"),
            Server::Loop => format!(
                "if [ -n \"$BACKING\" ]; then loop_case {id} \"$BACKING\"; \
                 else fail_case {id} \"no backing file: $(tail_of \"$OUT/backing.log\")\"; fi"
            ),
            Server::Kublk { batch, auto_zc } => match kublk {
                Ok(_) => format!(
                    "kublk_case {id} -t null -q {QUEUES} -d {DEPTH}{}{}",
                    if batch { " -b" } else { "" },
                    if auto_zc { " --auto_zc" } else { "" }
                ),
                Err(e) => format!("fail_case {id} {}", vm::shell_quote(e)),
            },
            Server::RawNvme { passthru } => format!("raw_nvme_case {id} {passthru}"),
            Server::Ublkd {
                backend,
                io_path,
                zero_copy,
                poll,
            } => {
                let on = |b: bool| if b { "on" } else { "off" };
                let common = format!(
                    "--queues {QUEUES} --depth {DEPTH} --io-path {io_path} --zero-copy {} --poll {}",
                    on(zero_copy),
                    on(poll)
                );
                match (ublkd, backend) {
                    (Err(e), _) => format!("fail_case {id} {}", vm::shell_quote(e)),
                    (Ok(_), UBackend::Null) => format!(
                        "ublkd_case {id} --backend null --size {NULL_BYTES} {common}"
                    ),
                    (Ok(_), UBackend::File) => format!(
                        "if [ -n \"$BACKING\" ]; then \
                         ublkd_case {id} --backend \"file:$BACKING\" --size {BACKING_BYTES} {common}; \
                         else fail_case {id} \"no backing file: $(tail_of \"$OUT/backing.log\")\"; fi"
                    ),
                    (Ok(_), UBackend::Nvme) => format!(
                        "ublkd_case {id} --backend nvme:/dev/ng0n1 \
                         --size $(( $(cat /sys/block/nvme0n1/size) * 512 )) {common}"
                    ),
                }
            }
        };
        s.push_str(&line);
        s.push('\n');
    }
    if !unmounted {
        s.push_str(umount);
    }
    let line = match (ublkd, ublkctl) {
        (Err(e), _) | (_, Err(e)) => format!("fail_case {CONTROL_RUN} {}", vm::shell_quote(e)),
        (Ok(_), Ok(_)) => format!(
            "ctl_case {CONTROL_RUN} {CONTROL_VOLUMES} {CONTROL_SIZE} {CONTROL_DEPTH} \
             {CONTROL_METRICS}"
        ),
    };
    s.push_str(&line);
    s.push('\n');
    // Crash recovery last: each run its own daemon, state and socket, torn down before the next.
    let mut runs: Vec<String> = RECOVERY_VOLUMES.iter().map(|&n| recovery_run(n)).collect();
    runs.push(STALL_RUN.to_owned());
    for (i, id) in runs.iter().enumerate() {
        let line = match (ublkd, ublkctl) {
            (Err(e), _) | (_, Err(e)) => format!("fail_case {id} {}", vm::shell_quote(e)),
            (Ok(_), Ok(_)) => match RECOVERY_VOLUMES.get(i) {
                Some(n) => {
                    format!("rec_case {id} {n} {RECOVERY_SIZE} {RECOVERY_DEPTH} {RECOVERY_METRICS}")
                }
                None => format!(
                    "stall_case {id} {STALL_SIZE} {STALL_RUNTIME_SECS} {STALL_KILL_AT_SECS} \
                     {RECOVERY_METRICS}"
                ),
            },
        };
        s.push_str(&line);
        s.push('\n');
    }
    s.push_str("note done\nexit 0\n");
    s
}

/// Reads what the guest wrote into `dir`.
fn collect(dir: &Path) -> Results {
    let mut results = Results::default();
    for run in RUNS {
        let rdir = dir.join(run.id);
        if let Ok(t) = fs::read_to_string(rdir.join("teardown_error")) {
            if !t.trim().is_empty() {
                results
                    .teardown
                    .insert(run.id.to_owned(), t.trim().replace('\n', "; "));
            }
        }
        let run_error = if !rdir.is_dir() {
            Some("did not run (the guest ended early)".to_owned())
        } else {
            fs::read_to_string(rdir.join("error"))
                .ok()
                .map(|e| e.trim().to_owned())
        };
        for wl in WORKLOADS {
            let sample = match &run_error {
                Some(e) => Err(e.clone()),
                None => load_sample(&rdir, wl),
            };
            results
                .samples
                .insert((run.id.to_owned(), wl.id.to_owned()), sample);
        }
    }
    results
}

fn load_sample(rdir: &Path, wl: &Workload) -> Result<Sample, String> {
    let read = |ext: &str| fs::read_to_string(rdir.join(format!("{}.{ext}", wl.id)));
    let rc = read("rc").map_err(|_| "fio did not run".to_owned())?;
    if rc.trim() != "0" {
        let log = read("log").unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        return Err(format!(
            "fio exited with status {}: {}",
            rc.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let json = read("json").map_err(|e| format!("no fio output: {e}"))?;
    let (iops, lat_us) = parse_fio(&json, wl.rw)?;
    let counters = read("counters").unwrap_or_default();
    Ok(Sample {
        iops,
        lat_us,
        cpu_s_per_mio: cpu_per_mio(&counters),
    })
}

/// IOPS and mean latency (µs) of the single job in fio's JSON output.
fn parse_fio(text: &str, rw: &str) -> Result<(f64, f64), String> {
    // fio may print notes before the JSON document.
    let start = text.find('{').ok_or("no JSON in fio output")?;
    let v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("bad fio JSON: {e}"))?;
    let job = &v["jobs"][0];
    if job.is_null() {
        return Err("no job in fio output".into());
    }
    if let Some(err) = job["error"].as_i64().filter(|&e| e != 0) {
        return Err(format!("fio reported error {err}"));
    }
    let dir = if rw.contains("write") {
        &job["write"]
    } else {
        &job["read"]
    };
    let ios = dir["total_ios"].as_f64().unwrap_or(0.0);
    if ios <= 0.0 {
        return Err("fio completed no I/O".into());
    }
    let iops = dir["iops"].as_f64().ok_or("no iops in fio output")?;
    let lat_ns = dir["lat_ns"]["mean"]
        .as_f64()
        .ok_or("no mean latency in fio output")?;
    Ok((iops, lat_ns / 1000.0))
}

/// Server CPU seconds per million I/Os from a counters line
/// (`ticks_before ticks_after hz ios_before ios_after`).
fn cpu_per_mio(line: &str) -> Result<f64, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [t0, t1, hz, ios0, ios1] = f.as_slice() else {
        return Err(format!("bad counters line {line:?}"));
    };
    if *t0 == "none" || *t1 == "none" {
        return Err("no server process".into());
    }
    let num = |s: &str, what: &str| {
        s.parse::<f64>()
            .map_err(|_| format!("{what} unreadable ({s:?})"))
    };
    let ticks = num(t1, "server CPU time after the job (process gone?)")?
        - num(t0, "server CPU time before the job")?;
    let hz = num(hz, "clock tick rate")?;
    let ios = num(ios1, "device I/O count")? - num(ios0, "device I/O count")?;
    if ios <= 0.0 || hz <= 0.0 {
        return Err("the device completed no I/O".into());
    }
    Ok(ticks / hz / (ios / 1e6))
}

fn fmt_value(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.decimals$}"))
}

fn entries_table(entries: &[Entry]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<54} {:>12} {:>18} {:>12} {:>7}  unit",
        "case", "ours", "peer", "peer value", "ratio"
    );
    for e in entries {
        let d = e.unit.decimals();
        let ours = match (e.ours, &e.error) {
            (None, Some(_)) => "FAILED".to_owned(),
            (v, _) => fmt_value(v, d),
        };
        let _ = writeln!(
            s,
            "{:<54} {:>12} {:>18} {:>12} {:>7}  {}",
            e.case,
            ours,
            e.peer,
            fmt_value(e.peer_value, d),
            fmt_value(e.ratio, 3),
            e.unit.name()
        );
        if let Some(err) = &e.error {
            let _ = writeln!(s, "    ! {err}");
        }
    }
    s
}

fn raw_table(results: &Results) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<20} {:<16} {:>10} {:>12} {:>14}",
        "run", "workload", "IOPS", "mean lat us", "cpu s/M I/O"
    );
    for run in RUNS {
        for wl in WORKLOADS {
            match results.get(run.id, wl.id) {
                Ok(sample) => {
                    let _ = writeln!(
                        s,
                        "{:<20} {:<16} {:>10.0} {:>12.1} {:>14}",
                        run.id,
                        wl.id,
                        sample.iops,
                        sample.lat_us,
                        fmt_value(sample.cpu_s_per_mio.ok(), 3)
                    );
                }
                Err(e) => {
                    let _ = writeln!(s, "{:<20} {:<16} FAILED: {e}", run.id, wl.id);
                }
            }
        }
        if let Some(t) = results.teardown.get(run.id) {
            let _ = writeln!(s, "{:<20} teardown: {t}", run.id);
        }
    }
    s
}

fn raw_json(results: &Results) -> Value {
    let mut list = Vec::new();
    for run in RUNS {
        for wl in WORKLOADS {
            let mut v = json!({ "run": run.id, "workload": wl.id });
            match results.get(run.id, wl.id) {
                Ok(sample) => {
                    v["iops"] = json!(round(sample.iops, 1));
                    v["lat_us"] = json!(round(sample.lat_us, 2));
                    v["cpu_s_per_mio"] = json!(sample.cpu_s_per_mio.ok().map(|x| round(x, 4)));
                }
                Err(e) => v["error"] = Value::from(e),
            }
            if let Some(t) = results.teardown.get(run.id) {
                v["teardown_error"] = Value::from(t.as_str());
            }
            list.push(v);
        }
    }
    Value::Array(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(iops: f64, lat_us: f64, cpu: f64) -> Result<Sample, String> {
        Ok(Sample {
            iops,
            lat_us,
            cpu_s_per_mio: Ok(cpu),
        })
    }

    fn results_with(f: impl Fn(&str, &str) -> Result<Sample, String>) -> Results {
        let mut r = Results::default();
        for run in RUNS {
            for wl in WORKLOADS {
                r.samples
                    .insert((run.id.into(), wl.id.into()), f(run.id, wl.id));
            }
        }
        r
    }

    fn find<'a>(entries: &'a [Entry], case: &str) -> &'a Entry {
        entries
            .iter()
            .find(|e| e.case == case)
            .unwrap_or_else(|| panic!("no entry {case:?}"))
    }

    #[test]
    fn ratios_point_the_way_the_unit_says() {
        assert_eq!(Unit::Iops.ratio(8000.0, 4000.0), Some(2.0));
        // Latency: lower is better, so peer/ours.
        assert_eq!(Unit::Us.ratio(50.0, 100.0), Some(2.0));
        assert_eq!(Unit::CpuPerMio.ratio(1.0, 4.0), Some(0.25));
        assert_eq!(Unit::Iops.ratio(1.0, 0.0), None);
        assert_eq!(Unit::Us.ratio(0.0, 1.0), None);
    }

    #[test]
    fn entries_compare_ours_with_peers_and_the_ceiling() {
        let results = results_with(|run, _| match run {
            "null_blk" => sample(20000.0, 20.0, 0.0),
            r if r.starts_with("ublkd") => sample(10000.0, 100.0, 2.0),
            _ => sample(8000.0, 125.0, 4.0),
        });
        let entries = entries(&results);
        // 9 pairs x 3 workloads, CPU for 6 pairs, 2 IOPS workloads x 4 ceilings.
        assert_eq!(entries.len(), 27 + 18 + 8);
        assert!(entries.iter().all(|e| e.error.is_none()));

        let e = find(&entries, "null per-io randread qd32");
        assert_eq!((e.ours, e.peer_value), (Some(10000.0), Some(8000.0)));
        assert_eq!((e.peer.as_str(), e.unit), ("kublk", Unit::Iops));
        assert_eq!(e.ratio, Some(1.25));

        let e = find(&entries, "file randread qd1");
        assert_eq!((e.peer.as_str(), e.unit), ("loop", Unit::Us));
        assert_eq!(e.ratio, Some(1.25));

        let e = find(&entries, "null batch randwrite qd32 cpu");
        assert_eq!(
            (e.ours, e.peer_value, e.ratio),
            (Some(2.0), Some(4.0), Some(0.5))
        );

        let e = find(&entries, "null batch randread qd32 vs null_blk");
        assert_eq!((e.ours, e.peer_value), (Some(0.5), Some(0.4)));
        assert_eq!(e.unit, Unit::FractionOfNullBlk);
    }

    #[test]
    fn failed_runs_give_null_values_and_an_error() {
        let mut results = results_with(|run, _| {
            if run.starts_with("ublkd") {
                Err("ublkd exited with status 2 before READY".into())
            } else {
                sample(8000.0, 125.0, 4.0)
            }
        });
        results
            .teardown
            .insert("kublk-null".into(), "kublk del failed".into());
        let entries = entries(&results);
        let e = find(&entries, "null per-io randread qd32");
        assert_eq!((e.ours, e.peer_value, e.ratio), (None, Some(8000.0), None));
        let err = e.error.as_deref().unwrap_or_default();
        assert!(err.contains("ublkd: ublkd exited with status 2"), "{err}");
        assert!(err.contains("kublk teardown: kublk del failed"), "{err}");

        let v = e.to_json();
        let keys: Vec<&str> = v
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "case",
                "error",
                "ours",
                "peer",
                "peer_value",
                "ratio",
                "unit"
            ]
        );
        assert!(v["ours"].is_null() && v["ratio"].is_null());
        assert_eq!(v["peer_value"], 8000.0);
        assert_eq!(v["unit"], "IOPS");
    }

    #[test]
    fn json_entry_has_the_documented_shape() {
        let e = Entry::compare(
            "null per-io randread qd32".into(),
            Side {
                name: "ublkd",
                value: Ok(8123.0),
                teardown: None,
            },
            Side {
                name: "kublk",
                value: Ok(8000.0),
                teardown: None,
            },
            Unit::Iops,
        );
        assert_eq!(
            e.to_json(),
            json!({"case": "null per-io randread qd32", "ours": 8123.0, "peer": "kublk",
                   "peer_value": 8000.0, "ratio": 1.0154, "unit": "IOPS"})
        );
    }

    #[test]
    fn fio_json_and_counters_parse() {
        let text = r#"note: both iodepth >= 1 and synchronous I/O engine
{"jobs":[{"error":0,"read":{"iops":8123.5,"total_ios":40000,"lat_ns":{"mean":3900000.0}},
          "write":{"iops":0.0,"total_ios":0,"lat_ns":{"mean":0.0}}}]}"#;
        assert_eq!(parse_fio(text, "randread"), Ok((8123.5, 3900.0)));
        assert!(parse_fio(text, "randwrite").is_err());
        assert!(parse_fio("garbage", "randread").is_err());

        // 150 ticks at 100 Hz = 1.5 s over 3 million I/Os.
        assert_eq!(cpu_per_mio("100 250 100 1000 3001000"), Ok(0.5));
        assert!(cpu_per_mio("none none 100 0 5").is_err_and(|e| e.contains("no server process")));
        assert!(cpu_per_mio("100 - 100 0 5").is_err());
        assert!(cpu_per_mio("1 2 100 5 5").is_err());
    }

    #[test]
    fn kernel_release_maps_to_its_source_package() {
        assert_eq!(
            kernel_series("7.3.4+deb13-amd64").ok(),
            Some(("7.3".to_owned(), "7.3.4".to_owned()))
        );
        assert!(kernel_series("amd64").is_err());
        let versions: Vec<String> = ["7.3.40-1", "7.3.4-2~bpo13+1", "7.3.4-1~bpo13+1"]
            .map(String::from)
            .to_vec();
        assert_eq!(
            pick_version(&versions, "7.3.4").as_deref(),
            Some("7.3.4-2~bpo13+1")
        );
        assert_eq!(pick_version(&versions, "7.3.5"), None);
    }

    #[test]
    fn script_runs_every_case_and_reports_missing_binaries() {
        let s = guest_script(
            5,
            Ok(Path::new("/cache/kublk")),
            Err("building ublkd failed"),
            Ok(Path::new("/t/ublkctl")),
        );
        assert!(s.contains("RUNTIME=5\n"));
        assert!(s.contains("kublk_case kublk-null -t null -q 2 -d 128\n"));
        assert!(s.contains("kublk_case kublk-null-batch -t null -q 2 -d 128 -b\n"));
        assert!(s.contains("kublk_case kublk-null-batch-zc -t null -q 2 -d 128 -b --auto_zc\n"));
        assert!(s.contains("fail_case ublkd-null-per-io 'building ublkd failed'\n"));
        assert!(s.contains("nullblk_case null_blk\n"));
        assert!(s.contains("loop_case loop-dio"));
        assert!(s.contains("UBLKCTL=/t/ublkctl\n"));
        assert!(s.contains("fail_case ublkd-control 'building ublkd failed'\n"));
        let s = guest_script(
            5,
            Err("no kublk"),
            Ok(Path::new("/t/ublkd")),
            Ok(Path::new("/t/ublkctl")),
        );
        assert!(s.contains(
            "ublkd_case ublkd-null-batch --backend null --size 1073741824 \
             --queues 2 --depth 128 --io-path batch --zero-copy off --poll off\n"
        ));
        assert!(s.contains(
            "ublkd_case ublkd-null-batch-zc --backend null --size 1073741824 \
             --queues 2 --depth 128 --io-path batch --zero-copy on --poll off\n"
        ));
        assert!(s.contains("raw_nvme_case fio-ng0n1-passthru true\n"));
        assert!(s.contains("ublkd_case ublkd-nvme-poll --backend nvme:/dev/ng0n1"));
        assert!(s.contains("fail_case kublk-null 'no kublk'\n"));
        // The control plane runs last, after the fio cases and the backing file's unmount.
        let ctl = s
            .find("ctl_case ublkd-control 100 64MiB 32 127.0.0.1:9581\n")
            .expect("no ctl_case line");
        assert!(s.rfind("loop_case loop-dio").is_some_and(|i| i < ctl));
        assert!(s.rfind("umount").is_some_and(|i| i < ctl));
        // The namespace's file system is gone before anything uses the namespace itself.
        let um = s.find("umount").expect("umount");
        assert!(s.rfind("ublkd-file-copy").is_some_and(|i| i < um));
        assert!(s.find("fio-ng0n1-passthru").is_some_and(|i| i > um));
        let s = guest_script(
            5,
            Err("no kublk"),
            Ok(Path::new("/t/ublkd")),
            Err("building ublkctl failed"),
        );
        assert!(s.contains("fail_case ublkd-control 'building ublkctl failed'\n"));
        assert!(!s.contains("ctl_case ublkd-control"));
    }

    #[test]
    fn script_runs_the_recovery_cases_last() {
        let s = guest_script(
            5,
            Ok(Path::new("/k/kublk")),
            Ok(Path::new("/t/ublkd")),
            Ok(Path::new("/t/ublkctl")),
        );
        let at = |line: &str| {
            s.find(line)
                .unwrap_or_else(|| panic!("no {line:?} in\n{s}"))
        };
        let ctl = at("ctl_case ublkd-control 100");
        let r1 = at("rec_case ublkd-recovery-1 1 64MiB 32 127.0.0.1:9582\n");
        let r16 = at("rec_case ublkd-recovery-16 16 64MiB 32 127.0.0.1:9582\n");
        let r64 = at("rec_case ublkd-recovery-64 64 64MiB 32 127.0.0.1:9582\n");
        let stall = at("stall_case ublkd-stall 128MiB 8 3 127.0.0.1:9582\n");
        assert!(ctl < r1 && r1 < r16 && r16 < r64 && r64 < stall);
        assert!(at("note done") > stall);

        let s = guest_script(
            5,
            Ok(Path::new("/k/kublk")),
            Ok(Path::new("/t/ublkd")),
            Err("building ublkctl failed"),
        );
        for run in [
            "ublkd-recovery-1",
            "ublkd-recovery-16",
            "ublkd-recovery-64",
            "ublkd-stall",
        ] {
            assert!(
                s.contains(&format!("fail_case {run} 'building ublkctl failed'\n")),
                "{run}"
            );
        }
        assert!(!s.contains("rec_case ublkd-recovery") && !s.contains("stall_case ublkd-stall"));
    }

    #[test]
    fn recovery_timings_and_fio_results_parse() {
        assert_eq!(parse_span_ms("1000000000 1012500000\n"), Ok(12.5));
        assert_eq!(parse_span_ms("5 5"), Ok(0.0));
        assert!(parse_span_ms("1012500000 1000000000").is_err_and(|e| e.contains("backwards")));
        assert!(parse_span_ms("1000000000").is_err());
        assert!(parse_span_ms("1000000000 x").is_err());
        assert!(parse_span_ms("1 2 3").is_err());

        // fio 3.33 per-I/O log: time ms, latency ns, direction, block size, offset (and prio).
        let log = "0, 92132, 1, 4096, 0\n3001, 45123456, 1, 4096, 8192\n\
                   3002, 45000000, 1, 4096, 0, 0\n7999, 80000, 1, 4096, 4096\n";
        assert_eq!(parse_clat_log(log), Ok((45.123456, 3001.0, 4)));
        assert!(parse_clat_log("").is_err_and(|e| e.contains("empty")));
        assert!(parse_clat_log("0, lots, 1, 4096, 0\n").is_err());
        assert!(parse_clat_log("garbage\n").is_err());

        let fio = r#"fio: note
{"jobs":[{"error":0,"write":{"total_ios":80000,"clat_ns":{"max":45123456.0}}}]}"#;
        assert_eq!(parse_fio_stall(fio), Ok((0, 45.123456)));
        let bad = r#"{"jobs":[{"error":5,"write":{"clat_ns":{"max":1000000.0}}}]}"#;
        assert_eq!(parse_fio_stall(bad), Ok((5, 1.0)));
        assert!(parse_fio_stall(r#"{"jobs":[]}"#).is_err());
        assert!(parse_fio_stall(r#"{"jobs":[{"error":0,"write":{}}]}"#).is_err());
        assert!(parse_fio_stall("nothing").is_err());

        let list = r#"{
  "volumes": [
    {
      "id": "r001",
      "state": "VOLUME_STATE_READY",
      "io_path_in_use": "IO_PATH_BATCH"
    }
  ]
}"#;
        assert_eq!(io_path_in_use(list).as_deref(), Some("IO_PATH_BATCH"));
        assert_eq!(io_path_in_use(r#"{"volumes": []}"#), None);
        assert_eq!(io_path_in_use("not json"), None);
    }

    fn stall_ok() -> Stall {
        Stall {
            max_ms: Ok(45.5),
            max_at_ms: Some(3010.0),
            ios: Some(80000),
            fio_max_ms: Some(45.5),
            first_write_ms: Some(80.0),
            kill_after_ms: Some(3000.0),
            kill_to_exec_ms: Some(2.0),
            restart_to_ready_ms: Some(30.0),
            kill_to_ready_ms: Some(33.0),
            list_call_ms: Some(9.0),
            io_path: Some("IO_PATH_BATCH".into()),
            teardown: None,
        }
    }

    fn recoveries_ok() -> Vec<Recovery> {
        RECOVERY_VOLUMES
            .iter()
            .map(|&n| Recovery {
                volumes: n,
                ready_ms: Ok(10.0 + n as f64),
                kill_to_exec_ms: Some(3.0),
                list_call_ms: Some(8.0),
                io_path: Some("IO_PATH_BATCH".into()),
                teardown: None,
            })
            .collect()
    }

    #[test]
    fn a_stall_must_span_the_restart() {
        // Killed 3000 ms after the first write; 10 ms from the kill to the new exec.
        assert_eq!(check_stall(35.0, 3030.0, Some(3000.0), Some(10.0)), Ok(()));
        assert_eq!(check_stall(10.0, 3001.0, Some(3000.0), Some(10.0)), Ok(()));
        assert!(check_stall(9.0, 3030.0, Some(3000.0), Some(10.0))
            .is_err_and(|e| e.contains("shorter than the time from the kill")));
        assert!(check_stall(1500.0, 1528.0, Some(3000.0), Some(1000.0))
            .is_err_and(|e| e.contains("before the kill")));
        assert!(check_stall(35.0, 3030.0, None, Some(10.0)).is_err());
        assert!(check_stall(35.0, 3030.0, Some(3000.0), None).is_err());
    }

    #[test]
    fn recovery_entries_are_ms_without_a_peer() {
        let entries = recovery_entries(&recoveries_ok(), &stall_ok());
        let got: Vec<(&str, Option<f64>)> =
            entries.iter().map(|e| (e.case.as_str(), e.ours)).collect();
        assert_eq!(
            got,
            [
                ("ublkd restart to READY, 1 volume", Some(11.0)),
                ("ublkd restart to READY, 16 volumes", Some(26.0)),
                ("ublkd restart to READY, 64 volumes", Some(74.0)),
                ("fio max I/O stall across kill -9", Some(45.5)),
            ]
        );
        assert_eq!(
            entries[3].to_json(),
            json!({"case": "fio max I/O stall across kill -9", "ours": 45.5, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "ms"})
        );
        assert!(entries
            .iter()
            .all(|e| e.error.is_none() && e.unit == Unit::Ms));

        let raw = recovery_raw_json(&recoveries_ok(), &stall_ok());
        assert_eq!(raw.len(), 4);
        assert_eq!(raw[2]["run"], "ublkd-recovery-64");
        assert_eq!(raw[2]["restart_to_ready_ms"], 74.0);
        assert_eq!(raw[3]["run"], "ublkd-stall");
        assert_eq!(raw[3]["max_clat_ms"], 45.5);
        assert_eq!(raw[3]["kill_to_ready_ms"], 33.0);
        assert!(raw.iter().all(|v| v.get("error").is_none()));

        let table = recovery_table(&entries, &recoveries_ok(), &stall_ok());
        assert!(
            table.contains("ublkd restart to READY, 64 volumes"),
            "{table}"
        );
        assert!(table.contains("I/O path: IO_PATH_BATCH."), "{table}");
        assert!(table.contains("33.0 ms after the kill"), "{table}");
        // The median of the four list-volumes calls (8, 8, 8, 9 ms).
        assert!(table.contains("one call took 8 ms here"), "{table}");
        assert_eq!(raw[0]["list_volumes_call_ms"], 8.0);
        assert_eq!(raw[3]["kill_after_first_write_ms"], 3000.0);
    }

    #[test]
    fn recovery_failures_give_null_values_and_an_error() {
        let mut recoveries = recoveries_ok();
        recoveries[1].ready_ms = Err("not all 16 volumes READY within 60 s".into());
        recoveries[2].teardown = Some("delete-volume r007 failed".into());
        let mut stall = stall_ok();
        stall.max_ms = Err("fio saw 3 errors across the restart".into());
        let entries = recovery_entries(&recoveries, &stall);
        assert_eq!(entries[0].error, None);
        assert_eq!(entries[1].ours, None);
        assert!(entries[1]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ublkd: not all 16")));
        // The time stands; the failed teardown marks it.
        assert_eq!(entries[2].ours, Some(74.0));
        assert!(entries[2]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ublkd teardown: delete-volume r007")));
        assert!(entries[3].to_json()["ours"].is_null());
        assert!(entries[3].to_json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("3 errors")));
        let raw = recovery_raw_json(&recoveries, &stall);
        assert!(raw[1]["restart_to_ready_ms"].is_null() && raw[1]["error"].is_string());
        assert!(raw[2]["teardown_error"].is_string());
        assert!(raw[3]["max_clat_ms"].is_null() && raw[3]["error"].is_string());
        let table = recovery_table(&entries, &recoveries, &stall);
        assert!(table.contains("FAILED"), "{table}");
    }

    #[test]
    fn recovery_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-rec-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let r = collect_recovery(&dir);
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| x
            .ready_ms
            .as_ref()
            .is_err_and(|e| e.contains("did not run"))));
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("did not run")));

        let write = |run: &str, name: &str, text: &str| {
            let d = dir.join(run);
            fs::create_dir_all(&d).expect("mkdir");
            fs::write(d.join(name), text).expect("write");
        };
        let list = r#"{"volumes": [{"id": "r001", "io_path_in_use": "IO_PATH_PER_IO"}]}"#;
        write("ublkd-recovery-1", "kill.ns", "990000000\n");
        write("ublkd-recovery-1", "ready.ns", "1000000000 1020000000\n");
        write("ublkd-recovery-1", "poll.ns", "1030000000 1037500000\n");
        write("ublkd-recovery-1", "list.json", list);
        write("ublkd-recovery-16", "ready.ns", "1000000000 1080000000\n");
        write(
            "ublkd-recovery-16",
            "teardown_error",
            "delete-volume r003 failed: x\n/dev/ublkb3 (r003) still exists after the deletes\n",
        );
        write(
            "ublkd-recovery-64",
            "error",
            "a volume FAILED to come back\n",
        );
        write("ublkd-recovery-64", "ready.ns", "1 2\n");
        let r = collect_recovery(&dir);
        assert_eq!(r[0].ready_ms, Ok(20.0));
        assert_eq!(r[0].io_path.as_deref(), Some("IO_PATH_PER_IO"));
        assert_eq!(r[0].teardown, None);
        assert_eq!(
            (r[0].kill_to_exec_ms, r[0].list_call_ms),
            (Some(10.0), Some(7.5))
        );
        assert_eq!((r[1].kill_to_exec_ms, r[1].list_call_ms), (None, None));
        assert_eq!(r[1].ready_ms, Ok(80.0));
        assert!(r[1]
            .teardown
            .as_deref()
            .is_some_and(|t| t.contains("r003 failed: x (and 1 more)")));
        assert!(r[2].ready_ms.as_ref().is_err_and(|e| e.contains("FAILED")));

        let st = "ublkd-stall";
        // fio launched at 1 s, first write at 1.1 s, kill at 4.1 s, exec at 4.11 s, READY at 4.14 s.
        write(st, "times.ns", "1000000000 1100000000\n");
        write(st, "kill.ns", "4100000000\n");
        write(st, "ready.ns", "4110000000 4140000000\n");
        write(st, "list.json", list);
        write(st, "fio.rc", "0\n");
        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":0,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n3030, 35000000, 1, 4096, 0\n",
        );
        let s = collect_stall(&dir);
        assert_eq!(s.max_ms, Ok(35.0));
        assert_eq!((s.max_at_ms, s.ios), (Some(3030.0), Some(2)));
        assert_eq!(s.fio_max_ms, Some(35.0));
        assert_eq!(s.first_write_ms, Some(100.0));
        assert_eq!(s.kill_after_ms, Some(3000.0));
        assert_eq!(s.kill_to_exec_ms, Some(10.0));
        assert_eq!(s.restart_to_ready_ms, Some(30.0));
        assert_eq!(s.kill_to_ready_ms, Some(40.0));
        assert_eq!(s.list_call_ms, None);

        // A log whose longest I/O ended before the kill did not see the stall.
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n1500, 35000000, 1, 4096, 0\n",
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("before the kill")));
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n3030, 35000000, 1, 4096, 0\n",
        );
        assert_eq!(s.io_path.as_deref(), Some("IO_PATH_PER_IO"));

        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":5,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("fio saw 5 errors")));
        write(st, "fio.rc", "1\n");
        write(
            st,
            "fio.log",
            "fio: io_u error on file /dev/ublkb0: Input/output error\n",
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("status 1: fio: io_u error")));
        write(st, "fio.rc", "0\n");
        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":0,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        fs::remove_file(dir.join(st).join("clat.log")).expect("rm");
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("no completion latency log")));
        write(st, "error", "ublkd did not exit within 10 s of kill -9\n");
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("kill -9")));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn script_parses_as_posix_sh() {
        let s = guest_script(
            5,
            Ok(Path::new("/k/kublk")),
            Ok(Path::new("/t/ublkd")),
            Ok(Path::new("/t/ublkctl")),
        );
        let path = std::env::temp_dir().join(format!("ublkd-bench-{}.sh", std::process::id()));
        fs::write(&path, &s).expect("writing the script");
        let out = Command::new("sh").arg("-n").arg(&path).output();
        let _ = fs::remove_file(&path);
        let out = out.expect("running sh -n");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&hundred, 50), Some(50.0));
        assert_eq!(percentile(&hundred, 99), Some(99.0));
        assert_eq!(percentile(&hundred, 100), Some(100.0));
        assert_eq!(percentile(&hundred, 1), Some(1.0));
        // Rank ceil(p/100 * n): 2 of 3 for p50, 3 of 3 for p99.
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50), Some(2.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50), Some(2.0));
        assert_eq!(percentile(&[7.5], 99), Some(7.5));
        assert_eq!(percentile(&[], 50), None);
        assert_eq!(percentile(&[1.0], 0), None);
        assert_eq!(percentile(&[1.0], 101), None);
    }

    #[test]
    fn rss_and_timings_parse() {
        let status = "Name:\tublkd\nVmPeak:\t  123456 kB\nVmHWM:\t   9000 kB\n\
                      VmRSS:\t    8520 kB\nRssAnon:\t    4000 kB\nThreads:\t5\n";
        assert_eq!(parse_vmrss(status), Ok(8520.0));
        assert!(parse_vmrss("Name:\tublkd\n").is_err_and(|e| e.contains("no VmRSS")));
        assert!(parse_vmrss("VmRSS:\t12 MB\n").is_err());
        assert!(parse_vmrss("VmRSS:\tlots kB\n").is_err());
        assert!(parse_vmrss("VmRSS:\t12 kB extra\n").is_err());

        let creates = "v001 /dev/ublkb0 12500000\nv002 /dev/ublkb1 7000000\n";
        assert_eq!(parse_latencies(creates, 2), Ok(vec![12.5, 7.0]));
        assert_eq!(parse_latencies("v001 1500000\n\n", 1), Ok(vec![1.5]));
        assert!(parse_latencies(creates, 3).is_err_and(|e| e.contains("2 of 3 calls")));
        assert!(parse_latencies("v001 /dev/ublkb0 -\n", 1).is_err());
    }

    fn control_ok() -> Control {
        Control {
            rss_empty_kib: Ok(10240.0),
            rss_full_kib: Ok(10240.0 + 100.0 * 48.0),
            create_ms: Ok((1..=100).map(f64::from).collect()),
            delete_ms: Ok((1..=100).map(|x| f64::from(x) / 2.0).collect()),
            scrape_ms: Ok((1..=10).map(f64::from).collect()),
            teardown: None,
        }
    }

    #[test]
    fn control_entries_have_no_peer_and_their_own_units() {
        let entries = control_entries(&control_ok());
        let got: Vec<(&str, Option<f64>, &str)> = entries
            .iter()
            .map(|e| (e.case.as_str(), e.ours, e.unit.name()))
            .collect();
        assert_eq!(
            got,
            [
                ("ublkctl create-volume p50", Some(50.0), "ms"),
                ("ublkctl create-volume p99", Some(99.0), "ms"),
                ("ublkctl delete-volume p50", Some(25.0), "ms"),
                ("ublkctl delete-volume p99", Some(49.5), "ms"),
                ("ublkd RSS, 0 volumes", Some(10.0), "MiB"),
                ("ublkd RSS, 100 idle volumes", Some(14.6875), "MiB"),
                ("ublkd RSS per idle volume", Some(48.0), "KiB"),
                ("GET /metrics, 100 volumes, p50", Some(5.0), "ms"),
                ("GET /metrics, 100 volumes, p100", Some(10.0), "ms"),
            ]
        );
        for e in &entries {
            assert_eq!(
                (e.peer.as_str(), e.peer_value, e.ratio, &e.error),
                ("none", None, None, &None)
            );
        }
        assert_eq!(
            entries[1].to_json(),
            json!({"case": "ublkctl create-volume p99", "ours": 99.0, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "ms"})
        );
        assert_eq!(
            entries[5].to_json(),
            json!({"case": "ublkd RSS, 100 idle volumes", "ours": 14.69, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "MiB"})
        );
        assert_eq!(entries[6].to_json()["unit"], "KiB");

        let raw = control_raw_json(&control_ok());
        assert_eq!(raw["run"], "ublkd-control");
        assert_eq!(raw["volumes"], 100);
        assert_eq!(raw["create_ms"].as_array().map(Vec::len), Some(100));
        assert_eq!(raw["rss_kib_all_volumes"], 15040.0);
        assert!(raw.get("errors").is_none() && raw.get("teardown_error").is_none());
    }

    #[test]
    fn control_failures_give_null_values_and_an_error() {
        let mut c = control_ok();
        c.create_ms = Err("create-volume v007 failed (exit 1): no space".into());
        c.rss_full_kib = Err("not all 100 volumes were created".into());
        c.teardown = Some("exited with status 1 after SIGTERM".into());
        let entries = control_entries(&c);
        assert!(entries.iter().all(|e| e.error.is_some()));
        let create = &entries[0];
        assert_eq!(create.ours, None);
        let err = create.error.as_deref().unwrap_or_default();
        assert!(err.contains("ublkd: create-volume v007 failed"), "{err}");
        assert!(
            err.contains("ublkd teardown: exited with status 1"),
            "{err}"
        );
        let v = create.to_json();
        assert!(v["ours"].is_null() && v["peer_value"].is_null() && v["ratio"].is_null());
        assert_eq!((&v["peer"], &v["unit"]), (&json!("none"), &json!("ms")));
        assert!(v["error"].is_string());
        // RSS with no volumes stands (only the teardown marks it); per volume needs both.
        assert_eq!(entries[4].ours, Some(10.0));
        assert_eq!(entries[6].ours, None);

        let raw = control_raw_json(&c);
        assert!(raw["create_ms"].is_null());
        assert!(raw["errors"]["create_ms"].is_string());
        assert!(raw["teardown_error"].is_string());

        let table = control_table(&entries);
        assert!(table.contains("FAILED"), "{table}");
        assert!(table.contains("including its start-up"), "{table}");
    }

    #[test]
    fn control_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-ctl-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        assert!(collect_control(&dir)
            .create_ms
            .is_err_and(|e| e.contains("did not run")));

        let d = dir.join(CONTROL_RUN);
        fs::create_dir_all(&d).expect("mkdir");
        let write = |name: &str, text: &str| fs::write(d.join(name), text).expect("write");
        let mut creates = String::new();
        let mut deletes = String::new();
        for k in 1..=CONTROL_VOLUMES {
            creates += &format!("v{k:03} /dev/ublkb{} {}\n", k - 1, k * 1_000_000);
            deletes += &format!("v{k:03} {}\n", k * 500_000);
        }
        write("status.0", "VmRSS:\t  8192 kB\n");
        write("status.full", "VmRSS:\t 13192 kB\n");
        write("create.ns", &creates);
        write("delete.ns", &deletes);
        let c = collect_control(&dir);
        assert_eq!(c.rss_empty_kib, Ok(8192.0));
        assert_eq!(c.rss_full_kib, Ok(13192.0));
        assert_eq!(c.create_ms.as_ref().map(Vec::len), Ok(CONTROL_VOLUMES));
        assert_eq!(c.delete_ms.as_ref().map(|v| v[1]), Ok(1.0));
        assert_eq!(c.teardown, None);
        assert_eq!(control_entries(&c)[6].ours, Some(50.0));

        write(
            "delete_error",
            "/dev/ublkb3 still exists after delete-volume v004 returned\n\
             /dev/ublkb4 still exists after delete-volume v005 returned\n",
        );
        write(
            "teardown_error",
            "did not exit within 30 s of SIGTERM (killed)\n",
        );
        let c = collect_control(&dir);
        assert!(c
            .delete_ms
            .is_err_and(|e| e.contains("v004 returned (and 1 more)")));
        assert!(c.teardown.is_some_and(|t| t.contains("SIGTERM")));

        write(
            "create_error",
            "create-volume v100 failed (exit 3): unreachable\n",
        );
        let c = collect_control(&dir);
        assert!(c.create_ms.is_err_and(|e| e.contains("v100 failed")));
        assert!(c.rss_full_kib.is_err_and(|e| e.contains("not all 100")));
        assert_eq!(c.rss_empty_kib, Ok(8192.0));

        write(
            "error",
            "ublkd exited with status 1 before its socket answered: bad config\n",
        );
        let c = collect_control(&dir);
        assert!(c.rss_empty_kib.is_err_and(|e| e.contains("bad config")));
        let _ = fs::remove_dir_all(&dir);
    }
}
