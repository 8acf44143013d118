//! The node service's features, measured: QoS limits against fio, and snapshots and clones on
//! an XFS with reflink.

use super::super::cases::{
    QosJob, QosLimit, QOS_JOBS, QOS_METRICS, QOS_QD, QOS_RUN, QOS_RUNTIME_SECS, QOS_SIZE,
    SNAPSHOT_FILL_MIB, SNAPSHOT_FS_GIB, SNAPSHOT_GIB, SNAPSHOT_METRICS, SNAPSHOT_REPEATS,
    SNAPSHOT_RUN,
};
use super::super::results::{Case, Measured, Outcome, Qos, SnapSize, Snapshots, Timed};
use super::fio::{fio, run, DIRECT};
use super::proc::{failed, note, sh, timed, Guest, Node};
use std::fs;
use std::path::{Path, PathBuf};

/// One null volume per QoS job, its limit set at create-volume, fio at `QOS_QD` on it for
/// `QOS_RUNTIME_SECS` after 1 s of ramp (the burst allowance is spent in the ramp), deleted
/// before the next.
pub fn qos_case(g: &Guest) -> Case {
    note(&format!(
        "{QOS_RUN}: null volumes with I/O limits, fio {QOS_RUNTIME_SECS} s at QD{QOS_QD} on each"
    ));
    Node::run(g, QOS_RUN, QOS_METRICS, |node| {
        let jobs = QOS_JOBS
            .iter()
            .map(|j| (j.id(), qos_job(node, j)))
            .collect();
        Ok(Measured::Qos(Qos { jobs }))
    })
}

/// The figure fio measured that the job's limit bounds: read IOPS, or write MiB/s.
fn qos_job(node: &mut Node, job: &QosJob) -> Outcome<f64> {
    let (d, id) = (node.d.clone(), job.id());
    let volume = format!("--size {QOS_SIZE} --backend null {}", job.flags());
    let (dev, _) = node.create(&id, &volume, &d.join("create.err"))?;
    let json = d.join(format!("{id}.json"));
    let (bs, rw, secs) = (job.bs, job.rw, QOS_RUNTIME_SECS);
    let args = format!(
        "{DIRECT} --bs={bs} --rw={rw} --iodepth={QOS_QD} --numjobs=1 --norandommap --time_based \
         --runtime={secs} --ramp_time=1"
    );
    let c = fio(secs, &id, &dev, &json, &args);
    let measured = run(c, &json, &d.join(format!("{id}.log"))).and_then(|j| {
        let (dir, name, rate) = match job.limit {
            QosLimit::Unlimited | QosLimit::ReadIops(_) => (&j.read, "read", j.read.iops),
            QosLimit::WriteMibps(_) => (&j.write, "write", j.write.bw_bytes / (1 << 20) as f64),
        };
        match dir.total_ios {
            0 => Err(format!("fio completed no {name}")),
            _ => Ok(rate),
        }
    });
    note(&format!("{id}: {measured:?}"));
    if let Err(e) = node.ctl(&format!("delete-volume {id}"), &d.join("delete.err")) {
        node.problems.push(format!("delete-volume {id} failed {e}"));
    }
    measured
}

/// The snapshot run's file system: an XFS with reflink=1 on a loop device over a sparse file
/// in the tmpfs, mounted as the node's allowed root.
#[derive(Debug)]
struct Xfs {
    img: PathBuf,
    root: PathBuf,
    dev: Option<String>,
}

impl Xfs {
    /// Makes and mounts it on the node's root; how that went is in `fs.log`.
    fn make(node: &Node) -> Outcome<Self> {
        let log = node.d.join("fs.log");
        let (img, root) = (node.c.join("xfs.img"), node.c.join("roots"));
        let (i, r) = (img.display(), root.display());
        let losetup = format!("truncate -s {SNAPSHOT_FS_GIB}G {i} && losetup --find --show {i}");
        let dev = sh(&losetup, &log)?;
        let made = sh(
            &format!("mkfs.xfs -q -f -m reflink=1 {dev} && mount {dev} {r}"),
            &log,
        );
        let x = Self {
            img: img.clone(),
            root: root.clone(),
            dev: Some(dev),
        };
        match made {
            Ok(_) => Ok(x),
            Err(e) => {
                x.teardown(&mut Vec::new());
                Err(e)
            }
        }
    }

    /// Bytes in use on it once it is synced.
    fn used(&self, log: &Path) -> Outcome<i64> {
        let r = self.root.display();
        let used = sh(
            &format!("sync -f {r} && df -B1 --output=used {r} | tail -n 1"),
            log,
        )?;
        used.parse()
            .map_err(|_| format!("df gave no used bytes: {used:?}"))
    }

    /// Unmounts it, detaches its loop device, removes its image; problems go to `problems`.
    fn teardown(self, problems: &mut Vec<String>) {
        let (r, log) = (self.root.display(), self.root.with_extension("log"));
        if let Err(e) = sh(&format!("! mountpoint -q {r} || umount {r}"), &log) {
            problems.push(format!("umount {r} failed: {e}"));
        }
        if let Some(dev) = &self.dev {
            if let Err(e) = sh(&format!("losetup -d {dev}"), &log) {
                problems.push(format!("losetup -d {dev} failed: {e}"));
            }
        }
        // The image lives in the guest's tmpfs, which goes with the guest.
        let _ = fs::remove_file(&self.img);
    }
}

/// File volumes of each `SNAPSHOT_GIB` size on an XFS with reflink: the floor of any call
/// (`ublkctl node-info`, `SNAPSHOT_REPEATS` times), then [`snapshot_size`] per size.
/// Snapshots, volumes, the daemon, the file system and its loop device are all gone at the end
/// (or the case's teardown says why not).
pub fn snapshot_case(g: &Guest) -> Case {
    let gib: Vec<String> = SNAPSHOT_GIB.iter().map(u64::to_string).collect();
    note(&format!(
        "{SNAPSHOT_RUN}: file volumes of {} GiB on XFS (reflink=1), {SNAPSHOT_REPEATS} \
         snapshots and clones of each",
        gib.join(" ")
    ));
    let node = match Node::new(g, SNAPSHOT_RUN, SNAPSHOT_METRICS) {
        Ok(n) => n,
        Err(why) => return failed(SNAPSHOT_RUN, why),
    };
    let xfs = match Xfs::make(&node) {
        Ok(x) => x,
        Err(e) => {
            return failed(
                SNAPSHOT_RUN,
                format!("no XFS with reflink for the volumes: {e}"),
            )
        }
    };
    let mut case = node.serve(SNAPSHOT_RUN, |node| snapshots(node, &xfs));
    xfs.teardown(&mut case.teardown);
    case
}

fn snapshots(node: &mut Node, xfs: &Xfs) -> Outcome<Measured> {
    let info = sh(
        &format!("xfs_info {}", xfs.root.display()),
        &node.d.join("fs.log"),
    );
    let reflink = info.ok().map(|o| o.contains("reflink=1"));
    let err = node.d.join("noop.err");
    let noop_ms = (0..SNAPSHOT_REPEATS)
        .map(|_| match timed(|| node.ctl("node-info", &err)) {
            (Ok(_), ms) => Ok(ms),
            (Err(e), _) => Err(format!("ublkctl node-info failed {e}")),
        })
        .collect();
    let mut snaps = Vec::new();
    let sizes = SNAPSHOT_GIB
        .iter()
        .map(|&gib| snapshot_size(node, xfs, gib, &mut snaps))
        .collect();
    for sid in snaps {
        if let Err(e) = node.ctl(
            &format!("delete-snapshot {sid}"),
            &node.d.join("delete.err"),
        ) {
            node.problems
                .push(format!("delete-snapshot {sid} failed {e}"));
        }
    }
    Ok(Measured::Snapshots(Snapshots {
        noop_ms,
        sizes,
        reflink,
    }))
}

/// One size: `src-Ng` on a new sparse backing file (its create timed), `SNAPSHOT_FILL_MIB` MiB
/// written into it by fio (randwrite 64k across the whole volume, so that the file has
/// thousands of extents), synced, its extents counted (filefrag). Then `SNAPSHOT_REPEATS` times
/// create-snapshot and create-volume --from-snapshot, each timed with df's used bytes around
/// it. The snapshots made go into `snaps`.
fn snapshot_size(node: &mut Node, xfs: &Xfs, gib: u64, snaps: &mut Vec<String>) -> SnapSize {
    let d = node.d.clone();
    let s = format!("{gib}g");
    let (src, size) = (format!("src-{s}"), format!("{gib}GiB"));
    let backend = |name: &str| format!("file+create:{}/{name}.img", xfs.root.display());
    let mut z = SnapSize {
        gib,
        create_ms: Err(String::new()),
        snapshot: Err(String::new()),
        clone: Err(String::new()),
        extents: None,
    };
    let fail = |mut z: SnapSize, why: String| {
        z.create_ms = z.create_ms.or(Err(why.clone()));
        (z.snapshot, z.clone) = (Err(why.clone()), Err(why));
        z
    };
    let create = format!("--size {size} --backend {}", backend(&src));
    let dev = match node.create(&src, &create, &d.join("create.err")) {
        Ok((dev, ms)) => {
            z.create_ms = Ok(ms);
            dev
        }
        Err(e) => return fail(z, e),
    };
    let json = d.join(format!("fill.{s}.json"));
    let args = format!(
        "{DIRECT} --bs=64k --rw=randwrite --iodepth=16 --numjobs=1 --io_size={SNAPSHOT_FILL_MIB}m"
    );
    let c = fio(120, "fill", &dev, &json, &args);
    if let Err(e) = run(c, &json, &d.join(format!("fill.{s}.log"))) {
        return fail(
            z,
            format!("fio writing {SNAPSHOT_FILL_MIB} MiB into {src} failed: {e}"),
        );
    }
    let img = xfs.root.join(format!("{src}.img"));
    let frag = sh(
        &format!("sync && filefrag {}", img.display()),
        &d.join("fs.log"),
    );
    let frag = frag.unwrap_or_default();
    note(&format!("{SNAPSHOT_RUN}: {frag}"));
    // `PATH: 4093 extents found`
    z.extents = frag
        .rsplit_once(": ")
        .and_then(|(_, t)| t.split(' ').next()?.parse().ok());
    let (mut snapshot, mut clone) = (Vec::new(), Vec::new());
    let mut failure = None;
    for k in 1..=SNAPSHOT_REPEATS {
        let (sid, name) = (format!("snap-{s}-{k}"), format!("clone-{s}-{k}"));
        let args = format!("create-snapshot {sid} --volume {src}");
        let made = call(node, xfs, &args, &d.join("snapshot.err")).and_then(|(_, t)| {
            snaps.push(sid.clone());
            t
        });
        match made {
            Ok(t) => snapshot.push(t),
            Err(e) => {
                failure = Some((true, e));
                break;
            }
        }
        let from = format!("--from-snapshot {sid} --backend {}", backend(&name));
        let args = format!("create-volume {name} --size {size} {from}");
        let made = call(node, xfs, &args, &d.join("clone.err")).and_then(|(dev, t)| {
            node.volumes.push((name.clone(), dev.into()));
            t
        });
        match made {
            Ok(t) => clone.push(t),
            Err(e) => {
                failure = Some((false, e));
                break;
            }
        }
    }
    note(&format!(
        "{SNAPSHOT_RUN}: {s}: {} snapshots, {} clones timed",
        snapshot.len(),
        clone.len()
    ));
    (z.snapshot, z.clone) = match failure {
        None => (Ok(snapshot), Ok(clone)),
        // A clone needs its snapshot: when that failed, that is why there is no clone.
        Some((true, e)) => (Err(e.clone()), Err(format!("no snapshot to clone: {e}"))),
        Some((false, e)) => (Ok(snapshot), Err(e)),
    };
    z
}

/// `ublkctl ARGS` timed: its output, and the call with the growth of the file system's used
/// bytes over it (which df may have failed to give), or why the call failed.
fn call(node: &Node, xfs: &Xfs, args: &str, err: &Path) -> Outcome<(String, Outcome<Timed>)> {
    let u0 = xfs.used(err);
    let (r, ms) = timed(|| node.ctl(args, err));
    let what: Vec<&str> = args.split(' ').take(2).collect();
    let out = r.map_err(|e| format!("{} failed {e}", what.join(" ")))?;
    let growth = xfs.used(err).and_then(|u1| Ok((u1 - u0?) as f64 / 1024.0));
    Ok((out, growth.map(|growth_kib| Timed { ms, growth_kib })))
}
