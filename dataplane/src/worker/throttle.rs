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
    /// The queue's throttle timer fired: admit what the buckets allow, in order, and arm the
    /// timer again for the rest.
    pub(super) fn on_throttle_timer(&mut self, slot: u16) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        q.throttle_timer = false;
        q.admit_waiting(&mut self.rings, &mut self.dirty, slot);
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
                q.admit_waiting(&mut self.rings, &mut self.dirty, slot as u16);
            }
        }
    }
}

impl Queue {
    /// Whether request `tag` must wait: its direction already has waiters (order is kept),
    /// or the buckets refuse it now. A waiting request is queued and the timer armed.
    pub(super) fn throttled(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> bool {
        let t = self.tags[tag.index()];
        let (Some(throttle), Some(dir)) = (self.setup.throttle.as_ref(), Direction::of(t.req.op))
        else {
            return false;
        };
        let now = t.started.unwrap_or_else(Instant::now);
        let wait = if self.waiting[dir.index()].is_empty() {
            let cost = crate::qos::charged_bytes(
                t.req.op,
                t.req.len,
                self.setup.backend.zeroes_deallocate(),
            );
            match throttle.admit(dir, cost, now) {
                Ok(()) => return false,
                Err(wait) => wait,
            }
        } else {
            crate::qos::MAX_WAIT
        };
        if !self.arm_throttle_timer(rings, slot, wait) {
            // No timer to wake it: serve it now, over the limit, rather than leave it stuck.
            self.setup.stats.throttle_overrun();
            return false;
        }
        self.waiting[dir.index()].push_back(tag);
        true
    }

    /// Arms the queue's timer unless one is in flight; false if it could not be queued.
    fn arm_throttle_timer(&mut self, rings: &mut Rings, slot: u16, wait: Duration) -> bool {
        if self.throttle_timer {
            return true;
        }
        if crate::hooks::fire(crate::hooks::Fault::ThrottleTimer) {
            return false;
        }
        let ts = kernel_timespec(wait);
        let region = self.throttle_timespec();
        if !self.scratch.write_at(region.offset, &ts) {
            return false;
        }
        let op = Op::Timeout {
            ts: (&self.scratch, region),
        };
        if rings
            .main
            .push(op, Token::Throttle { slot }.encode())
            .is_err()
        {
            return false;
        }
        self.life.pushed();
        self.throttle_timer = true;
        true
    }

    /// Starts the waiters the buckets admit now (`resume` too) (all of them with `force`) and arms the timer
    /// for the rest; if it cannot be armed, starts them all (over the limit, never stuck).
    pub(super) fn admit_waiting(&mut self, rings: &mut Rings, dirty: &mut Vec<u16>, slot: u16) {
        if let Some(wait) = self.admit_ready(rings, dirty, slot, false) {
            if !self.arm_throttle_timer(rings, slot, wait) {
                self.admit_ready(rings, dirty, slot, true);
            }
        }
    }

    /// Starts waiters in order while their buckets admit them (all, counted as overruns, with
    /// `force`); the shortest wait of those left.
    fn admit_ready(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        force: bool,
    ) -> Option<Duration> {
        if self.paused {
            // Drained: nothing starts; `resume` looks at the waiters again.
            return None;
        }
        let now = Instant::now();
        let mut next: Option<Duration> = None;
        for dir in [Direction::Read, Direction::Write] {
            while let Some(&tag) = self.waiting[dir.index()].front() {
                let t = self.tags[tag.index()];
                let admitted = match self.setup.throttle.as_ref() {
                    Some(th) if !force => th.admit(
                        dir,
                        crate::qos::charged_bytes(
                            t.req.op,
                            t.req.len,
                            self.setup.backend.zeroes_deallocate(),
                        ),
                        now,
                    ),
                    _ => Ok(()),
                };
                if let Err(wait) = admitted {
                    next = Some(next.map_or(wait, |n| n.min(wait)));
                    break;
                }
                self.waiting[dir.index()].pop_front();
                if force {
                    self.setup.stats.throttle_overrun();
                }
                let waited = t.started.map_or(Duration::ZERO, |s| now - s);
                self.setup.stats.throttled(waited.as_nanos() as u64);
                if let Some(r) = self.start_admitted(rings, slot, tag) {
                    self.done(rings, dirty, slot, tag, r);
                }
            }
        }
        next
    }
}
