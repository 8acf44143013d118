//! The script the guest runs: a preamble naming the binaries and settings, the shell functions
//! of `guest.sh`, `run_workloads` made from `WORKLOADS`, `qos_jobs` from `QOS_JOBS`, then one
//! line per case.

use super::cases::{
    ab_order, recovery_run, Build, Plan, Server, UBackend, BACKING_BYTES, CONTROL_DEPTH,
    CONTROL_LOAD_CALLS, CONTROL_METRICS, CONTROL_RUN, CONTROL_SIZE, CONTROL_VOLUMES, CSI_METRICS,
    CSI_PARALLEL, CSI_RUN, CSI_VOLUMES, DEPTH, NULL_BYTES, QOS_JOBS, QOS_METRICS, QOS_QD, QOS_RUN,
    QOS_RUNTIME_SECS, QOS_SIZE, QUEUES, RECOVERY_DEPTH, RECOVERY_METRICS, RECOVERY_SIZE,
    RECOVERY_VOLUMES, RUNS, SNAPSHOT_FILL_MIB, SNAPSHOT_FS_GIB, SNAPSHOT_GIB, SNAPSHOT_METRICS,
    SNAPSHOT_REPEATS, SNAPSHOT_RUN, STALL_KILL_AT_SECS, STALL_RUN, STALL_RUNTIME_SECS, STALL_SIZE,
    WARMUP_SUFFIX, WORKLOADS,
};
use crate::vm;
use std::fmt::Write as _;
use std::path::Path;

/// Shell functions the generated script uses. Each run writes into `$OUT/<run>/`:
/// `error` (setup failed; no numbers), `teardown_error`, and per workload `<wl>.json` (fio),
/// `<wl>.rc` and `<wl>.counters` (`cpu_ticks_before cpu_ticks_after hz ios_before ios_after`,
/// where a tick count is `none` without a server process and `-` when it could not be read).
/// Checked by shellcheck in the host tests (`cargo xtask test`).
const SCRIPT_LIB: &str = include_str!("guest.sh");

/// The script the guest runs: every run of `RUNS`, then the control-plane, CSI, QoS, snapshot
/// and recovery runs, each writing its results into the run directory. `kublk`/`ublkd`/`ublkctl`
/// are the binaries, or why they are missing. `plan` narrows the fio runs (`--only`) and adds the
/// baseline's runs of every ublkd case (`--baseline`, after a warm-up, A B B A or B A A B).
pub fn guest_script(
    runtime: u64,
    plan: &Plan,
    kublk: Result<&Path, &str>,
    ublkd: Result<&Path, &str>,
    ublkctl: Result<&Path, &str>,
    csi: Result<&Path, &str>,
) -> String {
    let q = |p: &Path| vm::shell_quote(&p.to_string_lossy());
    let mut s = String::from("set -u\n");
    let _ = writeln!(s, "RUNTIME={runtime}");
    let _ = writeln!(s, "BACKING_BYTES={BACKING_BYTES}");
    let _ = writeln!(s, "LOAD_CALLS={CONTROL_LOAD_CALLS}");
    let _ = writeln!(s, "KUBLK={}", kublk.map(q).unwrap_or_default());
    let _ = writeln!(s, "UBLKD={}", ublkd.map(q).unwrap_or_default());
    s.push_str("UBLKD_NEW=$UBLKD\n");
    if let Some((_, base)) = &plan.baseline {
        let _ = writeln!(s, "UBLKD_BASE={}", q(base));
    }
    let _ = writeln!(s, "UBLKCTL={}", ublkctl.map(q).unwrap_or_default());
    let _ = writeln!(s, "UBLKD_CSI={}", csi.map(q).unwrap_or_default());
    s.push_str("SOCK=\"\"\n");
    s.push_str(SCRIPT_LIB);
    s.push_str("\n# run_workloads RUN DEVICE PIDS\nrun_workloads() {\n");
    for wl in WORKLOADS {
        let _ = writeln!(
            s,
            "    run_fio \"$1\" \"$2\" {} {} {} \"$3\" {} {}",
            wl.id, wl.rw, wl.qd, wl.bs, wl.jobs
        );
    }
    s.push_str("}\n\n# qos_jobs: one qos_job ID RW BS [FLAGS] per limit\nqos_jobs() {\n");
    for job in QOS_JOBS {
        let line = format!(
            "    qos_job {} {} {} {}",
            job.id(),
            job.rw,
            job.bs,
            job.flags()
        );
        s.push_str(line.trim_end());
        s.push('\n');
    }
    s.push_str("}\n\n");
    s.push_str("echo \"bench: guest kernel $(uname -r), $(nproc) CPUs\"\n");
    s.push_str(
        "BACKING=\"\"\nif prepare_backing > \"$OUT/backing.log\" 2>&1; then\n    \
         note \"backing file $BACKING ready\"\nelse\n    \
         note \"backing file failed: $(tail_of \"$OUT/backing.log\")\"\nfi\n",
    );
    // The backing file's file system lives on the NVMe namespace: unmount it before the first
    // run that uses the namespace itself.
    let mut unmounted = false;
    // How many ublkd cases have run A/B so far: their order alternates.
    let mut ab_cases = 0;
    let umount = "if [ -n \"$BACKING\" ]; then umount \"$TMPDIR/ublkd-bench\"; BACKING=\"\"; fi\n";
    for run in RUNS.iter().filter(|r| plan.selected(r.id)) {
        let id = run.id;
        let on_namespace = matches!(
            run.server,
            Server::RawNvme { .. }
                | Server::Ublkd {
                    backend: UBackend::Nvme,
                    ..
                }
        );
        if on_namespace && !unmounted {
            s.push_str(umount);
            unmounted = true;
        }
        let line = match run.server {
            Server::NullBlk => format!("nullblk_case {id}"),
            Server::Loop => format!(
                "if [ -n \"$BACKING\" ]; then loop_case {id} \"$BACKING\"; \
                 else fail_case {id} \"no backing file: $(tail_of \"$OUT/backing.log\")\"; fi"
            ),
            Server::Kublk { batch, auto_zc } => match kublk {
                Ok(_) => format!(
                    "kublk_case {id} -t null -q {QUEUES} -d {DEPTH}{}{}",
                    if batch { " -b" } else { "" },
                    if auto_zc { " --auto_zc" } else { "" }
                ),
                Err(e) => format!("fail_case {id} {}", vm::shell_quote(e)),
            },
            Server::RawNvme { passthru } => format!("raw_nvme_case {id} {passthru}"),
            Server::Ublkd {
                backend,
                io_path,
                zero_copy,
                poll,
            } => {
                let on = |b: bool| if b { "on" } else { "off" };
                let common = format!(
                    "--queues {QUEUES} --depth {DEPTH} --io-path {io_path} --zero-copy {} --poll {}",
                    on(zero_copy),
                    on(poll)
                );
                match (ublkd, backend) {
                    (Err(e), _) => format!("fail_case {id} {}", vm::shell_quote(e)),
                    (Ok(_), UBackend::Null) => format!(
                        "ublkd_case {id} --backend null --size {NULL_BYTES} {common}"
                    ),
                    (Ok(_), UBackend::File) => format!(
                        "if [ -n \"$BACKING\" ]; then \
                         ublkd_case {id} --backend \"file:$BACKING\" --size {BACKING_BYTES} {common}; \
                         else fail_case {id} \"no backing file: $(tail_of \"$OUT/backing.log\")\"; fi"
                    ),
                    (Ok(_), UBackend::Nvme) => format!(
                        "ublkd_case {id} --backend nvme:/dev/ng0n1 \
                         --size $(( $(cat /sys/block/nvme0n1/size) * 512 )) {common}"
                    ),
                }
            }
        };
        match (&plan.baseline, ublkd) {
            (Some(_), Ok(_)) if run.is_ublkd() => {
                // A warm-up, discarded, then A B B A (or B A A B): the same case line, each
                // time with its build's binary and directory.
                let case = format!("ublkd_case {id} ");
                let order = ab_order(ab_cases);
                ab_cases += 1;
                let bin = |build: Build| match build {
                    Build::New => "$UBLKD_NEW",
                    Build::Baseline => "$UBLKD_BASE",
                };
                let warm = line.replace(
                    &case,
                    &format!(
                        "WARMUP=1; UBLKD=\"{}\"; ublkd_case {id}{WARMUP_SUFFIX} ",
                        bin(order[0].1)
                    ),
                );
                s.push_str(&warm);
                s.push_str("\nWARMUP=0\n");
                for (suffix, build) in order {
                    let one = line.replace(
                        &case,
                        &format!("UBLKD=\"{}\"; ublkd_case {id}{suffix} ", bin(build)),
                    );
                    s.push_str(&one);
                    s.push('\n');
                }
                s.push_str("UBLKD=\"$UBLKD_NEW\"\n");
            }
            _ => {
                s.push_str(&line);
                s.push('\n');
            }
        }
    }
    if !unmounted {
        s.push_str(umount);
    }
    if !plan.sections() {
        s.push_str("note done\nexit 0\n");
        return s;
    }
    let line = match (ublkd, ublkctl) {
        (Err(e), _) | (_, Err(e)) => format!("fail_case {CONTROL_RUN} {}", vm::shell_quote(e)),
        (Ok(_), Ok(_)) => format!(
            "ctl_case {CONTROL_RUN} {CONTROL_VOLUMES} {CONTROL_SIZE} {CONTROL_DEPTH} \
             {CONTROL_METRICS}"
        ),
    };
    s.push_str(&line);
    s.push('\n');
    let line = match (ublkd, ublkctl, csi) {
        (Err(e), _, _) | (_, Err(e), _) | (_, _, Err(e)) => {
            format!("fail_case {CSI_RUN} {}", vm::shell_quote(e))
        }
        (Ok(_), Ok(_), Ok(_)) => {
            format!("csi_case {CSI_RUN} {CSI_VOLUMES} {CSI_PARALLEL} {CSI_METRICS}")
        }
    };
    s.push_str(&line);
    s.push('\n');
    // The features measured through the node service: QoS limits, snapshots and clones.
    let gib: Vec<String> = SNAPSHOT_GIB.iter().map(u64::to_string).collect();
    for (id, case) in [
        (
            QOS_RUN,
            format!("qos_case {QOS_RUN} {QOS_METRICS} {QOS_SIZE} {QOS_QD} {QOS_RUNTIME_SECS}"),
        ),
        (
            SNAPSHOT_RUN,
            format!(
                "snap_case {SNAPSHOT_RUN} {SNAPSHOT_METRICS} {SNAPSHOT_FS_GIB} {SNAPSHOT_FILL_MIB} \
                 {SNAPSHOT_REPEATS} {}",
                gib.join(" ")
            ),
        ),
    ] {
        let line = match (ublkd, ublkctl) {
            (Err(e), _) | (_, Err(e)) => format!("fail_case {id} {}", vm::shell_quote(e)),
            (Ok(_), Ok(_)) => case,
        };
        s.push_str(&line);
        s.push('\n');
    }
    // Crash recovery last: each run its own daemon, state and socket, torn down before the next.
    let mut runs: Vec<String> = RECOVERY_VOLUMES.iter().map(|&n| recovery_run(n)).collect();
    runs.push(STALL_RUN.to_owned());
    for (i, id) in runs.iter().enumerate() {
        let line = match (ublkd, ublkctl) {
            (Err(e), _) | (_, Err(e)) => format!("fail_case {id} {}", vm::shell_quote(e)),
            (Ok(_), Ok(_)) => match RECOVERY_VOLUMES.get(i) {
                Some(n) => {
                    format!("rec_case {id} {n} {RECOVERY_SIZE} {RECOVERY_DEPTH} {RECOVERY_METRICS}")
                }
                None => format!(
                    "stall_case {id} {STALL_SIZE} {STALL_RUNTIME_SECS} {STALL_KILL_AT_SECS} \
                     {RECOVERY_METRICS}"
                ),
            },
        };
        s.push_str(&line);
        s.push('\n');
    }
    s.push_str("note done\nexit 0\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;
    use std::process::Command;

    /// The script of a bench whose every binary was built.
    fn all_binaries(plan: &Plan) -> String {
        guest_script(
            5,
            plan,
            Ok(Path::new("/k/kublk")),
            Ok(Path::new("/t/ublkd")),
            Ok(Path::new("/t/ublkctl")),
            Ok(Path::new("/t/ublkd-csi")),
        )
    }

    #[test]
    fn script_runs_every_case_and_reports_missing_binaries() {
        let s = guest_script(
            5,
            &Plan::default(),
            Ok(Path::new("/cache/kublk")),
            Err("building ublkd failed"),
            Ok(Path::new("/t/ublkctl")),
            Ok(Path::new("/t/ublkd-csi")),
        );
        assert!(s.contains("RUNTIME=5\n"));
        assert!(s.contains("kublk_case kublk-null -t null -q 2 -d 128\n"));
        assert!(s.contains("kublk_case kublk-null-batch -t null -q 2 -d 128 -b\n"));
        assert!(s.contains("kublk_case kublk-null-batch-zc -t null -q 2 -d 128 -b --auto_zc\n"));
        assert!(s.contains("fail_case ublkd-null-per-io 'building ublkd failed'\n"));
        assert!(s.contains("nullblk_case null_blk\n"));
        assert!(s.contains("loop_case loop-dio"));
        assert!(s.contains("UBLKCTL=/t/ublkctl\n"));
        assert!(s.contains("fail_case ublkd-control 'building ublkd failed'\n"));
        let s = guest_script(
            5,
            &Plan::default(),
            Err("no kublk"),
            Ok(Path::new("/t/ublkd")),
            Ok(Path::new("/t/ublkctl")),
            Ok(Path::new("/t/ublkd-csi")),
        );
        assert!(s.contains(
            "ublkd_case ublkd-null-batch --backend null --size 1073741824 \
             --queues 2 --depth 128 --io-path batch --zero-copy off --poll off\n"
        ));
        assert!(s.contains(
            "ublkd_case ublkd-null-batch-zc --backend null --size 1073741824 \
             --queues 2 --depth 128 --io-path batch --zero-copy on --poll off\n"
        ));
        assert!(s.contains("raw_nvme_case fio-ng0n1-passthru true\n"));
        assert!(s.contains("ublkd_case ublkd-nvme-poll --backend nvme:/dev/ng0n1"));
        assert!(s.contains("fail_case kublk-null 'no kublk'\n"));
        assert!(s.contains("csi_case ublkd-csi 50 20 127.0.0.1:9583\n"));
        assert!(s.contains("UBLKD_CSI=/t/ublkd-csi\n"));
        // The control plane runs last, after the fio cases and the backing file's unmount.
        let ctl = s
            .find("ctl_case ublkd-control 100 64MiB 32 127.0.0.1:9581\n")
            .expect("no ctl_case line");
        assert!(s.rfind("loop_case loop-dio").is_some_and(|i| i < ctl));
        // The backing file's unmount (guest.sh has umounts of its own, in functions).
        let umount = "then umount \"$TMPDIR/ublkd-bench\"";
        assert!(s.rfind(umount).is_some_and(|i| i < ctl));
        // The namespace's file system is gone before anything uses the namespace itself.
        let um = s.find(umount).expect("umount");
        assert!(s.rfind("ublkd-file-copy").is_some_and(|i| i < um));
        assert!(s.find("fio-ng0n1-passthru").is_some_and(|i| i > um));
        let s = guest_script(
            5,
            &Plan::default(),
            Err("no kublk"),
            Ok(Path::new("/t/ublkd")),
            Err("building ublkctl failed"),
            Ok(Path::new("/t/ublkd-csi")),
        );
        assert!(s.contains("fail_case ublkd-control 'building ublkctl failed'\n"));
        assert!(!s.contains("ctl_case ublkd-control"));
    }

    #[test]
    fn script_runs_the_recovery_cases_last() {
        let s = all_binaries(&Plan::default());
        let at = |line: &str| {
            s.find(line)
                .unwrap_or_else(|| panic!("no {line:?} in\n{s}"))
        };
        let ctl = at("ctl_case ublkd-control 100");
        let r1 = at("rec_case ublkd-recovery-1 1 64MiB 32 127.0.0.1:9582\n");
        let r16 = at("rec_case ublkd-recovery-16 16 64MiB 32 127.0.0.1:9582\n");
        let r64 = at("rec_case ublkd-recovery-64 64 64MiB 32 127.0.0.1:9582\n");
        let stall = at("stall_case ublkd-stall 128MiB 8 3 127.0.0.1:9582\n");
        assert!(ctl < r1 && r1 < r16 && r16 < r64 && r64 < stall);
        assert!(at("note done") > stall);

        let s = guest_script(
            5,
            &Plan::default(),
            Ok(Path::new("/k/kublk")),
            Ok(Path::new("/t/ublkd")),
            Err("building ublkctl failed"),
            Ok(Path::new("/t/ublkd-csi")),
        );
        for run in [
            "ublkd-recovery-1",
            "ublkd-recovery-16",
            "ublkd-recovery-64",
            "ublkd-stall",
        ] {
            assert!(
                s.contains(&format!("fail_case {run} 'building ublkctl failed'\n")),
                "{run}"
            );
        }
        assert!(!s.contains("rec_case ublkd-recovery") && !s.contains("stall_case ublkd-stall"));
    }

    #[test]
    fn script_runs_qos_and_snapshots_before_recovery() {
        let s = all_binaries(&Plan::default());
        let at = |line: &str| {
            s.find(line)
                .unwrap_or_else(|| panic!("no {line:?} in\n{s}"))
        };
        // The jobs are a function the case calls once its daemon is up.
        let jobs = at("qos_jobs() {\n");
        assert!(at("    qos_job qos-randread-unlimited randread 4k\n") > jobs);
        assert!(at("    qos_job qos-read-iops-5000 randread 4k --read-iops 5000\n") > jobs);
        assert!(at("    qos_job qos-write-bw-8mibps randwrite 64k --write-bw 8MiB/s\n") > jobs);
        let csi = at("csi_case ublkd-csi");
        let qos = at("qos_case ublkd-qos 127.0.0.1:9584 1GiB 32 5\n");
        let snap = at("snap_case ublkd-snapshot 127.0.0.1:9585 20 256 3 1 16\n");
        let rec = at("rec_case ublkd-recovery-1 ");
        assert!(jobs < csi && csi < qos && qos < snap && snap < rec);

        let s = guest_script(
            5,
            &Plan::default(),
            Ok(Path::new("/k/kublk")),
            Err("building ublkd failed"),
            Ok(Path::new("/t/ublkctl")),
            Ok(Path::new("/t/ublkd-csi")),
        );
        assert!(s.contains("fail_case ublkd-qos 'building ublkd failed'\n"));
        assert!(s.contains("fail_case ublkd-snapshot 'building ublkd failed'\n"));
        assert!(!s.contains("\nqos_case ublkd-qos") && !s.contains("\nsnap_case ublkd-snapshot"));
    }

    #[test]
    fn a_baseline_runs_each_selected_ublkd_case_a_b_b_a_with_its_binary() {
        let plan = Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/c/bin/fdc00eb/ublkd".into())),
        };
        let s = all_binaries(&plan);
        let at = |line: &str| {
            s.find(line)
                .unwrap_or_else(|| panic!("no {line:?} in\n{s}"))
        };
        assert!(s.contains("UBLKD_BASE=/c/bin/fdc00eb/ublkd\n"));
        let args = " --backend null --size 1073741824 --queues 2 --depth 128 --io-path batch \
                    --zero-copy off --poll off\n";
        let a1 = at(&format!(
            "UBLKD=\"$UBLKD_NEW\"; ublkd_case ublkd-null-batch{args}"
        ));
        let b1 = at(&format!(
            "UBLKD=\"$UBLKD_BASE\"; ublkd_case ublkd-null-batch~base{args}"
        ));
        let b2 = at(&format!(
            "UBLKD=\"$UBLKD_BASE\"; ublkd_case ublkd-null-batch~base2{args}"
        ));
        let a2 = at(&format!(
            "UBLKD=\"$UBLKD_NEW\"; ublkd_case ublkd-null-batch~2{args}"
        ));
        assert!(a1 < b1 && b1 < b2 && b2 < a2);
        // A discarded warm-up with the first build comes before the group.
        let warm = at(&format!(
            "WARMUP=1; UBLKD=\"$UBLKD_NEW\"; ublkd_case ublkd-null-batch~warm{args}WARMUP=0\n"
        ));
        assert!(warm < a1);
        // The next ublkd case runs B A A B, its warm-up with the baseline.
        let zc = |suffix: &str, bin: &str| {
            at(&format!(
                "UBLKD=\"{bin}\"; ublkd_case ublkd-null-batch-zc{suffix} --backend null"
            ))
        };
        let (w, b1, a1, a2, b2) = (
            s.find("WARMUP=1; UBLKD=\"$UBLKD_BASE\"; ublkd_case ublkd-null-batch-zc~warm ")
                .expect("the second case's warm-up"),
            zc("~base", "$UBLKD_BASE"),
            zc("", "$UBLKD_NEW"),
            zc("~2", "$UBLKD_NEW"),
            zc("~base2", "$UBLKD_BASE"),
        );
        assert!(w < b1 && b1 < a1 && a1 < a2 && a2 < b2);
        // The selected peers run once; what --only leaves out, and the sections, do not run.
        assert_eq!(s.matches("kublk_case kublk-null-batch -t null").count(), 1);
        assert!(s.contains("ublkd_case ublkd-null-batch-zc~base2 "));
        assert!(
            !s.contains("\nkublk_case kublk-null -t") && !s.contains("\nnullblk_case null_blk")
        );
        assert!(!s.contains("ublkd_case ublkd-file") && !s.contains("\nctl_case "));
        assert!(!s.contains("\nrec_case ") && !s.contains("\nqos_case "));
        assert!(at("note done") > a2);
    }

    #[test]
    fn script_parses_as_posix_sh() {
        let s = all_binaries(&Plan::default());
        let path = std::env::temp_dir().join(format!("ublkd-bench-{}.sh", std::process::id()));
        fs::write(&path, &s).expect("writing the script");
        let out = Command::new("sh").arg("-n").arg(&path).output();
        let _ = fs::remove_file(&path);
        let out = out.expect("running sh -n");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
