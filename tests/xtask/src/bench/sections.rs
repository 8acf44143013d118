//! The node service's sections in the report: each one's entries of `results.json` (peer
//! `none`, but for a few comparisons) and the notes printed under its table.

use super::cases::{
    recovery_run, QosLimit, Unit, CONTROL_DEPTH, CONTROL_LOAD_CALLS, CONTROL_RUN, CONTROL_SIZE,
    CONTROL_VOLUMES, CSI_PARALLEL, CSI_RUN, CSI_VOLUMES, QOS_JOBS, QOS_QD, QOS_RUN,
    QOS_RUNTIME_SECS, QOS_SIZE, RECOVERY_VOLUMES, SNAPSHOT_FILL_MIB, SNAPSHOT_FS_GIB, SNAPSHOT_GIB,
    SNAPSHOT_REPEATS, SNAPSHOT_RUN, STALL_KILL_AT_SECS, STALL_RUN, STALL_RUNTIME_SECS, STALL_SIZE,
};
use super::report::{percentile, Entry};
use super::results::{Control, Measured, Outcome, Restart, Results, SnapSize, Timed};

/// One section: a title, its entries, and what the numbers include.
#[derive(Debug)]
pub struct Section {
    pub title: &'static str,
    pub entries: Vec<Entry>,
    pub notes: Vec<String>,
}

/// Every section, in the order they ran.
pub fn sections(r: &Results) -> Vec<Section> {
    vec![control(r), csi(r), qos(r), snapshots(r), recovery(r)]
}

/// The `p`th percentile of a list of calls (ms).
fn pct(ms: Outcome<&Vec<f64>>, p: u32) -> Outcome<f64> {
    ms.and_then(|v| percentile(v, p).ok_or_else(|| "no calls timed".into()))
}

fn control(r: &Results) -> Section {
    let v = view!(r, CONTROL_RUN, Measured::Control);
    let entry = |case: String, unit, value| Entry::new(case, unit, value, v.teardown.clone());
    let field = |f: fn(&Control) -> &Outcome<f64>| v.value.clone().and_then(|c| f(c).clone());
    let calls = |case: &str, ps: [u32; 2], f: fn(&Control) -> &Outcome<Vec<f64>>| {
        let ms = v.value.clone();
        let ms = ms.and_then(|c| f(c).as_ref().map_err(Clone::clone));
        ps.map(|p| entry(format!("{case} p{p}"), Unit::MS, pct(ms.clone(), p)))
    };
    let (empty, full) = (field(|c| &c.rss_empty_kib), field(|c| &c.rss_full_kib));
    let per_volume = match (&empty, &full) {
        (Ok(e), Ok(f)) => Ok((f - e) / CONTROL_VOLUMES as f64),
        (Err(e), _) | (_, Err(e)) => Err(e.clone()),
    };
    let mib = |kib: Outcome<f64>| kib.map(|k| k / 1024.0);
    let mut e = Vec::new();
    e.extend(calls("ublkctl create-volume", [50, 99], |c| &c.create_ms));
    e.extend(calls("ublkctl delete-volume", [50, 99], |c| &c.delete_ms));
    e.push(entry("ublkd RSS, 0 volumes".into(), Unit::MIB, mib(empty)));
    let case = format!("ublkd RSS, {CONTROL_VOLUMES} idle volumes");
    e.push(entry(case, Unit::MIB, mib(full)));
    let case = "ublkd RSS per idle volume".into();
    e.push(entry(case, Unit::KIB, per_volume));
    let scrape = format!("GET /metrics, {CONTROL_VOLUMES} volumes,");
    e.extend(calls(&scrape, [50, 100], |c| &c.scrape_ms));
    let load = "ublkctl create-volume under load";
    e.extend(calls(load, [50, 99], |c| &c.load_create_ms));
    let load = "ublkctl delete-volume under load";
    e.extend(calls(load, [50, 99], |c| &c.load_delete_ms));
    let case = "fio load during those calls".into();
    e.push(entry(case, Unit::IOPS, field(|c| &c.load_iops)));
    Section {
        title: "control plane (ublkd --config, driven by ublkctl)",
        entries: e,
        notes: vec![format!(
            "note: create/delete latencies are as seen by ublkctl, including its start-up (one \
             process per call); create-volume returns when /dev/ublkbN serves I/O. \
             {CONTROL_VOLUMES} null volumes of {CONTROL_SIZE}, 1 queue of depth {CONTROL_DEPTH}; \
             p50/p99 by nearest rank. Under load: {CONTROL_LOAD_CALLS} more creates and deletes \
             while fio (4 KiB randread, QD32) runs on two of the volumes, so each attach and \
             teardown waits for a busy worker to read its command between completions; compare \
             them with the idle ones above."
        )],
    }
}

fn csi(r: &Results) -> Section {
    let v = view!(r, CSI_RUN, Measured::Csi);
    let t = || v.teardown.clone();
    let mut entries = Vec::new();
    for (fs, p) in [("ext4", 50), ("ext4", 99), ("xfs", 50), ("xfs", 99)] {
        let ms = v.value.clone();
        let ms = ms.map(|c| if fs == "ext4" { &c.ext4_ms } else { &c.xfs_ms });
        let case = format!("CSI CreateVolume to mounted {fs} p{p}");
        entries.push(Entry::new(case, Unit::MS, pct(ms, p), t()));
    }
    let seq = v.value.clone().map(|c| c.stage_seq_ms);
    let par = v.value.clone().map(|c| c.stage_par_ms);
    let case = format!("CSI {CSI_PARALLEL} stages one at a time");
    entries.push(Entry::new(case, Unit::MS, seq.clone(), t()));
    let case = format!("CSI {CSI_PARALLEL} stages in parallel vs one at a time");
    let e = Entry::new(case, Unit::MS, par.clone(), t());
    entries.push(e.vs("one at a time", seq.clone(), None));
    let mut notes = Vec::new();
    if let (Ok(seq), Ok(par)) = (seq, par) {
        let x = seq / par;
        notes.push(format!("parallel stages finish {x:.2}x faster in total"));
    }
    notes.push(format!(
        "note: each CSI call is one `ublkd-csi ctl` process (its start-up included) against a \
         ublkd-csi in front of ublkd; to mounted = CreateVolume + NodeStageVolume (mkfs, mount) \
         + NodePublishVolume (bind mount), {CSI_VOLUMES} file volumes per file system (ext4 64 \
         MiB, xfs 320 MiB); stages are of fresh ext4 volumes (mkfs included). p50/p99 by nearest \
         rank."
    ));
    Section {
        title: "CSI (ublkd-csi in front of ublkd, called as the provisioner and kubelet would)",
        entries,
        notes,
    }
}

/// One entry per job, in run order: ours the measured rate, the limit as the peer's value,
/// measured / limit as the ratio; the unlimited job alone, the ceiling of this setup.
fn qos(r: &Results) -> Section {
    let v = view!(r, QOS_RUN, Measured::Qos);
    let mut entries = Vec::new();
    for limit in QOS_JOBS {
        let measured = v.value.clone().and_then(|q| {
            let m = q.jobs.get(&limit.id()).cloned();
            m.unwrap_or_else(|| Err("did not run".into()))
        });
        let unit = match limit {
            QosLimit::WriteMibps(_) => Unit::MIBPS,
            QosLimit::Unlimited | QosLimit::ReadIops(_) => Unit::IOPS,
        };
        let mut e = Entry::new(limit.id(), unit, measured, v.teardown.clone());
        if let Some(l) = limit.value() {
            e = e.vs("limit", Ok(l), None);
        }
        // How far from the limit, in percent of it (above 0: over the limit).
        let off = |x: f64| format!(", {:+.2} %", (x - 1.0) * 100.0);
        let off = e.ratio.map_or(String::new(), off);
        let (rw, bs) = limit.fio();
        entries.push(e.with_detail(format!("fio {rw} {bs} qd{QOS_QD}{off}")));
    }
    Section {
        title: "QoS accuracy (a null volume per limit, fio against it)",
        entries,
        notes: vec![format!(
            "note: each limit is set by `ublkctl create-volume` on its own null volume of \
             {QOS_SIZE} (ublkd --config, one queue); fio io_uring direct, QD{QOS_QD}, \
             {QOS_RUNTIME_SECS} s after a 1 s ramp that the burst allowance (the daemon's default, \
             100 ms) falls into; measured is fio's read IOPS or write bandwidth over those \
             {QOS_RUNTIME_SECS} s. The unlimited volume shows what this setup can do: a limit \
             near it measures the setup, not the limit. Unthrottled speed with QoS compiled in is \
             the null cases above."
        )],
    }
}

/// `ublkctl-node-info` (the floor of a call), then per size `create-volume-Ng` (empty, sparse),
/// `snapshot-Ng` and `clone-Ng` (medians, ms; every size but the first against the first's,
/// since the times must not grow with size), `snapshot-Ng-df-growth` and `clone-Ng-df-growth`.
fn snapshots(r: &Results) -> Section {
    let v = view!(r, SNAPSHOT_RUN, Measured::Snapshots);
    let t = || v.teardown.clone();
    let median = |l: Outcome<Vec<f64>>| pct(l.as_ref().map_err(Clone::clone), 50);
    let noop = median(v.value.clone().and_then(|s| s.noop_ms.clone()));
    let mut entries = vec![Entry::new("ublkctl-node-info", Unit::MS, noop, t())];
    let mut first: Option<(u64, [Outcome<f64>; 3])> = None;
    for gib in SNAPSHOT_GIB {
        let z = v.value.clone().and_then(|s| {
            let z = s.sizes.iter().find(|z| z.gib == gib);
            z.ok_or_else(|| format!("{gib} GiB not measured"))
        });
        // The median of each call of `l` as `f` reads it.
        let of = |l: fn(&SnapSize) -> &Outcome<Vec<Timed>>, f: fn(&Timed) -> f64| {
            let l = z.clone().and_then(|z| l(z).clone());
            median(l.map(|l| l.iter().map(f).collect()))
        };
        let create = z.clone().and_then(|z| z.create_ms.clone());
        let (snapshot, clone) = (of(|z| &z.snapshot, |t| t.ms), of(|z| &z.clone, |t| t.ms));
        let times = [create, snapshot, clone];
        let ops = ["create-volume", "snapshot", "clone"];
        for (k, (op, ms)) in ops.into_iter().zip(times.clone()).enumerate() {
            let mut e = Entry::new(format!("{op}-{gib}g"), Unit::MS, ms, t());
            if let Some((base_gib, base)) = &first {
                e = e.vs(&format!("{base_gib} GiB"), base[k].clone(), None);
            }
            let extents = z.as_ref().ok().and_then(|z| z.extents);
            entries.push(match (op, extents) {
                ("snapshot", Some(n)) => e.with_detail(format!("{n} extents after the fill")),
                _ => e,
            });
        }
        let snapshot = of(|z| &z.snapshot, |t| t.growth_kib);
        let growth = [
            ("snapshot", snapshot),
            ("clone", of(|z| &z.clone, |t| t.growth_kib)),
        ];
        for (op, g) in growth {
            let case = format!("{op}-{gib}g-df-growth");
            entries.push(Entry::new(case, Unit::KIB, g, t()));
        }
        first.get_or_insert((gib, times));
    }
    let reflink = match v.value.as_ref().map(|s| s.reflink) {
        Ok(Some(true)) => "",
        Ok(Some(false)) => "? xfs_info did not show it",
        _ => "? not checked",
    };
    Section {
        title: "snapshots and clones (file volumes on XFS with reflink, through ublkctl)",
        entries,
        notes: vec![format!(
            "note: file volumes on XFS (reflink=1{reflink}, {SNAPSHOT_FS_GIB} GiB on a loop device \
             over a sparse file in the guest's tmpfs); each volume created empty on a sparse file, \
             then {SNAPSHOT_FILL_MIB} MiB written by fio (randwrite 64k across the volume) and \
             synced. {SNAPSHOT_REPEATS} create-snapshot calls per volume, each followed by a \
             create-volume --from-snapshot; medians shown. Times are ublkctl end to end, its \
             start-up included (node-info is that floor); a clone includes making its ublk \
             device, as create-volume does. Growth: df's used bytes after the call minus before \
             (synced)."
        )],
    }
}

fn recovery(r: &Results) -> Section {
    let mut entries = Vec::new();
    let (mut paths, mut calls, mut stall) = (Vec::new(), Vec::new(), String::new());
    let mut seen = |x: &Restart| {
        paths.extend(x.io_path.clone());
        calls.extend(x.list_call_ms);
    };
    for n in RECOVERY_VOLUMES {
        let v = view!(r, &recovery_run(n), Measured::Recovery);
        v.value.clone().map(&mut seen).unwrap_or_default();
        let s = if n == 1 { "" } else { "s" };
        let ready = v.value.and_then(|x| x.ready_ms.clone());
        let case = format!("ublkd restart to READY, {n} volume{s}");
        entries.push(Entry::new(case, Unit::MS, ready, v.teardown));
    }
    let v = view!(r, STALL_RUN, Measured::Stall);
    if let Ok(x) = v.value.clone().map(|x| &x.restart) {
        seen(x);
        if let (Some(k), Ok(r)) = (x.kill_to_ready_ms, &x.ready_ms) {
            let after = format!("{k:.1} ms after the kill, {r:.1} ms after the exec");
            stall = format!("; there the volume was READY {after}");
        }
    }
    let max = v.value.and_then(|x| x.max_ms.clone());
    let case = "fio max I/O stall across kill -9";
    entries.push(Entry::new(case, Unit::MS, max, v.teardown));
    paths.sort_unstable();
    paths.dedup();
    let paths = Some(paths.join(", ")).filter(|p| !p.is_empty());
    let paths = paths.unwrap_or_else(|| "unknown".into());
    let call = percentile(&calls, 50).map_or_else(String::new, |c| {
        format!("; one call took {c:.0} ms here, so READY is seen up to that much late")
    });
    Section {
        title: "recovery (ublkd --config killed with -9 and started again)",
        entries,
        notes: vec![format!(
            "note: restart to READY runs from the exec of the new ublkd (after kill -9 of the old \
             one) until `ublkctl list-volumes` shows every volume READY, polled every 20 ms \
             (ublkctl's start-up included{call}); null volumes of {CONTROL_SIZE}, 1 queue of \
             depth {CONTROL_DEPTH}. The stall is the longest completion latency in fio's per-I/O \
             log (randwrite 4k QD16, {STALL_RUNTIME_SECS} s, on a {STALL_SIZE} RAM volume; ublkd \
             killed {STALL_KILL_AT_SECS} s after the first write and started again as soon as it \
             was gone){stall}. I/O path: {paths}."
        )],
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::report::entries_table;
    use crate::bench::results::{Case, Qos, SnapSize, Snapshots};

    fn with(run: &str, m: Measured, teardown: &[&str]) -> Results {
        let (measured, teardown) = (Ok(m), teardown.iter().map(|t| t.to_string()).collect());
        Results([(run.to_owned(), Case { measured, teardown })].into())
    }

    fn find(s: &Section, case: &str) -> Entry {
        let e = s.entries.iter().find(|e| e.case == case);
        e.cloned().unwrap_or_else(|| panic!("no {case} in {s:?}"))
    }

    #[test]
    fn a_section_that_did_not_run_has_every_case_failed() {
        let all = sections(&Results::default());
        let counts: Vec<usize> = all.iter().map(|s| s.entries.len()).collect();
        assert_eq!(counts, [14, 6, 6, 11, 4]);
        let why = |e: &Entry| e.error.as_ref().is_some_and(|x| x.contains("did not run"));
        let failed = |e: &Entry| e.ours.is_none() && why(e);
        assert!(all.iter().flat_map(|s| &s.entries).all(failed));
    }

    #[test]
    fn control_entries_are_percentiles_rss_and_the_load() {
        let calls = |n: u32, f: f64| Ok((1..=n).map(|x| f64::from(x) * f).collect());
        let c = Control {
            rss_empty_kib: Ok(10240.0),
            rss_full_kib: Ok(10240.0 + 100.0 * 48.0),
            create_ms: calls(100, 1.0),
            delete_ms: Err("delete-volume v004 failed (exit 1)".into()),
            scrape_ms: calls(10, 1.0),
            load_create_ms: calls(20, 1.0),
            load_delete_ms: calls(20, 2.0),
            load_iops: Ok(15000.0),
        };
        let s = control(&with(CONTROL_RUN, Measured::Control(c), &[]));
        let got: Vec<(&str, Option<f64>)> =
            s.entries.iter().map(|e| (&e.case[..], e.ours)).collect();
        let expected = [
            ("ublkctl create-volume p50", Some(50.0)),
            ("ublkctl create-volume p99", Some(99.0)),
            ("ublkctl delete-volume p50", None),
            ("ublkctl delete-volume p99", None),
            ("ublkd RSS, 0 volumes", Some(10.0)),
            ("ublkd RSS, 100 idle volumes", Some(14.6875)),
            ("ublkd RSS per idle volume", Some(48.0)),
            ("GET /metrics, 100 volumes, p50", Some(5.0)),
            ("GET /metrics, 100 volumes, p100", Some(10.0)),
            ("ublkctl create-volume under load p50", Some(10.0)),
            ("ublkctl create-volume under load p99", Some(20.0)),
            ("ublkctl delete-volume under load p50", Some(20.0)),
            ("ublkctl delete-volume under load p99", Some(40.0)),
            ("fio load during those calls", Some(15000.0)),
        ];
        assert_eq!(got, expected);
        let alone = |e: &Entry| e.peer == "none" && e.ratio.is_none();
        assert!(s.entries.iter().all(alone));
        let t = entries_table(&s.entries);
        let error = "    ! ublkd: delete-volume v004 failed (exit 1)";
        assert!(t.contains(error), "{t}");
    }

    #[test]
    fn qos_and_snapshots_compare_with_the_limit_and_the_smallest_size() {
        let jobs = QOS_JOBS.map(|l| (l.id(), Ok(l.value().unwrap_or(9e4) * 1.02)));
        let q = Measured::Qos(Qos { jobs: jobs.into() });
        let q = qos(&with(QOS_RUN, q, &["busy"]));
        let e = find(&q, "qos-read-iops-5000");
        let limited = (Some(5100.0), Some(5000.0), Some(1.02));
        assert_eq!((e.ours, e.peer_value, e.ratio), limited);
        assert_eq!(e.detail.as_deref(), Some("fio randread 4k qd32, +2.00 %"));
        assert!(e.error.is_some_and(|x| x.contains("ublkd teardown: busy")));
        assert_eq!(find(&q, "qos-randread-unlimited").peer, "none");
        assert_eq!(find(&q, "qos-write-bw-8mibps").unit, Unit::MIBPS);

        let growth_kib = 4.0;
        let size = |gib, ms| SnapSize {
            gib,
            create_ms: Ok(30.0),
            snapshot: Ok(vec![Timed { ms, growth_kib }; 3]),
            clone: Err("create-volume clone-16g-1 failed".into()),
            extents: Some(4093),
        };
        let sizes = vec![size(1, 20.0), size(16, 22.0)];
        let (noop_ms, reflink) = (Ok(vec![8.0, 7.0, 9.0]), Some(true));
        let s = Snapshots {
            noop_ms,
            sizes,
            reflink,
        };
        let s = snapshots(&with(SNAPSHOT_RUN, Measured::Snapshots(s), &[]));
        assert_eq!(find(&s, "ublkctl-node-info").ours, Some(8.0));
        let big = find(&s, "snapshot-16g");
        assert_eq!((big.peer.as_str(), big.ratio), ("1 GiB", Some(1.1)));
        assert_eq!(big.detail.as_deref(), Some("4093 extents after the fill"));
        assert!(find(&s, "clone-16g-df-growth").error.is_some());
        assert_eq!(find(&s, "snapshot-1g-df-growth").ours, Some(4.0));
    }
}
