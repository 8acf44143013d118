//! One QEMU run: boot the guest kernel with the initramfs, an emulated NVMe controller with poll
//! queues and the host root shared read-only, run a shell script in a chroot of that root, and
//! report how it ended. A guest that hangs or panics is killed at the timeout and reported with
//! its console tail; it is never waited on forever.

use crate::apt;
use crate::image::Kernel;
use anyhow::{Context, Result};
use std::fmt;
use std::fs;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Size of the emulated NVMe namespace (sparse on the host).
const NVME_BYTES: u64 = 1 << 30;
/// Each namespace of the multipath subsystem (`Vm::multipath`).
const MPATH_NS_BYTES: u64 = 256 << 20;
const CONSOLE_KEEP: usize = 2000;

/// How a guest run ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exit {
    /// The command ran and exited with this status.
    Code(i32),
    /// The guest was killed at the timeout.
    Timeout(u64),
    /// The kernel panicked.
    Panic,
    /// QEMU ended without the guest reporting a status.
    NoStatus(String),
}

impl fmt::Display for Exit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Exit::Code(c) => write!(f, "exited with status {c}"),
            Exit::Timeout(s) => write!(f, "did not power off within {s} s and was killed"),
            Exit::Panic => write!(f, "kernel panicked"),
            Exit::NoStatus(why) => write!(f, "ended without reporting a status ({why})"),
        }
    }
}

/// The outcome of one guest run.
#[derive(Debug)]
pub struct RunResult {
    pub exit: Exit,
    pub console: Vec<String>,
    pub run_dir: PathBuf,
    pub wall: Duration,
}

impl RunResult {
    pub fn console_tail(&self, n: usize) -> String {
        let start = self.console.len().saturating_sub(n);
        self.console[start..].join("\n")
    }
}

#[derive(Debug)]
pub struct Vm {
    kernel: Kernel,
    run_dir: PathBuf,
    /// The workspace or the run directory is under /tmp (CI's fresh clone, whose `target` may
    /// link elsewhere): the guest keeps the host's /tmp and makes its scratch under /run.
    host_tmp: bool,
    timeout: u64,
    echo: bool,
    accel: Option<String>,
    multipath: bool,
    writable_root: bool,
    memory_mib: u32,
    tcg_single_thread: bool,
    clock: Clock,
    network: Option<Network>,
}

/// What the guest's clock counts under TCG.
///
/// `Wall`: the host's real time, with one host thread per vCPU (multi-threaded TCG). Timings
/// then carry everything the host does meanwhile: the same fio job on the same volume moves by
/// ±25 % from one 3 s run to the next, so a 5 % change cannot be told from noise.
///
/// `Instructions`: QEMU's `-icount shift=0,sleep=on`: the guest's clock advances one nanosecond
/// per guest instruction executed, so a timing measures the work done per I/O (the length of the
/// code path, on both sides of the ublk queue), not the host's load; the same job on a null
/// volume then repeats within 0.3 % (QD32) and 0.1 % (QD1). It is for work done on the vCPUs
/// only: an emulated device still works in host time, and cases that wait on one (file volumes
/// on the guest's disk, NVMe) swung by factors of 10 and more from run to run under it, far worse
/// than on the wall clock. The vCPUs run one at a time in one host thread, so it cannot show a change in
/// how work spreads over CPUs (placement, overlap, lock contention between threads): judge those
/// by `Wall`. It is slow: a busy guest second is 10^9 instructions, about 5 host seconds.
/// `sleep=on` lets an idle guest wait in real time for the emulated devices instead of
/// jumping its clock to the next timer, which would add whole timer periods to each NVMe I/O.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Clock {
    #[default]
    Wall,
    Instructions,
}

impl Clock {
    pub fn as_str(self) -> &'static str {
        match self {
            Clock::Wall => "wall",
            Clock::Instructions => "instructions",
        }
    }
}

/// QEMU's accelerator arguments for TCG.
fn tcg_args(single_thread: bool, clock: Clock, cpu: &str) -> Vec<String> {
    let thread = match (single_thread, clock) {
        (_, Clock::Instructions) | (true, Clock::Wall) => "single",
        (false, Clock::Wall) => "multi",
    };
    let mut args = vec![
        "-accel".to_owned(),
        format!("tcg,thread={thread}"),
        "-cpu".to_owned(),
        cpu.to_owned(),
    ];
    if clock == Clock::Instructions {
        args.extend(["-icount".to_owned(), "shift=0,sleep=on".to_owned()]);
    }
    args
}

/// A network for the guest: QEMU's user network (the host at 10.0.2.2, the guest 10.0.2.15),
/// with QEMU itself run in a network namespace of the host's, so that what the guest reaches
/// and what is forwarded into it stay in that namespace.
#[derive(Debug, Clone)]
pub struct Network {
    /// The namespace (`ip netns`) QEMU runs in.
    pub netns: String,
    /// `hostfwd` rules, each `tcp:ADDR:PORT-:GUESTPORT`.
    pub forwards: Vec<String>,
}

static RUN_SEQ: AtomicU32 = AtomicU32::new(0);

/// What the guest's init prints once it starts the command (`init.sh`).
const COMMAND_STARTED: &str = "ublkd-vm: modules loaded, running command";

impl Vm {
    pub fn new(ws: &Path, kernel: &Kernel) -> Result<Self> {
        let seq = RUN_SEQ.fetch_add(1, Ordering::Relaxed);
        let run_dir = ws
            .join("target/vm")
            .join(format!("run-{}-{seq}", std::process::id()));
        let _ = fs::remove_dir_all(&run_dir);
        fs::create_dir_all(&run_dir)?;
        let run_dir = run_dir.canonicalize()?;
        let host_tmp = [ws.canonicalize()?, run_dir.clone()]
            .iter()
            .any(|p| p.starts_with("/tmp"));
        Ok(Self {
            kernel: kernel.clone(),
            run_dir,
            host_tmp,
            timeout: 600,
            echo: std::env::var("UBLKD_VM_VERBOSE").is_ok_and(|v| v == "1"),
            accel: None,
            multipath: false,
            writable_root: false,
            memory_mib: 4096,
            tcg_single_thread: false,
            clock: Clock::Wall,
            network: None,
        })
    }

    pub fn timeout_secs(mut self, secs: u64) -> Self {
        self.timeout = secs;
        self
    }

    pub fn echo(mut self, on: bool) -> Self {
        self.echo = self.echo || on;
        self
    }

    /// Adds a second NVMe subsystem with two controllers, the topology of native multipath:
    /// namespace 1 private to the second controller (its char device is named by the
    /// controller, its disk by the subsystem) with 4 KiB blocks, and namespace 2 shared by both
    /// (one multipath head). The first controller and its `ng0n1` stay as in every boot, but
    /// controller numbering is then racy (asynchronous probe), so only tests that find their
    /// devices by serial run in such a boot.
    pub fn multipath(mut self, on: bool) -> Self {
        self.multipath = on;
        self
    }

    /// The host root under a tmpfs overlay, so the guest may write anywhere (the Kubernetes
    /// tier: containerd, the kubelet and etcd keep their state where they expect it). Writes stay
    /// in the guest's memory and go with it.
    pub fn writable_root(mut self, on: bool) -> Self {
        self.writable_root = on;
        self
    }

    /// Under TCG, one host thread for all vCPUs. Multi-threaded TCG has oopsed the guest kernel
    /// (int3 in kmalloc: a static key patched on one vCPU while another ran the code) when
    /// the Kubernetes tier's daemons start; one thread makes cross-vCPU code patching safe.
    pub fn tcg_single_thread(mut self, on: bool) -> Self {
        self.tcg_single_thread = on;
        self
    }

    /// What the guest's clock counts under TCG (`Clock`); KVM ignores it.
    pub fn clock(mut self, clock: Clock) -> Self {
        self.clock = clock;
        self
    }

    /// A NIC on QEMU's user network, QEMU in the namespace given (`Network`).
    pub fn network(mut self, net: Network) -> Self {
        self.network = Some(net);
        self
    }

    /// Where this run's files are (shared with the guest as `UBLKD_VM_RUN`).
    pub fn run_dir(&self) -> &Path {
        &self.run_dir
    }

    pub fn memory_mib(mut self, mib: u32) -> Self {
        self.memory_mib = mib;
        self
    }

    fn with_accel(mut self, accel: &str) -> Self {
        self.accel = Some(accel.to_owned());
        self
    }

    /// Boots the guest and runs `script` (POSIX sh) inside; `$UBLKD_VM_RUN` there names the
    /// writable run directory, shared with the host.
    ///
    /// A guest that dies before the command starts (an emulator flake: TCG has been seen to
    /// oops in early boot) is booted once more, and says so; the command never runs twice.
    pub fn run(self, script: &str) -> Result<RunResult> {
        let first = self.run_once(script)?;
        let started = first.console.iter().any(|l| l.contains(COMMAND_STARTED));
        if started || first.exit == Exit::Code(0) {
            return Ok(first);
        }
        eprintln!(
            "xtask: the guest died before running the command ({}); booting it again",
            first.exit
        );
        let rd = &self.run_dir;
        let _ = fs::rename(rd.join("console.log"), rd.join("console.boot-failure.log"));
        self.run_once(script)
    }

    fn run_once(&self, script: &str) -> Result<RunResult> {
        let accel = match &self.accel {
            Some(a) => a.clone(),
            None => choose_accel(&self.kernel)?,
        };
        let rd = &self.run_dir;
        fs::write(rd.join("cmd.sh"), script)?;
        let image = rd.join("nvme.img");
        fs::File::create(&image)?.set_len(NVME_BYTES)?;
        let qemu = apt::which("qemu-system-x86_64").context("qemu-system-x86_64 not found")?;
        let mut cmd = match &self.network {
            Some(net) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &net.netns]).arg(&qemu);
                c
            }
            None => Command::new(&qemu),
        };
        if let Some(net) = &self.network {
            let mut user = "user,id=net0,net=10.0.2.0/24".to_owned();
            for f in &net.forwards {
                user.push_str(",hostfwd=");
                user.push_str(f);
            }
            cmd.args(["-netdev", &user, "-device", "virtio-net-pci,netdev=net0"]);
        }
        cmd.args(["-nodefaults", "-display", "none", "-no-reboot"])
            .args(["-serial", "stdio", "-smp", "2", "-m"])
            .arg(format!("{}M", self.memory_mib));
        if accel == "kvm" {
            cmd.args(["-accel", "kvm", "-cpu", "host"]);
        } else {
            let cpu = std::env::var("UBLKD_VM_CPU").unwrap_or_else(|_| "max".into());
            cmd.args(tcg_args(self.tcg_single_thread, self.clock, &cpu));
        }
        cmd.arg("-kernel")
            .arg(&self.kernel.vmlinuz)
            .arg("-initrd")
            .arg(&self.kernel.initramfs)
            .arg("-append")
            .arg(format!(
                "console=ttyS0 loglevel=4 panic=-1 rdinit=/init nvme.poll_queues=2 ublkd.run={}{}{}",
                rd.display(),
                if self.writable_root {
                    " ublkd.overlay=1"
                } else {
                    ""
                },
                if self.host_tmp { " ublkd.hosttmp=1" } else { "" }
            ))
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
            .arg("-virtfs")
            .arg(format!(
                "local,path={},mount_tag=xfer,security_model=none",
                rd.display()
            ))
            .arg("-drive")
            .arg(format!(
                "file={},if=none,id=nvm,format=raw,cache=none,aio=io_uring,discard=unmap",
                image.display()
            ))
            .args([
                "-device",
                "nvme,serial=ublkd-nvme0,drive=nvm,max_ioqpairs=8",
            ])
            .args(self.multipath_args()?)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(fs::File::create(rd.join("qemu.stderr"))?);

        let started = Instant::now();
        let mut child = cmd.spawn().context("starting qemu")?;
        let stdout = child.stdout.take().context("qemu stdout")?;
        let console = Arc::new(Mutex::new(Vec::<String>::new()));
        let reader = {
            let console = Arc::clone(&console);
            let mut log = fs::File::create(rd.join("console.log"))?;
            let echo = self.echo;
            std::thread::spawn(move || {
                for line in BufReader::new(stdout).split(b'\n') {
                    let Ok(line) = line else { break };
                    let line = String::from_utf8_lossy(&line).trim_end().to_owned();
                    let _ = writeln!(log, "{line}");
                    if echo {
                        println!("  | {line}");
                    }
                    if let Ok(mut c) = console.lock() {
                        c.push(line);
                        if c.len() > CONSOLE_KEEP {
                            c.drain(..CONSOLE_KEEP / 2);
                        }
                    }
                }
            })
        };

        let deadline = started + Duration::from_secs(self.timeout);
        let mut timed_out = false;
        let status = loop {
            if let Some(status) = child.try_wait()? {
                break Some(status);
            }
            if Instant::now() >= deadline {
                timed_out = true;
                let _ = child.kill();
                let _ = child.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        let _ = reader.join();
        let wall = started.elapsed();
        let _ = fs::remove_file(&image);
        let console = console.lock().map(|c| c.clone()).unwrap_or_default();

        let rc = fs::read_to_string(rd.join("rc"))
            .ok()
            .and_then(|s| s.trim().parse::<i32>().ok())
            .or_else(|| {
                console.iter().rev().find_map(|l| {
                    l.split("UBLKD-VM-EXIT=")
                        .nth(1)
                        .and_then(|v| v.trim().parse().ok())
                })
            });
        // A panic counts until the guest reported its status; what the kernel does while it
        // powers off after that changes nothing the command did.
        let panicked = console
            .iter()
            .take_while(|l| !l.contains("UBLKD-VM-EXIT="))
            .any(|l| l.contains("Kernel panic"));
        let exit = match (rc, timed_out, panicked) {
            (_, _, true) => Exit::Panic,
            (Some(rc), _, false) => Exit::Code(rc),
            (None, true, false) => Exit::Timeout(self.timeout),
            (None, false, false) => {
                let stderr = fs::read_to_string(rd.join("qemu.stderr")).unwrap_or_default();
                Exit::NoStatus(format!(
                    "qemu {}; {}",
                    status.map_or("killed".into(), |s| s.to_string()),
                    stderr.trim()
                ))
            }
        };
        Ok(RunResult {
            exit,
            console,
            run_dir: self.run_dir.clone(),
            wall,
        })
    }
}

/// KVM when it is asked for or a probe boot works on this host, else TCG. The probe's answer is
/// cached per host kernel: a host whose KVM cannot run a stock kernel (PVM) fails the probe once.
impl Vm {
    fn multipath_args(&self) -> Result<Vec<String>> {
        if !self.multipath {
            return Ok(Vec::new());
        }
        let mut args = Vec::new();
        for (id, bytes) in [("mp1", MPATH_NS_BYTES), ("mp2", MPATH_NS_BYTES)] {
            let image = self.run_dir.join(format!("{id}.img"));
            fs::File::create(&image)?.set_len(bytes)?;
            args.push("-drive".to_owned());
            args.push(format!(
                "file={},if=none,id={id},format=raw,cache=none,aio=io_uring",
                image.display()
            ));
        }
        for dev in [
            "nvme-subsys,id=mpsub,nqn=ublkd-mpath",
            "nvme,serial=ublkd-mp,subsys=mpsub,id=mpc0,max_ioqpairs=4,mdts=5",
            "nvme,serial=ublkd-mp,subsys=mpsub,id=mpc1,max_ioqpairs=4,mdts=5",
            "nvme-ns,drive=mp1,nsid=1,bus=mpc1,shared=off,logical_block_size=4096,physical_block_size=4096",
            "nvme-ns,drive=mp2,nsid=2,shared=on",
        ] {
            args.push("-device".to_owned());
            args.push(dev.to_owned());
        }
        Ok(args)
    }
}

fn choose_accel(kernel: &Kernel) -> Result<String> {
    if let Ok(a) = std::env::var("UBLKD_VM_ACCEL") {
        return Ok(a);
    }
    if fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Ok("tcg".into());
    }
    let host = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let marker = kernel
        .cache
        .join(format!("kvm-probe-{}-{}", host.trim(), kernel.kver));
    if let Ok(a) = fs::read_to_string(&marker) {
        return Ok(a.trim().to_owned());
    }
    eprintln!("xtask: probing whether KVM can boot the guest kernel (once per host kernel)");
    let probe_dir = std::env::temp_dir().join(format!("ublkd-kvm-probe-{}", std::process::id()));
    fs::create_dir_all(&probe_dir)?;
    let probe = Vm::new(&probe_dir, kernel)?
        .timeout_secs(60)
        .with_accel("kvm")
        .run("exit 0")?;
    let _ = fs::remove_dir_all(&probe_dir);
    let accel = if probe.exit == Exit::Code(0) {
        "kvm"
    } else {
        "tcg"
    };
    eprintln!("xtask: KVM probe {}: using {accel}", probe.exit);
    fs::write(&marker, accel)?;
    Ok(accel.into())
}

/// Quotes `s` for a POSIX shell.
pub fn shell_quote(s: &str) -> String {
    if !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c))
    {
        return s.to_owned();
    }
    format!("'{}'", s.replace('\'', "'\\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_leaves_plain_words_and_quotes_the_rest() {
        assert_eq!(shell_quote("abc/d-e"), "abc/d-e");
        assert_eq!(shell_quote("a b"), "'a b'");
        assert_eq!(shell_quote("it's"), "'it'\\''s'");
        assert_eq!(shell_quote(""), "''");
    }

    #[test]
    fn instruction_clock_is_icount_on_one_thread() {
        let wall = tcg_args(false, Clock::Wall, "max");
        assert_eq!(wall, ["-accel", "tcg,thread=multi", "-cpu", "max"]);
        assert!(!wall.iter().any(|a| a == "-icount"));
        assert_eq!(tcg_args(true, Clock::Wall, "max")[1], "tcg,thread=single");
        let ins = tcg_args(false, Clock::Instructions, "max");
        assert_eq!(ins[1], "tcg,thread=single", "icount needs one TCG thread");
        let at = ins.iter().position(|a| a == "-icount").expect("-icount");
        assert_eq!(ins[at + 1], "shift=0,sleep=on");
    }
}
