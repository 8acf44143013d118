//! `cargo xtask compare REV[+FLAG...]...`: ublkd builds of several commits against each other in ONE boot,
//! the only comparison that means anything here (runs from different boots move by ±30 %).
//!
//! Each REV (a commit, or `work` for the working tree) is built in release mode once and cached
//! by commit: a detached worktree under `target/compare/src/<sha>`, one shared target directory
//! (`target/compare/target`, so dependencies build once), the binary kept at
//! `target/compare/bin/<sha>/ublkd`. Flags after a `+` go to that build's `ublkd run` (e.g.
//! `work+--placement=same-cpu`): one build can be compared with itself under another setting.
//! The guest (`guest.sh`) runs fio against `ublkd run` for every build in turn, forward then
//! backward, twice, recording IOPS (randread and randwrite at QD32) and the mean latency
//! (randread at QD1), blk-mq's queue-to-CPU map and each CPU's busy share. The host prints a table, each build against the first named, and
//! writes `target/compare/results.json`. Until `cargo xtask bench --baseline` exists this is how
//! a change is judged against an earlier one.

use crate::image;
use crate::vm::{self, Vm};
use anyhow::{bail, Context, Result};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const GUEST: &str = include_str!("guest.sh");
/// Seconds each fio job measures unless `--runtime` says otherwise.
const DEFAULT_RUNTIME: u64 = 8;

/// `cargo xtask compare [--runtime S] REV...`.
/// `cargo xtask compare`'s arguments.
#[derive(Debug, clap::Args)]
pub struct Args {
    /// Seconds per fio job.
    #[arg(long, default_value_t = DEFAULT_RUNTIME, value_parser = clap::value_parser!(u64).range(1..))]
    runtime: u64,
    /// The builds: REV[+FLAG...], a commit or `work` (the working tree); each FLAG goes to that
    /// build's `ublkd run` (work+--placement=same-cpu).
    #[arg(required = true, num_args = 2.., value_name = "REV[+FLAG...]", allow_hyphen_values = true)]
    builds: Vec<String>,
    /// What the guest's clock counts, as `cargo xtask bench --clock`: `instructions` compares
    /// the instructions one I/O costs (repeatable, blind to how work spreads over CPUs).
    #[arg(long, value_enum, default_value_t = vm::Clock::Wall)]
    clock: vm::Clock,
}

pub fn run(ws: &Path, args: &Args) -> Result<ExitCode> {
    let runtime = args.runtime;
    let revs = &args.builds;
    let mut builds = Vec::new();
    for arg in revs {
        let mut parts = arg.split('+');
        let rev = parts.next().unwrap_or_default();
        let flags: Vec<&str> = parts.collect();
        let (sha, bin) = build(ws, rev)?;
        let label = std::iter::once(sha.as_str())
            .chain(flags.iter().copied())
            .collect::<Vec<_>>()
            .join("+");
        if builds
            .iter()
            .any(|(l, _, _): &(String, PathBuf, String)| *l == label)
        {
            bail!("{arg} names a build already in the list ({label})");
        }
        builds.push((label, bin, flags.join(",")));
    }
    let kernel = image::prepare(ws)?;
    let script_path = ws.join("target/compare/guest.sh");
    fs::write(&script_path, GUEST).with_context(|| format!("writing {}", script_path.display()))?;
    let pairs: Vec<String> = builds
        .iter()
        .map(|(l, b, f)| vm::shell_quote(&format!("{l}|{}|{f}", b.display())))
        .collect();
    let script = format!(
        "sh {} {runtime} \"$UBLKD_VM_RUN/compare.txt\" {}\n",
        vm::shell_quote(&script_path.to_string_lossy()),
        pairs.join(" ")
    );
    // 4 passes x 3 jobs per build, each its runtime, a ramp second and about 5 s of set-up.
    // Under the instruction clock a busy guest second takes about 5 host seconds.
    let timeout = (180 + builds.len() as u64 * 12 * (runtime + 6))
        * match args.clock {
            vm::Clock::Wall => 1,
            vm::Clock::Instructions => 5,
        };
    eprintln!(
        "xtask: compare: {} builds x 3 jobs x 4 passes of {runtime} s, in one boot of {}, {} clock",
        builds.len(),
        kernel.kver,
        args.clock.as_str()
    );
    let run = Vm::new(ws, &kernel)?
        .clock(args.clock)
        .timeout_secs(timeout)
        .run(&script)?;
    let text = fs::read_to_string(run.run_dir.join("compare.txt")).unwrap_or_default();
    let rows = parse(&text);
    let labels: Vec<&str> = builds.iter().map(|(l, _, _)| l.as_str()).collect();
    print!("{}", table(&rows, &labels));
    let json = serde_json::json!({
        "builds": builds.iter().map(|(l, b, f)| serde_json::json!({"label": l, "binary": b, "flags": f})).collect::<Vec<_>>(),
        "runtime_s": runtime,
        "clock": args.clock.as_str(),
        "runs": rows.iter().map(|r| serde_json::json!({
            "build": r.label, "rw": r.rw, "iops": r.iops, "queue_cpus": r.map, "cpu_busy": r.busy,
            "per_io": r.trace,
        })).collect::<Vec<_>>(),
    });
    let out = ws.join("target/compare/results.json");
    fs::write(&out, serde_json::to_string_pretty(&json)? + "\n")
        .with_context(|| format!("writing {}", out.display()))?;
    println!("wrote {}", out.display());
    let complete = labels.iter().all(|l| {
        rows.iter()
            .filter(|r| r.label == *l && r.iops.is_some())
            .count()
            == 12
    });
    if run.exit != vm::Exit::Code(0) || !complete {
        println!(
            "compare: guest {}, runs incomplete; logs kept in {}\n{}",
            run.exit,
            run.run_dir.display(),
            run.console_tail(30)
        );
        return Ok(ExitCode::FAILURE);
    }
    let _ = fs::remove_dir_all(&run.run_dir); // A leftover run directory is only disk space.
    Ok(ExitCode::SUCCESS)
}

/// The label and binary of `rev`, built once per commit (`work`: the working tree, rebuilt).
/// `cargo xtask bench --baseline` builds its baseline here too, into the same cache.
pub(crate) fn build(ws: &Path, rev: &str) -> Result<(String, PathBuf)> {
    let root = ws.join("target/compare");
    if rev == "work" {
        let status = crate::cargo()
            .current_dir(ws)
            .args(["build", "--release", "--package", "ublkd-server"])
            .status()
            .context("running cargo build --release")?;
        if !status.success() {
            bail!("building the working tree's ublkd failed ({status})");
        }
        return Ok(("work".into(), ws.join("target/release/ublkd")));
    }
    let out = Command::new("git")
        .current_dir(ws)
        .args(["rev-parse", "--short=9", &format!("{rev}^{{commit}}")])
        .output()
        .context("running git rev-parse")?;
    if !out.status.success() {
        bail!(
            "{rev} is not a commit: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let sha = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let bin = root.join("bin").join(&sha).join("ublkd");
    if bin.is_file() {
        return Ok((sha, bin));
    }
    let src = root.join("src").join(&sha);
    if !src.join("Cargo.toml").is_file() {
        fs::create_dir_all(root.join("src"))?;
        let status = Command::new("git")
            .current_dir(ws)
            .args(["worktree", "add", "--force", "--detach"])
            .arg(&src)
            .arg(&sha)
            .status()
            .context("running git worktree add")?;
        if !status.success() {
            bail!("git worktree add {sha} failed ({status})");
        }
    }
    eprintln!("xtask: compare: building ublkd at {sha} (release)");
    let status = crate::cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .args(["build", "--release", "--package", "ublkd-server"])
        .status()
        .context("running cargo build --release")?;
    if !status.success() {
        bail!("building ublkd at {sha} failed ({status})");
    }
    fs::create_dir_all(bin.parent().context("no bin dir")?)?;
    fs::copy(root.join("target/release/ublkd"), &bin)
        .with_context(|| format!("keeping the binary of {sha}"))?;
    Ok((sha, bin))
}

/// One fio job of the guest's.
#[derive(Debug, Clone, PartialEq)]
struct Row {
    label: String,
    rw: String,
    iops: Option<f64>,
    map: String,
    busy: String,
    /// `ctx=..,ipi=..,enter=..,enter_ublkd=..` per I/O, or `-`.
    trace: String,
}

/// The guest's lines: `LABEL RW IOPS MAP BUSY [TRACE]` (IOPS `failed` when the run did not
/// happen).
fn parse(text: &str) -> Vec<Row> {
    text.lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() >= 5).then(|| Row {
                label: f[0].to_owned(),
                rw: f[1].to_owned(),
                iops: f[2].parse().ok(),
                map: f[3].trim_end_matches(',').to_owned(),
                busy: f[4].trim_end_matches(',').to_owned(),
                trace: f.get(5).copied().unwrap_or("-").to_owned(),
            })
        })
        .collect()
}

/// Sum of the CPUs' busy shares (`cpu0=53,cpu1=90` is 143).
fn busy_total(busy: &str) -> Option<f64> {
    busy.split(',')
        .map(|kv| kv.split_once('=').and_then(|(_, v)| v.parse::<f64>().ok()))
        .sum()
}

/// One figure of a trace field (`enter=0.512` in `ctx=1.2,enter=0.512`).
fn trace_field(trace: &str, key: &str) -> Option<f64> {
    trace
        .split(',')
        .find_map(|kv| kv.split_once('=').filter(|(k, _)| *k == key))
        .and_then(|(_, v)| v.parse().ok())
}

/// The per-I/O figures the table shows, in its order.
const TRACE_KEYS: [&str; 4] = ["ctx", "ipi", "enter", "enter_ublkd"];

/// Per build and job: the IOPS of each run, the CPUs' busy total of each, and each trace figure.
#[derive(Debug, Default)]
struct Runs {
    iops: Vec<f64>,
    busy: Vec<f64>,
    trace: BTreeMap<&'static str, Vec<f64>>,
}

/// Per build and job: mean IOPS, every run, the mean of all CPUs' busy share, and the ratio of
/// the mean to the first build's.
fn table(rows: &[Row], labels: &[&str]) -> String {
    let mut stats: BTreeMap<(&str, &str), Runs> = BTreeMap::new();
    for r in rows {
        let e = stats.entry((r.label.as_str(), r.rw.as_str())).or_default();
        if let Some(i) = r.iops {
            e.iops.push(i);
        }
        if let Some(b) = busy_total(&r.busy) {
            e.busy.push(b);
        }
        for k in TRACE_KEYS {
            if let Some(v) = trace_field(&r.trace, k) {
                e.trace.entry(k).or_default().push(v);
            }
        }
    }
    let mean = |v: &[f64]| (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64);
    let mut out = String::from(
        "build       job          mean  ratio  CPUs busy  per I/O: ctx   IPIs  enters (ublkd)  runs (IOPS; randread-qd1: latency in us)\n",
    );
    for rw in ["randread", "randwrite", "randread-qd1"] {
        let base = stats.get(&(labels[0], rw)).and_then(|s| mean(&s.iops));
        for l in labels {
            let Some(Runs { iops, busy, trace }) = stats.get(&(*l, rw)) else {
                out.push_str(&format!("{l:<11} {rw:<12} no runs\n"));
                continue;
            };
            let m = mean(iops);
            let ratio = match (m, base) {
                (Some(m), Some(b)) if b > 0.0 => format!("{:.2}", m / b),
                _ => "-".into(),
            };
            let runs: Vec<String> = iops.iter().map(|i| format!("{i:.0}")).collect();
            let t = |k: &str| {
                trace
                    .get(k)
                    .and_then(|v| mean(v))
                    .map_or("-".into(), |v| format!("{v:.2}"))
            };
            out.push_str(&format!(
                "{l:<11} {rw:<12} {:>7}  {ratio:>5}  {:>8}  {:>12} {:>6} {:>7} {:>7}  {}\n",
                m.map_or("-".into(), |m| format!("{m:.0}")),
                mean(busy).map_or("-".into(), |b| format!("{b:.0} %")),
                t("ctx"),
                t("ipi"),
                t("enter"),
                format!("({})", t("enter_ublkd")),
                runs.join(" ")
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_guests_lines_become_a_table_against_the_first_build() {
        let text = "a randread 100 0:1,1:0, cpu0=50,cpu1=50,\n\
                    b randread 250 0:1,1:0, cpu0=80,cpu1=70, ctx=1.5,ipi=0.5,enter=2.0,enter_ublkd=1.0\n\
                    b randread 150 0:1,1:0, cpu0=80,cpu1=70,\n\
                    a randwrite failed - -\n\
                    junk\n";
        let rows = parse(text);
        assert_eq!(rows.len(), 4, "{rows:?}");
        assert_eq!(rows[0].map, "0:1,1:0");
        assert_eq!(rows[3].iops, None);
        assert_eq!(busy_total(&rows[1].busy), Some(150.0));
        assert_eq!(busy_total("-"), None);
        let t = table(&rows, &["a", "b"]);
        assert!(
            t.contains("b           randread         200   2.00     150 %          1.50   0.50    2.00  (1.00)  250 150"),
            "{t}"
        );
        assert_eq!(trace_field(&rows[1].trace, "ipi"), Some(0.5));
        assert_eq!(trace_field(&rows[0].trace, "ipi"), None);
        assert!(t.contains("a           randwrite          -      -"), "{t}");
        assert!(t.contains("b           randwrite    no runs"), "{t}");
    }
}
