//! The per-IO path (every ublk kernel): FETCH_REQ, then COMMIT_AND_FETCH_REQ, one tag each
//! (`Queue::commit_one`, since every commit goes through the queue).

use super::queue::Queue;
use super::token::Token;
use super::{Rings, WorkerError};
use crate::ids::Tag;
use crate::ring::Op;
use crate::sys::{self, ublksrv_io_cmd};

/// Arms a FETCH_REQ for every tag of `q`.
pub(super) fn arm(q: &mut Queue, rings: &mut Rings, slot: u16) -> Result<(), WorkerError> {
    for tag in (0..q.setup.depth).map(Tag) {
        let cmd = ublksrv_io_cmd {
            q_id: q.setup.q_id.0,
            tag: tag.0,
            result: 0,
            addr: 0,
        };
        rings.get(q.setup.placement.ublk_on_poll()).push(
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

/// Per-IO: a FETCH or COMMIT_AND_FETCH completed for `tag`. `handled` counts the requests the
/// worker started in this loop iteration.
#[inline]
pub(super) fn on_io_cmd(
    q: &mut Queue,
    rings: &mut Rings,
    dirty: &mut Vec<u16>,
    handled: &mut u64,
    slot: u16,
    tag: Tag,
    res: i32,
) {
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
    *handled += 1;
    if let Some(r) = q.start_request(rings, slot, tag) {
        q.done(rings, dirty, slot, tag, r);
    }
}
