//! The control thread's state (workers, devices, devices being taken over) and the commands
//! with no step file of their own: drain and resume, limits, statistics, the kernel's device
//! list, deleting a device ublkd does not own, the shutdown that keeps devices. Its command loop
//! is in the parent module; a device's life in `lifecycle.rs` and `recover.rs`.

use super::{
    kernel_device_ids, DataplaneError, DeviceInfo, DeviceStats, KernelDevice, KernelState,
};
use crate::backend;
use crate::ctrl::{ControlDevice, CtrlError};
use crate::device::IoPath;
use crate::features::Features;
use crate::ids::{DevId, QueueId};
use crate::placement::PlacementPolicy;
use crate::qos::{QosLimits, Throttle};
use crate::stats::{CleanupErrors, CleanupStep, QueueStats, StatsSnapshot, WorkerStats};
use crate::sys::{self, os};
use crate::worker::WorkerCmd;
use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::path::PathBuf;
use std::sync::mpsc::{self, Receiver, Sender};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

pub(super) struct WorkerThread {
    pub(super) cpu: usize,
    pub(super) tx: Sender<WorkerCmd>,
    pub(super) event: Arc<os::EventFd>,
    pub(super) stats: Arc<WorkerStats>,
    /// How long it spins before sleeping (`crate::poll::idle_spin`).
    pub(super) spin: std::time::Duration,
    pub(super) join: Option<JoinHandle<()>>,
}

impl WorkerThread {
    /// Sends `cmd` and wakes the worker for it; false when the worker's thread has ended (it
    /// holds no queue then, so there is nothing left for the command to do).
    pub(super) fn tell(&self, cmd: WorkerCmd) -> bool {
        if self.tx.send(cmd).is_err() {
            return false;
        }
        self.wake();
        true
    }

    /// Wakes the worker through its eventfd. A failed write is counted (`Wake`); the worker
    /// still finds the command at its next completion.
    pub(super) fn wake(&self) {
        if self.event.notify().is_err() {
            self.stats.cleanup_failed(CleanupStep::Wake);
        }
    }

    /// Waits for the worker's thread to end; a thread that panicked is counted
    /// (`WorkerPanicked`).
    pub(super) fn join(&mut self) {
        if let Some(j) = self.join.take() {
            if j.join().is_err() {
                self.stats.cleanup_failed(CleanupStep::WorkerPanicked);
            }
        }
    }
}

pub(super) struct Device {
    pub(super) info: DeviceInfo,
    pub(super) backend: Arc<dyn backend::Backend>,
    /// Stats of every queue a worker serves or still holds commands of (each reports when it
    /// is gone). Unless `stuck`, these are queues 0..len, all accepted by the kernel.
    pub(super) queues: Vec<Arc<QueueStats>>,
    /// A queue's attach failed while the worker held commands of it: they stay with the kernel
    /// until the device stops or the process exits, so the queue cannot be attached again.
    pub(super) stuck: bool,
    pub(super) cdev: Option<Arc<File>>,
    /// The shared buckets of a limited device; None while it is unlimited.
    pub(super) throttle: Option<Arc<Throttle>>,
}

impl Device {
    pub(super) fn new(info: DeviceInfo, backend: Arc<dyn backend::Backend>) -> Self {
        let qos = info.spec.qos;
        Self {
            info,
            backend,
            queues: Vec::new(),
            stuck: false,
            cdev: None,
            throttle: (!qos.is_unlimited()).then(|| Arc::new(Throttle::new(qos))),
        }
    }
}

pub(super) struct Control {
    pub(super) ctrl: ControlDevice,
    pub(super) features: Features,
    pub(super) iopoll_shared: bool,
    /// `poll = auto` polls (the workers' CPUs run nothing else).
    pub(super) dedicated_cpus: bool,
    /// Which worker serves each queue.
    pub(super) placement: PlacementPolicy,
    pub(super) workers: Vec<WorkerThread>,
    pub(super) devices: BTreeMap<DevId, Device>,
    /// Devices whose takeover started (START_USER_RECOVERY) but did not finish: quiesced in the
    /// kernel, the queues attached so far kept, resumed by the next `recover` of the same id.
    pub(super) recovering: BTreeMap<DevId, Device>,
    pub(super) gone_tx: Sender<(DevId, QueueId)>,
    pub(super) gone_rx: Receiver<(DevId, QueueId)>,
    pub(super) timeout: Duration,
    /// Failures of the control thread's own clean-up steps.
    pub(super) cleanup: CleanupErrors,
}

impl Control {
    /// Asks every worker to hold the device's new requests and waits until each has none
    /// with the backend; on a timeout the device is resumed and the drain fails.
    pub(super) fn drain(&mut self, dev_id: DevId) -> Result<(), DataplaneError> {
        if !self.devices.contains_key(&dev_id) {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        }
        let mut answers = Vec::new();
        for w in &self.workers {
            let (reply, rx) = mpsc::sync_channel(1);
            if w.tell(WorkerCmd::Drain { dev_id, reply }) {
                answers.push(rx);
            }
        }
        let deadline = Instant::now() + self.timeout;
        for rx in answers {
            let left = deadline.saturating_duration_since(Instant::now());
            if rx.recv_timeout(left).is_err() {
                // The drain's own error is what the caller gets; a resume that fails too leaves
                // the device held, which the count says.
                if self.resume(dev_id).is_err() {
                    self.cleanup.failed(CleanupStep::ResumeAfterDrainTimeout);
                }
                return Err(DataplaneError::DrainTimeout(dev_id));
            }
        }
        Ok(())
    }

    pub(super) fn resume(&mut self, dev_id: DevId) -> Result<(), DataplaneError> {
        if !self.devices.contains_key(&dev_id) {
            return Err(DataplaneError::NoSuchDevice(dev_id));
        }
        self.resume_workers(dev_id);
        Ok(())
    }

    /// Tells every worker to serve the device's held requests (nothing to do if none are).
    pub(super) fn resume_workers(&self, dev_id: DevId) {
        for w in &self.workers {
            // A worker that is gone holds none of the device's requests.
            w.tell(WorkerCmd::Resume { dev_id });
        }
    }

    /// New limits for a device, in effect for its next request. Limited to limited changes the
    /// shared buckets in place; from or to unlimited, every worker is told (only those serving
    /// a queue of the device act on it).
    pub(super) fn set_qos(
        &mut self,
        dev_id: DevId,
        limits: QosLimits,
    ) -> Result<DeviceInfo, DataplaneError> {
        let device = self
            .devices
            .get_mut(&dev_id)
            .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
        let change = match (&device.throttle, limits.is_unlimited()) {
            (Some(t), false) => {
                t.set_limits(limits);
                None
            }
            (None, true) => None,
            (Some(_), true) => Some(None),
            (None, false) => Some(Some(Arc::new(Throttle::new(limits)))),
        };
        if let Some(throttle) = change {
            Self::send_throttle(&self.workers, dev_id, throttle.clone());
            device.throttle = throttle;
        }
        device.info.spec.qos = limits;
        Ok(device.info.clone())
    }

    /// Tells every worker the device's new throttle (only those serving a queue of it act).
    fn send_throttle(workers: &[WorkerThread], dev_id: DevId, throttle: Option<Arc<Throttle>>) {
        for w in workers {
            let cmd = WorkerCmd::Throttle {
                dev_id,
                throttle: throttle.clone(),
            };
            // A worker that is gone has no queue of this device left to throttle.
            w.tell(cmd);
        }
    }

    /// Before a device stops: its requests waiting for QoS tokens start now, so STOP_DEV,
    /// which waits for every request, is not held by the limit's debt (128 requests of 1 MiB
    /// at 1 MiB/s would hold it two minutes, past the control timeout).
    pub(super) fn drop_throttle(&self, device: &mut Device) {
        if device.throttle.take().is_some() {
            Self::send_throttle(&self.workers, device.info.dev_id, None);
        }
    }

    pub(super) fn kernel_devices(&mut self) -> Result<Vec<KernelDevice>, DataplaneError> {
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

    pub(super) fn delete_foreign(&mut self, dev_id: DevId) -> Result<(), DataplaneError> {
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
        // A device without a server may refuse STOP_DEV (already stopped): expected, so not
        // counted; DEL_DEV decides, and its error is the caller's.
        let _ = self.ctrl.stop_dev(dev_id);
        self.ctrl.del_dev(dev_id)?;
        Ok(())
    }

    pub(super) fn shutdown_keep(&mut self) -> Result<(), DataplaneError> {
        let mut first_err = None;
        let ids: Vec<DevId> = self.devices.keys().copied().collect();
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
            // A worker whose thread has ended is already shut down.
            w.tell(cmd);
            if quiesced && w.stats.down_errno().is_none() {
                w.join();
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    pub(super) fn wait_queues_gone(&self, device: &Device) -> Result<(), DataplaneError> {
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

    pub(super) fn stats(&self, dev_id: DevId) -> Result<DeviceStats, DataplaneError> {
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

/// Opens `/dev/ublkcN`, waiting up to `timeout` for the node to appear (udev may create it late).
pub(super) fn open_char_device(path: &PathBuf, timeout: Duration) -> Result<File, DataplaneError> {
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
    #![allow(clippy::unwrap_used)]

    use super::*;

    fn count(w: &WorkerThread, step: CleanupStep) -> u64 {
        w.stats
            .cleanup_errors()
            .into_iter()
            .find(|&(s, _)| s == step)
            .map_or(0, |(_, n)| n)
    }

    #[test]
    fn a_worker_thread_that_panicked_is_counted_and_told_nothing_more() {
        let (tx, rx) = mpsc::channel::<WorkerCmd>();
        let join = std::thread::spawn(move || {
            drop(rx);
            panic!("a worker thread panics (test)");
        });
        let mut w = WorkerThread {
            cpu: 0,
            tx,
            event: Arc::new(os::EventFd::new().unwrap()),
            stats: Arc::new(WorkerStats::default()),
            spin: std::time::Duration::ZERO,
            join: Some(join),
        };
        w.join();
        assert_eq!(count(&w, CleanupStep::WorkerPanicked), 1);
        // Its receiver is gone: a command has nobody to reach, and no wake is tried.
        assert!(!w.tell(WorkerCmd::Shutdown));
        assert_eq!(count(&w, CleanupStep::Wake), 0);
        // Joined once: a second join has no thread left to wait for.
        w.join();
        assert_eq!(count(&w, CleanupStep::WorkerPanicked), 1);
    }
}
