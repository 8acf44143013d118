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
/// The size of `Vm::state_disk`'s file (sparse).
const STATE_DISK_BYTES: u64 = 4 << 30;
/// Each namespace of the multipath subsystem (`Vm::multipath`).
const MPATH_NS_BYTES: u64 = 256 << 20;
/// Each of the multipath boot's two plain controllers whose names a test swaps (`Vm::multipath`).
const SWAP_NS_BYTES: u64 = 64 << 20;
/// Those controllers: serial (so subsystem NQN `nqn.2019-08.org.qemu:SERIAL`), the drive's id and
/// the namespace's EUI-64 (QEMU since 7.1 gives none unless told: every namespace would then be
/// known by its NQN and NSID alone).
const SWAP_DRIVES: [(&str, &str, u64); 2] = [
    ("ublkd-swapA", "swa", 0x5542_4c4b_4400_000a),
    ("ublkd-swapB", "swb", 0x5542_4c4b_4400_000b),
];
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

/// One guest to boot, set up through its public fields before `run`.
#[derive(Debug, Clone)]
pub struct Vm {
    kernel: Kernel,
    /// Where this run's files are (shared with the guest as `UBLKD_VM_RUN`).
    pub run_dir: PathBuf,
    /// The workspace or the run directory is under /tmp (CI's fresh clone, whose `target` may
    /// link elsewhere): the guest keeps the host's /tmp and makes its scratch under /run.
    host_tmp: bool,
    /// Seconds before the guest is killed.
    pub timeout: u64,
    /// The console echoed as it comes (also with `UBLKD_VM_VERBOSE=1`).
    pub echo: bool,
    accel: Option<String>,
    /// A second NVMe subsystem with two controllers, the topology of native multipath:
    /// namespace 1 private to the second controller (its char device is named by the
    /// controller, its disk by the subsystem) with 4 KiB blocks, and namespace 2 shared by both
    /// (one multipath head). The first controller and its `ng0n1` stay as in every boot, but
    /// controller numbering is then racy (asynchronous probe), so only tests that find their
    /// devices by serial run in such a boot. Two more plain controllers come with it
    /// (`SWAP_DRIVES`: serials `ublkd-swapA`, `ublkd-swapB`, one 64 MiB namespace each with its
    /// own EUI-64), whose names a test swaps by unbinding and binding them.
    pub multipath: bool,
    /// The host root under a tmpfs overlay, so the guest may write anywhere (the Kubernetes
    /// tier: containerd, the kubelet and etcd keep their state where they expect it). Writes stay
    /// in the guest's memory and go with it.
    pub writable_root: bool,
    /// A disk that outlives the guest (the Kubernetes tier's joined node, which is powered off
    /// and on again): `state.img` in the run directory, made once (sparse, `STATE_DISK_BYTES`)
    /// and kept by every boot of this run directory; the guest's only virtio disk, /dev/vda.
    pub state_disk: bool,
    pub memory_mib: u32,
    /// Its vCPUs.
    pub cpus: u32,
    /// What the guest's clock counts under TCG (`Clock`); KVM ignores it.
    pub clock: Clock,
    /// A NIC on QEMU's user network, QEMU in the namespace given (`Network`).
    pub network: Option<Network>,
}

/// What the guest's clock counts under TCG (the measurements: docs/performance.md, "The wall
/// clock against the instruction clock" and "Huge pages under the instruction clock").
///
/// `Wall`: the host's real time, one host thread per vCPU; a timing carries the host's load
/// (the same fio job moves by ±25 % from one run to the next).
///
/// `Instructions`: QEMU's `-icount shift=0,sleep=on`, one guest nanosecond per instruction, all
/// vCPUs in one host thread: the work per I/O, repeatable within 0.3 %, but only for work on the
/// vCPUs (emulated devices work in host time: file and NVMe cases swing by factors of 10), blind
/// to how work spreads over CPUs, and about 5 host seconds per busy guest second. `sleep=on`:
/// an idle guest waits for the devices in real time instead of jumping to the next timer. The
/// guest boots with transparent huge pages off under it: a huge page under fio's buffers, there
/// or not by chance, moved a 128 KiB copy-path job by 6 %. Under the wall clock they are
/// `madvise`: with `always`, once free memory was contiguous again, every new process cleared
/// huge pages at TCG's pace (a guest's 1,000 forks 44 s → 133 s; docs/performance.md).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Clock {
    #[default]
    Wall,
    Instructions,
}

/// QEMU's accelerator arguments for TCG: one host thread per vCPU (with one thread for both,
/// the Kubernetes tier's kubelet and containerd kept it busy and a pod took minutes to start),
/// but one for all of them under the instruction clock, which needs it.
fn tcg_args(clock: Clock, cpu: &str) -> Vec<String> {
    let (thread, icount) = match clock {
        Clock::Wall => ("multi", &[][..]),
        Clock::Instructions => ("single", &["-icount", "shift=0,sleep=on"][..]),
    };
    let args = ["-accel", &format!("tcg,thread={thread}"), "-cpu", cpu];
    args.iter().chain(icount).map(|a| a.to_string()).collect()
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
        let run_dir = ws.join(format!("target/vm/run-{}-{seq}", std::process::id()));
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
            state_disk: false,
            memory_mib: 4096,
            cpus: 2,
            clock: Clock::Wall,
            network: None,
        })
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
        let mut cmd = Command::new(&qemu);
        if let Some(net) = &self.network {
            cmd = Command::new("ip");
            cmd.args(["netns", "exec", &net.netns]).arg(&qemu);
            let mut user = "user,id=net0,net=10.0.2.0/24".to_owned();
            for f in &net.forwards {
                user.push_str(",hostfwd=");
                user.push_str(f);
            }
            cmd.args(["-netdev", &user, "-device", "virtio-net-pci,netdev=net0"]);
        }
        cmd.args(["-nodefaults", "-display", "none", "-no-reboot"])
            .args(["-serial", "stdio", "-smp", &self.cpus.to_string(), "-m"])
            .arg(format!("{}M", self.memory_mib));
        if accel == "kvm" {
            cmd.args(["-accel", "kvm", "-cpu", "host"]);
        } else {
            let cpu = std::env::var("UBLKD_VM_CPU").unwrap_or_else(|_| "max".into());
            cmd.args(tcg_args(self.clock, &cpu));
        }
        let icount = self.clock == Clock::Instructions;
        let flags = [
            (self.writable_root, " ublkd.overlay=1"),
            (self.host_tmp, " ublkd.hosttmp=1"),
        ];
        let flags: String = flags.iter().filter(|f| f.0).map(|f| f.1).collect();
        let thp = if icount { "never" } else { "madvise" };
        // Two polled queues where there are two CPUs: the driver refuses more than the CPUs.
        let polled = self.cpus.min(2);
        let (run, img) = (rd.display(), image.display());
        let xfer = format!("local,path={run},mount_tag=xfer,security_model=none");
        let nvme =
            format!("file={img},if=none,id=nvm,format=raw,cache=none,aio=io_uring,discard=unmap");
        cmd.arg("-kernel")
            .arg(&self.kernel.vmlinuz)
            .arg("-initrd")
            .arg(&self.kernel.initramfs)
            .arg("-append")
            .arg(format!(
                "console=ttyS0 loglevel=4 panic=-1 rdinit=/init nvme.poll_queues={polled} ublkd.run={run}{flags} transparent_hugepage={thp}"
            ))
            .arg("-virtfs")
            .arg("local,path=/,mount_tag=hostroot,security_model=none,readonly=on,multidevs=remap")
            .args(["-virtfs", &xfer, "-drive", &nvme])
            .arg("-device")
            .arg("nvme,serial=ublkd-nvme0,drive=nvm,max_ioqpairs=8")
            .args(self.multipath_args()?)
            .args(self.state_disk_args()?)
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

    /// QEMU's arguments for the multipath subsystem and the two swap drives (their images made
    /// in the run directory), or none.
    /// QEMU's arguments for `state_disk`: the disk, made on the first boot only.
    fn state_disk_args(&self) -> Result<Vec<String>> {
        if !self.state_disk {
            return Ok(Vec::new());
        }
        let file = self.run_dir.join("state.img");
        if !file.exists() {
            fs::File::create(&file)?.set_len(STATE_DISK_BYTES)?;
        }
        let drive = format!(
            "file={},if=virtio,format=raw,cache=none,aio=io_uring,discard=unmap",
            file.display()
        );
        Ok(vec!["-drive".into(), drive])
    }

    fn multipath_args(&self) -> Result<Vec<String>> {
        if !self.multipath {
            return Ok(Vec::new());
        }
        let mut args = Vec::new();
        // A drive `id` of `bytes` on a sparse image in the run directory, then `devices`.
        let mut add = |id: &str, bytes: u64, devices: &[String]| -> Result<()> {
            let image = self.run_dir.join(format!("{id}.img"));
            fs::File::create(&image)?.set_len(bytes)?;
            let f = image.display();
            let drive = format!("file={f},if=none,id={id},format=raw,cache=none,aio=io_uring");
            args.extend(["-drive".to_owned(), drive]);
            args.extend(
                devices
                    .iter()
                    .flat_map(|d| ["-device".to_owned(), d.clone()]),
            );
            Ok(())
        };
        add("mp1", MPATH_NS_BYTES, &[])?;
        let subsystem = [
            "nvme-subsys,id=mpsub,nqn=ublkd-mpath",
            "nvme,serial=ublkd-mp,subsys=mpsub,id=mpc0,max_ioqpairs=4,mdts=5",
            "nvme,serial=ublkd-mp,subsys=mpsub,id=mpc1,max_ioqpairs=4,mdts=5",
            "nvme-ns,drive=mp1,nsid=1,bus=mpc1,shared=off,logical_block_size=4096,physical_block_size=4096",
            "nvme-ns,drive=mp2,nsid=2,shared=on",
        ];
        add("mp2", MPATH_NS_BYTES, &subsystem.map(str::to_owned))?;
        for (serial, id, eui64) in SWAP_DRIVES {
            let controller = format!("nvme,serial={serial},id={id}c,max_ioqpairs=4");
            let ns = format!("nvme-ns,drive={id},bus={id}c,nsid=1,shared=off,eui64={eui64:#x}");
            add(id, SWAP_NS_BYTES, &[controller, ns])?;
        }
        Ok(args)
    }
}

/// KVM when it is asked for or a probe boot works on this host, else TCG. The probe's answer is
/// cached per host kernel: a host whose KVM cannot run a stock kernel (PVM) fails the probe once.
fn choose_accel(kernel: &Kernel) -> Result<String> {
    if let Ok(a) = std::env::var("UBLKD_VM_ACCEL") {
        return Ok(a);
    }
    let kvm = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm");
    if kvm.is_err() {
        return Ok("tcg".into());
    }
    let host = fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let marker = format!("kvm-probe-{}-{}", host.trim(), kernel.kver);
    let marker = kernel.cache.join(marker);
    if let Ok(a) = fs::read_to_string(&marker) {
        return Ok(a.trim().to_owned());
    }
    eprintln!("xtask: probing whether KVM can boot the guest kernel (once per host kernel)");
    let probe_dir = std::env::temp_dir().join(format!("ublkd-kvm-probe-{}", std::process::id()));
    fs::create_dir_all(&probe_dir)?;
    let mut probe = Vm::new(&probe_dir, kernel)?;
    (probe.timeout, probe.accel) = (60, Some("kvm".into()));
    let probe = probe.run("exit 0")?;
    let _ = fs::remove_dir_all(&probe_dir);
    let accel = match probe.exit {
        Exit::Code(0) => "kvm",
        _ => "tcg",
    };
    eprintln!("xtask: KVM probe {}: using {accel}", probe.exit);
    fs::write(&marker, accel)?;
    Ok(accel.into())
}

/// `path` quoted for a POSIX shell.
pub fn quoted(path: &Path) -> String {
    shell_quote(&path.to_string_lossy())
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
        let wall = tcg_args(Clock::Wall, "max");
        assert_eq!(wall, ["-accel", "tcg,thread=multi", "-cpu", "max"]);
        assert!(!wall.iter().any(|a| a == "-icount"));
        let ins = tcg_args(Clock::Instructions, "max");
        assert_eq!(ins[1], "tcg,thread=single", "icount needs one TCG thread");
        let at = ins.iter().position(|a| a == "-icount").expect("-icount");
        assert_eq!(ins[at + 1], "shift=0,sleep=on");
    }
}
