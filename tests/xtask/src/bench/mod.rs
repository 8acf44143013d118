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
//! Then the features of the node service, each with a fresh daemon of its own. QoS: one null
//! volume per limit (read 1000, 5000 and 20000 IOPS at 4 KiB randread QD32; write 8 and 32 MiB/s
//! at 64 KiB randwrite QD32; and one without limits, the ceiling of that setup), set by
//! `ublkctl create-volume`, measured by fio for 5 s after a 1 s ramp that the burst allowance
//! falls into; each entry has peer `limit`, the limit as its value, and measured / limit as its
//! ratio. Unthrottled speed with QoS compiled in is what the null cases above measure.
//! Snapshots: file volumes of 1 and 16 GiB on an XFS made with reflink=1 (a loop device over a
//! sparse file in the guest's tmpfs), each created empty, 256 MiB written by fio, then three
//! `create-snapshot` and `create-volume --from-snapshot` calls timed (ublkctl end to end, median;
//! `ublkctl node-info` timed as the floor) with df's used bytes before and after each; the 16 GiB
//! times are compared with the 1 GiB ones, since they must not grow with size.
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
//! `--baseline REV` measures REV's ublkd beside this one in the same boot, the only comparison
//! that means anything here (runs from different boots move by ±30 %): REV is built in release
//! mode once per commit (a worktree, cached under `target/baseline`, `baseline.rs`), and every
//! ublkd run happens four times in a row after a discarded warm-up,
//! A B B A (new, baseline, baseline, new) for every other case and B A A B for the rest, so that
//! a drift over the boot, and the first run's own handicap, fall on both alike. Each case and workload is
//! then reported as new against baseline, each side the mean of its two runs, in the table and
//! in `results.json` (peer `baseline <sha>`); `raw.json` keeps every run. `--only SUBSTR[,SUBSTR...]` runs
//! just the fio runs whose name contains SUBSTR, and none of the sections after them.
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
//! The code, by concern: `cases` (what is measured), `peers` (building kublk), `guest` (what
//! the guest runs: this binary again, `xtask bench-guest`, over the steps of the plan), `collect`
//! (reading what the guest left) and `report` (`results.json`, `raw.json` and the tables
//! printed).

mod baseline;
mod cases;
mod collect;
pub mod guest;
mod peers;
mod report;

use crate::apt;
use crate::image;
use crate::vm::{Clock, Exit, Vm};
use anyhow::{bail, Context, Result};
use cases::{
    Plan, ABBA, CONTROL_BUDGET_SECS, CONTROL_VOLUMES, CSI_BUDGET_SECS, DEFAULT_RUNTIME,
    QOS_BUDGET_SECS, RECOVERY_BUDGET_SECS, RUNS, SNAPSHOT_BUDGET_SECS, WORKLOADS,
};
use collect::control::collect_control;
use collect::csi::collect_csi;
use collect::qos::collect_qos;
use collect::recovery::{collect_recovery, collect_stall};
use collect::snapshot::collect_snapshots;
use peers::ensure_kublk;
use report::control::{control_entries, control_raw_json, control_table};
use report::csi::{csi_entries, csi_raw_json, csi_table};
use report::qos::{qos_entries, qos_raw_json, qos_table};
use report::recovery::{recovery_entries, recovery_raw_json, recovery_table};
use report::snapshot::{snapshot_entries, snapshot_raw_json, snapshot_table};
use report::{
    baseline_entries, baseline_raw_json, baseline_runs_table, entries, entries_table, raw_json,
    raw_table, rss_entries, Entry,
};
use serde_json::Value;
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
    let built = || crate::dist::release_build(ws).map_err(|e| format!("{e:#}"));
    let (ublkd, ublkctl, csi) = match std::env::var_os("UBLKD_BENCH_UBLKD") {
        Some(bin) => {
            let dir = built();
            (
                absolute_file(Path::new(&bin)).map_err(|e| format!("{e:#}")),
                dir.clone().and_then(|d| release_bin(&d, "ublkctl")),
                dir.and_then(|d| release_bin(&d, "ublkd-csi")),
            )
        }
        None => {
            let dir = built();
            (
                dir.clone().and_then(|d| release_bin(&d, "ublkd")),
                dir.clone().and_then(|d| release_bin(&d, "ublkctl")),
                dir.and_then(|d| release_bin(&d, "ublkd-csi")),
            )
        }
    };
    let mut errors: Vec<&String> = [&ublkd, &ublkctl, &csi]
        .into_iter()
        .filter_map(|r| r.as_ref().err())
        .collect();
    errors.dedup();
    for e in errors {
        eprintln!("xtask: {e}");
    }

    let input = guest::Input {
        runtime,
        plan: plan.clone(),
        kublk,
        ublkd,
        ublkctl,
        csi,
    };
    let selected = RUNS.iter().filter(|r| plan.selected(r.id));
    let runs: usize = selected
        .map(|r| {
            if plan.baseline.is_some() && r.is_ublkd() {
                ABBA.len()
            } else {
                1
            }
        })
        .sum();
    // One warm-up job before each A/B group.
    let warmups = match plan.baseline {
        Some(_) => RUNS
            .iter()
            .filter(|r| plan.selected(r.id) && r.is_ublkd())
            .count(),
        None => 0,
    };
    let jobs = (runs * WORKLOADS.len() + warmups) as u64;
    let sections = if plan.sections() {
        CONTROL_BUDGET_SECS
            + CSI_BUDGET_SECS
            + QOS_BUDGET_SECS
            + SNAPSHOT_BUDGET_SECS
            + RECOVERY_BUDGET_SECS
    } else {
        0
    };
    let timeout = std::env::var("UBLKD_VM_TIMEOUT")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(
            // Under the instruction clock a busy guest second (10^9 instructions) took about
            // 5 host seconds: one TCG thread runs some 200 million guest instructions a second.
            (300 + jobs * (runtime + 45) + sections)
                * match args.clock {
                    Clock::Wall => 1,
                    Clock::Instructions => 5,
                },
        );
    match &plan.baseline {
        Some((label, _)) => eprintln!(
            "xtask: bench: {runs} runs (each ublkd run A B B A or B A A B against {label}, after a warm-up) x {} fio jobs \
             of {runtime} s{}, in one boot of {}, {} clock",
            WORKLOADS.len(),
            if plan.sections() {
                ", then the node service's sections"
            } else {
                ""
            },
            kernel.kver,
            args.clock.as_str()
        ),
        None => eprintln!(
            "xtask: bench: {runs} runs x {} fio jobs of {runtime} s{}, in one boot of {}, {} clock",
            WORKLOADS.len(),
            if plan.sections() {
                format!(
                    ", then {CONTROL_VOLUMES} volumes through ublkctl, CSI, QoS limits, \
                         snapshots, then kill -9 recovery"
                )
            } else {
                String::new()
            },
            kernel.kver,
            args.clock.as_str()
        ),
    }
    let vm = Vm::new(ws, &kernel)?
        .timeout_secs(timeout)
        .clock(args.clock)
        .echo(true);
    let input_path = vm.run_dir().join("bench-input.json");
    fs::write(
        &input_path,
        serde_json::to_string_pretty(&input.to_json())? + "\n",
    )
    .with_context(|| format!("writing {}", input_path.display()))?;
    let xtask = std::env::current_exe().context("finding this xtask binary")?;
    let run = vm.run(&guest::script(&xtask, &input_path))?;

    let results = collect::collect(&run.run_dir, &plan);
    let mut entries = entries(&results, &plan);
    entries.extend(rss_entries(&run.run_dir, &plan));
    println!();
    println!(
        "bench ({}, {} clock, fio {runtime} s per job, {:.0} s in the guest):",
        kernel.kver,
        args.clock.as_str(),
        run.wall.as_secs_f64()
    );
    print!("{}", raw_table(&results));
    println!();
    print!("{}", entries_table(&entries));
    let mut raw = raw_json(&results);
    if let Value::Array(list) = &mut raw {
        list.insert(0, serde_json::json!({ "clock": args.clock.as_str() }));
    }
    if let Some((label, _)) = &plan.baseline {
        let against = baseline_entries(&results, label);
        println!();
        println!(
            "against the baseline {label}, same boot, A B B A / B A A B after a warm-up (each side the mean of its two \
             runs; ratio above 1 is better for this build, latency too; cpu: below 1 is better):"
        );
        print!("{}", entries_table(&against));
        println!();
        print!("{}", baseline_runs_table(&results));
        entries.extend(against);
        if let Value::Array(list) = &mut raw {
            list.push(baseline_raw_json(&results, label));
        }
    }
    if plan.sections() {
        sections_report(&run.run_dir, &mut entries, &mut raw);
    }
    let out_dir = ws.join("target/bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let json = Value::Array(entries.iter().map(Entry::to_json).collect());
    let path = out_dir.join("results.json");
    fs::write(&path, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", path.display()))?;
    let raw_path = out_dir.join("raw.json");
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

/// The control-plane, CSI, QoS, snapshot and recovery sections: read, printed, and added to
/// the entries and the raw list.
fn sections_report(dir: &Path, entries: &mut Vec<Entry>, raw: &mut Value) {
    let control = collect_control(dir);
    let csi_run = collect_csi(dir);
    let qos = collect_qos(dir);
    let snapshots = collect_snapshots(dir);
    let recoveries = collect_recovery(dir);
    let stall = collect_stall(dir);
    let control_entries = control_entries(&control);
    let csi_entries = csi_entries(&csi_run);
    let qos_entries = qos_entries(&qos);
    let snapshot_entries = snapshot_entries(&snapshots);
    let recovery_entries = recovery_entries(&recoveries, &stall);
    println!();
    println!("control plane (ublkd --config, driven by ublkctl):");
    print!("{}", control_table(&control_entries));
    println!();
    println!("CSI (ublkd-csi in front of ublkd, called as the provisioner and kubelet would):");
    print!("{}", csi_table(&csi_entries, &csi_run));
    println!();
    println!("QoS accuracy (a null volume per limit, fio against it):");
    print!("{}", qos_table(&qos_entries, &qos));
    println!();
    println!("snapshots and clones (file volumes on XFS with reflink, through ublkctl):");
    print!("{}", snapshot_table(&snapshot_entries, &snapshots));
    println!();
    println!("recovery (ublkd --config killed with -9 and started again):");
    print!("{}", recovery_table(&recovery_entries, &recoveries, &stall));
    entries.extend(control_entries);
    entries.extend(csi_entries);
    entries.extend(qos_entries);
    entries.extend(snapshot_entries);
    entries.extend(recovery_entries);
    if let Value::Array(list) = raw {
        list.push(control_raw_json(&control));
        list.push(csi_raw_json(&csi_run));
        list.push(qos_raw_json(&qos));
        list.push(snapshot_raw_json(&snapshots));
        list.extend(recovery_raw_json(&recoveries, &stall));
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
