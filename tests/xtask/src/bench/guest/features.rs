//! The node service's features, measured: QoS limits against fio, and snapshots and clones on
//! an XFS with reflink.

use super::super::cases::{
    QosLimit, QOS_JOBS, QOS_QD, QOS_RUN, QOS_RUNTIME_SECS, QOS_SIZE, SNAPSHOT_FILL_MIB,
    SNAPSHOT_FS_GIB, SNAPSHOT_GIB, SNAPSHOT_REPEATS, SNAPSHOT_RUN,
};
use super::super::results::{Case, Measured, Outcome, Qos, SnapSize, Snapshots, Timed};
use super::fio::{fio, job, run, DIRECT};
use super::proc::{failed, sh, Guest, Node};
use std::fs;
use std::path::{Path, PathBuf};

/// One null volume per QoS job, its limit set at create-volume, fio at `QOS_QD` on it for
/// `QOS_RUNTIME_SECS` after 1 s of ramp (the burst allowance is spent in the ramp), deleted
/// before the next.
pub fn qos_case(g: &Guest) -> Case {
    note!(
        "{QOS_RUN}: null volumes with I/O limits, fio {QOS_RUNTIME_SECS} s at QD{QOS_QD} on each"
    );
    Node::run(g, QOS_RUN, |node| {
        let jobs = QOS_JOBS.map(|limit| (limit.id(), qos_job(node, limit)));
        Ok(Measured::Qos(Qos { jobs: jobs.into() }))
    })
}

/// The figure fio measured that the job's limit bounds: read IOPS, or write MiB/s.
fn qos_job(node: &mut Node, limit: QosLimit) -> Outcome<f64> {
    let (d, id, (rw, bs)) = (node.d.clone(), limit.id(), limit.fio());
    let volume = format!("--size {QOS_SIZE} --backend null {}", limit.flags());
    let (dev, _) = node.create(&id, &volume, &d.join("create.err"))?;
    let json = d.join(format!("{id}.json"));
    let job = job(rw, bs, QOS_QD, QOS_RUNTIME_SECS);
    let args = format!("{DIRECT} {job} --ramp_time=1");
    let c = fio(QOS_RUNTIME_SECS, &id, &dev, &json, &args);
    let measured = run(c, &json, &d.join(format!("{id}.log"))).and_then(|j| {
        let (dir, name, rate) = match limit {
            QosLimit::WriteMibps(_) => (&j.write, "write", j.write.bw_bytes / (1 << 20) as f64),
            QosLimit::Unlimited | QosLimit::ReadIops(_) => (&j.read, "read", j.read.iops),
        };
        match dir.total_ios {
            0 => Err(format!("fio completed no {name}")),
            _ => Ok(rate),
        }
    });
    note!("{id}: {measured:?}");
    node.problems
        .extend(node.delete(&id, &d.join("delete.err")).err());
    measured
}

/// The snapshot run's file system: an XFS with reflink=1 on a loop device (`dev`) over a sparse
/// file in the tmpfs (`img`), mounted as the node's allowed root.
#[derive(Debug)]
struct Xfs {
    img: PathBuf,
    root: PathBuf,
    dev: String,
}

impl Xfs {
    /// Makes and mounts it on the node's root; how that went is in `fs.log`.
    fn make(node: &Node) -> Outcome<Self> {
        let log = node.d.join("fs.log");
        let (img, root) = (node.c.join("xfs.img"), node.c.join("roots"));
        let (i, r) = (img.display(), root.display());
        let losetup = format!("truncate -s {SNAPSHOT_FS_GIB}G {i} && losetup --find --show {i}");
        let dev = sh(&losetup, &log)?;
        let mkfs = format!("mkfs.xfs -q -f -m reflink=1 {dev} && mount {dev} {r}");
        let made = sh(&mkfs, &log);
        let x = Self { img, root, dev };
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
        let df = format!("sync -f {r} && df -B1 --output=used {r} | tail -n 1");
        let used = sh(&df, log)?;
        used.parse()
            .map_err(|_| format!("df gave no used bytes: {used:?}"))
    }

    /// Unmounts it, detaches its loop device, removes its image; problems go to `problems`.
    fn teardown(self, problems: &mut Vec<String>) {
        let (r, dev) = (self.root.display(), &self.dev);
        let log = self.root.with_extension("log");
        if let Err(e) = sh(&format!("! mountpoint -q {r} || umount {r}"), &log) {
            problems.push(format!("umount {r} failed: {e}"));
        }
        if let Err(e) = sh(&format!("losetup -d {dev}"), &log) {
            problems.push(format!("losetup -d {dev} failed: {e}"));
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
    note!(
        "{SNAPSHOT_RUN}: file volumes of {} GiB on XFS (reflink=1), {SNAPSHOT_REPEATS} \
         snapshots and clones of each",
        gib.join(" ")
    );
    let made = Node::new(g, SNAPSHOT_RUN).and_then(|node| {
        let xfs = Xfs::make(&node);
        xfs.map(|x| (node, x))
            .map_err(|e| format!("no XFS with reflink for the volumes: {e}"))
    });
    let (node, xfs) = match made {
        Ok(made) => made,
        Err(why) => return failed(SNAPSHOT_RUN, why),
    };
    let mut case = node.serve(SNAPSHOT_RUN, |node| snapshots(node, &xfs));
    xfs.teardown(&mut case.teardown);
    case
}

fn snapshots(node: &mut Node, xfs: &Xfs) -> Outcome<Measured> {
    let log = node.d.join("fs.log");
    let info = sh(&format!("xfs_info {}", xfs.root.display()), &log);
    let reflink = info.ok().map(|o| o.contains("reflink=1"));
    let err = node.d.join("noop.err");
    let noop_ms = (0..SNAPSHOT_REPEATS)
        .map(|_| node.call("node-info", &err).map(|(_, ms)| ms))
        .collect();
    let mut snaps = Vec::new();
    let sizes = SNAPSHOT_GIB.map(|gib| snapshot_size(node, xfs, gib, &mut snaps));
    for sid in snaps {
        let args = format!("delete-snapshot {sid}");
        let deleted = node.call(&args, &node.d.join("delete.err"));
        node.problems.extend(deleted.err());
    }
    let sizes = sizes.into();
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
/// it, until one fails. The snapshots made go into `snaps`.
fn snapshot_size(node: &mut Node, xfs: &Xfs, gib: u64, snaps: &mut Vec<String>) -> SnapSize {
    let (d, s) = (node.d.clone(), format!("{gib}g"));
    let (src, size) = (format!("src-{s}"), format!("{gib}GiB"));
    let backend = |name: &str| format!("file+create:{}/{name}.img", xfs.root.display());
    let create = format!("--size {size} --backend {}", backend(&src));
    let made = node.create(&src, &create, &d.join("create.err"));
    let create_ms = made.as_ref().map(|(_, ms)| *ms).map_err(Clone::clone);
    let filled = made.and_then(|(dev, _)| {
        let json = d.join(format!("fill.{s}.json"));
        let fill = format!("--bs=64k --rw=randwrite --iodepth=16 --io_size={SNAPSHOT_FILL_MIB}m");
        let args = format!("{DIRECT} {fill}");
        let log = d.join(format!("fill.{s}.log"));
        run(fio(120, "fill", &dev, &json, &args), &json, &log)
            .map_err(|e| format!("fio writing {SNAPSHOT_FILL_MIB} MiB into {src} failed: {e}"))
    });
    let mut z = SnapSize {
        gib,
        create_ms,
        snapshot: Ok(Vec::new()),
        clone: Ok(Vec::new()),
        extents: None,
    };
    if let Err(e) = filled {
        (z.snapshot, z.clone) = (Err(e.clone()), Err(e));
        return z;
    }
    let img = xfs.root.join(format!("{src}.img"));
    let frag = format!("sync && filefrag {}", img.display());
    let frag = sh(&frag, &d.join("fs.log")).unwrap_or_default();
    note!("{SNAPSHOT_RUN}: {frag}");
    // `PATH: 4093 extents found`
    z.extents = frag
        .rsplit_once(": ")
        .and_then(|(_, t)| t.split(' ').next()?.parse().ok());
    for k in 1..=SNAPSHOT_REPEATS {
        let (sid, name) = (format!("snap-{s}-{k}"), format!("clone-{s}-{k}"));
        let args = format!("create-snapshot {sid} --volume {src}");
        let made = call(node, xfs, &args, &d.join("snapshot.err")).and_then(|(_, t)| {
            snaps.push(sid.clone());
            t
        });
        if let Err(e) = push(&mut z.snapshot, made) {
            // A clone needs its snapshot: when that failed, that is why there is no clone.
            z.clone = Err(format!("no snapshot to clone: {e}"));
            break;
        }
        let from = format!("--from-snapshot {sid} --backend {}", backend(&name));
        let args = format!("create-volume {name} --size {size} {from}");
        let made = call(node, xfs, &args, &d.join("clone.err")).and_then(|(dev, t)| {
            node.volumes.push((name.clone(), dev.into()));
            t
        });
        if push(&mut z.clone, made).is_err() {
            break;
        }
    }
    let n = |l: &Outcome<Vec<Timed>>| l.as_ref().map_or(0, Vec::len);
    let (ns, nc) = (n(&z.snapshot), n(&z.clone));
    note!("{SNAPSHOT_RUN}: {s}: {ns} snapshots, {nc} clones timed");
    z
}

/// `t` added to `list`, or its failure in `list`'s place (and returned).
fn push(list: &mut Outcome<Vec<Timed>>, t: Outcome<Timed>) -> Outcome<()> {
    match (list.as_mut(), t) {
        (Ok(l), Ok(t)) => {
            l.push(t);
            Ok(())
        }
        (_, Err(e)) => {
            *list = Err(e.clone());
            Err(e)
        }
        (Err(e), _) => Err(e.clone()),
    }
}

/// `ublkctl ARGS` timed: its output, and the call with the growth of the file system's used
/// bytes over it (which df may have failed to give), or why the call failed.
fn call(node: &Node, xfs: &Xfs, args: &str, err: &Path) -> Outcome<(String, Outcome<Timed>)> {
    let u0 = xfs.used(err);
    let (out, ms) = node.call(args, err)?;
    let growth = xfs.used(err).and_then(|u1| Ok((u1 - u0?) as f64 / 1024.0));
    Ok((out, growth.map(|growth_kib| Timed { ms, growth_kib })))
}
