//! A queue's life on its worker: attach (mapping, buffers, slots, first commands), the
//! answer once the kernel accepted them, and teardown once the kernel gave every command back.
//! Functions of the `Worker`, named at its calls (`attach::attach`).

use super::queue::{Queue, TagState, SCRATCH_BYTES};
use super::state::Life;
use super::{batch, per_io};
use super::{
    AttachError, AttachReply, Placement, QueueSetup, Worker, WorkerError, NO_SLOT, POLL_CQ_ENTRIES,
    POLL_FIXED_BUFFERS,
};
use crate::backend::Request;
use crate::device::IoPath;
use crate::reply::Answer;
use crate::ring::{RingError, WorkerRing};
use crate::stats::CleanupStep;
use crate::sys::{self, os::DescMap, os::Mapping};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::Arc;

/// Maps the queue and arms its commands. On success the reply is sent once the kernel has
/// accepted them (`answer_attaches`); on failure the caller sends it.
pub(super) fn attach(
    worker: &mut Worker,
    setup: Box<QueueSetup>,
    reply: AttachReply,
) -> Result<(), AttachError> {
    let clean = |source| AttachError {
        source,
        held: false,
    };
    let slot = match worker.queues.iter().position(Option::is_none) {
        Some(i) => i,
        None => {
            worker.queues.push(None);
            worker.queues.len() - 1
        }
    };
    let slot16 = u16::try_from(slot).map_err(|_| clean(WorkerError::Full))?;
    if setup.placement != Placement::Main && worker.rings.poll.is_none() {
        let mut poll = WorkerRing::new(1024, POLL_CQ_ENTRIES, POLL_FIXED_BUFFERS, true)
            .map_err(|e| clean(e.into()))?;
        poll.register_eventfd(worker.event.raw())
            .map_err(|e| clean(e.into()))?;
        worker.rings.poll = Some(poll);
    }
    let desc = DescMap::map(&setup.cdev, setup.q_id.0, setup.depth)
        .map_err(|e| clean(WorkerError::MapDescriptors(e)))?;
    if setup.q_id.0 > 0 && crate::hooks::fire(crate::hooks::Fault::AttachFails) {
        return Err(clean(WorkerError::Injected));
    }
    let depth = usize::from(setup.depth);
    let zc_slots = if !setup.zero_copy {
        Vec::new()
    } else if setup.force_fallback {
        vec![NO_SLOT; depth]
    } else {
        match worker
            .rings
            .get(setup.placement.ublk_on_poll())
            .reserve_kernel_slots(depth)
        {
            Some(slots) => slots,
            // Out of slots: every request takes the fallback, served by copy, only when
            // asked; otherwise the queue is refused so it can go where slots are.
            None if setup.copy_if_no_slots && setup.user_copy => vec![NO_SLOT; depth],
            None => return Err(clean(WorkerError::Ring(RingError::NoFixedSlot))),
        }
    };
    let idle = TagState {
        req: Request::from_desc(&sys::ublksrv_io_desc::default()),
        started: None,
        fallback: false,
        result: 0,
        retries: 0,
    };
    // One scratch slot per tag, and one for the queue's throttle timer.
    let scratch = match Mapping::anonymous((depth + 1) * SCRATCH_BYTES) {
        Ok(m) => Arc::new(m),
        Err(e) => {
            release_zc_slots(worker, &setup, &zc_slots);
            return Err(clean(WorkerError::Buffers(e)));
        }
    };
    let mut q = Queue {
        tags: vec![idle; depth],
        setup,
        desc,
        bufs: None,
        buf_index: None,
        zc_slots,
        scratch,
        batch: None,
        life: Life::default(),
        attach_reply: None,
        waiting: [VecDeque::new(), VecDeque::new()],
        throttle_timer: false,
        active: 0,
        paused: false,
        held: VecDeque::new(),
    };
    if !q.setup.zero_copy {
        if let Err(e) = q.ensure_bufs(&mut worker.rings) {
            release_slots(worker, &q);
            return Err(clean(e));
        }
    }
    let armed = match q.setup.path {
        IoPath::Batch => batch::arm(&mut q, &mut worker.rings, slot16),
        _ => per_io::arm(&mut q, &mut worker.rings, slot16),
    };
    let on_poll = q.setup.placement.ublk_on_poll();
    // From here the queue stays in place until the kernel has answered every command
    // pushed for it (`reap_dead_queues` then reports it gone).
    let result = armed.and_then(|()| Ok(worker.rings.get(on_poll).submit()?));
    register_files(worker, &q);
    worker.live += 1;
    fit_iowq(worker);
    match result {
        Ok(()) => {
            q.attach_reply = Some(reply);
            worker.queues[slot] = Some(q);
            worker.attaching.push(slot16);
            Ok(())
        }
        Err(source) => {
            q.life.stop();
            worker.queues[slot] = Some(q);
            worker.dying.push(slot16);
            Err(AttachError { source, held: true })
        }
    }
}

/// Registers the queue's char device with the ring its commands go to, for the rest of its
/// life (`unregister_files` at teardown): its commands then skip the kernel's per-op file
/// lookup. Commands already pushed went by descriptor, which is as good; a refusal leaves
/// them so. Backend descriptors stay unregistered: measured, it bought nothing there.
pub(super) fn register_files(worker: &mut Worker, q: &Queue) {
    let r = worker
        .rings
        .get(q.setup.placement.ublk_on_poll())
        .register_file(q.setup.cdev.as_raw_fd());
    if r.is_err() {
        worker.stats.cleanup_failed(CleanupStep::RegisterFile);
    }
}

pub(super) fn unregister_files(worker: &mut Worker, q: &Queue) {
    worker
        .rings
        .get(q.setup.placement.ublk_on_poll())
        .unregister_file(q.setup.cdev.as_raw_fd());
}

/// Sets this thread's io-wq limits for the queues it now serves (`ring::iowq_limits`). A
/// refusal keeps the previous limits, which the worker's stats go on showing.
pub(super) fn fit_iowq(worker: &mut Worker) {
    let want = crate::ring::iowq_limits(worker.live);
    if want != worker.stats.iowq_limits() && worker.rings.main.set_iowq_limits(want).is_ok() {
        worker.stats.set_iowq_limits(want);
    }
}

/// Answers attaches whose commands the kernel has accepted or refused. Batch queues are
/// answered by their PREP completion (`on_prep`); a per-IO queue once its FETCH_REQs were
/// submitted and no completion is left to look at (a refused fetch completes at once).
pub(super) fn answer_attaches(worker: &mut Worker) {
    let mut waiting = std::mem::take(&mut worker.attaching);
    waiting.retain(|&slot| {
        let Some(Some(q)) = worker.queues.get_mut(usize::from(slot)) else {
            return false;
        };
        let Some(reply) = q.attach_reply.as_ref() else {
            return false;
        };
        if q.life.stopping() {
            reply.answer(Err(AttachError {
                source: WorkerError::Stopped,
                held: true,
            }));
            q.attach_reply = None;
            return false;
        }
        if q.batch.is_some() {
            return true;
        }
        let on_poll = q.setup.placement.ublk_on_poll();
        if worker.rings.get(on_poll).has_completions() {
            return true;
        }
        reply.answer(Ok(()));
        q.attach_reply = None;
        false
    });
    worker.attaching = waiting;
}

pub(super) fn release_slots(worker: &mut Worker, q: &Queue) {
    release_zc_slots(worker, &q.setup, &q.zc_slots);
}

pub(super) fn release_zc_slots(worker: &mut Worker, setup: &QueueSetup, zc_slots: &[u16]) {
    let slots: Vec<u16> = zc_slots.iter().copied().filter(|&s| s != NO_SLOT).collect();
    worker
        .rings
        .get(setup.placement.ublk_on_poll())
        .release_kernel_slots(&slots);
}

/// Tears down queues the kernel has let go of (stopping, nothing outstanding).
pub(super) fn reap_dead_queues(worker: &mut Worker) {
    if worker.dying.is_empty() {
        return;
    }
    let mut dying = std::mem::take(&mut worker.dying);
    dying.sort_unstable();
    dying.dedup();
    for &slot in &dying {
        let slot = usize::from(slot);
        let dead = matches!(&worker.queues[slot], Some(q) if q.life.is_dead());
        if !dead {
            continue;
        }
        if let Some(q) = worker.queues[slot].take() {
            if let Some(reply) = &q.attach_reply {
                reply.answer(Err(AttachError {
                    source: WorkerError::Stopped,
                    held: true,
                }));
            }
            if let Some(index) = q.buf_index {
                let r = worker
                    .rings
                    .get(q.setup.placement.backend_on_poll())
                    .unregister_fixed(index);
                if r.is_err() {
                    worker.stats.cleanup_failed(CleanupStep::UnregisterBuffer);
                }
            }
            release_slots(worker, &q);
            unregister_files(worker, &q);
            if let Some(b) = &q.batch {
                let ring = worker.rings.get(q.setup.placement.ublk_on_poll());
                for g in &b.groups {
                    if ring.unregister_buf_ring(g.group()).is_err() {
                        worker.stats.cleanup_failed(CleanupStep::UnregisterBufRing);
                    }
                }
            }
            // Limits first, so that whoever waits for `gone` sees them follow.
            worker.live -= 1;
            fit_iowq(worker);
            q.setup.gone.answer((q.setup.dev_id, q.setup.q_id));
        }
    }
    dying.clear();
    if worker.dying.is_empty() {
        worker.dying = dying;
    }
}
