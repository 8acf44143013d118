//! Requests of a limited device that its buckets refuse: they wait in their queue's FIFO (one
//! per direction) and a timer on the main ring looks at them again. Only queues with a
//! throttle come here; others never touch a clock or lock for limits.

use super::request;
use super::token::Token;
use super::{Queue, Rings, Worker};
use crate::ids::{DevId, Tag};
use crate::qos::{Direction, Throttle};
use crate::ring::{kernel_timespec, Op};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The queue's throttle timer fired: admit what the buckets allow, in order, and arm the
/// timer again for the rest.
pub(super) fn on_throttle_timer(worker: &mut Worker, slot: u16) {
    let Some(Some(q)) = worker.queues.get_mut(usize::from(slot)) else {
        return;
    };
    q.life.completed();
    q.throttle_timer = false;
    admit_waiting(q, &mut worker.rings, &mut worker.dirty, slot);
}

/// The control thread changed a device's limits from or to unlimited.
pub(super) fn set_throttle(worker: &mut Worker, dev_id: DevId, throttle: Option<Arc<Throttle>>) {
    for slot in 0..worker.queues.len() {
        let Some(Some(q)) = worker.queues.get_mut(slot) else {
            continue;
        };
        if q.setup.dev_id != dev_id {
            continue;
        }
        q.setup.throttle = throttle.clone();
        if q.setup.throttle.is_none() && !q.throttle_timer {
            // Nothing will wake the waiters (none normally: the timer is armed while any
            // wait), so admit them now.
            admit_waiting(q, &mut worker.rings, &mut worker.dirty, slot as u16);
        }
    }
}

/// Whether request `tag` must wait: its direction already has waiters (order is kept),
/// or the buckets refuse it now. A waiting request is queued and the timer armed.
pub(super) fn throttled(queue: &mut Queue, rings: &mut Rings, slot: u16, tag: Tag) -> bool {
    let t = queue.tags[tag.index()];
    let (Some(throttle), Some(dir)) = (queue.setup.throttle.as_ref(), Direction::of(t.req.op))
    else {
        return false;
    };
    let now = t.started.unwrap_or_else(Instant::now);
    let wait = if queue.waiting[dir.index()].is_empty() {
        let cost =
            crate::qos::charged_bytes(t.req.op, t.req.len, queue.setup.backend.zeroes_deallocate());
        match throttle.admit(dir, cost, now) {
            Ok(()) => return false,
            Err(wait) => wait,
        }
    } else {
        crate::qos::MAX_WAIT
    };
    if !arm_throttle_timer(queue, rings, slot, wait) {
        // No timer to wake it: serve it now, over the limit, rather than leave it stuck.
        queue.setup.stats.throttle_overrun();
        return false;
    }
    queue.waiting[dir.index()].push_back(tag);
    true
}

/// Arms the queue's timer unless one is in flight; false if it could not be queued.
fn arm_throttle_timer(queue: &mut Queue, rings: &mut Rings, slot: u16, wait: Duration) -> bool {
    if queue.throttle_timer {
        return true;
    }
    if crate::hooks::fire(crate::hooks::Fault::ThrottleTimer) {
        return false;
    }
    let ts = kernel_timespec(wait);
    let region = queue.throttle_timespec();
    if !queue.scratch.write_at(region.offset, &ts) {
        return false;
    }
    let op = Op::Timeout {
        ts: (&queue.scratch, region),
    };
    if rings
        .main
        .push(op, Token::Throttle { slot }.encode())
        .is_err()
    {
        return false;
    }
    queue.life.pushed();
    queue.throttle_timer = true;
    true
}

/// Starts the waiters the buckets admit now (`resume` too) (all of them with `force`) and arms the timer
/// for the rest; if it cannot be armed, starts them all (over the limit, never stuck).
pub(super) fn admit_waiting(queue: &mut Queue, rings: &mut Rings, dirty: &mut Vec<u16>, slot: u16) {
    if let Some(wait) = admit_ready(queue, rings, dirty, slot, false) {
        if !arm_throttle_timer(queue, rings, slot, wait) {
            admit_ready(queue, rings, dirty, slot, true);
        }
    }
}

/// Starts waiters in order while their buckets admit them (all, counted as overruns, with
/// `force`); the shortest wait of those left.
fn admit_ready(
    queue: &mut Queue,
    rings: &mut Rings,
    dirty: &mut Vec<u16>,
    slot: u16,
    force: bool,
) -> Option<Duration> {
    if queue.paused {
        // Drained: nothing starts; `resume` looks at the waiters again.
        return None;
    }
    let now = Instant::now();
    let mut next: Option<Duration> = None;
    for dir in [Direction::Read, Direction::Write] {
        while let Some(&tag) = queue.waiting[dir.index()].front() {
            let t = queue.tags[tag.index()];
            let admitted = match queue.setup.throttle.as_ref() {
                Some(th) if !force => th.admit(
                    dir,
                    crate::qos::charged_bytes(
                        t.req.op,
                        t.req.len,
                        queue.setup.backend.zeroes_deallocate(),
                    ),
                    now,
                ),
                _ => Ok(()),
            };
            if let Err(wait) = admitted {
                next = Some(next.map_or(wait, |n| n.min(wait)));
                break;
            }
            queue.waiting[dir.index()].pop_front();
            if force {
                queue.setup.stats.throttle_overrun();
            }
            let waited = t.started.map_or(Duration::ZERO, |s| now - s);
            queue.setup.stats.throttled(waited.as_nanos() as u64);
            if let Some(r) = request::start_admitted(queue, rings, slot, tag) {
                request::done(queue, rings, dirty, slot, tag, r);
            }
        }
    }
    next
}
