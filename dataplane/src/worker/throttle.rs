//! Requests of a limited device that its buckets refuse: they wait in their queue's FIFO (one
//! per direction) and a timer on the main ring looks at them again. Only queues with a
//! throttle come here; others never touch a clock or lock for limits.

use super::token::Token;
use super::{Queue, Rings, Worker};
use crate::ids::{DevId, Tag};
use crate::qos::{Direction, Throttle};
use crate::ring::{kernel_timespec, Op};
use std::sync::Arc;
use std::time::{Duration, Instant};

impl Worker {
    /// Whether request `tag` must wait: its direction already has waiters (order is kept),
    /// or the buckets refuse it now. A waiting request is queued and the timer armed.
    pub(super) fn throttled(rings: &mut Rings, q: &mut Queue, slot: u16, tag: Tag) -> bool {
        let t = q.tags[tag.index()];
        let (Some(throttle), Some(dir)) = (q.setup.throttle.as_ref(), Direction::of(t.req.op))
        else {
            return false;
        };
        let now = t.started.unwrap_or_else(Instant::now);
        let wait = if q.waiting[dir.index()].is_empty() {
            match throttle.admit(dir, crate::qos::charged_bytes(t.req.op, t.req.len), now) {
                Ok(()) => return false,
                Err(wait) => wait,
            }
        } else {
            crate::qos::MAX_WAIT
        };
        if !Self::arm_throttle_timer(rings, q, slot, wait) {
            // No timer to wake it: serve it now, over the limit, rather than leave it stuck.
            q.setup.stats.throttle_overrun();
            return false;
        }
        q.waiting[dir.index()].push_back(tag);
        true
    }

    /// Arms the queue's timer unless one is in flight; false if it could not be queued.
    fn arm_throttle_timer(rings: &mut Rings, q: &mut Queue, slot: u16, wait: Duration) -> bool {
        if q.throttle_timer {
            return true;
        }
        if crate::hooks::fire(crate::hooks::Fault::ThrottleTimer) {
            return false;
        }
        let ts = kernel_timespec(wait);
        let region = q.throttle_timespec();
        if !q.scratch.write_at(region.offset, &ts) {
            return false;
        }
        let op = Op::Timeout {
            ts: (&q.scratch, region),
        };
        if rings
            .main
            .push(op, Token::Throttle { slot }.encode())
            .is_err()
        {
            return false;
        }
        q.life.pushed();
        q.throttle_timer = true;
        true
    }

    /// The queue's throttle timer fired: admit what the buckets allow, in order, and arm the
    /// timer again for the rest.
    pub(super) fn on_throttle_timer(&mut self, slot: u16) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        q.throttle_timer = false;
        Self::admit_waiting(&mut self.rings, q, &mut self.dirty, slot);
    }

    /// Starts the waiters the buckets admit now (`resume` too) (all of them with `force`) and arms the timer
    /// for the rest; if it cannot be armed, starts them all (over the limit, never stuck).
    pub(super) fn admit_waiting(rings: &mut Rings, q: &mut Queue, dirty: &mut Vec<u16>, slot: u16) {
        if let Some(wait) = Self::admit_ready(rings, q, dirty, slot, false) {
            if !Self::arm_throttle_timer(rings, q, slot, wait) {
                Self::admit_ready(rings, q, dirty, slot, true);
            }
        }
    }

    /// Starts waiters in order while their buckets admit them (all, counted as overruns, with
    /// `force`); the shortest wait of those left.
    fn admit_ready(
        rings: &mut Rings,
        q: &mut Queue,
        dirty: &mut Vec<u16>,
        slot: u16,
        force: bool,
    ) -> Option<Duration> {
        if q.paused {
            // Drained: nothing starts; `resume` looks at the waiters again.
            return None;
        }
        let now = Instant::now();
        let mut next: Option<Duration> = None;
        for dir in [Direction::Read, Direction::Write] {
            while let Some(&tag) = q.waiting[dir.index()].front() {
                let t = q.tags[tag.index()];
                let admitted = match q.setup.throttle.as_ref() {
                    Some(th) if !force => {
                        th.admit(dir, crate::qos::charged_bytes(t.req.op, t.req.len), now)
                    }
                    _ => Ok(()),
                };
                if let Err(wait) = admitted {
                    next = Some(next.map_or(wait, |n| n.min(wait)));
                    break;
                }
                q.waiting[dir.index()].pop_front();
                if force {
                    q.setup.stats.throttle_overrun();
                }
                let waited = t.started.map_or(Duration::ZERO, |s| now - s);
                q.setup.stats.throttled(waited.as_nanos() as u64);
                if let Some(r) = Self::start_admitted(rings, q, slot, tag) {
                    Self::done(rings, q, dirty, slot, tag, r);
                }
            }
        }
        next
    }

    /// The control thread changed a device's limits from or to unlimited.
    pub(super) fn set_throttle(&mut self, dev_id: DevId, throttle: Option<Arc<Throttle>>) {
        for slot in 0..self.queues.len() {
            let Some(Some(q)) = self.queues.get_mut(slot) else {
                continue;
            };
            if q.setup.dev_id != dev_id {
                continue;
            }
            q.setup.throttle = throttle.clone();
            if q.setup.throttle.is_none() && !q.throttle_timer {
                // Nothing will wake the waiters (none normally: the timer is armed while any
                // wait), so admit them now.
                Self::admit_waiting(&mut self.rings, q, &mut self.dirty, slot as u16);
            }
        }
    }
}
