//! What the bench measures: the server setups (`RUNS`), the fio jobs run against each
//! (`WORKLOADS`), the comparisons reported (`PAIRS`, `RSS_PAIRS`), what one bench covers
//! (`Plan`), and the settings of the node service's sections.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// Default seconds each fio job measures (after one second of ramp).
pub const DEFAULT_RUNTIME: u64 = 5;
/// Size of ublkd's null device.
pub const NULL_BYTES: u64 = 1 << 30;
/// Size of the backing file shared by ublkd's file backend and the loop device. It lives on an
/// ext4 file system on the guest's NVMe namespace (1 GiB), so it must leave room for metadata.
pub const BACKING_BYTES: u64 = 512 << 20;
/// Queues and depth of every ublk device, ours and kublk's.
pub const QUEUES: u32 = 2;
pub const DEPTH: u32 = 128;

/// Where each node-service section's daemon serves metrics (only the control plane's is
/// scraped); one each, so that no section waits for the last one's port.
pub const CONTROL_METRICS: &str = "127.0.0.1:9581";
pub const RECOVERY_METRICS: &str = "127.0.0.1:9582";
pub const CSI_METRICS: &str = "127.0.0.1:9583";
pub const QOS_METRICS: &str = "127.0.0.1:9584";
pub const SNAPSHOT_METRICS: &str = "127.0.0.1:9585";

/// The control-plane run: its name, the volumes it creates and deletes (null, of this size, one
/// queue of this depth), the creates and deletes timed again while fio keeps the workers busy
/// (a command's round trip to a loaded worker), the scrapes of /metrics timed.
pub const CONTROL_RUN: &str = "ublkd-control";
pub const CONTROL_VOLUMES: usize = 100;
pub const CONTROL_SIZE: &str = "64MiB";
pub const CONTROL_DEPTH: u32 = 32;
pub const CONTROL_LOAD_CALLS: usize = 20;
pub const CONTROL_SCRAPES: usize = 10;
/// Guest seconds budgeted for the control-plane run (240 ublkctl calls under TCG, with margin).
pub const CONTROL_BUDGET_SECS: u64 = 360;

/// The CSI run: `ublkd-csi` in front of a ublkd, driven as the provisioner and kubelet would;
/// volumes timed from CreateVolume to a published, mounted file system, per file system; volumes
/// staged one at a time, and as many again staged all at once.
pub const CSI_RUN: &str = "ublkd-csi";
pub const CSI_VOLUMES: usize = 50;
pub const CSI_PARALLEL: usize = 20;
/// Guest seconds budgeted for the CSI run (100 volumes to mounted and back, 40 stages, mkfs).
pub const CSI_BUDGET_SECS: u64 = 600;

/// The recovery runs, `ublkd-recovery-N` for each number of volumes N (null volumes like the
/// control-plane run's), restarted by kill -9.
pub const RECOVERY_VOLUMES: [usize; 3] = [1, 16, 64];
/// The I/O stall run: fio on one RAM volume of this size for `STALL_RUNTIME_SECS`, ublkd killed
/// and restarted `STALL_KILL_AT_SECS` after the device's first write.
pub const STALL_RUN: &str = "ublkd-stall";
pub const STALL_SIZE: &str = "128MiB";
pub const STALL_RUNTIME_SECS: u64 = 8;
pub const STALL_KILL_AT_SECS: u64 = 3;
/// Guest seconds budgeted for the recovery and stall runs (162 ublkctl calls, 4 daemons, 2
/// restarts each, fio), with margin for TCG.
pub const RECOVERY_BUDGET_SECS: u64 = 400;

/// The QoS run: one null volume of `QOS_SIZE` per entry of `QOS_JOBS` (each limit set at
/// CreateVolume), fio at `QOS_QD` on it for `QOS_RUNTIME_SECS` after one second of ramp that
/// the burst allowance (100 ms of the limit) falls into; fixed, so that accuracy compares from
/// run to run.
pub const QOS_RUN: &str = "ublkd-qos";
pub const QOS_SIZE: &str = "1GiB";
pub const QOS_QD: u32 = 32;
pub const QOS_RUNTIME_SECS: u64 = 5;
/// Guest seconds budgeted for the QoS run: six fio jobs of 6 s, their volumes, and margin.
pub const QOS_BUDGET_SECS: u64 = 240;

/// Which limit a QoS job sets, and so which of fio's numbers it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosLimit {
    /// No limit: the ceiling of this setup, to read the others against.
    Unlimited,
    /// `--read-iops N`, measured as read IOPS.
    ReadIops(u64),
    /// `--write-bw N MiB/s`, measured as write MiB/s.
    WriteMibps(u64),
}

/// One QoS job: a null volume with `limit`, fio `rw` at `bs` on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QosJob {
    pub limit: QosLimit,
    pub rw: &'static str,
    pub bs: &'static str,
}

impl QosJob {
    /// Its case in `results.json` and its volume's id.
    pub fn id(&self) -> String {
        match self.limit {
            QosLimit::Unlimited => format!("qos-{}-unlimited", self.rw),
            QosLimit::ReadIops(n) => format!("qos-read-iops-{n}"),
            QosLimit::WriteMibps(n) => format!("qos-write-bw-{n}mibps"),
        }
    }

    /// The `ublkctl create-volume` flags that set its limit.
    pub fn flags(&self) -> String {
        match self.limit {
            QosLimit::Unlimited => String::new(),
            QosLimit::ReadIops(n) => format!("--read-iops {n}"),
            QosLimit::WriteMibps(n) => format!("--write-bw {n}MiB/s"),
        }
    }

    /// The limit as a number in the unit fio's figure is read in (IOPS or MiB/s).
    pub fn limit_value(&self) -> Option<f64> {
        match self.limit {
            QosLimit::Unlimited => None,
            QosLimit::ReadIops(n) | QosLimit::WriteMibps(n) => Some(n as f64),
        }
    }
}

const fn qos(limit: QosLimit, rw: &'static str, bs: &'static str) -> QosJob {
    QosJob { limit, rw, bs }
}

/// In the order they run: the ceiling first, then IOPS limits below and near it, then bandwidth.
pub const QOS_JOBS: &[QosJob] = &[
    qos(QosLimit::Unlimited, "randread", "4k"),
    qos(QosLimit::ReadIops(1000), "randread", "4k"),
    qos(QosLimit::ReadIops(5000), "randread", "4k"),
    qos(QosLimit::ReadIops(20000), "randread", "4k"),
    qos(QosLimit::WriteMibps(8), "randwrite", "64k"),
    qos(QosLimit::WriteMibps(32), "randwrite", "64k"),
];

/// The snapshot run: file volumes of each size in `SNAPSHOT_GIB` (the times must not grow with
/// it) on an XFS of `SNAPSHOT_FS_GIB` made with reflink=1 (a loop device over a sparse file in
/// the guest's tmpfs), each with `SNAPSHOT_FILL_MIB` written by fio (randwrite 64 KiB across the
/// volume, thousands of extents for the reflink to share), then `SNAPSHOT_REPEATS` snapshots and
/// clones timed (the median reported), and as many `ublkctl node-info` calls as the floor.
pub const SNAPSHOT_RUN: &str = "ublkd-snapshot";
pub const SNAPSHOT_GIB: [u64; 2] = [1, 16];
pub const SNAPSHOT_FS_GIB: u64 = 20;
pub const SNAPSHOT_FILL_MIB: u64 = 256;
pub const SNAPSHOT_REPEATS: usize = 3;
/// Guest seconds budgeted for the snapshot run: mkfs, 512 MiB written, 14 volumes, margin.
pub const SNAPSHOT_BUDGET_SECS: u64 = 300;

/// What serves the block device in one run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
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
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UBackend {
    Null,
    File,
    /// The whole guest namespace, `/dev/ng0n1`.
    Nvme,
}

/// One server setup, measured with every workload.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub id: &'static str,
    pub server: Server,
}

impl Run {
    /// A run of ublkd's, which `--baseline` repeats with the baseline's binary.
    pub fn is_ublkd(&self) -> bool {
        matches!(self.server, Server::Ublkd { .. })
    }
}

/// Which ublkd binary served a run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Build {
    /// The one measured: the working tree's release build (or `UBLKD_BENCH_UBLKD`).
    New,
    /// `--baseline REV`'s.
    Baseline,
}

/// With `--baseline`, every ublkd run happens four times in a row, so that a drift over the boot
/// falls on both builds alike: each entry is the suffix of that run's name (the run's id, then
/// the suffix) and the build that served it. The order is A B B A for the even-numbered ublkd
/// cases and B A A B for the odd ones ([`ab_order`]), and a short discarded warm-up
/// ([`WARMUP_SUFFIX`]) comes before each group: an A/A run (the same binary on both sides)
/// read the first run of a group 13-17 % slow, which A B B A alone puts on A every time.
pub const ABBA: [(&str, Build); 4] = [
    ("", Build::New),
    ("~base", Build::Baseline),
    ("~base2", Build::Baseline),
    ("~2", Build::New),
];

/// The suffix of the warm-up run before each A/B group: one fio job, never reported.
pub const WARMUP_SUFFIX: &str = "~warm";

/// The order the `n`th ublkd case (counted from 0) runs its builds in: [`ABBA`] when `n` is even,
/// B A A B when it is odd.
pub fn ab_order(n: usize) -> [(&'static str, Build); 4] {
    if n % 2 == 0 {
        ABBA
    } else {
        [ABBA[1], ABBA[0], ABBA[3], ABBA[2]]
    }
}

/// What one `cargo xtask bench` covers beyond the defaults.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Plan {
    /// `--only SUBSTR[,SUBSTR...]`: only the fio runs whose id contains one of them, and none
    /// of the sections after them (control plane, CSI, QoS, snapshots, recovery).
    pub only: Option<String>,
    /// `--baseline REV`: the baseline's label (its commit) and its ublkd binary.
    pub baseline: Option<(String, PathBuf)>,
}

impl Plan {
    pub fn selected(&self, run_id: &str) -> bool {
        self.only.as_deref().is_none_or(|s| {
            s.split(',')
                .any(|part| !part.is_empty() && run_id.contains(part))
        })
    }

    /// Whether the sections after the fio runs happen.
    pub fn sections(&self) -> bool {
        self.only.is_none()
    }

    /// Whether `run` happens A B B A against the baseline.
    pub fn ab(&self, run: &Run) -> bool {
        self.baseline.is_some() && run.is_ublkd()
    }
}

const fn run(id: &'static str, server: Server) -> Run {
    Run { id, server }
}

const fn ublkd(backend: UBackend, io_path: &'static str, zero_copy: bool, poll: bool) -> Server {
    Server::Ublkd {
        backend,
        io_path,
        zero_copy,
        poll,
    }
}

const fn kublk(batch: bool, auto_zc: bool) -> Server {
    Server::Kublk { batch, auto_zc }
}

/// In the order they run; each of ours next to its peer so that drift affects both alike.
pub const RUNS: &[Run] = {
    use UBackend::{File, Null, Nvme};
    &[
        run("null_blk", Server::NullBlk),
        run("ublkd-null-per-io", ublkd(Null, "per-io", false, false)),
        run("kublk-null", kublk(false, false)),
        run("ublkd-null-batch", ublkd(Null, "batch", false, false)),
        run("kublk-null-batch", kublk(true, false)),
        run("ublkd-null-per-io-zc", ublkd(Null, "per-io", true, false)),
        run("kublk-null-zc", kublk(false, true)),
        run("ublkd-null-batch-zc", ublkd(Null, "batch", true, false)),
        run("kublk-null-batch-zc", kublk(true, true)),
        run("ublkd-file", ublkd(File, "per-io", true, false)),
        run("loop-dio", Server::Loop),
        run("ublkd-file-copy", ublkd(File, "per-io", false, false)),
        run("ublkd-nvme-poll", ublkd(Nvme, "batch", true, true)),
        run("fio-ng0n1-passthru", Server::RawNvme { passthru: true }),
        run("fio-nvme0n1-hipri", Server::RawNvme { passthru: false }),
        run("ublkd-nvme-irq", ublkd(Nvme, "batch", true, false)),
    ]
};

/// What a workload reports as its headline number.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Metric {
    Iops,
    LatencyUs,
}

/// One fio job, run against every device.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub id: &'static str,
    pub label: &'static str,
    /// fio's `rw`; `randrw` is mixed 70 % reads, 30 % writes (IOPS of both counted).
    pub rw: &'static str,
    /// fio's `bs`.
    pub bs: &'static str,
    /// Depth per fio job.
    pub qd: u32,
    /// fio jobs (processes), reported together (`--group_reporting`).
    pub jobs: u32,
    pub metric: Metric,
}

const fn wl(id: &'static str, label: &'static str, rw: &'static str, bs: &'static str) -> Workload {
    Workload {
        id,
        label,
        rw,
        bs,
        qd: 32,
        jobs: 1,
        metric: Metric::Iops,
    }
}

pub const WORKLOADS: &[Workload] = &[
    wl("randread-qd32", "randread qd32", "randread", "4k"),
    // More submitters than CPUs on one 2-queue device: the shape of a busy node.
    Workload {
        jobs: 4,
        ..wl(
            "randread-qd32-4jobs",
            "randread qd32 x4 jobs",
            "randread",
            "4k",
        )
    },
    wl("randwrite-qd32", "randwrite qd32", "randwrite", "4k"),
    Workload {
        qd: 1,
        metric: Metric::LatencyUs,
        ..wl("randread-qd1", "randread qd1", "randread", "4k")
    },
    // Beyond 4 KiB: where the kernel's copy, not the server's work per request, is the cost.
    wl(
        "randread-128k-qd32",
        "randread 128k qd32",
        "randread",
        "128k",
    ),
    wl("randrw-64k-qd32", "randrw 70/30 64k qd32", "randrw", "64k"),
];

/// One comparison: our run against a peer's, optionally with server CPU and the null_blk ceiling.
#[derive(Debug, Clone, Copy)]
pub struct Pair {
    pub case: &'static str,
    pub ours: &'static str,
    pub peer: &'static str,
    pub peer_name: &'static str,
    /// The peer is a userspace process whose CPU time can be compared with ours.
    pub cpu: bool,
    /// Report both as fractions of null_blk's IOPS.
    pub ceiling: bool,
}

const fn pair(
    case: &'static str,
    (ours, peer): (&'static str, &'static str),
    peer_name: &'static str,
    cpu: bool,
    ceiling: bool,
) -> Pair {
    Pair {
        case,
        ours,
        peer,
        peer_name,
        cpu,
        ceiling,
    }
}

const POLL: &str = "ublkd-nvme-poll";

pub const PAIRS: &[Pair] = &[
    pair(
        "null per-io",
        ("ublkd-null-per-io", "kublk-null"),
        "kublk",
        true,
        true,
    ),
    pair(
        "null batch",
        ("ublkd-null-batch", "kublk-null-batch"),
        "kublk",
        true,
        true,
    ),
    pair(
        "null per-io zero copy",
        ("ublkd-null-per-io-zc", "kublk-null-zc"),
        "kublk --auto_zc",
        true,
        true,
    ),
    pair(
        "null batch zero copy",
        ("ublkd-null-batch-zc", "kublk-null-batch-zc"),
        "kublk -b --auto_zc",
        true,
        true,
    ),
    pair("file", ("ublkd-file", "loop-dio"), "loop", false, false),
    pair(
        "file zero copy vs copy",
        ("ublkd-file", "ublkd-file-copy"),
        "ublkd copy",
        true,
        false,
    ),
    pair(
        "nvme polled zc vs ng0n1 passthru",
        (POLL, "fio-ng0n1-passthru"),
        "fio ng0n1",
        false,
        false,
    ),
    pair(
        "nvme polled zc vs nvme0n1 hipri",
        (POLL, "fio-nvme0n1-hipri"),
        "fio nvme0n1",
        false,
        false,
    ),
    pair(
        "nvme polled vs interrupt",
        (POLL, "ublkd-nvme-irq"),
        "ublkd irq",
        true,
        false,
    ),
];
pub const CEILING_RUN: &str = "null_blk";
pub const OURS_NAME: &str = "ublkd";
/// The peer of a measurement that has none (the node service's entries).
pub const NO_PEER: &str = "none";

/// Zero copy against copy in daemon memory: `ublkd run` RSS with its one volume idle (2 queues
/// of depth 128), ours = zero copy, peer = copy.
pub const RSS_PAIRS: &[(&str, &str, &str)] = &[
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

/// The name of the recovery run with `n` volumes.
pub fn recovery_run(n: usize) -> String {
    format!("ublkd-recovery-{n}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--only a,b` selects the runs that either names, as `--only a` and `--only b` would
    /// together: the file volume and loop in one boot.
    #[test]
    fn several_only_substrings_select_the_union() {
        let plan = |only: &str| Plan {
            only: Some(only.into()),
            baseline: None,
        };
        let picked = |p: &Plan| -> Vec<&str> {
            RUNS.iter()
                .filter(|r| p.selected(r.id))
                .map(|r| r.id)
                .collect()
        };
        assert_eq!(
            picked(&plan("ublkd-file,loop-dio")),
            ["ublkd-file", "loop-dio", "ublkd-file-copy"]
        );
        assert_eq!(picked(&plan("loop-dio")), ["loop-dio"]);
        assert!(picked(&plan(",")).is_empty());
        assert!(!plan("x").sections());
    }
}
