//! The per-IO path (every ublk kernel): FETCH_REQ, then COMMIT_AND_FETCH_REQ, one tag each.

use super::token::Token;
use super::{Queue, Rings, Worker, WorkerError};
use crate::ids::Tag;
use crate::ring::Op;
use crate::sys::{self, ublksrv_io_cmd};
use std::os::fd::AsRawFd;

impl Worker {
    pub(super) fn arm_per_io(&mut self, q: &mut Queue, slot: u16) -> Result<(), WorkerError> {
        for tag in (0..q.setup.depth).map(Tag) {
            let cmd = ublksrv_io_cmd {
                q_id: q.setup.q_id.0,
                tag: tag.0,
                result: 0,
                addr: 0,
            };
            self.rings.get(q.setup.placement.ublk_on_poll()).push(
                Op::UblkIo {
                    fd: q.fd(),
                    cmd_op: sys::UBLK_U_IO_FETCH_REQ,
                    cmd,
                    buf: q.cmd_buf(tag),
                    auto_buf: q.auto_buf(tag),
                },
                Token::Io { slot, tag }.encode(),
            )?;
            q.life.pushed();
        }
        Ok(())
    }

    /// Per-IO: a FETCH or COMMIT_AND_FETCH completed for `tag`.
    pub(super) fn on_io_cmd(&mut self, slot: u16, tag: Tag, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        let verdict = super::state::io_cmd_verdict(res);
        q.life.completed();
        if let Some(errno) = verdict.protocol_error {
            q.setup.stats.protocol_error(errno);
        }
        if verdict.stop {
            // ABORT (-ENODEV) or an error: this tag gets no more requests.
            q.life.stop();
            return;
        }
        q.setup.stats.batch(1);
        self.handled += 1;
        if let Some(r) = q.start_request(&mut self.rings, slot, tag) {
            q.done(&mut self.rings, &mut self.dirty, slot, tag, r);
        }
    }
}

impl Queue {
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
