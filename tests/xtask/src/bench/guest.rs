//! The bench's guest side: this same xtask binary, run in the VM as `xtask bench-guest INPUT`
//! over the host's root. [`steps`] turns the [`Input`] into the ordered list of cases, and
//! [`main`] runs them: the fio cases in `devices` (on `fio`), the node service's sections in
//! `service` (control plane, CSI), `features` (QoS, snapshots) and `recovery` (kill -9, I/O
//! stall), all on the helpers of `proc`. Each step's [`Case`] goes into the [`Results`] that the
//! host reads back, rewritten in the run directory after every step.

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
use super::results::{Bin, Case, Input, Results, RESULTS_FILE};
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// One thing the guest does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ext4 on the NVMe namespace with the backing file of the file cases, written in full.
    PrepareBacking,
    /// That file system unmounted, before anything uses the namespace itself.
    UnmountBacking,
    /// A case that cannot run: it measures nothing, and says why.
    Fail {
        run: String,
        why: String,
    },
    /// A fio case on `server` (for ublkd, `build`'s binary); a `warmup` runs one discarded job
    /// instead of the workloads.
    Fio {
        run: String,
        server: Server,
        build: Build,
        warmup: bool,
    },
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
    let fail = |run: &str, why: &str| Step::Fail {
        run: run.to_owned(),
        why: why.to_owned(),
    };
    let mut out = vec![Step::PrepareBacking];
    let mut unmounted = false;
    let mut ab_cases = 0;
    for run in RUNS.iter().filter(|r| plan.selected(r.id)) {
        let (nvme, bin) = match run.server {
            Server::RawNvme { .. } => (true, Ok(())),
            Server::Ublkd { backend, .. } => {
                (backend == UBackend::Nvme, input.ublkd.as_ref().map(drop))
            }
            Server::Kublk { .. } => (false, input.kublk.as_ref().map(drop)),
            Server::Loop | Server::NullBlk => (false, Ok(())),
        };
        if nvme && !unmounted {
            out.push(Step::UnmountBacking);
            unmounted = true;
        }
        let fio = |suffix: &str, build, warmup| Step::Fio {
            run: format!("{}{suffix}", run.id),
            server: run.server,
            build,
            warmup,
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
    format!(
        "exec {} bench-guest {}\n",
        crate::vm::shell_quote(&xtask.to_string_lossy()),
        crate::vm::shell_quote(&input.to_string_lossy())
    )
}

/// `xtask bench-guest INPUT`, in the guest: every step, each one's [`Case`] written into the
/// run directory's results as it ends. Fails only when the input cannot be read or the results
/// cannot be written; a case that fails says so in its own [`Case`].
pub fn main(input: &Path) -> Result<()> {
    let text = fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let input: Input =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", input.display()))?;
    let out = PathBuf::from(std::env::var_os("UBLKD_VM_RUN").context("UBLKD_VM_RUN is not set")?);
    let g = proc::Guest::new(input.clone(), out.clone());
    proc::note(&format!(
        "guest kernel {}, {} CPUs",
        fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        std::thread::available_parallelism().map_or(0, usize::from)
    ));
    let mut results = Results::default();
    let mut backing: Option<PathBuf> = None;
    for step in steps(&input) {
        let (case, run): (Case, String) = match step {
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
            Step::Fail { run, why } => (proc::failed(&run, why), run),
            Step::Fio {
                run,
                server,
                build,
                warmup,
            } => {
                let case = devices::fio_case(&g, &run, server, build, warmup, backing.as_deref());
                (case, run)
            }
            Step::Control => (service::control_case(&g), CONTROL_RUN.into()),
            Step::Csi => (service::csi_case(&g), CSI_RUN.into()),
            Step::Qos => (features::qos_case(&g), QOS_RUN.into()),
            Step::Snapshot => (features::snapshot_case(&g), SNAPSHOT_RUN.into()),
            Step::Recovery(n) => (recovery::recovery_case(&g, n), recovery_run(n)),
            Step::Stall => (recovery::stall_case(&g), STALL_RUN.into()),
        };
        results.0.insert(run, case);
        // Whole after every step: a guest that dies keeps what it measured.
        let path = out.join(RESULTS_FILE);
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

    fn input(kublk: Bin, ublkd: Bin, ublkctl: Bin, csi: Bin) -> Input {
        Input {
            runtime: 5,
            plan: Plan::default(),
            kublk,
            ublkd,
            ublkctl,
            csi,
        }
    }

    fn all_binaries(plan: Plan) -> Input {
        let ok = |p: &str| Ok(p.into());
        let i = input(
            ok("/k/kublk"),
            ok("/t/ublkd"),
            ok("/t/ublkctl"),
            ok("/t/csi"),
        );
        Input { plan, ..i }
    }

    fn at(steps: &[Step], step: &Step) -> usize {
        steps
            .iter()
            .position(|s| s == step)
            .unwrap_or_else(|| panic!("no {step:?} in {steps:#?}"))
    }

    /// Where the fio step of `run` (a run id and a suffix) is, checking its build and warm-up.
    fn fio(steps: &[Step], run: &str, build: Build, warmup: bool) -> usize {
        let id = run.split('~').next().unwrap_or(run);
        let server = RUNS.iter().find(|r| r.id == id).map(|r| r.server).unwrap();
        let run = run.into();
        at(
            steps,
            &Step::Fio {
                run,
                server,
                build,
                warmup,
            },
        )
    }

    fn fail(run: &str, why: &str) -> Step {
        Step::Fail {
            run: run.into(),
            why: why.into(),
        }
    }

    #[test]
    fn every_case_runs_and_missing_binaries_are_reported() {
        let ok = |p: &str| Ok(p.into());
        let s = steps(&input(
            ok("/k"),
            Err("building ublkd failed".into()),
            ok("/c"),
            ok("/s"),
        ));
        let kublk = fio(&s, "kublk-null-batch-zc", Build::New, false);
        assert_eq!(
            devices::args(RUNS[8].server),
            "-t null -q 2 -d 128 -b --auto_zc"
        );
        at(&s, &fail("ublkd-null-per-io", "building ublkd failed"));
        at(&s, &fail(CONTROL_RUN, "building ublkd failed"));
        at(&s, &fail(STALL_RUN, "building ublkd failed"));
        let lp = fio(&s, "loop-dio", Build::New, false);
        assert!(fio(&s, "null_blk", Build::New, false) < kublk);

        let s = steps(&input(Err("no kublk".into()), ok("/u"), ok("/c"), ok("/s")));
        fio(&s, "ublkd-null-batch-zc", Build::New, false);
        assert_eq!(
            devices::args(RUNS[7].server),
            "--queues 2 --depth 128 --io-path batch --zero-copy on --poll off"
        );
        at(&s, &fail("kublk-null", "no kublk"));
        // The backing file is made first; its file system is gone before anything uses the
        // namespace itself, and after the last file case.
        assert_eq!(s[0], Step::PrepareBacking);
        let um = at(&s, &Step::UnmountBacking);
        let file_copy = fio(&s, "ublkd-file-copy", Build::New, false);
        let passthru = fio(&s, "fio-ng0n1-passthru", Build::New, false);
        assert!(lp < um && file_copy < um && um < passthru);
        // The node service's sections come after every fio case, recovery last.
        let order = [
            Step::Control,
            Step::Csi,
            Step::Qos,
            Step::Snapshot,
            Step::Recovery(1),
            Step::Recovery(16),
            Step::Recovery(64),
            Step::Stall,
        ];
        let places: Vec<usize> = order.iter().map(|x| at(&s, x)).collect();
        assert!(places.windows(2).all(|w| w[0] < w[1]), "{places:?}");
        let last_fio = s.iter().rposition(|x| matches!(x, Step::Fio { .. }));
        assert!(last_fio < Some(places[0]));

        // Without ublkctl, every section says so; without ublkd-csi, only the CSI run.
        let no_ctl = Err("building ublkctl failed".into());
        let s = steps(&input(ok("/k"), ok("/u"), no_ctl, ok("/s")));
        for run in [
            CONTROL_RUN,
            CSI_RUN,
            QOS_RUN,
            SNAPSHOT_RUN,
            "ublkd-recovery-64",
            STALL_RUN,
        ] {
            at(&s, &fail(run, "building ublkctl failed"));
        }
        assert!(!s.contains(&Step::Control) && !s.contains(&Step::Stall));
        let s = steps(&input(ok("/k"), ok("/u"), ok("/c"), Err("no csi".into())));
        at(&s, &fail(CSI_RUN, "no csi"));
        at(&s, &Step::Control);
    }

    #[test]
    fn a_baseline_runs_each_selected_ublkd_case_a_b_b_a_after_a_warm_up() {
        let s = steps(&all_binaries(Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/c/bin/fdc00eb/ublkd".into())),
        }));
        let b =
            |run: &str, build, warmup| fio(&s, &format!("ublkd-null-batch{run}"), build, warmup);
        let (w, a1, b1, b2, a2) = (
            b("~warm", Build::New, true),
            b("", Build::New, false),
            b("~base", Build::Baseline, false),
            b("~base2", Build::Baseline, false),
            b("~2", Build::New, false),
        );
        assert!(w < a1 && a1 < b1 && b1 < b2 && b2 < a2);
        // The next ublkd case runs B A A B, its warm-up with the baseline.
        let z = |run: &str, build, warmup| b(&format!("-zc{run}"), build, warmup);
        let (w, b1, a1, a2, b2) = (
            z("~warm", Build::Baseline, true),
            z("~base", Build::Baseline, false),
            z("", Build::New, false),
            z("~2", Build::New, false),
            z("~base2", Build::Baseline, false),
        );
        assert!(w < b1 && b1 < a1 && a1 < a2 && a2 < b2);
        // The selected peers run once; what --only leaves out, and the sections, do not run.
        let runs: Vec<&str> = s
            .iter()
            .filter_map(|x| match x {
                Step::Fio { run, .. } => Some(run.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(runs.len(), 2 * 5 + 2, "{runs:?}");
        assert!(runs.contains(&"kublk-null-batch") && runs.contains(&"kublk-null-batch-zc"));
        assert!(!s
            .iter()
            .any(|x| matches!(x, Step::Control | Step::Stall | Step::Qos)));
    }

    #[test]
    fn the_script_runs_this_binary_on_the_input() {
        assert_eq!(
            script(
                Path::new("/w/target/debug/xtask"),
                Path::new("/r/bench input.json")
            ),
            "exec /w/target/debug/xtask bench-guest '/r/bench input.json'\n"
        );
    }
}
