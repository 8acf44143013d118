//! The null backend: every request succeeds at once. Reads return zeros in copy mode; with zero
//! copy the backend touches no data at all, so reads leave the reader's buffer as it was (as
//! null_blk does without memory backing).

use super::{full, Backend, Data, IoCtx, Request, Started};
use crate::stats::OpKind;

#[derive(Debug)]
pub struct NullBackend;

impl Backend for NullBackend {
    fn kind(&self) -> &'static str {
        "null"
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started {
        match req.op {
            OpKind::Read => match ctx.data {
                Data::Copy { buf, region, .. } if !buf.zero(region.offset, region.len) => {
                    Started::Done(-libc::EIO)
                }
                _ => Started::Done(full(req)),
            },
            OpKind::Write => Started::Done(full(req)),
            OpKind::Flush | OpKind::Discard | OpKind::WriteZeroes => Started::Done(0),
            OpKind::Other => Started::Done(-libc::EOPNOTSUPP),
        }
    }
}
