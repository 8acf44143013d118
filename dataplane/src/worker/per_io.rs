//! The per-IO path (every ublk kernel): FETCH_REQ, then COMMIT_AND_FETCH_REQ, one tag each.

use super::*;

impl Worker {
    pub(super) fn arm_per_io(&mut self, q: &mut Queue, slot: u16) -> Result<(), WorkerError> {
        for tag in 0..q.setup.depth {
            let cmd = ublksrv_io_cmd {
                q_id: q.setup.q_id,
                tag,
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
                ud(K_IO, slot, tag),
            )?;
            q.outstanding += 1;
        }
        Ok(())
    }

    /// Per-IO: a FETCH or COMMIT_AND_FETCH completed for `tag`.
    pub(super) fn on_io_cmd(&mut self, slot: u16, tag: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        if res != sys::UBLK_IO_RES_OK {
            // ABORT (-ENODEV) or an error: this tag gets no more requests.
            if res != sys::UBLK_IO_RES_ABORT {
                q.setup.stats.protocol_error(res);
            }
            q.stopping = true;
            return;
        }
        q.setup.stats.batch(1);
        self.handled += 1;
        if let Some(r) = Self::start_request(&mut self.rings, q, slot, tag) {
            Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, r);
        }
    }

    pub(super) fn commit_one(rings: &mut Rings, q: &mut Queue, slot: u16, tag: u16, res: i32) {
        let cmd = ublksrv_io_cmd {
            q_id: q.setup.q_id,
            tag,
            result: res,
            addr: 0,
        };
        let pushed = rings.get(q.setup.placement.ublk_on_poll()).push(
            Op::UblkIo {
                fd: q.setup.cdev.as_raw_fd(),
                cmd_op: sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ,
                cmd,
                buf: q.cmd_buf(tag),
                auto_buf: q.auto_buf(tag),
            },
            ud(K_IO, slot, tag),
        );
        match pushed {
            Ok(()) => q.outstanding += 1,
            Err(_) => q.stopping = true,
        }
    }
}
