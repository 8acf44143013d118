//! What the bench measures: the server setups (`RUNS`), the fio jobs run against each
//! (`WORKLOADS`), the comparisons reported (`PAIRS`, `RSS_PAIRS`), and the settings of the
//! control-plane, QoS, snapshot, recovery and stall runs.

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

/// The control-plane run: its directory under the run directory and its name in `raw.json`.
pub const CONTROL_RUN: &str = "ublkd-control";
/// Volumes the control-plane run creates and deletes.
pub const CONTROL_VOLUMES: usize = 100;
/// Each of them: a null volume of this size, one queue (the server's default) of this depth.
pub const CONTROL_SIZE: &str = "64MiB";
pub const CONTROL_DEPTH: u32 = 32;
/// Where the control-plane daemon serves metrics (the bench never scrapes them).
pub const CONTROL_METRICS: &str = "127.0.0.1:9581";
/// Creates and deletes timed again while fio keeps the workers busy (a command's round trip to
/// a loaded worker).
pub const CONTROL_LOAD_CALLS: usize = 20;
/// Guest seconds budgeted for the control-plane run (240 ublkctl calls under TCG, with margin).
pub const CONTROL_BUDGET_SECS: u64 = 360;

/// The CSI run: `ublkd-csi` in front of a ublkd, driven as the provisioner and kubelet would.
pub const CSI_RUN: &str = "ublkd-csi";
/// Volumes timed from CreateVolume to a published, mounted file system, per file system.
pub const CSI_VOLUMES: usize = 50;
/// Volumes staged one at a time, and as many again staged all at once.
pub const CSI_PARALLEL: usize = 20;
/// Where the CSI run's daemon serves metrics (never scraped).
pub const CSI_METRICS: &str = "127.0.0.1:9583";
/// Guest seconds budgeted for the CSI run (100 volumes to mounted and back, 40 stages, mkfs).
pub const CSI_BUDGET_SECS: u64 = 600;

/// The recovery runs: `ublkd-recovery-N` for each number of volumes N, restarted by kill -9.
const RECOVERY_RUN: &str = "ublkd-recovery";
pub const RECOVERY_VOLUMES: [usize; 3] = [1, 16, 64];
/// Each of them a null volume like the control-plane run's: this size, 1 queue of this depth.
pub const RECOVERY_SIZE: &str = CONTROL_SIZE;
pub const RECOVERY_DEPTH: u32 = CONTROL_DEPTH;
/// The I/O stall run: fio on one RAM volume of this size while ublkd is killed and restarted.
pub const STALL_RUN: &str = "ublkd-stall";
pub const STALL_SIZE: &str = "128MiB";
/// Seconds fio runs, and seconds after the device's first write that ublkd is killed.
pub const STALL_RUNTIME_SECS: u64 = 8;
pub const STALL_KILL_AT_SECS: u64 = 3;
/// Where the recovery and stall daemons serve metrics (never scraped).
pub const RECOVERY_METRICS: &str = "127.0.0.1:9582";
/// Guest seconds budgeted for the recovery and stall runs (162 ublkctl calls, 4 daemons, 2
/// restarts each, fio), with margin for TCG.
pub const RECOVERY_BUDGET_SECS: u64 = 400;

/// The QoS run: `ublkd --config` with one null volume per entry of `QOS_JOBS` (each limit set at
/// CreateVolume), measured by fio and deleted before the next.
pub const QOS_RUN: &str = "ublkd-qos";
pub const QOS_SIZE: &str = "1GiB";
/// fio's depth for every QoS job: enough waiters that the limit, not the client, sets the pace.
pub const QOS_QD: u32 = 32;
/// Seconds each QoS job measures, after one second of ramp that the burst allowance (the
/// daemon's default, 100 ms of the limit) falls into. Fixed, unlike the fio cases' runtime, so
/// that accuracy compares from run to run.
pub const QOS_RUNTIME_SECS: u64 = 5;
/// Where the QoS run's daemon serves metrics (never scraped).
pub const QOS_METRICS: &str = "127.0.0.1:9584";
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
    /// Its case in `results.json`, its volume id and its files' names in the run directory.
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

/// In the order they run: the ceiling first, then IOPS limits below and near it, then bandwidth.
pub const QOS_JOBS: &[QosJob] = &[
    QosJob {
        limit: QosLimit::Unlimited,
        rw: "randread",
        bs: "4k",
    },
    QosJob {
        limit: QosLimit::ReadIops(1000),
        rw: "randread",
        bs: "4k",
    },
    QosJob {
        limit: QosLimit::ReadIops(5000),
        rw: "randread",
        bs: "4k",
    },
    QosJob {
        limit: QosLimit::ReadIops(20000),
        rw: "randread",
        bs: "4k",
    },
    QosJob {
        limit: QosLimit::WriteMibps(8),
        rw: "randwrite",
        bs: "64k",
    },
    QosJob {
        limit: QosLimit::WriteMibps(32),
        rw: "randwrite",
        bs: "64k",
    },
];

/// The snapshot run: file volumes on an XFS made with reflink=1 (a loop device over a sparse
/// file in the guest's tmpfs), snapshotted and cloned.
pub const SNAPSHOT_RUN: &str = "ublkd-snapshot";
/// Sizes (GiB) of the volumes snapshotted: the times must not grow with them.
pub const SNAPSHOT_GIB: [u64; 2] = [1, 16];
/// Size of that XFS (GiB): room for the largest volume in full, though only `SNAPSHOT_FILL_MIB`
/// of each is written (the image file is sparse, and tmpfs holds only what is written).
pub const SNAPSHOT_FS_GIB: u64 = 20;
/// MiB fio writes into each volume before its snapshots (randwrite 64 KiB across the whole
/// volume), so that the backing file has thousands of extents for the reflink to share.
pub const SNAPSHOT_FILL_MIB: u64 = 256;
/// Snapshots, and clones of them, per size (each timed; the median is reported); also the
/// `ublkctl node-info` calls timed as the floor of a call.
pub const SNAPSHOT_REPEATS: usize = 3;
/// Where the snapshot run's daemon serves metrics (never scraped).
pub const SNAPSHOT_METRICS: &str = "127.0.0.1:9585";
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
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
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Build {
    /// The one measured: the working tree's release build (or `UBLKD_BENCH_UBLKD`).
    New,
    /// `--baseline REV`'s.
    Baseline,
}

/// With `--baseline`, every ublkd run happens four times in a row, so that a drift over the boot
/// falls on both builds alike: each entry is the suffix of that run's directory (the run's id,
/// then the suffix) and the build that served it. The order is A B B A for the even-numbered
/// ublkd cases and B A A B for the odd ones ([`ab_order`]), and a short discarded warm-up
/// ([`WARMUP_SUFFIX`]) comes before each group: an A/A run (the same binary on both sides)
/// read the first run of a group 13-17 % slow, which A B B A alone puts on A every time.
pub const ABBA: [(&str, Build); 4] = [
    ("", Build::New),
    ("~base", Build::Baseline),
    ("~base2", Build::Baseline),
    ("~2", Build::New),
];

/// The suffix of the warm-up run before each A/B group: one fio job, never collected.
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
#[derive(Debug, Clone, Default)]
pub struct Plan {
    /// `--only SUBSTR[,SUBSTR...]`: only the fio runs whose id contains one of them, and none
    /// of the sections after them (control plane, CSI, QoS, snapshots, recovery).
    pub only: Option<String>,
    /// `--baseline REV`: the baseline's label (its commit) and its ublkd binary.
    pub baseline: Option<(String, std::path::PathBuf)>,
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
pub const RUNS: &[Run] = &[
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

pub const WORKLOADS: &[Workload] = &[
    Workload {
        id: "randread-qd32",
        bs: "4k",
        label: "randread qd32",
        rw: "randread",
        qd: 32,
        jobs: 1,
        metric: Metric::Iops,
    },
    // More submitters than CPUs on one 2-queue device: the shape of a busy node.
    Workload {
        id: "randread-qd32-4jobs",
        bs: "4k",
        label: "randread qd32 x4 jobs",
        rw: "randread",
        qd: 32,
        jobs: 4,
        metric: Metric::Iops,
    },
    Workload {
        id: "randwrite-qd32",
        bs: "4k",
        label: "randwrite qd32",
        rw: "randwrite",
        qd: 32,
        jobs: 1,
        metric: Metric::Iops,
    },
    Workload {
        id: "randread-qd1",
        bs: "4k",
        label: "randread qd1",
        rw: "randread",
        qd: 1,
        jobs: 1,
        metric: Metric::LatencyUs,
    },
    // Beyond 4 KiB: where the kernel's copy, not the server's work per request, is the cost.
    Workload {
        id: "randread-128k-qd32",
        bs: "128k",
        label: "randread 128k qd32",
        rw: "randread",
        qd: 32,
        jobs: 1,
        metric: Metric::Iops,
    },
    Workload {
        id: "randrw-64k-qd32",
        bs: "64k",
        label: "randrw 70/30 64k qd32",
        rw: "randrw",
        qd: 32,
        jobs: 1,
        metric: Metric::Iops,
    },
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

pub const PAIRS: &[Pair] = &[
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
pub const CEILING_RUN: &str = "null_blk";
pub const OURS_NAME: &str = "ublkd";
/// The peer of a measurement that has none (the control-plane entries).
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

/// The run directory name of the recovery run with `n` volumes.
pub fn recovery_run(n: usize) -> String {
    format!("{RECOVERY_RUN}-{n}")
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
