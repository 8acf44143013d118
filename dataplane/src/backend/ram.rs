//! The RAM backend: a lazily backed anonymous mapping. Untouched blocks read as zeros without
//! taking memory; pages are allocated on first write and given back on discard.
//!
//! The mapping reserves address space (not memory) beyond the volume's size so the volume can
//! grow in place: at least [`GROWTH_RESERVE`] bytes, or 4x the size.

use super::{full, Backend, BackendError, IoCtx, Request, Started};
use crate::stats::OpKind;
use crate::sys::os::Mapping;
use std::sync::atomic::{AtomicU64, Ordering};

/// Address space reserved for growth of small RAM volumes.
pub const GROWTH_RESERVE: u64 = 64 << 30;

#[derive(Debug)]
pub struct RamBackend {
    mem: Mapping,
    size: AtomicU64,
}

impl RamBackend {
    pub fn new(size: u64) -> Result<Self, BackendError> {
        let reserve = size.saturating_mul(4).max(GROWTH_RESERVE);
        let len = usize::try_from(reserve).map_err(|_| BackendError::Memory {
            size,
            source: std::io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        let mem =
            Mapping::anonymous(len).map_err(|source| BackendError::Memory { size, source })?;
        Ok(Self {
            mem,
            size: AtomicU64::new(size),
        })
    }

    fn range(&self, req: &Request) -> Option<usize> {
        let end = req.offset.checked_add(u64::from(req.len))?;
        (end <= self.size.load(Ordering::Relaxed)).then(|| usize::try_from(req.offset).ok())?
    }
}

impl Backend for RamBackend {
    fn kind(&self) -> &'static str {
        "ram"
    }

    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started {
        // Memory has no cache to flush; a flush's sector is not meaningful either.
        match req.op {
            OpKind::Flush => return Started::Done(0),
            OpKind::Other => return Started::Done(-libc::EOPNOTSUPP),
            _ => {}
        }
        let Some(off) = self.range(req) else {
            return Started::Done(-libc::EIO);
        };
        let len = req.len as usize;
        let ok = match req.op {
            OpKind::Read => ctx.buf.copy_from(ctx.region.offset, &self.mem, off, len),
            OpKind::Write => self.mem.copy_from(off, ctx.buf, ctx.region.offset, len),
            _ => self.mem.discard(off, len),
        };
        match (ok, req.has_data()) {
            (false, _) => Started::Done(-libc::EIO),
            (true, true) => Started::Done(full(req)),
            (true, false) => Started::Done(0),
        }
    }

    fn memory_bytes(&self) -> u64 {
        self.mem.resident_bytes()
    }

    fn resize(&self, size: u64) -> Result<(), BackendError> {
        let max = self.mem.len() as u64;
        if size > max {
            return Err(BackendError::CannotGrow { size, max });
        }
        self.size.store(size, Ordering::Relaxed);
        Ok(())
    }
}
