//! Crash recovery: ublkd killed with -9 and started again, with idle volumes (the time until
//! all are READY) and under I/O (the longest stall fio saw).

use super::super::cases::{
    recovery_run, RECOVERY_DEPTH, RECOVERY_METRICS, RECOVERY_SIZE, STALL_KILL_AT_SECS, STALL_RUN,
    STALL_RUNTIME_SECS, STALL_SIZE,
};
use super::proc::{
    append, blk_name, dev_writes, fio, is_blk, log_file, note, now_ns, put, tail_of, wait_blk,
    wait_until, Guest, Node,
};
use std::fs;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

/// A fresh daemon, `n` null volumes (1 queue each), kill -9, start it again; `ready.ns` times
/// the new process from its exec until list-volumes shows all `n` READY. Then every volume is
/// deleted and the daemon stopped.
pub fn recovery_case(g: &Guest, n: usize) {
    let run = recovery_run(n);
    let Some(mut node) = Node::new(g, &run, RECOVERY_METRICS) else {
        return;
    };
    let d = node.d.clone();
    note(&format!(
        "{run}: {n} null volumes, kill -9 ublkd, start it again"
    ));
    put(&d.join("volumes"), "");
    node.spawn();
    if !node.wait_up(g, &run) {
        return;
    }
    let mut devs = Vec::new();
    for k in 1..=n {
        let name = format!("r{k:03}");
        let depth = RECOVERY_DEPTH.to_string();
        let args = [
            "create-volume",
            &name,
            "--size",
            RECOVERY_SIZE,
            "--backend",
            "null",
            "--queues",
            "1",
            "--depth",
            &depth,
        ];
        match node.ctl(&args, &d.join("create.err")) {
            Ok(dev) => {
                append(&d.join("volumes"), &format!("{name} {dev}"));
                devs.push(PathBuf::from(dev));
            }
            Err(e) => {
                g.fail_case(&run, &format!("create-volume {name} failed {e}"));
                node.teardown();
                return;
            }
        }
    }
    match node.crash_restart() {
        Err(why) => g.fail_case(&run, &why),
        Ok(()) => {
            let gone: Vec<String> = devs
                .iter()
                .filter(|d| !is_blk(d))
                .map(|d| d.display().to_string())
                .collect();
            if let Err(why) = node.wait_ready(n) {
                g.fail_case(&run, &why);
            } else if !gone.is_empty() {
                g.fail_case(
                    &run,
                    &format!(
                        "devices gone after kill -9 (they must survive the daemon): {}",
                        gone.join(" ")
                    ),
                );
            }
        }
    }
    let ready = fs::read_to_string(d.join("ready.ns")).unwrap_or_else(|_| "not READY".into());
    note(&format!("{run}: {}", ready.trim()));
    node.teardown();
}

/// fio randwrite 4k QD16 on a RAM volume for `STALL_RUNTIME_SECS` with a per-I/O completion
/// latency log (`clat.log`); `STALL_KILL_AT_SECS` after the device completed its first write,
/// kill -9 ublkd and start it again at once. `times.ns`: `FIO_LAUNCH_NS FIRST_WRITE_NS`;
/// `kill.ns`, `ready.ns`, `poll.ns` as in recovery; `fio.json`, `fio.rc`.
pub fn stall_case(g: &Guest) {
    let run = STALL_RUN;
    let Some(mut node) = Node::new(g, run, RECOVERY_METRICS) else {
        return;
    };
    let d = node.d.clone();
    note(&format!(
        "{run}: fio on a RAM volume for {STALL_RUNTIME_SECS} s, kill -9 ublkd \
         {STALL_KILL_AT_SECS} s in"
    ));
    put(&d.join("volumes"), "");
    node.spawn();
    if !node.wait_up(g, run) {
        return;
    }
    let created = node.ctl(
        &[
            "create-volume",
            "s1",
            "--size",
            STALL_SIZE,
            "--backend",
            "ram",
        ],
        &d.join("create.err"),
    );
    let dev = match created {
        Ok(dev) => PathBuf::from(dev),
        Err(e) => {
            g.fail_case(run, &format!("create-volume s1 failed {e}"));
            node.teardown();
            return;
        }
    };
    put(&d.join("volumes"), &format!("s1 {}\n", dev.display()));
    if !wait_blk(&dev) {
        g.fail_case(
            run,
            &format!(
                "create-volume returned {}, which is no block device",
                dev.display()
            ),
        );
        node.teardown();
        return;
    }
    let logs = node.c.join("fio");
    if let Err(e) = fs::create_dir_all(&logs) {
        g.fail_case(run, &format!("mkdir {}: {e}", logs.display()));
        node.teardown();
        return;
    }
    let mut c = fio(STALL_RUNTIME_SECS);
    c.arg("--name=stall")
        .arg(format!("--filename={}", dev.display()))
        .args([
            "--ioengine=io_uring",
            "--direct=1",
            "--bs=4k",
            "--rw=randwrite",
        ])
        .args([
            "--iodepth=16",
            "--numjobs=1",
            "--norandommap",
            "--time_based",
        ])
        .arg(format!("--runtime={STALL_RUNTIME_SECS}"))
        .args(["--disable_slat=1", "--disable_lat=1"])
        .arg(format!("--write_lat_log={}", logs.join("stall").display()))
        .args(["--log_avg_msec=0", "--output-format=json"])
        .arg(format!("--output={}", d.join("fio.json").display()))
        .stdin(Stdio::null())
        .stdout(log_file(&d.join("fio.log")))
        .stderr(log_file(&d.join("fio.log")));
    let t0 = now_ns();
    let mut fio = match c.spawn() {
        Ok(f) => f,
        Err(e) => {
            g.fail_case(run, &format!("could not start fio: {e}"));
            node.teardown();
            return;
        }
    };
    let mut rc: Option<i32> = None;
    let mut ended = |fio: &mut std::process::Child| {
        if rc.is_none() {
            if let Ok(Some(s)) = fio.try_wait() {
                rc = Some(super::proc::code(s));
            }
        }
        rc
    };
    // fio can take seconds to start its job (TCG): count from the device's first write.
    let blk = blk_name(&dev);
    wait_until(Duration::from_secs(60), Duration::from_millis(10), || {
        dev_writes(&blk) > 0 || ended(&mut fio).is_some()
    });
    let t1 = now_ns();
    put(&d.join("times.ns"), &format!("{t0} {t1}\n"));
    if dev_writes(&blk) == 0 {
        g.fail_case(
            run,
            &format!(
                "fio wrote nothing to {} within 60 s: {}",
                dev.display(),
                tail_of(&d.join("fio.log"))
            ),
        );
    } else {
        std::thread::sleep(Duration::from_secs(STALL_KILL_AT_SECS));
        if let Err(why) = node.crash_restart().and_then(|()| node.wait_ready(1)) {
            g.fail_case(run, &why);
        }
    }
    let within = STALL_RUNTIME_SECS + 70;
    wait_until(
        Duration::from_secs(within),
        Duration::from_millis(100),
        || ended(&mut fio).is_some(),
    );
    match ended(&mut fio) {
        Some(rc) => put(&d.join("fio.rc"), &format!("{rc}\n")),
        None => {
            g.fail_case(run, &format!("fio did not end within {within} s"));
            super::proc::signal(fio.id(), "KILL");
            // Reaped so that no zombie outlives the case; its status is the kill.
            let _ = fio.wait();
        }
    }
    if let Err(e) = fs::copy(logs.join("stall_clat.1.log"), d.join("clat.log")) {
        append(
            &d.join("fio.log"),
            &format!("fio wrote no completion latency log: {e}"),
        );
    }
    let logged = fs::read_to_string(d.join("clat.log"))
        .map(|s| s.lines().count())
        .unwrap_or(0);
    note(&format!(
        "{run}: fio exit {}, {logged} I/Os logged",
        fs::read_to_string(d.join("fio.rc"))
            .unwrap_or_default()
            .trim()
    ));
    node.teardown();
}
