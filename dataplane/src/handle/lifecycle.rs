//! Bringing a device up (ADD_DEV, SET_PARAMS, queues to workers, START_DEV), resizing it and
//! tearing it down, and every device at shutdown. Functions of the control thread's `Control`,
//! named at each call (`lifecycle::add`).

use super::control::{open_char_device, Control, Device};
use super::{block_device, char_device, max_queues, DataplaneError, DeviceInfo};
use crate::backend::{self, Growth};
use crate::ctrl::CtrlError;
use crate::device::{DeviceSpec, SpecError, Toggle};
use crate::features::Features;
use crate::hooks::{self, Fault};
use crate::ids::{DevId, QueueId};
use crate::placement::{self, PlacementReason, QueuePlacement};
use crate::poll::{self, PollReason};
use crate::ring::RingError;
use crate::stats::{CleanupStep, QueueStats};
use crate::sys;
use crate::worker::{AttachError, Placement, QueueSetup, WorkerCmd, WorkerError};
use std::fs::File;
use std::path::Path;
use std::sync::{mpsc, Arc};

/// Resolves zero copy and polling for `spec` on `backend`. `kernel_zc` is the kernel
/// device's own setting when taking one over (it cannot change). Also says why polling is
/// on or off.
pub(super) fn modes(
    control: &Control,
    spec: &DeviceSpec,
    backend: &dyn backend::Backend,
    kernel_zc: Option<bool>,
) -> Result<(bool, bool, PollReason), DataplaneError> {
    let offer_zc = if !control.features.contains(Features::AUTO_BUF_REG) {
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
    let (mut polled, mut reason) = poll::decide(spec.poll, offer_poll, control.dedicated_cpus)?;
    let mut zero_copy = match kernel_zc {
        Some(z) => z,
        None => spec.zero_copy.resolve(offer_zc)?,
    };
    if polled && zero_copy && !control.iopoll_shared {
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
            _ => {
                polled = false;
                reason = PollReason::ZeroCopyKept;
            }
        }
    }
    Ok((zero_copy, polled, reason))
}

/// Refuses a backend whose part of a shared device overlaps another device's.
pub(super) fn check_claim(
    control: &Control,
    backend: &dyn backend::Backend,
    except: Option<DevId>,
) -> Result<(), DataplaneError> {
    let Some(mine) = backend.claim() else {
        return Ok(());
    };
    for (&id, d) in control.devices.iter().chain(&control.recovering) {
        if Some(id) == except {
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

pub(super) fn ring_placement(control: &Control, polled: bool) -> Placement {
    match (polled, control.iopoll_shared) {
        (false, _) => Placement::Main,
        (true, true) => Placement::Poll,
        (true, false) => Placement::Split,
    }
}

pub(super) fn add(control: &mut Control, spec: DeviceSpec) -> Result<DeviceInfo, DataplaneError> {
    spec.validate(max_queues())?;
    let path = spec.io_path.resolve(control.features, spec.queue_depth)?;
    let backend = backend::open(&spec.backend, spec.size_bytes, spec.block_size)?;
    check_claim(control, backend.as_ref(), None)?;
    let (zero_copy, polled, poll_reason) = modes(control, &spec, backend.as_ref(), None)?;
    let (placement, placement_reason) =
        placement::decide(control.placement, control.dedicated_cpus);
    // Only once the range is known to be nobody else's.
    let erased = if spec.erase { backend.erase()? } else { None };
    let mut spec = spec;
    if let Some(l) = backend.limits() {
        // Passthrough is never split: requests must fit the device's transfer limit.
        spec.max_io_bytes = spec.max_io_bytes.min(l.max_io_bytes);
    }
    spec.max_io_bytes = spec.max_io_bytes.min(copy_max_io(spec.queue_depth));
    let wanted = spec.wanted_flags(control.features, path, zero_copy);
    let granted = control.ctrl.add_dev(&spec.dev_info(wanted))?;
    let dev_id = DevId(granted.dev_id);
    let mut info = DeviceInfo {
        dev_id,
        spec: spec.clone(),
        io_path: path,
        flags: granted.flags,
        zero_copy,
        polled,
        poll_reason,
        copy_queues: 0,
        // Test hook: a new zero-copy device made to take the fallback on every request.
        every_request_by_copy: zero_copy
            && crate::hooks::fire(crate::hooks::Fault::EveryRequestByCopy),
        placement,
        placement_reason,
        queue_cpus: Vec::new(),
        erased,
        block_device: block_device(dev_id),
        char_device: char_device(dev_id),
    };
    let mut device = Device::new(info.clone(), backend);
    match bring_up(control, &mut device, &granted, wanted) {
        Ok(()) => {
            // With the CPU each queue got, and the placement as it came out.
            info = device.info.clone();
            control.devices.insert(dev_id, device);
            Ok(info)
        }
        Err(e) => {
            // Undo: whatever exists of the device goes; the original error is what the
            // caller gets, and an undo that fails too is counted.
            if tear_down(control, &mut device).is_err() {
                control.cleanup.failed(CleanupStep::UndoFailedAdd);
            }
            Err(e)
        }
    }
}

pub(super) fn bring_up(
    control: &mut Control,
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
    control
        .ctrl
        .set_params(dev_id, &device.info.spec.params(limits.as_ref()))?;
    attach_queues(control, device, false)?;
    control.ctrl.start_dev(dev_id)?;
    // The kernel gives a one-queue disk mq-deadline, whose dispatch runs in a kblockd worker: a
    // wake-up more per request, and 0.4x the IOPS of `none` at QD32 (docs/performance.md, "The
    // I/O scheduler of a one-queue volume"). No backend here gains from reordering; the
    // operator's udev rules, which run after this, may still choose one.
    if scheduler_none(&device.info.block_device).is_err() {
        control.cleanup.failed(CleanupStep::IoScheduler);
    }
    Ok(())
}

/// Sets the I/O scheduler of `block_device` (`/dev/ublkbN`) to `none`.
fn scheduler_none(block_device: &Path) -> std::io::Result<()> {
    if hooks::fire(Fault::IoScheduler) {
        return Err(std::io::Error::from_raw_os_error(libc::EROFS));
    }
    let name = block_device
        .file_name()
        .ok_or(std::io::ErrorKind::InvalidInput)?;
    let scheduler = Path::new("/sys/class/block")
        .join(name)
        .join("queue/scheduler");
    std::fs::write(scheduler, "none")
}

/// Opens `/dev/ublkcN` (once) and hands every queue not attached yet to its worker, which
/// maps it, arms its commands and replies once the kernel has accepted them.
pub(super) fn attach_queues(
    control: &mut Control,
    device: &mut Device,
    recovering: bool,
) -> Result<(), DataplaneError> {
    let dev_id = device.info.dev_id;
    let cdev = match &device.cdev {
        Some(c) => Arc::clone(c),
        None => {
            let c = Arc::new(open_char_device(&device.info.char_device, control.timeout)?);
            device.cdev = Some(Arc::clone(&c));
            c
        }
    };
    let queues = device.info.spec.queues;
    let rings = ring_placement(control, device.info.polled);
    let worker_cpus: Vec<usize> = control.workers.iter().map(|w| w.cpu).collect();
    // Queues 0..len are attached (a resumed takeover starts after them).
    let first = u16::try_from(device.queues.len()).unwrap_or(queues);
    for q in (first..queues).map(QueueId) {
        if recovering && q.0 + 1 == queues && hooks::fire(Fault::RecoverAfterStart) {
            return Err(DataplaneError::Attach {
                q_id: q,
                source: WorkerError::Injected,
            });
        }
        let queue_cpus = control.ctrl.queue_affinity(dev_id, q).ok();
        let (dev, qi) = (dev_id.0 as usize, q.index());
        let home = placement::home(
            device.info.placement,
            dev,
            qi,
            queue_cpus.as_deref(),
            &worker_cpus,
        )
        .unwrap_or_else(|| {
            spread_instead(&mut device.info);
            placement::spread(dev, qi, worker_cpus.len())
        });
        // Zero copy takes one buffer slot per tag on the worker's ring: a worker whose
        // table is full refuses, and the queue goes to the next one that has room. A new
        // device none can take is refused (RESOURCE_EXHAUSTED); a device being taken over
        // (its mode is the kernel's) is served by copy on its own worker.
        let mut tries: Vec<(usize, bool)> = (0..control.workers.len())
            .map(|i| ((home + i) % control.workers.len(), false))
            .collect();
        if recovering && device.info.zero_copy && device.info.flags & sys::UBLK_F_USER_COPY != 0 {
            tries.push((home, true));
        }
        let mut last = None;
        for (w, copy) in tries {
            match attach_queue(control, device, &cdev, q, w, rings, copy) {
                Ok(()) => {
                    if copy {
                        device.info.copy_queues += 1;
                    }
                    if w != home {
                        spread_instead(&mut device.info);
                    }
                    device.info.queue_cpus.truncate(q.index());
                    device.info.queue_cpus.push(worker_cpus[w]);
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

/// Hands queue `q` to worker `w` and waits for its answer.
pub(super) fn attach_queue(
    control: &mut Control,
    device: &mut Device,
    cdev: &Arc<File>,
    q: QueueId,
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
        force_fallback: device.info.every_request_by_copy,
        copy_if_no_slots,
        placement,
        cdev: Arc::clone(cdev),
        backend: Arc::clone(&device.backend),
        stats: Arc::clone(&stats),
        throttle: device.throttle.clone(),
        gone: control.gone_tx.clone(),
    });
    let w = &control.workers[w];
    let (reply, rx) = mpsc::sync_channel(1);
    if !w.tell(WorkerCmd::Attach { setup, reply }) {
        return Err(DataplaneError::Gone);
    }
    // Counted until told otherwise: the worker reports every queue it holds commands of
    // when the kernel lets go of them.
    device.queues.push(stats);
    match rx.recv_timeout(control.timeout) {
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

pub(super) fn delete(control: &mut Control, dev_id: DevId) -> Result<(), DataplaneError> {
    let mut device = control
        .devices
        .remove(&dev_id)
        .or_else(|| control.recovering.remove(&dev_id))
        .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
    tear_down(control, &mut device)
}

/// STOP_DEV, wait until every attached queue is gone, close our fd, DEL_DEV. When queues
/// do not let go in time the device is deleted all the same with DEL_DEV_ASYNC, which
/// returns at once (the kernel frees it when the last reference goes): no leaked device,
/// and a stuck one cannot block the control thread.
pub(super) fn tear_down(control: &mut Control, device: &mut Device) -> Result<(), DataplaneError> {
    let dev_id = device.info.dev_id;
    // Requests held by a drain must reach the backend, or STOP_DEV waits for them forever;
    // requests held by QoS must not wait for their tokens either.
    control.drop_throttle(device);
    control.resume_workers(dev_id);
    let stop = control.ctrl.stop_dev(dev_id);
    let gone = control.wait_queues_gone(device);
    device.cdev = None;
    // A failed worker keeps its queues' files open until the process exits.
    let held = device.queues.iter().any(|q| q.is_worker_failed());
    if gone.is_err() || held {
        // The wait's error is the caller's; a device left behind is counted, and the next
        // start deletes it.
        if control.ctrl.del_dev_async(dev_id).is_err() {
            control.cleanup.failed(CleanupStep::DelDevAsync);
        }
        return gone;
    }
    stop?;
    if hooks::fire(Fault::DelDevFails) {
        return Err(CtrlError::Command {
            command: "DEL_DEV",
            source: std::io::Error::from_raw_os_error(libc::EIO),
        }
        .into());
    }
    control.ctrl.del_dev(dev_id)?;
    Ok(())
}

pub(super) fn resize(
    control: &mut Control,
    dev_id: DevId,
    size: u64,
    growth: Growth,
) -> Result<DeviceInfo, DataplaneError> {
    // A backend whose range of a shared device grows (an NVMe window) must not grow into
    // another device's.
    let grown = control
        .devices
        .get(&dev_id)
        .ok_or(DataplaneError::NoSuchDevice(dev_id))?
        .backend
        .claim()
        .map(|mut c| {
            c.end = c.end.max(c.start.saturating_add(size));
            c
        });
    if let Some(c) = grown {
        for (&id, d) in control.devices.iter().chain(&control.recovering) {
            if let Some(theirs) = d.backend.claim().filter(|t| id != dev_id && t.overlaps(&c)) {
                return Err(DataplaneError::Overlap {
                    path: c.path,
                    start: theirs.start.max(c.start),
                    end: theirs.end.min(c.end),
                    dev_id: id,
                });
            }
        }
    }
    let device = control
        .devices
        .get_mut(&dev_id)
        .ok_or(DataplaneError::NoSuchDevice(dev_id))?;
    let mut spec = device.info.spec.clone();
    spec.size_bytes = size;
    spec.validate(max_queues())?;
    if !control.features.contains(Features::UPDATE_SIZE) {
        return Err(SpecError::Unsupported("UPDATE_SIZE").into());
    }
    device.backend.resize(size, growth)?;
    control.ctrl.update_size(dev_id, size / 512)?;
    device.info.spec = spec;
    Ok(device.info.clone())
}

/// Deletes every device (those whose takeover did not finish too), then shuts the workers
/// down; the first error is the caller's.
pub(super) fn shutdown(control: &mut Control) -> Result<(), DataplaneError> {
    let ids: Vec<DevId> = control
        .devices
        .keys()
        .chain(control.recovering.keys())
        .copied()
        .collect();
    let mut first_err = None;
    for id in ids {
        if let Err(e) = delete(control, id) {
            first_err.get_or_insert(e);
        }
    }
    for w in &mut control.workers {
        // A worker whose thread has ended is already shut down.
        w.tell(WorkerCmd::Shutdown);
        // A worker that stopped on a fatal error stays parked until the process exits.
        if w.stats.down_errno().is_some() {
            continue;
        }
        w.join();
    }
    first_err.map_or(Ok(()), Err)
}

/// Most bytes per request for a queue of `depth` tags: a queue's copy buffers (`depth` of
/// them) are one io_uring registration, which may not exceed 1 GiB. The kernel splits larger
/// requests, so the cap costs nothing but request size at very deep queues.
pub(super) fn copy_max_io(depth: u16) -> u32 {
    let per_tag = (1u32 << 30) / u32::from(depth.max(1));
    (per_tag & !4095).max(4096)
}

/// A queue could not go where the device's placement wanted: the device reports its queues as
/// spread, and why (a device already spread keeps its own reason).
fn spread_instead(info: &mut DeviceInfo) {
    if info.placement != QueuePlacement::Spread {
        info.placement = QueuePlacement::Spread;
        info.placement_reason = PlacementReason::NoWorkerFits;
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
}
