//! The node service's features, measured: QoS limits against fio, and snapshots and clones on
//! an XFS with reflink.

use super::super::cases::{
    QosJob, QOS_JOBS, QOS_METRICS, QOS_QD, QOS_RUN, QOS_RUNTIME_SECS, QOS_SIZE, SNAPSHOT_FILL_MIB,
    SNAPSHOT_FS_GIB, SNAPSHOT_GIB, SNAPSHOT_METRICS, SNAPSHOT_REPEATS, SNAPSHOT_RUN,
};
use super::proc::{append, fio, note, put, run_logged, tail_of, wait_blk, Engine, Guest, Node};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

/// One null volume per QoS job, its limit set at create-volume, fio at `QOS_QD` on it for
/// `QOS_RUNTIME_SECS` after 1 s of ramp (the burst allowance is spent in the ramp), deleted
/// before the next. Per job ID: `ID.json`, `ID.rc`, `ID.log` (fio), `ID.volume.json` (the limits
/// as the daemon took them), `ID.error` (no measurement, and why).
pub fn qos_case(g: &Guest) {
    let run = QOS_RUN;
    let Some(mut node) = Node::new(g, run, QOS_METRICS) else {
        return;
    };
    note(&format!(
        "{run}: null volumes with I/O limits, fio {QOS_RUNTIME_SECS} s at QD{QOS_QD} on each"
    ));
    put(&node.d.join("volumes"), "");
    node.spawn();
    if !node.wait_up(g, run) {
        return;
    }
    for job in QOS_JOBS {
        qos_job(&node, job);
    }
    node.teardown();
}

fn qos_job(node: &Node, job: &QosJob) {
    let d = &node.d;
    let id = job.id();
    let flags = job.flags();
    let mut args = vec![
        "create-volume",
        &id,
        "--size",
        QOS_SIZE,
        "--backend",
        "null",
    ];
    args.extend(flags.split_whitespace());
    let dev = match node.ctl(&args, &d.join("create.err")) {
        Ok(dev) => PathBuf::from(dev),
        Err(e) => {
            let why = format!("create-volume {id} {flags} failed {e}");
            put(&d.join(format!("{id}.error")), &format!("{why}\n"));
            note(&format!("{id}: {why}"));
            return;
        }
    };
    append(&d.join("volumes"), &format!("{id} {}", dev.display()));
    if wait_blk(&dev) {
        if let Ok(v) = node.ctl(&["get-volume", &id, "-o", "json"], &d.join("create.err")) {
            put(&d.join(format!("{id}.volume.json")), &v);
        }
        let mut c = fio(QOS_RUNTIME_SECS);
        c.arg(format!("--name={id}"))
            .arg(format!("--filename={}", dev.display()))
            .args(Engine::Direct.args())
            .arg(format!("--bs={}", job.bs))
            .arg(format!("--rw={}", job.rw))
            .arg(format!("--iodepth={QOS_QD}"))
            .args(["--numjobs=1", "--norandommap", "--time_based"])
            .arg(format!("--runtime={QOS_RUNTIME_SECS}"))
            .args(["--ramp_time=1", "--output-format=json"])
            .arg(format!(
                "--output={}",
                d.join(format!("{id}.json")).display()
            ));
        let log = d.join(format!("{id}.log"));
        let _ = fs::remove_file(&log); // absent before the job: nothing to remove is fine
        let rc = run_logged(c, &log);
        put(&d.join(format!("{id}.rc")), &format!("{rc}\n"));
        note(&format!("{id}: fio exit {rc}"));
    } else {
        put(
            &d.join(format!("{id}.error")),
            &format!(
                "create-volume {id} returned {}, which is no block device\n",
                dev.display()
            ),
        );
    }
    if let Err(e) = node.ctl(&["delete-volume", &id], &d.join("delete.err")) {
        append(
            &d.join("teardown_error"),
            &format!("delete-volume {id} failed {e}"),
        );
    }
}

/// The snapshot run's file system: an XFS with reflink=1 on a loop device over a sparse file
/// in the tmpfs, mounted as the node's allowed root.
struct Xfs {
    img: PathBuf,
    root: PathBuf,
    dev: Option<String>,
}

impl Xfs {
    /// Makes and mounts it; how that went is in `fs.log`.
    fn make(node: &Node) -> Result<Self, String> {
        let log = node.d.join("fs.log");
        let mut x = Self {
            img: node.c.join("xfs.img"),
            root: node.c.join("roots"),
            dev: None,
        };
        let run = |c: &mut Command| -> Result<String, String> {
            let out = c
                .stdin(Stdio::null())
                .stderr(super::proc::log_file(&log))
                .output()
                .map_err(|e| e.to_string())?;
            if out.status.success() {
                Ok(String::from_utf8_lossy(&out.stdout).trim().to_owned())
            } else {
                Err(tail_of(&log))
            }
        };
        run(Command::new("truncate")
            .args(["-s", &format!("{SNAPSHOT_FS_GIB}G")])
            .arg(&x.img))?;
        let dev = run(Command::new("losetup")
            .args(["--find", "--show"])
            .arg(&x.img))?;
        x.dev = Some(dev.clone());
        run(Command::new("mkfs.xfs").args(["-q", "-f", "-m", "reflink=1", &dev]))?;
        run(Command::new("mount").arg(&dev).arg(&x.root))?;
        Ok(x)
    }

    /// Bytes in use on it once it is synced, or `-`.
    fn used(&self) -> String {
        let synced = Command::new("sync")
            .arg("-f")
            .arg(&self.root)
            .status()
            .is_ok_and(|s| s.success());
        if !synced {
            note("sync -f failed before df");
        }
        Command::new("df")
            .args(["-B1", "--output=used"])
            .arg(&self.root)
            .output()
            .ok()
            .and_then(|o| {
                String::from_utf8_lossy(&o.stdout)
                    .lines()
                    .nth(1)
                    .map(|l| l.trim().to_owned())
            })
            .filter(|v| !v.is_empty())
            .unwrap_or_else(|| "-".into())
    }

    /// Unmounts it, detaches its loop device, removes its image; problems go to
    /// `teardown_error`.
    fn teardown(self, d: &Path) {
        let te = d.join("teardown_error");
        let mounted = Command::new("mountpoint")
            .arg("-q")
            .arg(&self.root)
            .status()
            .is_ok_and(|s| s.success());
        if mounted
            && !Command::new("umount")
                .arg(&self.root)
                .status()
                .is_ok_and(|s| s.success())
        {
            append(&te, &format!("umount {} failed", self.root.display()));
        }
        if let Some(dev) = &self.dev {
            if !Command::new("losetup")
                .args(["-d", dev])
                .status()
                .is_ok_and(|s| s.success())
            {
                append(&te, &format!("losetup -d {dev} failed"));
            }
        }
        // The image lives in the guest's tmpfs, which goes with the guest.
        let _ = fs::remove_file(&self.img);
    }
}

/// File volumes of each `SNAPSHOT_GIB` size on an XFS with reflink: `noop.ns` (the floor of
/// any call: `ublkctl node-info`, `SNAPSHOT_REPEATS` times), then [`snapshot_size`] per size.
/// Snapshots, volumes, the daemon, the file system and its loop device are all gone at the end
/// (or `teardown_error` says).
pub fn snapshot_case(g: &Guest) {
    let run = SNAPSHOT_RUN;
    let Some(mut node) = Node::new(g, run, SNAPSHOT_METRICS) else {
        return;
    };
    let gib: Vec<String> = SNAPSHOT_GIB.iter().map(u64::to_string).collect();
    note(&format!(
        "{run}: file volumes of {} GiB on XFS (reflink=1), {SNAPSHOT_REPEATS} snapshots and \
         clones of each",
        gib.join(" ")
    ));
    let d = node.d.clone();
    put(&d.join("volumes"), "");
    put(&d.join("snapshots"), "");
    let xfs = match Xfs::make(&node) {
        Ok(x) => x,
        Err(e) => {
            g.fail_case(run, &format!("no XFS with reflink for the volumes: {e}"));
            return;
        }
    };
    if let Ok(o) = Command::new("xfs_info").arg(&xfs.root).output() {
        put(&d.join("fs.txt"), &String::from_utf8_lossy(&o.stdout));
    }
    node.spawn();
    if !node.wait_up(g, run) {
        xfs.teardown(&d);
        return;
    }
    let mut noop = String::new();
    for _ in 0..SNAPSHOT_REPEATS {
        let t0 = Instant::now();
        let r = node.ctl(&["node-info"], &d.join("noop.err"));
        if r.is_ok() {
            noop.push_str(&format!("{}\n", t0.elapsed().as_nanos()));
        }
    }
    put(&d.join("noop.ns"), &noop);
    for gib in SNAPSHOT_GIB {
        snapshot_size(&node, &xfs, gib);
    }
    let snapshots = fs::read_to_string(d.join("snapshots")).unwrap_or_default();
    for sid in snapshots.lines() {
        if let Err(e) = node.ctl(&["delete-snapshot", sid], &d.join("delete.err")) {
            append(
                &d.join("teardown_error"),
                &format!("delete-snapshot {sid} failed {e}"),
            );
        }
    }
    node.teardown();
    xfs.teardown(&d);
}

/// One size: `src-Ng` on a new sparse backing file (`create.Ng.ns`), `SNAPSHOT_FILL_MIB` MiB
/// written into it by fio (randwrite 64k across the whole volume, so the file has thousands of
/// extents; `fill.Ng.*`), synced, its extents counted (`extents.Ng`: filefrag). Then
/// `SNAPSHOT_REPEATS` times create-snapshot and create-volume --from-snapshot, each timed
/// (`snapshot.Ng.ns`, `clone.Ng.ns`: `ID NS USED_BEFORE USED_AFTER`). Failures: `Ng.error`
/// (nothing to snapshot), `snapshot.Ng.error`, `clone.Ng.error`.
fn snapshot_size(node: &Node, xfs: &Xfs, gib: u64) {
    let d = &node.d;
    let s = format!("{gib}g");
    let src = format!("src-{s}");
    let size = format!("{gib}GiB");
    let backend = |name: &str| format!("file+create:{}/{name}.img", xfs.root.display());
    let t0 = Instant::now();
    let created = node.ctl(
        &[
            "create-volume",
            &src,
            "--size",
            &size,
            "--backend",
            &backend(&src),
        ],
        &d.join("create.err"),
    );
    let ns = t0.elapsed().as_nanos();
    let dev = match created {
        Ok(dev) => PathBuf::from(dev),
        Err(e) => {
            put(
                &d.join(format!("{s}.error")),
                &format!("create-volume {src} failed {e}\n"),
            );
            return;
        }
    };
    append(&d.join("volumes"), &format!("{src} {}", dev.display()));
    put(&d.join(format!("create.{s}.ns")), &format!("{ns}\n"));
    if !wait_blk(&dev) {
        put(
            &d.join(format!("{s}.error")),
            &format!(
                "create-volume {src} returned {}, which is no block device\n",
                dev.display()
            ),
        );
        return;
    }
    let mut c = fio(120);
    c.arg("--name=fill")
        .arg(format!("--filename={}", dev.display()))
        .args(Engine::Direct.args())
        .args(["--bs=64k", "--rw=randwrite", "--iodepth=16", "--numjobs=1"])
        .arg(format!("--io_size={SNAPSHOT_FILL_MIB}m"))
        .arg("--output-format=json")
        .arg(format!(
            "--output={}",
            d.join(format!("fill.{s}.json")).display()
        ));
    let log = d.join(format!("fill.{s}.log"));
    let rc = run_logged(c, &log);
    if rc != 0 {
        put(
            &d.join(format!("{s}.error")),
            &format!(
                "fio writing {SNAPSHOT_FILL_MIB} MiB into {src} failed (exit {rc}): {}\n",
                tail_of(&log)
            ),
        );
        return;
    }
    if !Command::new("sync").status().is_ok_and(|st| st.success()) {
        note("sync failed before filefrag");
    }
    let extents = Command::new("filefrag")
        .arg(xfs.root.join(format!("{src}.img")))
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout).into_owned() + &String::from_utf8_lossy(&o.stderr)
        })
        .unwrap_or_else(|e| format!("filefrag: {e}\n"));
    put(&d.join(format!("extents.{s}")), &extents);
    note(&format!("{SNAPSHOT_RUN}: {}", extents.trim()));
    let (mut snaps, mut clones) = (String::new(), String::new());
    for k in 1..=SNAPSHOT_REPEATS {
        let sid = format!("snap-{s}-{k}");
        let u0 = xfs.used();
        let t0 = Instant::now();
        let r = node.ctl(
            &["create-snapshot", &sid, "--volume", &src],
            &d.join("snapshot.err"),
        );
        let ns = t0.elapsed().as_nanos();
        if let Err(e) = r {
            put(
                &d.join(format!("snapshot.{s}.error")),
                &format!("create-snapshot {sid} failed {e}\n"),
            );
            break;
        }
        append(&d.join("snapshots"), &sid);
        snaps.push_str(&format!("{sid} {ns} {u0} {}\n", xfs.used()));
        let name = format!("clone-{s}-{k}");
        let u0 = xfs.used();
        let t0 = Instant::now();
        let r = node.ctl(
            &[
                "create-volume",
                &name,
                "--size",
                &size,
                "--backend",
                &backend(&name),
                "--from-snapshot",
                &sid,
            ],
            &d.join("clone.err"),
        );
        let ns = t0.elapsed().as_nanos();
        match r {
            Ok(cdev) => {
                let shown = if cdev.is_empty() { "-".into() } else { cdev };
                append(&d.join("volumes"), &format!("{name} {shown}"));
                clones.push_str(&format!("{name} {ns} {u0} {}\n", xfs.used()));
            }
            Err(e) => {
                put(
                    &d.join(format!("clone.{s}.error")),
                    &format!("create-volume {name} --from-snapshot {sid} failed {e}\n"),
                );
                break;
            }
        }
    }
    put(&d.join(format!("snapshot.{s}.ns")), &snaps);
    put(&d.join(format!("clone.{s}.ns")), &clones);
    note(&format!(
        "{SNAPSHOT_RUN}: {s}: {} snapshots, {} clones timed",
        snaps.lines().count(),
        clones.lines().count()
    ));
}
