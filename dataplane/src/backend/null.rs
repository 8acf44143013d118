//! The null backend: every request succeeds at once; reads return zeros.

use super::{full, Backend, IoCtx, Request, Started};
use crate::stats::OpKind;

#[derive(Debug)]
pub struct NullBackend;

impl Backend for NullBackend {
    fn kind(&self) -> &'static str {
        "null"
    }

    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started {
        match req.op {
            OpKind::Read => {
                if ctx.buf.zero(ctx.region.offset, ctx.region.len) {
                    Started::Done(full(req))
                } else {
                    Started::Done(-libc::EIO)
                }
            }
            OpKind::Write => Started::Done(full(req)),
            OpKind::Flush | OpKind::Discard | OpKind::WriteZeroes => Started::Done(0),
            OpKind::Other => Started::Done(-libc::EOPNOTSUPP),
        }
    }
}
