//! Reading what the recovery runs (restart to READY after kill -9) and the I/O stall run left.

use crate::bench::cases::{recovery_run, RECOVERY_VOLUMES, STALL_RUN};
use serde_json::Value;
use std::fs;
use std::path::Path;

/// One recovery run: N null volumes, kill -9, ublkd started again.
#[derive(Debug, Clone, PartialEq)]
pub struct Recovery {
    pub volumes: usize,
    /// From the new ublkd's exec until `list-volumes` showed all volumes READY, in ms.
    pub ready_ms: Result<f64, String>,
    /// From the kill -9 until the new ublkd's exec (the old one's exit included), ms.
    pub kill_to_exec_ms: Option<f64>,
    /// One more `list-volumes` call afterwards, ms: what one poll costs.
    pub list_call_ms: Option<f64>,
    /// The I/O path the volumes came back on (`IO_PATH_BATCH`, ...), when known.
    pub io_path: Option<String>,
    /// Deleting the volumes or stopping the daemon went wrong.
    pub teardown: Option<String>,
}

/// The I/O stall run: fio on a RAM volume across a kill -9 and restart.
#[derive(Debug, Clone, PartialEq)]
pub struct Stall {
    /// The longest completion latency in fio's per-I/O log (ms), or why there is none.
    pub max_ms: Result<f64, String>,
    /// When (ms into the fio job, by its log) the slowest I/O completed.
    pub max_at_ms: Option<f64>,
    /// Completions in the log.
    pub ios: Option<usize>,
    /// fio's own maximum completion latency (ms), from its JSON report.
    pub fio_max_ms: Option<f64>,
    /// From fio's launch until the device completed its first write, ms.
    pub first_write_ms: Option<f64>,
    /// From that first write to the kill -9, ms.
    pub kill_after_ms: Option<f64>,
    /// From the kill -9 until the new ublkd's exec, ms.
    pub kill_to_exec_ms: Option<f64>,
    /// From the new ublkd's exec until the volume was READY, ms.
    pub restart_to_ready_ms: Option<f64>,
    /// From the kill -9 until the volume was READY, ms.
    pub kill_to_ready_ms: Option<f64>,
    /// One more `list-volumes` call afterwards, ms.
    pub list_call_ms: Option<f64>,
    pub io_path: Option<String>,
    pub teardown: Option<String>,
}

/// Two `date +%s%N` stamps on one line (`START END`), as ms from the first to the second.
fn parse_span_ms(text: &str) -> Result<f64, String> {
    let f: Vec<&str> = text.split_whitespace().collect();
    let [a, b] = f.as_slice() else {
        return Err(format!("odd timestamps {:?}", text.trim()));
    };
    let (Ok(a), Ok(b)) = (a.parse::<u64>(), b.parse::<u64>()) else {
        return Err(format!("odd timestamps {:?}", text.trim()));
    };
    if b < a {
        return Err(format!("timestamps run backwards: {a} then {b}"));
    }
    Ok((b - a) as f64 / 1e6)
}

/// The longest completion latency in a fio latency log with one line per I/O
/// (`TIME_MS, LATENCY_NS, DIR, BS, OFFSET[, PRIO]`): (latency ms, completion time ms, I/Os).
fn parse_clat_log(text: &str) -> Result<(f64, f64, usize), String> {
    let mut best: Option<(u64, u64)> = None;
    let mut n = 0;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut f = line.split(',').map(str::trim);
        let (Some(Ok(t)), Some(Ok(ns))) = (
            f.next().map(str::parse::<u64>),
            f.next().map(str::parse::<u64>),
        ) else {
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

/// Errors summed over the jobs of fio's JSON report, and the longest write completion
/// latency it reports (ms).
fn parse_fio_stall(text: &str) -> Result<(u64, f64), String> {
    let start = text.find('{').ok_or("no JSON in fio output")?;
    let v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("bad fio JSON: {e}"))?;
    let jobs = v["jobs"].as_array().filter(|j| !j.is_empty());
    let jobs = jobs.ok_or("no job in fio output")?;
    let errors = jobs.iter().map(|j| j["error"].as_u64().unwrap_or(0)).sum();
    let max_ns = jobs
        .iter()
        .filter_map(|j| j["write"]["clat_ns"]["max"].as_f64())
        .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
        .ok_or("no write completion latency in fio output")?;
    Ok((errors, max_ns / 1e6))
}

/// The I/O path the first volume of a `list-volumes -o json` answer is served on.
fn io_path_in_use(list: &str) -> Option<String> {
    let v: Value = serde_json::from_str(list).ok()?;
    v["volumes"][0]["io_path_in_use"]
        .as_str()
        .map(str::to_owned)
}

/// The nanosecond stamps in `dir/name` (up to the first that is not one); empty without any.
fn read_stamps(dir: &Path, name: &str) -> Vec<u64> {
    read_trimmed(dir, name)
        .map(|t| {
            t.split_whitespace()
                .map_while(|x| x.parse::<u64>().ok())
                .collect()
        })
        .unwrap_or_default()
}

/// ms from stamp `a` to stamp `b`, when both are there and in order.
fn span_ms(a: Option<&u64>, b: Option<&u64>) -> Option<f64> {
    match (a, b) {
        (Some(a), Some(b)) if b >= a => Some((b - a) as f64 / 1e6),
        _ => None,
    }
}

/// Reads `dir/name` trimmed, if it has anything in it.
pub fn read_trimmed(dir: &Path, name: &str) -> Option<String> {
    fs::read_to_string(dir.join(name))
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

/// The teardown problems of a run directory, first one and a count.
pub fn teardown_of(d: &Path) -> Option<String> {
    read_trimmed(d, "teardown_error").map(|t| {
        let lines: Vec<&str> = t.lines().collect();
        match lines.len() {
            0 | 1 => t.clone(),
            n => format!("{} (and {} more)", lines[0], n - 1),
        }
    })
}

/// Reads what each recovery run left: `error`, `kill.ns`, `ready.ns` (`START_NS READY_NS`),
/// `poll.ns` (`BEFORE_NS AFTER_NS`), `list.json`, `teardown_error`.
pub fn collect_recovery(dir: &Path) -> Vec<Recovery> {
    RECOVERY_VOLUMES
        .iter()
        .map(|&n| {
            let d = dir.join(recovery_run(n));
            let ready_ms = if !d.is_dir() {
                Err("did not run (the guest ended early)".to_owned())
            } else if let Some(e) = read_trimmed(&d, "error") {
                Err(e)
            } else {
                read_trimmed(&d, "ready.ns")
                    .ok_or_else(|| "no READY time recorded (the guest ended early?)".to_owned())
                    .and_then(|t| parse_span_ms(&t))
            };
            let kill = read_stamps(&d, "kill.ns");
            let ready = read_stamps(&d, "ready.ns");
            let poll = read_stamps(&d, "poll.ns");
            Recovery {
                volumes: n,
                ready_ms,
                kill_to_exec_ms: span_ms(kill.first(), ready.first()),
                list_call_ms: span_ms(poll.first(), poll.get(1)),
                io_path: read_trimmed(&d, "list.json").and_then(|l| io_path_in_use(&l)),
                teardown: teardown_of(&d),
            }
        })
        .collect()
}

/// Reads what the stall run left: `error`, `fio.rc`, `fio.json`, `fio.log`, `clat.log`,
/// `times.ns` (`FIO_LAUNCH_NS FIRST_WRITE_NS`), `kill.ns`, `ready.ns`, `poll.ns`, `list.json`,
/// `teardown_error`.
pub fn collect_stall(dir: &Path) -> Stall {
    let d = dir.join(STALL_RUN);
    let read = |name: &str| read_trimmed(&d, name);
    let times = read_stamps(&d, "times.ns");
    let kill = read_stamps(&d, "kill.ns");
    let ready = read_stamps(&d, "ready.ns");
    let poll = read_stamps(&d, "poll.ns");
    let kill_after_ms = span_ms(times.get(1), kill.first());
    let kill_to_exec_ms = span_ms(kill.first(), ready.first());
    let log = read("clat.log").map(|t| parse_clat_log(&t));
    let fio = read("fio.json").map(|t| parse_fio_stall(&t));
    let max_ms = if !d.is_dir() {
        Err("did not run (the guest ended early)".to_owned())
    } else if let Some(e) = read("error") {
        Err(e)
    } else {
        match read("fio.rc").as_deref() {
            None => Err("fio did not run or did not end".to_owned()),
            Some("0") => match (&fio, &log) {
                (None, _) => Err("no fio report".to_owned()),
                (Some(Err(e)), _) => Err(e.clone()),
                (Some(Ok((errors, _))), _) if *errors > 0 => {
                    Err(format!("fio saw {errors} errors across the restart"))
                }
                (_, None) => Err(format!(
                    "no completion latency log from fio: {}",
                    read("fio.log").unwrap_or_default()
                )),
                (_, Some(Err(e))) => Err(e.clone()),
                (_, Some(Ok((ms, at, _)))) => {
                    check_stall(*ms, *at, kill_after_ms, kill_to_exec_ms).map(|()| *ms)
                }
            },
            Some(rc) => {
                let log = read("fio.log").unwrap_or_default();
                let tail: Vec<&str> = log.lines().rev().take(3).collect();
                Err(format!(
                    "fio exited with status {rc}: {}",
                    tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                ))
            }
        }
    };
    let log = log.and_then(Result::ok);
    Stall {
        max_ms,
        max_at_ms: log.map(|(_, at, _)| at),
        ios: log.map(|(_, _, n)| n),
        fio_max_ms: fio.and_then(Result::ok).map(|(_, ms)| ms),
        first_write_ms: span_ms(times.first(), times.get(1)),
        kill_after_ms,
        kill_to_exec_ms,
        restart_to_ready_ms: span_ms(ready.first(), ready.get(1)),
        kill_to_ready_ms: span_ms(kill.first(), ready.get(1)),
        list_call_ms: span_ms(poll.first(), poll.get(1)),
        io_path: read("list.json").and_then(|l| io_path_in_use(&l)),
        teardown: teardown_of(&d),
    }
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
) -> Result<(), String> {
    let (Some(after), Some(gap)) = (kill_after_ms, kill_to_exec_ms) else {
        return Err("no kill or restart time recorded (the guest ended early?)".to_owned());
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
    fn recovery_timings_and_fio_results_parse() {
        assert_eq!(parse_span_ms("1000000000 1012500000\n"), Ok(12.5));
        assert_eq!(parse_span_ms("5 5"), Ok(0.0));
        assert!(parse_span_ms("1012500000 1000000000").is_err_and(|e| e.contains("backwards")));
        assert!(parse_span_ms("1000000000").is_err());
        assert!(parse_span_ms("1000000000 x").is_err());
        assert!(parse_span_ms("1 2 3").is_err());

        // fio 3.33 per-I/O log: time ms, latency ns, direction, block size, offset (and prio).
        let log = "0, 92132, 1, 4096, 0\n3001, 45123456, 1, 4096, 8192\n\
                   3002, 45000000, 1, 4096, 0, 0\n7999, 80000, 1, 4096, 4096\n";
        assert_eq!(parse_clat_log(log), Ok((45.123456, 3001.0, 4)));
        assert!(parse_clat_log("").is_err_and(|e| e.contains("empty")));
        assert!(parse_clat_log("0, lots, 1, 4096, 0\n").is_err());
        assert!(parse_clat_log("garbage\n").is_err());

        let fio = r#"fio: note
{"jobs":[{"error":0,"write":{"total_ios":80000,"clat_ns":{"max":45123456.0}}}]}"#;
        assert_eq!(parse_fio_stall(fio), Ok((0, 45.123456)));
        let bad = r#"{"jobs":[{"error":5,"write":{"clat_ns":{"max":1000000.0}}}]}"#;
        assert_eq!(parse_fio_stall(bad), Ok((5, 1.0)));
        assert!(parse_fio_stall(r#"{"jobs":[]}"#).is_err());
        assert!(parse_fio_stall(r#"{"jobs":[{"error":0,"write":{}}]}"#).is_err());
        assert!(parse_fio_stall("nothing").is_err());

        let list = r#"{
  "volumes": [
    {
      "id": "r001",
      "state": "VOLUME_STATE_READY",
      "io_path_in_use": "IO_PATH_BATCH"
    }
  ]
}"#;
        assert_eq!(io_path_in_use(list).as_deref(), Some("IO_PATH_BATCH"));
        assert_eq!(io_path_in_use(r#"{"volumes": []}"#), None);
        assert_eq!(io_path_in_use("not json"), None);
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
        assert!(check_stall(35.0, 3030.0, Some(3000.0), None).is_err());
    }

    #[test]
    fn recovery_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-rec-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let r = collect_recovery(&dir);
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| x
            .ready_ms
            .as_ref()
            .is_err_and(|e| e.contains("did not run"))));
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("did not run")));

        let write = |run: &str, name: &str, text: &str| {
            let d = dir.join(run);
            fs::create_dir_all(&d).expect("mkdir");
            fs::write(d.join(name), text).expect("write");
        };
        let list = r#"{"volumes": [{"id": "r001", "io_path_in_use": "IO_PATH_PER_IO"}]}"#;
        write("ublkd-recovery-1", "kill.ns", "990000000\n");
        write("ublkd-recovery-1", "ready.ns", "1000000000 1020000000\n");
        write("ublkd-recovery-1", "poll.ns", "1030000000 1037500000\n");
        write("ublkd-recovery-1", "list.json", list);
        write("ublkd-recovery-16", "ready.ns", "1000000000 1080000000\n");
        write(
            "ublkd-recovery-16",
            "teardown_error",
            "delete-volume r003 failed: x\n/dev/ublkb3 (r003) still exists after the deletes\n",
        );
        write(
            "ublkd-recovery-64",
            "error",
            "a volume FAILED to come back\n",
        );
        write("ublkd-recovery-64", "ready.ns", "1 2\n");
        let r = collect_recovery(&dir);
        assert_eq!(r[0].ready_ms, Ok(20.0));
        assert_eq!(r[0].io_path.as_deref(), Some("IO_PATH_PER_IO"));
        assert_eq!(r[0].teardown, None);
        assert_eq!(
            (r[0].kill_to_exec_ms, r[0].list_call_ms),
            (Some(10.0), Some(7.5))
        );
        assert_eq!((r[1].kill_to_exec_ms, r[1].list_call_ms), (None, None));
        assert_eq!(r[1].ready_ms, Ok(80.0));
        assert!(r[1]
            .teardown
            .as_deref()
            .is_some_and(|t| t.contains("r003 failed: x (and 1 more)")));
        assert!(r[2].ready_ms.as_ref().is_err_and(|e| e.contains("FAILED")));

        let st = "ublkd-stall";
        // fio launched at 1 s, first write at 1.1 s, kill at 4.1 s, exec at 4.11 s, READY at 4.14 s.
        write(st, "times.ns", "1000000000 1100000000\n");
        write(st, "kill.ns", "4100000000\n");
        write(st, "ready.ns", "4110000000 4140000000\n");
        write(st, "list.json", list);
        write(st, "fio.rc", "0\n");
        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":0,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n3030, 35000000, 1, 4096, 0\n",
        );
        let s = collect_stall(&dir);
        assert_eq!(s.max_ms, Ok(35.0));
        assert_eq!((s.max_at_ms, s.ios), (Some(3030.0), Some(2)));
        assert_eq!(s.fio_max_ms, Some(35.0));
        assert_eq!(s.first_write_ms, Some(100.0));
        assert_eq!(s.kill_after_ms, Some(3000.0));
        assert_eq!(s.kill_to_exec_ms, Some(10.0));
        assert_eq!(s.restart_to_ready_ms, Some(30.0));
        assert_eq!(s.kill_to_ready_ms, Some(40.0));
        assert_eq!(s.list_call_ms, None);

        // A log whose longest I/O ended before the kill did not see the stall.
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n1500, 35000000, 1, 4096, 0\n",
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("before the kill")));
        write(
            st,
            "clat.log",
            "10, 50000, 1, 4096, 0\n3030, 35000000, 1, 4096, 0\n",
        );
        assert_eq!(s.io_path.as_deref(), Some("IO_PATH_PER_IO"));

        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":5,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("fio saw 5 errors")));
        write(st, "fio.rc", "1\n");
        write(
            st,
            "fio.log",
            "fio: io_u error on file /dev/ublkb0: Input/output error\n",
        );
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("status 1: fio: io_u error")));
        write(st, "fio.rc", "0\n");
        write(
            st,
            "fio.json",
            r#"{"jobs":[{"error":0,"write":{"clat_ns":{"max":35000000.0}}}]}"#,
        );
        fs::remove_file(dir.join(st).join("clat.log")).expect("rm");
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("no completion latency log")));
        write(st, "error", "ublkd did not exit within 10 s of kill -9\n");
        assert!(collect_stall(&dir)
            .max_ms
            .is_err_and(|e| e.contains("kill -9")));
        let _ = fs::remove_dir_all(&dir);
    }
}
