//! The bench's guest side. The host writes what the guest needs to know ([`Input`]: seconds per
//! fio job, the `--only`/`--baseline` plan, where each binary is or why it is missing) into the
//! run directory, and the guest runs this same xtask binary (`xtask bench-guest INPUT`) over the
//! host's root. [`steps`] turns the input into the ordered list of cases, one [`Step`] each, and
//! [`main`] runs them: the fio cases in `devices`, the node service's sections in `service`
//! (control plane, CSI), `features` (QoS, snapshots) and `recovery` (kill -9, I/O stall), all on
//! the helpers of `proc`. Every case writes its raw results into `<run dir>/<case>/`, which
//! `collect` reads on the host.

mod devices;
mod features;
mod proc;
mod recovery;
mod service;

use super::cases::{
    ab_order, recovery_run, Build, Plan, Server, UBackend, CONTROL_RUN, CSI_RUN, DEPTH, QOS_RUN,
    QUEUES, RECOVERY_VOLUMES, RUNS, SNAPSHOT_RUN, STALL_RUN, WARMUP_SUFFIX,
};
use anyhow::{Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};

/// A binary the guest runs, or why there is none.
pub type Bin = Result<PathBuf, String>;

/// What the host tells the guest.
#[derive(Debug, Clone)]
pub struct Input {
    /// Seconds each fio job measures.
    pub runtime: u64,
    pub plan: Plan,
    pub kublk: Bin,
    pub ublkd: Bin,
    pub ublkctl: Bin,
    pub csi: Bin,
}

impl Input {
    pub fn to_json(&self) -> Value {
        let bin = |b: &Bin| match b {
            Ok(p) => json!({ "path": p }),
            Err(e) => json!({ "missing": e }),
        };
        json!({
            "runtime": self.runtime,
            "only": self.plan.only,
            "baseline": self.plan.baseline.as_ref().map(|(label, bin)| json!({ "label": label, "bin": bin })),
            "kublk": bin(&self.kublk),
            "ublkd": bin(&self.ublkd),
            "ublkctl": bin(&self.ublkctl),
            "csi": bin(&self.csi),
        })
    }

    pub fn from_json(v: &Value) -> Result<Self> {
        let bin = |key: &str| -> Result<Bin> {
            let b = &v[key];
            match (b["path"].as_str(), b["missing"].as_str()) {
                (Some(p), _) => Ok(Ok(PathBuf::from(p))),
                (None, Some(e)) => Ok(Err(e.to_owned())),
                _ => anyhow::bail!("no path and no reason for {key} in {b}"),
            }
        };
        let baseline = match &v["baseline"] {
            Value::Null => None,
            b => Some((
                b["label"]
                    .as_str()
                    .context("baseline without a label")?
                    .to_owned(),
                PathBuf::from(b["bin"].as_str().context("baseline without a binary")?),
            )),
        };
        Ok(Self {
            runtime: v["runtime"].as_u64().context("no runtime")?,
            plan: Plan {
                only: v["only"].as_str().map(str::to_owned),
                baseline,
            },
            kublk: bin("kublk")?,
            ublkd: bin("ublkd")?,
            ublkctl: bin("ublkctl")?,
            csi: bin("csi")?,
        })
    }
}

/// One thing the guest does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// ext4 on the NVMe namespace with the backing file of the file cases, written in full.
    PrepareBacking,
    /// That file system unmounted, before anything uses the namespace itself.
    UnmountBacking,
    /// A case that cannot run: its directory gets `error` with `why`.
    Fail {
        run: String,
        why: String,
    },
    NullBlk {
        run: String,
    },
    /// A loop device with direct I/O on the backing file.
    Loop {
        run: String,
    },
    /// `kublk add ARGS`.
    Kublk {
        run: String,
        args: Vec<String>,
    },
    /// fio on the namespace itself: passthrough on `/dev/ng0n1`, or io_uring on `/dev/nvme0n1`.
    RawNvme {
        run: String,
        passthru: bool,
    },
    /// `ublkd run` with `backend` and `args`, by `build`'s binary; a `warmup` runs one discarded
    /// job instead of the workloads.
    Ublkd {
        run: String,
        build: Build,
        backend: UBackend,
        args: Vec<String>,
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
        let id = run.id.to_owned();
        let on_namespace = matches!(
            run.server,
            Server::RawNvme { .. }
                | Server::Ublkd {
                    backend: UBackend::Nvme,
                    ..
                }
        );
        if on_namespace && !unmounted {
            out.push(Step::UnmountBacking);
            unmounted = true;
        }
        match run.server {
            Server::NullBlk => out.push(Step::NullBlk { run: id }),
            Server::Loop => out.push(Step::Loop { run: id }),
            Server::RawNvme { passthru } => out.push(Step::RawNvme { run: id, passthru }),
            Server::Kublk { batch, auto_zc } => match &input.kublk {
                Err(e) => out.push(fail(&id, e)),
                Ok(_) => {
                    let mut args: Vec<String> = ["-t", "null", "-q", &QUEUES.to_string()]
                        .iter()
                        .map(|s| s.to_string())
                        .collect();
                    args.extend(["-d".to_owned(), DEPTH.to_string()]);
                    if batch {
                        args.push("-b".into());
                    }
                    if auto_zc {
                        args.push("--auto_zc".into());
                    }
                    out.push(Step::Kublk { run: id, args });
                }
            },
            Server::Ublkd {
                backend,
                io_path,
                zero_copy,
                poll,
            } => {
                if let Err(e) = &input.ublkd {
                    out.push(fail(&id, e));
                    continue;
                }
                let on = |b: bool| if b { "on" } else { "off" };
                let args: Vec<String> = [
                    "--queues",
                    &QUEUES.to_string(),
                    "--depth",
                    &DEPTH.to_string(),
                    "--io-path",
                    io_path,
                    "--zero-copy",
                    on(zero_copy),
                    "--poll",
                    on(poll),
                ]
                .iter()
                .map(|s| s.to_string())
                .collect();
                let one = |suffix: &str, build: Build, warmup: bool| Step::Ublkd {
                    run: format!("{id}{suffix}"),
                    build,
                    backend,
                    args: args.clone(),
                    warmup,
                };
                if plan.baseline.is_some() {
                    // A discarded warm-up, then A B B A (or B A A B).
                    let order = ab_order(ab_cases);
                    ab_cases += 1;
                    out.push(one(WARMUP_SUFFIX, order[0].1, true));
                    for (suffix, build) in order {
                        out.push(one(suffix, build, false));
                    }
                } else {
                    out.push(one("", Build::New, false));
                }
            }
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

/// `xtask bench-guest INPUT`, in the guest: every step, each case's outcome in its directory.
/// Fails only when the input cannot be read; a case that fails says so in its own files.
pub fn main(input: &Path) -> Result<()> {
    let text =
        std::fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let input = Input::from_json(&serde_json::from_str(&text)?)?;
    let out = PathBuf::from(std::env::var_os("UBLKD_VM_RUN").context("UBLKD_VM_RUN is not set")?);
    let g = proc::Guest::new(&input, out);
    proc::note(&format!(
        "guest kernel {}, {} CPUs",
        std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim(),
        std::thread::available_parallelism().map_or(0, usize::from)
    ));
    let mut backing: Option<PathBuf> = None;
    for step in steps(&input) {
        match step {
            Step::PrepareBacking => backing = devices::prepare_backing(&g),
            Step::UnmountBacking => {
                if backing.take().is_some() {
                    devices::unmount_backing(&g);
                }
            }
            Step::Fail { run, why } => g.fail_case(&run, &why),
            Step::NullBlk { run } => devices::nullblk_case(&g, &run),
            Step::Loop { run } => match &backing {
                Some(file) => devices::loop_case(&g, &run, file),
                None => g.fail_case(&run, &g.no_backing()),
            },
            Step::Kublk { run, args } => devices::kublk_case(&g, &run, &args),
            Step::RawNvme { run, passthru } => devices::raw_nvme_case(&g, &run, passthru),
            Step::Ublkd {
                run,
                build,
                backend,
                args,
                warmup,
            } => devices::ublkd_case(&g, &run, build, backend, &args, warmup, backing.as_deref()),
            Step::Control => service::control_case(&g),
            Step::Csi => service::csi_case(&g),
            Step::Qos => features::qos_case(&g),
            Step::Snapshot => features::snapshot_case(&g),
            Step::Recovery(n) => recovery::recovery_case(&g, n),
            Step::Stall => recovery::stall_case(&g),
        }
    }
    proc::note("done");
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn input(plan: Plan, kublk: Bin, ublkd: Bin, ublkctl: Bin) -> Input {
        Input {
            runtime: 5,
            plan,
            kublk,
            ublkd,
            ublkctl,
            csi: Ok("/t/ublkd-csi".into()),
        }
    }

    fn all_binaries(plan: Plan) -> Input {
        input(
            plan,
            Ok("/k/kublk".into()),
            Ok("/t/ublkd".into()),
            Ok("/t/ublkctl".into()),
        )
    }

    fn at(steps: &[Step], step: &Step) -> usize {
        steps
            .iter()
            .position(|s| s == step)
            .unwrap_or_else(|| panic!("no {step:?} in {steps:#?}"))
    }

    fn ublkd(run: &str, build: Build, io_path: &str, zc: &str, warmup: bool) -> Step {
        Step::Ublkd {
            run: run.into(),
            build,
            backend: UBackend::Null,
            args: [
                "--queues",
                "2",
                "--depth",
                "128",
                "--io-path",
                io_path,
                "--zero-copy",
                zc,
                "--poll",
                "off",
            ]
            .map(String::from)
            .to_vec(),
            warmup,
        }
    }

    fn fail(run: &str, why: &str) -> Step {
        Step::Fail {
            run: run.into(),
            why: why.into(),
        }
    }

    #[test]
    fn the_input_reads_back_as_written() {
        let mut i = all_binaries(Plan {
            only: Some("null".into()),
            baseline: Some(("fdc00eb".into(), "/c/bin/ublkd".into())),
        });
        i.kublk = Err("building kublk failed: it's gone".into());
        let back = Input::from_json(&i.to_json()).expect("reads back");
        assert_eq!(format!("{back:?}"), format!("{i:?}"));
        let plain = all_binaries(Plan::default());
        let back = Input::from_json(&plain.to_json()).expect("reads back");
        assert_eq!(format!("{back:?}"), format!("{plain:?}"));
    }

    #[test]
    fn every_case_runs_and_missing_binaries_are_reported() {
        let s = steps(&input(
            Plan::default(),
            Ok("/cache/kublk".into()),
            Err("building ublkd failed".into()),
            Ok("/t/ublkctl".into()),
        ));
        let kublk = |run: &str, extra: &[&str]| {
            let mut args: Vec<String> = ["-t", "null", "-q", "2", "-d", "128"]
                .map(String::from)
                .to_vec();
            args.extend(extra.iter().map(|s| s.to_string()));
            Step::Kublk {
                run: run.into(),
                args,
            }
        };
        at(&s, &kublk("kublk-null", &[]));
        at(&s, &kublk("kublk-null-batch", &["-b"]));
        at(&s, &kublk("kublk-null-batch-zc", &["-b", "--auto_zc"]));
        at(&s, &fail("ublkd-null-per-io", "building ublkd failed"));
        at(&s, &fail(CONTROL_RUN, "building ublkd failed"));
        at(&s, &fail(STALL_RUN, "building ublkd failed"));
        at(
            &s,
            &Step::NullBlk {
                run: "null_blk".into(),
            },
        );
        let lp = at(
            &s,
            &Step::Loop {
                run: "loop-dio".into(),
            },
        );

        let s = steps(&input(
            Plan::default(),
            Err("no kublk".into()),
            Ok("/t/ublkd".into()),
            Ok("/t/ublkctl".into()),
        ));
        at(
            &s,
            &ublkd("ublkd-null-batch", Build::New, "batch", "off", false),
        );
        at(
            &s,
            &ublkd("ublkd-null-batch-zc", Build::New, "batch", "on", false),
        );
        at(&s, &fail("kublk-null", "no kublk"));
        // The backing file is made first; its file system is gone before anything uses the
        // namespace itself, and after the last file case.
        assert_eq!(s[0], Step::PrepareBacking);
        let um = at(&s, &Step::UnmountBacking);
        assert!(lp < um);
        let file_copy = s
            .iter()
            .position(|x| matches!(x, Step::Ublkd { run, .. } if run == "ublkd-file-copy"))
            .expect("ublkd-file-copy");
        let passthru = at(
            &s,
            &Step::RawNvme {
                run: "fio-ng0n1-passthru".into(),
                passthru: true,
            },
        );
        assert!(file_copy < um && um < passthru);
        assert!(s.iter().any(|x| matches!(
            x,
            Step::Ublkd { run, backend: UBackend::Nvme, .. } if run == "ublkd-nvme-poll"
        )));
        // The node service's sections come after every fio case, recovery last.
        let control = at(&s, &Step::Control);
        assert!(s.iter().rposition(|x| matches!(x, Step::Ublkd { .. })) < Some(control));
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

        // Without ublkctl, every section says so; without ublkd-csi, only the CSI run.
        let s = steps(&input(
            Plan::default(),
            Err("no kublk".into()),
            Ok("/t/ublkd".into()),
            Err("building ublkctl failed".into()),
        ));
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
        let mut i = all_binaries(Plan::default());
        i.csi = Err("no csi".into());
        let s = steps(&i);
        at(&s, &fail(CSI_RUN, "no csi"));
        at(&s, &Step::Control);
    }

    #[test]
    fn a_baseline_runs_each_selected_ublkd_case_a_b_b_a_after_a_warm_up() {
        let s = steps(&all_binaries(Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/c/bin/fdc00eb/ublkd".into())),
        }));
        let b = |run: &str, build, warmup| at(&s, &ublkd(run, build, "batch", "off", warmup));
        let (w, a1, b1, b2, a2) = (
            b("ublkd-null-batch~warm", Build::New, true),
            b("ublkd-null-batch", Build::New, false),
            b("ublkd-null-batch~base", Build::Baseline, false),
            b("ublkd-null-batch~base2", Build::Baseline, false),
            b("ublkd-null-batch~2", Build::New, false),
        );
        assert!(w < a1 && a1 < b1 && b1 < b2 && b2 < a2);
        // The next ublkd case runs B A A B, its warm-up with the baseline.
        let z = |run: &str, build, warmup| at(&s, &ublkd(run, build, "batch", "on", warmup));
        let (w, b1, a1, a2, b2) = (
            z("ublkd-null-batch-zc~warm", Build::Baseline, true),
            z("ublkd-null-batch-zc~base", Build::Baseline, false),
            z("ublkd-null-batch-zc", Build::New, false),
            z("ublkd-null-batch-zc~2", Build::New, false),
            z("ublkd-null-batch-zc~base2", Build::Baseline, false),
        );
        assert!(w < b1 && b1 < a1 && a1 < a2 && a2 < b2);
        // The selected peers run once; what --only leaves out, and the sections, do not run.
        let kublk = |run: &str| {
            s.iter()
                .filter(|x| matches!(x, Step::Kublk { run: r, .. } if r == run))
                .count()
        };
        assert_eq!((kublk("kublk-null-batch"), kublk("kublk-null")), (1, 0));
        assert!(!s.iter().any(|x| matches!(
            x,
            Step::NullBlk { .. } | Step::Control | Step::Stall | Step::Qos
        )));
        assert!(!s
            .iter()
            .any(|x| matches!(x, Step::Ublkd { run, .. } if run.starts_with("ublkd-file"))));
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
