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

/// Guest seconds budgeted for the sections, with margin for TCG: the control plane (240 ublkctl
/// calls), CSI (100 volumes to mounted and back, 40 stages, mkfs), QoS (six fio jobs of 6 s),
/// snapshots (mkfs, 512 MiB written, 14 volumes), recovery and the stall (162 ublkctl calls, 4
/// daemons, 2 restarts each, fio).
pub const SECTIONS_BUDGET_SECS: u64 = 360 + 600 + 240 + 300 + 400;

/// The control-plane run: its name, the volumes it creates and deletes (null, of this size, one
/// queue of this depth), the creates and deletes timed again while fio keeps the workers busy
/// (a command's round trip to a loaded worker), the scrapes of /metrics timed.
pub const CONTROL_RUN: &str = "ublkd-control";
pub const CONTROL_VOLUMES: usize = 100;
pub const CONTROL_SIZE: &str = "64MiB";
pub const CONTROL_DEPTH: u32 = 32;
pub const CONTROL_LOAD_CALLS: usize = 20;
pub const CONTROL_SCRAPES: usize = 10;

/// The CSI run: `ublkd-csi` in front of a ublkd, driven as the provisioner and kubelet would;
/// volumes timed from CreateVolume to a published, mounted file system, per file system; volumes
/// staged one at a time, and as many again staged all at once.
pub const CSI_RUN: &str = "ublkd-csi";
pub const CSI_VOLUMES: usize = 50;
pub const CSI_PARALLEL: usize = 20;

/// The recovery runs, `ublkd-recovery-N` for each number of volumes N (null volumes like the
/// control-plane run's), restarted by kill -9.
pub const RECOVERY_VOLUMES: [usize; 3] = [1, 16, 64];
/// The I/O stall run: fio on one RAM volume of this size for `STALL_RUNTIME_SECS`, ublkd killed
/// and restarted `STALL_KILL_AT_SECS` after the device's first write.
pub const STALL_RUN: &str = "ublkd-stall";
pub const STALL_SIZE: &str = "128MiB";
pub const STALL_RUNTIME_SECS: u64 = 8;
pub const STALL_KILL_AT_SECS: u64 = 3;

/// The name of the recovery run with `n` volumes.
pub fn recovery_run(n: usize) -> String {
    format!("ublkd-recovery-{n}")
}

/// The QoS run: one null volume of `QOS_SIZE` per limit of `QOS_JOBS` (set at CreateVolume), fio
/// at `QOS_QD` on it for `QOS_RUNTIME_SECS` after one second of ramp that the burst allowance
/// (100 ms of the limit) falls into; fixed, so that accuracy compares from run to run.
pub const QOS_RUN: &str = "ublkd-qos";
pub const QOS_SIZE: &str = "1GiB";
pub const QOS_QD: u32 = 32;
pub const QOS_RUNTIME_SECS: u64 = 5;

/// The limit of one QoS job, and so its fio job and the figure read: randread 4k IOPS against
/// `--read-iops N`, randwrite 64k MiB/s against `--write-bw N MiB/s`. `Unlimited` (randread) is
/// the ceiling of this setup, to read the others against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QosLimit {
    Unlimited,
    ReadIops(u64),
    WriteMibps(u64),
}

impl QosLimit {
    /// Its case in `results.json` and its volume's id.
    pub fn id(self) -> String {
        match self {
            QosLimit::Unlimited => "qos-randread-unlimited".into(),
            QosLimit::ReadIops(n) => format!("qos-read-iops-{n}"),
            QosLimit::WriteMibps(n) => format!("qos-write-bw-{n}mibps"),
        }
    }

    /// The `ublkctl create-volume` flags that set it.
    pub fn flags(self) -> String {
        match self {
            QosLimit::Unlimited => String::new(),
            QosLimit::ReadIops(n) => format!("--read-iops {n}"),
            QosLimit::WriteMibps(n) => format!("--write-bw {n}MiB/s"),
        }
    }

    /// fio's `rw` and `bs`.
    pub fn fio(self) -> (&'static str, &'static str) {
        match self {
            QosLimit::WriteMibps(_) => ("randwrite", "64k"),
            QosLimit::Unlimited | QosLimit::ReadIops(_) => ("randread", "4k"),
        }
    }

    /// The limit in the unit fio's figure is read in (IOPS or MiB/s).
    pub fn value(self) -> Option<f64> {
        match self {
            QosLimit::Unlimited => None,
            QosLimit::ReadIops(n) | QosLimit::WriteMibps(n) => Some(n as f64),
        }
    }
}

/// In the order they run: the ceiling first, then IOPS limits below and near it, then bandwidth.
pub const QOS_JOBS: [QosLimit; 6] = {
    use QosLimit::{ReadIops, Unlimited, WriteMibps};
    [
        Unlimited,
        ReadIops(1000),
        ReadIops(5000),
        ReadIops(20000),
        WriteMibps(8),
        WriteMibps(32),
    ]
};

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
    /// `kublk add`, with `-b` (BATCH_IO) when `batch`, `--auto_zc` when `auto_zc`: `-t null`,
    /// or `-t loop` over the backing file (`File`) or the namespace `/dev/nvme0n1` (`Nvme`).
    Kublk {
        backend: UBackend,
        batch: bool,
        auto_zc: bool,
    },
    /// A linear device-mapper volume over the whole namespace, as an LVM logical volume
    /// (TopoLVM, LocalPV-LVM) is: the kernel's own path, fio with io_uring.
    DmLinear,
    /// The loop driver with direct I/O on the backing file.
    Loop,
    /// The kernel's null_blk (`/dev/nullb0`, loaded at boot).
    NullBlk,
    /// `ublkd-file`'s setup with a LUKS2 dm-crypt mapping on its device, opened as the CSI
    /// driver opens an `encryption: luks2` volume (ublkd_csi::crypt): fio on the mapping.
    Luks2File,
    /// fio straight on the NVMe namespace, polled: NVMe passthrough on `/dev/ng0n1`
    /// (io_uring_cmd, hipri, fixed buffers: the limit), or io_uring on `/dev/nvme0n1` (hipri).
    RawNvme { passthru: bool },
}

/// The backend of a `ublkd run`; `Nvme` is the whole guest namespace, `/dev/ng0n1`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum UBackend {
    Null,
    File,
    Nvme,
}

/// One server setup, measured with every workload.
#[derive(Debug, Clone, Copy)]
pub struct Run {
    pub id: &'static str,
    pub server: Server,
}

/// Which ublkd binary served a run: the one measured (the working tree's release build, or
/// `UBLKD_BENCH_UBLKD`), or `--baseline REV`'s.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Build {
    New,
    Baseline,
}

/// With `--baseline`, every ublkd run happens four times in a row, so that a drift over the boot
/// falls on both builds alike: each entry is the suffix of that run's name and the build that
/// served it; A B B A for the even-numbered ublkd cases, B A A B for the odd ones
/// ([`ab_order`]), after a discarded warm-up ([`WARMUP_SUFFIX`]): docs/performance.md, "An A/A
/// run of `--baseline`".
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
    match n % 2 {
        0 => ABBA,
        _ => [ABBA[1], ABBA[0], ABBA[3], ABBA[2]],
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

    /// Whether `run` happens A B B A against the baseline: a run of ublkd's, with a baseline.
    pub fn ab(&self, run: &Run) -> bool {
        self.baseline.is_some() && matches!(run.server, Server::Ublkd { .. })
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

const fn kublk(backend: UBackend, batch: bool, auto_zc: bool) -> Server {
    Server::Kublk {
        backend,
        batch,
        auto_zc,
    }
}

/// In the order they run; each of ours next to its peer so that drift affects both alike.
pub const RUNS: &[Run] = {
    use UBackend::{File, Null, Nvme};
    &[
        run("null_blk", Server::NullBlk),
        run("ublkd-null-per-io", ublkd(Null, "per-io", false, false)),
        run("kublk-null", kublk(Null, false, false)),
        run("ublkd-null-batch", ublkd(Null, "batch", false, false)),
        run("kublk-null-batch", kublk(Null, true, false)),
        run("ublkd-null-per-io-zc", ublkd(Null, "per-io", true, false)),
        run("kublk-null-zc", kublk(Null, false, true)),
        run("ublkd-null-batch-zc", ublkd(Null, "batch", true, false)),
        run("kublk-null-batch-zc", kublk(Null, true, true)),
        run("ublkd-file", ublkd(File, "per-io", true, false)),
        run("loop-dio", Server::Loop),
        run("ublkd-file-copy", ublkd(File, "per-io", false, false)),
        run("ublkd-file-luks2", Server::Luks2File),
        run("kublk-loop-file", kublk(File, false, false)),
        run("kublk-loop-file-zc", kublk(File, false, true)),
        run("ublkd-nvme-poll", ublkd(Nvme, "batch", true, true)),
        run("fio-ng0n1-passthru", Server::RawNvme { passthru: true }),
        run("fio-nvme0n1-hipri", Server::RawNvme { passthru: false }),
        run("dm-linear", Server::DmLinear),
        run("kublk-loop-nvme", kublk(Nvme, false, false)),
        run("kublk-loop-nvme-zc", kublk(Nvme, false, true)),
        run("kublk-loop-nvme-batch-zc", kublk(Nvme, true, true)),
        run("ublkd-nvme-irq", ublkd(Nvme, "batch", true, false)),
    ]
};

/// The server of run `id`.
pub fn server_of(id: &str) -> Option<Server> {
    RUNS.iter().find(|r| r.id == id).map(|r| r.server)
}

/// The unit of a results entry: its name in `results.json` and the decimals shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit(pub &'static str, pub usize);

impl Unit {
    pub const IOPS: Unit = Unit("IOPS", 0);
    pub const US: Unit = Unit("us", 1);
    pub const CPU_PER_MIO: Unit = Unit("cpu_s_per_mio", 3);
    pub const FRACTION_OF_NULL_BLK: Unit = Unit("fraction_of_null_blk", 3);
    pub const MS: Unit = Unit("ms", 2);
    pub const MIB: Unit = Unit("MiB", 1);
    pub const KIB: Unit = Unit("KiB", 0);
    pub const MIBPS: Unit = Unit("MiB/s", 2);

    /// `ours / peer`, except latency, where `peer / ours` so that above 1 is better for us.
    /// CPU per I/O keeps `ours / peer` (below 1 is better for us), and so do the node service's
    /// units.
    pub fn ratio(self, ours: f64, peer: f64) -> Option<f64> {
        let (num, den) = match self {
            Unit::US => (peer, ours),
            _ => (ours, peer),
        };
        let r = num / den;
        (den > 0.0 && r.is_finite()).then_some(r)
    }
}

/// One fio job, run against every device: fio's `rw` (`randrw` is mixed 70 % reads, 30 %
/// writes, IOPS of both counted) and `bs`, the depth per fio job, and the fio jobs (processes),
/// reported together (`--group_reporting`).
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    pub rw: &'static str,
    pub bs: &'static str,
    pub qd: u32,
    pub jobs: u32,
}

impl Workload {
    /// Its name in the fio table and the raw results: `randread-qd32`, `randrw-64k-qd32`,
    /// `randread-qd32-4jobs`.
    pub fn id(&self) -> String {
        self.words(self.rw, format!("{}jobs", self.jobs)).join("-")
    }

    /// Its name in the entries' cases: `randread qd32`, `randrw 70/30 64k qd32`, `randread qd32
    /// x4 jobs`.
    pub fn label(&self) -> String {
        let rw = match self.rw {
            "randrw" => "randrw 70/30",
            rw => rw,
        };
        self.words(rw, format!("x{} jobs", self.jobs)).join(" ")
    }

    /// `rw`, the block size unless 4 KiB, the depth, and `jobs` when more than one.
    fn words(&self, rw: &str, jobs: String) -> Vec<String> {
        let bs = (self.bs != "4k").then(|| self.bs.to_owned());
        let qd = Some(format!("qd{}", self.qd));
        let jobs = (self.jobs > 1).then_some(jobs);
        let all = [Some(rw.to_owned()), bs, qd, jobs];
        all.into_iter().flatten().collect()
    }

    /// Its headline number: QD1's mean latency, the others' IOPS.
    pub fn unit(&self) -> Unit {
        match self.qd {
            1 => Unit::US,
            _ => Unit::IOPS,
        }
    }
}

const fn wl(rw: &'static str, bs: &'static str, qd: u32, jobs: u32) -> Workload {
    Workload { rw, bs, qd, jobs }
}

pub const WORKLOADS: &[Workload] = &[
    wl("randread", "4k", 32, 1),
    // More submitters than CPUs on one 2-queue device: the shape of a busy node.
    wl("randread", "4k", 32, 4),
    wl("randwrite", "4k", 32, 1),
    wl("randread", "4k", 1, 1),
    // Beyond 4 KiB: where the kernel's copy, not the server's work per request, is the cost.
    wl("randread", "128k", 32, 1),
    wl("randrw", "64k", 32, 1),
    wl("randwrite", "128k", 32, 1),
];

/// One comparison: our run against a peer's (named so in `results.json`). Server CPU is compared
/// when the peer is a userspace server (kublk, or ublkd); ours against null_blk's IOPS when
/// ours is a null volume.
#[derive(Debug, Clone, Copy)]
pub struct Pair {
    pub case: &'static str,
    pub ours: &'static str,
    pub peer: &'static str,
    pub peer_name: &'static str,
}

impl Pair {
    pub fn cpu(&self) -> bool {
        let peer = server_of(self.peer);
        matches!(peer, Some(Server::Ublkd { .. } | Server::Kublk { .. }))
    }

    pub fn ceiling(&self) -> bool {
        let ours = server_of(self.ours);
        matches!(ours, Some(Server::Ublkd { backend, .. }) if backend == UBackend::Null)
    }
}

const fn pair(case: &'static str, runs: (&'static str, &'static str), name: &'static str) -> Pair {
    let (ours, peer) = runs;
    Pair {
        case,
        ours,
        peer,
        peer_name: name,
    }
}

const POLL: &str = "ublkd-nvme-poll";
const IRQ: &str = "ublkd-nvme-irq";

/// Ours against a peer: the case, (our run, the peer's run), the peer's name.
#[rustfmt::skip]
pub const PAIRS: &[Pair] = &[
    pair("null per-io", ("ublkd-null-per-io", "kublk-null"), "kublk"),
    pair("null batch", ("ublkd-null-batch", "kublk-null-batch"), "kublk"),
    pair("null per-io zero copy", ("ublkd-null-per-io-zc", "kublk-null-zc"), "kublk --auto_zc"),
    pair("null batch zero copy", ("ublkd-null-batch-zc", "kublk-null-batch-zc"), "kublk -b --auto_zc"),
    pair("file", ("ublkd-file", "loop-dio"), "loop"),
    pair("file vs kublk loop", ("ublkd-file", "kublk-loop-file"), "kublk -t loop"),
    pair("file vs kublk loop zero copy", ("ublkd-file", "kublk-loop-file-zc"), "kublk -t loop --auto_zc"),
    pair("file zero copy vs copy", ("ublkd-file", "ublkd-file-copy"), "ublkd copy"),
    pair("file encrypted (LUKS2) vs plain", ("ublkd-file-luks2", "ublkd-file"), "ublkd plain"),
    pair("nvme polled zc vs ng0n1 passthru", (POLL, "fio-ng0n1-passthru"), "fio ng0n1"),
    pair("nvme polled zc vs nvme0n1 hipri", (POLL, "fio-nvme0n1-hipri"), "fio nvme0n1"),
    pair("nvme polled vs interrupt", (POLL, "ublkd-nvme-irq"), "ublkd irq"),
    pair("nvme polled zc vs dm-linear", (POLL, "dm-linear"), "dm-linear"),
    pair("nvme irq zc vs dm-linear", (IRQ, "dm-linear"), "dm-linear"),
    pair("nvme polled zc vs kublk loop", (POLL, "kublk-loop-nvme"), "kublk -t loop"),
    pair("nvme polled zc vs kublk loop zc", (POLL, "kublk-loop-nvme-zc"), "kublk -t loop --auto_zc"),
    pair("nvme polled zc vs kublk loop batch zc", (POLL, "kublk-loop-nvme-batch-zc"), "kublk -t loop -b --auto_zc"),
    pair("nvme irq zc vs kublk loop zc", (IRQ, "kublk-loop-nvme-zc"), "kublk -t loop --auto_zc"),
];
pub const CEILING_RUN: &str = "null_blk";
pub const OURS_NAME: &str = "ublkd";

/// Zero copy against copy in daemon memory: `ublkd run` RSS with its one volume idle (2 queues
/// of depth 128), ours = zero copy, peer = copy.
pub const RSS_PAIRS: [(&str, &str, &str); 2] = [
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

#[cfg(test)]
mod tests {
    use super::*;

    /// `--only a,b` selects the runs that either names, as `--only a` and `--only b` would
    /// together: the file volume and loop in one boot. The workloads keep the names that
    /// `results.json`'s cases are made of.
    #[test]
    fn only_selects_the_union_and_workloads_keep_their_names() {
        let picked = |only: &str| -> Vec<&str> {
            let (only, baseline) = (Some(only.into()), None);
            let p = Plan { only, baseline };
            let ids = RUNS.iter().map(|r| r.id);
            ids.filter(|id| p.selected(id)).collect()
        };
        let file = [
            "ublkd-file",
            "loop-dio",
            "ublkd-file-copy",
            "ublkd-file-luks2",
        ];
        assert_eq!(picked("ublkd-file,loop-dio"), file);
        assert_eq!(picked("loop-dio"), ["loop-dio"]);
        assert!(picked(",").is_empty());
        let names: Vec<(String, String)> = WORKLOADS.iter().map(|w| (w.id(), w.label())).collect();
        let expected = [
            ("randread-qd32", "randread qd32"),
            ("randread-qd32-4jobs", "randread qd32 x4 jobs"),
            ("randwrite-qd32", "randwrite qd32"),
            ("randread-qd1", "randread qd1"),
            ("randread-128k-qd32", "randread 128k qd32"),
            ("randrw-64k-qd32", "randrw 70/30 64k qd32"),
            ("randwrite-128k-qd32", "randwrite 128k qd32"),
        ];
        assert_eq!(names, expected.map(|(i, l)| (i.to_owned(), l.to_owned())));
        let cpu: Vec<bool> = PAIRS.iter().map(Pair::cpu).collect();
        assert_eq!(
            cpu,
            [
                true, true, true, true, false, true, true, true, true, false, false, true, false,
                false, true, true, true, true
            ]
        );
        assert_eq!(PAIRS.iter().filter(|p| p.ceiling()).count(), 4);
    }
}
