//! The simulated kernel: ublk devices and one NVMe namespace in memory, behaving as the
//! dataplane does (an add erases a new window before the device appears, a resize erases the
//! growth before the size changes, a takeover serves the recorded window as it is, a delete
//! drops the device from the dataplane's maps before STOP_DEV and DEL_DEV), with every state
//! change a step the process may die at (`simctx::effect`) and, when faults are on, calls that
//! fail early or part way, and calls that are slow or hang (virtual time).
//!
//! Two namespaces, each with its identity, remember per 1 MiB chunk which volume wrote it last
//! (every served volume writes its whole window): a device that comes up serving a chunk
//! another volume wrote, with no erase since, is a violation (a tenant reading its
//! predecessor's data), and so is an erase of, or a serve over, a chunk a live volume wrote
//! (a tenant losing its own). A reboot drops every device and may swap the namespaces' names,
//! as probe order does on a real node.

use super::rng::Rng;
use crate::backend::BackendRecord;
use crate::devices::Devices;
use crate::record::VolumeRecord;
use crate::simctx::{self, Fate};
use crate::volume_id::VolumeId;
use crate::volumes::ordering::info;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;
use ublkd_dataplane::stats::CleanupStep;
use ublkd_dataplane::{
    BackendSpec, DataplaneError, DevId, DeviceInfo, DeviceSpec, DeviceStats, Erase, Features,
    Growth, KernelDevice, KernelState, Namespace, NamespaceIdentity, QosLimits, WorkerSnapshot,
};

/// The names of the simulated node's namespaces; which namespace each names changes when a
/// reboot swaps them.
pub const NS_PATHS: [&str; 2] = ["/dev/ng-sim0n1", "/dev/ng-sim1n1"];
/// The first name (namespace 0 until a reboot swaps them).
pub const NS_PATH: &str = NS_PATHS[0];
pub const CHUNK: u64 = 1 << 20;
pub const NS_BYTES: u64 = 48 * CHUNK;

/// Namespace `ns`'s identity (an EUI-64).
pub fn ns_identity(ns: usize) -> NamespaceIdentity {
    NamespaceIdentity::Eui64([0xa0 + ns as u8; 8])
}

/// Who wrote a chunk: a volume's id and its creation stamp (an id can be reused).
type Tenant = (VolumeId, i64);

/// The device calls that change state, as counted and failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Call {
    Add,
    Recover,
    Delete,
    DeleteForeign,
    Resize,
    SetQos,
    Drain,
    Resume,
    EraseWindow,
}

#[derive(Debug)]
struct Dev {
    info: DeviceInfo,
    /// Served by the living process (false: quiesced, nobody's, after a crash or a delete
    /// that failed part way).
    owned: bool,
    /// The namespace window it serves: namespace, offset, length.
    window: Option<(usize, u64, u64)>,
    keep_data: bool,
}

#[derive(Debug)]
pub struct World {
    devices: BTreeMap<DevId, Dev>,
    /// Who last wrote each chunk of each namespace, and whether as a `keep_data` volume.
    chunks: Vec<Vec<Option<(Tenant, bool)>>>,
    /// The namespace each of `NS_PATHS` names this boot.
    names: [usize; 2],
    /// Devices no ublkd of this node made (another ublk server's, or one whose record a kill
    /// lost): orphans to adopt or delete, no record's by right.
    foreign: std::collections::BTreeSet<DevId>,
    /// Devices a process holds open without O_EXCL (a VM's disk, a database): a delete must
    /// not pull them away unless forced (the simulated manager never forces).
    open: std::collections::BTreeSet<DevId>,
    /// Calls may fail, be slow or hang.
    pub faults: bool,
    rng: Rng,
    pub violations: Vec<String>,
    /// How often each call was made, and failed: what the budget reached.
    pub calls: BTreeMap<(Call, bool), u64>,
}

#[derive(Debug)]
pub struct SimKernel {
    registry: PathBuf,
    w: Mutex<World>,
}

/// How a call the faults chose fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Failure {
    /// Before anything happened.
    Early,
    /// After part of its work (the erase of an add or a resize; a delete's removal from the
    /// dataplane's maps).
    Late,
}

impl SimKernel {
    pub fn new(state_dir: &Path, seed: u64) -> Self {
        SimKernel {
            registry: state_dir.join("registry"),
            w: Mutex::new(World {
                devices: BTreeMap::new(),
                chunks: vec![vec![None; (NS_BYTES / CHUNK) as usize]; 2],
                names: [0, 1],
                foreign: std::collections::BTreeSet::new(),
                open: std::collections::BTreeSet::new(),
                faults: false,
                rng: Rng::new(seed ^ 0x6b65_726e_656c),
                violations: Vec::new(),
                calls: BTreeMap::new(),
            }),
        }
    }

    pub fn world(&self) -> MutexGuard<'_, World> {
        self.w.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// A step's faults: on or off, and chosen from `seed`.
    pub fn reseed(&self, seed: u64, faults: bool) {
        let mut w = self.world();
        w.rng = Rng::new(seed ^ 0x6b65_726e_656c);
        w.faults = faults;
    }

    /// Device `dev_id` stays in the kernel, served by nobody: an orphan.
    pub fn orphan(&self, dev_id: DevId) {
        if let Some(d) = self.world().devices.get_mut(&dev_id) {
            d.owned = false;
        }
    }

    /// A device of `size` bytes that no ublkd of this node made appears as `dev_id`, served by
    /// nobody: an orphan. False when the id is taken.
    pub fn foreign(&self, dev_id: DevId, size: u64) -> bool {
        let mut w = self.world();
        if w.devices.contains_key(&dev_id) {
            return false;
        }
        let spec = DeviceSpec {
            size_bytes: size,
            dev_id: Some(dev_id),
            ..DeviceSpec::default()
        };
        let dev = Dev {
            info: info(dev_id, &spec),
            owned: false,
            window: None,
            keep_data: false,
        };
        w.devices.insert(dev_id, dev);
        w.foreign.insert(dev_id);
        true
    }

    /// A process opens device `dev_id` (`true`) or closes it; false when there is no such
    /// device.
    pub fn hold(&self, dev_id: DevId, open: bool) -> bool {
        let mut w = self.world();
        if !w.devices.contains_key(&dev_id) {
            return false;
        }
        if open {
            w.open.insert(dev_id);
        } else {
            w.open.remove(&dev_id);
        }
        true
    }

    /// A device leaves the kernel: a violation while a process holds it open.
    fn gone(w: &mut World, dev_id: DevId) {
        if w.open.remove(&dev_id) {
            w.violations.push(format!(
                "device {dev_id} was deleted while a process held it open (unforced)"
            ));
        }
    }

    /// Whether `dev_id` is a foreign device no record has adopted yet.
    pub fn is_foreign(&self, dev_id: DevId) -> bool {
        self.world().foreign.contains(&dev_id)
    }

    /// A reboot: no device survives, and with `swap` the two namespaces trade names.
    pub fn reboot(&self, swap: bool) {
        let mut w = self.world();
        w.devices.clear();
        w.foreign.clear();
        w.open.clear();
        if swap {
            w.names.swap(0, 1);
        }
    }

    /// What the kernel keeps of a dead process's devices: each stays, quiesced, nobody's.
    pub fn process_died(&self) {
        for d in self.world().devices.values_mut() {
            d.owned = false;
        }
    }

    /// Chunks that still hold the data of a volume no record names (deleted, or never made),
    /// other than a `keep_data` volume's: `(chunk, volume)`.
    pub fn unerased_leftovers(&self, records: &[VolumeRecord]) -> Vec<(String, String)> {
        let w = self.world();
        let mut out = Vec::new();
        for (ns, chunks) in w.chunks.iter().enumerate() {
            for (c, owner) in chunks.iter().enumerate() {
                let Some(((id, created), keep)) = owner else {
                    continue;
                };
                let alive = records
                    .iter()
                    .any(|r| &r.id == id && r.created_unix_ms == *created);
                if !alive && !keep {
                    out.push((
                        format!("{c} of namespace {ns}"),
                        format!("{id} (created {created})"),
                    ));
                }
            }
        }
        out
    }

    /// The namespace `path` names this boot.
    fn ns_at(w: &World, path: &Path) -> Option<usize> {
        NS_PATHS
            .iter()
            .position(|p| Path::new(p) == path)
            .map(|i| w.names[i])
    }

    /// The namespace a record's window is on: the one with its identity, else the one its
    /// path names this boot.
    fn ns_of(w: &World, r: &VolumeRecord) -> Option<usize> {
        match &r.backend {
            BackendRecord::Nvme {
                identity: Some(id), ..
            } => (0..2).find(|n| ns_identity(*n) == *id),
            BackendRecord::Nvme { device, .. } => Self::ns_at(w, device),
            _ => None,
        }
    }

    /// Every device: id, owned, size.
    /// Whether another process holds device `dev` open.
    pub fn is_open(&self, dev: DevId) -> bool {
        self.world().open.contains(&dev)
    }

    pub fn devices(&self) -> Vec<(DevId, bool, u64)> {
        self.world()
            .devices
            .values()
            .map(|d| (d.info.dev_id, d.owned, d.info.spec.size_bytes))
            .collect()
    }

    /// The volume on disk whose NVMe window on namespace `ns` starts at `offset`, as its
    /// tenant.
    fn tenant(&self, w: &World, ns: usize, offset: u64) -> Option<Tenant> {
        let dir = std::fs::read_dir(&self.registry).ok()?;
        dir.flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<VolumeRecord>(&b).ok())
            .find(|r| {
                matches!(r.backend, BackendRecord::Nvme { offset: o, .. } if o == offset)
                    && Self::ns_of(w, r) == Some(ns)
            })
            .map(|r| (r.id, r.created_unix_ms))
    }

    /// Counts `call`, says whether the process lives through it, and picks its failure and
    /// its time when faults are on.
    fn enter(&self, call: Call) -> Result<Option<Failure>, DataplaneError> {
        match simctx::effect() {
            Fate::Go => {}
            Fate::DiesNow | Fate::Dead => return Err(DataplaneError::Gone),
        }
        let mut w = self.world();
        let mut failure = None;
        if w.faults {
            let roll = w.rng.below(100);
            if roll < 8 {
                failure = Some(if w.rng.below(2) == 0 {
                    Failure::Early
                } else {
                    Failure::Late
                });
            }
            let slow = w.rng.below(100);
            if slow < 2 {
                // A hang: far longer than any caller should wait, shorter than the bound
                // that calls a history deadlocked.
                simctx::set_delay(Duration::from_secs(20));
            } else if slow < 30 {
                simctx::set_delay(Duration::from_millis(1 + w.rng.below(50)));
            }
        }
        *w.calls.entry((call, failure.is_some())).or_default() += 1;
        Ok(failure)
    }

    fn window(
        w: &World,
        spec: &DeviceSpec,
    ) -> Result<Option<(usize, u64, u64, bool)>, DataplaneError> {
        let BackendSpec::Nvme {
            path,
            window,
            keep_data,
        } = &spec.backend
        else {
            return Ok(None);
        };
        let Some(ns) = Self::ns_at(w, path) else {
            return Err(DataplaneError::Gone);
        };
        let (offset, len) = match window {
            None => (0, NS_BYTES),
            Some(w) if w.len == 0 => (w.offset, NS_BYTES.saturating_sub(w.offset)),
            Some(w) => (w.offset, w.len),
        };
        let end = offset.checked_add(len);
        if offset % CHUNK != 0
            || len % CHUNK != 0
            || len == 0
            || end.is_none_or(|e| e > NS_BYTES)
            || len < spec.size_bytes
        {
            return Err(DataplaneError::Backend(
                ublkd_dataplane::BackendError::WindowPastEnd {
                    path: path.clone(),
                    offset,
                    len,
                    size: NS_BYTES,
                },
            ));
        }
        Ok(Some((ns, offset, len, *keep_data)))
    }

    fn chunks(offset: u64, len: u64) -> std::ops::Range<usize> {
        (offset / CHUNK) as usize..((offset + len) / CHUNK) as usize
    }

    /// The window's blocks become the device's tenant's; any written by another tenant since
    /// the last erase is a violation (unless the volume asked to keep the data).
    fn serve(
        &self,
        w: &mut World,
        dev_id: DevId,
        (ns, offset, len): (usize, u64, u64),
        keep_data: bool,
    ) {
        let Some(tenant) = self.tenant(w, ns, offset) else {
            w.violations.push(format!(
                "device {dev_id} serves window {offset}+{len} of namespace {ns} while no record \
                 names it there"
            ));
            return;
        };
        let live = self.live_tenants();
        for c in Self::chunks(offset, len) {
            if let Some((prev, _)) = &w.chunks[ns][c] {
                if *prev != tenant && live.contains(prev) {
                    w.violations.push(format!(
                        "volume {} (created {}) is served chunk {c} that live volume {} \
                         (created {}) holds",
                        tenant.0, tenant.1, prev.0, prev.1
                    ));
                } else if *prev != tenant && !keep_data {
                    w.violations.push(format!(
                        "volume {} (created {}) is served chunk {c} that volume {} (created {}) \
                         wrote, unerased",
                        tenant.0, tenant.1, prev.0, prev.1
                    ));
                }
            }
            w.chunks[ns][c] = Some((tenant.clone(), keep_data));
        }
    }

    /// A RAM volume's file holds what its tenant wrote (its stamp); a device that comes up over
    /// a file another tenant wrote reads that tenant's memory.
    fn serve_memory(&self, w: &mut World, dev_id: DevId, path: &Path) {
        let tenant = std::fs::read_dir(&self.registry)
            .into_iter()
            .flatten()
            .flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<VolumeRecord>(&b).ok())
            .find(|r| {
                r.backend == BackendRecord::Ram
                    && path.file_stem().is_some_and(|s| s == r.id.as_str())
            })
            .map(|r| format!("{} {}", r.id, r.created_unix_ms));
        let Some(tenant) = tenant else {
            w.violations.push(format!(
                "device {dev_id} serves memory {} while no record names it",
                path.display()
            ));
            return;
        };
        if let Ok(before) = std::fs::read_to_string(path) {
            if !before.is_empty() && before != tenant {
                w.violations.push(format!(
                    "RAM volume {tenant} reads the memory of {before} ({})",
                    path.display()
                ));
            }
        }
        if let Err(e) = std::fs::write(path, &tenant) {
            w.violations
                .push(format!("cannot write {}: {e}", path.display()));
        }
    }

    /// The volumes whose records are on disk and not being deleted: what they wrote is theirs
    /// to keep until their delete.
    fn live_tenants(&self) -> Vec<Tenant> {
        let Ok(dir) = std::fs::read_dir(&self.registry) else {
            return Vec::new();
        };
        dir.flatten()
            .filter(|e| e.file_name().to_string_lossy().ends_with(".json"))
            .filter_map(|e| std::fs::read(e.path()).ok())
            .filter_map(|b| serde_json::from_slice::<VolumeRecord>(&b).ok())
            .filter(|r| !r.deleting)
            .map(|r| (r.id, r.created_unix_ms))
            .collect()
    }

    /// Erases the chunks of `[offset, offset+len)`; a chunk a live volume wrote is a violation
    /// (the durability invariant: a tenant keeps its own writes until its delete; only a
    /// window's growth, a new window or a deleted one is erased).
    fn erase(&self, w: &mut World, ns: usize, offset: u64, len: u64) {
        let live = self.live_tenants();
        for c in Self::chunks(offset, len) {
            if let Some((owner, _)) = &w.chunks[ns][c] {
                if live.contains(owner) {
                    w.violations.push(format!(
                        "chunk {c} of namespace {ns}, live volume {}'s (created {}), was erased: \
                         its data is lost",
                        owner.0, owner.1
                    ));
                }
            }
            w.chunks[ns][c] = None;
        }
    }

    /// Another device's window overlapping `[offset, offset+len)` (the dataplane checks the
    /// devices it serves).
    fn overlap(w: &World, except: Option<DevId>, ns: usize, offset: u64, len: u64) -> bool {
        w.devices.values().any(|d| {
            Some(d.info.dev_id) != except
                && d.owned
                && d.window
                    .is_some_and(|(n, o, l)| n == ns && o < offset + len && offset < o + l)
        })
    }
}

impl Devices for SimKernel {
    fn features(&self) -> Features {
        Features::default()
    }

    fn kernel_device_ids(&self) -> Vec<DevId> {
        self.world().devices.keys().copied().collect()
    }

    fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError> {
        Ok(self
            .world()
            .devices
            .values()
            .map(|d| KernelDevice {
                dev_id: d.info.dev_id,
                state: if d.owned {
                    KernelState::Live
                } else {
                    KernelState::Quiesced
                },
                flags: 0,
                queues: d.info.spec.queues,
                queue_depth: d.info.spec.queue_depth,
                pid: 0,
                size_bytes: d.info.spec.size_bytes,
                owned: d.owned,
            })
            .collect())
    }

    fn held_elsewhere(&self, _: &Path) -> bool {
        false
    }

    fn identify_namespace(&self, device: &Path) -> Result<Namespace, DataplaneError> {
        let ns = Self::ns_at(&self.world(), device).ok_or(DataplaneError::Gone)?;
        Ok(Namespace {
            size_bytes: NS_BYTES,
            block_size: 4096,
            identity: Some(ns_identity(ns)),
        })
    }

    fn namespace_host_use(&self, _: &Path) -> Result<Option<String>, DataplaneError> {
        Ok(None)
    }

    fn opened_by(&self, dev: &Path) -> Vec<String> {
        let w = self.world();
        w.open
            .iter()
            .filter(|d| ublkd_dataplane::block_device(**d) == dev)
            .map(|d| format!("sim-reader ({})", d.0))
            .collect()
    }

    fn find_namespace(&self, identity: &NamespaceIdentity) -> Option<PathBuf> {
        let w = self.world();
        (0..2)
            .find(|i| ns_identity(w.names[*i]) == *identity)
            .map(|i| PathBuf::from(NS_PATHS[i]))
    }

    fn erase_window(&self, device: &Path, offset: u64, len: u64) -> Result<Erase, DataplaneError> {
        if self.enter(Call::EraseWindow)?.is_some() {
            return Err(DataplaneError::Gone);
        }
        let ns = Self::ns_at(&self.world(), device);
        if ns.is_none()
            || offset % CHUNK != 0
            || len % CHUNK != 0
            || offset.checked_add(len).is_none_or(|e| e > NS_BYTES)
        {
            return Err(DataplaneError::Backend(
                ublkd_dataplane::BackendError::WindowPastEnd {
                    path: device.to_owned(),
                    offset,
                    len,
                    size: NS_BYTES,
                },
            ));
        }
        let Some(ns) = ns else {
            return Err(DataplaneError::Gone);
        };
        self.erase(&mut self.world(), ns, offset, len);
        Ok(Erase::Deallocate)
    }

    fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let failure = self.enter(Call::Add)?;
        if failure == Some(Failure::Early) {
            return Err(DataplaneError::Gone);
        }
        let mut w = self.world();
        let window = Self::window(&w, &spec)?;
        let dev_id = match spec.dev_id {
            Some(id) if w.devices.contains_key(&id) => {
                return Err(DataplaneError::OpenCharDevice {
                    path: PathBuf::from(format!("/dev/ublkc{id}")),
                    source: std::io::Error::from_raw_os_error(libc::EEXIST),
                })
            }
            Some(id) => id,
            None => (0..)
                .map(DevId)
                .find(|id| !w.devices.contains_key(id))
                .unwrap_or(DevId(0)),
        };
        if let Some((ns, offset, len, keep_data)) = window {
            if Self::overlap(&w, None, ns, offset, len) {
                return Err(DataplaneError::Overlap {
                    path: PathBuf::from(NS_PATH),
                    start: offset,
                    end: offset + len,
                    dev_id,
                });
            }
            if spec.erase && !keep_data {
                self.erase(&mut w, ns, offset, len);
            }
            if failure == Some(Failure::Late) {
                return Err(DataplaneError::AttachTimeout {
                    q_id: ublkd_dataplane::QueueId(0),
                });
            }
            self.serve(&mut w, dev_id, (ns, offset, len), keep_data);
        } else if failure == Some(Failure::Late) {
            return Err(DataplaneError::Gone);
        }
        if let BackendSpec::Ram { path: Some(path) } = &spec.backend {
            self.serve_memory(&mut w, dev_id, path);
        }
        let i = info(dev_id, &spec);
        w.devices.insert(
            dev_id,
            Dev {
                info: i.clone(),
                owned: true,
                window: window.map(|(n, o, l, _)| (n, o, l)),
                keep_data: window.is_some_and(|(_, _, _, k)| k),
            },
        );
        Ok(i)
    }

    fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let failure = self.enter(Call::Recover)?;
        let dev_id = spec.dev_id.ok_or(DataplaneError::Gone)?;
        let mut w = self.world();
        let window = Self::window(&w, &spec)?;
        let Some(dev) = w.devices.get(&dev_id) else {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        };
        if dev.owned {
            return Err(DataplaneError::AlreadyOwned(dev_id));
        }
        if failure.is_some() {
            return Err(DataplaneError::NotRecoverable {
                dev_id,
                why: "the simulated kernel refused".into(),
            });
        }
        // Never shrunk on takeover; a larger recorded size is applied.
        let size = spec.size_bytes.max(dev.info.spec.size_bytes);
        if let Some((ns, offset, len, keep_data)) = window {
            self.serve(&mut w, dev_id, (ns, offset, len), keep_data);
        }
        let i = info(
            dev_id,
            &DeviceSpec {
                size_bytes: size,
                ..spec
            },
        );
        let dev = w.devices.get_mut(&dev_id).ok_or(DataplaneError::Gone)?;
        dev.info = i.clone();
        dev.owned = true;
        dev.window = window.map(|(n, o, l, _)| (n, o, l));
        dev.keep_data = window.is_some_and(|(_, _, _, k)| k);
        w.foreign.remove(&dev_id);
        Ok(i)
    }

    fn delete_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        let failure = self.enter(Call::Delete)?;
        let mut w = self.world();
        if !w.devices.get(&dev_id).is_some_and(|d| d.owned) {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        }
        match failure {
            Some(Failure::Early) => Err(DataplaneError::Gone),
            Some(Failure::Late) => {
                // Out of the dataplane's maps, STOP_DEV or DEL_DEV failed: the kernel keeps it.
                if let Some(d) = w.devices.get_mut(&dev_id) {
                    d.owned = false;
                }
                Err(DataplaneError::StopTimeout(dev_id))
            }
            None => {
                w.devices.remove(&dev_id);
                Self::gone(&mut w, dev_id);
                Ok(())
            }
        }
    }

    fn delete_foreign_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        let failure = self.enter(Call::DeleteForeign)?;
        let mut w = self.world();
        match w.devices.get(&dev_id) {
            None => return Err(DataplaneError::NoSuchDevice(dev_id)),
            Some(d) if d.owned => return Err(DataplaneError::AlreadyOwned(dev_id)),
            Some(_) => {}
        }
        if failure.is_some() {
            return Err(DataplaneError::Gone);
        }
        w.devices.remove(&dev_id);
        w.foreign.remove(&dev_id);
        Self::gone(&mut w, dev_id);
        Ok(())
    }

    fn resize_device(
        &self,
        dev_id: DevId,
        size: u64,
        growth: Growth,
    ) -> Result<DeviceInfo, DataplaneError> {
        let failure = self.enter(Call::Resize)?;
        let mut w = self.world();
        let Some(dev) = w.devices.get(&dev_id).filter(|d| d.owned) else {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        };
        if failure == Some(Failure::Early) {
            return Err(DataplaneError::Gone);
        }
        let (window, keep_data) = (dev.window, dev.keep_data);
        if let Some((ns, offset, len)) = window {
            if size > len {
                if offset + size > NS_BYTES || Self::overlap(&w, Some(dev_id), ns, offset, size) {
                    return Err(DataplaneError::Overlap {
                        path: PathBuf::from(NS_PATHS[ns]),
                        start: offset + len,
                        end: offset + size,
                        dev_id,
                    });
                }
                if !keep_data && growth == Growth::Erase {
                    self.erase(&mut w, ns, offset + len, size - len);
                }
            }
            if failure == Some(Failure::Late) {
                return Err(DataplaneError::Gone);
            }
            let len = len.max(size);
            self.serve(&mut w, dev_id, (ns, offset, len), keep_data);
            if let Some(d) = w.devices.get_mut(&dev_id) {
                d.window = Some((ns, offset, len));
            }
        } else if failure == Some(Failure::Late) {
            return Err(DataplaneError::Gone);
        }
        let d = w.devices.get_mut(&dev_id).ok_or(DataplaneError::Gone)?;
        d.info.spec.size_bytes = size;
        Ok(d.info.clone())
    }

    fn set_qos(&self, dev_id: DevId, limits: QosLimits) -> Result<DeviceInfo, DataplaneError> {
        let failure = self.enter(Call::SetQos)?;
        let mut w = self.world();
        let d = w
            .devices
            .get_mut(&dev_id)
            .filter(|d| d.owned)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        if failure.is_some() {
            return Err(DataplaneError::Gone);
        }
        d.info.spec.qos = limits;
        Ok(d.info.clone())
    }

    fn drain_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        let failure = self.enter(Call::Drain)?;
        if !self.world().devices.get(&dev_id).is_some_and(|d| d.owned) {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        }
        failure.map_or(Ok(()), |_| Err(DataplaneError::DrainTimeout(dev_id)))
    }

    fn resume_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        let failure = self.enter(Call::Resume)?;
        if !self.world().devices.get(&dev_id).is_some_and(|d| d.owned) {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        }
        failure.map_or(Ok(()), |_| Err(DataplaneError::Gone))
    }

    fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError> {
        Err(DataplaneError::NoSuchDevice(dev_id))
    }

    fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError> {
        Ok(Vec::new())
    }

    fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError> {
        Ok(Vec::new())
    }

    fn control_cleanup_errors(&self) -> Result<Vec<(CleanupStep, u64)>, DataplaneError> {
        Ok(Vec::new())
    }

    fn shutdown(&self) -> Result<(), DataplaneError> {
        Ok(())
    }

    fn shutdown_keep(&self) -> Result<(), DataplaneError> {
        Ok(())
    }
}
