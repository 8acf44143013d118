//! What the bench reports: the entries of `results.json` (ours against a peer, with a ratio),
//! the raw numbers of `raw.json`, and the tables printed. The fio runs here, the control-plane
//! run in `control`, the CSI run in `csi`, QoS accuracy in `qos`, snapshot and clone times in
//! `snapshot`, the recovery and stall runs in `recovery`.

pub mod control;
pub mod csi;
pub mod qos;
pub mod recovery;
pub mod snapshot;

use super::cases::{
    Metric, Plan, CEILING_RUN, NO_PEER, OURS_NAME, PAIRS, RSS_PAIRS, RUNS, WORKLOADS,
};
use super::collect::control::parse_vmrss;
use super::collect::{Results, Sample};
use serde_json::{json, Value};
use std::fmt::Write as _;
use std::fs;
use std::path::Path;

/// The unit of a results entry; it also fixes which way the ratio points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    Iops,
    Us,
    CpuPerMio,
    FractionOfNullBlk,
    Ms,
    MiB,
    KiB,
    /// MiB per second (the QoS bandwidth limits).
    MiBps,
}

impl Unit {
    pub fn name(self) -> &'static str {
        match self {
            Unit::Iops => "IOPS",
            Unit::Us => "us",
            Unit::CpuPerMio => "cpu_s_per_mio",
            Unit::FractionOfNullBlk => "fraction_of_null_blk",
            Unit::Ms => "ms",
            Unit::MiB => "MiB",
            Unit::KiB => "KiB",
            Unit::MiBps => "MiB/s",
        }
    }

    /// `ours / peer`, except latency, where `peer / ours` so that above 1 is better for us.
    /// CPU per I/O keeps `ours / peer` (below 1 is better for us), and so do the control-plane
    /// units, whose entries have no peer today.
    pub fn ratio(self, ours: f64, peer: f64) -> Option<f64> {
        let (num, den) = match self {
            Unit::Us => (peer, ours),
            Unit::Iops
            | Unit::CpuPerMio
            | Unit::FractionOfNullBlk
            | Unit::Ms
            | Unit::MiB
            | Unit::KiB
            | Unit::MiBps => (ours, peer),
        };
        let r = num / den;
        (den > 0.0 && r.is_finite()).then_some(r)
    }

    pub fn decimals(self) -> usize {
        match self {
            Unit::Iops | Unit::KiB => 0,
            Unit::Us | Unit::MiB => 1,
            Unit::Ms | Unit::MiBps => 2,
            Unit::CpuPerMio | Unit::FractionOfNullBlk => 3,
        }
    }
}

impl From<Metric> for Unit {
    fn from(m: Metric) -> Self {
        match m {
            Metric::Iops => Unit::Iops,
            Metric::LatencyUs => Unit::Us,
        }
    }
}

/// One side of a comparison.
#[derive(Debug)]
pub struct Side<'a> {
    pub name: &'a str,
    pub value: Result<f64, String>,
    pub teardown: Option<&'a str>,
}

/// One line of `results.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub case: String,
    pub ours: Option<f64>,
    pub peer: String,
    pub peer_value: Option<f64>,
    pub ratio: Option<f64>,
    pub unit: Unit,
    pub error: Option<String>,
}

impl Entry {
    pub fn compare(case: String, ours: Side<'_>, peer: Side<'_>, unit: Unit) -> Self {
        let mut errors = Vec::new();
        for side in [&ours, &peer] {
            if let Err(e) = &side.value {
                errors.push(format!("{}: {e}", side.name));
            }
            if let Some(t) = side.teardown {
                errors.push(format!("{} teardown: {t}", side.name));
            }
        }
        let ours_v = ours.value.ok();
        let peer_v = peer.value.ok();
        let ratio = match (ours_v, peer_v) {
            (Some(o), Some(p)) => unit.ratio(o, p),
            _ => None,
        };
        Entry {
            case,
            ours: ours_v,
            peer: peer.name.to_owned(),
            peer_value: peer_v,
            ratio,
            unit,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        }
    }

    /// A measurement of ours alone: peer `none`, no peer value, no ratio.
    pub fn alone(case: String, ours: Side<'_>, unit: Unit) -> Self {
        let mut errors = Vec::new();
        if let Err(e) = &ours.value {
            errors.push(format!("{}: {e}", ours.name));
        }
        if let Some(t) = ours.teardown {
            errors.push(format!("{} teardown: {t}", ours.name));
        }
        Entry {
            case,
            ours: ours.value.ok(),
            peer: NO_PEER.to_owned(),
            peer_value: None,
            ratio: None,
            unit,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
        }
    }

    pub fn to_json(&self) -> Value {
        let d = self.unit.decimals() + 1;
        let mut v = json!({
            "case": self.case,
            "ours": self.ours.map(|x| round(x, d)),
            "peer": self.peer,
            "peer_value": self.peer_value.map(|x| round(x, d)),
            "ratio": self.ratio.map(|x| round(x, 4)),
            "unit": self.unit.name(),
        });
        if let Some(e) = &self.error {
            v["error"] = Value::from(e.as_str());
        }
        v
    }
}

pub fn round(x: f64, decimals: usize) -> f64 {
    let f = 10f64.powi(i32::try_from(decimals).unwrap_or(6));
    (x * f).round() / f
}

/// Every comparison the bench reports whose runs `plan` selected, in table order.
pub fn entries(results: &Results, plan: &Plan) -> Vec<Entry> {
    let side = |name: &'static str, run: &'static str, value: Result<f64, String>| Side {
        name,
        value,
        teardown: results.teardown.get(run).map(String::as_str),
    };
    let mut out = Vec::new();
    for pair in PAIRS
        .iter()
        .filter(|p| plan.selected(p.ours) && plan.selected(p.peer))
    {
        for wl in WORKLOADS {
            let value = |run| results.get(run, wl.id).map(|s| s.metric(wl.metric));
            out.push(Entry::compare(
                format!("{} {}", pair.case, wl.label),
                side(OURS_NAME, pair.ours, value(pair.ours)),
                side(pair.peer_name, pair.peer, value(pair.peer)),
                wl.metric.into(),
            ));
        }
        if pair.cpu {
            for wl in WORKLOADS {
                let cpu = |run| results.get(run, wl.id).and_then(|s| s.cpu_s_per_mio);
                out.push(Entry::compare(
                    format!("{} {} cpu", pair.case, wl.label),
                    side(OURS_NAME, pair.ours, cpu(pair.ours)),
                    side(pair.peer_name, pair.peer, cpu(pair.peer)),
                    Unit::CpuPerMio,
                ));
            }
        }
        if pair.ceiling && plan.selected(CEILING_RUN) {
            for wl in WORKLOADS.iter().filter(|w| w.metric == Metric::Iops) {
                let ceiling = results
                    .get(CEILING_RUN, wl.id)
                    .map(|s| s.iops)
                    .map_err(|e| format!("{CEILING_RUN}: {e}"));
                let fraction = |run| {
                    let iops = results.get(run, wl.id)?.iops;
                    let c = ceiling.clone()?;
                    if c > 0.0 {
                        Ok(iops / c)
                    } else {
                        Err(format!("{CEILING_RUN} did no I/O"))
                    }
                };
                out.push(Entry::compare(
                    format!("{} {} vs null_blk", pair.case, wl.label),
                    side(OURS_NAME, pair.ours, fraction(pair.ours)),
                    side(pair.peer_name, pair.peer, fraction(pair.peer)),
                    Unit::FractionOfNullBlk,
                ));
            }
        }
    }
    out
}

/// `--baseline`: every selected ublkd run against the baseline's, per workload, each side the
/// mean of its two runs (A B B A); the ratio points the bench's way (above 1 is better for the
/// new build, for latency too), and CPU per I/O is new / baseline (below 1 is better).
pub fn baseline_entries(results: &Results, label: &str) -> Vec<Entry> {
    let peer = format!("baseline {label}");
    let mut out = Vec::new();
    for run in RUNS.iter().filter(|r| r.is_ublkd()) {
        for wl in WORKLOADS {
            let Some(ab) = results.ab.get(&(run.id.to_owned(), wl.id.to_owned())) else {
                continue;
            };
            let (new, base) = (ab.new_mean(), ab.base_mean());
            let side = |name, value| Side {
                name,
                value,
                teardown: None,
            };
            let metric = |s: &Result<Sample, String>| {
                s.as_ref()
                    .map(|s| s.metric(wl.metric))
                    .map_err(Clone::clone)
            };
            out.push(Entry::compare(
                format!("{} {}", run.id, wl.label),
                side(OURS_NAME, metric(&new)),
                side(&peer, metric(&base)),
                wl.metric.into(),
            ));
            let cpu = |s: &Result<Sample, String>| {
                s.as_ref()
                    .map_err(Clone::clone)
                    .and_then(|s| s.cpu_s_per_mio.clone())
            };
            out.push(Entry::compare(
                format!("{} {} cpu", run.id, wl.label),
                side(OURS_NAME, cpu(&new)),
                side(&peer, cpu(&base)),
                Unit::CpuPerMio,
            ));
        }
    }
    out
}

/// The runs behind `baseline_entries`, one line per ublkd run and workload: each build's runs
/// in the order they ran, so that a drift within the boot is visible.
pub fn baseline_runs_table(results: &Results) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<22} {:<20} {:>18} {:>18}  (IOPS; qd1: mean latency us)",
        "run", "workload", "new A1 A2", "baseline B1 B2"
    );
    for ((run, wl), ab) in &results.ab {
        let Some(w) = WORKLOADS.iter().find(|w| w.id == wl) else {
            continue;
        };
        let fmt = |v: &[Result<Sample, String>]| {
            v.iter()
                .map(|r| {
                    r.as_ref().map_or("failed".to_owned(), |s| {
                        format!("{:.0}", s.metric(w.metric))
                    })
                })
                .collect::<Vec<_>>()
                .join(" ")
        };
        let _ = writeln!(
            s,
            "{run:<22} {wl:<20} {:>18} {:>18}",
            fmt(&ab.new),
            fmt(&ab.base)
        );
    }
    s
}

/// The raw runs behind `baseline_entries`, for `raw.json`.
pub fn baseline_raw_json(results: &Results, label: &str) -> Value {
    let runs = |v: &[Result<Sample, String>]| -> Vec<Value> {
        v.iter()
            .map(|r| match r {
                Ok(s) => json!({"iops": round(s.iops, 1), "lat_us": round(s.lat_us, 2),
                                "cpu_s_per_mio": s.cpu_s_per_mio.as_ref().ok().map(|x| round(*x, 4))}),
                Err(e) => json!({"error": e}),
            })
            .collect()
    };
    let list: Vec<Value> = results
        .ab
        .iter()
        .map(|((run, wl), ab)| json!({"run": run, "workload": wl, "new": runs(&ab.new), "baseline": runs(&ab.base)}))
        .collect();
    json!({"baseline": label, "order": "A B B A for even cases, B A A B for odd ones, after a discarded warm-up", "runs": list})
}

pub fn rss_entries(dir: &Path, plan: &Plan) -> Vec<Entry> {
    let rss = |run: &str| -> Result<f64, String> {
        let text = fs::read_to_string(dir.join(run).join("status.idle"))
            .map_err(|_| format!("{run}: no /proc status (the run failed?)"))?;
        parse_vmrss(&text).map(|kib| kib / 1024.0)
    };
    RSS_PAIRS
        .iter()
        .filter(|(_, ours, peer)| plan.selected(ours) && plan.selected(peer))
        .map(|&(case, ours, peer)| {
            Entry::compare(
                case.to_owned(),
                Side {
                    name: OURS_NAME,
                    value: rss(ours),
                    teardown: None,
                },
                Side {
                    name: "ublkd copy",
                    value: rss(peer),
                    teardown: None,
                },
                Unit::MiB,
            )
        })
        .collect()
}

/// The `p`th percentile of `values` by nearest rank: the smallest value that at least `p`
/// percent of them do not exceed (`p` in 1..=100). `None` when `values` is empty.
pub fn percentile(values: &[f64], p: u32) -> Option<f64> {
    if values.is_empty() || p == 0 || p > 100 {
        return None;
    }
    let mut sorted = values.to_vec();
    sorted.sort_by(f64::total_cmp);
    let rank = (p as usize * sorted.len()).div_ceil(100).max(1);
    sorted.get(rank - 1).copied()
}

/// Entries without a peer as a table: case, our value, unit, and each error below its line.
pub fn alone_table(entries: &[Entry]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "{:<34} {:>10}  unit", "case", "ublkd");
    for e in entries {
        let value = match (e.ours, &e.error) {
            (None, Some(_)) => "FAILED".to_owned(),
            (v, _) => fmt_value(v, e.unit.decimals()),
        };
        let _ = writeln!(s, "{:<34} {:>10}  {}", e.case, value, e.unit.name());
        if let Some(err) = &e.error {
            let _ = writeln!(s, "    ! {err}");
        }
    }
    s
}

fn fmt_value(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.decimals$}"))
}

pub fn entries_table(entries: &[Entry]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<54} {:>12} {:>18} {:>12} {:>7}  unit",
        "case", "ours", "peer", "peer value", "ratio"
    );
    for e in entries {
        let d = e.unit.decimals();
        let ours = match (e.ours, &e.error) {
            (None, Some(_)) => "FAILED".to_owned(),
            (v, _) => fmt_value(v, d),
        };
        let _ = writeln!(
            s,
            "{:<54} {:>12} {:>18} {:>12} {:>7}  {}",
            e.case,
            ours,
            e.peer,
            fmt_value(e.peer_value, d),
            fmt_value(e.ratio, 3),
            e.unit.name()
        );
        if let Some(err) = &e.error {
            let _ = writeln!(s, "    ! {err}");
        }
    }
    s
}

pub fn raw_table(results: &Results) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<20} {:<20} {:>10} {:>12} {:>14} {:>14}",
        "run", "workload", "IOPS", "mean lat us", "cpu s/M I/O", "all CPUs us/IO"
    );
    for run in RUNS {
        for wl in WORKLOADS {
            if !results
                .samples
                .contains_key(&(run.id.to_owned(), wl.id.to_owned()))
            {
                continue;
            }
            match results.get(run.id, wl.id) {
                Ok(sample) => {
                    let _ = writeln!(
                        s,
                        "{:<20} {:<20} {:>10.0} {:>12.1} {:>14} {:>14}",
                        run.id,
                        wl.id,
                        sample.iops,
                        sample.lat_us,
                        fmt_value(sample.cpu_s_per_mio.ok(), 3),
                        fmt_value(sample.sys_us_per_io.ok(), 1)
                    );
                }
                Err(e) => {
                    let _ = writeln!(s, "{:<20} {:<20} FAILED: {e}", run.id, wl.id);
                }
            }
        }
        if let Some(t) = results.teardown.get(run.id) {
            let _ = writeln!(s, "{:<20} teardown: {t}", run.id);
        }
    }
    s
}

pub fn raw_json(results: &Results) -> Value {
    let mut list = Vec::new();
    for run in RUNS {
        for wl in WORKLOADS {
            if !results
                .samples
                .contains_key(&(run.id.to_owned(), wl.id.to_owned()))
            {
                continue;
            }
            let mut v = json!({ "run": run.id, "workload": wl.id });
            match results.get(run.id, wl.id) {
                Ok(sample) => {
                    v["iops"] = json!(round(sample.iops, 1));
                    v["lat_us"] = json!(round(sample.lat_us, 2));
                    v["cpu_s_per_mio"] = json!(sample.cpu_s_per_mio.ok().map(|x| round(x, 4)));
                    v["all_cpus_us_per_io"] = json!(sample.sys_us_per_io.ok().map(|x| round(x, 2)));
                }
                Err(e) => v["error"] = Value::from(e),
            }
            if let Some(t) = results.teardown.get(run.id) {
                v["teardown_error"] = Value::from(t.as_str());
            }
            list.push(v);
        }
    }
    Value::Array(list)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(iops: f64, lat_us: f64, cpu: f64) -> Result<Sample, String> {
        Ok(Sample {
            iops,
            lat_us,
            cpu_s_per_mio: Ok(cpu),
            sys_us_per_io: Ok(cpu * 2.0),
        })
    }

    fn results_with(f: impl Fn(&str, &str) -> Result<Sample, String>) -> Results {
        let mut r = Results::default();
        for run in RUNS {
            for wl in WORKLOADS {
                r.samples
                    .insert((run.id.into(), wl.id.into()), f(run.id, wl.id));
            }
        }
        r
    }

    fn find<'a>(entries: &'a [Entry], case: &str) -> &'a Entry {
        entries
            .iter()
            .find(|e| e.case == case)
            .unwrap_or_else(|| panic!("no entry {case:?}"))
    }

    #[test]
    fn ratios_point_the_way_the_unit_says() {
        assert_eq!(Unit::Iops.ratio(8000.0, 4000.0), Some(2.0));
        // Latency: lower is better, so peer/ours.
        assert_eq!(Unit::Us.ratio(50.0, 100.0), Some(2.0));
        assert_eq!(Unit::CpuPerMio.ratio(1.0, 4.0), Some(0.25));
        assert_eq!(Unit::Iops.ratio(1.0, 0.0), None);
        assert_eq!(Unit::Us.ratio(0.0, 1.0), None);
    }

    #[test]
    fn entries_compare_ours_with_peers_and_the_ceiling() {
        let results = results_with(|run, _| match run {
            "null_blk" => sample(20000.0, 20.0, 0.0),
            r if r.starts_with("ublkd") => sample(10000.0, 100.0, 2.0),
            _ => sample(8000.0, 125.0, 4.0),
        });
        let entries = entries(&results, &Plan::default());
        // 9 pairs x 6 workloads, CPU for 6 pairs x 6, 5 IOPS workloads x 4 ceilings.
        assert_eq!(entries.len(), 54 + 36 + 20);
        assert!(entries.iter().all(|e| e.error.is_none()));

        let e = find(&entries, "null per-io randread qd32");
        assert_eq!((e.ours, e.peer_value), (Some(10000.0), Some(8000.0)));
        assert_eq!((e.peer.as_str(), e.unit), ("kublk", Unit::Iops));
        assert_eq!(e.ratio, Some(1.25));

        let e = find(&entries, "file randread qd1");
        assert_eq!((e.peer.as_str(), e.unit), ("loop", Unit::Us));
        assert_eq!(e.ratio, Some(1.25));

        let e = find(&entries, "null batch randwrite qd32 cpu");
        assert_eq!(
            (e.ours, e.peer_value, e.ratio),
            (Some(2.0), Some(4.0), Some(0.5))
        );

        let e = find(&entries, "null batch zero copy randrw 70/30 64k qd32");
        assert_eq!(
            (e.peer.as_str(), e.unit),
            ("kublk -b --auto_zc", Unit::Iops)
        );

        let e = find(&entries, "null batch randread qd32 vs null_blk");
        assert_eq!((e.ours, e.peer_value), (Some(0.5), Some(0.4)));
        assert_eq!(e.unit, Unit::FractionOfNullBlk);
    }

    #[test]
    fn a_baseline_is_compared_case_by_case_from_both_builds_runs() {
        use crate::bench::collect::Ab;
        let mut results = Results::default();
        let key = |wl: &str| ("ublkd-null-batch".to_owned(), wl.to_owned());
        results.ab.insert(
            key("randread-qd32"),
            Ab {
                new: vec![sample(150.0, 200.0, 1.0), sample(250.0, 200.0, 3.0)],
                base: vec![sample(100.0, 400.0, 4.0), sample(100.0, 400.0, 4.0)],
            },
        );
        results.ab.insert(
            key("randread-qd1"),
            Ab {
                new: vec![
                    sample(10.0, 50.0, 1.0),
                    Err("fio exited with status 1".into()),
                ],
                base: vec![sample(10.0, 100.0, 1.0), sample(10.0, 100.0, 1.0)],
            },
        );
        let e = baseline_entries(&results, "fdc00eb");
        assert_eq!(e.len(), 4, "{e:?}");
        let read = find(&e, "ublkd-null-batch randread qd32");
        assert_eq!(read.peer, "baseline fdc00eb");
        assert_eq!(
            (read.ours, read.peer_value, read.ratio),
            (Some(200.0), Some(100.0), Some(2.0))
        );
        let cpu = find(&e, "ublkd-null-batch randread qd32 cpu");
        assert_eq!(cpu.ratio, Some(0.5));
        // A failed run of either build fails the comparison, never a mean of what is left.
        let qd1 = find(&e, "ublkd-null-batch randread qd1");
        assert!(
            qd1.ratio.is_none() && qd1.error.as_deref().is_some_and(|x| x.contains("status 1"))
        );
        let t = baseline_runs_table(&results);
        assert!(
            t.contains("150 250") && t.contains("100 100") && t.contains("failed"),
            "{t}"
        );
        let raw = baseline_raw_json(&results, "fdc00eb");
        assert_eq!(raw["runs"][1]["new"][0]["iops"], 150.0, "{raw}");
    }

    #[test]
    fn failed_runs_give_null_values_and_an_error() {
        let mut results = results_with(|run, _| {
            if run.starts_with("ublkd") {
                Err("ublkd exited with status 2 before READY".into())
            } else {
                sample(8000.0, 125.0, 4.0)
            }
        });
        results
            .teardown
            .insert("kublk-null".into(), "kublk del failed".into());
        let entries = entries(&results, &Plan::default());
        let e = find(&entries, "null per-io randread qd32");
        assert_eq!((e.ours, e.peer_value, e.ratio), (None, Some(8000.0), None));
        let err = e.error.as_deref().unwrap_or_default();
        assert!(err.contains("ublkd: ublkd exited with status 2"), "{err}");
        assert!(err.contains("kublk teardown: kublk del failed"), "{err}");

        let v = e.to_json();
        let keys: Vec<&str> = v
            .as_object()
            .map(|o| o.keys().map(String::as_str).collect())
            .unwrap_or_default();
        let mut keys = keys;
        keys.sort_unstable();
        assert_eq!(
            keys,
            [
                "case",
                "error",
                "ours",
                "peer",
                "peer_value",
                "ratio",
                "unit"
            ]
        );
        assert!(v["ours"].is_null() && v["ratio"].is_null());
        assert_eq!(v["peer_value"], 8000.0);
        assert_eq!(v["unit"], "IOPS");
    }

    #[test]
    fn json_entry_has_the_documented_shape() {
        let e = Entry::compare(
            "null per-io randread qd32".into(),
            Side {
                name: "ublkd",
                value: Ok(8123.0),
                teardown: None,
            },
            Side {
                name: "kublk",
                value: Ok(8000.0),
                teardown: None,
            },
            Unit::Iops,
        );
        assert_eq!(
            e.to_json(),
            json!({"case": "null per-io randread qd32", "ours": 8123.0, "peer": "kublk",
                   "peer_value": 8000.0, "ratio": 1.0154, "unit": "IOPS"})
        );
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&hundred, 50), Some(50.0));
        assert_eq!(percentile(&hundred, 99), Some(99.0));
        assert_eq!(percentile(&hundred, 100), Some(100.0));
        assert_eq!(percentile(&hundred, 1), Some(1.0));
        // Rank ceil(p/100 * n): 2 of 3 for p50, 3 of 3 for p99.
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50), Some(2.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50), Some(2.0));
        assert_eq!(percentile(&[7.5], 99), Some(7.5));
        assert_eq!(percentile(&[], 50), None);
        assert_eq!(percentile(&[1.0], 0), None);
        assert_eq!(percentile(&[1.0], 101), None);
    }
}
