//! What crosses the VM's boundary, typed: the host's [`Input`] to the guest
//! (`bench-input.json` in the run directory) and the guest's [`Results`] back
//! (`bench-results.json`, rewritten after every step, so that a guest that dies keeps what it
//! measured). Each step of the guest is one [`Case`]: what it measured or why it measured
//! nothing, and what went wrong tearing it down.

use super::cases::{Plan, Unit};
use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A measurement, or why there is none.
pub type Outcome<T> = Result<T, String>;

/// A binary the guest runs, or why there is none.
pub type Bin = Outcome<PathBuf>;

/// What the host tells the guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Input {
    /// Seconds each fio job measures.
    pub runtime: u64,
    pub plan: Plan,
    pub kublk: Bin,
    pub ublkd: Bin,
    pub ublkctl: Bin,
    pub csi: Bin,
    /// Syscalls counted per I/O too (tracefs): with the instruction clock, which they skew not.
    pub count_syscalls: bool,
}

/// The name of the guest's results in the run directory.
pub const RESULTS_FILE: &str = "bench-results.json";

/// Everything the guest measured, by run name (`null_blk`, `ublkd-null-batch~base`,
/// `ublkd-control`, `ublkd-recovery-16`, ...).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Results(pub BTreeMap<String, Case>);

/// One step of the guest.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Case {
    pub measured: Outcome<Measured>,
    /// What went wrong after the measurement (volumes left, a daemon that would not stop, a
    /// device that stayed): it marks every number of the case.
    pub teardown: Vec<String>,
}

/// What one step measured, by kind.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Measured {
    Fio(FioRun),
    Control(Control),
    Csi(Csi),
    Qos(Qos),
    Snapshots(Snapshots),
    Recovery(Restart),
    Stall(Stall),
}

/// What each workload measured, by workload id.
pub type Samples = BTreeMap<String, Outcome<Sample>>;

/// One server under every workload.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FioRun {
    pub samples: Samples,
    /// The server's VmRSS (KiB) with its one volume idle, before the first job (ublkd only).
    pub rss_kib: Outcome<f64>,
}

/// What one fio job against one device measured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub iops: f64,
    /// Mean latency (µs); of the reads for a mixed job.
    pub lat_us: f64,
    /// Server CPU seconds per million I/Os (utime + stime of its processes over the I/Os the
    /// block device completed), or why there is none.
    pub cpu_s_per_mio: Outcome<f64>,
    /// Every CPU's busy time per I/O (µs): fio, the server and the kernel, so that the kernel's
    /// own drivers (loop, null_blk, raw NVMe) have a CPU cost too.
    pub sys_us_per_io: Outcome<f64>,
    /// The whole guest's kernel events per I/O over the job, by name ([`EVENTS`]); empty when
    /// they could not be read.
    pub per_io: BTreeMap<String, f64>,
}

/// The kernel events counted per I/O, on every CPU (fio's and the server's alike): context
/// switches and interrupts (/proc/stat ctxt, intr), IPIs (CAL, RES and TLB in /proc/interrupts),
/// and with `Input::count_syscalls`, syscalls and io_uring_enter calls (raw_syscalls:sys_enter).
pub const EVENTS: [&str; 5] = ["ctx", "irq", "IPI", "syscall", "enter"];

impl Sample {
    /// The workload's headline number, in `unit` (`Workload::unit`).
    pub fn metric(&self, unit: Unit) -> f64 {
        match unit {
            Unit::US => self.lat_us,
            _ => self.iops,
        }
    }
}

/// The control plane: `ublkd --config` driven by `ublkctl`; times in ms, end to end.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Control {
    /// Daemon VmRSS (KiB) with no volumes, and with all `CONTROL_VOLUMES` idle.
    pub rss_empty_kib: Outcome<f64>,
    pub rss_full_kib: Outcome<f64>,
    pub create_ms: Outcome<Vec<f64>>,
    pub delete_ms: Outcome<Vec<f64>>,
    /// Each `GET /metrics` with all volumes present.
    pub scrape_ms: Outcome<Vec<f64>>,
    /// Creates and deletes while fio kept the workers busy, and the IOPS of that load.
    pub load_create_ms: Outcome<Vec<f64>>,
    pub load_delete_ms: Outcome<Vec<f64>>,
    pub load_iops: Outcome<f64>,
}

/// The CSI driver in front of ublkd; ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Csi {
    /// CreateVolume to published and mounted, per volume.
    pub ext4_ms: Vec<f64>,
    pub xfs_ms: Vec<f64>,
    /// `CSI_PARALLEL` stages one at a time, and all at once: total each.
    pub stage_seq_ms: f64,
    pub stage_par_ms: f64,
}

/// Per QoS job id, what fio measured in the unit of its limit (read IOPS, or write MiB/s).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Qos {
    pub jobs: BTreeMap<String, Outcome<f64>>,
}

/// Snapshots and clones on an XFS with reflink.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshots {
    /// Each `ublkctl node-info` (ms): what any call costs.
    pub noop_ms: Outcome<Vec<f64>>,
    pub sizes: Vec<SnapSize>,
    /// Whether `xfs_info` showed `reflink=1`, when it ran.
    pub reflink: Option<bool>,
}

/// The snapshot run's volume of one size.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SnapSize {
    pub gib: u64,
    /// `create-volume` of it, empty, on a new sparse backing file (ms).
    pub create_ms: Outcome<f64>,
    /// Each `create-snapshot` of it after the fill, and each `create-volume --from-snapshot`.
    pub snapshot: Outcome<Vec<Timed>>,
    pub clone: Outcome<Vec<Timed>>,
    /// Extents of the backing file after the fill (filefrag).
    pub extents: Option<u64>,
}

/// One timed call: ublkctl end to end, and the growth of the file system's used bytes over it
/// (negative when XFS gave back a reservation).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timed {
    pub ms: f64,
    pub growth_kib: f64,
}

/// ublkd killed with -9 and started again; ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Restart {
    /// From the new ublkd's exec until `list-volumes` showed every volume READY.
    pub ready_ms: Outcome<f64>,
    /// From the kill until the new exec (the old one's exit included), and until READY.
    pub kill_to_exec_ms: Option<f64>,
    pub kill_to_ready_ms: Option<f64>,
    /// One more `list-volumes` call afterwards: what a poll costs.
    pub list_call_ms: Option<f64>,
    /// The I/O path the volumes came back on (`IO_PATH_BATCH`, ...).
    pub io_path: Option<String>,
}

impl Restart {
    /// A restart that did not happen, or that never became READY, and why.
    pub fn failed(why: String) -> Self {
        Restart {
            ready_ms: Err(why),
            kill_to_exec_ms: None,
            kill_to_ready_ms: None,
            list_call_ms: None,
            io_path: None,
        }
    }
}

/// fio on a RAM volume across a kill -9 and restart; ms.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stall {
    /// The longest completion latency in fio's per-I/O log, once it is shown to span the
    /// restart and fio saw no error.
    pub max_ms: Outcome<f64>,
    /// When (ms into the job, by its log) the slowest I/O completed; completions logged.
    pub max_at_ms: Option<f64>,
    pub ios: Option<usize>,
    /// fio's own maximum completion latency, from its JSON report.
    pub fio_max_ms: Option<f64>,
    /// From fio's launch until the device completed its first write; from then to the kill.
    pub first_write_ms: Option<f64>,
    pub kill_after_ms: Option<f64>,
    pub restart: Restart,
}

/// One run as the host reads it: its measurement or why there is none, and its teardown
/// problems (the first, and how many more).
#[derive(Debug)]
pub struct View<'a, T> {
    pub value: Outcome<&'a T>,
    pub teardown: Option<String>,
}

impl Results {
    /// The guest's results in `run_dir`; none when the guest wrote none (every case then reads
    /// as not run).
    pub fn read(run_dir: &Path) -> Result<Self> {
        let path = run_dir.join(RESULTS_FILE);
        if !path.exists() {
            return Ok(Self::default());
        }
        let text = std::fs::read_to_string(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// `run` as `pick` reads its kind of measurement.
    pub fn view<'a, T>(&'a self, run: &str, pick: fn(&Measured) -> Option<&T>) -> View<'a, T> {
        let case = self.0.get(run);
        let value = match case.map(|c| &c.measured) {
            None => Err("did not run (the guest ended early)".into()),
            Some(Ok(m)) => pick(m).ok_or_else(|| format!("{run} measured something else")),
            Some(Err(e)) => Err(e.clone()),
        };
        let teardown = case.and_then(|c| first_of(&c.teardown));
        View { value, teardown }
    }

    /// The fio run `run`.
    pub fn fio(&self, run: &str) -> View<'_, FioRun> {
        view!(self, run, Measured::Fio)
    }

    /// One workload of the fio run `run`.
    pub fn sample(&self, run: &str, wl: &str) -> Outcome<Sample> {
        let run = self.fio(run).value?;
        run.samples
            .get(wl)
            .cloned()
            .unwrap_or_else(|| Err("not measured".into()))
    }
}

/// Several problems as the first one and a count.
pub fn first_of(problems: &[String]) -> Option<String> {
    match problems {
        [] => None,
        [one] => Some(one.clone()),
        [first, more @ ..] => Some(format!("{first} (and {} more)", more.len())),
    }
}

/// The mean of runs that all succeeded (each figure on its own: CPU may be missing in one);
/// otherwise the first failure.
pub fn mean(runs: &[Outcome<Sample>]) -> Outcome<Sample> {
    let ok: Outcome<Vec<&Sample>> = runs
        .iter()
        .map(|r| r.as_ref().map_err(Clone::clone))
        .collect();
    let ok = ok?;
    if ok.is_empty() {
        return Err("no runs".into());
    }
    let n = ok.len() as f64;
    let avg = |f: &dyn Fn(&Sample) -> Outcome<f64>| -> Outcome<f64> {
        ok.iter().map(|s| f(s)).sum::<Outcome<f64>>().map(|x| x / n)
    };
    Ok(Sample {
        iops: ok.iter().map(|s| s.iops).sum::<f64>() / n,
        lat_us: ok.iter().map(|s| s.lat_us).sum::<f64>() / n,
        cpu_s_per_mio: avg(&|s| s.cpu_s_per_mio.clone()),
        sys_us_per_io: avg(&|s| s.sys_us_per_io.clone()),
        // the first run's events: they count work per I/O, which the runs share
        per_io: ok[0].per_io.clone(),
    })
}

/// A sample for the tests: `iops`, `lat_us`, server CPU `cpu`, and every CPU 20 µs per I/O.
#[cfg(test)]
pub fn sample(iops: f64, lat_us: f64, cpu: Outcome<f64>) -> Outcome<Sample> {
    Ok(Sample {
        iops,
        lat_us,
        cpu_s_per_mio: cpu,
        sys_us_per_io: Ok(20.0),
        per_io: BTreeMap::new(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn results_and_the_input_read_back_as_written() {
        let failed = Err("fio exited with status 1".into());
        let samples = [
            ("randread-qd32".into(), sample(8000.0, 125.0, Ok(1.5))),
            ("randread-qd1".into(), failed),
        ];
        let (samples, rss_kib) = (samples.into(), Err("not measured".into()));
        let measured = Ok(Measured::Fio(FioRun { samples, rss_kib }));
        let teardown = vec!["del failed".into(), "x".into()];
        let kublk = ("kublk-null".into(), Case { measured, teardown });
        let (measured, teardown) = (Err("no ublkctl".into()), vec![]);
        let qos = ("ublkd-qos".into(), Case { measured, teardown });
        let r = Results([kublk, qos].into());
        let dir = std::env::temp_dir().join(format!("xtask-results-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        assert_eq!(Results::read(&dir).unwrap(), Results::default());
        std::fs::write(dir.join(RESULTS_FILE), serde_json::to_string(&r).unwrap()).unwrap();
        let back = Results::read(&dir);
        let _ = std::fs::remove_dir_all(&dir); // a scratch directory
        let back = back.unwrap();
        assert_eq!(back, r);
        let kublk = back.fio("kublk-null");
        assert_eq!(kublk.teardown.as_deref(), Some("del failed (and 1 more)"));
        let iops = back.sample("kublk-null", "randread-qd32").map(|s| s.iops);
        assert_eq!(iops, Ok(8000.0));
        assert!(back.sample("kublk-null", "randwrite-qd32").is_err());
        let qos = back.fio("ublkd-qos").value.err();
        assert_eq!(qos.as_deref(), Some("no ublkctl"));
        let none = back.sample("null_blk", "randread-qd32");
        assert!(none.is_err_and(|e| e.contains("did not run")));

        let i = Input {
            runtime: 5,
            plan: Plan {
                only: Some("null".into()),
                baseline: Some(("fdc00eb".into(), "/c/bin/ublkd".into())),
            },
            kublk: Err("building kublk failed: it's gone".into()),
            ublkd: Ok("/t/ublkd".into()),
            ublkctl: Ok("/t/ublkctl".into()),
            csi: Ok("/t/ublkd-csi".into()),
            count_syscalls: true,
        };
        let text = serde_json::to_string(&i).unwrap();
        assert_eq!(serde_json::from_str::<Input>(&text).unwrap(), i);
    }

    #[test]
    fn each_builds_runs_average_and_a_failure_is_kept() {
        let s = |iops: f64, cpu| sample(iops, 1e6 / iops, cpu);
        let m = mean(&[s(100.0, Ok(2.0)), s(300.0, Ok(4.0))]).unwrap();
        let both = (200.0, Ok(3.0), Ok(20.0));
        assert_eq!((m.iops, m.cpu_s_per_mio, m.sys_us_per_io), both);
        let failed = Err("ublkd exited with status 2".to_owned());
        assert_eq!(mean(&[s(100.0, Ok(1.0)), failed.clone()]), failed);
        // CPU missing in one run: IOPS still averages, CPU says why.
        let none = Err("no server process".to_owned());
        let m = mean(&[s(100.0, Ok(2.0)), s(200.0, none.clone())]).unwrap();
        assert_eq!((m.iops, m.cpu_s_per_mio), (150.0, none));
        assert!(mean(&[]).is_err());
    }
}
