//! The control-plane run in the report: its `results.json` entries, table and raw numbers.

use super::{alone_table, percentile, round, Entry, Side, Unit};
use crate::bench::cases::{
    CONTROL_DEPTH, CONTROL_LOAD_CALLS, CONTROL_RUN, CONTROL_SIZE, CONTROL_VOLUMES, OURS_NAME,
};
use crate::bench::collect::control::Control;
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The control-plane entries of `results.json`, in table order; every one with peer `none`.
pub fn control_entries(c: &Control) -> Vec<Entry> {
    let entry = |case: String, value: Result<f64, String>, unit| {
        Entry::alone(
            case,
            Side {
                name: OURS_NAME,
                value,
                teardown: c.teardown.as_deref(),
            },
            unit,
        )
    };
    let pct = |ms: &Result<Vec<f64>, String>, p| {
        ms.clone()
            .and_then(|v| percentile(&v, p).ok_or_else(|| "no calls timed".to_owned()))
    };
    let mut out = Vec::new();
    for (call, ms) in [
        ("ublkctl create-volume", &c.create_ms),
        ("ublkctl delete-volume", &c.delete_ms),
    ] {
        for p in [50, 99] {
            out.push(entry(format!("{call} p{p}"), pct(ms, p), Unit::Ms));
        }
    }
    let mib = |kib: &Result<f64, String>| kib.clone().map(|k| k / 1024.0);
    out.push(entry(
        "ublkd RSS, 0 volumes".into(),
        mib(&c.rss_empty_kib),
        Unit::MiB,
    ));
    out.push(entry(
        format!("ublkd RSS, {CONTROL_VOLUMES} idle volumes"),
        mib(&c.rss_full_kib),
        Unit::MiB,
    ));
    let per_volume = match (&c.rss_empty_kib, &c.rss_full_kib) {
        (Ok(empty), Ok(full)) => Ok((full - empty) / CONTROL_VOLUMES as f64),
        (Err(e), _) | (_, Err(e)) => Err(e.clone()),
    };
    out.push(entry(
        "ublkd RSS per idle volume".into(),
        per_volume,
        Unit::KiB,
    ));
    for p in [50, 100] {
        out.push(entry(
            format!("GET /metrics, {CONTROL_VOLUMES} volumes, p{p}"),
            pct(&c.scrape_ms, p),
            Unit::Ms,
        ));
    }
    for (call, ms) in [
        ("ublkctl create-volume", &c.load_create_ms),
        ("ublkctl delete-volume", &c.load_delete_ms),
    ] {
        for p in [50, 99] {
            out.push(entry(
                format!("{call} under load p{p}"),
                pct(ms, p),
                Unit::Ms,
            ));
        }
    }
    out.push(entry(
        "fio load during those calls".into(),
        c.load_iops.clone(),
        Unit::Iops,
    ));
    out
}

/// What `results.json` says of the control plane, as a table, with what the numbers include.
pub fn control_table(entries: &[Entry]) -> String {
    let mut s = alone_table(entries);
    let _ = writeln!(
        s,
        "note: create/delete latencies are as seen by ublkctl, including its start-up (one \
         process per call); create-volume returns when /dev/ublkbN serves I/O. {CONTROL_VOLUMES} \
         null volumes of {CONTROL_SIZE}, 1 queue of depth {CONTROL_DEPTH}; p50/p99 by nearest rank. \
         Under load: {CONTROL_LOAD_CALLS} more creates and deletes while fio (4 KiB randread, QD32) \
         runs on two of the volumes, so each attach and teardown waits for a busy worker to read \
         its command between completions; compare them with the idle ones above."
    );
    s
}

/// The control-plane run's raw numbers for `raw.json`.
pub fn control_raw_json(c: &Control) -> Value {
    let mut v = json!({ "run": CONTROL_RUN, "volumes": CONTROL_VOLUMES });
    let mut errors = serde_json::Map::new();
    let mut put = |key: &str, value: Result<Value, &String>| match value {
        Ok(x) => v[key] = x,
        Err(e) => {
            v[key] = Value::Null;
            errors.insert(key.to_owned(), Value::from(e.as_str()));
        }
    };
    let ms_list = |ms: &Vec<f64>| json!(ms.iter().map(|x| round(*x, 3)).collect::<Vec<_>>());
    put("create_ms", c.create_ms.as_ref().map(ms_list));
    put("delete_ms", c.delete_ms.as_ref().map(ms_list));
    put("load_create_ms", c.load_create_ms.as_ref().map(ms_list));
    put("load_delete_ms", c.load_delete_ms.as_ref().map(ms_list));
    put(
        "load_iops",
        c.load_iops.as_ref().map(|x| json!(round(*x, 1))),
    );
    put(
        "rss_kib_no_volumes",
        c.rss_empty_kib.as_ref().map(|k| json!(k)),
    );
    put(
        "rss_kib_all_volumes",
        c.rss_full_kib.as_ref().map(|k| json!(k)),
    );
    if !errors.is_empty() {
        v["errors"] = Value::Object(errors);
    }
    if let Some(t) = &c.teardown {
        v["teardown_error"] = Value::from(t.as_str());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    fn control_ok() -> Control {
        Control {
            rss_empty_kib: Ok(10240.0),
            rss_full_kib: Ok(10240.0 + 100.0 * 48.0),
            create_ms: Ok((1..=100).map(f64::from).collect()),
            delete_ms: Ok((1..=100).map(|x| f64::from(x) / 2.0).collect()),
            scrape_ms: Ok((1..=10).map(f64::from).collect()),
            load_create_ms: Ok((1..=20).map(f64::from).collect()),
            load_delete_ms: Ok((1..=20).map(|x| f64::from(x) * 2.0).collect()),
            load_iops: Ok(15000.0),
            teardown: None,
        }
    }

    #[test]
    fn control_entries_have_no_peer_and_their_own_units() {
        let entries = control_entries(&control_ok());
        let got: Vec<(&str, Option<f64>, &str)> = entries
            .iter()
            .map(|e| (e.case.as_str(), e.ours, e.unit.name()))
            .collect();
        assert_eq!(
            got,
            [
                ("ublkctl create-volume p50", Some(50.0), "ms"),
                ("ublkctl create-volume p99", Some(99.0), "ms"),
                ("ublkctl delete-volume p50", Some(25.0), "ms"),
                ("ublkctl delete-volume p99", Some(49.5), "ms"),
                ("ublkd RSS, 0 volumes", Some(10.0), "MiB"),
                ("ublkd RSS, 100 idle volumes", Some(14.6875), "MiB"),
                ("ublkd RSS per idle volume", Some(48.0), "KiB"),
                ("GET /metrics, 100 volumes, p50", Some(5.0), "ms"),
                ("GET /metrics, 100 volumes, p100", Some(10.0), "ms"),
                ("ublkctl create-volume under load p50", Some(10.0), "ms"),
                ("ublkctl create-volume under load p99", Some(20.0), "ms"),
                ("ublkctl delete-volume under load p50", Some(20.0), "ms"),
                ("ublkctl delete-volume under load p99", Some(40.0), "ms"),
                ("fio load during those calls", Some(15000.0), "IOPS"),
            ]
        );
        for e in &entries {
            assert_eq!(
                (e.peer.as_str(), e.peer_value, e.ratio, &e.error),
                ("none", None, None, &None)
            );
        }
        assert_eq!(
            entries[1].to_json(),
            json!({"case": "ublkctl create-volume p99", "ours": 99.0, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "ms"})
        );
        assert_eq!(
            entries[5].to_json(),
            json!({"case": "ublkd RSS, 100 idle volumes", "ours": 14.69, "peer": "none",
                   "peer_value": null, "ratio": null, "unit": "MiB"})
        );
        assert_eq!(entries[6].to_json()["unit"], "KiB");

        let raw = control_raw_json(&control_ok());
        assert_eq!(raw["run"], "ublkd-control");
        assert_eq!(raw["volumes"], 100);
        assert_eq!(raw["create_ms"].as_array().map(Vec::len), Some(100));
        assert_eq!(raw["rss_kib_all_volumes"], 15040.0);
        assert_eq!(raw["load_delete_ms"].as_array().map(Vec::len), Some(20));
        assert_eq!(raw["load_iops"], 15000.0);
        assert!(raw.get("errors").is_none() && raw.get("teardown_error").is_none());
    }

    #[test]
    fn control_failures_give_null_values_and_an_error() {
        let mut c = control_ok();
        c.create_ms = Err("create-volume v007 failed (exit 1): no space".into());
        c.rss_full_kib = Err("not all 100 volumes were created".into());
        c.teardown = Some("exited with status 1 after SIGTERM".into());
        let entries = control_entries(&c);
        assert!(entries.iter().all(|e| e.error.is_some()));
        let create = &entries[0];
        assert_eq!(create.ours, None);
        let err = create.error.as_deref().unwrap_or_default();
        assert!(err.contains("ublkd: create-volume v007 failed"), "{err}");
        assert!(
            err.contains("ublkd teardown: exited with status 1"),
            "{err}"
        );
        let v = create.to_json();
        assert!(v["ours"].is_null() && v["peer_value"].is_null() && v["ratio"].is_null());
        assert_eq!((&v["peer"], &v["unit"]), (&json!("none"), &json!("ms")));
        assert!(v["error"].is_string());
        // RSS with no volumes stands (only the teardown marks it); per volume needs both.
        assert_eq!(entries[4].ours, Some(10.0));
        assert_eq!(entries[6].ours, None);

        let raw = control_raw_json(&c);
        assert!(raw["create_ms"].is_null());
        assert!(raw["errors"]["create_ms"].is_string());
        assert!(raw["teardown_error"].is_string());

        let table = control_table(&entries);
        assert!(table.contains("FAILED"), "{table}");
        assert!(table.contains("including its start-up"), "{table}");
    }
}
