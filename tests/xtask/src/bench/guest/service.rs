//! ublkd as a node service: the control plane driven by `ublkctl` (creates, deletes, a scrape,
//! round trips to busy workers), and `ublkd-csi` in front of it driven as the provisioner and
//! the kubelet would.

use super::super::cases::{
    CONTROL_DEPTH, CONTROL_LOAD_CALLS, CONTROL_RUN, CONTROL_SCRAPES, CONTROL_SIZE, CONTROL_VOLUMES,
    CSI_PARALLEL, CSI_RUN, CSI_VOLUMES,
};
use super::super::results::{first_of, Case, Control, Csi, Measured, Outcome};
use super::fio::{job, report, DIRECT};
use super::proc::{log_file, output, signal, tail_of, timed, vmrss_kib, wait_secs, Guest, Node};
use std::fs;
use std::io::{self, Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The control plane: the daemon's RSS with no volumes and with `CONTROL_VOLUMES` idle null
/// volumes; each create-volume and delete-volume timed end to end, ublkctl's start-up
/// included; scrapes of /metrics with every volume present; and creates and deletes again
/// while fio keeps the workers of the first two volumes busy.
pub fn control_case(g: &Guest) -> Case {
    let n = CONTROL_VOLUMES;
    note!("{CONTROL_RUN}: ublkd --config, then {n} volumes through ublkctl");
    Node::run(g, CONTROL_RUN, |node| Ok(Measured::Control(control(node))))
}

fn control(node: &mut Node) -> Control {
    let rss = |node: &Node| vmrss_kib(node.pid().ok_or("ublkd is not running")?);
    std::thread::sleep(Duration::from_secs(1));
    let rss_empty_kib = rss(node);
    let err = node.d.join("create.err");
    // Null volumes of one queue (the server's default).
    let volume = format!("--size {CONTROL_SIZE} --backend null --depth {CONTROL_DEPTH}");
    let mut created = Vec::new();
    let mut create = |k| {
        let name = format!("v{k:03}");
        let (dev, ms) = node.create(&name, &volume, &err)?;
        created.push((name, dev));
        Ok(ms)
    };
    let create_ms: Outcome<Vec<f64>> = (1..=CONTROL_VOLUMES).map(&mut create).collect();
    note!("{CONTROL_RUN}: {} volumes created", created.len());
    std::thread::sleep(Duration::from_secs(1));
    let not_all = |e: &String| format!("not all {CONTROL_VOLUMES} volumes were created: {e}");
    let rss_full_kib = create_ms.as_ref().map_err(not_all).and_then(|_| rss(node));
    let scrape_ms = scrape(&node.metrics);
    let load = under_load(node, &created, &volume);

    let err = node.d.join("delete.err");
    let (mut delete_ms, mut problems) = (Vec::new(), Vec::new());
    for (name, dev) in &created {
        match node.delete(name, &err) {
            Ok(ms) => delete_ms.push(ms),
            Err(e) => problems.push(e),
        }
        if dev.exists() {
            let dev = dev.display();
            problems.push(format!(
                "{dev} still exists after delete-volume {name} returned"
            ));
        }
    }
    note!("{CONTROL_RUN}: {} volumes deleted", delete_ms.len());
    let delete_ms = match (&create_ms, first_of(&problems)) {
        (Err(e), _) => Err(not_all(e)),
        (_, Some(e)) => Err(e),
        _ => Ok(delete_ms),
    };
    Control {
        rss_empty_kib,
        rss_full_kib,
        create_ms,
        delete_ms,
        scrape_ms,
        load_create_ms: load.clone().map(|l| l.0),
        load_delete_ms: load.clone().map(|l| l.1),
        load_iops: load.map(|l| l.2),
    }
}

/// GETs of /metrics at `addr`, each timed inside this process (ms).
fn scrape(addr: &str) -> Outcome<Vec<f64>> {
    let get = || -> io::Result<String> {
        let mut c = TcpStream::connect(addr)?;
        let mut body = Vec::new();
        c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
        c.read_to_end(&mut body)?;
        let head = body.split(|&b| b == b'\r').next().unwrap_or_default();
        Ok(String::from_utf8_lossy(head).into_owned())
    };
    let timed_get = |_| match timed(get) {
        (Ok(head), ms) if head.starts_with("HTTP/1.") && head.contains(" 200 ") => Ok(ms),
        (Ok(head), _) => Err(format!("GET /metrics did not answer 200: {head}")),
        (Err(e), _) => Err(format!("GET /metrics: {e}")),
    };
    (0..CONTROL_SCRAPES).map(timed_get).collect()
}

/// Round trips to busy workers: a create hands the new queue to a worker and waits for its
/// answer (the worker reads commands between completions), a delete tears the queue down
/// through it. Timed while fio keeps the workers busy on the first two volumes: (creates ms,
/// deletes ms, the IOPS of the load).
fn under_load(
    node: &mut Node,
    created: &[(String, PathBuf)],
    volume: &str,
) -> Outcome<(Vec<f64>, Vec<f64>, f64)> {
    let [(_, a), (_, b), ..] = created else {
        return Err("fewer than 2 volumes to load".into());
    };
    let (json, log) = (node.d.join("load.json"), node.d.join("load.log"));
    let mut fio = Command::new("fio")
        .args(DIRECT.split_whitespace())
        .args(job("randread", "4k", 32, 300).split_whitespace())
        .arg("--output-format=json")
        .arg(format!("--output={}", json.display()))
        .args(["--name=load0", &format!("--filename={}", a.display())])
        .args(["--name=load1", &format!("--filename={}", b.display())])
        .stdin(Stdio::null())
        .stdout(log_file(&log))
        .stderr(log_file(&log))
        .spawn()
        .map_err(|e| format!("could not start fio: {e}"))?;
    std::thread::sleep(Duration::from_secs(2));
    let calls = load_calls(node, &mut fio, &log, volume);
    // SIGINT: fio stops and writes its report.
    signal(fio.id(), "INT");
    if let Err(e) = fio.wait() {
        note!("waiting for the fio load: {e}");
    }
    let (creates, deletes) = calls?;
    let n = creates.len();
    note!("{CONTROL_RUN}: {n} creates and deletes timed under load");
    let mut iops = 0.0;
    for job in report(&json)?.jobs {
        if job.error != 0 {
            return Err(format!("the fio load reported error {}", job.error));
        }
        iops += job.read.iops + job.write.iops;
    }
    match iops > 0.0 {
        true => Ok((creates, deletes, iops)),
        false => Err("the fio load did no I/O".into()),
    }
}

/// `CONTROL_LOAD_CALLS` creates and deletes, timed while `fio` runs.
fn load_calls(
    node: &mut Node,
    fio: &mut Child,
    log: &Path,
    volume: &str,
) -> Outcome<(Vec<f64>, Vec<f64>)> {
    let err = node.d.join("load.err");
    let (mut creates, mut deletes) = (Vec::new(), Vec::new());
    for k in 0..=CONTROL_LOAD_CALLS {
        if !matches!(fio.try_wait(), Ok(None)) {
            let tail = tail_of(log);
            return Err(format!(
                "the fio load ended before the timed calls did: {tail}"
            ));
        }
        if k == CONTROL_LOAD_CALLS {
            break;
        }
        let name = format!("l{:03}", k + 1);
        let under_load = |e| format!("{e} (under load)");
        creates.push(node.create(&name, volume, &err).map_err(under_load)?.1);
        deletes.push(node.delete(&name, &err).map_err(under_load)?);
    }
    Ok((creates, deletes))
}

/// The CSI driver of the CSI run and what it needs: its binary (copied to tmpfs, so that
/// process start-up stays off the 9p root), socket and kubelet directory.
#[derive(Debug)]
struct Driver {
    bin: PathBuf,
    sock: PathBuf,
    kubelet: PathBuf,
    roots: PathBuf,
    /// Volumes made and not yet torn down.
    made: Vec<String>,
}

impl Driver {
    /// `ublkd-csi ctl ARGS` (words) against the driver; stderr goes to `err`.
    fn command(&self, args: &str, err: &Path) -> Command {
        let mut c = Command::new(&self.bin);
        c.arg("ctl")
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", self.sock.display()))
            .args(args.split_whitespace())
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(err));
        c
    }

    fn ctl(&self, args: &str, err: &Path) -> Outcome<()> {
        output(&mut self.command(args, err), err).map(drop)
    }

    /// A volume's staging path and its pod's target path.
    fn paths(&self, name: &str) -> (String, String) {
        let k = self.kubelet.display();
        (format!("{k}/staging/{name}"), format!("{k}/pods/p/{name}"))
    }

    fn create(&mut self, name: &str, size: u64, fs: Option<&str>, err: &Path) -> Outcome<()> {
        self.made.push(name.to_owned());
        let fs = fs.map_or(String::new(), |f| format!("--fs {f} --param fsType={f}"));
        let root = self.roots.display();
        let params = format!("--param backend=file --param root={root} {fs}");
        self.ctl(&format!("create {name} --size {size} {params}"), err)
    }

    /// CreateVolume, NodeStageVolume and NodePublishVolume, as the provisioner and the kubelet
    /// make them for a pod's first start.
    fn up(&mut self, name: &str, size: u64, fs: &str, err: &Path) -> Outcome<()> {
        self.create(name, size, Some(fs), err)?;
        let (staging, target) = self.paths(name);
        self.ctl(&format!("stage {name} {staging} --fs {fs}"), err)?;
        self.ctl(&format!("publish {name} {staging} {target} --fs {fs}"), err)
    }

    /// Unpublishes, unstages and deletes every volume made (each a no-op where there is
    /// nothing to undo); failures go to `problems`.
    fn teardown(&mut self, d: &Path, problems: &mut Vec<String>) {
        let err = d.join("teardown.err");
        for name in std::mem::take(&mut self.made) {
            let (staging, target) = self.paths(&name);
            let down = self
                .ctl(&format!("unpublish {name} {target}"), &err)
                .and_then(|()| self.ctl(&format!("unstage {name} {staging}"), &err))
                .and_then(|()| self.ctl(&format!("delete {name}"), &err));
            if let Err(e) = down {
                problems.push(format!("tearing down {name} failed: {e}"));
            }
        }
    }
}

/// ublkd with ublkd-csi in front of it: for ext4 and xfs, `CSI_VOLUMES` file volumes each timed
/// from CreateVolume to a published, mounted file system, each torn down before the next (the
/// node's capacity is a tmpfs); then `CSI_PARALLEL` fresh ext4 volumes staged one at a time,
/// torn down, and as many staged all at once.
pub fn csi_case(g: &Guest) -> Case {
    note!(
        "{CSI_RUN}: {CSI_VOLUMES} volumes per file system to a mounted pod path; \
         {CSI_PARALLEL} stages in sequence, {CSI_PARALLEL} in parallel"
    );
    Node::run(g, CSI_RUN, |node| {
        let src = g.input.csi.as_ref();
        let src = src.map_err(|e| format!("no ublkd-csi binary: {e}"))?;
        // In the node's own directory: the tmpfs, and never a path the node uses.
        let mut drv = Driver {
            bin: node.c.join("ublkd-csi.bin"),
            sock: node.c.join("csi.sock"),
            kubelet: node.c.join("kubelet"),
            roots: node.c.join("roots"),
            made: Vec::new(),
        };
        fs::copy(src, &drv.bin)
            .and_then(|_| fs::create_dir_all(&drv.kubelet))
            .map_err(|e| format!("preparing ublkd-csi in {}: {e}", node.c.display()))?;
        let mut driver = Command::new(&drv.bin)
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", drv.sock.display()))
            .arg("--ublkd")
            .arg(format!("unix://{}", node.sock().display()))
            .args(["--node-id", "bench", "--kubelet-dir"])
            .arg(&drv.kubelet)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(&node.d.join("csi.log")))
            .spawn()
            .map_err(|e| format!("could not start ublkd-csi: {e}"))?;
        wait_secs(10, || drv.sock.exists());
        let measured = csi(&mut drv, &node.d, &mut node.problems);
        drv.teardown(&node.d, &mut node.problems);
        signal(driver.id(), "TERM");
        if let Err(e) = driver.wait() {
            note!("waiting for ublkd-csi: {e}");
        }
        measured.map(Measured::Csi)
    })
}

fn csi(drv: &mut Driver, d: &Path, problems: &mut Vec<String>) -> Outcome<Csi> {
    let err = d.join("csi.err");
    let mut mounted = [Vec::new(), Vec::new()];
    for (fs, times) in ["ext4", "xfs"].into_iter().zip(&mut mounted) {
        // xfs refuses file systems under 300 MB.
        let size: u64 = if fs == "xfs" { 320 << 20 } else { 64 << 20 };
        for k in 1..=CSI_VOLUMES {
            let name = format!("pvc-{fs}-{k:03}");
            let (r, ms) = timed(|| drv.up(&name, size, fs, &err));
            drv.teardown(d, problems);
            r.map_err(|e| format!("{name}: {e}"))?;
            times.push(ms);
        }
    }
    note!("{CSI_RUN}: {} volumes timed to mounted", 2 * CSI_VOLUMES);
    let mut stages = [0.0; 2];
    for (parallel, total) in [false, true].into_iter().zip(&mut stages) {
        let set = if parallel { "par" } else { "seq" };
        let names: Vec<String> = (1..=CSI_PARALLEL)
            .map(|k| format!("pvc-{set}-{k:03}"))
            .collect();
        for name in &names {
            let made = drv.create(name, 64 << 20, None, &err);
            made.map_err(|e| format!("{name}: {e}"))?;
        }
        let t0 = Instant::now();
        let stage = |n: &String| {
            drv.command(&format!("stage {n} {}", drv.paths(n).0), &err)
                .spawn()
        };
        let wait = |(n, c): (&String, io::Result<Child>)| match c.and_then(|mut c| c.wait()) {
            Ok(s) if s.success() => None,
            Ok(_) => Some(format!("stage {n} failed: {}", tail_of(&err))),
            Err(e) => Some(format!("could not start the stage of {n}: {e}")),
        };
        let failures: Vec<String> = match parallel {
            true => {
                let children: Vec<_> = names.iter().map(|n| (n, stage(n))).collect();
                children.into_iter().filter_map(wait).collect()
            }
            false => names.iter().filter_map(|n| wait((n, stage(n)))).collect(),
        };
        *total = t0.elapsed().as_secs_f64() * 1e3;
        drv.teardown(d, problems);
        if let Some(e) = first_of(&failures) {
            return Err(e);
        }
    }
    let [ext4_ms, xfs_ms] = mounted;
    Ok(Csi {
        ext4_ms,
        xfs_ms,
        stage_seq_ms: stages[0],
        stage_par_ms: stages[1],
    })
}
