//! fio in the guest: the command, its JSON report read into serde structs, and one workload
//! against a device with the CPU and I/O counters read around it.

use super::super::cases::WORKLOADS;
use super::super::results::{Outcome, Sample, Samples};
use super::proc::{note, run_logged, tail_of, Guest, USER_HZ};
use serde::Deserialize;
use std::collections::BTreeMap;
use std::fs;
use std::path::Path;
use std::process::Command;

/// fio's JSON report, as far as the bench reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Report {
    pub jobs: Vec<Job>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Job {
    pub error: u64,
    pub read: Dir,
    pub write: Dir,
}

/// One direction of a job.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Dir {
    pub iops: f64,
    pub total_ios: u64,
    pub bw_bytes: f64,
    pub lat_ns: Stat,
    pub clat_ns: Stat,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Stat {
    pub mean: f64,
    pub max: Option<f64>,
}

/// fio's report in `path` (after any notes fio printed before it), with at least one job.
pub fn report(path: &Path) -> Outcome<Report> {
    let text = fs::read_to_string(path).map_err(|e| format!("no fio output: {e}"))?;
    let start = text.find('{').ok_or("no JSON in fio output")?;
    let r: Report =
        serde_json::from_str(&text[start..]).map_err(|e| format!("bad fio JSON: {e}"))?;
    match r.jobs.is_empty() {
        true => Err("no job in fio output".into()),
        false => Ok(r),
    }
}

/// Runs fio `c` with its output in `log` and reads its report from `json`: the first job,
/// unless fio failed or reported an error.
pub fn run(c: Command, json: &Path, log: &Path) -> Outcome<Job> {
    let _ = fs::remove_file(json); // a report of an earlier job would be read as this one's
    match run_logged(c, log)? {
        0 => {}
        rc => return Err(format!("fio exited with status {rc}: {}", tail_of(log))),
    }
    let job = report(json)?.jobs.remove(0);
    match job.error {
        0 => Ok(job),
        e => Err(format!("fio reported error {e}")),
    }
}

/// How fio reaches a device: io_uring with direct I/O (every block device); NVMe passthrough
/// on the namespace's char device, polled, with fixed buffers and files; io_uring on its block
/// device, polled, the same.
pub const DIRECT: &str = "--ioengine=io_uring --direct=1";
pub const PASSTHRU: &str =
    "--ioengine=io_uring_cmd --cmd_type=nvme --hipri=1 --fixedbufs=1 --registerfiles=1";
pub const HIPRI: &str = "--ioengine=io_uring --direct=1 --hipri=1 --fixedbufs=1 --registerfiles=1";

/// fio's arguments for `rw` of `bs` blocks at depth `qd` for `secs` seconds.
pub fn job(rw: &str, bs: &str, qd: u32, secs: u64) -> String {
    format!("--bs={bs} --rw={rw} --iodepth={qd} --norandommap --time_based --runtime={secs}")
}

/// fio under timeout(1), killed 60 s after `secs` if it has not ended: job `name` on `dev`, its
/// JSON report to `json`, then `args` (words).
pub fn fio(secs: u64, name: &str, dev: &Path, json: &Path, args: &str) -> Command {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", &(secs + 60).to_string(), "fio"])
        .arg(format!("--name={name}"))
        .arg(format!("--filename={}", dev.display()))
        .arg("--output-format=json")
        .arg(format!("--output={}", json.display()))
        .args(args.split_whitespace());
    c
}

/// IOPS and mean latency (µs) of a job running `rw`: a mixed job counts both directions, and
/// its latency is the reads'.
fn rate(job: &Job, rw: &str) -> Outcome<(f64, f64)> {
    let dirs = match rw {
        "randrw" => vec![&job.read, &job.write],
        rw if rw.contains("write") => vec![&job.write],
        _ => vec![&job.read],
    };
    if dirs.iter().map(|d| d.total_ios).sum::<u64>() == 0 {
        return Err("fio completed no I/O".into());
    }
    let iops = dirs.iter().map(|d| d.iops).sum();
    Ok((iops, dirs[0].lat_ns.mean / 1000.0))
}

/// Whitespace-separated numbers of `text` (from field `skip`).
fn numbers(text: &str, skip: usize) -> Vec<u64> {
    let words = text.split_whitespace().skip(skip);
    words.map_while(|x| x.parse().ok()).collect()
}

/// What the guest counts around a job: the server's CPU ticks (utime + stime of `pids`), every
/// CPU's busy ticks (user, nice, system, irq, softirq), and the I/Os `blk` completed.
fn counters(blk: &str, pids: &[u32]) -> [Outcome<u64>; 3] {
    let read = |path: String| fs::read_to_string(path).unwrap_or_default();
    let process = |p: &u32| {
        // After the command's closing parenthesis: utime is field 14, stime 15.
        let stat = read(format!("/proc/{p}/stat"));
        let fields = stat.rsplit_once(") ").map(|(_, r)| numbers(r, 11));
        match fields.as_deref() {
            Some([u, s, ..]) => Ok(u + s),
            _ => Err("server CPU time unreadable (process gone?)".to_owned()),
        }
    };
    let server = match pids {
        [] => Err("no server process".into()),
        _ => pids.iter().map(process).sum(),
    };
    let stat = read("/proc/stat".into());
    let cpu = stat.lines().find_map(|l| l.strip_prefix("cpu "));
    let all = match cpu.map(|l| numbers(l, 0)).as_deref() {
        Some([user, nice, system, _, _, irq, softirq, ..]) => {
            Ok(user + nice + system + irq + softirq)
        }
        _ => Err("no cpu line in /proc/stat".into()),
    };
    let ios = io_counts(blk).map(|(reads, writes)| reads + writes);
    [server, all, ios]
}

/// The raw_syscalls:sys_enter event, and the hist trigger that counts the guest's syscalls on it
/// by number.
const SYS_ENTER: &str = "/sys/kernel/tracing/events/raw_syscalls/sys_enter";
const HIST: &str = "hist:keys=id.syscall:vals=hitcount";

/// Sets (`on`) or removes the syscall-counting trigger (tracefs is mounted by the guest's init);
/// whether that worked.
fn count_syscalls(on: bool) -> bool {
    let trigger = if on { HIST.into() } else { format!("!{HIST}") };
    fs::write(format!("{SYS_ENTER}/trigger"), trigger).is_ok()
}

/// The guest's kernel events so far by name (`results::EVENTS`), with the syscalls counted since
/// the trigger was set (its hist lines: `{ id: sys_io_uring_enter [426] } hitcount: 12`).
fn kernel_events(syscalls: bool) -> Events {
    let read = |p: &str| fs::read_to_string(p).unwrap_or_default();
    let (stat, mut e) = (read("/proc/stat"), BTreeMap::new());
    for (k, line) in [("ctx", "ctxt "), ("irq", "intr ")] {
        let n = stat.lines().find_map(|l| l.strip_prefix(line));
        e.extend(n.and_then(|l| numbers(l, 0).first().map(|&n| (k.into(), n as f64))));
    }
    let interrupts = read("/proc/interrupts");
    let mut add = |k: &str, n| *e.entry(k.into()).or_default() += n;
    let ipi = |l: &&str| matches!(l.split_whitespace().next(), Some("CAL:" | "RES:" | "TLB:"));
    let ipis = interrupts.lines().filter(ipi).flat_map(|l| numbers(l, 1));
    add("IPI", ipis.sum::<u64>() as f64);
    let hist = syscalls.then(|| read(&format!("{SYS_ENTER}/hist")));
    let count = |l: &str| l.rsplit_once("hitcount:")?.1.trim().parse::<f64>().ok();
    for l in hist.iter().flat_map(|h| h.lines()) {
        add("syscall", count(l).unwrap_or(0.0));
        if l.contains("io_uring_enter") {
            add("enter", count(l).unwrap_or(0.0));
        }
    }
    e
}

/// Kernel events by name (`results::EVENTS`).
type Events = BTreeMap<String, f64>;

/// Each count of `after` less `before`'s, over `ios` (none without I/O).
fn per_io(after: &Events, before: &Events, ios: u64) -> Events {
    let d = |(k, a): (&String, &f64)| (k.clone(), (a - before.get(k).unwrap_or(&0.0)) / ios as f64);
    after.iter().filter(|_| ios > 0).map(d).collect()
}

/// The block device behind `dev` (its name under `/sys/block`).
pub fn blk_of(dev: &Path) -> String {
    let real = fs::canonicalize(dev).unwrap_or_else(|_| dev.to_path_buf());
    real.file_name()
        .unwrap_or_default()
        .to_string_lossy()
        .into()
}

/// The reads and writes block device `blk` completed.
pub fn io_counts(blk: &str) -> Outcome<(u64, u64)> {
    let stat = fs::read_to_string(format!("/sys/block/{blk}/stat")).unwrap_or_default();
    match numbers(&stat, 0)[..] {
        [reads, _, _, _, writes, ..] => Ok((reads, writes)),
        _ => Err(format!("no I/O counts in /sys/block/{blk}/stat")),
    }
}

/// `a` less `b`, counters read after and before.
fn delta(a: &Outcome<u64>, b: &Outcome<u64>) -> Outcome<u64> {
    Ok(a.clone()?.saturating_sub(b.clone()?))
}

/// CPU seconds per million I/Os (= µs per I/O): `ticks` over `ios`.
fn per_mio(ticks: Outcome<u64>, ios: &Outcome<u64>) -> Outcome<f64> {
    match ios.clone()? {
        0 => Err("the device completed no I/O".into()),
        ios => Ok(ticks? as f64 / USER_HZ / (ios as f64 / 1e6)),
    }
}

/// Every workload through `engine` on `dev`, with the CPU time of `pids` (the server) around each.
pub fn workloads(g: &Guest, run_id: &str, dev: &Path, pids: &[u32], engine: &str) -> Samples {
    let d = g.dir(run_id);
    let blk = blk_of(dev);
    let mut out = Samples::new();
    for wl in WORKLOADS {
        let (id, secs) = (wl.id(), g.input.runtime);
        let json = d.join(format!("{id}.json"));
        let mix = if wl.rw == "randrw" {
            "--rwmixread=70"
        } else {
            ""
        };
        let job = job(wl.rw, wl.bs, wl.qd, secs);
        let args = format!(
            "{engine} {job} {mix} --numjobs={} --group_reporting --ramp_time=1",
            wl.jobs
        );
        let c = fio(secs, &id, dev, &json, &args);
        let traced = g.input.count_syscalls && count_syscalls(true);
        let (before, events) = (counters(&blk, pids), kernel_events(false));
        let job = run(c, &json, &d.join(format!("{id}.log")));
        let [server, all, ios] = counters(&blk, pids);
        let after = kernel_events(traced);
        if traced && !count_syscalls(false) {
            note(&format!("{run_id} {id}: the syscall trigger stayed"));
        }
        let ios = delta(&ios, &before[2]);
        let per_io = per_io(&after, &events, ios.clone().unwrap_or(0));
        let done = match (&job, &ios) {
            (Ok(_), Ok(n)) => format!("{n} I/Os"),
            (Err(e), _) | (_, Err(e)) => e.clone(),
        };
        note(&format!("{run_id} {id}: {done}"));
        let sample = job.and_then(|job| {
            let (iops, lat_us) = rate(&job, wl.rw)?;
            Ok(Sample {
                iops,
                lat_us,
                cpu_s_per_mio: per_mio(delta(&server, &before[0]), &ios),
                sys_us_per_io: per_mio(delta(&all, &before[1]), &ios),
                per_io,
            })
        });
        out.insert(id, sample);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(text: &str) -> Job {
        let path = std::env::temp_dir().join(format!("xtask-fio-{}", std::process::id()));
        fs::write(&path, text).unwrap();
        let r = report(&path);
        let _ = fs::remove_file(&path); // a temp file
        r.map(|mut r| r.jobs.remove(0)).unwrap_or_default()
    }

    #[test]
    fn fio_reports_and_counters_read_into_numbers() {
        let text = r#"note: both iodepth >= 1 and synchronous I/O engine
{"jobs":[{"error":0,"read":{"iops":8123.5,"total_ios":40000,"lat_ns":{"mean":3900000.0}},
          "write":{"iops":0.0,"total_ios":0,"lat_ns":{"mean":0.0}}}]}"#;
        assert_eq!(rate(&job(text), "randread"), Ok((8123.5, 3900.0)));
        assert!(rate(&job(text), "randwrite").is_err());
        // Mixed: both directions' IOPS, the reads' latency.
        let mixed = r#"{"jobs":[{"error":0,"read":{"iops":700.0,"total_ios":7000,"lat_ns":{"mean":2000.0}},
          "write":{"iops":300.0,"total_ios":3000,"lat_ns":{"mean":9000.0}, "clat_ns":{"max":5.0}}}]}"#;
        let j = job(mixed);
        assert_eq!(rate(&j, "randrw"), Ok((1000.0, 2.0)));
        assert_eq!((j.write.clat_ns.max, j.read.clat_ns.max), (Some(5.0), None));
        // Garbage and a report without jobs read as no job at all.
        assert!(rate(&job("garbage"), "randread").is_err());
        assert!(rate(&job(r#"{"jobs":[]}"#), "randread").is_err());

        // 150 ticks at 100 Hz = 1.5 s over 3 million I/Os.
        assert_eq!(per_mio(delta(&Ok(250), &Ok(100)), &Ok(3_000_000)), Ok(0.5));
        let none = Err("no server process".into());
        assert!(per_mio(delta(&none, &none), &Ok(5)).is_err_and(|e| e.contains("no server")));
        assert!(per_mio(Ok(1), &Ok(0)).is_err_and(|e| e.contains("no I/O")));
        assert_eq!(numbers("1 2 x 3", 0), [1, 2]);
        // The whole guest's counters move; each count is per I/O, and none without I/O.
        let (b, a) = (kernel_events(false), kernel_events(false));
        assert!(a["ctx"] >= b["ctx"] && a["irq"] > 0.0 && !a.contains_key("syscall"));
        let after = BTreeMap::from([("ctx".into(), 9.0), ("enter".into(), 4.0)]);
        let before = BTreeMap::from([("ctx".into(), 3.0)]);
        let want = BTreeMap::from([("ctx".into(), 3.0), ("enter".into(), 2.0)]);
        assert_eq!(per_io(&after, &before, 2), want);
        assert!(per_io(&after, &before, 0).is_empty());
    }
}
