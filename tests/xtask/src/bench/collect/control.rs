//! Reading what the control-plane run left: daemon RSS and per-call latencies.

use crate::bench::cases::{CONTROL_LOAD_CALLS, CONTROL_RUN, CONTROL_VOLUMES};
use serde_json::Value;
use std::fs;
use std::path::Path;

/// What the control-plane run measured; each part a value or why there is none.
#[derive(Debug, Clone, PartialEq)]
pub struct Control {
    /// Daemon RSS (KiB) with no volumes.
    pub rss_empty_kib: Result<f64, String>,
    /// Daemon RSS (KiB) with all `CONTROL_VOLUMES` volumes idle.
    pub rss_full_kib: Result<f64, String>,
    /// Each `ublkctl create-volume`, end to end, in ms; all of them or an error.
    pub create_ms: Result<Vec<f64>, String>,
    /// Each `ublkctl delete-volume`, end to end, in ms; all of them or an error.
    pub delete_ms: Result<Vec<f64>, String>,
    /// Each `GET /metrics` with all volumes present, in ms.
    pub scrape_ms: Result<Vec<f64>, String>,
    /// The same creates and deletes (`CONTROL_LOAD_CALLS` of each) while fio kept the workers
    /// busy, in ms, and the IOPS that load ran at: a command's round trip to a loaded worker.
    pub load_create_ms: Result<Vec<f64>, String>,
    pub load_delete_ms: Result<Vec<f64>, String>,
    pub load_iops: Result<f64, String>,
    /// The daemon did not exit 0 within 30 s of SIGTERM.
    pub teardown: Option<String>,
}

impl Control {
    /// A run that produced no numbers at all.
    fn failed(why: &str, teardown: Option<String>) -> Self {
        Control {
            rss_empty_kib: Err(why.to_owned()),
            rss_full_kib: Err(why.to_owned()),
            create_ms: Err(why.to_owned()),
            delete_ms: Err(why.to_owned()),
            scrape_ms: Err(why.to_owned()),
            load_create_ms: Err(why.to_owned()),
            load_delete_ms: Err(why.to_owned()),
            load_iops: Err(why.to_owned()),
            teardown,
        }
    }
}

/// The IOPS of every job in fio's JSON report together (reads, writes and trims).
pub fn parse_load_iops(text: &str) -> Result<f64, String> {
    let start = text
        .find('{')
        .ok_or("no JSON in fio's report of the load")?;
    let v: Value = serde_json::from_str(&text[start..])
        .map_err(|e| format!("bad JSON in fio's report of the load: {e}"))?;
    let jobs = v["jobs"]
        .as_array()
        .filter(|j| !j.is_empty())
        .ok_or("no job in fio's report of the load")?;
    let mut iops = 0.0;
    for job in jobs {
        if let Some(err) = job["error"].as_i64().filter(|&e| e != 0) {
            return Err(format!("the fio load reported error {err}"));
        }
        for dir in ["read", "write", "trim"] {
            iops += job[dir]["iops"].as_f64().unwrap_or(0.0);
        }
    }
    if iops > 0.0 {
        Ok(iops)
    } else {
        Err("the fio load did no I/O".into())
    }
}

/// Scrapes of `/metrics` timed with every control-plane volume present.
const CONTROL_SCRAPES: usize = 10;

/// `VmRSS` in KiB from the text of `/proc/PID/status` (`VmRSS:\t   12345 kB`).
pub fn parse_vmrss(status: &str) -> Result<f64, String> {
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or("no VmRSS line in /proc/PID/status (process gone?)")?;
    let mut fields = line["VmRSS:".len()..].split_whitespace();
    let (Some(n), Some("kB"), None) = (fields.next(), fields.next(), fields.next()) else {
        return Err(format!("odd VmRSS line {line:?}"));
    };
    n.parse::<u64>()
        .map(|kib| kib as f64)
        .map_err(|_| format!("odd VmRSS line {line:?}"))
}

/// Latencies in ms from lines whose last field is nanoseconds (`NAME [DEVICE] NS`), checking
/// that there are `expected` of them.
pub fn parse_latencies(text: &str, expected: usize) -> Result<Vec<f64>, String> {
    let mut out = Vec::new();
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let ns = line
            .split_whitespace()
            .last()
            .and_then(|f| f.parse::<u64>().ok())
            .ok_or_else(|| format!("odd timing line {line:?}"))?;
        out.push(ns as f64 / 1e6);
    }
    if out.len() != expected {
        return Err(format!(
            "{} of {expected} calls timed (the guest ended early?)",
            out.len()
        ));
    }
    Ok(out)
}

/// Reads what the control-plane run left in `dir/CONTROL_RUN`: `error` (no daemon), `status.0`
/// and `status.full` (copies of `/proc/PID/status`), `create.ns` (`NAME DEVICE NS` per created
/// volume), `create_error`, `delete.ns` (`NAME NS`), `delete_error`, `teardown_error`.
pub fn collect_control(dir: &Path) -> Control {
    let d = dir.join(CONTROL_RUN);
    let read = |name: &str| {
        fs::read_to_string(d.join(name))
            .ok()
            .map(|s| s.trim().to_owned())
            .filter(|s| !s.is_empty())
    };
    // Several failures (one per volume) read as the first one and a count.
    let first_of = |text: String| {
        let lines: Vec<&str> = text.lines().collect();
        match lines.len() {
            0 | 1 => text.clone(),
            n => format!("{} (and {} more)", lines[0], n - 1),
        }
    };
    let teardown = read("teardown_error").map(|t| t.replace('\n', "; "));
    if !d.is_dir() {
        return Control::failed("did not run (the guest ended early)", teardown);
    }
    if let Some(e) = read("error") {
        return Control::failed(&e, teardown);
    }
    let rss = |name: &str, what: &str| {
        read(name)
            .ok_or_else(|| format!("no /proc status with {what} (the guest ended early?)"))
            .and_then(|s| parse_vmrss(&s))
    };
    let create_ms = match read("create_error") {
        Some(e) => Err(first_of(e)),
        None => parse_latencies(&read("create.ns").unwrap_or_default(), CONTROL_VOLUMES),
    };
    let (rss_full_kib, delete_ms) = match &create_ms {
        Err(e) => {
            let why = format!("not all {CONTROL_VOLUMES} volumes were created: {e}");
            (Err(why.clone()), Err(why))
        }
        Ok(_) => (
            rss("status.full", &format!("{CONTROL_VOLUMES} volumes")),
            match read("delete_error") {
                Some(e) => Err(first_of(e)),
                None => parse_latencies(&read("delete.ns").unwrap_or_default(), CONTROL_VOLUMES),
            },
        ),
    };
    let scrape_ms = match read("scrape_error") {
        Some(e) => Err(e),
        None => parse_latencies(&read("scrape.ns").unwrap_or_default(), CONTROL_SCRAPES),
    };
    let loaded = |name: &str| match read("load_error") {
        Some(e) => Err(e),
        None => parse_latencies(&read(name).unwrap_or_default(), CONTROL_LOAD_CALLS),
    };
    let load_iops = match read("load_error") {
        Some(e) => Err(e),
        None => read("load.json")
            .ok_or_else(|| "no fio report of the load".to_owned())
            .and_then(|t| parse_load_iops(&t)),
    };
    Control {
        rss_empty_kib: rss("status.0", "0 volumes"),
        rss_full_kib,
        create_ms,
        delete_ms,
        scrape_ms,
        load_create_ms: loaded("load_create.ns"),
        load_delete_ms: loaded("load_delete.ns"),
        load_iops,
        teardown,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::control::control_entries;

    #[test]
    fn rss_and_timings_parse() {
        let status = "Name:\tublkd\nVmPeak:\t  123456 kB\nVmHWM:\t   9000 kB\n\
                      VmRSS:\t    8520 kB\nRssAnon:\t    4000 kB\nThreads:\t5\n";
        assert_eq!(parse_vmrss(status), Ok(8520.0));
        assert!(parse_vmrss("Name:\tublkd\n").is_err_and(|e| e.contains("no VmRSS")));
        assert!(parse_vmrss("VmRSS:\t12 MB\n").is_err());
        assert!(parse_vmrss("VmRSS:\tlots kB\n").is_err());
        assert!(parse_vmrss("VmRSS:\t12 kB extra\n").is_err());

        let creates = "v001 /dev/ublkb0 12500000\nv002 /dev/ublkb1 7000000\n";
        assert_eq!(parse_latencies(creates, 2), Ok(vec![12.5, 7.0]));
        assert_eq!(parse_latencies("v001 1500000\n\n", 1), Ok(vec![1.5]));
        assert!(parse_latencies(creates, 3).is_err_and(|e| e.contains("2 of 3 calls")));
        assert!(parse_latencies("v001 /dev/ublkb0 -\n", 1).is_err());
    }

    #[test]
    fn control_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-ctl-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        assert!(collect_control(&dir)
            .create_ms
            .is_err_and(|e| e.contains("did not run")));

        let d = dir.join(CONTROL_RUN);
        fs::create_dir_all(&d).expect("mkdir");
        let write = |name: &str, text: &str| fs::write(d.join(name), text).expect("write");
        let mut creates = String::new();
        let mut deletes = String::new();
        for k in 1..=CONTROL_VOLUMES {
            creates += &format!("v{k:03} /dev/ublkb{} {}\n", k - 1, k * 1_000_000);
            deletes += &format!("v{k:03} {}\n", k * 500_000);
        }
        write("status.0", "VmRSS:\t  8192 kB\n");
        write("status.full", "VmRSS:\t 13192 kB\n");
        write("create.ns", &creates);
        write("delete.ns", &deletes);
        let loaded: String = (1..=CONTROL_LOAD_CALLS)
            .map(|k| format!("l{k:03} {}\n", k * 2_000_000))
            .collect();
        write("load_create.ns", &loaded);
        write("load_delete.ns", &loaded);
        write(
            "load.json",
            r#"{"jobs":[{"error":0,"read":{"iops":9000.5}},{"error":0,"read":{"iops":8000.5}}]}"#,
        );
        let c = collect_control(&dir);
        assert_eq!(c.load_create_ms.as_ref().map(|v| v[0]), Ok(2.0));
        assert_eq!(c.load_iops, Ok(17001.0));
        assert_eq!(c.rss_empty_kib, Ok(8192.0));
        assert_eq!(c.rss_full_kib, Ok(13192.0));
        assert_eq!(c.create_ms.as_ref().map(Vec::len), Ok(CONTROL_VOLUMES));
        assert_eq!(c.delete_ms.as_ref().map(|v| v[1]), Ok(1.0));
        assert_eq!(c.teardown, None);
        assert_eq!(control_entries(&c)[6].ours, Some(50.0));

        write(
            "delete_error",
            "/dev/ublkb3 still exists after delete-volume v004 returned\n\
             /dev/ublkb4 still exists after delete-volume v005 returned\n",
        );
        write(
            "teardown_error",
            "did not exit within 30 s of SIGTERM (killed)\n",
        );
        let c = collect_control(&dir);
        assert!(c
            .delete_ms
            .is_err_and(|e| e.contains("v004 returned (and 1 more)")));
        assert!(c.teardown.is_some_and(|t| t.contains("SIGTERM")));

        write(
            "load_error",
            "the fio load ended before the timed calls did: no such device\n",
        );
        let c = collect_control(&dir);
        assert!(c
            .load_delete_ms
            .is_err_and(|e| e.contains("fio load ended")));
        assert!(c.load_iops.is_err());
        assert!(parse_load_iops(r#"{"jobs":[{"error":5}]}"#).is_err_and(|e| e.contains("error 5")));
        assert!(parse_load_iops(r#"{"jobs":[]}"#).is_err());

        write(
            "create_error",
            "create-volume v100 failed (exit 3): unreachable\n",
        );
        let c = collect_control(&dir);
        assert!(c.create_ms.is_err_and(|e| e.contains("v100 failed")));
        assert!(c.rss_full_kib.is_err_and(|e| e.contains("not all 100")));
        assert_eq!(c.rss_empty_kib, Ok(8192.0));

        write(
            "error",
            "ublkd exited with status 1 before its socket answered: bad config\n",
        );
        let c = collect_control(&dir);
        assert!(c.rss_empty_kib.is_err_and(|e| e.contains("bad config")));
        let _ = fs::remove_dir_all(&dir);
    }
}
