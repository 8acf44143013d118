//! Reading what the guest left in the run directory: the fio runs here, the control-plane run
//! in `control`, the CSI run in `csi`, the QoS run in `qos`, the snapshot run in `snapshot`, the
//! recovery and stall runs in `recovery`.

pub mod control;
pub mod csi;
pub mod qos;
pub mod recovery;
pub mod snapshot;

use super::cases::{Build, Metric, Plan, Workload, ABBA, RUNS, WORKLOADS};
use serde_json::Value;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;

/// What one fio job against one device measured.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample {
    pub iops: f64,
    pub lat_us: f64,
    /// Server CPU seconds per million I/Os, or why there is none.
    pub cpu_s_per_mio: Result<f64, String>,
    /// Every CPU's busy time per I/O, in microseconds: fio, the server and the kernel, so that
    /// the kernel's own drivers (loop, null_blk, raw NVMe) have a CPU cost too.
    pub sys_us_per_io: Result<f64, String>,
}

impl Sample {
    pub fn metric(&self, m: Metric) -> f64 {
        match m {
            Metric::Iops => self.iops,
            Metric::LatencyUs => self.lat_us,
        }
    }
}

/// Everything the guest left behind, by run and workload.
#[derive(Debug, Default)]
pub struct Results {
    /// With a baseline, a ublkd run's sample is the mean of the new build's two runs.
    pub samples: BTreeMap<(String, String), Result<Sample, String>>,
    /// Runs whose measurements stand but whose teardown went wrong.
    pub teardown: BTreeMap<String, String>,
    /// `--baseline`: per ublkd run and workload, each build's runs in the order they ran.
    pub ab: BTreeMap<(String, String), Ab>,
}

/// The runs of one ublkd case and workload, per build (A B B A: two each).
#[derive(Debug, Clone, Default)]
pub struct Ab {
    pub new: Vec<Result<Sample, String>>,
    pub base: Vec<Result<Sample, String>>,
}

impl Ab {
    pub fn new_mean(&self) -> Result<Sample, String> {
        mean(&self.new)
    }

    pub fn base_mean(&self) -> Result<Sample, String> {
        mean(&self.base)
    }
}

/// The mean of runs that all succeeded (each figure on its own: CPU may be missing in one);
/// otherwise the first failure.
fn mean(runs: &[Result<Sample, String>]) -> Result<Sample, String> {
    let ok: Vec<&Sample> = runs
        .iter()
        .map(|r| r.as_ref().map_err(Clone::clone))
        .collect::<Result<_, _>>()?;
    if ok.is_empty() {
        return Err("no runs".into());
    }
    let n = ok.len() as f64;
    let avg = |f: &dyn Fn(&Sample) -> Result<f64, String>| -> Result<f64, String> {
        let mut sum = 0.0;
        for s in &ok {
            sum += f(s)?;
        }
        Ok(sum / n)
    };
    Ok(Sample {
        iops: avg(&|s| Ok(s.iops))?,
        lat_us: avg(&|s| Ok(s.lat_us))?,
        cpu_s_per_mio: avg(&|s| s.cpu_s_per_mio.clone()),
        sys_us_per_io: avg(&|s| s.sys_us_per_io.clone()),
    })
}

impl Results {
    pub fn get(&self, run: &str, workload: &str) -> Result<Sample, String> {
        self.samples
            .get(&(run.to_owned(), workload.to_owned()))
            .cloned()
            .unwrap_or_else(|| Err("no result".into()))
    }
}

/// Reads what the guest wrote into `dir` for the runs `plan` selected.
pub fn collect(dir: &Path, plan: &Plan) -> Results {
    let mut results = Results::default();
    for run in RUNS.iter().filter(|r| plan.selected(r.id)) {
        if plan.baseline.is_some() && run.is_ublkd() {
            let mut per_wl: BTreeMap<&str, Ab> = BTreeMap::new();
            for (suffix, build) in ABBA {
                let id = format!("{}{suffix}", run.id);
                for (wl, sample) in load_run(dir, &id, &mut results.teardown) {
                    let ab = per_wl.entry(wl).or_default();
                    match build {
                        Build::New => ab.new.push(sample),
                        Build::Baseline => ab.base.push(sample),
                    }
                }
            }
            for (wl, ab) in per_wl {
                let key = (run.id.to_owned(), wl.to_owned());
                results.samples.insert(key.clone(), ab.new_mean());
                results.ab.insert(key, ab);
            }
        } else {
            for (wl, sample) in load_run(dir, run.id, &mut results.teardown) {
                results
                    .samples
                    .insert((run.id.to_owned(), wl.to_owned()), sample);
            }
        }
    }
    results
}

/// One run directory's samples by workload; its teardown error, if any, goes into `teardown`.
fn load_run(
    dir: &Path,
    id: &str,
    teardown: &mut BTreeMap<String, String>,
) -> Vec<(&'static str, Result<Sample, String>)> {
    let rdir = dir.join(id);
    if let Ok(t) = fs::read_to_string(rdir.join("teardown_error")) {
        if !t.trim().is_empty() {
            teardown.insert(id.to_owned(), t.trim().replace('\n', "; "));
        }
    }
    let run_error = if !rdir.is_dir() {
        Some("did not run (the guest ended early)".to_owned())
    } else {
        fs::read_to_string(rdir.join("error"))
            .ok()
            .map(|e| e.trim().to_owned())
    };
    WORKLOADS
        .iter()
        .map(|wl| {
            let sample = match &run_error {
                Some(e) => Err(e.clone()),
                None => load_sample(&rdir, wl),
            };
            (wl.id, sample)
        })
        .collect()
}

fn load_sample(rdir: &Path, wl: &Workload) -> Result<Sample, String> {
    let read = |ext: &str| fs::read_to_string(rdir.join(format!("{}.{ext}", wl.id)));
    let rc = read("rc").map_err(|_| "fio did not run".to_owned())?;
    if rc.trim() != "0" {
        let log = read("log").unwrap_or_default();
        let tail: Vec<&str> = log.lines().rev().take(3).collect();
        return Err(format!(
            "fio exited with status {}: {}",
            rc.trim(),
            tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
        ));
    }
    let json = read("json").map_err(|e| format!("no fio output: {e}"))?;
    let (iops, lat_us) = parse_fio(&json, wl.rw)?;
    let counters = read("counters").unwrap_or_default();
    let sys = read("syscounters").unwrap_or_default();
    Ok(Sample {
        iops,
        lat_us,
        cpu_s_per_mio: cpu_per_mio(&counters),
        // CPU s per million I/Os is CPU µs per I/O.
        sys_us_per_io: cpu_per_mio(&sys),
    })
}

/// The single job of fio's JSON output; an error if there is none or fio reported one.
pub fn fio_job(text: &str) -> Result<Value, String> {
    // fio may print notes before the JSON document.
    let start = text.find('{').ok_or("no JSON in fio output")?;
    let mut v: Value =
        serde_json::from_str(&text[start..]).map_err(|e| format!("bad fio JSON: {e}"))?;
    let job = v
        .get_mut("jobs")
        .and_then(|j| j.get_mut(0))
        .map_or(Value::Null, Value::take);
    if job.is_null() {
        return Err("no job in fio output".into());
    }
    if let Some(err) = job["error"].as_i64().filter(|&e| e != 0) {
        return Err(format!("fio reported error {err}"));
    }
    Ok(job)
}

/// IOPS and mean latency (µs) of the single job in fio's JSON output.
fn parse_fio(text: &str, rw: &str) -> Result<(f64, f64), String> {
    let job = &fio_job(text)?;
    // Mixed jobs count both directions; their latency is the reads'.
    let dirs: Vec<&Value> = match rw {
        "randrw" => vec![&job["read"], &job["write"]],
        rw if rw.contains("write") => vec![&job["write"]],
        _ => vec![&job["read"]],
    };
    let ios: f64 = dirs
        .iter()
        .map(|d| d["total_ios"].as_f64().unwrap_or(0.0))
        .sum();
    if ios <= 0.0 {
        return Err("fio completed no I/O".into());
    }
    let mut iops = 0.0;
    for d in &dirs {
        iops += d["iops"].as_f64().ok_or("no iops in fio output")?;
    }
    let lat_ns = dirs[0]["lat_ns"]["mean"]
        .as_f64()
        .ok_or("no mean latency in fio output")?;
    Ok((iops, lat_ns / 1000.0))
}

/// Server CPU seconds per million I/Os from a counters line
/// (`ticks_before ticks_after hz ios_before ios_after`).
fn cpu_per_mio(line: &str) -> Result<f64, String> {
    let f: Vec<&str> = line.split_whitespace().collect();
    let [t0, t1, hz, ios0, ios1] = f.as_slice() else {
        return Err(format!("bad counters line {line:?}"));
    };
    if *t0 == "none" || *t1 == "none" {
        return Err("no server process".into());
    }
    let num = |s: &str, what: &str| {
        s.parse::<f64>()
            .map_err(|_| format!("{what} unreadable ({s:?})"))
    };
    let ticks = num(t1, "server CPU time after the job (process gone?)")?
        - num(t0, "server CPU time before the job")?;
    let hz = num(hz, "clock tick rate")?;
    let ios = num(ios1, "device I/O count")? - num(ios0, "device I/O count")?;
    if ios <= 0.0 || hz <= 0.0 {
        return Err("the device completed no I/O".into());
    }
    Ok(ticks / hz / (ios / 1e6))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_json_and_counters_parse() {
        let text = r#"note: both iodepth >= 1 and synchronous I/O engine
{"jobs":[{"error":0,"read":{"iops":8123.5,"total_ios":40000,"lat_ns":{"mean":3900000.0}},
          "write":{"iops":0.0,"total_ios":0,"lat_ns":{"mean":0.0}}}]}"#;
        assert_eq!(parse_fio(text, "randread"), Ok((8123.5, 3900.0)));
        assert!(parse_fio(text, "randwrite").is_err());
        assert!(parse_fio("garbage", "randread").is_err());
        // Mixed: both directions' IOPS, the reads' latency.
        let mixed = r#"{"jobs":[{"error":0,"read":{"iops":700.0,"total_ios":7000,"lat_ns":{"mean":2000.0}},
          "write":{"iops":300.0,"total_ios":3000,"lat_ns":{"mean":9000.0}}}]}"#;
        assert_eq!(parse_fio(mixed, "randrw"), Ok((1000.0, 2.0)));

        // 150 ticks at 100 Hz = 1.5 s over 3 million I/Os.
        assert_eq!(cpu_per_mio("100 250 100 1000 3001000"), Ok(0.5));
        assert!(cpu_per_mio("none none 100 0 5").is_err_and(|e| e.contains("no server process")));
        assert!(cpu_per_mio("100 - 100 0 5").is_err());
        assert!(cpu_per_mio("1 2 100 5 5").is_err());
    }

    fn run(iops: f64, cpu: Result<f64, String>) -> Result<Sample, String> {
        Ok(Sample {
            iops,
            lat_us: 1e6 / iops,
            cpu_s_per_mio: cpu,
            sys_us_per_io: Ok(20.0),
        })
    }

    #[test]
    fn each_builds_runs_average_and_a_failure_is_kept() {
        let ab = Ab {
            new: vec![run(100.0, Ok(2.0)), run(300.0, Ok(4.0))],
            base: vec![
                run(100.0, Ok(1.0)),
                Err("ublkd exited with status 2".into()),
            ],
        };
        let m = ab.new_mean().expect("both new runs succeeded");
        assert_eq!(
            (m.iops, m.cpu_s_per_mio, m.sys_us_per_io),
            (200.0, Ok(3.0), Ok(20.0))
        );
        assert_eq!(
            ab.base_mean().map(|s| s.iops),
            Err("ublkd exited with status 2".into())
        );
        // CPU missing in one run: IOPS still averages, CPU says why.
        let m = mean(&[
            run(100.0, Ok(2.0)),
            run(200.0, Err("no server process".into())),
        ])
        .expect("IOPS of both");
        assert_eq!(
            (m.iops, m.cpu_s_per_mio),
            (150.0, Err("no server process".into()))
        );
        assert!(mean(&[]).is_err());
    }

    #[test]
    fn a_baseline_run_reads_all_four_directories() {
        let dir = std::env::temp_dir().join(format!("ublkd-bench-ab-{}", std::process::id()));
        let job = |iops: f64| {
            format!(
                r#"{{"jobs":[{{"error":0,"read":{{"iops":{iops},"total_ios":1000,"lat_ns":{{"mean":1000.0}}}},
                   "write":{{"iops":{iops},"total_ios":1000,"lat_ns":{{"mean":1000.0}}}}}}]}}"#
            )
        };
        for (suffix, iops) in [
            ("", 100.0),
            ("~base", 50.0),
            ("~base2", 70.0),
            ("~2", 300.0),
        ] {
            let d = dir.join(format!("ublkd-null-batch{suffix}"));
            fs::create_dir_all(&d).expect("run dir");
            for wl in WORKLOADS {
                fs::write(d.join(format!("{}.rc", wl.id)), "0\n").expect("rc");
                fs::write(d.join(format!("{}.json", wl.id)), job(iops)).expect("json");
                fs::write(
                    d.join(format!("{}.counters", wl.id)),
                    "0 100 100 0 1000000\n",
                )
                .expect("counters");
                fs::write(
                    d.join(format!("{}.syscounters", wl.id)),
                    "0 200 100 0 1000000\n",
                )
                .expect("sys");
            }
        }
        let plan = Plan {
            only: Some("ublkd-null-batch".into()),
            baseline: Some(("abc".into(), "/x/ublkd".into())),
        };
        let r = collect(&dir, &plan);
        let _ = fs::remove_dir_all(&dir);
        let key = ("ublkd-null-batch".to_owned(), "randread-qd32".to_owned());
        let ab = &r.ab[&key];
        let iops = |v: &[Result<Sample, String>]| -> Vec<f64> {
            v.iter()
                .map(|s| s.as_ref().map_or(0.0, |s| s.iops))
                .collect()
        };
        assert_eq!(
            (iops(&ab.new), iops(&ab.base)),
            (vec![100.0, 300.0], vec![50.0, 70.0])
        );
        let s = r
            .get("ublkd-null-batch", "randread-qd32")
            .expect("the new build's mean");
        assert_eq!(
            (s.iops, s.cpu_s_per_mio, s.sys_us_per_io),
            (200.0, Ok(1.0), Ok(2.0))
        );
        // The zero-copy run was selected too but never ran: it says so.
        let zc = ("ublkd-null-batch-zc".to_owned(), "randread-qd32".to_owned());
        assert!(r.ab[&zc]
            .new_mean()
            .is_err_and(|e| e.contains("did not run")));
        assert!(!r
            .samples
            .contains_key(&("kublk-null".to_owned(), "randread-qd32".to_owned())));
    }
}
