//! The dataplane's only public control surface: [`Handle`].
//!
//! `Handle::start` spawns one pinned worker per CPU and a control thread. Commands travel to the
//! control thread over a channel, each with its own reply channel; the control thread runs the
//! `/dev/ublk-control` commands (bounded by timeouts, never on a worker) and hands queues to the
//! workers over their own channels, waking each through an eventfd its ring is reading.

use crate::backend::{Erase, Growth};
use crate::ctrl::ControlDevice;
use crate::device::{DeviceSpec, IoPath};
use crate::features::Features;
use crate::ids::{DevId, QueueId};
use crate::placement::{PlacementPolicy, PlacementReason, QueuePlacement};
use crate::poll::PollReason;
use crate::qos::QosLimits;
use crate::reply::Answer;
use crate::stats::{CleanupErrors, CleanupStep, StatsSnapshot, WorkerStats};
use crate::sys::{self, os};
use crate::worker::Worker;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Duration;

mod control;
mod error;
mod lifecycle;
mod recover;

use control::{Control, WorkerThread};
pub use error::{DataplaneError, ErrorKind};

/// How the dataplane runs.
#[derive(Debug, Clone)]
pub struct Config {
    /// CPUs to run one pinned worker on each; empty means every CPU this process may use.
    pub cpus: Vec<usize>,
    /// Bound on each control command and on waiting for a device's queues to stop.
    pub timeout: Duration,
    /// The operator says the workers' CPUs run nothing else (e.g. exclusive CPUs from the
    /// Kubernetes static CPU manager), so `poll = auto` polls. CPUs the kernel isolates
    /// (`isolcpus=`, `nohz_full=`) count as dedicated without it.
    pub dedicated_cpus: bool,
    /// Which worker serves each queue (`crate::placement`).
    pub placement: PlacementPolicy,
    /// How long an idle worker looks for work in user space before it sleeps
    /// (`crate::poll::idle_spin`); zero sleeps at once; None: spin on dedicated CPUs only.
    pub idle_spin: Option<Duration>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            cpus: Vec::new(),
            timeout: Duration::from_secs(10),
            dedicated_cpus: false,
            placement: PlacementPolicy::Auto,
            idle_spin: None,
        }
    }
}

/// A device as the dataplane serves it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    pub dev_id: DevId,
    pub spec: DeviceSpec,
    /// The path actually used (Auto resolved).
    pub io_path: IoPath,
    /// Flags the kernel granted.
    pub flags: u64,
    /// Zero copy is on (UBLK_F_AUTO_BUF_REG).
    pub zero_copy: bool,
    /// Backend I/O is polled (IOPOLL ring).
    pub polled: bool,
    /// Why `polled` is what it is.
    pub poll_reason: PollReason,
    /// Queues of a zero-copy device served by copy: taken over when no worker had buffer slots
    /// left for them (a new device is refused instead).
    pub copy_queues: u16,
    /// A zero-copy device all of whose requests are served by copy (the kernel is handed a
    /// buffer slot it cannot use, so each comes with UBLK_IO_F_NEED_REG_BUF): one taken over by
    /// a backend that copies, such as an orphan adopted as a RAM volume.
    pub every_request_by_copy: bool,
    /// Where the queues went (`crate::placement`), and why.
    pub placement: QueuePlacement,
    pub placement_reason: PlacementReason,
    /// The CPU of the worker serving each queue, by queue number (filled as queues attach).
    pub queue_cpus: Vec<usize>,
    /// How the backend's range was erased before the device appeared (`DeviceSpec::erase`);
    /// None when nothing needed erasing or the device was taken over.
    pub erased: Option<Erase>,
    pub block_device: PathBuf,
    pub char_device: PathBuf,
}

impl DeviceInfo {
    /// Whether every request's pages are lent by the kernel (zero copy on, no queue copying).
    pub fn zero_copy_in_use(&self) -> bool {
        self.zero_copy && self.copy_queues == 0 && !self.every_request_by_copy
    }
}

/// Statistics of one device: its queues merged, plus backend memory.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct DeviceStats {
    pub dev_id: DevId,
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
    /// Whether its thread runs pinned to `cpu`.
    pub pinned: bool,
    /// Failures of its clean-up steps so far (`stats::CleanupStep`).
    pub cleanup_errors: Vec<(CleanupStep, u64)>,
    /// How long it looks for work before it sleeps (`crate::poll::idle_spin`).
    pub idle_spin: Duration,
    /// Its waits for work that ended while spinning, then sleeping (`stats::Wait`); both
    /// zero when it does not spin.
    pub waits: [u64; 2],
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
    pub dev_id: DevId,
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
    Add {
        spec: DeviceSpec,
        reply: Reply<DeviceInfo>,
    },
    /// STOP_DEV, wait for the workers to let go, DEL_DEV.
    Delete {
        dev_id: DevId,
        reply: Reply<()>,
    },
    /// UPDATE_SIZE to a new size in bytes.
    Resize {
        dev_id: DevId,
        size_bytes: u64,
        growth: Growth,
        reply: Reply<DeviceInfo>,
    },
    /// Hold the device's new requests and wait until none is with the backend.
    Drain {
        dev_id: DevId,
        reply: Reply<()>,
    },
    /// Serve the device's held requests and new ones again.
    Resume {
        dev_id: DevId,
        reply: Reply<()>,
    },
    /// New I/O limits, live.
    SetQos {
        dev_id: DevId,
        limits: QosLimits,
        reply: Reply<DeviceInfo>,
    },
    Stats {
        dev_id: DevId,
        reply: Reply<DeviceStats>,
    },
    /// Statistics of every device, in one round trip.
    StatsAll(Reply<Vec<DeviceStats>>),
    List(Reply<Vec<DeviceInfo>>),
    Workers(Reply<Vec<WorkerSnapshot>>),
    /// Failures of the control thread's own clean-up steps.
    ControlCleanup(Reply<Vec<(CleanupStep, u64)>>),
    /// Take over a device whose server is gone (START/END_USER_RECOVERY); the spec's `dev_id`
    /// names it.
    Recover {
        spec: DeviceSpec,
        reply: Reply<DeviceInfo>,
    },
    /// Every ublk device in the kernel.
    KernelDevices(Reply<Vec<KernelDevice>>),
    /// STOP_DEV + DEL_DEV of a device this dataplane does not serve (an orphan).
    DeleteForeign {
        dev_id: DevId,
        reply: Reply<()>,
    },
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
    /// How long a read (statistics, the device list) waits for the control thread.
    read_timeout: std::time::Duration,
}

impl Handle {
    /// Probes the kernel, starts the workers and the control thread.
    pub fn start(config: Config) -> Result<Handle, DataplaneError> {
        crate::hooks::arm_from_env();
        let mut ctrl = ControlDevice::open()?;
        ctrl.set_timeout(config.timeout);
        let features = ctrl.features()?;
        check_features(features)?;
        // Whether ublk commands may share an IOPOLL ring (Linux >= 7.1): probed, never guessed.
        let iopoll_shared =
            !crate::hooks::fire(crate::hooks::Fault::IopollSplit) && ctrl.iopoll_takes_ublk_cmds();
        let cpus = if config.cpus.is_empty() {
            os::allowed_cpus()
        } else {
            config.cpus.clone()
        };
        let dedicated_cpus = config.dedicated_cpus || crate::poll::host_cpus_isolated(&cpus);
        let idle_spin = crate::poll::idle_spin(config.idle_spin, dedicated_cpus);
        let mut workers = Vec::new();
        for cpu in cpus {
            workers.push(spawn_worker(cpu, idle_spin)?);
        }
        let n = workers.len();
        let (gone_tx, gone_rx) = mpsc::channel();
        let control = Control {
            ctrl,
            features,
            iopoll_shared,
            dedicated_cpus,
            placement: config.placement,
            workers,
            devices: BTreeMap::new(),
            recovering: BTreeMap::new(),
            gone_tx,
            gone_rx,
            timeout: config.timeout,
            cleanup: CleanupErrors::default(),
        };
        let (tx, rx) = mpsc::channel();
        std::thread::Builder::new()
            .name("ublkd-ctrl".into())
            .spawn(move || run_control(control, rx))
            .map_err(DataplaneError::Spawn)?;
        Ok(Handle {
            tx,
            features,
            iopoll_shared,
            workers: n,
            read_timeout: config.timeout,
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

    /// A read that changes nothing: it waits for the control thread at most `read_timeout`,
    /// so that a scrape or a status call never hangs behind a slow command. A change is never
    /// abandoned this way (its caller must learn its outcome).
    fn read<T>(&self, make: impl FnOnce(Reply<T>) -> Command) -> Result<T, DataplaneError> {
        let (reply, rx) = mpsc::sync_channel(1);
        self.tx
            .send(make(reply))
            .map_err(|_| DataplaneError::Gone)?;
        match rx.recv_timeout(self.read_timeout) {
            Ok(r) => r,
            Err(mpsc::RecvTimeoutError::Timeout) => {
                Err(DataplaneError::ControlBusy(self.read_timeout))
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => Err(DataplaneError::Gone),
        }
    }

    /// Creates and starts a device; `/dev/ublkbN` serves I/O when this returns.
    pub fn add_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        self.call(|reply| Command::Add { spec, reply })
    }

    /// Stops and deletes a device; its device nodes are gone when this returns.
    pub fn delete_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.call(|reply| Command::Delete { dev_id, reply })
    }

    /// Changes a device's capacity (UBLK_F_UPDATE_SIZE); `growth` says whether an NVMe
    /// window's new blocks are erased here or were erased by the caller.
    pub fn resize_device(
        &self,
        dev_id: DevId,
        size_bytes: u64,
        growth: Growth,
    ) -> Result<DeviceInfo, DataplaneError> {
        self.call(|reply| Command::Resize {
            dev_id,
            size_bytes,
            growth,
            reply,
        })
    }

    /// Drains a device: from now on its new requests wait in the workers (the kernel keeps
    /// them queued), and this returns once every request already started has completed, so
    /// the backend holds exactly what was acknowledged. Undone by [`Handle::resume_device`];
    /// a drain that times out resumes the device itself.
    pub fn drain_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.call(|reply| Command::Drain { dev_id, reply })
    }

    /// Serves a drained device again, its held requests first.
    pub fn resume_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.call(|reply| Command::Resume { dev_id, reply })
    }

    /// Changes a device's I/O limits; its next request is held to them.
    pub fn set_qos(&self, dev_id: DevId, limits: QosLimits) -> Result<DeviceInfo, DataplaneError> {
        self.call(|reply| Command::SetQos {
            dev_id,
            limits,
            reply,
        })
    }

    pub fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError> {
        self.read(|reply| Command::Stats { dev_id, reply })
    }

    /// Statistics of every device this dataplane serves, in one call (a scrape with hundreds
    /// of volumes makes one round trip to the control thread, not one per volume).
    pub fn stats_all(&self) -> Result<Vec<DeviceStats>, DataplaneError> {
        self.read(Command::StatsAll)
    }

    pub fn list(&self) -> Result<Vec<DeviceInfo>, DataplaneError> {
        self.call(Command::List)
    }

    pub fn worker_stats(&self) -> Result<Vec<WorkerSnapshot>, DataplaneError> {
        self.read(Command::Workers)
    }

    /// Failures of the control thread's clean-up steps so far (the workers' are in
    /// [`WorkerSnapshot::cleanup_errors`]).
    pub fn control_cleanup_errors(&self) -> Result<Vec<(CleanupStep, u64)>, DataplaneError> {
        self.read(Command::ControlCleanup)
    }

    /// Deletes every device and stops all dataplane threads.
    pub fn shutdown(&self) -> Result<(), DataplaneError> {
        self.call(Command::Shutdown)
    }

    /// Takes over device `spec.dev_id`, left by a server that exited or crashed: the block device,
    /// its mounts and open files stay; requests queued meanwhile are served.
    pub fn recover_device(&self, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
        self.call(|reply| Command::Recover { spec, reply })
    }

    /// Every ublk device the kernel has, whoever serves it.
    pub fn kernel_devices(&self) -> Result<Vec<KernelDevice>, DataplaneError> {
        self.call(Command::KernelDevices)
    }

    /// Stops and deletes a device this dataplane does not serve.
    pub fn delete_foreign_device(&self, dev_id: DevId) -> Result<(), DataplaneError> {
        self.call(|reply| Command::DeleteForeign { dev_id, reply })
    }

    /// Stops serving but leaves every device in the kernel for the next server.
    pub fn shutdown_keep(&self) -> Result<(), DataplaneError> {
        self.call(Command::ShutdownKeep)
    }
}

/// Refuses a driver without user recovery: ublkd's every promise across a restart (devices
/// taken over, never deleted; in-flight I/O reissued) rests on it.
fn check_features(features: Features) -> Result<(), DataplaneError> {
    let missing = features.missing(Features::RECOVERY);
    if missing.0 == 0 {
        Ok(())
    } else {
        Err(DataplaneError::NoUserRecovery { features, missing })
    }
}

/// The control thread: takes each command in turn and answers it, handing a device's life
/// (add, delete, resize, takeover) to the file that owns it; cleans up as on shutdown once every
/// `Handle` is gone.
fn run_control(mut control: Control, rx: Receiver<Command>) {
    while let Ok(cmd) = rx.recv() {
        match cmd {
            Command::Add { spec, reply } => {
                reply.answer(lifecycle::add(&mut control, spec));
            }
            Command::Delete { dev_id: id, reply } => {
                reply.answer(lifecycle::delete(&mut control, id));
            }
            Command::Resize {
                dev_id: id,
                size_bytes: size,
                growth,
                reply,
            } => {
                reply.answer(lifecycle::resize(&mut control, id, size, growth));
            }
            Command::Drain { dev_id: id, reply } => {
                reply.answer(control.drain(id));
            }
            Command::Resume { dev_id: id, reply } => {
                reply.answer(control.resume(id));
            }
            Command::SetQos {
                dev_id: id,
                limits,
                reply,
            } => {
                reply.answer(control.set_qos(id, limits));
            }
            Command::Stats { dev_id: id, reply } => {
                reply.answer(control.stats(id));
            }
            Command::StatsAll(reply) => {
                let all = control
                    .devices
                    .keys()
                    .filter_map(|&id| control.stats(id).ok())
                    .collect();
                reply.answer(Ok(all));
            }
            Command::List(reply) => {
                reply.answer(Ok(control
                    .devices
                    .values()
                    .map(|d| d.info.clone())
                    .collect()));
            }
            Command::Workers(reply) => {
                reply.answer(Ok(control
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
                            pinned: w.stats.pinned(),
                            cleanup_errors: w.stats.cleanup_errors(),
                            idle_spin: w.spin,
                            waits: w.stats.waits(),
                        }
                    })
                    .collect()));
            }
            Command::ControlCleanup(reply) => {
                reply.answer(Ok(control.cleanup.counts()));
            }
            Command::Shutdown(reply) => {
                reply.answer(lifecycle::shutdown(&mut control));
                return;
            }
            Command::Recover { spec, reply } => {
                reply.answer(recover::recover(&mut control, spec));
            }
            Command::KernelDevices(reply) => {
                reply.answer(control.kernel_devices());
            }
            Command::DeleteForeign { dev_id: id, reply } => {
                reply.answer(control.delete_foreign(id));
            }
            Command::ShutdownKeep(reply) => {
                reply.answer(control.shutdown_keep());
                return;
            }
        }
    }
    // Every Handle is gone: clean up as on shutdown. Nobody is left to tell of a failure
    // but the count (the process is exiting, or its server dropped the dataplane).
    if lifecycle::shutdown(&mut control).is_err() {
        control.cleanup.failed(CleanupStep::ShutdownWithoutHandles);
    }
}

fn spawn_worker(cpu: usize, spin: Duration) -> Result<WorkerThread, DataplaneError> {
    let (tx, rx) = mpsc::channel();
    let event = Arc::new(os::EventFd::new().map_err(DataplaneError::Spawn)?);
    let stats = Arc::new(WorkerStats::default());
    let (ready_tx, ready_rx) = mpsc::sync_channel(1);
    let ev = Arc::clone(&event);
    let st = Arc::clone(&stats);
    let join = std::thread::Builder::new()
        .name(format!("ublkd-w{cpu}"))
        .spawn(move || {
            // Pinning is best effort: a CPU outside our cgroup's set still gets a worker, and
            // its snapshot (`ublkd_worker_pinned`) says it runs unpinned.
            st.set_pinned(os::pin_current_thread(cpu).is_ok());
            match Worker::new(rx, ev, st, spin) {
                Ok(w) => {
                    ready_tx.answer(Ok(()));
                    w.run();
                }
                Err(e) => {
                    ready_tx.answer(Err(e));
                }
            }
        })
        .map_err(DataplaneError::Spawn)?;
    match ready_rx.recv() {
        Ok(Ok(())) => {}
        Ok(Err(source)) => {
            return Err(DataplaneError::Attach {
                q_id: QueueId(0),
                source,
            })
        }
        Err(_) => return Err(DataplaneError::Gone),
    }
    Ok(WorkerThread {
        cpu,
        tx,
        event,
        stats,
        spin,
        join: Some(join),
    })
}

/// The block device ublk makes for device `dev_id`.
pub fn block_device(dev_id: DevId) -> PathBuf {
    PathBuf::from(format!("/dev/ublkb{dev_id}"))
}

/// The char device ublkd serves device `dev_id` through.
fn char_device(dev_id: DevId) -> PathBuf {
    PathBuf::from(format!("/dev/ublkc{dev_id}"))
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

/// Ids of every ublk device the kernel has (from sysfs, or /dev), sorted. Issues no control
/// command: cheap enough to call before each create.
pub fn kernel_device_ids() -> Vec<DevId> {
    let mut ids: Vec<DevId> = std::fs::read_dir("/sys/class/ublk-char")
        .or_else(|_| std::fs::read_dir("/dev"))
        .map(|d| {
            d.flatten()
                .filter_map(|e| {
                    e.file_name()
                        .to_str()
                        .and_then(|n| n.strip_prefix("ublkc"))
                        .and_then(|n| n.parse().ok())
                        .map(DevId)
                })
                .collect()
        })
        .unwrap_or_default();
    ids.sort_unstable();
    ids.dedup();
    ids
}

#[cfg(test)]
mod tests {
    use super::{check_features, DataplaneError, ErrorKind, Features};

    #[test]
    fn a_driver_without_user_recovery_is_refused() {
        let full = Features::RECOVERY | Features::BATCH_IO;
        assert!(check_features(full).is_ok());
        let e = check_features(Features::USER_RECOVERY | Features::BATCH_IO)
            .expect_err("no reissue: refused");
        assert!(
            matches!(e, DataplaneError::NoUserRecovery { missing, .. } if missing == Features::USER_RECOVERY_REISSUE),
            "{e:?}"
        );
        assert_eq!(e.kind(), ErrorKind::FailedPrecondition);
        assert_eq!(
            e.to_string(),
            "the ublk driver offers no user recovery (missing USER_RECOVERY_REISSUE): a device \
             would not outlive a restart of its server"
        );
        let none = check_features(Features::default()).expect_err("none: refused");
        assert!(
            none.to_string()
                .contains("USER_RECOVERY|USER_RECOVERY_REISSUE"),
            "{none}"
        );
    }
}
