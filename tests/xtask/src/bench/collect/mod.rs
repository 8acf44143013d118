//! Reading what the guest left in the run directory: the fio runs here, the control-plane run
//! in `control`, the CSI run in `csi`, the QoS run in `qos`, the snapshot run in `snapshot`, the
//! recovery and stall runs in `recovery`.

pub mod control;
pub mod csi;
pub mod qos;
pub mod recovery;
pub mod snapshot;

use super::cases::{Metric, Workload, RUNS, WORKLOADS};
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
    pub samples: BTreeMap<(String, String), Result<Sample, String>>,
    /// Runs whose measurements stand but whose teardown went wrong.
    pub teardown: BTreeMap<String, String>,
}

impl Results {
    pub fn get(&self, run: &str, workload: &str) -> Result<Sample, String> {
        self.samples
            .get(&(run.to_owned(), workload.to_owned()))
            .cloned()
            .unwrap_or_else(|| Err("no result".into()))
    }
}

/// Reads what the guest wrote into `dir`.
pub fn collect(dir: &Path) -> Results {
    let mut results = Results::default();
    for run in RUNS {
        let rdir = dir.join(run.id);
        if let Ok(t) = fs::read_to_string(rdir.join("teardown_error")) {
            if !t.trim().is_empty() {
                results
                    .teardown
                    .insert(run.id.to_owned(), t.trim().replace('\n', "; "));
            }
        }
        let run_error = if !rdir.is_dir() {
            Some("did not run (the guest ended early)".to_owned())
        } else {
            fs::read_to_string(rdir.join("error"))
                .ok()
                .map(|e| e.trim().to_owned())
        };
        for wl in WORKLOADS {
            let sample = match &run_error {
                Some(e) => Err(e.clone()),
                None => load_sample(&rdir, wl),
            };
            results
                .samples
                .insert((run.id.to_owned(), wl.id.to_owned()), sample);
        }
    }
    results
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
    Ok(Sample {
        iops,
        lat_us,
        cpu_s_per_mio: cpu_per_mio(&counters),
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
}
