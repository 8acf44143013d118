//! `cargo xtask bench`: ublkd against its peers, all in one VM boot (tests/README.md, "4.
//! Benchmarks"; why it runs this way: docs/performance.md, "The bench's own method, measured").
//! Peers (`cases::Server`): the kernel's selftest server `kublk` (built by `peers`), the loop
//! driver, a linear device-mapper volume, `null_blk` as the null cases' ceiling, and fio on the
//! NVMe namespace itself. Every case runs the same fio jobs; server CPU time is sampled from
//! `/proc/PID/stat` around each job and divided by the I/Os the block device completed in the
//! same window (`/sys/block/*/stat`). Then the node service's sections, each with a fresh
//! `ublkd --config` driven by `ublkctl` (release builds): the control plane, CSI, QoS accuracy,
//! snapshots and clones, and last crash recovery. Their settings are in `cases`; what each
//! number includes is printed under its table.
//! The guest (this binary again, `xtask bench-guest`, `guest`) writes typed results
//! (`results`) into the run directory; the host prints them (`report`, `sections`) and writes
//! `target/bench/results.json`: a list of `{case, ours, peer, peer_value, ratio, unit}` objects,
//! with `ours: null` and an `error` field for cases that failed, and `target/bench/raw.json`:
//! the clock, then every run as the guest measured it. Numbers are never made up: a case that
//! did not run says why, and the command then exits non-zero.
//! Its options are [`Args`]'s (`--baseline REV`: `baseline` builds it, `cases::ABBA` orders its
//! runs; `--clock`: `vm::Clock`); its environment (`UBLKD_BENCH_RUNTIME`, `UBLKD_BENCH_UBLKD`):
//! `cargo xtask bench --help`.

/// What run `$run` of the results `$r` measured, as the kind `$kind` (a variant of `Measured`).
macro_rules! view {
    ($r:expr, $run:expr, $kind:path) => {
        $r.view($run, |m| match m {
            $kind(x) => Some(x),
            _ => None,
        })
    };
}

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
use cases::{Plan, ABBA, CONTROL_VOLUMES, DEFAULT_RUNTIME, RUNS, SECTIONS_BUDGET_SECS, WORKLOADS};
use clap::ValueEnum;
use report::{entries_table, fio_entries, fio_samples, fio_table, Entry};
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
    for part in args.only.iter().flat_map(|s| s.split(',')) {
        if part.is_empty() || !RUNS.iter().any(|r| r.id.contains(part)) {
            let runs = RUNS.iter().map(|r| r.id).collect::<Vec<_>>().join(", ");
            bail!("--only {part:?} names no run; the runs: {runs}");
        }
    }
    let baseline = args.baseline.as_ref().map(|rev| baseline::build(ws, rev));
    let plan = Plan {
        only: args.only.clone(),
        baseline: baseline.transpose()?,
    };
    let runtime = match std::env::var("UBLKD_BENCH_RUNTIME") {
        Ok(v) => match v.parse::<u64>() {
            Ok(s) if s > 0 => s,
            _ => bail!("UBLKD_BENCH_RUNTIME={v:?} is not a number of seconds"),
        },
        Err(_) => DEFAULT_RUNTIME,
    };
    let kernel = image::prepare(ws)?;
    apt::require("losetup", "mount")?;
    let kublk = peers::ensure_kublk(&kernel).map_err(|e| format!("building kublk failed: {e:#}"));
    let dir = crate::dist::release_build(ws).map_err(|e| format!("{e:#}"));
    let bin = |name: &str| {
        let bin = dir.clone()?.join(name);
        match bin.is_file() {
            true => Ok(bin),
            false => Err(format!("{} is missing after the build", bin.display())),
        }
    };
    // Made absolute: the guest runs the script elsewhere.
    let ublkd = match std::env::var_os("UBLKD_BENCH_UBLKD").map(PathBuf::from) {
        Some(b) => match b.canonicalize() {
            Ok(abs) if abs.is_file() => Ok(abs),
            Ok(_) => Err(format!("UBLKD_BENCH_UBLKD={} is not a file", b.display())),
            Err(e) => Err(format!("UBLKD_BENCH_UBLKD={}: {e}", b.display())),
        },
        None => bin("ublkd"),
    };
    let (ublkctl, csi) = (bin("ublkctl"), bin("ublkd-csi"));
    let bins = [&kublk, &ublkd, &ublkctl, &csi];
    let mut errors: Vec<&String> = bins.into_iter().filter_map(|r| r.as_ref().err()).collect();
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
        count_syscalls: args.clock == Clock::Instructions,
    };

    let selected = RUNS.iter().filter(|r| plan.selected(r.id));
    let ab = selected.clone().filter(|r| plan.ab(r)).count();
    let runs = selected.count() + ab * (ABBA.len() - 1);
    // One warm-up job before each A/B group.
    let jobs = (runs * WORKLOADS.len() + ab) as u64;
    let sections = SECTIONS_BUDGET_SECS * u64::from(plan.sections());
    // Under the instruction clock a busy guest second (10^9 instructions) took about 5 host
    // seconds: one TCG thread runs some 200 million guest instructions a second.
    let slowdown = match args.clock {
        Clock::Wall => 1,
        Clock::Instructions => 5,
    };
    let timeout = (300 + jobs * (runtime + 45) + sections) * slowdown;
    let order = plan.baseline.as_ref().map_or(String::new(), |(label, _)| {
        format!(" (each ublkd run A B B A or B A A B against {label}, after a warm-up)")
    });
    let then = match plan.sections() {
        true => format!(
            ", then {CONTROL_VOLUMES} volumes through ublkctl, CSI, QoS limits, snapshots, \
             then kill -9 recovery"
        ),
        false => String::new(),
    };
    // Its name as `--clock` takes it.
    let clock = args.clock.to_possible_value().context("no clock name")?;
    let (wls, clock, kver) = (WORKLOADS.len(), clock.get_name(), &kernel.kver);
    let jobs_of = format!("{wls} fio jobs of {runtime} s");
    eprintln!(
        "xtask: bench: {runs} runs{order} x {jobs_of}{then}, in one boot of {kver}, {clock} clock"
    );
    let mut vm = Vm::new(ws, &kernel)?;
    (vm.timeout, vm.clock, vm.echo) = (timeout, args.clock, true);
    let input_path = vm.run_dir.join("bench-input.json");
    fs::write(&input_path, serde_json::to_string_pretty(&input)? + "\n")
        .with_context(|| format!("writing {}", input_path.display()))?;
    let xtask = std::env::current_exe().context("finding this xtask binary")?;
    let run = vm.run(&guest::script(&xtask, &input_path))?;

    let results = Results::read(&run.run_dir)?;
    let (kver, secs) = (&kernel.kver, run.wall.as_secs_f64());
    println!("\nbench ({kver}, {clock} clock, fio {runtime} s per job, {secs:.0} s in the guest):");
    print!("{}", fio_table(&results, &plan));
    let mut entries = fio_entries(&results, &plan);
    print!("\n{}", entries_table(&entries));
    if let Some((label, _)) = &plan.baseline {
        let (against, runs) = report::baseline(&results, &plan, label);
        println!(
            "\nagainst the baseline {label}, same boot, A B B A / B A A B after a warm-up (each \
             side the mean of its two runs; ratio above 1 is better for this build, latency too; \
             cpu: below 1 is better):"
        );
        print!("{}\n{runs}", entries_table(&against));
        entries.extend(against);
    }
    let shown = plan.sections().then(|| sections::sections(&results));
    for s in shown.into_iter().flatten() {
        println!("\n{}:", s.title);
        print!("{}", entries_table(&s.entries));
        for n in &s.notes {
            println!("{n}");
        }
        entries.extend(s.entries);
    }
    let out_dir = ws.join("target/bench");
    fs::create_dir_all(&out_dir).with_context(|| format!("creating {}", out_dir.display()))?;
    let baseline = plan.baseline.as_ref().map(|(label, _)| label);
    let raw = json!([{ "clock": clock, "baseline": baseline }, results]);
    let json = Value::Array(entries.iter().map(Entry::to_json).collect());
    let (path, raw_path) = (out_dir.join("results.json"), out_dir.join("raw.json"));
    for (path, v) in [(&path, json), (&raw_path, raw)] {
        fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    println!("\nwrote {} and {}", path.display(), raw_path.display());

    let mut failed = entries.iter().filter(|e| e.error.is_some()).count();
    let samples = fio_samples(&results, &plan);
    failed += samples.iter().filter(|(_, _, s)| s.is_err()).count();
    if run.exit != Exit::Code(0) {
        failed += 1;
        let tail = run.console_tail(40);
        println!("guest {}; console tail:\n{tail}", run.exit);
    }
    if failed == 0 {
        let _ = fs::remove_dir_all(&run.run_dir);
        Ok(ExitCode::SUCCESS)
    } else {
        let dir = run.run_dir.display();
        println!("bench: {failed} cases failed; guest logs kept in {dir}");
        Ok(ExitCode::FAILURE)
    }
}
