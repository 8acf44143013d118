//! ublkd as a node service: the control plane driven by `ublkctl` (creates, deletes, a scrape,
//! round trips to busy workers), and `ublkd-csi` in front of it driven as the provisioner and
//! the kubelet would.

use super::super::cases::{
    CONTROL_DEPTH, CONTROL_LOAD_CALLS, CONTROL_METRICS, CONTROL_RUN, CONTROL_SIZE, CONTROL_VOLUMES,
    CSI_METRICS, CSI_PARALLEL, CSI_RUN, CSI_VOLUMES,
};
use super::proc::{
    append, log_file, note, put, signal, tail_of, Engine, Guest, Node, RANDREAD_QD32,
};
use std::fs;
use std::io::{Read as _, Write as _};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Nanoseconds `f` took, with its result.
fn timed<T>(f: impl FnOnce() -> T) -> (T, u128) {
    let t0 = Instant::now();
    let r = f();
    (r, t0.elapsed().as_nanos())
}

/// The control plane: the daemon's /proc status with no volumes (`status.0`) and with
/// `CONTROL_VOLUMES` idle null volumes (`status.full`); each create-volume (`create.ns`: NAME
/// DEVICE NS) and delete-volume (`delete.ns`: NAME NS) timed end to end, ublkctl's start-up
/// included; a scrape of /metrics with every volume present (`scrape.ns`); and creates and
/// deletes again while fio keeps the workers of the first two volumes busy (`load_create.ns`,
/// `load_delete.ns`; `load.json`: fio's report of the load).
pub fn control_case(g: &Guest) {
    let run = CONTROL_RUN;
    let Some(mut node) = Node::new(g, run, CONTROL_METRICS) else {
        return;
    };
    let d = node.d.clone();
    note(&format!(
        "{run}: ublkd --config, then {CONTROL_VOLUMES} volumes through ublkctl"
    ));
    node.spawn();
    if !node.wait_up(g, run) {
        return;
    }
    std::thread::sleep(Duration::from_secs(1));
    let status = |name: &str, pid: Option<u32>| {
        if let Some(s) = pid.and_then(|p| fs::read_to_string(format!("/proc/{p}/status")).ok()) {
            put(&d.join(name), &s);
        }
    };
    status("status.0", node.pid());

    let err = d.join("create.err");
    let mut created: Vec<(String, String)> = Vec::new();
    let mut lines = String::new();
    for k in 1..=CONTROL_VOLUMES {
        let name = format!("v{k:03}");
        let depth = CONTROL_DEPTH.to_string();
        let args = [
            "create-volume",
            &name,
            "--size",
            CONTROL_SIZE,
            "--backend",
            "null",
            "--depth",
            &depth,
        ];
        let (r, ns) = timed(|| node.ctl(&args, &err));
        let dev = match r {
            Ok(dev) => dev,
            Err(e) => {
                put(
                    &d.join("create_error"),
                    &format!("create-volume {name} failed {e}\n"),
                );
                break;
            }
        };
        // Created: deleted below, whatever else goes wrong.
        let shown = if dev.is_empty() { "-" } else { dev.as_str() };
        lines.push_str(&format!("{name} {shown} {ns}\n"));
        created.push((name.clone(), dev.clone()));
        if !super::proc::is_blk(Path::new(&dev)) {
            put(
                &d.join("create_error"),
                &format!("create-volume {name} returned {shown}, which is no block device\n"),
            );
            break;
        }
    }
    put(&d.join("create.ns"), &lines);
    note(&format!("{run}: {} volumes created", created.len()));
    std::thread::sleep(Duration::from_secs(1));
    status("status.full", node.pid());
    scrape(&d, CONTROL_METRICS);
    under_load(g, &node, &created);

    let mut deleted = String::new();
    let err = d.join("delete.err");
    for (name, dev) in &created {
        let (r, ns) = timed(|| node.ctl(&["delete-volume", name], &err));
        if let Err(e) = r {
            append(
                &d.join("delete_error"),
                &format!("delete-volume {name} failed {e}"),
            );
            continue;
        }
        deleted.push_str(&format!("{name} {ns}\n"));
        if Path::new(dev).exists() {
            append(
                &d.join("delete_error"),
                &format!("{dev} still exists after delete-volume {name} returned"),
            );
        }
    }
    put(&d.join("delete.ns"), &deleted);
    note(&format!(
        "{run}: {} volumes deleted",
        deleted.lines().count()
    ));
    node.stop();
}

/// Ten GETs of /metrics at `addr`, each timed inside this process (`scrape.ns`: one NS per
/// line); a failure goes to `scrape_error`.
fn scrape(d: &Path, addr: &str) {
    let mut lines = String::new();
    for _ in 0..10 {
        let t0 = Instant::now();
        let got = TcpStream::connect(addr).and_then(|mut c| {
            c.write_all(b"GET /metrics HTTP/1.0\r\n\r\n")?;
            let mut body = Vec::new();
            c.read_to_end(&mut body)?;
            Ok(body)
        });
        let ns = t0.elapsed().as_nanos();
        match got {
            Ok(body) => {
                let head = body.split(|&b| b == b'\r').next().unwrap_or_default();
                let head = String::from_utf8_lossy(head);
                if !head.starts_with("HTTP/1.") || !head.contains(" 200 ") {
                    put(
                        &d.join("scrape_error"),
                        &format!("GET /metrics did not answer 200: {head}\n"),
                    );
                    break;
                }
                lines.push_str(&format!("{ns}\n"));
            }
            Err(e) => {
                put(&d.join("scrape_error"), &format!("GET /metrics: {e}\n"));
                break;
            }
        }
    }
    put(&d.join("scrape.ns"), &lines);
}

/// Round trips to busy workers: a create hands the new queue to a worker and waits for its
/// answer (the worker reads commands between completions), a delete tears the queue down
/// through it. Timed while fio keeps the workers busy on the first two volumes.
fn under_load(g: &Guest, node: &Node, created: &[(String, String)]) {
    let d = &node.d;
    let [(_, a), (_, b), ..] = created else {
        put(&d.join("load_error"), "fewer than 2 volumes to load\n");
        return;
    };
    let mut fio = Command::new("fio");
    fio.args(Engine::Direct.args())
        .args(RANDREAD_QD32)
        .args(["--runtime=300", "--output-format=json"])
        .arg(format!("--output={}", d.join("load.json").display()))
        .args(["--name=load0", &format!("--filename={a}")])
        .args(["--name=load1", &format!("--filename={b}")])
        .stdin(Stdio::null())
        .stdout(log_file(&d.join("load.log")))
        .stderr(log_file(&d.join("load.log")));
    let mut fio = match fio.spawn() {
        Ok(c) => c,
        Err(e) => {
            put(
                &d.join("load_error"),
                &format!("could not start fio: {e}\n"),
            );
            return;
        }
    };
    std::thread::sleep(Duration::from_secs(2));
    let err = d.join("load.err");
    let (mut creates, mut deletes) = (String::new(), String::new());
    let mut failed = false;
    for k in 1..=CONTROL_LOAD_CALLS {
        if !matches!(fio.try_wait(), Ok(None)) {
            break;
        }
        let name = format!("l{k:03}");
        let args = [
            "create-volume",
            &name,
            "--size",
            "64MiB",
            "--backend",
            "null",
            "--depth",
            "32",
        ];
        let (r, c_ns) = timed(|| node.ctl(&args, &err));
        if let Err(e) = r {
            put(
                &d.join("load_error"),
                &format!("create-volume {name} failed under load {e}\n"),
            );
            failed = true;
            break;
        }
        let (r, d_ns) = timed(|| node.ctl(&["delete-volume", &name], &err));
        if let Err(e) = r {
            put(
                &d.join("load_error"),
                &format!("delete-volume {name} failed under load {e}\n"),
            );
            failed = true;
            break;
        }
        creates.push_str(&format!("{name} {c_ns}\n"));
        deletes.push_str(&format!("{name} {d_ns}\n"));
    }
    put(&d.join("load_create.ns"), &creates);
    put(&d.join("load_delete.ns"), &deletes);
    if !failed && !matches!(fio.try_wait(), Ok(None)) {
        put(
            &d.join("load_error"),
            &format!(
                "the fio load ended before the timed calls did: {}\n",
                tail_of(&d.join("load.log"))
            ),
        );
    }
    // SIGINT: fio stops and writes its report.
    signal(fio.id(), "INT");
    if let Err(e) = fio.wait() {
        note(&format!("waiting for the fio load: {e}"));
    }
    note(&format!(
        "{CONTROL_RUN}: {} creates and deletes timed under load (runtime {} s per job elsewhere)",
        creates.lines().count(),
        g.runtime
    ));
}

/// The CSI driver of the CSI run and what it needs: its binary (copied to tmpfs, so that
/// process start-up stays off the 9p root), socket and kubelet directory.
struct Csi {
    bin: PathBuf,
    sock: PathBuf,
    kubelet: PathBuf,
    roots: PathBuf,
    /// Volumes made and not yet torn down.
    made: Vec<String>,
}

impl Csi {
    /// `ublkd-csi ctl ARGS` against the driver; stderr goes to `err`.
    fn ctl(&self, args: &[&str], err: &Path) -> Result<(), String> {
        let ok = Command::new(&self.bin)
            .arg("ctl")
            .arg("--csi-endpoint")
            .arg(format!("unix://{}", self.sock.display()))
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log_file(err))
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            Ok(())
        } else {
            Err(tail_of(err))
        }
    }

    fn staging(&self, name: &str) -> String {
        self.kubelet
            .join("staging")
            .join(name)
            .display()
            .to_string()
    }

    fn target(&self, name: &str) -> String {
        self.kubelet.join("pods/p").join(name).display().to_string()
    }

    fn create(
        &mut self,
        name: &str,
        size: u64,
        fs: Option<&str>,
        err: &Path,
    ) -> Result<(), String> {
        self.made.push(name.to_owned());
        let size = size.to_string();
        let root = format!("root={}", self.roots.display());
        let mut args = vec!["create", name, "--size", &size];
        let fs_param = fs.map(|f| format!("fsType={f}"));
        if let Some(f) = fs {
            args.extend(["--fs", f]);
        }
        args.extend(["--param", "backend=file", "--param", &root]);
        if let Some(p) = &fs_param {
            args.extend(["--param", p]);
        }
        self.ctl(&args, err)
    }

    /// CreateVolume, NodeStageVolume and NodePublishVolume, as the provisioner and the kubelet
    /// make them for a pod's first start.
    fn up(&mut self, name: &str, size: u64, fs: &str, err: &Path) -> Result<(), String> {
        self.create(name, size, Some(fs), err)?;
        let (staging, target) = (self.staging(name), self.target(name));
        self.ctl(&["stage", name, &staging, "--fs", fs], err)?;
        self.ctl(&["publish", name, &staging, &target, "--fs", fs], err)
    }

    /// Unpublishes, unstages and deletes every volume made (each a no-op where there is
    /// nothing to undo); failures go to `teardown_error`.
    fn teardown(&mut self, d: &Path) {
        let err = d.join("teardown.err");
        for name in std::mem::take(&mut self.made) {
            let (staging, target) = (self.staging(&name), self.target(&name));
            let down = self
                .ctl(&["unpublish", &name, &target], &err)
                .and_then(|()| self.ctl(&["unstage", &name, &staging], &err))
                .and_then(|()| self.ctl(&["delete", &name], &err));
            if let Err(e) = down {
                append(
                    &d.join("teardown_error"),
                    &format!("tearing down {name} failed: {e}"),
                );
            }
        }
    }
}

/// ublkd with ublkd-csi in front of it: for ext4 and xfs, `CSI_VOLUMES` file volumes each timed
/// from CreateVolume to a published, mounted file system (`<fs>.ns`), each torn down before the
/// next (the node's capacity is a tmpfs); then `CSI_PARALLEL` fresh ext4 volumes staged one at
/// a time (`stage_seq.ns`: total NS), torn down, and as many staged all at once
/// (`stage_par.ns`). Problems go to `error` or `teardown_error`.
pub fn csi_case(g: &Guest) {
    let run = CSI_RUN;
    let Some(mut node) = Node::new(g, run, CSI_METRICS) else {
        return;
    };
    let d = node.d.clone();
    let Some(src) = &g.csi else {
        return g.fail_case(run, "no ublkd-csi binary");
    };
    // In the node's own directory: the tmpfs, and never a path the node uses.
    let bin = node.c.join("ublkd-csi.bin");
    if let Err(e) = fs::copy(src, &bin) {
        return g.fail_case(run, &format!("copying ublkd-csi to {}: {e}", bin.display()));
    }
    let kubelet = node.c.join("kubelet");
    if let Err(e) = fs::create_dir_all(&kubelet) {
        return g.fail_case(run, &format!("mkdir {}: {e}", kubelet.display()));
    }
    note(&format!(
        "{run}: {CSI_VOLUMES} volumes per file system to a mounted pod path; \
         {CSI_PARALLEL} stages in sequence, {CSI_PARALLEL} in parallel"
    ));
    node.spawn();
    if !node.wait_up(g, run) {
        return;
    }
    let mut csi = Csi {
        sock: node.c.join("csi.sock"),
        roots: node.c.join("roots"),
        kubelet,
        bin,
        made: Vec::new(),
    };
    let driver = Command::new(&csi.bin)
        .arg("--csi-endpoint")
        .arg(format!("unix://{}", csi.sock.display()))
        .arg("--ublkd")
        .arg(format!("unix://{}", node.sock().display()))
        .args(["--node-id", "bench", "--kubelet-dir"])
        .arg(&csi.kubelet)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(log_file(&d.join("csi.log")))
        .spawn();
    let mut driver = match driver {
        Ok(c) => c,
        Err(e) => {
            g.fail_case(run, &format!("could not start ublkd-csi: {e}"));
            node.stop();
            return;
        }
    };
    super::proc::wait_until(Duration::from_secs(10), Duration::from_millis(100), || {
        csi.sock.exists()
    });
    let err = d.join("csi.err");
    let error = d.join("error");
    for fs in ["ext4", "xfs"] {
        // xfs refuses file systems under 300 MB.
        let size: u64 = if fs == "xfs" { 320 << 20 } else { 64 << 20 };
        let mut times = String::new();
        for k in 1..=CSI_VOLUMES {
            let name = format!("pvc-{fs}-{k:03}");
            let (r, ns) = timed(|| csi.up(&name, size, fs, &err));
            csi.teardown(&d);
            match r {
                Ok(()) => times.push_str(&format!("{ns}\n")),
                Err(e) => {
                    put(&error, &format!("{name}: {e}\n"));
                    break;
                }
            }
        }
        put(&d.join(format!("{fs}.ns")), &times);
        if error.exists() {
            break;
        }
    }
    for set in ["seq", "par"] {
        if error.exists() {
            break;
        }
        for k in 1..=CSI_PARALLEL {
            let name = format!("pvc-{set}-{k:03}");
            if let Err(e) = csi.create(&name, 64 << 20, None, &err) {
                put(&error, &format!("{name}: {e}\n"));
                break;
            }
        }
        if error.exists() {
            break;
        }
        let names: Vec<String> = (1..=CSI_PARALLEL)
            .map(|k| format!("pvc-{set}-{k:03}"))
            .collect();
        let t0 = Instant::now();
        if set == "seq" {
            for name in &names {
                if let Err(e) = csi.ctl(&["stage", name, &csi.staging(name)], &err) {
                    append(&error, &format!("stage {name} failed: {e}"));
                }
            }
        } else {
            let children: Vec<_> = names
                .iter()
                .map(|name| {
                    Command::new(&csi.bin)
                        .arg("ctl")
                        .arg("--csi-endpoint")
                        .arg(format!("unix://{}", csi.sock.display()))
                        .args(["stage", name, &csi.staging(name)])
                        .stdin(Stdio::null())
                        .stdout(Stdio::null())
                        .stderr(log_file(&err))
                        .spawn()
                        .map(|c| (name, c))
                })
                .collect();
            for child in children {
                let ok = match child {
                    Ok((name, mut c)) => (name.as_str(), c.wait().is_ok_and(|s| s.success())),
                    Err(e) => {
                        append(&error, &format!("could not start a stage: {e}"));
                        continue;
                    }
                };
                if !ok.1 {
                    append(&error, &format!("stage {} failed: {}", ok.0, tail_of(&err)));
                }
            }
        }
        put(
            &d.join(format!("stage_{set}.ns")),
            &format!("{}\n", t0.elapsed().as_nanos()),
        );
        csi.teardown(&d);
    }
    let timed_count: usize = ["ext4.ns", "xfs.ns"]
        .iter()
        .map(|f| {
            fs::read_to_string(d.join(f))
                .unwrap_or_default()
                .lines()
                .count()
        })
        .sum();
    note(&format!("{run}: {timed_count} volumes timed to mounted"));
    csi.teardown(&d);
    signal(driver.id(), "TERM");
    if let Err(e) = driver.wait() {
        note(&format!("waiting for ublkd-csi: {e}"));
    }
    node.stop();
}
