//! What the host makes of the guest's [`Results`]: the entries of `results.json` (ours against
//! a peer, with a ratio) and every table printed, all through one renderer, [`table`]. The fio
//! cases and `--baseline` here; the node service's sections in `sections`.

use super::cases::{
    Metric, Plan, Run, Workload, ABBA, CEILING_RUN, NO_PEER, OURS_NAME, PAIRS, RSS_PAIRS, RUNS,
    WORKLOADS,
};
use super::results::{mean, Outcome, Results, Sample};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// The unit of a results entry: its name in `results.json` and the decimals shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unit(pub &'static str, pub usize);

impl Unit {
    pub const IOPS: Unit = Unit("IOPS", 0);
    pub const US: Unit = Unit("us", 1);
    pub const CPU_PER_MIO: Unit = Unit("cpu_s_per_mio", 3);
    pub const FRACTION_OF_NULL_BLK: Unit = Unit("fraction_of_null_blk", 3);
    pub const MS: Unit = Unit("ms", 2);
    pub const MIB: Unit = Unit("MiB", 1);
    pub const KIB: Unit = Unit("KiB", 0);
    pub const MIBPS: Unit = Unit("MiB/s", 2);

    /// `ours / peer`, except latency, where `peer / ours` so that above 1 is better for us.
    /// CPU per I/O keeps `ours / peer` (below 1 is better for us), and so do the node service's
    /// units.
    pub fn ratio(self, ours: f64, peer: f64) -> Option<f64> {
        let (num, den) = if self == Unit::US {
            (peer, ours)
        } else {
            (ours, peer)
        };
        let r = num / den;
        (den > 0.0 && r.is_finite()).then_some(r)
    }

    pub fn of(m: Metric) -> Self {
        match m {
            Metric::Iops => Unit::IOPS,
            Metric::LatencyUs => Unit::US,
        }
    }
}

/// One side of a comparison: who, the value or why there is none, and its teardown problems.
#[derive(Debug)]
pub struct Side {
    pub name: String,
    pub value: Outcome<f64>,
    pub teardown: Option<String>,
}

impl Side {
    pub fn new(name: &str, value: Outcome<f64>, teardown: Option<String>) -> Self {
        Side {
            name: name.to_owned(),
            value,
            teardown,
        }
    }
}

/// One line of `results.json`, and of the tables.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub case: String,
    pub ours: Option<f64>,
    pub peer: String,
    pub peer_value: Option<f64>,
    pub ratio: Option<f64>,
    pub unit: Unit,
    pub error: Option<String>,
    /// What the table shows beside the numbers; not in `results.json`.
    pub detail: Option<String>,
}

impl Entry {
    /// Ours against `peer`'s value, or alone (peer `none`, no ratio); every side's failure and
    /// teardown problem in `error`.
    pub fn new(case: impl Into<String>, unit: Unit, ours: Side, peer: Option<Side>) -> Self {
        let mut errors = Vec::new();
        for side in std::iter::once(&ours).chain(&peer) {
            if let Err(e) = &side.value {
                errors.push(format!("{}: {e}", side.name));
            }
            if let Some(t) = &side.teardown {
                errors.push(format!("{} teardown: {t}", side.name));
            }
        }
        let ours = ours.value.ok();
        let peer_value = peer.as_ref().and_then(|p| p.value.clone().ok());
        Entry {
            case: case.into(),
            ours,
            peer: peer.map_or_else(|| NO_PEER.to_owned(), |p| p.name),
            peer_value,
            ratio: ours.zip(peer_value).and_then(|(o, p)| unit.ratio(o, p)),
            unit,
            error: (!errors.is_empty()).then(|| errors.join("; ")),
            detail: None,
        }
    }

    /// Ours alone, as `OURS_NAME`.
    pub fn alone(
        case: impl Into<String>,
        unit: Unit,
        value: Outcome<f64>,
        t: Option<String>,
    ) -> Self {
        Self::new(case, unit, Side::new(OURS_NAME, value, t), None)
    }

    pub fn with_detail(mut self, detail: String) -> Self {
        self.detail = Some(detail);
        self
    }

    pub fn to_json(&self) -> Value {
        let d = self.unit.1 + 1;
        let mut v = json!({
            "case": self.case,
            "ours": self.ours.map(|x| round(x, d)),
            "peer": self.peer,
            "peer_value": self.peer_value.map(|x| round(x, d)),
            "ratio": self.ratio.map(|x| round(x, 4)),
            "unit": self.unit.0,
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

/// `v` with `decimals`, `-` without a value.
pub fn fmt_value(v: Option<f64>, decimals: usize) -> String {
    v.map_or_else(|| "-".to_owned(), |x| format!("{x:.decimals$}"))
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

/// One row of a [`table`]: its cells, and what went wrong, printed on a line of its own below.
pub type Row = (Vec<String>, Option<String>);

/// Every table the bench prints: `header` over `rows`, each column as wide as its widest cell,
/// right-aligned when all its cells are numbers (`-` and `FAILED` count), else left-aligned.
pub fn table(header: &[&str], rows: &[Row]) -> String {
    let numeric = |s: &str| s.parse::<f64>().is_ok() || matches!(s, "-" | "FAILED" | "");
    let cols: Vec<(usize, bool)> = (0..header.len())
        .map(|i| {
            let cells = rows.iter().filter_map(|(c, _)| c.get(i));
            let width = cells.clone().map(|c| c.chars().count()).max().unwrap_or(0);
            (
                width.max(header[i].chars().count()),
                i > 0 && cells.clone().all(|c| numeric(c)),
            )
        })
        .collect();
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut l = String::new();
        for (cell, &(w, right)) in cells.zip(&cols) {
            let _ = match right {
                true => write!(l, "{cell:>w$}  "),
                false => write!(l, "{cell:<w$}  "),
            };
        }
        l.trim_end().to_owned() + "\n"
    };
    let mut s = line(&mut header.iter().copied());
    for (cells, error) in rows {
        s += &line(&mut cells.iter().map(String::as_str));
        if let Some(e) = error {
            let _ = writeln!(s, "    ! {e}");
        }
    }
    s
}

/// Entries as a table: case, ours (`FAILED` without a value), peer, peer value, ratio, unit,
/// and the details when any entry has one; each error below its line.
pub fn entries_table(entries: &[Entry]) -> String {
    let detail = entries.iter().any(|e| e.detail.is_some());
    let mut header = vec!["case", "ours", "peer", "peer value", "ratio", "unit"];
    if detail {
        header.push("");
    }
    let rows: Vec<Row> = entries
        .iter()
        .map(|e| {
            let d = e.unit.1;
            let mut cells = vec![
                e.case.clone(),
                match (e.ours, &e.error) {
                    (None, Some(_)) => "FAILED".to_owned(),
                    (v, _) => fmt_value(v, d),
                },
                e.peer.clone(),
                fmt_value(e.peer_value, d),
                fmt_value(e.ratio, 3),
                e.unit.0.to_owned(),
            ];
            if detail {
                cells.push(e.detail.clone().unwrap_or_default());
            }
            (cells, e.error.clone())
        })
        .collect();
    table(&header, &rows)
}

/// Whether `run` is measured A B B A against the baseline.
fn is_ab(plan: &Plan, run: &str) -> bool {
    RUNS.iter().any(|r| r.id == run && plan.ab(r))
}

/// Each build's runs of ublkd run `run` under workload `wl` in the order they ran: (new,
/// baseline), two each.
pub fn ab_runs(
    results: &Results,
    run: &str,
    wl: &str,
) -> (Vec<Outcome<Sample>>, Vec<Outcome<Sample>>) {
    let (mut new, mut base) = (Vec::new(), Vec::new());
    for (suffix, build) in ABBA {
        let s = results.sample(&format!("{run}{suffix}"), wl);
        match build {
            super::cases::Build::New => new.push(s),
            super::cases::Build::Baseline => base.push(s),
        }
    }
    (new, base)
}

/// What `run` measured under `wl`: with a baseline, a ublkd run's is the mean of the new
/// build's two runs.
pub fn sample(results: &Results, plan: &Plan, run: &str, wl: &str) -> Outcome<Sample> {
    if is_ab(plan, run) {
        mean(&ab_runs(results, run, wl).0)
    } else {
        results.sample(run, wl)
    }
}

/// Every selected run and workload with what it measured, in run order.
pub fn fio_samples(
    results: &Results,
    plan: &Plan,
) -> Vec<(&'static Run, &'static Workload, Outcome<Sample>)> {
    let mut out = Vec::new();
    for run in RUNS.iter().filter(|r| plan.selected(r.id)) {
        for wl in WORKLOADS {
            out.push((run, wl, sample(results, plan, run.id, wl.id)));
        }
    }
    out
}

/// Every run and workload: IOPS, mean latency, server CPU and every CPU per I/O, each failure
/// and each run's teardown problems below its lines.
pub fn fio_table(results: &Results, plan: &Plan) -> String {
    let header = [
        "run",
        "workload",
        "IOPS",
        "mean lat us",
        "cpu s/M I/O",
        "all CPUs us/IO",
    ];
    let mut rows: Vec<Row> = Vec::new();
    for (run, wl, s) in fio_samples(results, plan) {
        let cells = match &s {
            Ok(s) => vec![
                format!("{:.0}", s.iops),
                format!("{:.1}", s.lat_us),
                fmt_value(s.cpu_s_per_mio.clone().ok(), 3),
                fmt_value(s.sys_us_per_io.clone().ok(), 1),
            ],
            Err(_) => vec!["FAILED".into(); 4],
        };
        let mut error = s.err();
        if wl.id == WORKLOADS[WORKLOADS.len() - 1].id {
            if let Some(t) = results.fio(run.id).teardown {
                error = Some(error.map_or(String::new(), |e| e + "; ") + "teardown: " + &t);
            }
        }
        rows.push(([vec![run.id.into(), wl.id.into()], cells].concat(), error));
    }
    table(&header, &rows)
}

/// Every comparison of the fio cases whose runs `plan` selected, in table order: each pair per
/// workload, its server CPU, both against null_blk's IOPS; then RSS, zero copy against copy.
pub fn fio_entries(results: &Results, plan: &Plan) -> Vec<Entry> {
    let side = |name: &str, run: &str, value| Side::new(name, value, results.fio(run).teardown);
    let get = |run: &str, wl: &Workload| sample(results, plan, run, wl.id);
    let mut out = Vec::new();
    for p in PAIRS
        .iter()
        .filter(|p| plan.selected(p.ours) && plan.selected(p.peer))
    {
        let both = |case: String, unit, f: &dyn Fn(&str) -> Outcome<f64>| {
            let peer = side(p.peer_name, p.peer, f(p.peer));
            Entry::new(case, unit, side(OURS_NAME, p.ours, f(p.ours)), Some(peer))
        };
        for wl in WORKLOADS {
            out.push(both(
                format!("{} {}", p.case, wl.label),
                Unit::of(wl.metric),
                &|r| get(r, wl).map(|s| s.metric(wl.metric)),
            ));
        }
        for wl in WORKLOADS.iter().filter(|_| p.cpu) {
            out.push(both(
                format!("{} {} cpu", p.case, wl.label),
                Unit::CPU_PER_MIO,
                &|r| get(r, wl).and_then(|s| s.cpu_s_per_mio),
            ));
        }
        if !(p.ceiling && plan.selected(CEILING_RUN)) {
            continue;
        }
        for wl in WORKLOADS.iter().filter(|w| w.metric == Metric::Iops) {
            let ceiling = get(CEILING_RUN, wl)
                .map(|s| s.iops)
                .map_err(|e| format!("{CEILING_RUN}: {e}"));
            let fraction = |r: &str| {
                let (iops, c) = (get(r, wl)?.iops, ceiling.clone()?);
                match c > 0.0 {
                    true => Ok(iops / c),
                    false => Err(format!("{CEILING_RUN} did no I/O")),
                }
            };
            let case = format!("{} {} vs null_blk", p.case, wl.label);
            out.push(both(case, Unit::FRACTION_OF_NULL_BLK, &fraction));
        }
    }
    let rss = |run: &str| {
        let kib = results.fio(run).value.and_then(|f| f.rss_kib.clone());
        kib.map(|k| k / 1024.0).map_err(|e| format!("{run}: {e}"))
    };
    for &(case, ours, peer) in RSS_PAIRS
        .iter()
        .filter(|(_, o, p)| plan.selected(o) && plan.selected(p))
    {
        let peer = Side::new("ublkd copy", rss(peer), None);
        let ours = Side::new(OURS_NAME, rss(ours), None);
        out.push(Entry::new(case, Unit::MIB, ours, Some(peer)));
    }
    out
}

/// `--baseline`: every selected ublkd run against the baseline's, per workload, each side the
/// mean of its two runs (A B B A); a failed run of either fails the comparison.
pub fn baseline_entries(results: &Results, plan: &Plan, label: &str) -> Vec<Entry> {
    let peer = format!("baseline {label}");
    let mut out = Vec::new();
    for run in RUNS.iter().filter(|r| plan.ab(r) && plan.selected(r.id)) {
        for wl in WORKLOADS {
            let (new, base) = ab_runs(results, run.id, wl.id);
            let (new, base) = (mean(&new), mean(&base));
            let compare = |case: String, unit, f: &dyn Fn(Sample) -> Outcome<f64>| {
                let ours = Side::new(OURS_NAME, new.clone().and_then(f), None);
                let base = Side::new(&peer, base.clone().and_then(f), None);
                Entry::new(case, unit, ours, Some(base))
            };
            let label = format!("{} {}", run.id, wl.label);
            let metric = |s: Sample| Ok(s.metric(wl.metric));
            out.push(compare(label.clone(), Unit::of(wl.metric), &metric));
            let cpu = |s: Sample| s.cpu_s_per_mio;
            out.push(compare(label + " cpu", Unit::CPU_PER_MIO, &cpu));
        }
    }
    out
}

/// The runs behind `baseline_entries`, one line per ublkd run and workload: each build's runs
/// in the order they ran, so that a drift within the boot shows.
pub fn baseline_runs_table(results: &Results, plan: &Plan) -> String {
    let mut rows: Vec<Row> = Vec::new();
    for run in RUNS.iter().filter(|r| plan.ab(r) && plan.selected(r.id)) {
        for wl in WORKLOADS {
            let (new, base) = ab_runs(results, run.id, wl.id);
            let fmt = |v: &[Outcome<Sample>]| {
                let one = |r: &Outcome<Sample>| {
                    r.as_ref()
                        .map_or("failed".into(), |s| format!("{:.0}", s.metric(wl.metric)))
                };
                v.iter().map(one).collect::<Vec<_>>().join(" ")
            };
            let cells = vec![run.id.into(), wl.id.into(), fmt(&new), fmt(&base)];
            rows.push((cells, None));
        }
    }
    table(&["run", "workload", "new A1 A2", "baseline B1 B2"], &rows)
        + "(IOPS; qd1: mean latency us)\n"
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::results::{Case, FioRun, Measured};

    fn sample(iops: f64, lat_us: f64, cpu: f64) -> Outcome<Sample> {
        Ok(Sample {
            iops,
            lat_us,
            cpu_s_per_mio: Ok(cpu),
            sys_us_per_io: Ok(cpu * 2.0),
        })
    }

    /// Every run of `RUNS` (and of `suffixes` of it), each workload measured by `f`.
    fn results_with(suffixes: &[&str], f: impl Fn(&str, &str) -> Outcome<Sample>) -> Results {
        let mut r = Results::default();
        for run in RUNS {
            for suffix in suffixes {
                let id = format!("{}{suffix}", run.id);
                let samples = WORKLOADS
                    .iter()
                    .map(|w| (w.id.into(), f(&id, w.id)))
                    .collect();
                let fio = FioRun {
                    samples,
                    rss_kib: Ok(2048.0),
                };
                let case = Case {
                    measured: Ok(Measured::Fio(fio)),
                    teardown: vec![],
                };
                r.0.insert(id, case);
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
        assert_eq!(Unit::IOPS.ratio(8000.0, 4000.0), Some(2.0));
        // Latency: lower is better, so peer/ours.
        assert_eq!(Unit::US.ratio(50.0, 100.0), Some(2.0));
        assert_eq!(Unit::CPU_PER_MIO.ratio(1.0, 4.0), Some(0.25));
        assert_eq!(Unit::IOPS.ratio(1.0, 0.0), None);
        assert_eq!(Unit::US.ratio(0.0, 1.0), None);
    }

    #[test]
    fn entries_compare_ours_with_peers_and_the_ceiling() {
        let results = results_with(&[""], |run, _| match run {
            "null_blk" => sample(20000.0, 20.0, 0.0),
            r if r.starts_with("ublkd") => sample(10000.0, 100.0, 2.0),
            _ => sample(8000.0, 125.0, 4.0),
        });
        let entries = fio_entries(&results, &Plan::default());
        // 9 pairs x 6 workloads, CPU for 6 pairs x 6, 5 IOPS workloads x 4 ceilings, 2 RSS.
        assert_eq!(entries.len(), 54 + 36 + 20 + 2);
        assert!(entries.iter().all(|e| e.error.is_none()));
        let e = find(&entries, "null per-io randread qd32");
        assert_eq!(
            (e.ours, e.peer_value, e.ratio),
            (Some(10000.0), Some(8000.0), Some(1.25))
        );
        assert_eq!((e.peer.as_str(), e.unit), ("kublk", Unit::IOPS));
        let e = find(&entries, "file randread qd1");
        assert_eq!(
            (e.peer.as_str(), e.unit, e.ratio),
            ("loop", Unit::US, Some(1.25))
        );
        let e = find(&entries, "null batch randwrite qd32 cpu");
        assert_eq!(
            (e.ours, e.peer_value, e.ratio),
            (Some(2.0), Some(4.0), Some(0.5))
        );
        let e = find(&entries, "null batch randread qd32 vs null_blk");
        assert_eq!(
            (e.ours, e.peer_value, e.unit),
            (Some(0.5), Some(0.4), Unit::FRACTION_OF_NULL_BLK)
        );
        let e = find(
            &entries,
            "ublkd RSS, one idle null volume, zero copy vs copy",
        );
        assert_eq!((e.ours, e.unit), (Some(2.0), Unit::MIB));
        assert_eq!(
            e.to_json(),
            json!({"case": "ublkd RSS, one idle null volume, zero copy vs copy", "ours": 2.0,
                   "peer": "ublkd copy", "peer_value": 2.0, "ratio": 1.0, "unit": "MiB"})
        );
    }

    #[test]
    fn a_failed_case_shows_its_error_in_the_table_and_the_json() {
        let mut results = results_with(&[""], |run, _| match run.starts_with("ublkd") {
            true => Err("ublkd exited with status 2 before READY".into()),
            false => sample(8000.0, 125.0, 4.0),
        });
        if let Some(c) = results.0.get_mut("kublk-null") {
            c.teardown.push("kublk del failed".into());
        }
        let entries = fio_entries(&results, &Plan::default());
        let e = find(&entries, "null per-io randread qd32");
        assert_eq!((e.ours, e.peer_value, e.ratio), (None, Some(8000.0), None));
        let err = e.error.as_deref().unwrap_or_default();
        assert!(err.contains("ublkd: ublkd exited with status 2"), "{err}");
        assert!(err.contains("kublk teardown: kublk del failed"), "{err}");
        let v = e.to_json();
        let mut keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
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

        let t = entries_table(&entries[..1]);
        let lines: Vec<&str> = t.lines().collect();
        assert_eq!(lines.len(), 3, "{t}");
        assert!(
            lines[1].starts_with("null per-io randread qd32  FAILED  kublk"),
            "{t}"
        );
        assert!(lines[1].ends_with("8000      -  IOPS"), "{t}");
        assert!(lines[2].starts_with("    ! ublkd: ublkd exited"), "{t}");
        let raw = fio_table(&results, &Plan::default());
        assert!(raw.contains("teardown: kublk del failed"), "{raw}");
        assert!(raw.contains("! ublkd exited with status 2"), "{raw}");
    }

    #[test]
    fn a_baseline_is_compared_from_the_mean_of_each_builds_two_runs() {
        let suffixes: Vec<&str> = ABBA.iter().map(|(s, _)| *s).collect();
        let results = results_with(&suffixes, |run, wl| match (run, wl) {
            ("ublkd-null-batch", _) => sample(150.0, 200.0, 1.0),
            ("ublkd-null-batch~2", "randread-qd1") => Err("fio exited with status 1".into()),
            ("ublkd-null-batch~2", _) => sample(250.0, 200.0, 3.0),
            _ => sample(100.0, 400.0, 4.0),
        });
        let plan = Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/b/ublkd".into())),
        };
        let e = baseline_entries(&results, &plan, "fdc00eb");
        // Two ublkd runs (batch, batch-zc) x 6 workloads x IOPS and CPU.
        assert_eq!(e.len(), 24);
        let read = find(&e, "ublkd-null-batch randread qd32");
        assert_eq!(read.peer, "baseline fdc00eb");
        assert_eq!(
            (read.ours, read.peer_value, read.ratio),
            (Some(200.0), Some(100.0), Some(2.0))
        );
        assert_eq!(
            find(&e, "ublkd-null-batch randread qd32 cpu").ratio,
            Some(0.5)
        );
        // A failed run of either build fails the comparison, never a mean of what is left.
        let qd1 = find(&e, "ublkd-null-batch randread qd1");
        assert!(
            qd1.ratio.is_none() && qd1.error.as_deref().is_some_and(|x| x.contains("status 1"))
        );
        // The fio table and the pairs read the new build's mean.
        let s = sample_of(&results, &plan, "ublkd-null-batch", "randwrite-qd32");
        assert_eq!(s, 200.0);
        let t = baseline_runs_table(&results, &plan);
        assert!(
            t.contains("150 250") && t.contains("100 100") && t.contains("200 failed"),
            "{t}"
        );
    }

    fn sample_of(r: &Results, plan: &Plan, run: &str, wl: &str) -> f64 {
        super::sample(r, plan, run, wl).map_or(0.0, |s| s.iops)
    }

    #[test]
    fn json_entry_has_the_documented_shape() {
        let e = Entry::new(
            "null per-io randread qd32",
            Unit::IOPS,
            Side::new("ublkd", Ok(8123.0), None),
            Some(Side::new("kublk", Ok(8000.0), None)),
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
        // Rank ceil(p/100 * n): 2 of 3 for p50, 3 of 3 for p99.
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 50), Some(2.0));
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 99), Some(3.0));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50), Some(2.0));
        assert_eq!(percentile(&[], 50), None);
        assert_eq!(percentile(&[1.0], 0), None);
        assert_eq!(percentile(&[1.0], 101), None);
    }
}
