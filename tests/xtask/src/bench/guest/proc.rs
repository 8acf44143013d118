//! What every guest case uses: the run directory and its files, fio with the counters around
//! each job, processes (a `ublkd` node service, `ublkctl` calls) and waits.

use super::super::cases::{Build, Workload, WORKLOADS};
use super::Input;
use std::fs::{self, File, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A line on the guest's console.
pub fn note(msg: &str) {
    println!("bench: {msg}");
}

/// The last five lines of `path`, on one line (what a failure message quotes).
pub fn tail_of(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" ")
}

/// Appends `line` to `path` (created if missing).
pub fn append(path: &Path, line: &str) {
    let written = OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| writeln!(f, "{line}"));
    if let Err(e) = written {
        note(&format!("cannot write {}: {e}", path.display()));
    }
}

/// Writes `text` as the whole of `path`.
pub fn put(path: &Path, text: &str) {
    if let Err(e) = fs::write(path, text) {
        note(&format!("cannot write {}: {e}", path.display()));
    }
}

/// A file to append a process's output to.
pub fn log_file(path: &Path) -> Stdio {
    match OpenOptions::new().create(true).append(true).open(path) {
        Ok(f) => Stdio::from(f),
        Err(e) => {
            note(&format!("cannot open {}: {e}", path.display()));
            Stdio::null()
        }
    }
}

/// Wall-clock nanoseconds: the clock fio's logs and the host's readers share.
pub fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A process's exit status as the shell writes it (128 + signal when killed).
pub fn code(s: ExitStatus) -> i32 {
    s.code()
        .unwrap_or_else(|| 128 + s.signal().unwrap_or_default())
}

/// Polls `done` every `every` until it holds or `within` passed; whether it held.
pub fn wait_until(within: Duration, every: Duration, mut done: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + within;
    loop {
        if done() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(every);
    }
}

pub fn is_blk(dev: &Path) -> bool {
    fs::metadata(dev).is_ok_and(|m| m.file_type().is_block_device())
}

/// Waits up to 10 s for block device `dev` to appear.
pub fn wait_blk(dev: &Path) -> bool {
    wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        is_blk(dev)
    })
}

/// Sends `sig` (a name, e.g. `TERM`) to `pid`; whether kill(1) did.
pub fn signal(pid: u32, sig: &str) -> bool {
    Command::new("kill")
        .arg(format!("-{sig}"))
        .arg(pid.to_string())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Field `n` (from 0) of `/sys/block/<blk>/stat`.
fn blk_stat(blk: &str, n: usize) -> Option<u64> {
    let s = fs::read_to_string(format!("/sys/block/{blk}/stat")).ok()?;
    s.split_whitespace().nth(n)?.parse().ok()
}

/// Reads and writes completed by block device `blk`, or `-`.
fn dev_ios(blk: &str) -> String {
    match (blk_stat(blk, 0), blk_stat(blk, 4)) {
        (Some(r), Some(w)) => (r + w).to_string(),
        _ => "-".into(),
    }
}

/// Writes completed by block device `blk` (0 when unreadable).
pub fn dev_writes(blk: &str) -> u64 {
    blk_stat(blk, 4).unwrap_or(0)
}

/// Every CPU's busy time (user, nice, system, irq, softirq), in clock ticks: fio, the server
/// and the kernel together, so that each case has a CPU cost per I/O, the kernel's peers too.
fn sys_ticks() -> String {
    let stat = fs::read_to_string("/proc/stat").unwrap_or_default();
    let Some(cpu) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return "-".into();
    };
    let f: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|x| x.parse().ok())
        .collect();
    match f.get(..7) {
        Some(f) => (f[0] + f[1] + f[2] + f[5] + f[6]).to_string(),
        None => "-".into(),
    }
}

/// utime + stime, in clock ticks, summed over `pids`: `none` without any, `-` if one is gone.
fn cpu_ticks(pids: &[u32]) -> String {
    if pids.is_empty() {
        return "none".into();
    }
    let mut total = 0u64;
    for p in pids {
        let Ok(stat) = fs::read_to_string(format!("/proc/{p}/stat")) else {
            return "-".into();
        };
        // After the command's closing parenthesis: state is field 3, utime 14, stime 15.
        let Some((_, rest)) = stat.rsplit_once(") ") else {
            return "-".into();
        };
        let f: Vec<&str> = rest.split_whitespace().collect();
        match (
            f.get(11).and_then(|x| x.parse::<u64>().ok()),
            f.get(12).and_then(|x| x.parse::<u64>().ok()),
        ) {
            (Some(u), Some(s)) => total += u + s,
            _ => return "-".into(),
        }
    }
    total.to_string()
}

/// The block device's name under /sys/block, following links.
pub fn blk_name(dev: &Path) -> String {
    let real = fs::canonicalize(dev).unwrap_or_else(|_| dev.to_path_buf());
    real.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// How fio reaches a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    /// io_uring with direct I/O: every block device.
    Direct,
    /// NVMe passthrough on the char device, polled, fixed buffers and files.
    Passthru,
    /// io_uring on the namespace's block device, polled, fixed buffers and files.
    Hipri,
}

impl Engine {
    pub fn args(self) -> &'static [&'static str] {
        match self {
            Engine::Direct => &["--ioengine=io_uring", "--direct=1"],
            Engine::Passthru => &[
                "--ioengine=io_uring_cmd",
                "--cmd_type=nvme",
                "--hipri=1",
                "--fixedbufs=1",
                "--registerfiles=1",
            ],
            Engine::Hipri => &[
                "--ioengine=io_uring",
                "--direct=1",
                "--hipri=1",
                "--fixedbufs=1",
                "--registerfiles=1",
            ],
        }
    }
}

/// The 4 KiB randread at QD32 that the warm-ups and the control plane's load run, after
/// `fio`'s engine arguments.
pub const RANDREAD_QD32: &[&str] = &[
    "--bs=4k",
    "--rw=randread",
    "--iodepth=32",
    "--norandommap",
    "--time_based",
];

/// `fio` under timeout(1): killed 60 s after `secs` if it has not ended.
pub fn fio(secs: u64) -> Command {
    let mut c = Command::new("timeout");
    c.args(["-k", "5", &(secs + 60).to_string(), "fio"]);
    c
}

/// The whole guest's setting: the run directory, binaries, seconds per job.
pub struct Guest {
    pub out: PathBuf,
    pub tmp: PathBuf,
    pub runtime: u64,
    hz: String,
    pub kublk: Option<PathBuf>,
    ublkd_new: Option<PathBuf>,
    ublkd_base: Option<PathBuf>,
    pub ublkctl: Option<PathBuf>,
    pub csi: Option<PathBuf>,
}

impl Guest {
    pub fn new(input: &Input, out: PathBuf) -> Self {
        let hz = Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_owned())
            .filter(|s| s.parse::<u64>().is_ok())
            .unwrap_or_else(|| "100".into());
        Self {
            out,
            tmp: std::env::temp_dir(),
            runtime: input.runtime,
            hz,
            kublk: input.kublk.clone().ok(),
            ublkd_new: input.ublkd.clone().ok(),
            ublkd_base: input.plan.baseline.as_ref().map(|(_, b)| b.clone()),
            ublkctl: input.ublkctl.clone().ok(),
            csi: input.csi.clone().ok(),
        }
    }

    /// The ublkd binary of `build`.
    pub fn ublkd(&self, build: Build) -> Option<&Path> {
        match build {
            Build::New => self.ublkd_new.as_deref(),
            Build::Baseline => self.ublkd_base.as_deref(),
        }
    }

    /// The case's directory, made.
    pub fn dir(&self, run: &str) -> PathBuf {
        let d = self.out.join(run);
        if let Err(e) = fs::create_dir_all(&d) {
            note(&format!("cannot make {}: {e}", d.display()));
        }
        d
    }

    /// A case that did not measure: `error` says why.
    pub fn fail_case(&self, run: &str, why: &str) {
        put(&self.dir(run).join("error"), &format!("{why}\n"));
        note(&format!("{run}: {why}"));
    }

    pub fn no_backing(&self) -> String {
        format!(
            "no backing file: {}",
            tail_of(&self.out.join("backing.log"))
        )
    }

    /// Every workload on `dev`, with the CPU time of `pids` (the server) around each.
    pub fn run_workloads(&self, run: &str, dev: &Path, pids: &[u32], engine: Engine) {
        for wl in WORKLOADS {
            self.run_fio(run, dev, wl, pids, engine);
        }
    }

    /// One workload: `<wl>.json` (fio's report), `<wl>.log`, `<wl>.rc`, `<wl>.counters`
    /// (`cpu_ticks_before cpu_ticks_after hz ios_before ios_after`) and `<wl>.syscounters` (the
    /// same with every CPU's busy ticks).
    fn run_fio(&self, run: &str, dev: &Path, wl: &Workload, pids: &[u32], engine: Engine) {
        let d = self.dir(run);
        let blk = blk_name(dev);
        let (ios0, t0, s0) = (dev_ios(&blk), cpu_ticks(pids), sys_ticks());
        let mut c = fio(self.runtime);
        c.arg(format!("--name={}", wl.id))
            .arg(format!("--filename={}", dev.display()))
            .args(engine.args())
            .arg(format!("--bs={}", wl.bs))
            .arg(format!("--rw={}", wl.rw));
        if wl.rw == "randrw" {
            c.arg("--rwmixread=70");
        }
        c.arg(format!("--iodepth={}", wl.qd))
            .arg(format!("--numjobs={}", wl.jobs))
            .args(["--group_reporting", "--norandommap", "--time_based"])
            .arg(format!("--runtime={}", self.runtime))
            .args(["--ramp_time=1", "--output-format=json"])
            .arg(format!(
                "--output={}",
                d.join(format!("{}.json", wl.id)).display()
            ));
        let rc = run_logged(c, &d.join(format!("{}.log", wl.id)));
        let (s1, t1, ios1) = (sys_ticks(), cpu_ticks(pids), dev_ios(&blk));
        put(&d.join(format!("{}.rc", wl.id)), &format!("{rc}\n"));
        let hz = &self.hz;
        put(
            &d.join(format!("{}.counters", wl.id)),
            &format!("{t0} {t1} {hz} {ios0} {ios1}\n"),
        );
        put(
            &d.join(format!("{}.syscounters", wl.id)),
            &format!("{s0} {s1} {hz} {ios0} {ios1}\n"),
        );
        let ios = match (ios0.parse::<i64>(), ios1.parse::<i64>()) {
            (Ok(a), Ok(b)) => (b - a).to_string(),
            _ => "-".into(),
        };
        note(&format!("{run} {}: fio exit {rc}, {ios} I/Os", wl.id));
    }
}

/// Runs `c` with stdout and stderr appended to `log`; its exit code as the shell gives it (-1
/// if it did not start, which `log` then says).
pub fn run_logged(mut c: Command, log: &Path) -> i32 {
    c.stdin(Stdio::null())
        .stdout(log_file(log))
        .stderr(log_file(log));
    match c.status() {
        Ok(s) => code(s),
        Err(e) => {
            append(log, &format!("could not start: {e}"));
            -1
        }
    }
}

/// A server process the case started, logging into its directory.
pub struct Proc {
    child: Child,
    dir: PathBuf,
    exit: Option<i32>,
}

impl Proc {
    /// Starts `c` with stdout to `dir/server.out` and stderr to `dir/server.err` (appended).
    pub fn spawn(mut c: Command, dir: &Path) -> Result<Self, String> {
        c.stdin(Stdio::null())
            .stdout(log_file(&dir.join("server.out")))
            .stderr(log_file(&dir.join("server.err")));
        let child = c.spawn().map_err(|e| format!("could not start: {e}"))?;
        Ok(Self {
            child,
            dir: dir.to_path_buf(),
            exit: None,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit code, once it has exited.
    pub fn exited(&mut self) -> Option<i32> {
        if self.exit.is_none() {
            if let Ok(Some(s)) = self.child.try_wait() {
                self.exit = Some(code(s));
            }
        }
        self.exit
    }

    /// Waits up to `within` for it to exit.
    pub fn wait_exit(&mut self, within: Duration, every: Duration) -> Option<i32> {
        wait_until(within, every, || self.exited().is_some());
        self.exited()
    }

    /// SIGKILL, and waits for it.
    pub fn kill9(&mut self) {
        if self.exited().is_none() && !signal(self.pid(), "KILL") {
            note(&format!("kill -9 {} failed", self.pid()));
        }
    }

    /// SIGTERM, then waits for the exit and for `dev`'s removal; what went wrong goes to
    /// `teardown_error`.
    pub fn stop(&mut self, dev: Option<&Path>) {
        let te = self.dir.join("teardown_error");
        if self.exited().is_none() {
            signal(self.pid(), "TERM");
        }
        match self.wait_exit(Duration::from_secs(30), Duration::from_millis(100)) {
            None => {
                append(&te, "did not exit within 30 s of SIGTERM (killed)");
                self.kill9();
                self.wait_exit(Duration::from_secs(5), Duration::from_millis(100));
            }
            Some(0) => {}
            Some(rc) => append(
                &te,
                &format!(
                    "exited with status {rc} after SIGTERM: {}",
                    tail_of(&self.dir.join("server.err"))
                ),
            ),
        }
        if let Some(dev) = dev {
            let gone = wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
                !dev.exists()
            });
            if !gone {
                append(
                    &te,
                    &format!("{} still exists after ublkd exited", dev.display()),
                );
            }
        }
    }
}

/// `ublkd --config` as a node service, driven by `ublkctl` over its socket, everything under
/// its own directory in the guest's tmpfs.
pub struct Node {
    /// The case's directory in the run directory.
    pub d: PathBuf,
    /// Its configuration, state, roots and socket.
    pub c: PathBuf,
    ublkd: PathBuf,
    ublkctl: PathBuf,
    proc: Option<Proc>,
}

impl Node {
    /// A fresh directory and `ublkd.toml` for `run` (metrics on `metrics`); not started.
    pub fn new(g: &Guest, run: &str, metrics: &str) -> Option<Self> {
        let (Some(ublkd), Some(ublkctl)) = (g.ublkd(Build::New), &g.ublkctl) else {
            g.fail_case(run, "no ublkd or ublkctl binary");
            return None;
        };
        let c = g.tmp.join(run);
        // A leftover of an earlier run in this boot would be read as state.
        let _ = fs::remove_dir_all(&c); // absent on a fresh boot: nothing to remove is fine
        if let Err(e) = fs::create_dir_all(c.join("roots")) {
            g.fail_case(run, &format!("cannot make {}: {e}", c.display()));
            return None;
        }
        let cd = c.display();
        put(
            &c.join("ublkd.toml"),
            &format!(
                "state_dir = \"{cd}/state\"\nallowed_roots = [\"{cd}/roots\"]\nram_dir = \"{cd}/ram\"\n\
                 on_exit = \"keep\"\n\n[grpc]\nlisten = [\"unix://{cd}/ublkd.sock\"]\n\n\
                 [metrics]\nlisten = \"{metrics}\"\n\n[dataplane]\ncpus = [0, 1]\n"
            ),
        );
        Some(Self {
            d: g.dir(run),
            c,
            ublkd: ublkd.to_path_buf(),
            ublkctl: ublkctl.clone(),
            proc: None,
        })
    }

    pub fn sock(&self) -> PathBuf {
        self.c.join("ublkd.sock")
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// Whether it has exited (or never started), with its status.
    pub fn exited(&mut self) -> Option<i32> {
        match &mut self.proc {
            Some(p) => p.exited(),
            None => Some(-1),
        }
    }

    /// Starts it; `start.ns` is the moment right before.
    pub fn spawn(&mut self) {
        put(&self.d.join("start.ns"), &format!("{}\n", now_ns()));
        let mut c = Command::new(&self.ublkd);
        c.arg("--config").arg(self.c.join("ublkd.toml"));
        match Proc::spawn(c, &self.d) {
            Ok(p) => self.proc = Some(p),
            Err(e) => {
                append(&self.d.join("server.err"), &e);
                self.proc = None;
            }
        }
    }

    /// Waits up to 60 s for its socket to answer node-info; if it does not, says why
    /// (`error`), stops it and returns false.
    pub fn wait_up(&mut self, g: &Guest, run: &str) -> bool {
        let (out, err) = (self.d.join("node-info.out"), self.d.join("node-info.err"));
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end && self.exited().is_none() {
            if let Ok(o) = self.ctl(&["node-info"], &err) {
                put(&out, &o);
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let server = tail_of(&self.d.join("server.err"));
        match self.exited() {
            Some(rc) => g.fail_case(
                run,
                &format!("ublkd exited with status {rc} before its socket answered: {server}"),
            ),
            None => {
                g.fail_case(
                    run,
                    &format!(
                        "ublkd's socket did not answer node-info within 60 s: {} {server}",
                        tail_of(&err)
                    ),
                );
                self.stop();
            }
        }
        false
    }

    /// `ublkctl ARGS` against it: its stdout, or the tail of `err` (where its stderr went).
    pub fn ctl(&self, args: &[&str], err: &Path) -> Result<String, String> {
        let out = Command::new(&self.ublkctl)
            .arg("--endpoint")
            .arg(format!("unix://{}", self.sock().display()))
            .args(args)
            .stdin(Stdio::null())
            .stderr(log_file(err))
            .output()
            .map_err(|e| format!("could not start ublkctl: {e}"))?;
        if out.status.success() {
            Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
        } else {
            Err(format!("(exit {}) {}", code(out.status), tail_of(err)))
        }
    }

    /// SIGTERM and the wait (see [`Proc::stop`]).
    pub fn stop(&mut self) {
        if let Some(p) = &mut self.proc {
            p.stop(None);
        }
    }

    /// kill -9 (`kill.ns` the moment), waits until it is gone (10 s at most), starts it again.
    pub fn crash_restart(&mut self) -> Result<(), String> {
        put(&self.d.join("kill.ns"), &format!("{}\n", now_ns()));
        let Some(p) = &mut self.proc else {
            return Err("ublkd was not running".into());
        };
        p.kill9();
        if p.wait_exit(Duration::from_secs(10), Duration::from_millis(10))
            .is_none()
        {
            return Err("ublkd did not exit within 10 s of kill -9".into());
        }
        self.spawn();
        Ok(())
    }

    /// Polls `list-volumes -o json` every 20 ms until it shows `n` volumes READY, then writes
    /// `list.json` (that answer), `ready.ns` (`START_NS READY_NS`: the exec and the moment that
    /// answer arrived) and `poll.ns` (`BEFORE_NS AFTER_NS` of one more call, what a poll
    /// costs). Gives up when a volume FAILED, the daemon exited, or 60 s passed.
    pub fn wait_ready(&mut self, n: usize) -> Result<(), String> {
        let err = self.d.join("list.err");
        let end = Instant::now() + Duration::from_secs(60);
        let mut last = String::new();
        loop {
            if let Ok(list) = self.ctl(&["list-volumes", "-o", "json"], &err) {
                let t1 = now_ns();
                if list.matches("\"VOLUME_STATE_READY\"").count() == n {
                    put(&self.d.join("list.json"), &list);
                    let start = fs::read_to_string(self.d.join("start.ns")).unwrap_or_default();
                    put(
                        &self.d.join("ready.ns"),
                        &format!("{} {t1}\n", start.trim()),
                    );
                    let p0 = now_ns();
                    // Only its duration counts: an error here shows in list.err.
                    let _ = self.ctl(&["list-volumes", "-o", "json"], &err);
                    put(&self.d.join("poll.ns"), &format!("{p0} {}\n", now_ns()));
                    return Ok(());
                }
                if list.contains("\"VOLUME_STATE_FAILED\"") {
                    let msg = list
                        .lines()
                        .find(|l| l.contains("\"message\"") && !l.contains("\"\""))
                        .unwrap_or_default()
                        .trim();
                    return Err(format!("a volume FAILED to come back: {msg}"));
                }
                last = list;
            }
            if let Some(rc) = self.exited() {
                return Err(format!(
                    "the new ublkd exited with status {rc}: {}",
                    tail_of(&self.d.join("server.err"))
                ));
            }
            if Instant::now() >= end {
                return Err(format!(
                    "not all {n} volumes READY within 60 s of the restart: {} READY; {}",
                    last.matches("\"VOLUME_STATE_READY\"").count(),
                    tail_of(&err)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Deletes every volume the daemon lists (starting it again first if it is gone), checks
    /// that the devices in `volumes` (`NAME DEVICE` lines) are gone, stops the daemon.
    /// Problems go to `teardown_error`.
    pub fn teardown(&mut self) {
        let te = self.d.join("teardown_error");
        let del = self.d.join("delete.err");
        if self.exited().is_some() {
            self.spawn();
            wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
                self.exited().is_some() || self.ctl(&["node-info"], &del).is_ok()
            });
        }
        let ids = match self.ctl(&["list-volumes", "-o", "json"], &del) {
            Ok(list) => {
                put(&self.d.join("final.json"), &list);
                volume_ids(&list)
            }
            Err(e) => {
                append(&te, &format!("list-volumes failed before the deletes: {e}"));
                Vec::new()
            }
        };
        for id in ids {
            if let Err(e) = self.ctl(&["delete-volume", &id], &del) {
                append(&te, &format!("delete-volume {id} failed: {e}"));
            }
        }
        let volumes = fs::read_to_string(self.d.join("volumes")).unwrap_or_default();
        for line in volumes.lines() {
            if let Some((name, dev)) = line.split_once(' ') {
                if Path::new(dev).exists() {
                    append(
                        &te,
                        &format!("{dev} ({name}) still exists after the deletes"),
                    );
                }
            }
        }
        if let Some(rc) = self.exited() {
            append(
                &te,
                &format!(
                    "ublkd was not running for the deletes (status {rc}): {}",
                    tail_of(&self.d.join("server.err"))
                ),
            );
        } else {
            self.stop();
        }
    }
}

/// The ids of the volumes in `ublkctl list-volumes -o json`'s answer.
pub fn volume_ids(list: &str) -> Vec<String> {
    let v: serde_json::Value = serde_json::from_str(list).unwrap_or_default();
    let items = match &v {
        serde_json::Value::Array(a) => a.clone(),
        serde_json::Value::Object(o) => o
            .get("volumes")
            .and_then(|x| x.as_array())
            .cloned()
            .unwrap_or_default(),
        _ => Vec::new(),
    };
    items
        .iter()
        .filter_map(|x| x["id"].as_str().map(str::to_owned))
        .collect()
}

/// The file of `path` for writing (truncated): a process's whole output.
pub fn fresh(path: &Path) -> Stdio {
    match File::create(path) {
        Ok(f) => Stdio::from(f),
        Err(e) => {
            note(&format!("cannot write {}: {e}", path.display()));
            Stdio::null()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn volume_ids_come_from_the_list_as_ublkctl_prints_it() {
        let list = r#"[{"id": "r001", "state": "VOLUME_STATE_READY", "snapshot": {"id": "x"}},
                       {"id": "r002"}]"#;
        assert_eq!(volume_ids(list), ["r001", "r002"]);
        assert_eq!(volume_ids(r#"{"volumes": [{"id": "a"}]}"#), ["a"]);
        assert!(volume_ids("not json").is_empty());
    }

    #[test]
    fn the_tail_of_a_file_is_its_last_five_lines() {
        let p = std::env::temp_dir().join(format!("xtask-tail-{}", std::process::id()));
        fs::write(&p, "1\n2\n3\n4\n5\n6\n7\n").unwrap();
        assert_eq!(tail_of(&p), "3 4 5 6 7");
        let _ = fs::remove_file(&p); // a temp file
        assert_eq!(tail_of(&p), "");
    }
}
