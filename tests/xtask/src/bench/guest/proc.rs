//! What every guest case uses: the guest's setting, logs in the run directory, processes (a
//! `ublkd` node service driven by `ublkctl`) and waits.

use super::super::cases::Build;
use super::super::results::{Case, Input, Measured, Outcome, Restart};
use serde::Deserialize;
use std::fs::{self, OpenOptions};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU16, Ordering};
use std::time::{Duration, Instant};

/// Clock ticks per second of `/proc`'s CPU times: USER_HZ (`getconf CLK_TCK`), which Linux fixes
/// at 100 on x86.
pub const USER_HZ: f64 = 100.0;

/// A line on the guest's console.
pub fn note(msg: &str) {
    println!("bench: {msg}");
}

/// A case that measured nothing, and why.
pub fn failed(run: &str, why: String) -> Case {
    note!("{run}: {why}");
    let (measured, teardown) = (Err(why), Vec::new());
    Case { measured, teardown }
}

/// The last five lines of `path`, on one line (what a failure message quotes).
pub fn tail_of(path: &Path) -> String {
    let text = fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" ")
}

/// A file to append a process's output to (created if missing).
pub fn log_file(path: &Path) -> Stdio {
    match OpenOptions::new().create(true).append(true).open(path) {
        Ok(f) => Stdio::from(f),
        Err(e) => {
            note!("cannot open {}: {e}", path.display());
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

/// Runs `c` with its stderr appended to `log`: its stdout, or its status and the log's tail.
pub fn output(c: &mut Command, log: &Path) -> Outcome<String> {
    let out = c.stdin(Stdio::null()).stderr(log_file(log)).output();
    let out = out.map_err(|e| format!("could not start {:?}: {e}", c.get_program()))?;
    match out.status.success() {
        true => Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned()),
        false => Err(format!("(exit {}) {}", code(out.status), tail_of(log))),
    }
}

/// `sh -c SCRIPT`, as [`output`].
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

/// Polls `done` every 100 ms for up to `secs` seconds; whether it held.
pub fn wait_secs(secs: u64, done: impl FnMut() -> bool) -> bool {
    wait_until(Duration::from_secs(secs), Duration::from_millis(100), done)
}

pub fn is_blk(dev: &Path) -> bool {
    fs::metadata(dev).is_ok_and(|m| m.file_type().is_block_device())
}

/// Waits up to 10 s for block device `dev` to appear.
pub fn wait_blk(dev: &Path) -> bool {
    wait_secs(10, || is_blk(dev))
}

/// Sends `sig` (a name, e.g. `TERM`) to `pid`; whether kill(1) did.
pub fn signal(pid: u32, sig: &str) -> bool {
    let mut kill = Command::new("kill");
    kill.arg(format!("-{sig}")).arg(pid.to_string());
    kill.stderr(Stdio::null())
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
    let line = status.lines().find_map(|l| l.strip_prefix("VmRSS:"));
    let kib = line.and_then(|l| l.trim().strip_suffix(" kB")?.trim().parse::<u64>().ok());
    kib.map(|k| k as f64)
        .ok_or_else(|| format!("no VmRSS in kB in /proc/PID/status: {line:?}"))
}

/// The whole guest's setting: the run directory, the guest's tmpfs, the host's input.
#[derive(Debug)]
pub struct Guest {
    pub out: PathBuf,
    pub tmp: PathBuf,
    pub input: Input,
}

impl Guest {
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
            note!("cannot make {}: {e}", d.display());
        }
        d
    }

    pub fn no_backing(&self) -> String {
        let log = self.out.join("backing.log");
        format!("no backing file: {}", tail_of(&log))
    }
}

/// A process the case started (a server: its stdout in `server.out` and its stderr in
/// `server.err` of the case's directory).
#[derive(Debug)]
pub struct Proc {
    child: Child,
    err: PathBuf,
    exit: Option<i32>,
}

impl Proc {
    /// `c` started, its stdout appended to `out` and its stderr to `err`.
    pub fn spawn(mut c: Command, out: &Path, err: &Path) -> Outcome<Self> {
        c.stdin(Stdio::null())
            .stdout(log_file(out))
            .stderr(log_file(err));
        let child = c.spawn().map_err(|e| format!("could not start: {e}"))?;
        let (err, exit) = (err.to_path_buf(), None);
        Ok(Self { child, err, exit })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Its exit code, once it has exited.
    pub fn exited(&mut self) -> Option<i32> {
        if self.exit.is_none() {
            self.exit = self.child.try_wait().ok().flatten().map(code);
        }
        self.exit
    }

    /// Waits up to `secs` seconds for it to exit.
    pub fn wait_exit(&mut self, secs: u64) -> Option<i32> {
        wait_until(Duration::from_secs(secs), Duration::from_millis(10), || {
            self.exited().is_some()
        });
        self.exit
    }

    /// The tail of its stderr.
    pub fn err_tail(&self) -> String {
        tail_of(&self.err)
    }

    /// SIGKILL.
    pub fn kill9(&mut self) {
        if self.exited().is_none() && !signal(self.pid(), "KILL") {
            note!("kill -9 {} failed", self.pid());
        }
    }

    /// SIGTERM, then waits for the exit and for `dev`'s removal; what went wrong goes into
    /// `problems`.
    pub fn stop(&mut self, dev: Option<&Path>, problems: &mut Vec<String>) {
        if self.exited().is_none() {
            signal(self.pid(), "TERM");
        }
        match self.wait_exit(30) {
            None => {
                problems.push("did not exit within 30 s of SIGTERM (killed)".into());
                self.kill9();
                self.wait_exit(5);
            }
            Some(0) => {}
            Some(rc) => {
                let tail = self.err_tail();
                problems.push(format!("exited with status {rc} after SIGTERM: {tail}"));
            }
        }
        if let Some(dev) = dev.filter(|d| !wait_secs(5, || !d.exists())) {
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

/// A volume's state is its name, or its number when ublkctl does not know it.
#[derive(Debug, Default, Deserialize)]
#[serde(default)]
pub struct Volume {
    pub id: String,
    pub state: serde_json::Value,
    pub io_path_in_use: serde_json::Value,
    pub message: String,
}

/// `ublkd --config` as a node service, driven by `ublkctl` over its socket, everything under
/// its own directory in the guest's tmpfs, and what happened to it.
#[derive(Debug)]
pub struct Node {
    /// The case's directory in the run directory (its logs).
    pub d: PathBuf,
    /// Its configuration, state, roots and socket.
    pub c: PathBuf,
    ublkd: PathBuf,
    ublkctl: PathBuf,
    /// Where it serves /metrics.
    pub metrics: String,
    proc: Option<Proc>,
    /// When the running process was started.
    started: Instant,
    /// Volumes made (name, device): their devices must be gone after the teardown.
    pub volumes: Vec<(String, PathBuf)>,
    /// What went wrong after the measurements.
    pub problems: Vec<String>,
}

impl Node {
    /// A fresh `ublkd --config` for `run`, served by [`Node::serve`].
    pub fn run(g: &Guest, run: &str, f: impl FnOnce(&mut Node) -> Outcome<Measured>) -> Case {
        match Node::new(g, run) {
            Ok(node) => node.serve(run, f),
            Err(why) => failed(run, why),
        }
    }

    /// A fresh directory and `ublkd.toml` for `run`, with a metrics port of its own (no daemon
    /// waits for the last one's port to be free); not started.
    pub fn new(g: &Guest, run: &str) -> Outcome<Self> {
        static PORT: AtomicU16 = AtomicU16::new(9581);
        let metrics = format!("127.0.0.1:{}", PORT.fetch_add(1, Ordering::Relaxed));
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
            metrics,
            proc: None,
            started: Instant::now(),
            volumes: Vec::new(),
            problems: Vec::new(),
        })
    }

    /// Starts it and waits until it answers; `f` measures with it; then every volume it lists
    /// is deleted and it is stopped.
    pub fn serve(mut self, run: &str, f: impl FnOnce(&mut Node) -> Outcome<Measured>) -> Case {
        self.spawn();
        let up = self.wait_up(60);
        let measured = up.clone().and_then(|()| f(&mut self));
        match up {
            Ok(()) => self.teardown(),
            Err(_) => self.stop(),
        }
        if let Err(why) = &measured {
            note!("{run}: {why}");
        }
        let teardown = self.problems;
        Case { measured, teardown }
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
    fn spawn(&mut self) {
        self.started = Instant::now();
        let mut c = Command::new(&self.ublkd);
        c.arg("--config").arg(self.c.join("ublkd.toml"));
        let p = Proc::spawn(c, &self.d.join("server.out"), &self.d.join("server.err"));
        self.proc = p.map_err(|e| note!("ublkd {e}")).ok();
    }

    /// SIGTERM and the wait (see [`Proc::stop`]).
    fn stop(&mut self) {
        if let Some(p) = &mut self.proc {
            p.stop(None, &mut self.problems);
        }
    }

    /// Waits up to `secs` seconds for its socket to answer node-info; why not, if it does not.
    fn wait_up(&mut self, secs: u64) -> Outcome<()> {
        let err = self.d.join("node-info.err");
        let up = wait_secs(secs, || {
            self.exited().is_some() || self.ctl("node-info", &err).is_ok()
        });
        let (tail, node_info) = (self.err_tail(), tail_of(&err));
        match (up, self.exited()) {
            (_, Some(rc)) => Err(format!(
                "ublkd exited with status {rc} before its socket answered: {tail}"
            )),
            (true, None) => Ok(()),
            (false, None) => Err(format!(
                "ublkd's socket did not answer node-info within {secs} s: {node_info} {tail}"
            )),
        }
    }

    /// `ublkctl ARGS` (words) against it: its stdout, or why not (its stderr in `err`).
    pub fn ctl(&self, args: &str, err: &Path) -> Outcome<String> {
        let mut c = Command::new(&self.ublkctl);
        c.arg("--endpoint")
            .arg(format!("unix://{}", self.sock().display()))
            .args(args.split_whitespace());
        output(&mut c, err)
    }

    /// `ublkctl ARGS` timed (ms, end to end): its stdout and the time, or which call failed
    /// (its first two words) and why.
    pub fn call(&self, args: &str, err: &Path) -> Outcome<(String, f64)> {
        let (out, ms) = timed(|| self.ctl(args, err));
        let what: Vec<&str> = args.split_whitespace().take(2).collect();
        out.map(|o| (o, ms))
            .map_err(|e| format!("{} failed {e}", what.join(" ")))
    }

    /// `create-volume NAME ARGS` (words), timed as [`Node::call`]: its block device, once it is
    /// one (remembered for the teardown's check).
    pub fn create(&mut self, name: &str, args: &str, err: &Path) -> Outcome<(PathBuf, f64)> {
        let (dev, ms) = self.call(&format!("create-volume {name} {args}"), err)?;
        let dev = PathBuf::from(dev);
        self.volumes.push((name.to_owned(), dev.clone()));
        match wait_blk(&dev) {
            true => Ok((dev, ms)),
            false => Err(format!(
                "create-volume {name} returned {dev:?}, which is no block device"
            )),
        }
    }

    /// `delete-volume NAME` timed, as [`Node::call`].
    pub fn delete(&self, name: &str, err: &Path) -> Outcome<f64> {
        let (_, ms) = self.call(&format!("delete-volume {name}"), err)?;
        Ok(ms)
    }

    /// The volumes it lists.
    pub fn list(&self, err: &Path) -> Outcome<VolumeList> {
        let text = self.ctl("list-volumes -o json", err)?;
        serde_json::from_str(&text).map_err(|e| format!("list-volumes gave no volume list: {e}"))
    }

    /// kill -9, waits until it is gone (10 s at most), starts it again, runs `check` (what must
    /// hold right after the exec, reported once READY), then polls `list-volumes` every 20 ms
    /// until it shows `n` volumes READY: what that took.
    pub fn crash_restart(&mut self, n: usize, check: impl FnOnce() -> Outcome<()>) -> Restart {
        let killed = Instant::now();
        let gone = self.proc.as_mut().map(|p| {
            p.kill9();
            p.wait_exit(10).is_some()
        });
        let mut r = Restart::failed(match gone {
            None => "ublkd was not running".into(),
            Some(_) => "ublkd did not exit within 10 s of kill -9".into(),
        });
        if gone == Some(true) {
            self.spawn();
            r.kill_to_exec_ms = span_ms(Some(killed), Some(self.started));
            let checked = check();
            r.ready_ms = self
                .wait_ready(n, &mut r)
                .and_then(|ms| checked.map(|()| ms));
            let ready_ms = r.ready_ms.clone().ok();
            r.kill_to_ready_ms = r.kill_to_exec_ms.zip(ready_ms).map(|(a, b)| a + b);
        }
        r
    }

    /// ms from the exec until `list-volumes` showed `n` volumes READY; then times one more call
    /// and notes the I/O path, into `r`. Gives up when a volume FAILED, the daemon exited, or
    /// 60 s passed.
    fn wait_ready(&mut self, n: usize, r: &mut Restart) -> Outcome<f64> {
        let err = self.d.join("list.err");
        let end = Instant::now() + Duration::from_secs(60);
        let state = |v: &Volume, s: &str| v.state.as_str() == Some(s);
        loop {
            let list = self.list(&err).unwrap_or_default().volumes;
            let seen = list
                .iter()
                .filter(|v| state(v, "VOLUME_STATE_READY"))
                .count();
            if seen == n {
                let ready_ms = span_ms(Some(self.started), Some(Instant::now()));
                // Only its duration counts: an error here shows in list.err.
                r.list_call_ms = Some(timed(|| self.list(&err)).1);
                let path = list.first().map(|v| &v.io_path_in_use);
                r.io_path = path.map(|p| p.as_str().map_or(p.to_string(), str::to_owned));
                return ready_ms.ok_or("no start time".into());
            }
            if let Some(v) = list.iter().find(|v| state(v, "VOLUME_STATE_FAILED")) {
                return Err(format!("a volume FAILED to come back: {}", v.message));
            }
            if let Some(rc) = self.exited() {
                let tail = self.err_tail();
                return Err(format!("the new ublkd exited with status {rc}: {tail}"));
            }
            if Instant::now() >= end {
                let why = format!("{seen} READY; {}", tail_of(&err));
                return Err(format!(
                    "not all {n} volumes READY within 60 s of the restart: {why}"
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Deletes every volume the daemon lists (starting it again first if it is gone), checks
    /// that the devices of `volumes` are gone, stops the daemon; problems go to `problems`.
    fn teardown(&mut self) {
        let del = self.d.join("delete.err");
        if self.exited().is_some() {
            self.spawn();
            let _ = self.wait_up(10); // whether it answers shows in the deletes
        }
        let problems = match self.list(&del) {
            Ok(list) => list
                .volumes
                .iter()
                .filter_map(|v| self.delete(&v.id, &del).err())
                .collect(),
            Err(e) => vec![format!("list-volumes failed before the deletes: {e}")],
        };
        self.problems.extend(problems);
        for (name, dev) in &self.volumes {
            if dev.exists() {
                let left = format!("{} ({name}) still exists after the deletes", dev.display());
                self.problems.push(left);
            }
        }
        match self.exited() {
            None => self.stop(),
            Some(rc) => {
                let tail = self.err_tail();
                let why = format!("ublkd was not running for the deletes (status {rc}): {tail}");
                self.problems.push(why);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_volume_lists_and_tails_read_as_written() {
        let status = "Name:\tublkd\nVmHWM:\t   9000 kB\nVmRSS:\t    8520 kB\nThreads:\t5\n";
        assert_eq!(parse_vmrss(status), Ok(8520.0));
        assert!(parse_vmrss("Name:\tublkd\n").is_err_and(|e| e.contains("no VmRSS")));
        assert!(parse_vmrss("VmRSS:\t12 MB\n").is_err());
        assert!(parse_vmrss("VmRSS:\t12 kB extra\n").is_err());
        let list = r#"{"volumes": [{"id": "r001", "state": "VOLUME_STATE_READY",
            "io_path_in_use": "IO_PATH_BATCH", "spec": {"size": 1}}, {"id": "r002", "state": 9}]}"#;
        let l: VolumeList = serde_json::from_str(list).unwrap();
        assert_eq!(l.volumes[0].io_path_in_use, "IO_PATH_BATCH");
        let unknown = (l.volumes[1].id.as_str(), l.volumes[1].state.as_u64());
        assert_eq!(unknown, ("r002", Some(9)));
        let p = std::env::temp_dir().join(format!("xtask-tail-{}", std::process::id()));
        fs::write(&p, "1\n2\n3\n4\n5\n6\n7\n").unwrap();
        assert_eq!(tail_of(&p), "3 4 5 6 7");
        let _ = fs::remove_file(&p); // a temp file
        assert_eq!(tail_of(&p), "");
    }
}
