//! The bench's guest side: this same xtask binary, run in the VM as `xtask bench-guest INPUT`
//! over the host's root. [`steps`] turns the [`Input`] into the ordered list of cases, and
//! [`main`] runs them: the fio cases in `devices` (on `fio`), the node service's sections in
//! `service` (control plane, CSI), `features` (QoS, snapshots) and `recovery` (kill -9, I/O
//! stall), all on the helpers of `proc`. Each step's [`Case`] goes into the [`Results`] that the
//! host reads back, rewritten in the run directory after every step.

/// [`proc::note`] of `format!(ARGS)`.
macro_rules! note {
    ($($args:tt)*) => {
        $crate::bench::guest::proc::note(&format!($($args)*))
    };
}

mod devices;
mod features;
mod fio;
mod proc;
mod recovery;
mod service;

use super::cases::{
    ab_order, recovery_run, Build, Server, UBackend, CONTROL_RUN, CSI_RUN, QOS_RUN,
    RECOVERY_VOLUMES, RUNS, SNAPSHOT_RUN, STALL_RUN, WARMUP_SUFFIX,
};
use super::results::{Bin, Input, Results, RESULTS_FILE};
use anyhow::{Context, Result};
use devices::FioCase;
use std::fs;
use std::path::{Path, PathBuf};

/// One thing the guest does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ext4 on the NVMe namespace with the backing file of the file cases, written in full.
    PrepareBacking,
    /// That file system unmounted, before anything uses the namespace itself.
    UnmountBacking,
    /// A case that cannot run (its run, and why): it measures nothing, and says why.
    Fail(String, String),
    /// A fio case: its server set up, measured, torn down.
    Fio(FioCase),
    /// The node service's sections: control plane, CSI, QoS, snapshots, recovery of N volumes,
    /// the I/O stall.
    Control,
    Csi,
    Qos,
    Snapshot,
    Recovery(usize),
    Stall,
}

/// What the guest does for `input`: every selected fio run (each ublkd run four times after a
/// warm-up with a baseline), then, without `--only`, the node service's sections. A case whose
/// binary is missing is a [`Step::Fail`] saying why.
pub fn steps(input: &Input) -> Vec<Step> {
    let plan = &input.plan;
    let fail = |run: &str, why: &str| Step::Fail(run.into(), why.into());
    let mut out = vec![Step::PrepareBacking];
    let mut unmounted = false;
    let mut ab_cases = 0;
    let ublkd = input.ublkd.as_ref().map(drop);
    let kublk = input.kublk.as_ref().map(drop);
    for run in RUNS.iter().filter(|r| plan.selected(r.id)) {
        let (nvme, bin) = match run.server {
            Server::RawNvme { .. } | Server::DmLinear => (true, Ok(())),
            Server::Ublkd { backend, .. } => (backend == UBackend::Nvme, ublkd),
            Server::Luks2File => (false, ublkd),
            Server::Kublk { backend, .. } => (backend == UBackend::Nvme, kublk),
            Server::Loop | Server::NullBlk => (false, Ok(())),
        };
        if nvme && !unmounted {
            out.push(Step::UnmountBacking);
            unmounted = true;
        }
        let fio = |suffix: &str, build, warmup| {
            let (run, server) = (format!("{}{suffix}", run.id), run.server);
            Step::Fio(FioCase {
                run,
                server,
                build,
                warmup,
            })
        };
        match bin {
            Err(e) => out.push(fail(run.id, e)),
            // A discarded warm-up, then A B B A (or B A A B).
            Ok(()) if plan.ab(run) => {
                let order = ab_order(ab_cases);
                ab_cases += 1;
                out.push(fio(WARMUP_SUFFIX, order[0].1, true));
                out.extend(order.map(|(suffix, build)| fio(suffix, build, false)));
            }
            Ok(()) => out.push(fio("", Build::New, false)),
        }
    }
    if !unmounted {
        out.push(Step::UnmountBacking);
    }
    if !plan.sections() {
        return out;
    }
    let node = input.ublkd.as_ref().and(input.ublkctl.as_ref());
    let section = |run: &str, step: Step, also: Option<&Bin>| match (node, also) {
        (Err(e), _) | (_, Some(Err(e))) => fail(run, e),
        _ => step,
    };
    out.push(section(CONTROL_RUN, Step::Control, None));
    out.push(section(CSI_RUN, Step::Csi, Some(&input.csi)));
    out.push(section(QOS_RUN, Step::Qos, None));
    out.push(section(SNAPSHOT_RUN, Step::Snapshot, None));
    // Crash recovery last: each run its own daemon, state and socket, torn down before the next.
    for n in RECOVERY_VOLUMES {
        out.push(section(&recovery_run(n), Step::Recovery(n), None));
    }
    out.push(section(STALL_RUN, Step::Stall, None));
    out
}

/// The script the guest's init runs: this binary, over the host's root, on `input` (a file in
/// the run directory).
pub fn script(xtask: &Path, input: &Path) -> String {
    let quote = crate::vm::quoted;
    format!("exec {} bench-guest {}\n", quote(xtask), quote(input))
}

/// `xtask bench-guest INPUT`, in the guest: every step, each one's [`Case`] written into the
/// run directory's results as it ends. Fails only when the input cannot be read or the results
/// cannot be written; a case that fails says so in its own [`Case`].
pub fn main(input: &Path) -> Result<()> {
    let text = fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let input: Input =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", input.display()))?;
    let out = PathBuf::from(std::env::var_os("UBLKD_VM_RUN").context("UBLKD_VM_RUN is not set")?);
    let kernel = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let cpus = std::thread::available_parallelism().map_or(0, usize::from);
    proc::note(&format!("guest kernel {}, {cpus} CPUs", kernel.trim()));
    let (steps, tmp) = (steps(&input), std::env::temp_dir());
    let g = proc::Guest { out, tmp, input };
    let mut results = Results::default();
    let mut backing: Option<PathBuf> = None;
    for step in steps {
        let (run, case) = match step {
            Step::PrepareBacking => {
                backing = devices::prepare_backing(&g);
                continue;
            }
            Step::UnmountBacking => {
                if backing.take().is_some() {
                    devices::unmount_backing(&g);
                }
                continue;
            }
            Step::Fail(run, why) => (run.clone(), proc::failed(&run, why)),
            Step::Fio(f) => {
                let case = devices::fio_case(&g, &f, backing.as_deref());
                (f.run, case)
            }
            Step::Control => (CONTROL_RUN.into(), service::control_case(&g)),
            Step::Csi => (CSI_RUN.into(), service::csi_case(&g)),
            Step::Qos => (QOS_RUN.into(), features::qos_case(&g)),
            Step::Snapshot => (SNAPSHOT_RUN.into(), features::snapshot_case(&g)),
            Step::Recovery(n) => (recovery_run(n), recovery::recovery_case(&g, n)),
            Step::Stall => (STALL_RUN.into(), recovery::stall_case(&g)),
        };
        results.0.insert(run, case);
        // Whole after every step: a guest that dies keeps what it measured.
        let path = g.out.join(RESULTS_FILE);
        let tmp = path.with_extension("tmp");
        fs::write(&tmp, serde_json::to_string_pretty(&results)? + "\n")
            .and_then(|()| fs::rename(&tmp, &path))
            .with_context(|| format!("writing {}", path.display()))?;
    }
    proc::note("done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::cases::Plan;

    /// The steps for `plan` with the binaries `bins` (kublk, ublkd, ublkctl, ublkd-csi; the empty
    /// path stands for a failed build), each step in a few words.
    fn steps_of(plan: Plan, bins: [&str; 4]) -> Vec<String> {
        let [kublk, ublkd, ublkctl, csi] = bins.map(|b| match b {
            "" => Err("not built".to_owned()),
            b => Ok(PathBuf::from(b)),
        });
        let input = Input {
            runtime: 5,
            plan,
            kublk,
            ublkd,
            ublkctl,
            csi,
            count_syscalls: false,
        };
        let word = |s: Step| match s {
            Step::Fail(run, why) => format!("{run}: {why}"),
            Step::Fio(FioCase {
                run,
                build: Build::Baseline,
                warmup,
                ..
            }) => format!("{run} B {warmup}"),
            Step::Fio(FioCase { run, warmup, .. }) => format!("{run} {warmup}"),
            Step::Recovery(n) => recovery_run(n),
            other => format!("{other:?}"),
        };
        steps(&input).into_iter().map(word).collect()
    }

    #[test]
    fn every_case_runs_in_order_and_missing_binaries_are_reported() {
        // Every run once in RUNS' order, kublk's saying it was not built; the backing file made
        // first, its file system gone after the last file case and before anything uses the
        // namespace itself; the sections last.
        let s = steps_of(Plan::default(), ["", "/u", "/c", ""]);
        let (u, runs) = (s.iter().position(|x| x == "UnmountBacking"), RUNS.len());
        let run = |x: &String| x.split([' ', ':']).next().unwrap_or_default().to_owned();
        let ran = s[1..=runs + 1].iter().filter(|x| *x != "UnmountBacking");
        let ids: Vec<&str> = RUNS.iter().map(|r| r.id).collect();
        assert_eq!(ran.map(run).collect::<Vec<_>>(), ids);
        let mut kublk = s.iter().filter(|x| x.starts_with("kublk"));
        assert!(kublk.clone().count() == 9 && kublk.all(|x| x.ends_with("not built")));
        let u = u.expect("the backing file system unmounted");
        assert_eq!(s[0], "PrepareBacking");
        assert_eq!(s[u - 1], "kublk-loop-file-zc: not built");
        assert_eq!(s[u + 1], "ublkd-nvme-poll false");
        let sections = "Control,ublkd-csi: not built,Qos,Snapshot,ublkd-recovery-1,\
                        ublkd-recovery-16,ublkd-recovery-64,Stall";
        assert_eq!(s[runs + 2..].join(","), sections);
        // Without ublkd, its runs and every section say so; without ublkctl, the sections.
        let failed = |s: Vec<String>| s.iter().filter(|x| x.ends_with("not built")).count();
        assert_eq!(
            failed(steps_of(Plan::default(), ["/k", "", "/c", "/s"])),
            9 + 8
        );
        assert_eq!(failed(steps_of(Plan::default(), ["/k", "/u", "", "/s"])), 8);
        let args = |i: usize| devices::args(RUNS[i].server);
        assert_eq!(args(8), "-t null -q 2 -d 128 -b --auto_zc");
        assert_eq!(args(14), "-t loop -q 2 -d 128 --auto_zc");
        let zc = "--queues 2 --depth 128 --io-path batch --zero-copy on --poll off";
        assert_eq!(args(7), zc);
    }

    #[test]
    fn a_baseline_runs_each_selected_ublkd_case_a_b_b_a_after_a_warm_up() {
        let plan = Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/c/bin/fdc00eb/ublkd".into())),
        };
        // The next ublkd case runs B A A B, its warm-up with the baseline; the selected peers
        // run once; what --only leaves out, and the sections, do not run.
        let expected = [
            "PrepareBacking",
            "ublkd-null-batch~warm true",
            "ublkd-null-batch false",
            "ublkd-null-batch~base B false",
            "ublkd-null-batch~base2 B false",
            "ublkd-null-batch~2 false",
            "kublk-null-batch false",
            "ublkd-null-batch-zc~warm B true",
            "ublkd-null-batch-zc~base B false",
            "ublkd-null-batch-zc false",
            "ublkd-null-batch-zc~2 false",
            "ublkd-null-batch-zc~base2 B false",
            "kublk-null-batch-zc false",
            "UnmountBacking",
        ];
        assert_eq!(steps_of(plan, ["/k", "/u", "/c", "/s"]), expected);
        let script = script(Path::new("/w/xtask"), Path::new("/r/bench input.json"));
        assert_eq!(script, "exec /w/xtask bench-guest '/r/bench input.json'\n");
    }
}
