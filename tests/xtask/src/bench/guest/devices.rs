//! The fio cases: one server per case (`ublkd run`, kublk, loop, null_blk, the raw namespace),
//! every workload against its device, the server's CPU time around each.

use super::super::cases::{Build, Server, UBackend, BACKING_BYTES, DEPTH, NULL_BYTES, QUEUES};
use super::super::results::{Case, FioRun, Measured};
use super::fio::{fio, run, workloads, DIRECT, HIPRI, PASSTHRU, RANDREAD_QD32};
use super::proc::{
    failed, is_blk, note, output, run_logged, tail_of, vmrss_kib, wait_blk, Guest, Proc,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

/// Where the backing file's file system is mounted.
fn backing_mount(g: &Guest) -> PathBuf {
    g.tmp.join("ublkd-bench")
}

/// The backing file of the file cases: ext4 on the NVMe namespace, written out in full so
/// that reads reach the device, then the whole namespace read once. How it went is in
/// `backing.log`.
///
/// The namespace is a file on the host's disk opened with `cache=none`, and that disk (itself
/// virtual) served the first reads of newly written blocks at 50–100 ms each: the first file
/// runs of a bench measured the host's first touch, not the volume (issue 24's note,
/// 2026-12-03: 396 IOPS against 7371 for the same build a minute later, the host disk 90 %
/// busy with 527 reads a second). Reading it all here pays that before anything is measured.
pub fn prepare_backing(g: &Guest) -> Option<PathBuf> {
    let (log, mnt) = (g.out.join("backing.log"), backing_mount(g));
    let file = mnt.join("backing");
    let (m, f, mib) = (mnt.display(), file.display(), BACKING_BYTES >> 20);
    let script = format!(
        "mkdir -p {m} && mkfs.ext4 -q -F /dev/nvme0n1 && mount /dev/nvme0n1 {m} && \
         dd if=/dev/zero of={f} bs=1M count={mib} oflag=direct status=none && \
         dd if=/dev/nvme0n1 of=/dev/null bs=1M iflag=direct status=none"
    );
    let mut c = Command::new("sh");
    c.args(["-xc", &script]);
    match run_logged(c, &log) {
        Ok(0) => {
            note(&format!("backing file {f} ready"));
            Some(file)
        }
        rc => {
            note(&format!("backing file failed ({rc:?}): {}", tail_of(&log)));
            None
        }
    }
}

/// Unmounts the backing file's file system: the namespace is used on its own next.
pub fn unmount_backing(g: &Guest) {
    let mut c = Command::new("umount");
    c.arg(backing_mount(g));
    match run_logged(c, &g.out.join("backing.log")) {
        Ok(0) => {}
        rc => note(&format!(
            "umount of the backing file system failed ({rc:?})"
        )),
    }
}

/// A fio run that measured: every workload on `dev` through `engine`, the CPU time of `pids`
/// around each.
fn measured(g: &Guest, run_id: &str, dev: &Path, engine: &str, pids: &[u32]) -> FioRun {
    FioRun {
        samples: workloads(g, run_id, dev, pids, engine),
        rss_kib: Err("not measured for this server".into()),
    }
}

fn case(run: FioRun) -> Case {
    Case {
        measured: Ok(Measured::Fio(run)),
        teardown: vec![],
    }
}

/// One fio case: its server set up, measured, torn down.
pub fn fio_case(
    g: &Guest,
    run_id: &str,
    server: Server,
    build: Build,
    warmup: bool,
    backing: Option<&Path>,
) -> Case {
    match (server, backing) {
        (Server::NullBlk, _) => nullblk_case(g, run_id),
        (Server::Loop, Some(file)) => loop_case(g, run_id, file),
        (Server::Loop, None) => failed(run_id, g.no_backing()),
        (Server::RawNvme { passthru }, _) => raw_nvme_case(g, run_id, passthru),
        (Server::Kublk { .. }, _) => kublk_case(g, run_id, &args(server)),
        (Server::Ublkd { backend, .. }, _) => {
            ublkd_case(g, run_id, backend, &args(server), build, warmup, backing)
        }
    }
}

/// The arguments of `kublk add` or `ublkd run` that make `server`.
pub fn args(server: Server) -> String {
    let on = |b: bool| if b { "on" } else { "off" };
    match server {
        Server::Kublk { batch, auto_zc } => format!(
            "-t null -q {QUEUES} -d {DEPTH}{}{}",
            if batch { " -b" } else { "" },
            if auto_zc { " --auto_zc" } else { "" }
        ),
        Server::Ublkd {
            io_path,
            zero_copy,
            poll,
            ..
        } => format!(
            "--queues {QUEUES} --depth {DEPTH} --io-path {io_path} --zero-copy {} --poll {}",
            on(zero_copy),
            on(poll)
        ),
        Server::Loop | Server::NullBlk | Server::RawNvme { .. } => String::new(),
    }
}

/// `ublkd run --backend B --size S ARGS` with `build`'s binary: waits for its READY line,
/// reads its RSS with the volume idle, runs every workload (or, for a warm-up, one discarded
/// job), stops it with SIGTERM and checks the device is gone.
fn ublkd_case(
    g: &Guest,
    run_id: &str,
    backend: UBackend,
    args: &str,
    build: Build,
    warmup: bool,
    backing: Option<&Path>,
) -> Case {
    let Some(bin) = g.ublkd(build) else {
        return failed(run_id, "no ublkd binary for this build".into());
    };
    let sectors = || fs::read_to_string("/sys/block/nvme0n1/size").map(|s| s.trim().parse::<u64>());
    let (backend, size) = match (backend, backing) {
        (UBackend::Null, _) => ("null".to_owned(), NULL_BYTES),
        (UBackend::File, Some(f)) => (format!("file:{}", f.display()), BACKING_BYTES),
        (UBackend::File, None) => return failed(run_id, g.no_backing()),
        (UBackend::Nvme, _) => match sectors() {
            Ok(Ok(s)) => ("nvme:/dev/ng0n1".to_owned(), s * 512),
            _ => return failed(run_id, "no /sys/block/nvme0n1/size".into()),
        },
    };
    let d = g.dir(run_id);
    let mut c = Command::new(bin);
    c.args(["run", "--backend", &backend, "--size", &size.to_string()])
        .args(args.split_whitespace());
    note(&format!("{run_id}: ublkd run --backend {backend} {args}"));
    let mut p = match Proc::spawn(c, &d) {
        Ok(p) => p,
        Err(e) => return failed(run_id, format!("ublkd {e}")),
    };
    let ready = || {
        let out = fs::read_to_string(d.join("server.out")).unwrap_or_default();
        let dev = out.lines().find_map(|l| l.strip_prefix("READY "))?;
        let dev = dev.split_whitespace().next()?;
        dev.starts_with("/dev/").then(|| PathBuf::from(dev))
    };
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end && ready().is_none() && p.exited().is_none() {
        std::thread::sleep(Duration::from_millis(100));
    }
    let dev = match (ready(), p.exited()) {
        (Some(dev), _) if wait_blk(&dev) => Ok(dev),
        (Some(dev), _) => Err(format!(
            "ublkd said READY {}, but that is no block device",
            dev.display()
        )),
        (None, Some(rc)) => Err(format!(
            "ublkd exited with status {rc} before READY: {}",
            p.err_tail()
        )),
        (None, None) => Err(format!(
            "ublkd printed no READY line within 60 s: {}",
            p.err_tail()
        )),
    };
    let mut case = match &dev {
        Err(why) => failed(run_id, why.clone()),
        Ok(dev) if warmup => {
            // A warm-up before an A/B group: one job of randread QD32, measured by nobody.
            let runtime = g.input.runtime;
            let json = d.join("warmup.json");
            let args = format!("{DIRECT} {RANDREAD_QD32} --runtime={runtime}");
            let c = fio(runtime, "warmup", dev, &json, &args);
            let r = run(c, &json, &d.join("warmup.log"));
            note(&format!("{run_id}: warm-up fio: {:?}", r.map(|_| "done")));
            case(FioRun {
                samples: Default::default(),
                rss_kib: Err("a warm-up".into()),
            })
        }
        Ok(dev) => {
            std::thread::sleep(Duration::from_secs(1));
            let rss_kib = vmrss_kib(p.pid());
            case(FioRun {
                rss_kib,
                ..measured(g, run_id, dev, DIRECT, &[p.pid()])
            })
        }
    };
    p.stop(dev.as_ref().ok().map(PathBuf::as_path), &mut case.teardown);
    case
}

/// `kublk add ARGS`: measures its daemon, then `kublk del`.
fn kublk_case(g: &Guest, run_id: &str, args: &str) -> Case {
    let Ok(kublk) = &g.input.kublk else {
        return failed(run_id, "no kublk binary".into());
    };
    let out = g.dir(run_id).join("server.out");
    note(&format!("{run_id}: kublk add {args}"));
    // Into a file: the daemon kublk leaves behind keeps its output open.
    let kublk = |args: &[&str]| {
        let mut c = Command::new("timeout");
        c.arg("60").arg(kublk).args(args);
        match run_logged(c, &out) {
            Ok(0) => Ok(fs::read_to_string(&out).unwrap_or_default()),
            rc => Err(format!("{rc:?}: {}", tail_of(&out))),
        }
    };
    let add: Vec<&str> = ["add"].into_iter().chain(args.split_whitespace()).collect();
    let text = match kublk(&add) {
        Ok(text) => text,
        Err(e) => return failed(run_id, format!("kublk {} failed {e}", add.join(" "))),
    };
    // "dev id N: ..." and "... daemon pid N ..."
    let number = |after: &str| {
        let (_, r) = text.split_once(after)?;
        r.split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse::<u32>()
            .ok()
    };
    let (id, pid) = (number("dev id "), number("daemon pid "));
    let dev = id.map(|id| PathBuf::from(format!("/dev/ublkb{id}")));
    let mut case = match (&dev, pid) {
        (Some(dev), Some(pid)) if wait_blk(dev) => case(measured(g, run_id, dev, DIRECT, &[pid])),
        (Some(dev), Some(_)) => failed(
            run_id,
            format!("kublk added {}, but it did not appear", dev.display()),
        ),
        _ => failed(
            run_id,
            format!("no dev id or daemon pid in the output of kublk add: {text}"),
        ),
    };
    if let Some(id) = id {
        if let Err(e) = kublk(&["del", "-n", &id.to_string()]) {
            case.teardown.push(format!("kublk del -n {id} failed: {e}"));
        }
    }
    case
}

/// fio on the namespace itself, polled: passthrough on `/dev/ng0n1` with fixed buffers, or
/// io_uring on `/dev/nvme0n1`.
fn raw_nvme_case(g: &Guest, run_id: &str, passthru: bool) -> Case {
    let poll = fs::read_to_string("/sys/block/nvme0n1/queue/io_poll").unwrap_or_default();
    if poll.trim() != "1" {
        return failed(run_id, "/dev/nvme0n1 has no poll queues".into());
    }
    let (dev, engine) = match passthru {
        true => ("/dev/ng0n1", PASSTHRU),
        false => ("/dev/nvme0n1", HIPRI),
    };
    note(&format!("{run_id}: fio {} on {dev}", engine));
    case(measured(g, run_id, Path::new(dev), engine, &[]))
}

/// A loop device with direct I/O on `file`.
fn loop_case(g: &Guest, run_id: &str, file: &Path) -> Case {
    let err = g.dir(run_id).join("server.err");
    note(&format!(
        "{run_id}: losetup --direct-io=on {}",
        file.display()
    ));
    let mut c = Command::new("losetup");
    let made = output(
        c.args(["--direct-io=on", "--find", "--show"]).arg(file),
        &err,
    );
    let dev = match made {
        Ok(dev) => PathBuf::from(dev),
        Err(e) => return failed(run_id, format!("losetup failed: {e}")),
    };
    let name = dev.file_name().unwrap_or_default().to_string_lossy();
    let dio = fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
    let mut case = match dio.trim() {
        "1" => case(measured(g, run_id, &dev, DIRECT, &[])),
        _ => failed(
            run_id,
            format!("{} did not switch to direct I/O", dev.display()),
        ),
    };
    if output(Command::new("losetup").arg("-d").arg(&dev), &err).is_err() {
        case.teardown
            .push(format!("losetup -d {} failed", dev.display()));
    }
    case
}

/// The kernel's null_blk, loaded at boot.
fn nullblk_case(g: &Guest, run_id: &str) -> Case {
    note(&format!("{run_id}: /dev/nullb0"));
    let dev = Path::new("/dev/nullb0");
    match is_blk(dev) {
        true => case(measured(g, run_id, dev, DIRECT, &[])),
        false => failed(
            run_id,
            "/dev/nullb0 is missing (null_blk not loaded?)".into(),
        ),
    }
}
