//! The fio cases: one server per case (`ublkd run`, kublk, loop, null_blk, the raw namespace),
//! every workload against its device, the server's CPU time around each.

use super::super::cases::{
    server_of, Build, Server, UBackend, BACKING_BYTES, DEPTH, NULL_BYTES, QUEUES,
};
use super::super::results::{Case, FioRun, Measured, Outcome, Samples};
use super::fio::{fio, job, run, workloads, DIRECT, HIPRI, PASSTHRU};
use super::proc::{
    failed, is_blk, output, run_logged, sh, tail_of, vmrss_kib, wait_blk, wait_secs, Guest, Proc,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Where the backing file's file system is mounted.
fn backing_mount(g: &Guest) -> PathBuf {
    g.tmp.join("ublkd-bench")
}

/// The backing file of the file cases: ext4 on the NVMe namespace, written out in full so that
/// reads reach the device, then the whole namespace read once: the host's slow first reads of
/// new blocks are paid before anything is measured (docs/performance.md, "Reading the namespace
/// before the file cases"). How it went is in `backing.log`.
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
    let rc = run_logged(c, &log);
    let ready = rc == Ok(0);
    match ready {
        true => note!("backing file {f} ready"),
        false => note!("backing file failed ({rc:?}): {}", tail_of(&log)),
    }
    ready.then_some(file)
}

/// Unmounts the backing file's file system: the namespace is used on its own next.
pub fn unmount_backing(g: &Guest) {
    let mut c = Command::new("umount");
    c.arg(backing_mount(g));
    let rc = run_logged(c, &g.out.join("backing.log"));
    if rc != Ok(0) {
        note!("umount of the backing file system failed ({rc:?})");
    }
}

/// A fio case that measured `samples` (by workload) and the server's RSS.
fn fio_run(samples: Samples, rss_kib: Outcome<f64>) -> Case {
    let (measured, teardown) = (Ok(Measured::Fio(FioRun { samples, rss_kib })), vec![]);
    Case { measured, teardown }
}

/// The RSS of a server that is not ublkd's.
fn no_rss() -> Outcome<f64> {
    Err("not measured for this server".into())
}

/// A fio case: its run (the run's id, with the suffix of its place in an A/B group) on `server`
/// (for ublkd, `build`'s binary); a `warmup` runs one discarded job instead of the workloads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FioCase {
    pub run: String,
    pub server: Server,
    pub build: Build,
    pub warmup: bool,
}

/// One fio case: its server set up, measured, torn down.
pub fn fio_case(g: &Guest, f: &FioCase, backing: Option<&Path>) -> Case {
    let (run_id, server) = (f.run.as_str(), f.server);
    match (server, backing) {
        (Server::NullBlk, _) => {
            note!("{run_id}: /dev/nullb0");
            let dev = Path::new("/dev/nullb0");
            let missing = "/dev/nullb0 is missing (null_blk not loaded?)";
            match is_blk(dev) {
                true => fio_run(workloads(g, run_id, dev, &[], DIRECT), no_rss()),
                false => failed(run_id, missing.into()),
            }
        }
        (Server::Loop, Some(file)) => loop_case(g, run_id, file),
        (Server::Loop, None) => failed(run_id, g.no_backing()),
        (Server::RawNvme { passthru }, _) => {
            // fio on the namespace itself, polled: passthrough on `/dev/ng0n1` with fixed
            // buffers, or io_uring on `/dev/nvme0n1`.
            let poll = fs::read_to_string("/sys/block/nvme0n1/queue/io_poll").unwrap_or_default();
            if poll.trim() != "1" {
                return failed(run_id, "/dev/nvme0n1 has no poll queues".into());
            }
            let (dev, engine) = match passthru {
                true => ("/dev/ng0n1", PASSTHRU),
                false => ("/dev/nvme0n1", HIPRI),
            };
            note!("{run_id}: fio {engine} on {dev}");
            fio_run(workloads(g, run_id, Path::new(dev), &[], engine), no_rss())
        }
        (Server::DmLinear, _) => dm_linear_case(g, run_id),
        (Server::Kublk { backend, .. }, backing) => match (backend, backing, args(server)) {
            (UBackend::File, None, _) => failed(run_id, g.no_backing()),
            (UBackend::File, Some(f), a) => kublk_case(g, run_id, &format!("{a} {}", f.display())),
            (UBackend::Nvme, _, a) => kublk_case(g, run_id, &(a + " /dev/nvme0n1")),
            (UBackend::Null, _, a) => kublk_case(g, run_id, &a),
        },
        (Server::Ublkd { .. } | Server::Luks2File, _) => ublkd_case(g, f, backing),
    }
}

/// The arguments of `kublk add` or `ublkd run` that make `server`.
pub fn args(server: Server) -> String {
    let pick = |b: bool, yes: &'static str, no: &'static str| if b { yes } else { no };
    match server {
        Server::Kublk {
            backend,
            batch,
            auto_zc,
        } => format!(
            "-t {} -q {QUEUES} -d {DEPTH}{}{}",
            pick(backend == UBackend::Null, "null", "loop"),
            pick(batch, " -b", ""),
            pick(auto_zc, " --auto_zc", "")
        ),
        Server::Ublkd {
            io_path,
            zero_copy,
            poll,
            ..
        } => format!(
            "--queues {QUEUES} --depth {DEPTH} --io-path {io_path} --zero-copy {} --poll {}",
            pick(zero_copy, "on", "off"),
            pick(poll, "on", "off")
        ),
        Server::Luks2File => server_of("ublkd-file").map_or_else(String::new, args),
        Server::Loop | Server::NullBlk | Server::RawNvme { .. } | Server::DmLinear => String::new(),
    }
}

/// The mapping of a `Luks2File` run.
const MAPPING: &str = "ublkd-bench";

/// Formats `dev` with LUKS2 and opens it as the CSI driver does (`ublkd_csi::crypt`: no
/// dm-crypt work queues; argon2id kept small, which only the open's time sees).
fn open_luks2(dev: &Path, log: &Path) -> Outcome<PathBuf> {
    let d = dev.display();
    let key = "printf bench-key-0123456789";
    sh(
        &format!(
            "{key} | cryptsetup luksFormat --type luks2 --batch-mode --key-file=- --pbkdf argon2id \
             --pbkdf-memory 65536 --iter-time 100 {d} && {key} | cryptsetup open --type luks2 \
             --key-file=- --perf-no_read_workqueue --perf-no_write_workqueue {d} {MAPPING} && \
             {DM_DEV} {MAPPING}"
        ),
        log,
    )
    .and_then(dm_dev)
}

/// `ublkd run --backend B --size S ARGS` with `build`'s binary: waits for its READY line,
/// reads its RSS with the volume idle, runs every workload (or, for a warm-up, one discarded
/// job; on a LUKS2 mapping over the device for `Luks2File`), stops it with SIGTERM and checks
/// the device is gone.
fn ublkd_case(g: &Guest, f: &FioCase, backing: Option<&Path>) -> Case {
    let (run_id, server, build, warmup) = (f.run.as_str(), f.server, f.build, f.warmup);
    let (backend, luks2) = match server {
        Server::Ublkd { backend, .. } => (backend, false),
        _ => (UBackend::File, true),
    };
    let args = &args(server);
    let Some(bin) = g.ublkd(build) else {
        return failed(run_id, "no ublkd binary for this build".into());
    };
    let sectors = fs::read_to_string("/sys/block/nvme0n1/size");
    let (backend, size) = match (backend, backing, sectors.map(|s| s.trim().parse::<u64>())) {
        (UBackend::Null, _, _) => ("null".to_owned(), NULL_BYTES),
        (UBackend::File, Some(f), _) => (format!("file:{}", f.display()), BACKING_BYTES),
        (UBackend::File, None, _) => return failed(run_id, g.no_backing()),
        (UBackend::Nvme, _, Ok(Ok(s))) => ("nvme:/dev/ng0n1".to_owned(), s * 512),
        (UBackend::Nvme, _, _) => return failed(run_id, "no /sys/block/nvme0n1/size".into()),
    };
    let d = g.dir(run_id);
    let mut c = Command::new(bin);
    c.args(["run", "--backend", &backend, "--size", &size.to_string()])
        .args(args.split_whitespace());
    note!("{run_id}: ublkd run --backend {backend} {args}");
    let mut p = match Proc::spawn(c, &d.join("server.out"), &d.join("server.err")) {
        Ok(p) => p,
        Err(e) => return failed(run_id, format!("ublkd {e}")),
    };
    let ready = || {
        let out = fs::read_to_string(d.join("server.out")).unwrap_or_default();
        let dev = out.lines().find_map(|l| l.strip_prefix("READY "))?;
        let dev = dev.split_whitespace().next()?;
        dev.starts_with("/dev/").then(|| PathBuf::from(dev))
    };
    wait_secs(60, || ready().is_some() || p.exited().is_some());
    let (dev, tail) = (ready(), p.err_tail());
    let dev = match (dev, p.exited()) {
        (Some(dev), _) if wait_blk(&dev) => Ok(dev),
        (Some(dev), _) => Err(format!(
            "ublkd said READY {dev:?}, but that is no block device"
        )),
        (None, Some(rc)) => Err(format!(
            "ublkd exited with status {rc} before READY: {tail}"
        )),
        (None, None) => Err(format!("ublkd printed no READY line within 60 s: {tail}")),
    };
    let mut case = match &dev {
        Err(why) => failed(run_id, why.clone()),
        Ok(dev) if warmup => {
            // A warm-up before an A/B group: one job of randread QD32, measured by nobody.
            let (secs, json, log) = (g.input.runtime, d.join("warmup.json"), d.join("warmup.log"));
            let args = format!("{DIRECT} {}", job("randread", "4k", 32, secs));
            let r = run(fio(secs, "warmup", dev, &json, &args), &json, &log);
            note!("{run_id}: warm-up fio: {:?}", r.map(|_| "done"));
            fio_run(Samples::new(), Err("a warm-up".into()))
        }
        Ok(dev) if luks2 => {
            let log = d.join("cryptsetup.log");
            let mut case = match open_luks2(dev, &log) {
                Ok(mapping) => {
                    let rss = vmrss_kib(p.pid());
                    fio_run(workloads(g, run_id, &mapping, &[p.pid()], DIRECT), rss)
                }
                Err(e) => failed(run_id, format!("LUKS2 on {}: {e}", dev.display())),
            };
            let closed = sh(&format!("cryptsetup close {MAPPING}"), &log);
            let failed = |e| format!("cryptsetup close {MAPPING} failed: {e}");
            case.teardown.extend(closed.err().map(failed));
            case
        }
        Ok(dev) => {
            std::thread::sleep(Duration::from_secs(1));
            let rss = vmrss_kib(p.pid());
            fio_run(workloads(g, run_id, dev, &[p.pid()], DIRECT), rss)
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
    note!("{run_id}: kublk add {args}");
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
        (Some(dev), Some(pid)) if wait_blk(dev) => {
            fio_run(workloads(g, run_id, dev, &[pid], DIRECT), no_rss())
        }
        (Some(dev), Some(_)) => failed(
            run_id,
            format!("kublk added {dev:?}, but it did not appear"),
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

/// The name of the `DmLinear` run's mapping.
const LINEAR: &str = "ublkd-bench-lv";

/// `dmsetup create` of one linear target over all of `/dev/nvme0n1`, fio on it, then `dmsetup
/// remove`.
fn dm_linear_case(g: &Guest, run_id: &str) -> Case {
    let log = g.dir(run_id).join("dmsetup.log");
    let table = "0 $(blockdev --getsz /dev/nvme0n1) linear /dev/nvme0n1 0";
    note!("{run_id}: dmsetup create {LINEAR} ({table})");
    let create = format!("dmsetup create --noudevsync {LINEAR} --table \"{table}\"");
    let mut case = match sh(&format!("{create} && {DM_DEV} {LINEAR}"), &log).and_then(dm_dev) {
        Ok(dev) => fio_run(workloads(g, run_id, &dev, &[], DIRECT), no_rss()),
        Err(e) => failed(run_id, format!("dm-linear: {e}")),
    };
    let removed = sh(&format!("dmsetup remove --noudevsync {LINEAR}"), &log);
    let failed = |e| format!("dmsetup remove {LINEAR} failed: {e}");
    case.teardown.extend(removed.err().map(failed));
    case
}

/// Prints a device-mapper device's kernel name (`dm-N`; fio's I/O counts are read from
/// /sys/block/dm-N).
const DM_DEV: &str = "dmsetup info -c --noheadings -o blkdevname";

/// `/dev/dm-N` of the name [`DM_DEV`] printed, once it is a block device.
fn dm_dev(name: String) -> Outcome<PathBuf> {
    let dev = Path::new("/dev").join(name.trim());
    wait_blk(&dev)
        .then_some(dev)
        .ok_or(format!("no block device {name:?}"))
}

/// A loop device with direct I/O on `file`.
fn loop_case(g: &Guest, run_id: &str, file: &Path) -> Case {
    let err = g.dir(run_id).join("server.err");
    note!("{run_id}: losetup --direct-io=on {}", file.display());
    let mut c = Command::new("losetup");
    c.args(["--direct-io=on", "--find", "--show"]).arg(file);
    let dev = match output(&mut c, &err) {
        Ok(dev) => PathBuf::from(dev),
        Err(e) => return failed(run_id, format!("losetup failed: {e}")),
    };
    let name = dev.file_name().unwrap_or_default().to_string_lossy();
    let dio = fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
    let mut case = match dio.trim() {
        "1" => fio_run(workloads(g, run_id, &dev, &[], DIRECT), no_rss()),
        _ => failed(run_id, format!("{dev:?} did not switch to direct I/O")),
    };
    if output(Command::new("losetup").arg("-d").arg(&dev), &err).is_err() {
        case.teardown.push(format!("losetup -d {dev:?} failed"));
    }
    case
}
