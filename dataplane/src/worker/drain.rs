//! Draining a device for the instant of a snapshot: its new requests are held in the worker
//! (the kernel keeps waiting for them), the ones already with the backend finish, and the
//! control thread is told once none is left; `resume` starts the held requests in order.
//! Functions of the `Worker`, named at its calls (`drain::resume`).

use super::Worker;
use crate::ids::DevId;
use crate::reply::Answer;
use std::sync::mpsc::SyncSender;

/// Holds the device's new requests from now on; replies once its requests on this worker
/// are all out of the backend (at once if it serves no queue of the device).
pub(super) fn drain(worker: &mut Worker, dev_id: DevId, reply: SyncSender<()>) {
    for q in worker.queues.iter_mut().flatten() {
        if q.setup.dev_id == dev_id {
            q.paused = true;
        }
    }
    if crate::hooks::fire(crate::hooks::Fault::DrainUnanswered) {
        // Test hook: the reply is dropped unanswered, as by a worker that went away.
        return;
    }
    worker.drains.push((dev_id, reply));
    answer_drains(worker);
}

/// Answers the drains whose device has no request left with the backend here. A stopping
/// queue counts as drained: the kernel is taking its requests back.
pub(super) fn answer_drains(worker: &mut Worker) {
    let queues = &worker.queues;
    worker.drains.retain(|(dev_id, reply)| {
        let busy = queues.iter().flatten().any(|q| {
            q.setup.dev_id == *dev_id
                && !q.life.stopping()
                && q.active > q.held.len() + q.waiting[0].len() + q.waiting[1].len()
        });
        if !busy {
            reply.answer(());
        }
        busy
    });
}

/// Serves the device again: its held requests start in arrival order (through its limits).
pub(super) fn resume(worker: &mut Worker, dev_id: DevId) {
    worker.drains.retain(|(d, _)| *d != dev_id);
    for slot in 0..worker.queues.len() {
        let Some(Some(q)) = worker.queues.get_mut(slot) else {
            continue;
        };
        if q.setup.dev_id != dev_id || !q.paused {
            continue;
        }
        q.paused = false;
        let slot = slot as u16;
        q.admit_waiting(&mut worker.rings, &mut worker.dirty, slot);
        while let Some(tag) = q.held.pop_front() {
            if let Some(r) = q.start_unheld(&mut worker.rings, slot, tag) {
                q.done(&mut worker.rings, &mut worker.dirty, slot, tag, r);
            }
        }
    }
}
