//! A queue of a device on its worker, and what one request of it goes through once fetched
//! (by either ublk path: `per_io.rs`, `batch.rs`): held while the device is drained, made to
//! wait by the device's limits, copied in, handed to the backend (and retried), copied out, and
//! committed. The worker finds the queue a completion is for and hands it here, with the rings
//! and its list of batch queues whose commits are due.

use super::state::{Commits, Life, COMMIT_BUFS};
use super::token::Token;
use super::{AttachReply, QueueSetup, Rings, WorkerError, NO_SLOT};
use crate::backend::{Data, IoCtx, Request, Started};
use crate::ids::Tag;
use crate::qos::Direction;
use crate::ring::{kernel_timespec, BufRing, Op, Region};
use crate::stats::OpKind;
use crate::sys::{self, os::DescMap, os::Mapping, ublksrv_io_cmd};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Times a backend operation that failed for a passing reason is sent again, and the first
/// back-off (doubled each time: 1, 2, 4, 8, 16 ms).
const MAX_RETRIES: u8 = 5;
const FIRST_BACKOFF_NS: u64 = 1_000_000;
/// Command payload bytes per tag (one NVMe DSM range).
const PAYLOAD_BYTES: usize = 16;
/// Scratch bytes per tag: the payload, then a `__kernel_timespec` for retry back-offs.
pub(super) const SCRATCH_BYTES: usize = PAYLOAD_BYTES + 16;

/// Which way the copy fallback moves a request's data through `/dev/ublkcN`.
#[derive(Debug, Clone, Copy)]
pub(super) enum UserCopy {
    /// A write's data, from the kernel into the copy buffer.
    In,
    /// A read's data, from the copy buffer back to the kernel.
    Out,
}

/// What a queue keeps of the request a tag carries.
#[derive(Debug, Clone, Copy)]
pub(super) struct TagState {
    pub(super) req: Request,
    pub(super) started: Option<Instant>,
    /// Zero copy failed to register this request's buffer: it is served by copy.
    pub(super) fallback: bool,
    /// The backend's result while a fallback read's data is copied out to the kernel.
    pub(super) result: i32,
    /// Times the backend operation was sent again.
    pub(super) retries: u8,
}

/// A batch queue's fetch buffer groups and commit buffers (`batch.rs`).
#[derive(Debug)]
pub(super) struct Batch {
    pub(super) groups: [BufRing; 2],
    pub(super) commit: [Arc<Mapping>; COMMIT_BUFS],
    /// Finished tags on their way to the kernel, pending or in flight.
    pub(super) commits: Commits,
    pub(super) scratch: Vec<u16>,
}

/// One queue of a device as its worker serves it: the kernel's descriptors, the buffers, each
/// tag's request, and the requests waiting for limits or held by a drain.
#[derive(Debug)]
pub(super) struct Queue {
    pub(super) setup: Box<QueueSetup>,
    pub(super) desc: DescMap,
    /// Copy buffers, one `max_io` region per tag. With zero copy they exist only once a request
    /// needs the fallback.
    pub(super) bufs: Option<Arc<Mapping>>,
    /// Fixed-buffer slot of `bufs` on the backend's ring, when the backend reads and writes
    /// through the ring.
    pub(super) buf_index: Option<u16>,
    /// Zero copy: each tag's slot in the ublk ring's buffer table (reserved for the kernel).
    pub(super) zc_slots: Vec<u16>,
    /// Per-tag command payload memory (16 bytes per tag).
    pub(super) scratch: Arc<Mapping>,
    pub(super) tags: Vec<TagState>,
    pub(super) batch: Option<Batch>,
    /// What the kernel still holds of the queue, and whether it is stopping.
    pub(super) life: Life,
    /// The control thread waits for the kernel to accept this queue's commands.
    pub(super) attach_reply: Option<AttachReply>,
    /// Requests over the device's limits, `[reads, writes]`, in arrival order: each waits in
    /// the worker until its direction's buckets admit it (at most `depth` of them).
    pub(super) waiting: [VecDeque<Tag>; 2],
    /// A timer to look at `waiting` again is in flight.
    pub(super) throttle_timer: bool,
    /// Requests fetched and not yet committed (waiting, held or with the backend).
    pub(super) active: usize,
    /// Drained: new requests are held in `held`, not started, until resumed.
    pub(super) paused: bool,
    pub(super) held: VecDeque<Tag>,
}

impl Queue {
    pub(super) fn fd(&self) -> i32 {
        self.setup.cdev.as_raw_fd()
    }

    fn tag_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * self.setup.max_io as usize,
            len: self.setup.max_io as usize,
        }
    }

    /// The kernel buffer slot of `tag` (zero copy).
    pub(super) fn zc_slot(&self, tag: Tag) -> u16 {
        self.zc_slots.get(tag.index()).copied().unwrap_or(NO_SLOT)
    }

    /// The AUTO_BUF_REG word for `tag`'s next request (zero copy), else None.
    pub(super) fn auto_buf(&self, tag: Tag) -> Option<u64> {
        self.setup
            .zero_copy
            .then(|| sys::auto_buf_reg(self.zc_slot(tag), self.fallback_flag()))
    }

    fn fallback_flag(&self) -> u8 {
        if self.setup.user_copy {
            sys::UBLK_AUTO_BUF_REG_FALLBACK
        } else {
            0
        }
    }

    /// Copy mode's per-tag buffer for a ublk command (None with zero copy).
    pub(super) fn cmd_buf(&self, tag: Tag) -> Option<(&Arc<Mapping>, Region)> {
        if self.setup.zero_copy {
            return None;
        }
        self.bufs.as_ref().map(|b| (b, self.tag_region(tag)))
    }

    /// `tag`'s command payload (one NVMe DSM range).
    fn scratch_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * SCRATCH_BYTES,
            len: PAYLOAD_BYTES,
        }
    }

    /// `tag`'s back-off timespec, apart from its payload (a retried discard still needs it).
    fn timespec_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * SCRATCH_BYTES + PAYLOAD_BYTES,
            len: 16,
        }
    }

    /// The queue's own timespec (the throttle timer), after every tag's scratch.
    fn throttle_timespec(&self) -> Region {
        Region {
            offset: usize::from(self.setup.depth) * SCRATCH_BYTES + PAYLOAD_BYTES,
            len: 16,
        }
    }

    /// Allocates the queue's copy buffers (and registers them with the backend's ring) unless
    /// they exist.
    pub(super) fn ensure_bufs(&mut self, rings: &mut Rings) -> Result<(), WorkerError> {
        if self.bufs.is_some() {
            return Ok(());
        }
        let bufs = Arc::new(
            Mapping::anonymous(usize::from(self.setup.depth) * self.setup.max_io as usize)
                .map_err(WorkerError::Buffers)?,
        );
        if self.setup.backend.uses_fixed_buffers() {
            let ring = rings.get(self.setup.placement.backend_on_poll());
            self.buf_index = Some(ring.register_fixed(&bufs)?);
        }
        self.setup.stats.copy_buffers(bufs.len() as u64);
        self.bufs = Some(bufs);
        Ok(())
    }
}

// One request from fetch to completion, whichever path fetched it: copy-in, the backend
// operation (and its bounded retries), copy-out, and the commit its result is queued for.
impl Queue {
    /// Request `tag`'s backend operation completed with `res`: sent again after a back-off if
    /// it failed for a passing reason, else done.
    #[inline]
    pub(super) fn on_backend(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
        res: i32,
    ) {
        self.life.completed();
        let t = self.tags[tag.index()];
        use crate::hooks::{fire, fire_in, Fault};
        // Test hook; `cfg!` keeps the backend check off the I/O path of shipped builds.
        let res = if cfg!(feature = "test-hooks")
            && self.setup.backend.kind() == "nvme"
            && ((t.retries == 0 && fire(Fault::NvmePathError)) || fire(Fault::NvmePathDown))
        {
            0x371 // Host Aborted Command: a path-related status, DNR clear
        } else if cfg!(feature = "test-hooks")
            && t.req.op == crate::stats::OpKind::Read
            && self.setup.backend.kind() == "file"
            && fire_in(Fault::FileReadEio, t.req.offset, u64::from(t.req.len))
        {
            -libc::EIO
        } else {
            res
        };
        if t.retries < MAX_RETRIES
            && self.setup.backend.retryable(res)
            && self.retry_later(rings, slot, tag)
        {
            return;
        }
        let res = self.setup.backend.finish(&t.req, res);
        self.done(rings, dirty, slot, tag, res);
    }

    /// A back-off ended: send request `tag`'s backend operation again.
    #[inline]
    pub(super) fn on_retry(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
    ) {
        self.life.completed();
        if let Some(r) = self.start_backend(rings, slot, tag) {
            self.done(rings, dirty, slot, tag, r);
        }
    }

    /// A fallback write's data arrived from the kernel: start the backend.
    #[inline]
    pub(super) fn on_copy_in(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
        res: i32,
    ) {
        self.life.completed();
        let want = self.tags[tag.index()].req.len;
        let started = if u32::try_from(res).ok() == Some(want) {
            self.start_backend(rings, slot, tag)
        } else {
            Some(-libc::EIO)
        };
        if let Some(r) = started {
            self.done(rings, dirty, slot, tag, r);
        }
    }

    /// A fallback read's data reached the kernel: commit the backend's result.
    #[inline]
    pub(super) fn on_copy_out(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
        res: i32,
    ) {
        self.life.completed();
        let want = self.tags[tag.index()].result;
        let r = if res == want { want } else { -libc::EIO };
        self.commit(rings, dirty, slot, tag, r);
    }

    /// Starts request `tag`; returns its result if it finished at once. A zero-copy request
    /// whose pages the kernel could not lend (fallback) is served by copy: a write's data is
    /// first read from `/dev/ublkcN` on the ring (`on_copy_in` then starts the backend).
    pub(super) fn start_request(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> Option<i32> {
        let Some(desc) = self.desc.get(tag.0) else {
            return Some(-libc::EINVAL);
        };
        let req = Request::from_desc(&desc);
        let fallback = self.setup.zero_copy && desc.op_flags & sys::UBLK_IO_F_NEED_REG_BUF != 0;
        self.tags[tag.index()] = TagState {
            req,
            started: Some(Instant::now()),
            fallback,
            result: 0,
            retries: 0,
        };
        self.setup.stats.started();
        self.active += 1;
        if req.has_data() && req.len > self.setup.max_io {
            return Some(-libc::EIO);
        }
        if self.paused {
            self.held.push_back(tag);
            return None;
        }
        self.start_unheld(rings, slot, tag)
    }

    /// Starts request `tag` unless the device's limits make it wait.
    pub(super) fn start_unheld(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> Option<i32> {
        if self.setup.throttle.is_some() && self.throttled(rings, slot, tag) {
            return None;
        }
        self.start_admitted(rings, slot, tag)
    }

    /// Starts request `tag` once its limits admitted it: copies a fallback write's data in,
    /// else hands it to the backend; returns its result if it finished at once.
    pub(super) fn start_admitted(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> Option<i32> {
        let req = self.tags[tag.index()].req;
        if self.tags[tag.index()].fallback {
            self.setup.stats.zero_copy_fallback();
            if self.ensure_bufs(rings).is_err() {
                return Some(-libc::ENOMEM);
            }
            if req.op == OpKind::Write && req.len > 0 {
                return self.copy_user(rings, slot, tag, UserCopy::In, req.len as usize);
            }
        }
        self.start_backend(rings, slot, tag)
    }

    /// Copies `len` bytes of `tag`'s data between its copy buffer and the kernel's request
    /// (user copy through `/dev/ublkcN`, on the main ring: never a blocking call on the
    /// worker), in the direction `dir` names.
    pub(super) fn copy_user(
        &mut self,
        rings: &mut Rings,
        slot: u16,
        tag: Tag,
        dir: UserCopy,
        len: usize,
    ) -> Option<i32> {
        let Some(buf) = self.bufs.as_ref() else {
            return Some(-libc::EIO);
        };
        let region = Region {
            offset: self.tag_region(tag).offset,
            len,
        };
        let file_offset = sys::user_copy_offset(self.setup.q_id.0, tag.0);
        let fd = self.fd();
        let (op, token) = match dir {
            UserCopy::In => (
                Op::Read {
                    fd,
                    buf,
                    region,
                    file_offset,
                },
                Token::CopyIn { slot, tag },
            ),
            UserCopy::Out => (
                Op::Write {
                    fd,
                    buf,
                    region,
                    file_offset,
                },
                Token::CopyOut { slot, tag },
            ),
        };
        match rings.main.push(op, token.encode()) {
            Ok(()) => {
                self.life.pushed();
                None
            }
            Err(_) => Some(-libc::EIO),
        }
    }

    /// Hands request `tag` to the backend; returns its result if it finished at once.
    pub(super) fn start_backend(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> Option<i32> {
        let t = self.tags[tag.index()];
        let req = t.req;
        let region = Region {
            offset: self.tag_region(tag).offset,
            len: if req.has_data() { req.len as usize } else { 0 },
        };
        let data = match &self.bufs {
            Some(buf) if !self.setup.zero_copy || t.fallback => Data::Copy {
                buf,
                region,
                index: self.buf_index,
            },
            _ => Data::ZeroCopy {
                index: self.zc_slot(tag),
            },
        };
        let on_poll = self.setup.placement.backend_on_poll();
        let ctx = IoCtx {
            ring: rings.get(on_poll),
            user_data: Token::Backend { slot, tag }.encode(),
            data,
            scratch: (&self.scratch, self.scratch_region(tag)),
        };
        match self.setup.backend.start(&req, ctx) {
            Started::Done(res) => Some(res),
            Started::Submitted => {
                self.life.pushed();
                if on_poll {
                    rings.polled += 1;
                }
                None
            }
        }
    }

    /// Request `tag` finished with `res`. A fallback read first copies its data out to the
    /// kernel (`on_copy_out` then commits); everything else is recorded and committed.
    pub(super) fn done(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
        res: i32,
    ) {
        let t = self.tags[tag.index()];
        if t.fallback && t.req.op == OpKind::Read && res > 0 {
            self.tags[tag.index()].result = res;
            match self.copy_user(rings, slot, tag, UserCopy::Out, res as usize) {
                None => return,
                Some(err) => return self.commit(rings, dirty, slot, tag, err),
            }
        }
        self.commit(rings, dirty, slot, tag, res)
    }

    /// Records request `tag`'s final result and commits it: per-IO with the tag's next
    /// COMMIT_AND_FETCH_REQ, batch by queueing it for this iteration's COMMIT_IO_CMDS.
    pub(super) fn commit(
        &mut self,
        rings: &mut Rings,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: Tag,
        res: i32,
    ) {
        let t = self.tags[tag.index()];
        self.active = self.active.saturating_sub(1);
        let lat = t.started.map_or(0, |s| s.elapsed().as_nanos() as u64);
        self.setup
            .stats
            .finished(t.req.op, u64::from(t.req.len), res, lat);
        if let Some(b) = self.batch.as_mut() {
            b.commits.finished(tag, res);
            dirty.push(slot);
        } else {
            self.commit_one(rings, slot, tag, res);
        }
    }

    /// Sends request `tag`'s backend operation again after a back-off (a timeout on the main
    /// ring; its completion resends). False if the timeout could not be queued.
    pub(super) fn retry_later(&mut self, rings: &mut Rings, slot: u16, tag: Tag) -> bool {
        let n = self.tags[tag.index()].retries;
        let ts = kernel_timespec(Duration::from_nanos(FIRST_BACKOFF_NS << n));
        let region = self.timespec_region(tag);
        if !self.scratch.write_at(region.offset, &ts) {
            return false;
        }
        let pushed = rings.main.push(
            Op::Timeout {
                ts: (&self.scratch, region),
            },
            Token::Retry { slot, tag }.encode(),
        );
        if pushed.is_err() {
            return false;
        }
        self.life.pushed();
        self.tags[tag.index()].retries = n + 1;
        self.setup.stats.retry();
        true
    }

    /// Per-IO: commits request `tag`'s result with the tag's next COMMIT_AND_FETCH_REQ, which
    /// also fetches its next request.
    pub(super) fn commit_one(&mut self, rings: &mut Rings, slot: u16, tag: Tag, res: i32) {
        let cmd = ublksrv_io_cmd {
            q_id: self.setup.q_id.0,
            tag: tag.0,
            result: res,
            addr: 0,
        };
        let pushed = rings.get(self.setup.placement.ublk_on_poll()).push(
            Op::UblkIo {
                fd: self.setup.cdev.as_raw_fd(),
                cmd_op: sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ,
                cmd,
                buf: self.cmd_buf(tag),
                auto_buf: self.auto_buf(tag),
            },
            Token::Io { slot, tag }.encode(),
        );
        match pushed {
            Ok(()) => self.life.pushed(),
            Err(_) => self.life.stop(),
        }
    }
}

// Requests of a limited device that its buckets refuse: they wait in their queue's FIFO (one
// per direction) and a timer on the main ring looks at them again. Only queues with a
// throttle come here; others never touch a clock or lock for limits.
impl Queue {
    /// The queue's throttle timer fired: admit what the buckets allow, in order, and arm the
    /// timer again for the rest.
    #[inline]
    pub(super) fn on_throttle_timer(&mut self, rings: &mut Rings, dirty: &mut Vec<u16>, slot: u16) {
        self.life.completed();
        self.throttle_timer = false;
        self.admit_waiting(rings, dirty, slot);
    }

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
