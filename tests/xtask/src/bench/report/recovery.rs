//! The recovery and stall runs in the report: their `results.json` entries, table and raw
//! numbers.

use super::{alone_table, percentile, round, Entry, Side, Unit};
use crate::bench::cases::{
    recovery_run, OURS_NAME, RECOVERY_DEPTH, RECOVERY_SIZE, STALL_KILL_AT_SECS, STALL_RUN,
    STALL_RUNTIME_SECS, STALL_SIZE,
};
use crate::bench::collect::recovery::{Recovery, Stall};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The recovery entries of `results.json`, in table order; every one with peer `none`, in ms.
pub fn recovery_entries(recoveries: &[Recovery], stall: &Stall) -> Vec<Entry> {
    let mut out: Vec<Entry> = recoveries
        .iter()
        .map(|r| {
            Entry::alone(
                format!(
                    "ublkd restart to READY, {} volume{}",
                    r.volumes,
                    if r.volumes == 1 { "" } else { "s" }
                ),
                Side {
                    name: OURS_NAME,
                    value: r.ready_ms.clone(),
                    teardown: r.teardown.as_deref(),
                },
                Unit::Ms,
            )
        })
        .collect();
    out.push(Entry::alone(
        "fio max I/O stall across kill -9".into(),
        Side {
            name: OURS_NAME,
            value: stall.max_ms.clone(),
            teardown: stall.teardown.as_deref(),
        },
        Unit::Ms,
    ));
    out
}

/// The recovery and stall runs' raw numbers for `raw.json`.
pub fn recovery_raw_json(recoveries: &[Recovery], stall: &Stall) -> Vec<Value> {
    let ms = |x: Option<f64>| x.map(|v| round(v, 3));
    let mut out = Vec::new();
    for r in recoveries {
        let mut v = json!({
            "run": recovery_run(r.volumes),
            "volumes": r.volumes,
            "volume_size": RECOVERY_SIZE,
            "queue_depth": RECOVERY_DEPTH,
            "restart_to_ready_ms": ms(r.ready_ms.as_ref().ok().copied()),
            "kill_to_exec_ms": ms(r.kill_to_exec_ms),
            "list_volumes_call_ms": ms(r.list_call_ms),
            "io_path_in_use": r.io_path,
        });
        if let Err(e) = &r.ready_ms {
            v["error"] = Value::from(e.as_str());
        }
        if let Some(t) = &r.teardown {
            v["teardown_error"] = Value::from(t.as_str());
        }
        out.push(v);
    }
    let mut v = json!({
        "run": STALL_RUN,
        "volume_size": STALL_SIZE,
        "fio": "randwrite 4k qd16 io_uring direct",
        "runtime_s": STALL_RUNTIME_SECS,
        "kill_after_first_write_s": STALL_KILL_AT_SECS,
        "max_clat_ms": ms(stall.max_ms.as_ref().ok().copied()),
        "max_clat_completed_at_ms": stall.max_at_ms,
        "ios_logged": stall.ios,
        "fio_report_max_clat_ms": ms(stall.fio_max_ms),
        "first_write_after_fio_launch_ms": ms(stall.first_write_ms),
        "kill_after_first_write_ms": ms(stall.kill_after_ms),
        "kill_to_exec_ms": ms(stall.kill_to_exec_ms),
        "restart_to_ready_ms": ms(stall.restart_to_ready_ms),
        "kill_to_ready_ms": ms(stall.kill_to_ready_ms),
        "list_volumes_call_ms": ms(stall.list_call_ms),
        "io_path_in_use": stall.io_path,
    });
    if let Err(e) = &stall.max_ms {
        v["error"] = Value::from(e.as_str());
    }
    if let Some(t) = &stall.teardown {
        v["teardown_error"] = Value::from(t.as_str());
    }
    out.push(v);
    out
}

/// What `results.json` says of the recovery runs, as a table, with what the numbers include.
pub fn recovery_table(entries: &[Entry], recoveries: &[Recovery], stall: &Stall) -> String {
    let mut s = alone_table(entries);
    let mut distinct: Vec<&str> = recoveries
        .iter()
        .filter_map(|r| r.io_path.as_deref())
        .chain(stall.io_path.as_deref())
        .collect();
    distinct.sort_unstable();
    distinct.dedup();
    let calls: Vec<f64> = recoveries
        .iter()
        .filter_map(|r| r.list_call_ms)
        .chain(stall.list_call_ms)
        .collect();
    let call = percentile(&calls, 50).map_or_else(String::new, |c| {
        format!("; one call took {c:.0} ms here, so READY is seen up to that much late")
    });
    let _ = writeln!(
        s,
        "note: restart to READY runs from the exec of the new ublkd (after kill -9 of the old \
         one) until `ublkctl list-volumes` shows every volume READY, polled every 20 ms \
         (ublkctl's start-up included{call}); null volumes of {RECOVERY_SIZE}, 1 queue of depth \
         {RECOVERY_DEPTH}. The stall is the longest completion latency in fio's per-I/O log \
         (randwrite 4k QD16, {STALL_RUNTIME_SECS} s, on a {STALL_SIZE} RAM volume; ublkd \
         killed {STALL_KILL_AT_SECS} s after the first write and started again as soon as it \
         was gone){}. I/O path: {}.",
        match (stall.kill_to_ready_ms, stall.restart_to_ready_ms) {
            (Some(k), Some(r)) => format!(
                "; there the volume was READY {k:.1} ms after the kill, {r:.1} ms after the exec"
            ),
            _ => String::new(),
        },
        if distinct.is_empty() {
            "unknown".to_owned()
        } else {
            distinct.join(", ")
        }
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::cases::RECOVERY_VOLUMES;

    fn stall_ok() -> Stall {
        Stall {
            max_ms: Ok(45.5),
            max_at_ms: Some(3010.0),
            ios: Some(80000),
            fio_max_ms: Some(45.5),
            first_write_ms: Some(80.0),
            kill_after_ms: Some(3000.0),
            kill_to_exec_ms: Some(2.0),
            restart_to_ready_ms: Some(30.0),
            kill_to_ready_ms: Some(33.0),
            list_call_ms: Some(9.0),
            io_path: Some("IO_PATH_BATCH".into()),
            teardown: None,
        }
    }

    fn recoveries_ok() -> Vec<Recovery> {
        RECOVERY_VOLUMES
            .iter()
            .map(|&n| Recovery {
                volumes: n,
                ready_ms: Ok(10.0 + n as f64),
                kill_to_exec_ms: Some(3.0),
                list_call_ms: Some(8.0),
                io_path: Some("IO_PATH_BATCH".into()),
                teardown: None,
            })
            .collect()
    }

    #[test]
    fn recovery_entries_are_ms_without_a_peer() {
        let entries = recovery_entries(&recoveries_ok(), &stall_ok());
        let got: Vec<(&str, Option<f64>)> =
            entries.iter().map(|e| (e.case.as_str(), e.ours)).collect();
        assert_eq!(
            got,
            [
                ("ublkd restart to READY, 1 volume", Some(11.0)),
                ("ublkd restart to READY, 16 volumes", Some(26.0)),
                ("ublkd restart to READY, 64 volumes", Some(74.0)),
                ("fio max I/O stall across kill -9", Some(45.5)),
            ]
        );
        assert_eq!(
            entries[3].to_json(),
            json!({"case": "fio max I/O stall across kill -9", "ours": 45.5, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "ms"})
        );
        assert!(entries
            .iter()
            .all(|e| e.error.is_none() && e.unit == Unit::Ms));

        let raw = recovery_raw_json(&recoveries_ok(), &stall_ok());
        assert_eq!(raw.len(), 4);
        assert_eq!(raw[2]["run"], "ublkd-recovery-64");
        assert_eq!(raw[2]["restart_to_ready_ms"], 74.0);
        assert_eq!(raw[3]["run"], "ublkd-stall");
        assert_eq!(raw[3]["max_clat_ms"], 45.5);
        assert_eq!(raw[3]["kill_to_ready_ms"], 33.0);
        assert!(raw.iter().all(|v| v.get("error").is_none()));

        let table = recovery_table(&entries, &recoveries_ok(), &stall_ok());
        assert!(
            table.contains("ublkd restart to READY, 64 volumes"),
            "{table}"
        );
        assert!(table.contains("I/O path: IO_PATH_BATCH."), "{table}");
        assert!(table.contains("33.0 ms after the kill"), "{table}");
        // The median of the four list-volumes calls (8, 8, 8, 9 ms).
        assert!(table.contains("one call took 8 ms here"), "{table}");
        assert_eq!(raw[0]["list_volumes_call_ms"], 8.0);
        assert_eq!(raw[3]["kill_after_first_write_ms"], 3000.0);
    }

    #[test]
    fn recovery_failures_give_null_values_and_an_error() {
        let mut recoveries = recoveries_ok();
        recoveries[1].ready_ms = Err("not all 16 volumes READY within 60 s".into());
        recoveries[2].teardown = Some("delete-volume r007 failed".into());
        let mut stall = stall_ok();
        stall.max_ms = Err("fio saw 3 errors across the restart".into());
        let entries = recovery_entries(&recoveries, &stall);
        assert_eq!(entries[0].error, None);
        assert_eq!(entries[1].ours, None);
        assert!(entries[1]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ublkd: not all 16")));
        // The time stands; the failed teardown marks it.
        assert_eq!(entries[2].ours, Some(74.0));
        assert!(entries[2]
            .error
            .as_deref()
            .is_some_and(|e| e.contains("ublkd teardown: delete-volume r007")));
        assert!(entries[3].to_json()["ours"].is_null());
        assert!(entries[3].to_json()["error"]
            .as_str()
            .is_some_and(|e| e.contains("3 errors")));
        let raw = recovery_raw_json(&recoveries, &stall);
        assert!(raw[1]["restart_to_ready_ms"].is_null() && raw[1]["error"].is_string());
        assert!(raw[2]["teardown_error"].is_string());
        assert!(raw[3]["max_clat_ms"].is_null() && raw[3]["error"].is_string());
        let table = recovery_table(&entries, &recoveries, &stall);
        assert!(table.contains("FAILED"), "{table}");
    }
}
