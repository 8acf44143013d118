//! The fio cases: one server per case (`ublkd run`, kublk, loop, null_blk, the raw namespace),
//! every workload against its device, the server's CPU time around each.

use super::super::cases::{Build, UBackend, BACKING_BYTES, NULL_BYTES};
use super::proc::{
    append, fio, fresh, is_blk, note, put, run_logged, tail_of, wait_blk, Engine, Guest, Proc,
    RANDREAD_QD32,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
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
    let log = g.out.join("backing.log");
    let mnt = backing_mount(g);
    let file = mnt.join("backing");
    if let Err(e) = fs::create_dir_all(&mnt) {
        append(&log, &format!("mkdir {}: {e}", mnt.display()));
        note(&format!("backing file failed: {}", tail_of(&log)));
        return None;
    }
    let steps: [Vec<String>; 4] = [
        ["mkfs.ext4", "-q", "-F", "/dev/nvme0n1"]
            .map(String::from)
            .to_vec(),
        vec![
            "mount".into(),
            "/dev/nvme0n1".into(),
            mnt.display().to_string(),
        ],
        vec![
            "dd".into(),
            "if=/dev/zero".into(),
            format!("of={}", file.display()),
            "bs=1M".into(),
            format!("count={}", BACKING_BYTES >> 20),
            "oflag=direct".into(),
            "status=none".into(),
        ],
        [
            "dd",
            "if=/dev/nvme0n1",
            "of=/dev/null",
            "bs=1M",
            "iflag=direct",
            "status=none",
        ]
        .map(String::from)
        .to_vec(),
    ];
    for step in &steps {
        let mut c = Command::new(&step[0]);
        c.args(&step[1..]);
        let rc = run_logged(c, &log);
        if rc != 0 {
            append(&log, &format!("{} exited with {rc}", step.join(" ")));
            note(&format!("backing file failed: {}", tail_of(&log)));
            return None;
        }
    }
    note(&format!("backing file {} ready", file.display()));
    Some(file)
}

/// Unmounts the backing file's file system: the namespace is used on its own next.
pub fn unmount_backing(g: &Guest) {
    let mut c = Command::new("umount");
    c.arg(backing_mount(g));
    let rc = run_logged(c, &g.out.join("backing.log"));
    if rc != 0 {
        note(&format!("umount of the backing file system failed ({rc})"));
    }
}

/// `ublkd run --backend B --size S ARGS` with `build`'s binary: waits for its READY line,
/// records `status.idle` (its /proc status, one volume idle), runs every workload (or, for a
/// warm-up, one discarded job), stops it with SIGTERM and checks the device is gone.
pub fn ublkd_case(
    g: &Guest,
    run: &str,
    build: Build,
    backend: UBackend,
    args: &[String],
    warmup: bool,
    backing: Option<&Path>,
) {
    let Some(bin) = g.ublkd(build) else {
        g.fail_case(run, "no ublkd binary for this build");
        return;
    };
    let (backend, size) = match backend {
        UBackend::Null => ("null".to_owned(), NULL_BYTES),
        UBackend::File => match backing {
            Some(f) => (format!("file:{}", f.display()), BACKING_BYTES),
            None => return g.fail_case(run, &g.no_backing()),
        },
        UBackend::Nvme => {
            let sectors = fs::read_to_string("/sys/block/nvme0n1/size")
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok());
            match sectors {
                Some(s) => ("nvme:/dev/ng0n1".to_owned(), s * 512),
                None => return g.fail_case(run, "no /sys/block/nvme0n1/size"),
            }
        }
    };
    let d = g.dir(run);
    let mut c = Command::new(bin);
    c.args(["run", "--backend", &backend, "--size", &size.to_string()])
        .args(args);
    note(&format!(
        "{run}: ublkd run --backend {backend} {}",
        args.join(" ")
    ));
    let mut p = match Proc::spawn(c, &d) {
        Ok(p) => p,
        Err(e) => return g.fail_case(run, &format!("ublkd {e}")),
    };
    let out = d.join("server.out");
    let mut dev = None;
    let end = Instant::now() + Duration::from_secs(60);
    while Instant::now() < end && dev.is_none() && p.exited().is_none() {
        dev = fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("READY "))
            .and_then(|rest| rest.split_whitespace().next())
            .filter(|w| w.starts_with("/dev/"))
            .map(PathBuf::from);
        if dev.is_none() {
            std::thread::sleep(Duration::from_millis(100));
        }
    }
    let server = || tail_of(&d.join("server.err"));
    let Some(dev) = dev else {
        match p.exited() {
            Some(rc) => g.fail_case(
                run,
                &format!("ublkd exited with status {rc} before READY: {}", server()),
            ),
            None => {
                g.fail_case(
                    run,
                    &format!("ublkd printed no READY line within 60 s: {}", server()),
                );
                p.stop(None);
            }
        }
        return;
    };
    if !wait_blk(&dev) {
        g.fail_case(
            run,
            &format!(
                "ublkd said READY {}, but that is no block device",
                dev.display()
            ),
        );
        p.stop(None);
        return;
    }
    std::thread::sleep(Duration::from_secs(1));
    if let Ok(s) = fs::read_to_string(format!("/proc/{}/status", p.pid())) {
        put(&d.join("status.idle"), &s);
    }
    if warmup {
        // A warm-up before an A/B group: one job of randread QD32, measured by nobody.
        let mut c = fio(g.runtime);
        c.arg("--name=warmup")
            .arg(format!("--filename={}", dev.display()))
            .args(Engine::Direct.args())
            .args(RANDREAD_QD32)
            .arg(format!("--runtime={}", g.runtime));
        let rc = run_logged(c, &d.join("warmup.log"));
        note(&format!("{run}: warm-up fio exit {rc}"));
    } else {
        g.run_workloads(run, &dev, &[p.pid()], Engine::Direct);
    }
    p.stop(Some(&dev));
}

/// `kublk add ARGS`: measures its daemon, then `kublk del`.
pub fn kublk_case(g: &Guest, run: &str, args: &[String]) {
    let Some(kublk) = &g.kublk else {
        return g.fail_case(run, "no kublk binary");
    };
    let d = g.dir(run);
    note(&format!("{run}: kublk add {}", args.join(" ")));
    let added = Command::new("timeout")
        .arg("60")
        .arg(kublk)
        .arg("add")
        .args(args)
        .stdin(Stdio::null())
        .stdout(fresh(&d.join("server.out")))
        .stderr(fresh(&d.join("server.err")))
        .status();
    if !added.is_ok_and(|s| s.success()) {
        return g.fail_case(
            run,
            &format!(
                "kublk add {} failed: {}",
                args.join(" "),
                tail_of(&d.join("server.err"))
            ),
        );
    }
    let out = fs::read_to_string(d.join("server.out")).unwrap_or_default();
    // "dev id N: ..." and "... daemon pid N ..."
    let id = out.lines().find_map(|l| {
        l.strip_prefix("dev id ")
            .and_then(|r| r.split(':').next())
            .and_then(|n| n.parse::<u32>().ok())
    });
    let pid = out.lines().find_map(|l| {
        l.split_once("daemon pid ").and_then(|(_, r)| {
            r.split(|c: char| !c.is_ascii_digit())
                .next()
                .and_then(|n| n.parse::<u32>().ok())
        })
    });
    let del = |id: u32| {
        Command::new("timeout")
            .arg("60")
            .arg(kublk)
            .args(["del", "-n", &id.to_string()])
            .stdin(Stdio::null())
            .stdout(fresh(&d.join("del.log")))
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let (Some(id), Some(pid)) = (id, pid) else {
        g.fail_case(
            run,
            &format!(
                "no dev id or daemon pid in the output of kublk add: {}",
                tail_of(&d.join("server.out"))
            ),
        );
        if let Some(id) = id {
            del(id);
        }
        return;
    };
    let dev = PathBuf::from(format!("/dev/ublkb{id}"));
    if wait_blk(&dev) {
        g.run_workloads(run, &dev, &[pid], Engine::Direct);
    } else {
        g.fail_case(
            run,
            &format!(
                "kublk added device {id}, but {} did not appear",
                dev.display()
            ),
        );
    }
    if !del(id) {
        append(
            &d.join("teardown_error"),
            &format!("kublk del -n {id} failed: {}", tail_of(&d.join("del.log"))),
        );
    }
}

/// fio on the namespace itself, polled: passthrough on `/dev/ng0n1` with fixed buffers, or
/// io_uring on `/dev/nvme0n1`.
pub fn raw_nvme_case(g: &Guest, run: &str, passthru: bool) {
    g.dir(run);
    let poll = fs::read_to_string("/sys/block/nvme0n1/queue/io_poll").unwrap_or_default();
    if poll.trim() != "1" {
        return g.fail_case(run, "/dev/nvme0n1 has no poll queues");
    }
    if passthru {
        note(&format!(
            "{run}: fio io_uring_cmd on /dev/ng0n1 (hipri, fixedbufs)"
        ));
        g.run_workloads(run, Path::new("/dev/ng0n1"), &[], Engine::Passthru);
    } else {
        note(&format!("{run}: fio io_uring on /dev/nvme0n1 (hipri)"));
        g.run_workloads(run, Path::new("/dev/nvme0n1"), &[], Engine::Hipri);
    }
}

/// A loop device with direct I/O on `file`.
pub fn loop_case(g: &Guest, run: &str, file: &Path) {
    let d = g.dir(run);
    note(&format!("{run}: losetup --direct-io=on {}", file.display()));
    let made = Command::new("losetup")
        .args(["--direct-io=on", "--find", "--show"])
        .arg(file)
        .stdin(Stdio::null())
        .stderr(fresh(&d.join("server.err")))
        .output();
    let dev = match made {
        Ok(o) if o.status.success() => {
            PathBuf::from(String::from_utf8_lossy(&o.stdout).trim().to_owned())
        }
        _ => {
            return g.fail_case(
                run,
                &format!("losetup failed: {}", tail_of(&d.join("server.err"))),
            )
        }
    };
    let name = dev
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dio = fs::read_to_string(format!("/sys/block/{name}/loop/dio")).unwrap_or_default();
    if dio.trim() == "1" {
        g.run_workloads(run, &dev, &[], Engine::Direct);
    } else {
        g.fail_case(
            run,
            &format!("{} did not switch to direct I/O", dev.display()),
        );
    }
    let detached = Command::new("losetup")
        .arg("-d")
        .arg(&dev)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !detached {
        append(
            &d.join("teardown_error"),
            &format!("losetup -d {} failed", dev.display()),
        );
    }
}

/// The kernel's null_blk, loaded at boot.
pub fn nullblk_case(g: &Guest, run: &str) {
    g.dir(run);
    note(&format!("{run}: /dev/nullb0"));
    let dev = Path::new("/dev/nullb0");
    if is_blk(dev) {
        g.run_workloads(run, dev, &[], Engine::Direct);
    } else {
        g.fail_case(run, "/dev/nullb0 is missing (null_blk not loaded?)");
    }
}
