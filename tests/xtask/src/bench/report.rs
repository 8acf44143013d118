//! What the host makes of the guest's [`Results`]: the entries of `results.json` (ours against
//! a peer, with a ratio) and every table printed, all through one renderer, [`table`]. The fio
//! cases and `--baseline` here; the node service's sections in `sections`.

use super::cases::{
    Build, Plan, Run, Unit, Workload, ABBA, CEILING_RUN, OURS_NAME, PAIRS, RSS_PAIRS, RUNS,
    WORKLOADS,
};
use super::results::{mean, Outcome, Results, Sample, EVENTS};
use serde_json::{json, Value};
use std::fmt::Write as _;

/// One line of `results.json`, and of the tables.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    pub case: String,
    pub ours: Option<f64>,
    pub peer: String,
    pub peer_value: Option<f64>,
    pub ratio: Option<f64>,
    pub unit: Unit,
    /// Each side's failure (`NAME: ...`) and teardown problem (`NAME teardown: ...`).
    pub error: Option<String>,
    /// What the table shows beside the numbers; not in `results.json`.
    pub detail: Option<String>,
}

impl Entry {
    /// Ours alone (peer `none`, no ratio), with its run's teardown problem.
    pub fn new(case: impl Into<String>, unit: Unit, ours: Outcome<f64>, t: Option<String>) -> Self {
        let mut e = Entry {
            case: case.into(),
            ours: ours.clone().ok(),
            peer: "none".into(),
            peer_value: None,
            ratio: None,
            unit,
            error: None,
            detail: None,
        };
        e.failed(OURS_NAME, ours.err(), t);
        e
    }

    /// Ours against `peer`'s value, with the peer run's teardown problem.
    pub fn vs(mut self, peer: &str, value: Outcome<f64>, t: Option<String>) -> Self {
        self.peer = peer.to_owned();
        self.peer_value = value.clone().ok();
        let both = self.ours.zip(self.peer_value);
        self.ratio = both.and_then(|(o, p)| self.unit.ratio(o, p));
        self.failed(peer, value.err(), t);
        self
    }

    /// `who`'s failure and teardown problem, added to `error`.
    fn failed(&mut self, who: &str, e: Option<String>, t: Option<String>) {
        let e = e.map(|e| format!("{who}: {e}"));
        let t = t.map(|t| format!("{who} teardown: {t}"));
        let all: Vec<String> = self.error.take().into_iter().chain(e).chain(t).collect();
        self.error = (!all.is_empty()).then(|| all.join("; "));
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

/// Each build's runs of ublkd run `run` under workload `wl` in the order they ran: (new,
/// baseline), two each.
pub fn ab_runs(r: &Results, run: &str, wl: &str) -> (Vec<Outcome<Sample>>, Vec<Outcome<Sample>>) {
    let (mut new, mut base) = (Vec::new(), Vec::new());
    for (suffix, build) in ABBA {
        let s = r.sample(&format!("{run}{suffix}"), wl);
        match build {
            Build::New => new.push(s),
            Build::Baseline => base.push(s),
        }
    }
    (new, base)
}

/// What `run` measured under `wl`: with a baseline, a ublkd run's is the mean of the new
/// build's two runs.
pub fn sample(r: &Results, plan: &Plan, run: &str, wl: &Workload) -> Outcome<Sample> {
    match RUNS.iter().any(|x| x.id == run && plan.ab(x)) {
        true => mean(&ab_runs(r, run, &wl.id()).0),
        false => r.sample(run, &wl.id()),
    }
}

/// Every selected run and workload with what it measured, in run order.
pub fn fio_samples(r: &Results, plan: &Plan) -> Vec<(&'static Run, Workload, Outcome<Sample>)> {
    let runs = RUNS.iter().filter(|run| plan.selected(run.id));
    let all = runs.flat_map(|run| WORKLOADS.iter().map(move |wl| (run, *wl)));
    let measured = |(run, wl): (&'static Run, Workload)| (run, wl, sample(r, plan, run.id, &wl));
    all.map(measured).collect()
}

/// Every run and workload: IOPS, mean latency, server CPU and every CPU per I/O, each failure
/// and each run's teardown problems below its lines.
pub fn fio_table(r: &Results, plan: &Plan) -> String {
    let mut rows: Vec<Row> = Vec::new();
    for (run, wl, s) in fio_samples(r, plan) {
        let cells = match &s {
            Ok(s) => vec![
                format!("{:.0}", s.iops),
                format!("{:.1}", s.lat_us),
                fmt_value(s.cpu_s_per_mio.clone().ok(), 3),
                fmt_value(s.sys_us_per_io.clone().ok(), 1),
            ]
            .into_iter()
            .chain(EVENTS.map(|k| fmt_value(s.per_io.get(k).copied(), 2)))
            .collect(),
            Err(_) => vec!["FAILED".into(); 4 + EVENTS.len()],
        };
        let mut error = s.err();
        let last = WORKLOADS.last().is_some_and(|w| w.id() == wl.id());
        if let Some(t) = r.fio(run.id).teardown.filter(|_| last) {
            error = Some(error.map_or(String::new(), |e| e + "; ") + "teardown: " + &t);
        }
        rows.push(([vec![run.id.into(), wl.id()], cells].concat(), error));
    }
    let events = EVENTS.map(|k| format!("{k}/IO"));
    let mut header = vec![
        "run",
        "workload",
        "IOPS",
        "mean lat us",
        "cpu s/M I/O",
        "all CPUs us/IO",
    ];
    header.extend(events.iter().map(String::as_str));
    table(&header, &rows)
}

/// Every comparison of the fio cases whose runs `plan` selected, in table order: each pair per
/// workload, its server CPU, both against null_blk's IOPS; then RSS, zero copy against copy.
pub fn fio_entries(r: &Results, plan: &Plan) -> Vec<Entry> {
    let get = |run: &str, wl: &Workload| sample(r, plan, run, wl);
    let mut out = Vec::new();
    let pairs = PAIRS.iter().filter(|p| plan.selected(p.ours));
    for p in pairs.filter(|p| plan.selected(p.peer)) {
        let mut both = |case: String, unit, f: &dyn Fn(&str) -> Outcome<f64>| {
            let t = |run: &str| r.fio(run).teardown;
            let e = Entry::new(case, unit, f(p.ours), t(p.ours));
            out.push(e.vs(p.peer_name, f(p.peer), t(p.peer)));
        };
        for wl in WORKLOADS {
            let (case, u) = (format!("{} {}", p.case, wl.label()), wl.unit());
            both(case, u, &|run| get(run, wl).map(|s| s.metric(u)));
        }
        for wl in WORKLOADS.iter().filter(|_| p.cpu()) {
            let case = format!("{} {} cpu", p.case, wl.label());
            let cpu = |run: &str| get(run, wl).and_then(|s| s.cpu_s_per_mio);
            both(case, Unit::CPU_PER_MIO, &cpu);
        }
        if !(p.ceiling() && plan.selected(CEILING_RUN)) {
            continue;
        }
        for wl in WORKLOADS.iter().filter(|w| w.unit() == Unit::IOPS) {
            let ceiling = get(CEILING_RUN, wl).map(|s| s.iops);
            let ceiling = ceiling.map_err(|e| format!("{CEILING_RUN}: {e}"));
            let fraction = |run: &str| match (get(run, wl)?.iops, ceiling.clone()?) {
                (_, 0.0) => Err(format!("{CEILING_RUN} did no I/O")),
                (iops, c) => Ok(iops / c),
            };
            let case = format!("{} {} vs null_blk", p.case, wl.label());
            both(case, Unit::FRACTION_OF_NULL_BLK, &fraction);
        }
    }
    let rss = |run: &str| {
        let kib = r.fio(run).value.and_then(|f| f.rss_kib.clone());
        kib.map(|k| k / 1024.0).map_err(|e| format!("{run}: {e}"))
    };
    for (case, ours, peer) in RSS_PAIRS {
        if plan.selected(ours) && plan.selected(peer) {
            let e = Entry::new(case, Unit::MIB, rss(ours), None);
            out.push(e.vs("ublkd copy", rss(peer), None));
        }
    }
    out
}

/// `--baseline`: every selected ublkd run against the baseline's, per workload, each side the
/// mean of its two runs (A B B A); a failed run of either fails the comparison. Also the runs
/// behind them, one line per ublkd run and workload: each build's runs in the order they ran,
/// so that a drift within the boot shows.
pub fn baseline(r: &Results, plan: &Plan, label: &str) -> (Vec<Entry>, String) {
    let peer = format!("baseline {label}");
    let (mut out, mut rows) = (Vec::new(), Vec::<Row>::new());
    for run in RUNS.iter().filter(|run| plan.ab(run)) {
        if !plan.selected(run.id) {
            continue;
        }
        for wl in WORKLOADS {
            let (new, base) = ab_runs(r, run.id, &wl.id());
            let m = wl.unit();
            let one = |s: &Outcome<Sample>| match s {
                Ok(s) => format!("{:.0}", s.metric(m)),
                Err(_) => "failed".into(),
            };
            let fmt = |v: &[Outcome<Sample>]| v.iter().map(one).collect::<Vec<_>>().join(" ");
            rows.push((vec![run.id.into(), wl.id(), fmt(&new), fmt(&base)], None));
            let (new, base) = (mean(&new), mean(&base));
            let label = format!("{} {}", run.id, wl.label());
            let compare = |case: String, unit, f: &dyn Fn(Sample) -> Outcome<f64>| {
                let e = Entry::new(case, unit, new.clone().and_then(f), None);
                e.vs(&peer, base.clone().and_then(f), None)
            };
            out.push(compare(label.clone(), m, &|s| Ok(s.metric(m))));
            let cpu = |s: Sample| s.cpu_s_per_mio;
            out.push(compare(label + " cpu", Unit::CPU_PER_MIO, &cpu));
        }
    }
    let header = ["run", "workload", "new A1 A2", "baseline B1 B2"];
    let runs = table(&header, &rows) + "(IOPS; qd1: mean latency us)\n";
    (out, runs)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::results::{sample, Case, FioRun, Measured};

    /// Every run of `RUNS` (and of `suffixes` of it), each workload measured by `f`.
    fn results_with(suffixes: &[&str], f: impl Fn(&str, &str) -> Outcome<Sample>) -> Results {
        let runs = |r: &'static Run| suffixes.iter().map(move |s| r.id.to_owned() + s);
        let ids = RUNS.iter().flat_map(runs);
        let case = |id: &str| {
            let samples = WORKLOADS.iter().map(|w| (w.id(), f(id, &w.id()))).collect();
            let rss_kib = Ok(2048.0);
            let (measured, teardown) = (Ok(Measured::Fio(FioRun { samples, rss_kib })), vec![]);
            Case { measured, teardown }
        };
        Results(ids.map(|id| (id.clone(), case(&id))).collect())
    }

    /// The table of the entries of `cases`, in that order.
    fn table_of(entries: &[Entry], cases: &[&str]) -> String {
        let find = |c: &&str| entries.iter().find(|e| e.case == *c).cloned();
        let some: Option<Vec<Entry>> = cases.iter().map(find).collect();
        entries_table(&some.unwrap_or_else(|| panic!("not all of {cases:?}")))
    }

    #[test]
    fn entries_compare_ours_with_peers_and_the_ceiling() {
        let results = results_with(&[""], |run, _| match run {
            "null_blk" => sample(20000.0, 20.0, Ok(0.0)),
            r if r.starts_with("ublkd") => sample(10000.0, 100.0, Ok(2.0)),
            _ => sample(8000.0, 125.0, Ok(4.0)),
        });
        let entries = fio_entries(&results, &Plan::default());
        // 18 pairs x 7 workloads, CPU for 13 pairs x 7, 6 IOPS workloads x 4 ceilings, 2 RSS.
        assert_eq!(entries.len(), 126 + 91 + 24 + 2);
        assert!(entries.iter().all(|e| e.error.is_none()));
        // Latency: lower is better, so peer / ours; CPU: ours / peer, below 1 is better.
        let cases = [
            "null per-io randread qd32",
            "file randread qd1",
            "null batch randwrite qd32 cpu",
            "null batch randread qd32 vs null_blk",
        ];
        let expected = "\
case                                   ours  peer   peer value  ratio  unit
null per-io randread qd32             10000  kublk        8000  1.250  IOPS
file randread qd1                     100.0  loop        125.0  1.250  us
null batch randwrite qd32 cpu         2.000  kublk       4.000  0.500  cpu_s_per_mio
null batch randread qd32 vs null_blk  0.500  kublk       0.400  1.250  fraction_of_null_blk
";
        assert_eq!(table_of(&entries, &cases), expected);
        let rss = ["ublkd RSS, one idle null volume, zero copy vs copy"];
        let rss = table_of(&entries, &rss);
        let copy = "2.0  ublkd copy         2.0  1.000  MiB";
        assert!(rss.contains(copy), "{rss}");
        assert_eq!(
            entries[0].to_json(),
            json!({"case": "null per-io randread qd32", "ours": 10000.0, "peer": "kublk",
                   "peer_value": 8000.0, "ratio": 1.25, "unit": "IOPS"})
        );
        let zero = (Unit::IOPS.ratio(1.0, 0.0), Unit::US.ratio(0.0, 1.0));
        assert_eq!(zero, (None, None));
    }

    #[test]
    fn a_failed_case_shows_its_error_in_the_table_and_the_json() {
        let mut results = results_with(&[""], |run, _| match run.starts_with("ublkd") {
            true => Err("ublkd exited with status 2 before READY".into()),
            false => sample(8000.0, 125.0, Ok(4.0)),
        });
        if let Some(c) = results.0.get_mut("kublk-null") {
            c.teardown.push("kublk del failed".into());
        }
        let entries = fio_entries(&results, &Plan::default());
        assert_eq!(
            entries[0].to_json(),
            json!({"case": "null per-io randread qd32", "ours": null, "peer": "kublk",
                   "peer_value": 8000.0, "ratio": null, "unit": "IOPS",
                   "error": "ublkd: ublkd exited with status 2 before READY; \
                             kublk teardown: kublk del failed"})
        );
        let expected = "\
case                         ours  peer   peer value  ratio  unit
null per-io randread qd32  FAILED  kublk        8000      -  IOPS
    ! ublkd: ublkd exited with status 2 before READY; kublk teardown: kublk del failed
";
        assert_eq!(table_of(&entries, &["null per-io randread qd32"]), expected);
        let raw = fio_table(&results, &Plan::default());
        assert!(raw.contains("teardown: kublk del failed"), "{raw}");
        assert!(raw.contains("! ublkd exited with status 2"), "{raw}");
    }

    #[test]
    fn a_baseline_is_compared_from_the_mean_of_each_builds_two_runs() {
        let suffixes: Vec<&str> = ABBA.iter().map(|(s, _)| *s).collect();
        let results = results_with(&suffixes, |run, wl| match (run, wl) {
            ("ublkd-null-batch", _) => sample(150.0, 200.0, Ok(1.0)),
            ("ublkd-null-batch~2", "randread-qd1") => Err("fio exited with status 1".into()),
            ("ublkd-null-batch~2", _) => sample(250.0, 200.0, Ok(3.0)),
            _ => sample(100.0, 400.0, Ok(4.0)),
        });
        let plan = Plan {
            only: Some("null-batch".into()),
            baseline: Some(("fdc00eb".into(), "/b/ublkd".into())),
        };
        let (e, runs) = baseline(&results, &plan, "fdc00eb");
        // Two ublkd runs (batch, batch-zc) x 7 workloads x IOPS and CPU. A failed run of either
        // build fails the comparison, never a mean of what is left.
        assert_eq!(e.len(), 28);
        let cases = [
            "ublkd-null-batch randread qd32",
            "ublkd-null-batch randread qd32 cpu",
            "ublkd-null-batch randread qd1",
        ];
        let expected = "\
case                                  ours  peer              peer value  ratio  unit
ublkd-null-batch randread qd32         200  baseline fdc00eb         100  2.000  IOPS
ublkd-null-batch randread qd32 cpu   2.000  baseline fdc00eb       4.000  0.500  cpu_s_per_mio
ublkd-null-batch randread qd1       FAILED  baseline fdc00eb       400.0      -  us
    ! ublkd: fio exited with status 1
";
        assert_eq!(table_of(&e, &cases), expected);
        // The fio table and the pairs read the new build's mean.
        let s = super::sample(&results, &plan, "ublkd-null-batch", &WORKLOADS[2]);
        assert_eq!(s.map(|s| s.iops), Ok(200.0));
        let drift = ["150 250", "100 100", "200 failed"];
        assert!(drift.iter().all(|d| runs.contains(d)), "{runs}");
    }

    #[test]
    fn percentiles_take_the_nearest_rank() {
        let hundred: Vec<f64> = (1..=100).rev().map(f64::from).collect();
        let p = |v: &[f64], ps: [u32; 3]| ps.map(|p| percentile(v, p));
        assert_eq!(p(&hundred, [50, 99, 100]), [50.0, 99.0, 100.0].map(Some));
        // Rank ceil(p/100 * n): 2 of 3 for p50, 3 of 3 for p99.
        assert_eq!(p(&[3.0, 1.0, 2.0], [50, 99, 1]), [2.0, 3.0, 1.0].map(Some));
        assert_eq!(percentile(&[1.0, 2.0, 3.0, 4.0], 50), Some(2.0));
        assert_eq!(p(&[1.0], [0, 101, 50]), [None, None, Some(1.0)]);
        assert_eq!(percentile(&[], 50), None);
    }
}
