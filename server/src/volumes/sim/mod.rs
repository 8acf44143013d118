//! A seeded, deterministic simulation of the volume manager: random histories of creates (every
//! backend, NVMe windows placed and explicit, `keep_data`, clones from volumes and snapshots,
//! two volumes cloning each other at once), deletes, resizes, QoS changes, snapshots, orphan
//! adoption and deletion, the CSI report, concurrent calls on the same and on different
//! volumes and retries, over a simulated kernel (`kernel`) whose calls fail early or part way,
//! are slow or hang, and a process that dies at any registry write or device call (a write torn
//! by the crash) and restarts. Invariants are checked after every step.
//!
//! Deterministic: one thread (tokio's current-thread runtime), virtual time (paused clock),
//! device calls answered inline (`simctx`), every choice from one seed. `cargo test` runs a
//! budget of seeds; `UBLKD_SIM_SEED=N` replays one with its whole history, `UBLKD_SIM_SEEDS=N`
//! sets the budget (`cargo xtask sim --seeds N`). A failure prints its seed and a history
//! shortened to the steps that still make it fail.

mod cases;
mod kernel;
mod rng;

use super::Volumes;
use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::devices::Devices;
use crate::record::{volume_registry, SourceRecord, VolumeRecord};
use crate::registry::Registry;
use crate::simctx;
use crate::snapshot::SnapshotId;
use crate::volume::{State, Volume};
use crate::volume_id::VolumeId;
use kernel::{Call, SimKernel, CHUNK, NS_BYTES, NS_PATHS};
use rng::Rng;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;
use ublkd_dataplane::{DevId, QosLimits};

const VOLUME_IDS: [&str; 5] = ["a", "b", "c", "d", "e"];
const SNAPSHOT_IDS: [&str; 2] = ["s1", "s2"];
const FILES: [&str; 4] = ["f1", "f2", "f3", "f4"];
/// Steps in one history.
const STEPS: usize = 24;
/// Seeds `cargo test` runs.
const BUDGET: u64 = 2_000;
/// A step whose calls have not all answered after this much virtual time is a deadlock.
const BOUND: Duration = Duration::from_secs(600);

/// One call of the manager's API.
#[derive(Debug, Clone)]
enum Op {
    Create {
        record: VolumeRecord,
        place: bool,
    },
    Delete {
        id: VolumeId,
        backing: bool,
    },
    Resize {
        id: VolumeId,
        grow: u64,
    },
    Qos {
        id: VolumeId,
        iops: u64,
    },
    Snapshot {
        id: SnapshotId,
        volume: VolumeId,
    },
    DeleteSnapshot {
        id: SnapshotId,
    },
    Report {
        ids: Vec<VolumeId>,
    },
    Adopt {
        dev: DevId,
        record: VolumeRecord,
    },
    DeleteOrphan {
        dev: DevId,
    },
    /// A device no ublkd of this node made appears (another ublk server's): an orphan.
    Foreign {
        dev: DevId,
        size: u64,
    },
    /// A process opens volume `id`'s device without O_EXCL (`open`), or closes it.
    Hold {
        id: VolumeId,
        open: bool,
    },
}

impl std::fmt::Display for Op {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Op::Create { record, place } => {
                write!(f, "create {} {}MiB ", record.id, record.size_bytes / CHUNK)?;
                match &record.backend {
                    BackendRecord::File { path, .. } => {
                        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
                        write!(f, "file {}", name.unwrap_or_default())?;
                    }
                    BackendRecord::Nvme {
                        offset,
                        length,
                        keep_data,
                        ..
                    } => {
                        if let BackendRecord::Nvme { device, .. } = &record.backend {
                            let name = device.file_name().map(|n| n.to_string_lossy().into_owned());
                            write!(f, "{} ", name.unwrap_or_default())?;
                        }
                        if *place && *length != 0 {
                            write!(f, "nvme placed +{length}")?;
                        } else if *place {
                            write!(f, "nvme placed")?;
                        } else {
                            write!(f, "nvme @{}MiB+{}MiB", offset / CHUNK, length / CHUNK)?;
                        }
                        if *keep_data {
                            write!(f, " keep_data")?;
                        }
                    }
                    // A kind with nothing more to say than its name (null, ram).
                    other => write!(f, "{}", other.kind())?,
                }
                match &record.source {
                    Some(SourceRecord::Volume(v)) => write!(f, " from volume {v}"),
                    Some(SourceRecord::Snapshot(s)) => write!(f, " from snapshot {s}"),
                    None => Ok(()),
                }
            }
            Op::Delete { id, backing } => {
                write!(f, "delete {id}{}", if *backing { " +file" } else { "" })
            }
            Op::Resize { id, grow } => write!(f, "resize {id} +{}MiB", grow / CHUNK),
            Op::Qos { id, iops } => write!(f, "qos {id} {iops} iops"),
            Op::Snapshot { id, volume } => write!(f, "snapshot {id} of {volume}"),
            Op::DeleteSnapshot { id } => write!(f, "delete snapshot {id}"),
            Op::Report { ids } => write!(f, "report without pv {ids:?}"),
            Op::Adopt { dev, record } => write!(f, "adopt {dev} as {}", record.id),
            Op::DeleteOrphan { dev } => write!(f, "delete orphan {dev}"),
            Op::Foreign { dev, size } => {
                write!(f, "foreign device {dev} of {}MiB appears", size / CHUNK)
            }
            Op::Hold { id, open: true } => write!(f, "open {id}'s device (another process)"),
            Op::Hold { id, open: false } => write!(f, "close {id}'s device (another process)"),
        }
    }
}

/// One step of a history: calls made at once, under faults or not, maybe with the process
/// dying at its n-th effect.
#[derive(Debug, Clone)]
struct Step {
    ops: Vec<Op>,
    faults: bool,
    crash: Option<(u64, bool)>,
    /// After the step's calls the node reboots (no device survives), the namespaces' names
    /// swapped when `true`, and ublkd starts again.
    reboot: Option<bool>,
    /// Each create that succeeded is made again, alone: it must answer as it did.
    retry: bool,
    /// Seeds this step's interleaving and the kernel's faults: a step behaves the same
    /// whichever steps came before it, so a history shortens well.
    seed: u64,
}

impl std::fmt::Display for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let ops: Vec<String> = self.ops.iter().map(ToString::to_string).collect();
        write!(f, "[{}]", ops.join(" | "))?;
        if self.faults {
            write!(f, " with faults")?;
        }
        if let Some((n, after)) = self.crash {
            let when = if after { "after" } else { "at" };
            write!(f, ", dies {when} effect {n}")?;
        }
        match self.reboot {
            Some(true) => write!(f, ", then the node reboots with its NVMe names swapped")?,
            Some(false) => write!(f, ", then the node reboots")?,
            None => {}
        }
        Ok(())
    }
}

fn vid(s: &str) -> VolumeId {
    VolumeId::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn sid(s: &str) -> SnapshotId {
    SnapshotId::parse(s).unwrap_or_else(|e| panic!("{s}: {e}"))
}

fn base_record(id: VolumeId, size_bytes: u64, backend: BackendRecord) -> VolumeRecord {
    VolumeRecord::example(id, size_bytes, backend)
}

/// Where a history's files live: tmpfs when there is one (fsync is free there).
struct Dirs {
    _tmp: tempfile::TempDir,
    state: PathBuf,
    files: PathBuf,
}

impl Dirs {
    fn new() -> Self {
        let shm = Path::new("/dev/shm");
        let tmp = if shm.is_dir() {
            tempfile::tempdir_in(shm)
        } else {
            tempfile::tempdir()
        }
        .unwrap_or_else(|e| panic!("tempdir: {e}"));
        let state = tmp.path().join("state");
        let files = tmp.path().join("files");
        std::fs::create_dir_all(&files).unwrap_or_else(|e| panic!("{e}"));
        Dirs {
            state,
            files,
            _tmp: tmp,
        }
    }
}

/// Where generated histories name their backing files; `Op::at` puts them in a run's own
/// directory, so a history replays the same in any.
const FILES_ROOT: &str = "/sim-files";

impl Op {
    /// The volume the call is about.
    fn volume(&self) -> Option<&VolumeId> {
        match self {
            Op::Create { record, .. } | Op::Adopt { record, .. } => Some(&record.id),
            Op::Delete { id, .. }
            | Op::Resize { id, .. }
            | Op::Qos { id, .. }
            | Op::Hold { id, .. } => Some(id),
            Op::Snapshot { volume, .. } => Some(volume),
            Op::DeleteSnapshot { .. }
            | Op::Report { .. }
            | Op::DeleteOrphan { .. }
            | Op::Foreign { .. } => None,
        }
    }

    fn at(mut self, files: &Path) -> Self {
        if let Op::Create { record, .. } = &mut self {
            if let BackendRecord::File { path, .. } = &mut record.backend {
                if let Ok(rest) = path.strip_prefix(FILES_ROOT) {
                    *path = files.join(rest);
                }
            }
        }
        self
    }
}

fn gen_record(rng: &mut Rng, files: &Path, id: VolumeId) -> (VolumeRecord, bool) {
    let size = (1 + rng.below(4)) * CHUNK;
    let roll = rng.below(100);
    let file = |rng: &mut Rng| BackendRecord::File {
        path: files.join(format!("{}.img", rng.pick(&FILES))),
        create: true,
    };
    let (backend, place) = match roll {
        0..=9 => (BackendRecord::Null, false),
        10..=21 => (BackendRecord::Ram, false),
        22..=46 => (file(rng), false),
        47..=71 => (
            BackendRecord::Nvme {
                device: PathBuf::from(rng.pick(&NS_PATHS)),
                offset: 0,
                // Mostly placed to the size; sometimes a length a client got wrong: one near
                // u64::MAX (its rounding must not wrap to "the end"), one past the namespace,
                // one below the size.
                length: match rng.below(20) {
                    0 => u64::MAX - rng.below(3) * CHUNK,
                    1 => NS_BYTES + CHUNK,
                    2 => size - CHUNK / 2,
                    _ => 0,
                },
                keep_data: rng.chance(5),
                identity: None,
            },
            true,
        ),
        _ => {
            let offset = rng.below(NS_BYTES / CHUNK) * CHUNK;
            let length = match rng.below(3) {
                0 => 0,
                1 => size,
                _ => size + CHUNK,
            };
            (
                BackendRecord::Nvme {
                    device: PathBuf::from(rng.pick(&NS_PATHS)),
                    offset,
                    length,
                    keep_data: rng.chance(5),
                    identity: None,
                },
                false,
            )
        }
    };
    let mut record = base_record(id, size, backend);
    if matches!(record.backend, BackendRecord::File { .. }) && rng.chance(25) {
        record.source = Some(if rng.chance(50) {
            SourceRecord::Volume(vid(rng.pick(&VOLUME_IDS)))
        } else {
            SourceRecord::Snapshot(sid(rng.pick(&SNAPSHOT_IDS)))
        });
    }
    (record, place)
}

fn gen_op(rng: &mut Rng, files: &Path) -> Op {
    let id = vid(rng.pick(&VOLUME_IDS));
    match rng.below(100) {
        0..=39 => {
            let (record, place) = gen_record(rng, files, id);
            Op::Create { record, place }
        }
        40..=59 => Op::Delete {
            id,
            backing: rng.chance(50),
        },
        60..=71 => Op::Resize {
            id,
            grow: (1 + rng.below(3)) * CHUNK,
        },
        72..=73 => Op::Hold {
            id,
            open: rng.chance(60),
        },
        74..=77 => Op::Qos {
            id,
            iops: 100 * (1 + rng.below(4)),
        },
        78..=85 => Op::Snapshot {
            id: sid(rng.pick(&SNAPSHOT_IDS)),
            volume: id,
        },
        86..=89 => Op::DeleteSnapshot {
            id: sid(rng.pick(&SNAPSHOT_IDS)),
        },
        90..=92 => Op::Report {
            ids: VOLUME_IDS
                .iter()
                .filter(|_| rng.chance(40))
                .map(|s| vid(s))
                .collect(),
        },
        93..=95 => Op::Foreign {
            dev: foreign_dev(rng),
            size: (1 + rng.below(4)) * CHUNK,
        },
        96..=98 => Op::Adopt {
            dev: orphan_dev(rng),
            record: base_record(
                id,
                0,
                if rng.chance(50) {
                    BackendRecord::Null
                } else {
                    BackendRecord::Ram
                },
            ),
        },
        _ => Op::DeleteOrphan {
            dev: orphan_dev(rng),
        },
    }
}

/// The ids foreign devices take: above those ublkd gives its volumes in a history.
fn foreign_dev(rng: &mut Rng) -> DevId {
    DevId(20 + rng.below(2) as u32)
}

/// A device to adopt or delete as an orphan: mostly one a foreign device may hold, else any.
fn orphan_dev(rng: &mut Rng) -> DevId {
    if rng.chance(85) {
        foreign_dev(rng)
    } else {
        DevId(rng.below(6) as u32)
    }
}

/// The history seed `seed` makes.
fn history(seed: u64) -> Vec<Step> {
    let files = Path::new(FILES_ROOT);
    let mut rng = Rng::new(seed);
    (0..STEPS)
        .map(|_| {
            let ops = if rng.chance(5) {
                // Two volumes cloning each other at once.
                let (a, b) = (vid(rng.pick(&VOLUME_IDS)), vid(rng.pick(&VOLUME_IDS)));
                [(a.clone(), b.clone()), (b, a)]
                    .into_iter()
                    .map(|(id, from)| {
                        let mut record = base_record(
                            id,
                            CHUNK,
                            BackendRecord::File {
                                path: files.join(format!("{}.img", rng.pick(&FILES))),
                                create: true,
                            },
                        );
                        record.source = Some(SourceRecord::Volume(from));
                        Op::Create {
                            record,
                            place: false,
                        }
                    })
                    .collect()
            } else {
                let n = 1 + rng.below(3) as usize;
                let mut ops: Vec<Op> = (0..n).map(|_| gen_op(&mut rng, files)).collect();
                if rng.chance(10) {
                    // The same call twice at once (a client's retry racing the first).
                    ops.push(ops[0].clone());
                }
                ops
            };
            Step {
                ops,
                faults: rng.chance(30),
                crash: rng.chance(15).then(|| (1 + rng.below(6), rng.chance(50))),
                reboot: rng.chance(5).then(|| rng.chance(60)),
                retry: rng.chance(30),
                seed: rng.next_u64(),
            }
        })
        .collect()
}

/// What one call answered, short.
#[derive(Debug, Clone)]
struct Answer {
    text: String,
    created: Option<Volume>,
}

async fn apply(v: Arc<Volumes>, kernel: Arc<SimKernel>, op: Op) -> Answer {
    // Calls of one step start in an order the seed chooses.
    simctx::schedule_point().await;
    fn text<T>(r: &Result<T, crate::error::VolumeError>) -> String {
        match r {
            Ok(_) => "ok".into(),
            Err(e) => format!("error: {e}"),
        }
    }
    let plain = |text: String| Answer {
        text,
        created: None,
    };
    match op {
        Op::Create { record, place } => {
            let r = v.create(record, place).await;
            Answer {
                text: text(&r),
                created: r.ok(),
            }
        }
        Op::Delete { id, backing } => plain(text(&v.delete(&id, true, backing, false).await)),
        Op::Resize { id, grow } => {
            let size = v.get(&id).await.map_or(CHUNK, |x| x.record.size_bytes) + grow;
            plain(text(&v.resize(&id, size).await))
        }
        Op::Qos { id, iops } => {
            let qos = QosLimits {
                read_iops: iops,
                ..QosLimits::default()
            };
            plain(text(&v.set_qos(&id, qos).await))
        }
        Op::Snapshot { id, volume } => plain(text(&v.create_snapshot(id, volume).await)),
        Op::DeleteSnapshot { id } => plain(text(&v.delete_snapshot(&id, true).await)),
        Op::Report { ids } => {
            let new = v.report_without_pv(ids).await;
            plain(format!("ok (new {new:?})"))
        }
        Op::Adopt { dev, record } => plain(text(&v.adopt(dev, record).await)),
        Op::DeleteOrphan { dev } => plain(text(&v.delete_orphan(dev).await)),
        // Done as the step began (`run_steps`): an open racing a delete's check of its
        // holders is a race no server can close, not what this models.
        Op::Hold { .. } => plain("ok (as the step began)".into()),
        Op::Foreign { dev, size } => match kernel.foreign(dev, size) {
            true => plain("ok".into()),
            false => plain("error: the id is taken".into()),
        },
    }
}

fn volumes(state: &Path, kernel: &Arc<SimKernel>) -> Volumes {
    volumes_limited(state, kernel, None)
}

/// `volumes` under a memory limit (ublkd's cgroup's `memory.max`).
fn volumes_limited(state: &Path, kernel: &Arc<SimKernel>, memory_limit: Option<u64>) -> Volumes {
    let mut settings = Settings {
        state_dir: state.to_owned(),
        ram_dir: state.join("ram"),
        memory_limit,
        ..Settings::default()
    };
    settings.limits.allow_keep_data = true;
    std::fs::create_dir_all(state.join("ram")).unwrap_or_else(|e| panic!("ram dir: {e}"));
    Volumes::new(
        Ok(Arc::clone(kernel) as Arc<dyn Devices>),
        volume_registry(state).unwrap_or_else(|e| panic!("registry: {e}")),
        Registry::open_dir(state.join("snapshots")).unwrap_or_else(|e| panic!("snapshots: {e}")),
        Registry::open_dir(state.join("intents")).unwrap_or_else(|e| panic!("intents: {e}")),
        Arc::new(settings),
    )
}

/// The memory limit of a history: none for odd seeds; for even ones room for three volumes'
/// copy buffers and 8 MiB of RAM pages, so that creates and resizes meet it.
fn memory_limit(seed: u64) -> Option<u64> {
    let one = crate::capacity::memory_bytes(&base_record(vid("m"), 0, BackendRecord::Null));
    (seed % 2 == 0).then(|| crate::capacity::MEMORY_RESERVE + 3 * one + 8 * CHUNK)
}

/// The records on disk, read without touching anything (a load would tidy up).
fn on_disk(state: &Path) -> Vec<VolumeRecord> {
    let Ok(dir) = std::fs::read_dir(state.join("registry")) else {
        return Vec::new();
    };
    let mut all: Vec<VolumeRecord> = dir
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
        .filter_map(|e| std::fs::read(e.path()).ok())
        .filter_map(|b| serde_json::from_slice(&b).ok())
        .collect();
    all.sort_by(|a, b| a.id.cmp(&b.id));
    all
}

/// The namespace range a record's window claims: its namespace (by identity, else by path),
/// offset and length.
fn window(r: &VolumeRecord) -> Option<(String, u64, u64)> {
    match &r.backend {
        BackendRecord::Nvme {
            offset,
            length,
            identity,
            device,
            ..
        } => Some((
            identity
                .as_ref()
                .map_or_else(|| device.display().to_string(), ToString::to_string),
            *offset,
            if *length == 0 {
                NS_BYTES.saturating_sub(*offset)
            } else {
                *length
            },
        )),
        _ => None,
    }
}

/// The invariants, with no call in flight. `restored`: right after a restart, when every
/// volume must serve again.
async fn check(
    v: &Volumes,
    kernel: &SimKernel,
    state: &Path,
    restored: bool,
) -> Result<(), String> {
    let violations = std::mem::take(&mut kernel.world().violations);
    if !violations.is_empty() {
        return Err(violations.join("; "));
    }
    // Registry writes fsync: on ublkd's two runtime threads one would stall the API and every
    // other volume's change for as long (review L7, issue 55).
    let inline = simctx::take_inline_writes();
    if !inline.is_empty() {
        return Err(format!(
            "registry writes ran on the runtime's thread, not the blocking pool: {inline:?}"
        ));
    }
    let records = on_disk(state);
    let listed = v.list().await;
    let ids = |it: &mut dyn Iterator<Item = VolumeId>| it.collect::<Vec<_>>();
    let on_disk_ids = ids(&mut records.iter().map(|r| r.id.clone()));
    let listed_ids = ids(&mut listed.iter().map(|v| v.record.id.clone()));
    if on_disk_ids != listed_ids {
        return Err(format!(
            "registry and manager disagree: on disk {on_disk_ids:?}, listed {listed_ids:?}"
        ));
    }
    if let Some(limit) = v.settings().memory_limit {
        let held: u64 = records.iter().map(crate::capacity::memory_bytes).sum();
        if held > limit.saturating_sub(crate::capacity::MEMORY_RESERVE) {
            return Err(format!(
                "the volumes may hold {held} bytes of ublkd's memory, past its limit of {limit} \
                 (less the reserve)"
            ));
        }
    }
    let leftovers = kernel.unerased_leftovers(&records);
    if let Some((chunk, owner)) = leftovers.first() {
        return Err(format!(
            "chunk {chunk} still holds the data of volume {owner}, which no record names \
             ({} such chunks)",
            leftovers.len()
        ));
    }
    let devices = kernel.devices();
    // A delete a crash interrupted, whose device another process opened since: the restart
    // leaves it FAILED and marked, never pulls the device from under the opener.
    let held_delete = |r: &VolumeRecord| r.deleting && r.dev_id.is_some_and(|d| kernel.is_open(d));
    for vol in &listed {
        if restored && vol.state == State::Failed && held_delete(&vol.record) {
            continue;
        }
        if restored && vol.state != State::Ready {
            return Err(format!(
                "after the restart {} is {}: {} (records {:?}, kernel devices {devices:?})",
                vol.record.id,
                vol.state.name(),
                vol.message,
                records
                    .iter()
                    .map(|r| (r.id.as_str(), r.dev_id, window(r)))
                    .collect::<Vec<_>>()
            ));
        }
        if vol.state != State::Ready {
            continue;
        }
        let Some(dev) = &vol.device else {
            return Err(format!("{} is READY without a device", vol.record.id));
        };
        let found = devices.iter().find(|d| d.0 == dev.dev_id);
        if found != Some(&(dev.dev_id, true, vol.record.size_bytes)) {
            return Err(format!(
                "{} is READY on device {} of {} bytes, the kernel has {found:?}",
                vol.record.id, dev.dev_id, vol.record.size_bytes
            ));
        }
    }
    for (dev, owned, _) in &devices {
        if !records.iter().any(|r| r.dev_id == Some(*dev)) && !kernel.is_foreign(*dev) {
            return Err(format!(
                "kernel device {dev} (served: {owned}) is no record's"
            ));
        }
    }
    for (i, a) in records.iter().enumerate() {
        if restored && a.deleting && !held_delete(a) {
            return Err(format!(
                "after the restart {} is still marked deleting",
                a.id
            ));
        }
        for b in &records[i + 1..] {
            if a.dev_id.is_some() && a.dev_id == b.dev_id {
                return Err(format!(
                    "{} and {} both own device {:?}",
                    a.id, b.id, a.dev_id
                ));
            }
            if let (BackendRecord::File { path: p, .. }, BackendRecord::File { path: q, .. }) =
                (&a.backend, &b.backend)
            {
                if p == q {
                    return Err(format!("{} and {} both own {}", a.id, b.id, p.display()));
                }
            }
            if let (Some((n1, o1, l1)), Some((n2, o2, l2))) = (window(a), window(b)) {
                if n1 == n2 && o1 < o2 + l2 && o2 < o1 + l1 {
                    return Err(format!("{} and {} own overlapping windows", a.id, b.id));
                }
            }
        }
        if let Some((_, _, len)) = window(a) {
            if len < a.size_bytes {
                return Err(format!("{} is larger than its window", a.id));
            }
        }
    }
    Ok(())
}

/// Each `delete +file` that is done (`true`: it answered OK, or a restart finished it, its
/// intent not preceded by a recorded delete that keeps the file) left no backing file, unless
/// a record names that file again (a create of the same step).
fn files_removed(deletes: &[(&str, &PathBuf, bool)], state: &Path) -> Result<(), String> {
    let records = on_disk(state);
    for (op, path, done) in deletes {
        let named = records
            .iter()
            .any(|r| matches!(&r.backend, BackendRecord::File { path: p, .. } if p == *path));
        if *done && !named && path.exists() {
            return Err(format!("`{op}` left its backing file {}", path.display()));
        }
    }
    Ok(())
}

/// After a restart: a backing file a create of the crashed step made is a recorded volume's,
/// or gone (a create cut short before its record leaves no file nobody owns).
fn files_owned(fresh: &[PathBuf], state: &Path) -> Result<(), String> {
    let records = on_disk(state);
    for path in fresh {
        let named = records
            .iter()
            .any(|r| matches!(&r.backend, BackendRecord::File { path: p, .. } if p == path));
        if !named && path.exists() {
            return Err(format!(
                "a create cut short left its new backing file {} with no record",
                path.display()
            ));
        }
    }
    Ok(())
}

/// What running one history reached.
#[derive(Debug, Default)]
struct Coverage {
    ops: BTreeMap<String, (u64, u64)>,
    crashes: u64,
    reboots: u64,
    calls: BTreeMap<(Call, bool), u64>,
}

impl Coverage {
    fn add(&mut self, other: Coverage) {
        for (k, (ok, err)) in other.ops {
            let e = self.ops.entry(k).or_default();
            e.0 += ok;
            e.1 += err;
        }
        self.crashes += other.crashes;
        self.reboots += other.reboots;
        for (k, n) in other.calls {
            *self.calls.entry(k).or_default() += n;
        }
    }
}

/// A failed history: what went wrong, and the log of the steps up to it.
#[derive(Debug)]
struct Failure {
    what: String,
    log: String,
}

/// ublkd starting again over `state` (after a crash or a reboot): load, restore, and every
/// invariant with every volume serving again.
async fn restart(
    state: &Path,
    kernel: &Arc<SimKernel>,
    limit: Option<u64>,
) -> Result<Arc<Volumes>, String> {
    let v = Arc::new(volumes_limited(state, kernel, limit));
    v.load()
        .await
        .map_err(|e| format!("load after the restart: {e}"))?;
    v.restore().await;
    check(&v, kernel, state, true).await?;
    Ok(v)
}

/// Runs `steps` from `seed`'s kernel: Ok with what it reached, or the first invariant broken.
fn run(seed: u64, steps: &[Step], dirs: &Dirs) -> Result<Coverage, Failure> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
        .unwrap_or_else(|e| panic!("runtime: {e}"));
    simctx::set_on(true);
    let out = rt.block_on(run_steps(seed, steps, dirs));
    simctx::set_on(false);
    // Tasks that the simulated crash froze are dropped with the runtime.
    rt.shutdown_background();
    out
}

async fn run_steps(seed: u64, steps: &[Step], dirs: &Dirs) -> Result<Coverage, Failure> {
    let kernel = Arc::new(SimKernel::new(&dirs.state, seed));
    let limit = memory_limit(seed);
    let mut v = Arc::new(volumes_limited(&dirs.state, &kernel, limit));
    let mut cov = Coverage::default();
    let mut log = String::new();
    let fail = |log: &String, what: String| Failure {
        what,
        log: log.clone(),
    };
    for (i, step) in steps.iter().enumerate() {
        let _ = writeln!(log, "{i:>3}: {step}"); // writing to a String cannot fail
        kernel.reseed(step.seed, step.faults);
        simctx::seed_schedule(step.seed);
        // A process opens or closes a volume's device before the step's calls start.
        for op in &step.ops {
            if let Op::Hold { id, open } = op {
                let dev = v
                    .get(id)
                    .await
                    .ok()
                    .and_then(|x| x.device.map(|d| d.dev_id));
                if let Some(dev) = dev {
                    kernel.hold(dev, *open);
                }
            }
        }
        simctx::crash_at(step.crash);
        // The backing file each `delete +file` of the step names, as the step starts; not when
        // the step also deletes the volume keeping its file: whichever ends first decides, and
        // a delete of a volume already gone answers OK (the CSI contract) with no file to own.
        let mut removals = Vec::new();
        let keeps = |vol: &VolumeId| {
            (step.ops.iter()).any(|o| matches!(o, Op::Delete { id, backing: false } if id == vol))
        };
        for op in &step.ops {
            if let Op::Delete { id, backing: true } = op {
                if keeps(id) {
                    continue;
                }
                let Ok(vol) = v.get(id).await else { continue };
                // `kept`: an earlier delete that keeps the file is recorded; a crash before
                // this call records its own intent finishes that one.
                let recorded = on_disk(&dirs.state).into_iter().find(|r| &r.id == id);
                let kept = recorded.is_some_and(|r| r.deleting && !r.delete_backing);
                if let BackendRecord::File { path, .. } = vol.record.backend {
                    removals.push((op.to_string(), path, kept));
                }
            }
        }
        // The backing files the step's creates would make: none of them is there yet. Not
        // when the step also deletes, keeping its file, a volume one of its creates makes
        // on that file (under any id), as that create may finish and that delete leave it.
        let file_of = |o: &Op| match o.clone().at(&dirs.files) {
            Op::Create { record, .. } => match record.backend {
                BackendRecord::File { path, .. } => Some((record.id, path)),
                _ => None,
            },
            _ => None,
        };
        let fresh: Vec<PathBuf> = (step.ops.iter())
            .filter_map(file_of)
            .filter(|(_, path)| !path.exists())
            .filter(|(_, path)| {
                !(step.ops.iter())
                    .filter_map(file_of)
                    .any(|(id, p)| &p == path && keeps(&id))
            })
            .map(|(_, path)| path)
            .collect();
        let tasks: Vec<_> = step
            .ops
            .iter()
            .map(|op| {
                let (v, k) = (Arc::clone(&v), Arc::clone(&kernel));
                tokio::spawn(apply(v, k, op.clone().at(&dirs.files)))
            })
            .collect();
        let started = tokio::time::Instant::now();
        while !tasks.iter().all(|t| t.is_finished()) && !simctx::dead() {
            if started.elapsed() > BOUND {
                let stuck: Vec<String> = step
                    .ops
                    .iter()
                    .zip(&tasks)
                    .filter(|(_, t)| !t.is_finished())
                    .map(|(op, _)| op.to_string())
                    .collect();
                return Err(fail(
                    &log,
                    format!(
                        "deadlock: {stuck:?} still running after {} s (virtual)",
                        BOUND.as_secs()
                    ),
                ));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        kernel.world().faults = false;
        if simctx::dead() {
            for t in &tasks {
                t.abort();
            }
            cov.crashes += 1;
            let _ = writeln!(log, "     the process died; restart"); // a String: cannot fail
            simctx::crash_at(None);
            match step.reboot {
                Some(swap) => kernel.reboot(swap),
                None => kernel.process_died(),
            }
            v = restart(&dirs.state, &kernel, limit)
                .await
                .map_err(|w| fail(&log, w))?;
            // A delete the crash cut short finishes at the start, its file included.
            let all: Vec<_> = removals
                .iter()
                .map(|(op, p, kept)| (op.as_str(), p, !kept))
                .collect();
            files_removed(&all, &dirs.state).map_err(|w| fail(&log, w))?;
            files_owned(&fresh, &dirs.state).map_err(|w| fail(&log, w))?;
            continue;
        }
        simctx::crash_at(None);
        let mut answers = Vec::new();
        for (op, t) in step.ops.iter().zip(tasks) {
            let answer = t.await.unwrap_or_else(|e| Answer {
                text: format!("panicked: {e}"),
                created: None,
            });
            if answer.text.starts_with("panicked") {
                return Err(fail(&log, format!("{op}: {}", answer.text)));
            }
            let kind = op.to_string().split(' ').next().unwrap_or("").to_owned();
            let e = cov.ops.entry(kind).or_default();
            if answer.text.starts_with("ok") {
                e.0 += 1;
            } else {
                e.1 += 1;
            }
            let _ = writeln!(log, "     {op} -> {}", answer.text); // a String: cannot fail
            answers.push((op, answer));
        }
        check(&v, &kernel, &dirs.state, false)
            .await
            .map_err(|w| fail(&log, w))?;
        let done: Vec<_> = (removals.iter())
            .map(|(op, p, _)| {
                let ok = answers
                    .iter()
                    .any(|(o, a)| o.to_string() == *op && a.text.starts_with("ok"));
                (op.as_str(), p, ok)
            })
            .collect();
        files_removed(&done, &dirs.state).map_err(|w| fail(&log, w))?;
        if let Some(swap) = step.reboot {
            cov.reboots += 1;
            kernel.reboot(swap);
            v = restart(&dirs.state, &kernel, limit)
                .await
                .map_err(|w| fail(&log, w))?;
            continue;
        }
        if step.retry {
            for (op, answer) in answers {
                let (Op::Create { place, record }, Some(first)) = (op, &answer.created) else {
                    continue;
                };
                // Only a call nothing else in the step changed the answer of.
                if step
                    .ops
                    .iter()
                    .filter(|o| o.volume() == Some(&record.id))
                    .count()
                    > 1
                {
                    continue;
                }
                let Op::Create { record, .. } = op.clone().at(&dirs.files) else {
                    continue;
                };
                let again = v.create(record, *place).await;
                let same = again.as_ref().is_ok_and(|a| {
                    a.record.dev_id == first.record.dev_id
                        && a.record.backend == first.record.backend
                });
                if !same {
                    return Err(fail(
                        &log,
                        format!(
                            "the retry of `{op}` answered {:?}, the first {:?}",
                            again.map(|a| (a.record.dev_id, a.record.backend)),
                            (first.record.dev_id, &first.record.backend)
                        ),
                    ));
                }
            }
        }
    }
    cov.calls = std::mem::take(&mut kernel.world().calls);
    Ok(cov)
}

/// The steps of a failing history that still make it fail, one dropped at a time.
fn shorten(seed: u64, mut steps: Vec<Step>) -> (Vec<Step>, Failure) {
    let dirs = Dirs::new();
    let Err(mut failure) = run(seed, &steps, &dirs) else {
        panic!("seed {seed} did not fail again: the simulation is not deterministic");
    };
    let mut i = steps.len();
    let mut tries = 0;
    while i > 0 && tries < 400 {
        i -= 1;
        tries += 1;
        let mut fewer = steps.clone();
        fewer.remove(i);
        if let Err(f) = run(seed, &fewer, &Dirs::new()) {
            steps = fewer;
            failure = f;
            i = i.min(steps.len());
        }
    }
    (steps, failure)
}

fn report(seed: u64, steps: Vec<Step>) -> String {
    let (short, failure) = shorten(seed, steps);
    format!(
        "simulation seed {seed} failed: {}\nreplay: UBLKD_SIM_SEED={seed} cargo test -p ublkd-server \
         simulated\nshortened history ({} steps):\n{}",
        failure.what,
        short.len(),
        failure.log
    )
}

/// Runs seeds `seeds` and panics with the first failure's seed and shortened history; prints
/// what the budget reached.
fn search(seeds: std::ops::Range<u64>) {
    let mut cov = Coverage::default();
    for seed in seeds.clone() {
        let dirs = Dirs::new();
        let steps = history(seed);
        match run(seed, &steps, &dirs) {
            Ok(c) => cov.add(c),
            Err(_) => panic!("{}", report(seed, steps)),
        }
    }
    eprintln!(
        "simulated {} histories of {STEPS} steps: {} crashes, {} reboots; calls (ok, refused): \
         {:?}",
        seeds.end - seeds.start,
        cov.crashes,
        cov.reboots,
        cov.ops
    );
    eprintln!("device calls (call, failed): {:?}", cov.calls);
}

/// The budget every `cargo test` runs; `UBLKD_SIM_SEED` replays one seed, printing its whole
/// history, and `UBLKD_SIM_SEEDS` sets how many.
#[test]
fn simulated_histories_keep_every_invariant() {
    if let Some(seed) = std::env::var("UBLKD_SIM_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
    {
        let dirs = Dirs::new();
        let steps = history(seed);
        match run(seed, &steps, &dirs) {
            Ok(_) => eprintln!("seed {seed} keeps every invariant"),
            Err(f) => panic!("seed {seed}: {}\n{}", f.what, f.log),
        }
        return;
    }
    let budget = std::env::var("UBLKD_SIM_SEEDS")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or(BUDGET);
    search(0..budget);
}
