//! One request from fetch to completion, whichever path fetched it: copy-in, the backend
//! operation (and its bounded retries), copy-out, and the commit its result is queued for.

use super::token::Token;
use super::{Queue, Rings, TagState, Worker, FIRST_BACKOFF_NS, MAX_RETRIES};
use crate::backend::{Data, IoCtx, Request, Started};
use crate::ids::Tag;
use crate::ring::{kernel_timespec, Op, Region};
use crate::stats::OpKind;
use crate::sys;
use std::time::{Duration, Instant};

/// Which way the copy fallback moves a request's data through `/dev/ublkcN`.
#[derive(Debug, Clone, Copy)]
pub(super) enum UserCopy {
    /// A write's data, from the kernel into the copy buffer.
    In,
    /// A read's data, from the copy buffer back to the kernel.
    Out,
}

impl Worker {
    pub(super) fn on_backend(&mut self, slot: u16, tag: Tag, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        let t = q.tags[tag.index()];
        use crate::hooks::{fire, fire_in, Fault};
        // Test hook; `cfg!` keeps the backend check off the I/O path of shipped builds.
        let res = if cfg!(feature = "test-hooks")
            && q.setup.backend.kind() == "nvme"
            && ((t.retries == 0 && fire(Fault::NvmePathError)) || fire(Fault::NvmePathDown))
        {
            0x371 // Host Aborted Command: a path-related status, DNR clear
        } else if cfg!(feature = "test-hooks")
            && t.req.op == crate::stats::OpKind::Read
            && q.setup.backend.kind() == "file"
            && fire_in(Fault::FileReadEio, t.req.offset, u64::from(t.req.len))
        {
            -libc::EIO
        } else {
            res
        };
        if t.retries < MAX_RETRIES
            && q.setup.backend.retryable(res)
            && q.retry_later(&mut self.rings, slot, tag)
        {
            return;
        }
        let res = q.setup.backend.finish(&t.req, res);
        q.done(&mut self.rings, &mut self.dirty, slot, tag, res);
    }

    /// A back-off ended: send request `tag`'s backend operation again.
    pub(super) fn on_retry(&mut self, slot: u16, tag: Tag) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        if let Some(r) = q.start_backend(&mut self.rings, slot, tag) {
            q.done(&mut self.rings, &mut self.dirty, slot, tag, r);
        }
    }

    /// A fallback write's data arrived from the kernel: start the backend.
    pub(super) fn on_copy_in(&mut self, slot: u16, tag: Tag, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        let want = q.tags[tag.index()].req.len;
        let started = if u32::try_from(res).ok() == Some(want) {
            q.start_backend(&mut self.rings, slot, tag)
        } else {
            Some(-libc::EIO)
        };
        if let Some(r) = started {
            q.done(&mut self.rings, &mut self.dirty, slot, tag, r);
        }
    }

    /// A fallback read's data reached the kernel: commit the backend's result.
    pub(super) fn on_copy_out(&mut self, slot: u16, tag: Tag, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.life.completed();
        let want = q.tags[tag.index()].result;
        let r = if res == want { want } else { -libc::EIO };
        q.commit(&mut self.rings, &mut self.dirty, slot, tag, r);
    }
}

impl Queue {
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
}
