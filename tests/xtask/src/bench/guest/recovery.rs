//! Crash recovery: ublkd killed with -9 and started again, with idle volumes (the time until
//! all are READY) and under I/O (the longest stall fio saw).

use super::super::cases::{
    recovery_run, CONTROL_DEPTH, CONTROL_SIZE, STALL_KILL_AT_SECS, STALL_RUN, STALL_RUNTIME_SECS,
    STALL_SIZE,
};
use super::super::results::{Case, Measured, Outcome, Restart, Stall};
use super::fio::{blk_of, fio, io_counts, job, report, DIRECT};
use super::proc::{is_blk, span_ms, tail_of, wait_secs, wait_until, Guest, Node, Proc};
use std::fs;
use std::time::{Duration, Instant};

/// A fresh daemon, `n` null volumes (1 queue each), kill -9, start it again: the time from the
/// new process's exec until list-volumes shows all `n` READY.
pub fn recovery_case(g: &Guest, n: usize) -> Case {
    let run = recovery_run(n);
    note!("{run}: {n} null volumes, kill -9 ublkd, start it again");
    Node::run(g, &run, |node| {
        let err = node.d.join("create.err");
        let volume =
            format!("--size {CONTROL_SIZE} --backend null --queues 1 --depth {CONTROL_DEPTH}");
        let devs = (1..=n)
            .map(|k| Ok(node.create(&format!("r{k:03}"), &volume, &err)?.0))
            .collect::<Outcome<Vec<_>>>()?;
        let r = node.crash_restart(n, || {
            let gone: Vec<String> = devs
                .iter()
                .filter(|d| !is_blk(d))
                .map(|d| d.display().to_string())
                .collect();
            match gone.is_empty() {
                true => Ok(()),
                false => Err(format!(
                    "devices gone after kill -9 (they must survive the daemon): {}",
                    gone.join(" ")
                )),
            }
        });
        note!("{run}: READY after {:?} ms", r.ready_ms);
        Ok(Measured::Recovery(r))
    })
}

/// fio randwrite 4k QD16 on a RAM volume for `STALL_RUNTIME_SECS` with a per-I/O completion
/// latency log; `STALL_KILL_AT_SECS` after the device completed its first write, kill -9 ublkd
/// and start it again at once.
pub fn stall_case(g: &Guest) -> Case {
    note!(
        "{STALL_RUN}: fio on a RAM volume for {STALL_RUNTIME_SECS} s, kill -9 ublkd \
         {STALL_KILL_AT_SECS} s in"
    );
    Node::run(g, STALL_RUN, |node| stall(node).map(Measured::Stall))
}

fn stall(node: &mut Node) -> Outcome<Stall> {
    let d = node.d.clone();
    let volume = format!("--size {STALL_SIZE} --backend ram");
    let (dev, _) = node.create("s1", &volume, &d.join("create.err"))?;
    let logs = node.c.join("fio");
    fs::create_dir_all(&logs).map_err(|e| format!("mkdir {}: {e}", logs.display()))?;
    let (json, log, lat_log) = (d.join("fio.json"), d.join("fio.log"), logs.join("stall"));
    let args = format!(
        "{DIRECT} {} --disable_slat=1 --disable_lat=1 --log_avg_msec=0 --write_lat_log={}",
        job("randwrite", "4k", 16, STALL_RUNTIME_SECS),
        lat_log.display()
    );
    let c = fio(STALL_RUNTIME_SECS, "stall", &dev, &json, &args);
    let launched = Instant::now();
    let mut fio = Proc::spawn(c, &log, &log).map_err(|e| format!("fio {e}"))?;
    // fio can take seconds to start its job (TCG): count from the device's first write.
    let blk = blk_of(&dev);
    let writes = || io_counts(&blk).map_or(0, |(_, w)| w);
    wait_until(Duration::from_secs(60), Duration::from_millis(10), || {
        writes() > 0 || fio.exited().is_some()
    });
    let first_write = Instant::now();
    let (restart, killed) = match writes() {
        0 => {
            let (dev, tail) = (dev.display(), tail_of(&log));
            let why = format!("fio wrote nothing to {dev} within 60 s: {tail}");
            (Restart::failed(why), None)
        }
        _ => {
            std::thread::sleep(Duration::from_secs(STALL_KILL_AT_SECS));
            let killed = Instant::now();
            (node.crash_restart(1, || Ok(())), Some(killed))
        }
    };
    let mut failure = restart.ready_ms.clone().map(drop);
    let within = STALL_RUNTIME_SECS + 70;
    wait_secs(within, || fio.exited().is_some());
    let rc = fio.exited();
    if rc.is_none() {
        failure = failure.and(Err(format!("fio did not end within {within} s")));
        // Reaped so that no zombie outlives the case; its status is the kill.
        fio.kill9();
        fio.wait_exit(10);
    }
    let clat = fs::read_to_string(logs.join("stall_clat.1.log"))
        .map_err(|e| format!("no completion latency log from fio: {e}: {}", tail_of(&log)))
        .and_then(|t| parse_clat_log(&t));
    let fio_report = report(&json);
    let kill_after_ms = span_ms(Some(first_write), killed);
    let max_ms = failure.and_then(|()| {
        match rc {
            Some(0) => {}
            rc => return Err(format!("fio exited with status {rc:?}: {}", tail_of(&log))),
        }
        let errors: u64 = fio_report.as_ref()?.jobs.iter().map(|j| j.error).sum();
        if errors > 0 {
            return Err(format!("fio saw {errors} errors across the restart"));
        }
        let (ms, at, _) = clat.clone()?;
        check_stall(ms, at, kill_after_ms, restart.kill_to_exec_ms).map(|()| ms)
    });
    note!("{STALL_RUN}: fio exit {rc:?}, longest I/O {max_ms:?} ms");
    let fio_max = fio_report.ok().and_then(|r| {
        let max = r.jobs.iter().filter_map(|j| j.write.clat_ns.max);
        max.reduce(f64::max)
    });
    let clat = clat.ok();
    Ok(Stall {
        max_ms,
        max_at_ms: clat.map(|(_, at, _)| at),
        ios: clat.map(|(_, _, n)| n),
        fio_max_ms: fio_max.map(|ns| ns / 1e6),
        first_write_ms: span_ms(Some(launched), Some(first_write)),
        kill_after_ms,
        restart,
    })
}

/// The longest completion latency in a fio latency log with one line per I/O
/// (`TIME_MS, LATENCY_NS, DIR, BS, OFFSET[, PRIO]`): (latency ms, completion time ms, I/Os).
fn parse_clat_log(text: &str) -> Outcome<(f64, f64, usize)> {
    let mut best: Option<(u64, u64)> = None;
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(|x| x.trim().parse::<u64>());
        let (Some(Ok(t)), Some(Ok(ns))) = (f.next(), f.next()) else {
            return Err(format!("odd fio latency log line {line:?}"));
        };
        n += 1;
        if best.is_none_or(|(_, b)| ns > b) {
            best = Some((t, ns));
        }
    }
    let (t, ns) = best.ok_or("fio's latency log is empty (no I/O completed?)")?;
    Ok((ns as f64 / 1e6, t as f64, n))
}

/// Whether the longest completion latency in fio's log (`max_ms`, completed `at_ms` into the
/// job) can be the stall across the restart: fio's I/O was in flight when ublkd was killed and
/// could not complete before the new one ran, so that I/O lasted at least from the kill to the
/// new exec (`kill_to_exec_ms`), and it completed after the kill, which came `kill_after_ms`
/// after the device's first write (itself after the job's start, fio's time zero).
fn check_stall(
    max_ms: f64,
    at_ms: f64,
    kill_after_ms: Option<f64>,
    kill_to_exec_ms: Option<f64>,
) -> Outcome<()> {
    let (Some(after), Some(gap)) = (kill_after_ms, kill_to_exec_ms) else {
        return Err("no kill or restart time recorded".to_owned());
    };
    if max_ms < gap {
        return Err(format!(
            "fio's longest I/O ({max_ms:.1} ms) is shorter than the time from the kill to the \
             new ublkd ({gap:.1} ms): the log missed the stall"
        ));
    }
    if at_ms < after {
        return Err(format!(
            "fio's longest I/O completed {at_ms:.0} ms into the job, before the kill (at least \
             {after:.0} ms in): the log missed the stall"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_longest_io_is_read_from_fios_latency_log() {
        // fio 3.33 per-I/O log: time ms, latency ns, direction, block size, offset (and prio).
        let log = "0, 92132, 1, 4096, 0\n3001, 45123456, 1, 4096, 8192\n\
                   3002, 45000000, 1, 4096, 0, 0\n7999, 80000, 1, 4096, 4096\n";
        assert_eq!(parse_clat_log(log), Ok((45.123456, 3001.0, 4)));
        assert!(parse_clat_log("").is_err_and(|e| e.contains("empty")));
        assert!(parse_clat_log("0, lots, 1, 4096, 0\n").is_err());
        assert!(parse_clat_log("garbage\n").is_err());
    }

    #[test]
    fn a_stall_must_span_the_restart() {
        // Killed 3000 ms after the first write; 10 ms from the kill to the new exec.
        assert_eq!(check_stall(35.0, 3030.0, Some(3000.0), Some(10.0)), Ok(()));
        assert_eq!(check_stall(10.0, 3001.0, Some(3000.0), Some(10.0)), Ok(()));
        assert!(check_stall(9.0, 3030.0, Some(3000.0), Some(10.0))
            .is_err_and(|e| e.contains("shorter than the time from the kill")));
        assert!(check_stall(1500.0, 1528.0, Some(3000.0), Some(1000.0))
            .is_err_and(|e| e.contains("before the kill")));
        assert!(check_stall(35.0, 3030.0, None, Some(10.0)).is_err());
    }
}
