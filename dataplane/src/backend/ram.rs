//! The RAM backend: a lazily backed anonymous mapping. Untouched blocks read as zeros without
//! taking memory; pages are allocated on first write and given back on discard.

use super::{full, Backend, BackendError, IoCtx, Request, Started};
use crate::stats::OpKind;
use crate::sys::os::Mapping;

#[derive(Debug)]
pub struct RamBackend {
    mem: Mapping,
    size: u64,
}

impl RamBackend {
    pub fn new(size: u64) -> Result<Self, BackendError> {
        let len = usize::try_from(size).map_err(|_| BackendError::Memory {
            size,
            source: std::io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        let mem =
            Mapping::anonymous(len).map_err(|source| BackendError::Memory { size, source })?;
        Ok(Self { mem, size })
    }

    fn range(&self, req: &Request) -> Option<usize> {
        let end = req.offset.checked_add(u64::from(req.len))?;
        (end <= self.size).then(|| usize::try_from(req.offset).ok())?
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
}
