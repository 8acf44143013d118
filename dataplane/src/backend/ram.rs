//! The RAM backend: a shared mapping of a tmpfs file (named, or a memfd). Untouched blocks read as zeros without
//! taking memory; pages are allocated on first write and given back on discard.
//!
//! The mapping reserves address space (not memory) beyond the volume's size so the volume can
//! grow in place: at least [`GROWTH_RESERVE`] bytes, or 4x the size.

use super::{full, Backend, BackendError, Data, Growth, IoCtx, Request, Started};
use crate::stats::OpKind;
use crate::sys::os::{self, Mapping};
use std::sync::atomic::{AtomicU64, Ordering};

/// Address space reserved for growth of small RAM volumes.
pub const GROWTH_RESERVE: u64 = 64 << 30;

#[derive(Debug)]
pub struct RamBackend {
    mem: Mapping,
    size: AtomicU64,
    /// The tmpfs file behind the volume: a named one for a persistent RAM volume, else a memfd.
    /// Resized with the volume; its block count is the memory the volume uses.
    file: std::fs::File,
}

impl RamBackend {
    /// A RAM volume that lives as long as this process (its memory is a memfd).
    pub fn new(size: u64) -> Result<Self, BackendError> {
        let file =
            os::memfd("ublkd-ram").map_err(|source| BackendError::Memory { size, source })?;
        Self::from_file(file, size).map_err(|e| match e {
            BackendError::Open { source, .. } => BackendError::Memory { size, source },
            other => other,
        })
    }

    /// A RAM volume kept in the file `path` (created if missing, e.g. on tmpfs): its data
    /// survives the process, so a restarted ublkd serves it again.
    pub fn with_file(path: &std::path::Path, size: u64) -> Result<Self, BackendError> {
        let open_err = |source| BackendError::Open {
            path: path.to_owned(),
            source,
        };
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(open_err)?;
        }
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(open_err)?;
        Self::from_file(file, size).map_err(|e| match e {
            BackendError::Open { source, .. } => open_err(source),
            other => other,
        })
    }

    fn from_file(file: std::fs::File, size: u64) -> Result<Self, BackendError> {
        let open_err = |source| BackendError::Open {
            path: std::path::PathBuf::new(),
            source,
        };
        if file.metadata().map_err(open_err)?.len() < size {
            file.set_len(size).map_err(open_err)?;
        }
        let reserve = size.saturating_mul(4).max(GROWTH_RESERVE);
        let len = usize::try_from(reserve).map_err(|_| BackendError::Memory {
            size,
            source: std::io::Error::from_raw_os_error(libc::EFBIG),
        })?;
        // Pages past the file's end are never touched: every access is checked against `size`.
        let mem = Mapping::shared_file(&file, len)
            .map_err(|source| BackendError::Memory { size, source })?;
        Ok(Self {
            mem,
            size: AtomicU64::new(size),
            file,
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
        let ok = match (req.op, ctx.data) {
            (OpKind::Read, Data::Copy { buf, region, .. }) => {
                buf.copy_from(region.offset, &self.mem, off, len)
            }
            (OpKind::Write, Data::Copy { buf, region, .. }) => {
                self.mem.copy_from(off, buf, region.offset, len)
            }
            // Memory is copied by the CPU: the kernel's pages are out of reach.
            (OpKind::Read | OpKind::Write, Data::ZeroCopy { .. }) => false,
            _ => self.mem.discard(off, len),
        };
        match (ok, req.has_data()) {
            (false, _) => Started::Done(-libc::EIO),
            (true, true) => Started::Done(full(req)),
            (true, false) => Started::Done(0),
        }
    }

    /// The tmpfs file's allocated blocks: one fstat, whatever the volume's size (pages are
    /// allocated on first write and freed by discard, MADV_REMOVE).
    fn memory_bytes(&self) -> u64 {
        os::allocated_bytes(&self.file)
    }

    fn resize(&self, size: u64, _: Growth) -> Result<(), BackendError> {
        let max = self.mem.len() as u64;
        if size > max {
            return Err(BackendError::CannotGrow { size, max });
        }
        if self.file.metadata().map(|m| m.len()).unwrap_or(0) < size {
            self.file
                .set_len(size)
                .map_err(|source| BackendError::Memory { size, source })?;
        }
        self.size.store(size, Ordering::Relaxed);
        Ok(())
    }
}
