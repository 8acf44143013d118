//! What every guest case uses: the guest's setting, logs in the run directory, processes (a
//! `ublkd` node service driven by `ublkctl`) and waits.

use super::super::cases::Build;
use super::super::results::{Case, Input, Measured, Outcome, Restart};
use serde::Deserialize;
use std::fs::{self, OpenOptions};
use std::io::Write as _;
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A line on the guest's console.
pub fn note(msg: &str) {
    println!("bench: {msg}");
}

/// A case that measured nothing, and why.
pub fn failed(run: &str, why: String) -> Case {
    note(&format!("{run}: {why}"));
    Case {
        measured: Err(why),
        teardown: Vec::new(),
    }
}

/// The last five lines of `path`, on one line (what a failure message quotes).
pub fn tail_of(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" ")
}

/// Appends `line` to the log `path` (created if missing).
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

/// A process's exit status as the shell writes it (128 + signal when killed).
pub fn code(s: ExitStatus) -> i32 {
    s.code()
        .unwrap_or_else(|| 128 + s.signal().unwrap_or_default())
}

/// Runs `c` with stdout and stderr appended to `log`: its exit code, or why it did not start.
pub fn run_logged(mut c: Command, log: &Path) -> Outcome<i32> {
    c.stdin(Stdio::null())
        .stdout(log_file(log))
        .stderr(log_file(log));
    c.status()
        .map(code)
        .map_err(|e| format!("could not start: {e}"))
}

/// Runs `c` with its stderr in `log`: its stdout, or the log's tail.
pub fn output(c: &mut Command, log: &Path) -> Outcome<String> {
    let out = c
        .stdin(Stdio::null())
        .stderr(log_file(log))
        .output()
        .map_err(|e| e.to_string())?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        false => Err(tail_of(log)),
    }
}

/// `sh -c SCRIPT` with its stderr in `log`: its stdout, or the log's tail.
pub fn sh(script: &str, log: &Path) -> Outcome<String> {
    output(Command::new("sh").args(["-c", script]), log)
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

/// ms from `a` to `b`, when both happened in that order.
pub fn span_ms(a: Option<Instant>, b: Option<Instant>) -> Option<f64> {
    Some(b?.checked_duration_since(a?)?.as_secs_f64() * 1e3)
}

/// ms that `f` took, with its result.
pub fn timed<T>(f: impl FnOnce() -> T) -> (T, f64) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed().as_secs_f64() * 1e3)
}

/// `VmRSS` of process `pid` in KiB (`VmRSS:\t   12345 kB` in its `/proc/PID/status`).
pub fn vmrss_kib(pid: u32) -> Outcome<f64> {
    let status = fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("no /proc/{pid}/status (process gone?): {e}"))?;
    parse_vmrss(&status)
}

fn parse_vmrss(status: &str) -> Outcome<f64> {
    let line = status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .ok_or("no VmRSS line in /proc/PID/status (process gone?)")?;
    match line["VmRSS:".len()..]
        .split_whitespace()
        .collect::<Vec<_>>()[..]
    {
        [n, "kB"] => n.parse::<u64>().map(|k| k as f64).ok(),
        _ => None,
    }
    .ok_or_else(|| format!("odd VmRSS line {line:?}"))
}

/// The whole guest's setting: the run directory, the host's input, the clock tick rate.
#[derive(Debug)]
pub struct Guest {
    pub out: PathBuf,
    pub tmp: PathBuf,
    pub input: Input,
    /// Clock ticks per second of `/proc`'s CPU times.
    pub hz: f64,
}

impl Guest {
    pub fn new(input: Input, out: PathBuf) -> Self {
        let getconf = Command::new("getconf").arg("CLK_TCK").output();
        let hz = getconf.map(|o| String::from_utf8_lossy(&o.stdout).trim().parse());
        Self {
            out,
            tmp: std::env::temp_dir(),
            input,
            hz: hz.ok().and_then(Result::ok).unwrap_or(100.0),
        }
    }

    /// The ublkd binary of `build`.
    pub fn ublkd(&self, build: Build) -> Option<&Path> {
        match build {
            Build::New => self.input.ublkd.as_deref().ok(),
            Build::Baseline => self.input.plan.baseline.as_ref().map(|(_, b)| b.as_path()),
        }
    }

    /// The case's directory for its logs, made.
    pub fn dir(&self, run: &str) -> PathBuf {
        let d = self.out.join(run);
        if let Err(e) = fs::create_dir_all(&d) {
            note(&format!("cannot make {}: {e}", d.display()));
        }
        d
    }

    pub fn no_backing(&self) -> String {
        let log = self.out.join("backing.log");
        format!("no backing file: {}", tail_of(&log))
    }
}

/// A server process the case started, logging into its directory.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    dir: PathBuf,
    exit: Option<i32>,
}

impl Proc {
    /// Starts `c` with stdout to `dir/server.out` and stderr to `dir/server.err` (appended).
    pub fn spawn(mut c: Command, dir: &Path) -> Outcome<Self> {
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

    /// The tail of its stderr.
    pub fn err_tail(&self) -> String {
        tail_of(&self.dir.join("server.err"))
    }

    /// SIGKILL.
    pub fn kill9(&mut self) {
        if self.exited().is_none() && !signal(self.pid(), "KILL") {
            note(&format!("kill -9 {} failed", self.pid()));
        }
    }

    /// SIGTERM, then waits for the exit and for `dev`'s removal; what went wrong goes into
    /// `problems`.
    pub fn stop(&mut self, dev: Option<&Path>, problems: &mut Vec<String>) {
        if self.exited().is_none() {
            signal(self.pid(), "TERM");
        }
        match self.wait_exit(Duration::from_secs(30), Duration::from_millis(100)) {
            None => {
                problems.push("did not exit within 30 s of SIGTERM (killed)".into());
                self.kill9();
                self.wait_exit(Duration::from_secs(5), Duration::from_millis(100));
            }
            Some(0) => {}
            Some(rc) => problems.push(format!(
                "exited with status {rc} after SIGTERM: {}",
                self.err_tail()
            )),
        }
        let gone = |dev: &Path| {
            wait_until(Duration::from_secs(5), Duration::from_millis(100), || {
                !dev.exists()
            })
        };
        if let Some(dev) = dev.filter(|d| !gone(d)) {
            problems.push(format!("{} still exists after ublkd exited", dev.display()));
        }
    }
}

/// `ublkctl list-volumes -o json`, as far as the bench reads it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct VolumeList {
    pub volumes: Vec<Volume>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Volume {
    pub id: String,
    /// The state's name, or its number when ublkctl does not know it.
    pub state: serde_json::Value,
    pub io_path_in_use: serde_json::Value,
    pub message: String,
}

/// `ublkd --config` as a node service, driven by `ublkctl` over its socket, everything under
/// its own directory in the guest's tmpfs, and what happened to it.
#[derive(Debug, Default)]
pub struct Node {
    /// The case's directory in the run directory (its logs).
    pub d: PathBuf,
    /// Its configuration, state, roots and socket.
    pub c: PathBuf,
    ublkd: PathBuf,
    ublkctl: PathBuf,
    proc: Option<Proc>,
    /// Volumes made (name, device): their devices must be gone after the teardown.
    pub volumes: Vec<(String, PathBuf)>,
    /// What went wrong after the measurements.
    pub problems: Vec<String>,
    /// When the running process was started, when the last one was killed, when the volumes
    /// were last seen READY.
    pub started: Option<Instant>,
    pub killed: Option<Instant>,
    pub ready: Option<Instant>,
    /// One more `list-volumes` once all were READY (ms), and the first volume's I/O path.
    pub list_call_ms: Option<f64>,
    pub io_path: Option<String>,
}

impl Node {
    /// A fresh `ublkd --config` for `run` (metrics on `metrics`), served by [`Node::serve`].
    pub fn run(
        g: &Guest,
        run: &str,
        metrics: &str,
        f: impl FnOnce(&mut Node) -> Outcome<Measured>,
    ) -> Case {
        match Node::new(g, run, metrics) {
            Ok(node) => node.serve(run, f),
            Err(why) => failed(run, why),
        }
    }

    /// A fresh directory and `ublkd.toml` for `run`; not started.
    pub fn new(g: &Guest, run: &str, metrics: &str) -> Outcome<Self> {
        let (Some(ublkd), Ok(ublkctl)) = (g.ublkd(Build::New), &g.input.ublkctl) else {
            return Err("no ublkd or ublkctl binary".into());
        };
        let c = g.tmp.join(run);
        // A leftover of an earlier run in this boot would be read as state.
        let _ = fs::remove_dir_all(&c); // absent on a fresh boot: nothing to remove is fine
        let cd = c.display();
        let config = format!(
            "state_dir = \"{cd}/state\"\nallowed_roots = [\"{cd}/roots\"]\nram_dir = \"{cd}/ram\"\n\
             on_exit = \"keep\"\n\n[grpc]\nlisten = [\"unix://{cd}/ublkd.sock\"]\n\n[metrics]\n\
             listen = \"{metrics}\"\n\n[dataplane]\ncpus = [0, 1]\n"
        );
        fs::create_dir_all(c.join("roots"))
            .and_then(|()| fs::write(c.join("ublkd.toml"), config))
            .map_err(|e| format!("cannot make {cd}: {e}"))?;
        Ok(Self {
            d: g.dir(run),
            c,
            ublkd: ublkd.to_path_buf(),
            ublkctl: ublkctl.clone(),
            ..Self::default()
        })
    }

    /// Starts it and waits until it answers; `f` measures with it; then every volume it lists
    /// is deleted and it is stopped.
    pub fn serve(mut self, run: &str, f: impl FnOnce(&mut Node) -> Outcome<Measured>) -> Case {
        self.spawn();
        let measured = match self.wait_up() {
            Ok(()) => {
                let m = f(&mut self);
                self.teardown();
                m
            }
            Err(e) => {
                self.stop();
                Err(e)
            }
        };
        if let Err(why) = &measured {
            note(&format!("{run}: {why}"));
        }
        Case {
            measured,
            teardown: self.problems,
        }
    }

    pub fn sock(&self) -> PathBuf {
        self.c.join("ublkd.sock")
    }

    pub fn pid(&self) -> Option<u32> {
        self.proc.as_ref().map(Proc::pid)
    }

    /// Whether it has exited (or never started), with its status.
    pub fn exited(&mut self) -> Option<i32> {
        self.proc.as_mut().map_or(Some(-1), Proc::exited)
    }

    fn err_tail(&self) -> String {
        tail_of(&self.d.join("server.err"))
    }

    /// Starts it (`started`: the moment right before).
    pub fn spawn(&mut self) {
        self.started = Some(Instant::now());
        let mut c = Command::new(&self.ublkd);
        c.arg("--config").arg(self.c.join("ublkd.toml"));
        self.proc = Proc::spawn(c, &self.d)
            .map_err(|e| append(&self.d.join("server.err"), &e))
            .ok();
    }

    /// Waits up to 60 s for its socket to answer node-info; why not, if it does not.
    fn wait_up(&mut self) -> Outcome<()> {
        let err = self.d.join("node-info.err");
        let end = Instant::now() + Duration::from_secs(60);
        while Instant::now() < end && self.exited().is_none() {
            if self.ctl("node-info", &err).is_ok() {
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Err(match self.exited() {
            Some(rc) => format!(
                "ublkd exited with status {rc} before its socket answered: {}",
                self.err_tail()
            ),
            None => format!(
                "ublkd's socket did not answer node-info within 60 s: {} {}",
                tail_of(&err),
                self.err_tail()
            ),
        })
    }

    /// `ublkctl ARGS` (words) against it: its stdout, or the tail of `err` (its stderr).
    pub fn ctl(&self, args: &str, err: &Path) -> Outcome<String> {
        let out = Command::new(&self.ublkctl)
            .arg("--endpoint")
            .arg(format!("unix://{}", self.sock().display()))
            .args(args.split_whitespace())
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

    /// `create-volume NAME ARGS` (words), timed (ms, ublkctl end to end): its block device, once
    /// it is one (remembered for the teardown's check).
    pub fn create(&mut self, name: &str, args: &str, err: &Path) -> Outcome<(PathBuf, f64)> {
        let (out, ms) = timed(|| self.ctl(&format!("create-volume {name} {args}"), err));
        let dev = PathBuf::from(out.map_err(|e| format!("create-volume {name} failed {e}"))?);
        self.volumes.push((name.to_owned(), dev.clone()));
        if !wait_blk(&dev) {
            return Err(format!(
                "create-volume {name} returned {}, which is no block device",
                dev.display()
            ));
        }
        Ok((dev, ms))
    }

    /// The volumes it lists.
    pub fn list(&self, err: &Path) -> Outcome<VolumeList> {
        let text = self.ctl("list-volumes -o json", err)?;
        serde_json::from_str(&text).map_err(|e| format!("list-volumes gave no volume list: {e}"))
    }

    /// SIGTERM and the wait (see [`Proc::stop`]).
    pub fn stop(&mut self) {
        if let Some(p) = &mut self.proc {
            p.stop(None, &mut self.problems);
        }
    }

    /// kill -9 (`killed`), waits until it is gone (10 s at most), starts it again.
    pub fn crash_restart(&mut self) -> Outcome<()> {
        self.killed = Some(Instant::now());
        let p = self.proc.as_mut().ok_or("ublkd was not running")?;
        p.kill9();
        if p.wait_exit(Duration::from_secs(10), Duration::from_millis(10))
            .is_none()
        {
            return Err("ublkd did not exit within 10 s of kill -9".into());
        }
        self.spawn();
        Ok(())
    }

    /// Polls `list-volumes` every 20 ms until it shows `n` volumes READY: ms from the exec
    /// until that answer (`ready`); then times one more call (`list_call_ms`) and notes the
    /// I/O path. Gives up when a volume FAILED, the daemon exited, or 60 s passed.
    pub fn wait_ready(&mut self, n: usize) -> Outcome<f64> {
        let err = self.d.join("list.err");
        let end = Instant::now() + Duration::from_secs(60);
        let state = |v: &Volume, s: &str| v.state.as_str() == Some(s);
        let mut seen = 0;
        loop {
            if let Ok(list) = self.list(&err) {
                seen = list
                    .volumes
                    .iter()
                    .filter(|v| state(v, "VOLUME_STATE_READY"))
                    .count();
                if seen == n {
                    self.ready = Some(Instant::now());
                    // Only its duration counts: an error here shows in list.err.
                    let ((), ms) = timed(|| drop(self.list(&err)));
                    self.list_call_ms = Some(ms);
                    let path = list.volumes.first().map(|v| &v.io_path_in_use);
                    self.io_path = path.map(|p| p.as_str().map_or(p.to_string(), str::to_owned));
                    return span_ms(self.started, self.ready).ok_or("no start time".into());
                }
                if let Some(v) = list
                    .volumes
                    .iter()
                    .find(|v| state(v, "VOLUME_STATE_FAILED"))
                {
                    return Err(format!("a volume FAILED to come back: {}", v.message));
                }
            }
            if let Some(rc) = self.exited() {
                let tail = self.err_tail();
                return Err(format!("the new ublkd exited with status {rc}: {tail}"));
            }
            if Instant::now() >= end {
                return Err(format!(
                    "not all {n} volumes READY within 60 s of the restart: {seen} READY; {}",
                    tail_of(&err)
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// What the last restart took, READY `ready_ms` after the exec.
    pub fn restart(&self, ready_ms: Outcome<f64>) -> Restart {
        Restart {
            ready_ms,
            kill_to_exec_ms: span_ms(self.killed, self.started),
            kill_to_ready_ms: span_ms(self.killed, self.ready),
            list_call_ms: self.list_call_ms,
            io_path: self.io_path.clone(),
        }
    }

    /// Deletes every volume the daemon lists (starting it again first if it is gone), checks
    /// that the devices of `volumes` are gone, stops the daemon; problems go to `problems`.
    fn teardown(&mut self) {
        let del = self.d.join("delete.err");
        if self.exited().is_some() {
            self.spawn();
            wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
                self.exited().is_some() || self.ctl("node-info", &del).is_ok()
            });
        }
        match self.list(&del) {
            Ok(list) => {
                for v in list.volumes {
                    if let Err(e) = self.ctl(&format!("delete-volume {}", v.id), &del) {
                        self.problems
                            .push(format!("delete-volume {} failed: {e}", v.id));
                    }
                }
            }
            Err(e) => self
                .problems
                .push(format!("list-volumes failed before the deletes: {e}")),
        }
        for (name, dev) in &self.volumes {
            if dev.exists() {
                let dev = dev.display();
                self.problems
                    .push(format!("{dev} ({name}) still exists after the deletes"));
            }
        }
        match self.exited() {
            Some(rc) => {
                let tail = self.err_tail();
                self.problems.push(format!(
                    "ublkd was not running for the deletes (status {rc}): {tail}"
                ));
            }
            None => self.stop(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_and_volume_lists_read_as_ublkctl_and_proc_write_them() {
        let status = "Name:\tublkd\nVmHWM:\t   9000 kB\nVmRSS:\t    8520 kB\nThreads:\t5\n";
        assert_eq!(parse_vmrss(status), Ok(8520.0));
        assert!(parse_vmrss("Name:\tublkd\n").is_err_and(|e| e.contains("no VmRSS")));
        assert!(parse_vmrss("VmRSS:\t12 MB\n").is_err());
        assert!(parse_vmrss("VmRSS:\t12 kB extra\n").is_err());
        let list = r#"{"volumes": [{"id": "r001", "state": "VOLUME_STATE_READY",
            "io_path_in_use": "IO_PATH_BATCH", "spec": {"size": 1}}, {"id": "r002", "state": 9}]}"#;
        let l: VolumeList = serde_json::from_str(list).unwrap();
        assert_eq!(l.volumes[0].io_path_in_use, "IO_PATH_BATCH");
        assert_eq!(
            (l.volumes[1].id.as_str(), l.volumes[1].state.as_u64()),
            ("r002", Some(9))
        );
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
