//! `cargo xtask bench`: ublkd against its peers, all in one VM boot.
//!
//! Peers: the kernel's selftest server `kublk` (built here from Debian's `linux-source-<x.y>` of
//! the guest kernel, cached per kernel version), the loop driver with direct I/O on the same
//! backing file as ublkd's file backend, and `null_blk` as the ceiling for the null cases. Every
//! case runs the same fio jobs (io_uring, direct, 4 KiB, randread/randwrite at QD32, randread at
//! QD1, and larger blocks); server CPU time is sampled from `/proc/PID/stat` around each job and
//! divided by the I/Os the block device completed in the same window (`/sys/block/*/stat`).
//!
//! After the fio cases, the same boot measures the node service, each section with a fresh
//! `ublkd --config` of its own driven by `ublkctl` (release builds), every entry with peer
//! `none` unless said: the control plane (the daemon's RSS with no volumes and with 100 idle
//! ones; 100 `create-volume` calls, which return once `/dev/ublkbN` serves I/O, and 100
//! `delete-volume` calls, p50 and p99 by nearest rank, end to end with ublkctl's start-up; the
//! same again while fio keeps the workers busy; scrapes of /metrics), CSI (`ublkd-csi` in front
//! of it: CreateVolume to a mounted file system, and stages one at a time against all at once),
//! QoS accuracy (a null volume per limit, fio against it; peer `limit`, the limit as its value,
//! measured / limit as the ratio), snapshots and clones (file volumes of 1 and 16 GiB on an XFS
//! with reflink, 256 MiB written into each; median times and df's growth, the 16 GiB times
//! against the 1 GiB ones, since they must not grow with size), and last crash recovery (for 1,
//! 16 and 64 null volumes, ublkd killed with SIGKILL, the devices staying, and started again:
//! the time from the new exec until every volume is READY; and the longest completion latency
//! fio sees on a RAM volume across such a restart, the case failing if fio saw an error). Their
//! settings are in `cases`; what each number includes is printed under its table.
//!
//! The guest measures and writes typed results (`results`) into the run directory; the host
//! reads them back, prints them, and writes `target/bench/results.json`: a list of `{case, ours,
//! peer, peer_value, ratio, unit}` objects, with `ours: null` and an `error` field for cases that
//! failed, and `target/bench/raw.json`: the clock, then every run as the guest measured it.
//! Numbers are never made up: a case that did not run says why, and the command then exits
//! non-zero.
//!
//! `--baseline REV` measures REV's ublkd beside this one in the same boot, the only comparison
//! that means anything here (runs from different boots move by ±30 %): REV is built in release
//! mode once per commit (a worktree, cached under `target/baseline`, `baseline.rs`), and every
//! ublkd run happens four times in a row after a discarded warm-up, A B B A (new, baseline,
//! baseline, new) for every other case and B A A B for the rest, so that a drift over the boot,
//! and the first run's own handicap, fall on both alike. Each case and workload is then reported
//! as new against baseline, each side the mean of its two runs, in the table and in
//! `results.json` (peer `baseline <sha>`); `raw.json` keeps every run.
//! `--only SUBSTR[,SUBSTR...]` runs just the fio runs whose name contains SUBSTR, and none of the
//! sections after them.
//!
//! `--clock instructions` runs the boot with QEMU's instruction counter as the guest's clock
//! (`vm::Clock`): every timing then counts the guest instructions spent, so the same job on a
//! null volume repeats within 0.3 % where the wall clock moves it by ±25 %. That is the clock to
//! judge a change of the code path with (`--baseline REV --clock instructions --only ublkd-null`);
//! only the null cases: those that wait on an emulated device (file, NVMe) swing by factors of
//! 10 under it. The wall clock (the default) is the one for peers, devices and anything about how
//! work spreads over CPUs, which one TCG thread cannot show. The clock is printed in the tables'
//! heading and is the first element of `raw.json`. It costs time: a busy guest second is 10^9
//! instructions, about 5 host seconds, so `--only ublkd` took 41 minutes with
//! `UBLKD_BENCH_RUNTIME=1` (1 s runs are enough at that spread).
//!
//! `UBLKD_BENCH_RUNTIME` sets the seconds each fio job measures (default 5);
//! `UBLKD_BENCH_UBLKD` names a ublkd binary to measure instead of building the workspace's
//! (ublkctl is still built). The binary must live outside `/tmp` (the guest mounts a tmpfs there).
//!
//! The code, by concern: `cases` (what is measured), `peers` (building kublk), `baseline`,
//! `guest` (what the guest runs: this binary again, `xtask bench-guest`, over the steps of the
//! plan), `results` (what crosses the VM's boundary, typed), `report` (the entries, the fio
//! cases' and `--baseline`'s, and the one table renderer) and `sections` (the node service's).

mod baseline;
mod cases;
pub mod guest;
mod peers;
mod report;
mod results;
mod sections;

use crate::apt;
use crate::image;
use crate::vm::{Clock, Exit, Vm};
use anyhow::{bail, Context, Result};
use cases::{
    Plan, ABBA, CONTROL_BUDGET_SECS, CONTROL_VOLUMES, CSI_BUDGET_SECS, DEFAULT_RUNTIME,
    QOS_BUDGET_SECS, RECOVERY_BUDGET_SECS, RUNS, SNAPSHOT_BUDGET_SECS, WORKLOADS,
};
use peers::ensure_kublk;
use report::{
    baseline_entries, baseline_runs_table, entries_table, fio_entries, fio_samples, fio_table,
};
use results::{Input, Results};
use serde_json::{json, Value};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// `cargo xtask bench`'s arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Also run every ublkd case with REV's ublkd (a commit, or `work`: built and cached by `baseline`),
    /// interleaved A B B A, and report new/baseline per case.
    #[arg(long, value_name = "REV")]
    baseline: Option<String>,
    /// Run only the fio cases whose name contains SUBSTR, or one of several comma-separated
    /// (`ublkd-file,loop-dio`), and skip the control-plane, CSI, QoS, snapshot and recovery
    /// sections.
    #[arg(long, value_name = "SUBSTR[,SUBSTR...]")]
    only: Option<String>,
    /// What the guest's clock counts: `wall` (host real time, multi-threaded TCG) or
    /// `instructions` (one guest nanosecond per instruction: the work per I/O, repeatable to
    /// within 0.3 %; the way to judge a code change with --baseline; blind to how work spreads
    /// over CPUs).
    #[arg(long, value_enum, default_value_t = Clock::Wall)]
    clock: Clock,
}

/// `cargo xtask bench [--baseline REV] [--only SUBSTR] [--clock wall|instructions]`.
pub fn run(ws: &Path, args: &Args) -> Result<ExitCode> {
    let mut plan = Plan::default();
    if let Some(s) = &args.only {
        for part in s.split(',') {
            if part.is_empty() || !RUNS.iter().any(|r| r.id.contains(part)) {
                bail!("--only {part:?} names no run; the runs: {}", run_names());
            }
        }
        plan.only = Some(s.clone());
    }
    if let Some(rev) = &args.baseline {
        let (label, bin) = baseline::build(ws, rev)?;
        plan.baseline = Some((label, bin));
    }
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
    let dir = crate::dist::release_build(ws).map_err(|e| format!("{e:#}"));
    let bin = |name| dir.clone().and_then(|d| release_bin(&d, name));
    let ublkd = match std::env::var_os("UBLKD_BENCH_UBLKD") {
        Some(b) => absolute_file(Path::new(&b)).map_err(|e| format!("{e:#}")),
        None => bin("ublkd"),
    };
    let (ublkctl, csi) = (bin("ublkctl"), bin("ublkd-csi"));
    let mut errors: Vec<&String> = [&ublkd, &ublkctl, &csi]
        .into_iter()
        .filter_map(|r| r.as_ref().err())
        .collect();
    errors.dedup();
    for e in errors {
        eprintln!("xtask: {e}");
    }
    let input = Input {
        runtime,
        plan: plan.clone(),
        kublk,
        ublkd,
        ublkctl,
        csi,
    };

    let selected = RUNS.iter().filter(|r| plan.selected(r.id));
    let ab = selected.clone().filter(|r| plan.ab(r)).count();
    let runs = selected.count() + ab * (ABBA.len() - 1);
    // One warm-up job before each A/B group.
    let jobs = (runs * WORKLOADS.len() + ab) as u64;
    let sections = match plan.sections() {
        true => {
            CONTROL_BUDGET_SECS
                + CSI_BUDGET_SECS
                + QOS_BUDGET_SECS
                + SNAPSHOT_BUDGET_SECS
                + RECOVERY_BUDGET_SECS
        }
        false => 0,
    };
    // Under the instruction clock a busy guest second (10^9 instructions) took about 5 host
    // seconds: one TCG thread runs some 200 million guest instructions a second.
    let slowdown = match args.clock {
        Clock::Wall => 1,
        Clock::Instructions => 5,
    };
    let timeout = std::env::var("UBLKD_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or((300 + jobs * (runtime + 45) + sections) * slowdown);
    let order = match &plan.baseline {
        Some((label, _)) => {
            format!(" (each ublkd run A B B A or B A A B against {label}, after a warm-up)")
        }
        None => String::new(),
    };
    let then = match plan.sections() {
        true => format!(
            ", then {CONTROL_VOLUMES} volumes through ublkctl, CSI, QoS limits, snapshots, \
             then kill -9 recovery"
        ),
        false => String::new(),
    };
    eprintln!(
        "xtask: bench: {runs} runs{order} x {} fio jobs of {runtime} s{then}, in one boot of {}, \
         {} clock",
        WORKLOADS.len(),
        kernel.kver,
        args.clock.as_str()
    );
    let vm = Vm::new(ws, &kernel)?
        .timeout_secs(timeout)
        .clock(args.clock)
        .echo(true);
    let input_path = vm.run_dir().join("bench-input.json");
    fs::write(&input_path, serde_json::to_string_pretty(&input)? + "\n")
        .with_context(|| format!("writing {}", input_path.display()))?;
    let xtask = std::env::current_exe().context("finding this xtask binary")?;
    let run = vm.run(&guest::script(&xtask, &input_path))?;

    let results = Results::read(&run.run_dir)?;
    println!();
    println!(
        "bench ({}, {} clock, fio {runtime} s per job, {:.0} s in the guest):",
        kernel.kver,
        args.clock.as_str(),
        run.wall.as_secs_f64()
    );
    print!("{}", fio_table(&results, &plan));
    let mut entries = fio_entries(&results, &plan);
    println!();
    print!("{}", entries_table(&entries));
    if let Some((label, _)) = &plan.baseline {
        let against = baseline_entries(&results, &plan, label);
        println!();
        println!(
            "against the baseline {label}, same boot, A B B A / B A A B after a warm-up (each \
             side the mean of its two runs; ratio above 1 is better for this build, latency too; \
             cpu: below 1 is better):"
        );
        print!("{}", entries_table(&against));
        println!();
        print!("{}", baseline_runs_table(&results, &plan));
        entries.extend(against);
    }
    if plan.sections() {
        for s in sections::sections(&results) {
            println!();
            println!("{}:", s.title);
            print!("{}", entries_table(&s.entries));
            for n in &s.notes {
                println!("{n}");
            }
            entries.extend(s.entries);
        }
    }
    let out_dir = ws.join("target/bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let path = out_dir.join("results.json");
    let json = Value::Array(entries.iter().map(report::Entry::to_json).collect());
    fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let raw_path = out_dir.join("raw.json");
    let baseline = plan.baseline.as_ref().map(|(label, _)| label);
    let raw = json!([{ "clock": args.clock.as_str(), "baseline": baseline }, results]);
    fs::write(&raw_path, serde_json::to_string_pretty(&raw)? + "\n")
        .with_context(|| format!("writing {}", raw_path.display()))?;
    println!();
    println!("wrote {} and {}", path.display(), raw_path.display());

    let mut failed = entries.iter().filter(|e| e.error.is_some()).count();
    failed += fio_samples(&results, &plan)
        .iter()
        .filter(|(_, _, s)| s.is_err())
        .count();
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
            "bench: {failed} cases failed; guest logs kept in {}",
            run.run_dir.display()
        );
        Ok(ExitCode::FAILURE)
    }
}

fn run_names() -> String {
    RUNS.iter().map(|r| r.id).collect::<Vec<_>>().join(", ")
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

/// `dir/name`, if the build left it there.
fn release_bin(dir: &Path, name: &str) -> Result<PathBuf, String> {
    let bin = dir.join(name);
    if bin.is_file() {
        Ok(bin)
    } else {
        Err(format!("{} is missing after the build", bin.display()))
    }
}
