//! Reading what the QoS run left: per limit of `QOS_JOBS`, the rate fio measured on a volume
//! with that limit.

use super::recovery::{read_trimmed, teardown_of};
use crate::bench::cases::{QosJob, QosLimit, QOS_JOBS, QOS_RUN};
use std::path::Path;

/// One QoS job: what fio measured, in the unit of its limit (read IOPS, or write MiB/s).
#[derive(Debug, Clone, PartialEq)]
pub struct QosResult {
    pub job: QosJob,
    pub measured: Result<f64, String>,
}

/// The QoS run: every job of `QOS_JOBS` in order, and the run's teardown problems.
#[derive(Debug, Clone, PartialEq)]
pub struct Qos {
    pub jobs: Vec<QosResult>,
    pub teardown: Option<String>,
}

const MIB: f64 = 1024.0 * 1024.0;

/// The figure of fio's JSON report that `limit` bounds: read IOPS, or write MiB/s (from
/// `bw_bytes`). A job that did no I/O in that direction, or reported an error, has none.
fn parse_rate(text: &str, limit: QosLimit) -> Result<f64, String> {
    let job = &super::fio_job(text)?;
    let (dir, field, scale) = match limit {
        QosLimit::Unlimited | QosLimit::ReadIops(_) => ("read", "iops", 1.0),
        QosLimit::WriteMibps(_) => ("write", "bw_bytes", MIB),
    };
    if job[dir]["total_ios"].as_f64().unwrap_or(0.0) <= 0.0 {
        return Err(format!("fio completed no {dir}"));
    }
    job[dir][field]
        .as_f64()
        .map(|x| x / scale)
        .ok_or_else(|| format!("no {dir} {field} in fio output"))
}

/// Reads `dir/QOS_RUN`: `error` (no daemon), and per job ID `ID.error` (no volume), `ID.rc`,
/// `ID.json`, `ID.log`; `teardown_error`.
pub fn collect_qos(dir: &Path) -> Qos {
    let d = dir.join(QOS_RUN);
    let run_error = if !d.is_dir() {
        Some("did not run (the guest ended early)".to_owned())
    } else {
        read_trimmed(&d, "error")
    };
    let jobs = QOS_JOBS
        .iter()
        .map(|job| {
            let id = job.id();
            let read = |ext: &str| read_trimmed(&d, &format!("{id}.{ext}"));
            let measured = if let Some(e) = &run_error {
                Err(e.clone())
            } else if let Some(e) = read("error") {
                Err(e)
            } else {
                match read("rc").as_deref() {
                    None => Err("fio did not run (the guest ended early?)".to_owned()),
                    Some("0") => read("json")
                        .ok_or_else(|| "no fio output".to_owned())
                        .and_then(|t| parse_rate(&t, job.limit)),
                    Some(rc) => {
                        let log = read("log").unwrap_or_default();
                        let tail: Vec<&str> = log.lines().rev().take(3).collect();
                        Err(format!(
                            "fio exited with status {rc}: {}",
                            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
                        ))
                    }
                }
            };
            QosResult {
                job: *job,
                measured,
            }
        })
        .collect();
    Qos {
        jobs,
        teardown: teardown_of(&d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::fs;

    #[test]
    fn fio_rates_are_read_in_the_unit_of_the_limit() {
        let text = r#"fio: note
{"jobs":[{"error":0,"read":{"iops":5012.5,"total_ios":25062,"bw_bytes":20531200},
          "write":{"iops":0.0,"total_ios":0,"bw_bytes":0}}]}"#;
        assert_eq!(parse_rate(text, QosLimit::ReadIops(5000)), Ok(5012.5));
        assert_eq!(parse_rate(text, QosLimit::Unlimited), Ok(5012.5));
        assert!(parse_rate(text, QosLimit::WriteMibps(8)).is_err_and(|e| e.contains("no write")));
        let write = r#"{"jobs":[{"error":0,"read":{"iops":0.0,"total_ios":0},
          "write":{"iops":128.0,"total_ios":640,"bw_bytes":8388608}}]}"#;
        assert_eq!(parse_rate(write, QosLimit::WriteMibps(8)), Ok(8.0));
        let failed = r#"{"jobs":[{"error":5,"read":{"iops":1.0,"total_ios":1}}]}"#;
        assert!(parse_rate(failed, QosLimit::ReadIops(1)).is_err_and(|e| e.contains("error 5")));
        assert!(parse_rate("garbage", QosLimit::ReadIops(1)).is_err());
        assert!(parse_rate(r#"{"jobs":[]}"#, QosLimit::ReadIops(1)).is_err());
    }

    #[test]
    fn qos_results_are_read_from_the_run_directory() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-qos-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        let q = collect_qos(&dir);
        assert_eq!(q.jobs.len(), QOS_JOBS.len());
        assert!(q.jobs.iter().all(|j| j
            .measured
            .as_ref()
            .is_err_and(|e| e.contains("did not run"))));

        let d = dir.join(QOS_RUN);
        fs::create_dir_all(&d).expect("mkdir");
        let write = |name: &str, text: &str| fs::write(d.join(name), text).expect("write");
        let read_json = r#"{"jobs":[{"error":0,"read":{"iops":1001.0,"total_ios":5005}}]}"#;
        write("qos-read-iops-1000.rc", "0\n");
        write("qos-read-iops-1000.json", read_json);
        write("qos-read-iops-5000.rc", "1\n");
        write(
            "qos-read-iops-5000.log",
            "fio: io_u error on file /dev/ublkb1: Input/output error\n",
        );
        write(
            "qos-read-iops-20000.error",
            "create-volume qos-read-iops-20000 --read-iops 20000 failed: unknown flag\n",
        );
        write(
            "teardown_error",
            "delete-volume qos-read-iops-1000 failed: x\n",
        );
        let q = collect_qos(&dir);
        let by_id = |id: &str| {
            q.jobs
                .iter()
                .find(|j| j.job.id() == id)
                .map(|j| j.measured.clone())
                .unwrap_or_else(|| panic!("no job {id}"))
        };
        assert_eq!(by_id("qos-read-iops-1000"), Ok(1001.0));
        assert!(by_id("qos-read-iops-5000").is_err_and(|e| e.contains("status 1: fio: io_u")));
        assert!(by_id("qos-read-iops-20000").is_err_and(|e| e.contains("unknown flag")));
        assert!(by_id("qos-write-bw-8mibps").is_err_and(|e| e.contains("fio did not run")));
        assert!(q.teardown.is_some_and(|t| t.contains("qos-read-iops-1000")));

        write(
            "error",
            "ublkd's socket did not answer node-info within 60 s\n",
        );
        assert!(collect_qos(&dir).jobs[1]
            .measured
            .as_ref()
            .is_err_and(|e| e.contains("node-info")));
        let _ = fs::remove_dir_all(&dir);
    }
}
