//! The dataplane's only public control surface: [`Handle`].
//!
//! `Handle::start` spawns one pinned worker per CPU and a control thread. Commands travel to the
//! control thread over a channel, each with its own reply channel; the control thread runs the
//! `/dev/ublk-control` commands (bounded by timeouts, never on a worker) and hands queues to the
//! workers over their own channels, waking each through an eventfd its ring is reading.

use crate::backend::{self, BackendError};
use crate::ctrl::{ControlDevice, CtrlError};
use crate::device::{DeviceSpec, IoPath, SpecError, Toggle};
use crate::features::Features;
use crate::hooks::{self, Fault};
use crate::ring::RingError;
use crate::stats::{QueueStats, StatsSnapshot, WorkerStats};
use crate::sys::{self, os};
use crate::worker::{AttachError, Placement, QueueSetup, Worker, WorkerCmd, WorkerError};
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How the dataplane runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// CPUs to run one pinned worker on each; empty means every CPU this process may use.
    pub cpus: Vec<usize>,
    /// Bound on each control command and on waiting for a device's queues to stop.
    pub timeout: Duration,
    /// Whether ublk commands may share an IOPOLL ring (Linux >= 7.1); None probes the kernel.
    /// Tests set Some(false) to exercise the older kernels' split-ring polling.
    pub iopoll_shared: Option<bool>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            cpus: Vec::new(),
            timeout: Duration::from_secs(10),
            iopoll_shared: None,
        }
    }
}

/// The error classes callers act on; the server maps them to gRPC codes in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorKind {
    InvalidArgument,
    NotFound,
    AlreadyExists,
    FailedPrecondition,
    ResourceExhausted,
    Unavailable,
    Internal,
}

/// Errors of the dataplane's control surface, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum DataplaneError {
    #[error("invalid device spec")]
    Spec(#[from] SpecError),
    #[error("opening the backend failed")]
    Backend(#[from] BackendError),
    #[error("ublk control command failed")]
    Ctrl(#[from] CtrlError),
    #[error("the kernel granted flags {granted:#x}, missing {missing:#x}")]
    FlagsRefused { granted: u64, missing: u64 },
    #[error("cannot open {path}")]
    OpenCharDevice {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("worker could not attach queue {q_id}")]
    Attach {
        q_id: u16,
        #[source]
        source: WorkerError,
    },
    #[error("worker did not answer the attach of queue {q_id} in time")]
    AttachTimeout { q_id: u16 },
    #[error("the previous server of device {0} did not let go in time")]
    ReleaseTimeout(u32),
    #[error("device {0} is half taken over and a queue is stuck in the kernel: the next ublkd start takes it over")]
    RecoveryStuck(u32),
    #[error("no device {0}")]
    NoSuchDevice(u32),
    #[error("queues of device {0} did not stop within the timeout")]
    StopTimeout(u32),
    #[error("cannot start worker threads")]
    Spawn(#[source] std::io::Error),
    #[error("the dataplane has shut down")]
    Gone,
    #[error("device {dev_id} is still served by process {pid}")]
    Busy { dev_id: u32, pid: i32 },
    #[error("device {0} is already served by this process")]
    AlreadyOwned(u32),
    #[error("device {dev_id} cannot be recovered: {why}")]
    NotRecoverable { dev_id: u32, why: String },
    #[error("bytes {start}..{end} of {path} are already used by device {dev_id}")]
    Overlap {
        path: PathBuf,
        start: u64,
        end: u64,
        dev_id: u32,
    },
}

impl DataplaneError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            DataplaneError::Spec(SpecError::Unsupported(_)) => ErrorKind::FailedPrecondition,
            DataplaneError::Spec(_) => ErrorKind::InvalidArgument,
            DataplaneError::Backend(BackendError::Memory { .. }) => ErrorKind::ResourceExhausted,
            DataplaneError::Backend(BackendError::CannotGrow { .. }) => {
                ErrorKind::FailedPrecondition
            }
            DataplaneError::Backend(BackendError::Open { source, .. })
                if source.kind() == std::io::ErrorKind::NotFound =>
            {
                ErrorKind::NotFound
            }
            DataplaneError::Backend(_) => ErrorKind::InvalidArgument,
            DataplaneError::Ctrl(CtrlError::Open { .. }) => ErrorKind::FailedPrecondition,
            DataplaneError::Ctrl(CtrlError::Timeout { .. }) => ErrorKind::Unavailable,
            DataplaneError::NoSuchDevice(_) => ErrorKind::NotFound,
            DataplaneError::Busy { .. } | DataplaneError::NotRecoverable { .. } => {
                ErrorKind::FailedPrecondition
            }
            DataplaneError::AlreadyOwned(_) => ErrorKind::AlreadyExists,
            DataplaneError::Overlap { .. } => ErrorKind::FailedPrecondition,
            DataplaneError::Attach {
                source: WorkerError::Full | WorkerError::Ring(RingError::NoFixedSlot),
                ..
            } => ErrorKind::ResourceExhausted,
            DataplaneError::Gone
            | DataplaneError::ReleaseTimeout(_)
            | DataplaneError::AttachTimeout { .. } => ErrorKind::Unavailable,
            DataplaneError::RecoveryStuck(_) => ErrorKind::FailedPrecondition,
            _ => ErrorKind::Internal,
        }
    }
}

/// A device as the dataplane serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub dev_id: u32,
    pub spec: DeviceSpec,
    /// The path actually used (Auto resolved).
    pub io_path: IoPath,
    /// Flags the kernel granted.
    pub flags: u64,
    /// Zero copy is on (UBLK_F_AUTO_BUF_REG).
    pub zero_copy: bool,
    /// Backend I/O is polled (IOPOLL ring).
    pub polled: bool,
    /// Queues of a zero-copy device served by copy: taken over when no worker had buffer slots
    /// left for them (a new device is refused instead).
    pub copy_queues: u16,
    pub block_device: PathBuf,
    pub char_device: PathBuf,
}

impl DeviceInfo {
    /// Whether every request's pages are lent by the kernel (zero copy on, no queue copying).
    pub fn zero_copy_in_use(&self) -> bool {
        self.zero_copy && self.copy_queues == 0
    }
}

/// Statistics of one device: its queues merged, plus backend memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceStats {
    pub dev_id: u32,
    pub total: StatsSnapshot,
    pub memory_bytes: u64,
}

/// Statistics of one worker.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkerSnapshot {
    pub cpu: usize,
    pub busy_seconds: f64,
    pub idle_seconds: f64,
    /// Requests started per loop iteration: non-cumulative counts per
    /// `stats::BATCH_BOUNDS` bucket, then one for larger values.
    pub batch_buckets: Vec<u64>,
    pub batch_sum: u64,
    /// None while the worker serves; else the errno of the ring error that stopped it.
    pub down_errno: Option<u64>,
    /// Transient ring errors (EAGAIN, ENOMEM) the worker waited out.
    pub ring_retries: u64,
    /// io-wq threads the worker may have now, `[bounded, unbounded]` (`ring::iowq_limits`).
    pub iowq_limits: [u32; 2],
}

/// The state of a ublk device as the kernel reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelState {
    Dead,
    Live,
    /// No server: requests wait for the next one (USER_RECOVERY).
    Quiesced,
    /// No server: requests fail (USER_RECOVERY_FAIL_IO).
    FailIo,
    Unknown(u16),
}

impl KernelState {
    fn from_raw(v: u16) -> Self {
        match v {
            sys::UBLK_S_DEV_DEAD => KernelState::Dead,
            sys::UBLK_S_DEV_LIVE => KernelState::Live,
            sys::UBLK_S_DEV_QUIESCED => KernelState::Quiesced,
            sys::UBLK_S_DEV_FAIL_IO => KernelState::FailIo,
            other => KernelState::Unknown(other),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KernelState::Dead => "dead",
            KernelState::Live => "live",
            KernelState::Quiesced => "quiesced",
            KernelState::FailIo => "fail_io",
            KernelState::Unknown(_) => "unknown",
        }
    }
}

/// A ublk device that exists in the kernel, whoever serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelDevice {
    pub dev_id: u32,
    pub state: KernelState,
    pub flags: u64,
    pub queues: u16,
    pub queue_depth: u16,
    /// The server process the kernel last knew (may be gone).
    pub pid: i32,
    pub size_bytes: u64,
    /// Served by this dataplane.
    pub owned: bool,
}

type Reply<T> = SyncSender<Result<T, DataplaneError>>;

/// Requests the control thread serves.
#[derive(Debug)]
pub enum Command {
    /// ADD_DEV, SET_PARAMS, attach every queue to a worker, START_DEV.
    Add(DeviceSpec, Reply<DeviceInfo>),
    /// STOP_DEV, wait for the workers to let go, DEL_DEV.
    Delete(u32, Reply<()>),
    /// UPDATE_SIZE to a new size in bytes.
    Resize(u32, u64, Reply<DeviceInfo>),
    Stats(u32, Reply<DeviceStats>),
    /// Statistics of every device, in one round trip.
    StatsAll(Reply<Vec<DeviceStats>>),
    List(Reply<Vec<DeviceInfo>>),
    Workers(Reply<Vec<WorkerSnapshot>>),
    /// Take over a device whose server is gone (START/END_USER_RECOVERY); the spec's `dev_id`
    /// names it.
    Recover(DeviceSpec, Reply<DeviceInfo>),
    /// Every ublk device in the kernel.
    KernelDevices(Reply<Vec<KernelDevice>>),
    /// STOP_DEV + DEL_DEV of a device this dataplane does not serve (an orphan).
    DeleteForeign(u32, Reply<()>),
    /// Delete every device and stop all threads.
    Shutdown(Reply<()>),
    /// Leave every device to the next server: quiesce it (QUIESCE_DEV where offered), stop
    /// serving, keep it in the kernel.
    ShutdownKeep(Reply<()>),
}

/// The dataplane's control surface. Cheap to clone; every clone talks to the same threads.
#[derive(Debug, Clone)]
pub struct Handle {
    tx: Sender<Command>,
    features: Features,
    iopoll_shared: bool,
    workers: usize,
}

struct WorkerThread {
    cpu: usize,
    tx: Sender<WorkerCmd>,
    event: Arc<os::EventFd>,
    stats: Arc<WorkerStats>,
    join: Option<JoinHandle<()>>,
}

struct Device {
    info: DeviceInfo,
    backend: Arc<dyn backend::Backend>,
    /// Stats of every queue a worker serves or still holds commands of (each reports when it
    /// is gone). Unless `stuck`, these are queues 0..len, all accepted by the kernel.
    queues: Vec<Arc<QueueStats>>,
    /// A queue's attach failed while the worker held commands of it: they stay with the kernel
    /// until the device stops or the process exits, so the queue cannot be attached again.
    stuck: bool,
    cdev: Option<Arc<File>>,
}

impl Device {
    fn new(info: DeviceInfo, backend: Arc<dyn backend::Backend>) -> Self {
        Self {
            info,
            backend,
            queues: Vec::new(),
            stuck: false,
            cdev: None,
        }
    }
}

struct Control {
    ctrl: ControlDevice,
    features: Features,
    iopoll_shared: bool,
    workers: Vec<WorkerThread>,
    devices: BTreeMap<u32, Device>,
    /// Devices whose takeover started (START_USER_RECOVERY) but did not finish: quiesced in the
    /// kernel, the queues attached so far kept, resumed by the next `recover` of the same id.
    recovering: BTreeMap<u32, Device>,
    gone_tx: Sender<(u32, u16)>,
    gone_rx: Receiver<(u32, u16)>,
    timeout: Duration,
}

impl Handle {
    /// Probes the kernel, starts the workers and the control thread.
    pub fn start(config: Config) -> Result<Handle, DataplaneError> {
        crate::hooks::arm_from_env();
        let mut ctrl = ControlDevice::open()?;
        ctrl.set_timeout(config.timeout);
        let features = ctrl.features()?;
        let iopoll_shared = config
            .iopoll_shared
            .unwrap_or_else(|| ctrl.iopoll_takes_ublk_cmds());
        let cpus = if config.cpus.is_empty() {
            os::allowed_cpus()
        } else {
            config.cpus.clone()
        };
        let mut workers = Vec::new();
        for cpu in cpus {
            workers.push(spawn_worker(cpu)?);
        }
        let n = workers.len();
        let (gone_tx, gone_rx) = mpsc::channel();
        let control = Control {
            ctrl,
            features,
            iopoll_shared,
            workers,
            devices: BTreeMap::new(),
            recovering: BTreeMap::new(),
            gone_tx,
            gone_rx,
            timeout: config.timeout,
        };
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("ublkd-ctrl".into())
            .spawn(move || control.run(rx))
            .map_err(DataplaneError::Spawn)?;
        Ok(Handle {
            tx,
            features,
            iopoll_shared,
            workers: n,
        })
    }

    /// Whether ublk commands and polled NVMe I/O share one IOPOLL ring (Linux >= 7.1), so that
    /// zero copy and polling work together.
    pub fn iopoll_shared(&self) -> bool {
        self.iopoll_shared
    }

    /// The kernel's ublk features, probed once at start.
    pub fn features(&self) -> Features {
        self.features
    }

    pub fn worker_count(&self) -> usize {
        self.workers
    }

    fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, DataplaneError> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.tx
            .send(make(reply))
            .map_err(|_| DataplaneError::Gone)?;
        rx.recv().map_err(|_| DataplaneError::Gone)?
    }

    /// Creates and starts a device; `/dev/ublkbN` serves I/O when this returns.
    pub fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        self.call(|r| Command::Add(spec, r))
    }

    /// Stops and deletes a device; its device nodes are gone when this returns.
    pub fn delete_device(&self, dev_id: u32) -> Result<(), DataplaneError> {
        self.call(|r| Command::Delete(dev_id, r))
    }

    /// Changes a device's capacity (UBLK_F_UPDATE_SIZE).
    pub fn resize_device(
        &self,
        dev_id: u32,
        size_bytes: u64,
    ) -> Result<DeviceInfo, DataplaneError> {
        self.call(|r| Command::Resize(dev_id, size_bytes, r))
    }

    pub fn stats(&self, dev_id: u32) -> Result<DeviceStats, DataplaneError> {
        self.call(|r| Command::Stats(dev_id, r))
    }

    /// Statistics of every device this dataplane serves, in one call (a scrape with hundreds
    /// of volumes makes one round trip to the control thread, not one per volume).
    pub fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError> {
        self.call(Command::StatsAll)
    }

    pub fn list(&self) -> Result<Vec<DeviceInfo>, DataplaneError> {
        self.call(Command::List)
    }

    pub fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError> {
        self.call(Command::Workers)
    }

    /// Deletes every device and stops all dataplane threads.
    pub fn shutdown(&self) -> Result<(), DataplaneError> {
        self.call(Command::Shutdown)
    }

    /// Takes over device `spec.dev_id`, left by a server that exited or crashed: the block device,
    /// its mounts and open files stay; requests queued meanwhile are served.
    pub fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        self.call(|r| Command::Recover(spec, r))
    }

    /// Every ublk device the kernel has, whoever serves it.
    pub fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError> {
        self.call(Command::KernelDevices)
    }

    /// Stops and deletes a device this dataplane does not serve.
    pub fn delete_foreign_device(&self, dev_id: u32) -> Result<(), DataplaneError> {
        self.call(|r| Command::DeleteForeign(dev_id, r))
    }

    /// Stops serving but leaves every device in the kernel for the next server.
    pub fn shutdown_keep(&self) -> Result<(), DataplaneError> {
        self.call(Command::ShutdownKeep)
    }
}

fn spawn_worker(cpu: usize) -> Result<WorkerThread, DataplaneError> {
    let (tx, rx) = mpsc::channel();
    let event = Arc::new(os::EventFd::new().map_err(DataplaneError::Spawn)?);
    let stats = Arc::new(WorkerStats::default());
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let ev = Arc::clone(&event);
    let st = Arc::clone(&stats);
    let join = std::thread::Builder::new()
        .name(format!("ublkd-w{cpu}"))
        .spawn(move || {
            // Pinning is best effort: a CPU outside our cgroup's set still gets a worker.
            let _ = os::pin_current_thread(cpu);
            match Worker::new(rx, ev, st) {
                Ok(w) => {
                    let _ = ready_tx.send(Ok(()));
                    w.run();
                }
                Err(e) => {
                    let _ = ready_tx.send(Err(e));
                }
            }
        })
        .map_err(DataplaneError::Spawn)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(source)) => return Err(DataplaneError::Attach { q_id: 0, source }),
        Err(_) => return Err(DataplaneError::Gone),
    }
    Ok(WorkerThread {
        cpu,
        tx,
        event,
        stats,
        join: Some(join),
    })
}

/// Kernel limit on queues per device: one per possible CPU.
fn max_queues() -> u16 {
    let possible = std::fs::read_to_string("/sys/devices/system/cpu/possible").unwrap_or_default();
    let n = possible
        .trim()
        .split(',')
        .filter_map(|r| {
            let mut it = r.split('-');
            let a: u32 = it.next()?.parse().ok()?;
            let b: u32 = it.next().map_or(Some(a), |b| b.parse().ok())?;
            Some(b - a + 1)
        })
        .sum::<u32>();
    u16::try_from(n.max(1)).unwrap_or(sys::UBLK_MAX_NR_QUEUES)
}

impl Control {
    fn run(mut self, rx: Receiver<Command>) {
        while let Ok(cmd) = rx.recv() {
            match cmd {
                Command::Add(spec, reply) => {
                    let _ = reply.send(self.add(spec));
                }
                Command::Delete(id, reply) => {
                    let _ = reply.send(self.delete(id));
                }
                Command::Resize(id, size, reply) => {
                    let _ = reply.send(self.resize(id, size));
                }
                Command::Stats(id, reply) => {
                    let _ = reply.send(self.stats(id));
                }
                Command::StatsAll(reply) => {
                    let all = self
                        .devices
                        .keys()
                        .filter_map(|&id| self.stats(id).ok())
                        .collect();
                    let _ = reply.send(Ok(all));
                }
                Command::List(reply) => {
                    let _ = reply.send(Ok(self.devices.values().map(|d| d.info.clone()).collect()));
                }
                Command::Workers(reply) => {
                    let _ = reply.send(Ok(self
                        .workers
                        .iter()
                        .map(|w| {
                            let (busy, idle) = w.stats.seconds();
                            let (batch_buckets, batch_sum) = w.stats.batches();
                            WorkerSnapshot {
                                cpu: w.cpu,
                                busy_seconds: busy,
                                idle_seconds: idle,
                                batch_buckets,
                                batch_sum,
                                down_errno: w.stats.down_errno(),
                                ring_retries: w.stats.ring_retries(),
                                iowq_limits: w.stats.iowq_limits(),
                            }
                        })
                        .collect()));
                }
                Command::Shutdown(reply) => {
                    let _ = reply.send(self.shutdown());
                    return;
                }
                Command::Recover(spec, reply) => {
                    let _ = reply.send(self.recover(spec));
                }
                Command::KernelDevices(reply) => {
                    let _ = reply.send(self.kernel_devices());
                }
                Command::DeleteForeign(id, reply) => {
                    let _ = reply.send(self.delete_foreign(id));
                }
                Command::ShutdownKeep(reply) => {
                    let _ = reply.send(self.shutdown_keep());
                    return;
                }
            }
        }
        // Every Handle is gone: clean up as on shutdown.
        let _ = self.shutdown();
    }

    fn shutdown(&mut self) -> Result<(), DataplaneError> {
        let ids: Vec<u32> = self
            .devices
            .keys()
            .chain(self.recovering.keys())
            .copied()
            .collect();
        let mut first_err = None;
        for id in ids {
            if let Err(e) = self.delete(id) {
                first_err.get_or_insert(e);
            }
        }
        for w in &mut self.workers {
            let _ = w.tx.send(WorkerCmd::Shutdown);
            let _ = w.event.notify();
            // A worker that stopped on a fatal error stays parked until the process exits.
            if w.stats.down_errno().is_some() {
                continue;
            }
            if let Some(j) = w.join.take() {
                let _ = j.join();
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Waits until the device's previous server has let go (the kernel releases its queues
    /// asynchronously after the process dies); returns the device's info.
    fn wait_released(&mut self, dev_id: u32) -> Result<sys::ublksrv_ctrl_dev_info, DataplaneError> {
        let deadline = Instant::now() + self.timeout;
        loop {
            let info = match self.ctrl.dev_info(dev_id) {
                Ok(i) => i,
                Err(CtrlError::Command { source, .. })
                    if source.raw_os_error() == Some(libc::ENODEV) =>
                {
                    return Err(DataplaneError::NoSuchDevice(dev_id))
                }
                Err(e) => return Err(e.into()),
            };
            match KernelState::from_raw(info.state) {
                KernelState::Quiesced | KernelState::FailIo => return Ok(info),
                KernelState::Dead => {
                    return Err(DataplaneError::NotRecoverable {
                        dev_id,
                        why: "it was stopped".into(),
                    })
                }
                KernelState::Live | KernelState::Unknown(_) => {
                    let pid = info.ublksrv_pid;
                    if pid > 0 && pid as u32 != std::process::id() && os::pid_alive(pid) {
                        return Err(DataplaneError::Busy { dev_id, pid });
                    }
                    if Instant::now() >= deadline {
                        return Err(DataplaneError::ReleaseTimeout(dev_id));
                    }
                    std::thread::sleep(Duration::from_millis(20));
                }
            }
        }
    }

    fn recover(&mut self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        let dev_id = spec.dev_id.ok_or(DataplaneError::NotRecoverable {
            dev_id: u32::MAX,
            why: "no device id given".into(),
        })?;
        if self.devices.contains_key(&dev_id) {
            return Err(DataplaneError::AlreadyOwned(dev_id));
        }
        if let Some(device) = self.recovering.remove(&dev_id) {
            // A takeover that failed half way: the device is still ours and quiesced.
            let kernel_size = device.info.spec.size_bytes;
            return self.finish_recovery(device, kernel_size, spec.size_bytes);
        }
        spec.validate(max_queues())?;
        let info = self.wait_released(dev_id)?;
        if info.nr_hw_queues != spec.queues || info.queue_depth != spec.queue_depth {
            return Err(DataplaneError::NotRecoverable {
                dev_id,
                why: format!(
                    "the kernel device has {} queue(s) of depth {}, the volume {} of depth {}",
                    info.nr_hw_queues, info.queue_depth, spec.queues, spec.queue_depth
                ),
            });
        }
        if let Some(name) = unservable_flags(info.flags) {
            return Err(DataplaneError::NotRecoverable {
                dev_id,
                why: format!("the device uses {name}, which ublkd does not serve"),
            });
        }
        let path = if info.flags & sys::UBLK_F_BATCH_IO != 0 {
            IoPath::Batch
        } else {
            IoPath::PerIo
        };
        let kernel_size = self.ctrl.params(dev_id)?.basic.dev_sectors * 512;
        let backend = backend::open(
            &spec.backend,
            spec.size_bytes.max(kernel_size),
            spec.block_size,
        )?;
        self.check_claim(backend.as_ref(), dev_id)?;
        let kernel_zc = info.flags & sys::UBLK_F_AUTO_BUF_REG != 0;
        let (zero_copy, polled) = self.modes(&spec, backend.as_ref(), Some(kernel_zc))?;
        // A zero-copy device whose new backend must copy (an orphan adopted as a RAM volume):
        // every request takes the fallback, served by copy, which needs USER_COPY.
        let copy_only = zero_copy && !backend.zero_copy();
        if copy_only && info.flags & sys::UBLK_F_USER_COPY == 0 {
            return Err(DataplaneError::NotRecoverable {
                dev_id,
                why: "the device is zero copy without USER_COPY, and this backend copies".into(),
            });
        }
        let device = Device::new(
            DeviceInfo {
                dev_id,
                spec: DeviceSpec {
                    max_io_bytes: info.max_io_buf_bytes,
                    force_copy_fallback: spec.force_copy_fallback || copy_only,
                    // Never shrink a device on takeover; a larger recorded size is applied below.
                    size_bytes: kernel_size,
                    ..spec.clone()
                },
                io_path: path,
                flags: info.flags,
                zero_copy,
                polled,
                copy_queues: 0,
                block_device: PathBuf::from(format!("/dev/ublkb{dev_id}")),
                char_device: PathBuf::from(format!("/dev/ublkc{dev_id}")),
            },
            backend,
        );
        self.start_recovery(dev_id)?;
        self.finish_recovery(device, kernel_size, spec.size_bytes)
    }

    /// START_USER_RECOVERY, retrying -EBUSY with a bounded back-off: the driver marks the
    /// device QUIESCED before it clears its open bit, so a device found released can still be
    /// busy for a moment.
    fn start_recovery(&mut self, dev_id: u32) -> Result<(), DataplaneError> {
        let deadline = Instant::now() + self.timeout;
        let mut pause = Duration::from_millis(5);
        loop {
            let r = if hooks::fire(Fault::RecoverBusy) {
                Err(CtrlError::Command {
                    command: "START_USER_RECOVERY",
                    source: std::io::Error::from_raw_os_error(libc::EBUSY),
                })
            } else {
                self.ctrl.start_recovery(dev_id)
            };
            match r {
                Err(CtrlError::Command { ref source, .. })
                    if source.raw_os_error() == Some(libc::EBUSY) && Instant::now() < deadline =>
                {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(200));
                }
                other => return Ok(other?),
            }
        }
    }

    /// Attaches the queues not attached yet and ends the recovery. On failure nothing is torn
    /// down: the device stays quiesced in the kernel (applications wait, mounts and open files
    /// stay) and is kept for the next `recover` of its id, which resumes here.
    fn finish_recovery(
        &mut self,
        mut device: Device,
        kernel_size: u64,
        wanted_size: u64,
    ) -> Result<DeviceInfo, DataplaneError> {
        let dev_id = device.info.dev_id;
        if device.stuck {
            self.recovering.insert(dev_id, device);
            return Err(DataplaneError::RecoveryStuck(dev_id));
        }
        let r = self
            .attach_queues(&mut device, true)
            .and_then(|()| Ok(self.ctrl.end_recovery(dev_id)?));
        if let Err(e) = r {
            self.recovering.insert(dev_id, device);
            return Err(e);
        }
        if wanted_size > kernel_size {
            // A grow recorded but not (or not wholly) applied before a crash. The device serves
            // either way: if growing fails it keeps its size, which its info reports.
            let grown = device
                .backend
                .resize(wanted_size)
                .map_err(DataplaneError::from)
                .and_then(|()| Ok(self.ctrl.update_size(dev_id, wanted_size / 512)?));
            if grown.is_ok() {
                device.info.spec.size_bytes = wanted_size;
            }
        }
        let out = device.info.clone();
        self.devices.insert(dev_id, device);
        Ok(out)
    }

    fn kernel_devices(&mut self) -> Result<Vec<KernelDevice>, DataplaneError> {
        let ids = kernel_device_ids();
        let mut out = Vec::new();
        for dev_id in ids {
            // Devices we serve are described from our own table: a scrape with hundreds of
            // volumes issues no control command for them.
            if let Some(d) = self.devices.get(&dev_id) {
                out.push(KernelDevice {
                    dev_id,
                    state: KernelState::Live,
                    flags: d.info.flags,
                    queues: d.info.spec.queues,
                    queue_depth: d.info.spec.queue_depth,
                    pid: std::process::id() as i32,
                    size_bytes: d.info.spec.size_bytes,
                    owned: true,
                });
                continue;
            }
            let Ok(info) = self.ctrl.dev_info(dev_id) else {
                continue;
            };
            let size_bytes = self
                .ctrl
                .params(dev_id)
                .map_or(0, |p| p.basic.dev_sectors * 512);
            out.push(KernelDevice {
                dev_id,
                state: KernelState::from_raw(info.state),
                flags: info.flags,
                queues: info.nr_hw_queues,
                queue_depth: info.queue_depth,
                pid: info.ublksrv_pid,
                size_bytes,
                // A device whose takeover is under way is not served yet: its volume's next
                // restore resumes the takeover.
                owned: false,
            });
        }
        Ok(out)
    }

    fn delete_foreign(&mut self, dev_id: u32) -> Result<(), DataplaneError> {
        if self.devices.contains_key(&dev_id) || self.recovering.contains_key(&dev_id) {
            return Err(DataplaneError::AlreadyOwned(dev_id));
        }
        let info = self.ctrl.dev_info(dev_id).map_err(|e| match e {
            CtrlError::Command { ref source, .. }
                if source.raw_os_error() == Some(libc::ENODEV) =>
            {
                DataplaneError::NoSuchDevice(dev_id)
            }
            other => other.into(),
        })?;
        if KernelState::from_raw(info.state) == KernelState::Live
            && info.ublksrv_pid > 0
            && os::pid_alive(info.ublksrv_pid)
        {
            return Err(DataplaneError::Busy {
                dev_id,
                pid: info.ublksrv_pid,
            });
        }
        // A device without a server may refuse STOP_DEV (already stopped); DEL_DEV decides.
        let _ = self.ctrl.stop_dev(dev_id);
        self.ctrl.del_dev(dev_id)?;
        Ok(())
    }

    fn shutdown_keep(&mut self) -> Result<(), DataplaneError> {
        let mut first_err = None;
        let ids: Vec<u32> = self.devices.keys().copied().collect();
        let mut quiesced = true;
        for id in ids {
            let Some(mut device) = self.devices.remove(&id) else {
                continue;
            };
            // QUIESCE_DEV drains per-IO queues cleanly. On BATCH_IO queues the 7.3 driver fails
            // the requests it aborts instead of requeueing them, so those are left the way a
            // crash leaves them: the kernel reissues what was in flight to the next server.
            if device.info.flags & sys::UBLK_F_QUIESCE == 0 || device.info.io_path == IoPath::Batch
            {
                quiesced = false;
                continue;
            }
            // The kernel lets requests in flight finish, then aborts our fetches; the workers
            // tear the queues down and report them gone.
            let r = self
                .ctrl
                .quiesce(id, self.timeout.as_millis() as u64)
                .map_err(DataplaneError::from)
                .and_then(|()| self.wait_queues_gone(&device));
            if let Err(e) = r {
                quiesced = false;
                first_err.get_or_insert(e);
            }
            device.cdev = None;
        }
        for w in &mut self.workers {
            let cmd = if quiesced {
                WorkerCmd::Shutdown
            } else {
                WorkerCmd::Abandon
            };
            let _ = w.tx.send(cmd);
            let _ = w.event.notify();
            if quiesced && w.stats.down_errno().is_none() {
                if let Some(j) = w.join.take() {
                    let _ = j.join();
                }
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    fn wait_queues_gone(&self, device: &Device) -> Result<(), DataplaneError> {
        let dev_id = device.info.dev_id;
        // A failed worker reports nothing: its queues are not waited for.
        let mut left = device
            .queues
            .iter()
            .filter(|q| !q.is_worker_failed())
            .count();
        let deadline = Instant::now() + self.timeout;
        while left > 0 {
            let now = Instant::now();
            if now >= deadline {
                return Err(DataplaneError::StopTimeout(dev_id));
            }
            match self.gone_rx.recv_timeout(deadline - now) {
                Ok((d, _)) if d == dev_id => left -= 1,
                Ok(_) => {}
                Err(_) => return Err(DataplaneError::StopTimeout(dev_id)),
            }
        }
        Ok(())
    }

    /// Resolves zero copy and polling for `spec` on `backend`. `kernel_zc` is the kernel
    /// device's own setting when taking one over (it cannot change).
    fn modes(
        &self,
        spec: &DeviceSpec,
        backend: &dyn backend::Backend,
        kernel_zc: Option<bool>,
    ) -> Result<(bool, bool), DataplaneError> {
        let offer_zc = if !self.features.contains(Features::AUTO_BUF_REG) {
            Err("zero copy (UBLK_F_AUTO_BUF_REG)")
        } else if !backend.zero_copy() {
            Err("zero copy with this backend, which copies by design")
        } else {
            Ok(())
        };
        let offer_poll = if backend.pollable() {
            Ok(())
        } else {
            Err("polling: it needs an NVMe namespace whose controller has poll queues")
        };
        let mut polled = spec.poll.resolve(offer_poll)?;
        let mut zero_copy = match kernel_zc {
            Some(z) => z,
            None => spec.zero_copy.resolve(offer_zc)?,
        };
        if polled && zero_copy && !self.iopoll_shared {
            // Before Linux 7.1 a kernel buffer and a polled command cannot share a ring: keep
            // what was asked for explicitly, prefer zero copy otherwise.
            match (spec.zero_copy, spec.poll) {
                (Toggle::On, Toggle::On) => {
                    return Err(SpecError::Unsupported(
                        "zero copy together with polling (Linux 7.1 or later)",
                    )
                    .into())
                }
                (_, Toggle::On) if kernel_zc.is_none() => zero_copy = false,
                _ => polled = false,
            }
        }
        Ok((zero_copy, polled))
    }

    /// Refuses a backend whose part of a shared device overlaps another device's.
    fn check_claim(
        &self,
        backend: &dyn backend::Backend,
        except: u32,
    ) -> Result<(), DataplaneError> {
        let Some(mine) = backend.claim() else {
            return Ok(());
        };
        for (&id, d) in &self.devices {
            if id == except {
                continue;
            }
            if let Some(theirs) = d.backend.claim().filter(|c| c.overlaps(&mine)) {
                return Err(DataplaneError::Overlap {
                    path: mine.path,
                    start: theirs.start.max(mine.start),
                    end: theirs.end.min(mine.end),
                    dev_id: id,
                });
            }
        }
        Ok(())
    }

    fn placement(&self, polled: bool) -> Placement {
        match (polled, self.iopoll_shared) {
            (false, _) => Placement::Main,
            (true, true) => Placement::Poll,
            (true, false) => Placement::Split,
        }
    }

    fn add(&mut self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        spec.validate(max_queues())?;
        let path = spec.io_path.resolve(self.features, spec.queue_depth)?;
        let backend = backend::open(&spec.backend, spec.size_bytes, spec.block_size)?;
        self.check_claim(backend.as_ref(), u32::MAX)?;
        let (zero_copy, polled) = self.modes(&spec, backend.as_ref(), None)?;
        let mut spec = spec;
        if let Some(l) = backend.limits() {
            // Passthrough is never split: requests must fit the device's transfer limit.
            spec.max_io_bytes = spec.max_io_bytes.min(l.max_io_bytes);
        }
        spec.max_io_bytes = spec.max_io_bytes.min(copy_max_io(spec.queue_depth));
        let wanted = spec.wanted_flags(self.features, path, zero_copy);
        let granted = self.ctrl.add_dev(&spec.dev_info(wanted))?;
        let dev_id = granted.dev_id;
        let info = DeviceInfo {
            dev_id,
            spec: spec.clone(),
            io_path: path,
            flags: granted.flags,
            zero_copy,
            polled,
            copy_queues: 0,
            block_device: PathBuf::from(format!("/dev/ublkb{dev_id}")),
            char_device: PathBuf::from(format!("/dev/ublkc{dev_id}")),
        };
        let mut device = Device::new(info.clone(), backend);
        match self.bring_up(&mut device, &granted, wanted) {
            Ok(()) => {
                self.devices.insert(dev_id, device);
                Ok(info)
            }
            Err(e) => {
                // Undo: whatever exists of the device goes; the original error is what counts.
                let _ = self.tear_down(&mut device);
                Err(e)
            }
        }
    }

    fn bring_up(
        &mut self,
        device: &mut Device,
        granted: &sys::ublksrv_ctrl_dev_info,
        wanted: u64,
    ) -> Result<(), DataplaneError> {
        let dev_id = device.info.dev_id;
        let essential =
            wanted & (sys::UBLK_F_BATCH_IO | sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_AUTO_BUF_REG);
        if granted.flags & essential != essential
            || granted.nr_hw_queues != device.info.spec.queues
            || granted.queue_depth != device.info.spec.queue_depth
        {
            return Err(DataplaneError::FlagsRefused {
                granted: granted.flags,
                missing: essential & !granted.flags,
            });
        }
        let limits = device.backend.limits();
        self.ctrl
            .set_params(dev_id, &device.info.spec.params(limits.as_ref()))?;
        self.attach_queues(device, false)?;
        self.ctrl.start_dev(dev_id)?;
        Ok(())
    }

    /// Opens `/dev/ublkcN` (once) and hands every queue not attached yet to its worker, which
    /// maps it, arms its commands and replies once the kernel has accepted them.
    fn attach_queues(
        &mut self,
        device: &mut Device,
        recovering: bool,
    ) -> Result<(), DataplaneError> {
        let dev_id = device.info.dev_id;
        let cdev = match &device.cdev {
            Some(c) => Arc::clone(c),
            None => {
                let c = Arc::new(open_char_device(&device.info.char_device, self.timeout)?);
                device.cdev = Some(Arc::clone(&c));
                c
            }
        };
        let queues = device.info.spec.queues;
        let placement = self.placement(device.info.polled);
        // Queues 0..len are attached (a resumed takeover starts after them).
        let first = u16::try_from(device.queues.len()).unwrap_or(queues);
        for q in first..queues {
            if recovering && q + 1 == queues && hooks::fire(Fault::RecoverAfterStart) {
                return Err(DataplaneError::Attach {
                    q_id: q,
                    source: WorkerError::Injected,
                });
            }
            let home = self
                .affine_worker(dev_id, q)
                .unwrap_or((dev_id as usize + usize::from(q)) % self.workers.len());
            // Zero copy takes one buffer slot per tag on the worker's ring: a worker whose
            // table is full refuses, and the queue goes to the next one that has room. A new
            // device none can take is refused (RESOURCE_EXHAUSTED); a device being taken over
            // (its mode is the kernel's) is served by copy on its own worker.
            let mut tries: Vec<(usize, bool)> = (0..self.workers.len())
                .map(|i| ((home + i) % self.workers.len(), false))
                .collect();
            if recovering && device.info.zero_copy && device.info.flags & sys::UBLK_F_USER_COPY != 0
            {
                tries.push((home, true));
            }
            let mut last = None;
            for (w, copy) in tries {
                match self.attach_queue(device, &cdev, q, w, placement, copy) {
                    Ok(()) => {
                        if copy {
                            device.info.copy_queues += 1;
                        }
                        last = None;
                        break;
                    }
                    Err(DataplaneError::Attach {
                        source: WorkerError::Ring(RingError::NoFixedSlot),
                        ..
                    }) if !device.stuck => {
                        last = Some(DataplaneError::Attach {
                            q_id: q,
                            source: WorkerError::Ring(RingError::NoFixedSlot),
                        });
                    }
                    Err(e) => return Err(e),
                }
            }
            if let Some(e) = last {
                return Err(e);
            }
        }
        Ok(())
    }

    /// The worker whose CPU blk-mq maps to queue `q` (GET_QUEUE_AFFINITY), so a request is
    /// served, and completes, on the CPU that submitted it; devices spread over the workers
    /// when several CPUs share a queue. None when no worker runs on one of those CPUs.
    fn affine_worker(&mut self, dev_id: u32, q: u16) -> Option<usize> {
        let cpus = self.ctrl.queue_affinity(dev_id, q).ok()?;
        let matching: Vec<usize> = self
            .workers
            .iter()
            .enumerate()
            .filter(|(_, w)| cpus.contains(&w.cpu))
            .map(|(i, _)| i)
            .collect();
        matching
            .get(dev_id as usize % matching.len().max(1))
            .copied()
    }

    /// Hands queue `q` to worker `w` and waits for its answer.
    fn attach_queue(
        &mut self,
        device: &mut Device,
        cdev: &Arc<File>,
        q: u16,
        w: usize,
        placement: Placement,
        copy_if_no_slots: bool,
    ) -> Result<(), DataplaneError> {
        let spec = &device.info.spec;
        let stats = Arc::new(QueueStats::default());
        let setup = Box::new(QueueSetup {
            dev_id: device.info.dev_id,
            q_id: q,
            depth: spec.queue_depth,
            max_io: spec.max_io_bytes,
            path: device.info.io_path,
            zero_copy: device.info.zero_copy,
            user_copy: device.info.flags & sys::UBLK_F_USER_COPY != 0,
            force_fallback: spec.force_copy_fallback,
            copy_if_no_slots,
            placement,
            cdev: Arc::clone(cdev),
            backend: Arc::clone(&device.backend),
            stats: Arc::clone(&stats),
            gone: self.gone_tx.clone(),
        });
        let w = &self.workers[w];
        let (reply, rx) = mpsc::sync_channel(1);
        w.tx.send(WorkerCmd::Attach(setup, reply))
            .map_err(|_| DataplaneError::Gone)?;
        let _ = w.event.notify();
        // Counted until told otherwise: the worker reports every queue it holds commands of
        // when the kernel lets go of them.
        device.queues.push(stats);
        match rx.recv_timeout(self.timeout) {
            Ok(Ok(())) => Ok(()),
            Ok(Err(AttachError { source, held })) => {
                if held {
                    device.stuck = true;
                } else {
                    device.queues.pop();
                }
                Err(DataplaneError::Attach { q_id: q, source })
            }
            Err(_) => {
                device.stuck = true;
                Err(DataplaneError::AttachTimeout { q_id: q })
            }
        }
    }

    fn delete(&mut self, dev_id: u32) -> Result<(), DataplaneError> {
        let mut device = self
            .devices
            .remove(&dev_id)
            .or_else(|| self.recovering.remove(&dev_id))
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        self.tear_down(&mut device)
    }

    /// STOP_DEV, wait until every attached queue is gone, close our fd, DEL_DEV. When queues
    /// do not let go in time the device is deleted all the same with DEL_DEV_ASYNC, which
    /// returns at once (the kernel frees it when the last reference goes): no leaked device,
    /// and a stuck one cannot block the control thread.
    fn tear_down(&mut self, device: &mut Device) -> Result<(), DataplaneError> {
        let dev_id = device.info.dev_id;
        let stop = self.ctrl.stop_dev(dev_id);
        let gone = self.wait_queues_gone(device);
        device.cdev = None;
        // A failed worker keeps its queues' files open until the process exits.
        let held = device.queues.iter().any(|q| q.is_worker_failed());
        if gone.is_err() || held {
            let _ = self.ctrl.del_dev_async(dev_id);
            return gone;
        }
        stop?;
        self.ctrl.del_dev(dev_id)?;
        Ok(())
    }

    fn resize(&mut self, dev_id: u32, size: u64) -> Result<DeviceInfo, DataplaneError> {
        let device = self
            .devices
            .get_mut(&dev_id)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        let mut spec = device.info.spec.clone();
        spec.size_bytes = size;
        spec.validate(max_queues())?;
        if !self.features.contains(Features::UPDATE_SIZE) {
            return Err(SpecError::Unsupported("UPDATE_SIZE").into());
        }
        device.backend.resize(size)?;
        self.ctrl.update_size(dev_id, size / 512)?;
        device.info.spec = spec;
        Ok(device.info.clone())
    }

    fn stats(&self, dev_id: u32) -> Result<DeviceStats, DataplaneError> {
        let device = self
            .devices
            .get(&dev_id)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        let mut total = StatsSnapshot::default();
        for q in &device.queues {
            total.merge(&q.snapshot());
        }
        Ok(DeviceStats {
            dev_id,
            total,
            memory_bytes: device.backend.memory_bytes(),
        })
    }
}

/// Most bytes per request for a queue of `depth` tags: a queue's copy buffers (`depth` of
/// them) are one io_uring registration, which may not exceed 1 GiB. The kernel splits larger
/// requests, so the cap costs nothing but request size at very deep queues.
fn copy_max_io(depth: u16) -> u32 {
    let per_tag = (1u32 << 30) / u32::from(depth.max(1));
    (per_tag & !4095).max(4096)
}

/// The data path a device's flags ask for that this server does not speak, if any: serving such
/// a device could only corrupt its data.
fn unservable_flags(flags: u64) -> Option<&'static str> {
    let foreign = [
        (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
        (sys::UBLK_F_ZONED, "ZONED"),
        (sys::UBLK_F_INTEGRITY, "INTEGRITY"),
        (sys::UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
        (sys::UBLK_F_IO_DESC_SIZE, "IO_DESC_SIZE"),
    ];
    let zc_only = sys::UBLK_F_USER_COPY | sys::UBLK_F_SUPPORT_ZERO_COPY;
    foreign
        .iter()
        .find(|(bit, _)| flags & bit != 0)
        .map(|(_, name)| *name)
        .or_else(|| {
            (flags & zc_only != 0 && flags & sys::UBLK_F_AUTO_BUF_REG == 0)
                .then_some("USER_COPY or SUPPORT_ZERO_COPY without AUTO_BUF_REG")
        })
}

/// Ids of every ublk device the kernel has (from sysfs, or /dev), sorted. Issues no control
/// command: cheap enough to call before each create.
pub fn kernel_device_ids() -> Vec<u32> {
    let mut ids: Vec<u32> = std::fs::read_dir("/sys/class/ublk-char")
        .or_else(|_| std::fs::read_dir("/dev"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("ublkc"))
                        .and_then(|n| n.parse().ok())
                })
                .collect()
        })
        .unwrap_or_default();
    ids.sort_unstable();
    ids.dedup();
    ids
}

/// Opens `/dev/ublkcN`, waiting up to `timeout` for the node to appear (udev may create it late).
fn open_char_device(path: &PathBuf, timeout: Duration) -> Result<File, DataplaneError> {
    let deadline = Instant::now() + timeout;
    loop {
        match OpenOptions::new().read(true).write(true).open(path) {
            Ok(f) => return Ok(f),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(10));
            }
            Err(source) => {
                return Err(DataplaneError::OpenCharDevice {
                    path: path.clone(),
                    source,
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_buffers_of_a_queue_fit_one_registration() {
        for depth in [1u16, 32, 128, 1000, 4096] {
            let max = copy_max_io(depth);
            assert_eq!(max % 4096, 0);
            assert!(
                u64::from(max) * u64::from(depth) <= 1 << 30,
                "depth {depth}"
            );
        }
        assert_eq!(copy_max_io(4096), 256 << 10);
        assert_eq!(copy_max_io(128), 8 << 20);
    }

    #[test]
    fn recovery_refuses_data_paths_ublkd_does_not_speak() {
        let ours = sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_BATCH_IO | sys::UBLK_F_AUTO_BUF_REG;
        assert_eq!(unservable_flags(ours), None);
        assert_eq!(unservable_flags(ours | sys::UBLK_F_USER_COPY), None);
        for (bit, name) in [
            (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
            (sys::UBLK_F_ZONED, "ZONED"),
            (sys::UBLK_F_INTEGRITY, "INTEGRITY"),
            (sys::UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
            (sys::UBLK_F_IO_DESC_SIZE, "IO_DESC_SIZE"),
        ] {
            assert_eq!(unservable_flags(ours | bit), Some(name));
        }
        assert!(unservable_flags(sys::UBLK_F_USER_COPY).is_some());
    }
}
