//! The QoS run in the report: each limit against what fio measured under it (`results.json`
//! entries with peer `limit`), the accuracy table and the raw numbers.

use super::{fmt_value, round, Entry, Side, Unit};
use crate::bench::cases::{QosLimit, OURS_NAME, QOS_QD, QOS_RUN, QOS_RUNTIME_SECS, QOS_SIZE};
use crate::bench::collect::qos::{Qos, QosResult};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The peer of a QoS entry: the limit the volume was given.
const LIMIT: &str = "limit";

fn unit(limit: QosLimit) -> Unit {
    match limit {
        QosLimit::Unlimited | QosLimit::ReadIops(_) => Unit::Iops,
        QosLimit::WriteMibps(_) => Unit::MiBps,
    }
}

/// How far `measured` is from `limit`, in percent of the limit (above 0: over the limit).
fn error_pct(measured: f64, limit: f64) -> Option<f64> {
    (limit > 0.0).then(|| (measured / limit - 1.0) * 100.0)
}

/// One entry per job, in run order: `ours` the measured rate, `peer_value` the limit, `ratio`
/// measured / limit; the unlimited job alone (peer `none`), as the ceiling of this setup.
pub fn qos_entries(q: &Qos) -> Vec<Entry> {
    q.jobs
        .iter()
        .map(|r| {
            let ours = Side {
                name: OURS_NAME,
                value: r.measured.clone(),
                teardown: q.teardown.as_deref(),
            };
            let case = r.job.id();
            match r.job.limit_value() {
                None => Entry::alone(case, ours, unit(r.job.limit)),
                Some(limit) => Entry::compare(
                    case,
                    ours,
                    Side {
                        name: LIMIT,
                        value: Ok(limit),
                        teardown: None,
                    },
                    unit(r.job.limit),
                ),
            }
        })
        .collect()
}

fn fio_label(r: &QosResult) -> String {
    format!("{} {} qd{QOS_QD}", r.job.rw, r.job.bs)
}

/// The accuracy table: limit, measured, error in percent of the limit, with each failure below
/// its line, the run's teardown problems once, and what the numbers are.
pub fn qos_table(entries: &[Entry], q: &Qos) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<26} {:<20} {:>10} {:>10} {:>9}  unit",
        "case", "fio", "limit", "measured", "error"
    );
    for (e, r) in entries.iter().zip(&q.jobs) {
        let d = e.unit.decimals();
        let measured = match (e.ours, &e.error) {
            (None, Some(_)) => "FAILED".to_owned(),
            (v, _) => fmt_value(v, d),
        };
        let err = match (e.ours, e.peer_value) {
            (Some(m), Some(l)) => {
                error_pct(m, l).map_or_else(|| "-".to_owned(), |p| format!("{p:+.2} %"))
            }
            _ => "-".to_owned(),
        };
        let _ = writeln!(
            s,
            "{:<26} {:<20} {:>10} {:>10} {:>9}  {}",
            e.case,
            fio_label(r),
            fmt_value(e.peer_value, d),
            measured,
            err,
            e.unit.name()
        );
        if let Err(err) = &r.measured {
            let _ = writeln!(s, "    ! {err}");
        }
    }
    // Once, though every entry carries it.
    if let Some(t) = &q.teardown {
        let _ = writeln!(s, "    ! teardown: {t}");
    }
    let _ = writeln!(
        s,
        "note: each limit is set by `ublkctl create-volume` on its own null volume of {QOS_SIZE} \
         (ublkd --config, one queue); fio io_uring direct, QD{QOS_QD}, {QOS_RUNTIME_SECS} s after \
         a 1 s ramp that the burst allowance (the daemon's default, 100 ms) falls into; measured \
         is fio's read IOPS or write bandwidth over those {QOS_RUNTIME_SECS} s. The unlimited \
         volume shows what this setup can do: a limit near it measures the setup, not the limit. \
         Unthrottled speed with QoS compiled in is the null cases above."
    );
    s
}

/// The QoS run's raw numbers for `raw.json`.
pub fn qos_raw_json(q: &Qos) -> Value {
    let jobs: Vec<Value> = q
        .jobs
        .iter()
        .map(|r| {
            let u = unit(r.job.limit);
            let measured = r.measured.as_ref().ok().copied();
            let mut v = json!({
                "case": r.job.id(),
                "fio": fio_label(r),
                "limit": r.job.limit_value(),
                "unit": u.name(),
                "measured": measured.map(|m| round(m, u.decimals() + 1)),
                "error_pct": measured
                    .zip(r.job.limit_value())
                    .and_then(|(m, l)| error_pct(m, l))
                    .map(|p| round(p, 3)),
            });
            if let Err(e) = &r.measured {
                v["error"] = Value::from(e.as_str());
            }
            v
        })
        .collect();
    let mut v = json!({
        "run": QOS_RUN,
        "volume_size": QOS_SIZE,
        "queue_depth": QOS_QD,
        "runtime_s": QOS_RUNTIME_SECS,
        "ramp_s": 1,
        "jobs": jobs,
    });
    if let Some(t) = &q.teardown {
        v["teardown_error"] = Value::from(t.as_str());
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::cases::QOS_JOBS;

    fn qos_ok() -> Qos {
        Qos {
            jobs: QOS_JOBS
                .iter()
                .map(|job| QosResult {
                    job: *job,
                    // 2 % over each limit; the ceiling 250000 IOPS.
                    measured: Ok(job.limit_value().map_or(250_000.0, |l| l * 1.02)),
                })
                .collect(),
            teardown: None,
        }
    }

    #[test]
    fn qos_entries_compare_the_measured_rate_with_the_limit() {
        let q = qos_ok();
        let entries = qos_entries(&q);
        let got: Vec<(&str, &str, Option<f64>, &str)> = entries
            .iter()
            .map(|e| {
                (
                    e.case.as_str(),
                    e.peer.as_str(),
                    e.peer_value,
                    e.unit.name(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                ("qos-randread-unlimited", "none", None, "IOPS"),
                ("qos-read-iops-1000", "limit", Some(1000.0), "IOPS"),
                ("qos-read-iops-5000", "limit", Some(5000.0), "IOPS"),
                ("qos-read-iops-20000", "limit", Some(20000.0), "IOPS"),
                ("qos-write-bw-8mibps", "limit", Some(8.0), "MiB/s"),
                ("qos-write-bw-32mibps", "limit", Some(32.0), "MiB/s"),
            ]
        );
        assert!(entries.iter().all(|e| e.error.is_none()));
        assert_eq!(
            entries[2].to_json(),
            json!({"case": "qos-read-iops-5000", "ours": 5100.0, "peer": "limit",
                   "peer_value": 5000.0, "ratio": 1.02, "unit": "IOPS"})
        );
        assert_eq!(entries[4].to_json()["ours"], 8.16);
        assert_eq!(entries[4].to_json()["ratio"], 1.02);

        let table = qos_table(&entries, &q);
        assert!(table.contains("qos-read-iops-1000"), "{table}");
        assert!(table.contains("randwrite 64k qd32"), "{table}");
        assert!(table.contains("+2.00 %"), "{table}");
        let raw = qos_raw_json(&q);
        assert_eq!(raw["run"], "ublkd-qos");
        assert_eq!(raw["jobs"][1]["error_pct"], 2.0);
        assert!(raw["jobs"][0]["limit"].is_null() && raw["jobs"][0]["error_pct"].is_null());
        assert_eq!(raw["jobs"][5]["measured"], 32.64);
    }

    #[test]
    fn qos_failures_give_null_values_and_an_error() {
        let mut q = qos_ok();
        q.jobs[3].measured = Err("create-volume qos-read-iops-20000 failed: bad flag".into());
        q.teardown = Some("delete-volume qos-write-bw-8mibps failed: busy".into());
        let entries = qos_entries(&q);
        let e = &entries[3];
        assert_eq!((e.ours, e.peer_value, e.ratio), (None, Some(20000.0), None));
        assert!(e
            .error
            .as_deref()
            .is_some_and(|x| x.contains("ublkd: create-volume") && x.contains("teardown")));
        // The other numbers stand; the teardown marks them.
        assert_eq!(entries[1].ours, Some(1020.0));
        assert!(entries[1].error.is_some());
        let table = qos_table(&entries, &q);
        assert!(table.contains("FAILED"), "{table}");
        assert!(
            table.contains("    ! create-volume qos-read-iops-20000 failed"),
            "{table}"
        );
        assert_eq!(table.matches("teardown").count(), 1, "{table}");
        let raw = qos_raw_json(&q);
        assert!(raw["jobs"][3]["measured"].is_null() && raw["jobs"][3]["error"].is_string());
        assert!(raw["teardown_error"].is_string());
    }
}
