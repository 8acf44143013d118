//! Storage backends: where a volume's blocks live. One trait, one file per backend.
//!
//! A backend never blocks its worker: it either finishes a request at once (`Started::Done`) or
//! pushes exactly one operation on the worker's ring (`Started::Submitted`), whose completion the
//! worker hands back to `finish`.

mod file;
mod host_use;
mod namespace_id;
mod null;
mod nvme;
mod ram;

pub use file::FileBackend;
pub use namespace_id::{NamespaceIdentity, ParseIdentityError};
pub use null::NullBackend;
pub use nvme::{
    erase_window, find_namespace, identify_namespace, namespace_host_use, Namespace, NvmeBackend,
    Window,
};
pub use ram::RamBackend;

use crate::ring::{Region, WorkerRing};
use crate::stats::OpKind;
use crate::sys::{self, os::Mapping, ublksrv_io_desc};
use std::fmt::Debug;
use std::io;
use std::path::PathBuf;
use std::sync::Arc;

/// What a volume is backed by.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum BackendSpec {
    /// Completes at once and touches no data: writes are dropped, reads return what the
    /// buffer held.
    Null,
    /// Sparse memory, allocated on first write: anonymous (lost when the process ends), or a
    /// file on tmpfs (`path`, e.g. under /dev/shm) that outlives the process until a reboot.
    Ram { path: Option<PathBuf> },
    /// A regular file or a block device.
    File { path: PathBuf },
    /// An NVMe namespace through its generic char device (`/dev/ngXnY`), whole or a window of
    /// it, driven with passthrough commands.
    Nvme {
        path: PathBuf,
        window: Option<Window>,
        /// Serve the window's blocks as they are: no erase when the device is created
        /// (`DeviceSpec::erase`) or when the window grows. For adopting a window's data on
        /// purpose; otherwise earlier tenants' blocks are made unreadable first.
        keep_data: bool,
    },
}

/// How a range of a shared device was made unreadable before a volume served it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Erase {
    /// NVMe Write Zeroes; `deallocate` when DEAC deallocated the blocks as well.
    WriteZeroes { deallocate: bool },
    /// NVMe Dataset Management deallocate, on a namespace whose deallocated blocks read as
    /// zeroes.
    Deallocate,
}

impl Erase {
    pub fn name(self) -> &'static str {
        match self {
            Erase::WriteZeroes { deallocate: true } => "write zeroes (deallocate)",
            Erase::WriteZeroes { deallocate: false } => "write zeroes",
            Erase::Deallocate => "deallocate",
        }
    }
}

impl BackendSpec {
    pub fn kind(&self) -> &'static str {
        match self {
            BackendSpec::Null => "null",
            BackendSpec::Ram { .. } => "ram",
            BackendSpec::File { .. } => "file",
            BackendSpec::Nvme { .. } => "nvme",
        }
    }
}

/// Errors opening a backend, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("cannot open backing file {path}")]
    Open {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("backing path {0} is neither a regular file nor a block device")]
    NotFileOrBlock(PathBuf),
    #[error("backing file {path} holds {have} bytes, the volume needs {need}")]
    TooSmall { path: PathBuf, have: u64, need: u64 },
    #[error("a RAM volume created at this size can grow to {max} bytes, not {size}")]
    CannotGrow { size: u64, max: u64 },
    #[error("cannot reserve {size} bytes of memory")]
    Memory {
        size: u64,
        #[source]
        source: io::Error,
    },
    #[error("{0} is not an NVMe namespace char device (use /dev/ngXnY)")]
    NotNvme(PathBuf),
    #[error("cannot identify NVMe namespace {path}")]
    Identify {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("NVMe namespace {path} uses {metadata} bytes of metadata per block, which ublk volumes cannot carry")]
    NvmeMetadata { path: PathBuf, metadata: u16 },
    #[error("window {offset}+{len} of {path} is not aligned to its {lba} byte blocks")]
    WindowUnaligned {
        path: PathBuf,
        offset: u64,
        len: u64,
        lba: u32,
    },
    #[error("window {offset}+{len} ends past the end of {path} ({size} bytes)")]
    WindowPastEnd {
        path: PathBuf,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error(
        "{path} can neither write zeroes nor deallocate to zeroes, so an earlier tenant's data in \
         window {offset}+{len} would be readable: refused (keep_data serves it as it is)"
    )]
    CannotErase {
        path: PathBuf,
        offset: u64,
        len: u64,
    },
    #[error("cannot erase window {offset}+{len} of {path}")]
    EraseFailed {
        path: PathBuf,
        offset: u64,
        len: u64,
        #[source]
        source: io::Error,
    },
    #[error("volume block size {block_size} is smaller than the {lba} byte blocks of {path}")]
    BlockSmallerThanLba {
        path: PathBuf,
        block_size: u32,
        lba: u32,
    },
}

/// One block request as the kernel described it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub op: OpKind,
    pub raw_op: u8,
    pub fua: bool,
    pub nounmap: bool,
    /// Byte offset on the volume.
    pub offset: u64,
    /// Length in bytes.
    pub len: u32,
}

impl Request {
    pub fn from_desc(d: &ublksrv_io_desc) -> Self {
        let raw_op = (d.op_flags & 0xff) as u8;
        let op = match raw_op {
            sys::UBLK_IO_OP_READ => OpKind::Read,
            sys::UBLK_IO_OP_WRITE => OpKind::Write,
            sys::UBLK_IO_OP_FLUSH => OpKind::Flush,
            sys::UBLK_IO_OP_DISCARD => OpKind::Discard,
            sys::UBLK_IO_OP_WRITE_ZEROES => OpKind::WriteZeroes,
            _ => OpKind::Other,
        };
        Self {
            op,
            raw_op,
            fua: d.op_flags & sys::UBLK_IO_F_FUA != 0,
            nounmap: d.op_flags & sys::UBLK_IO_F_NOUNMAP != 0,
            offset: d.start_sector.saturating_mul(512),
            len: d.nr_sectors.saturating_mul(512),
        }
    }

    /// Whether the request moves data through the tag buffer.
    pub fn has_data(&self) -> bool {
        matches!(self.op, OpKind::Read | OpKind::Write)
    }
}

/// Where a request's data is.
#[derive(Debug, Clone, Copy)]
pub enum Data<'a> {
    /// Copied: this tag's part of the queue's buffers (`region.len` = the request's length),
    /// and the buffers' fixed-buffer slot on the ring when registered.
    Copy {
        buf: &'a Arc<Mapping>,
        region: Region,
        index: Option<u16>,
    },
    /// Zero copy: the request's own pages, which the kernel registered at fixed-buffer slot
    /// `index` of the ring (UBLK_F_AUTO_BUF_REG). Only ring operations can reach them.
    ZeroCopy { index: u16 },
}

/// What a backend needs to serve one request.
#[derive(Debug)]
pub struct IoCtx<'a> {
    pub ring: &'a mut WorkerRing,
    /// Completion tag for an operation the backend pushes.
    pub user_data: u64,
    pub data: Data<'a>,
    /// A few bytes (`region.len`, at least 16) of this tag's own memory that stay put until the
    /// pushed operation completes: command payloads such as a DSM range.
    pub scratch: (&'a Arc<Mapping>, Region),
}

/// Limits a backend puts on the volume's block device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// Smallest block the backend can address.
    pub block_size: u32,
    /// Largest single read or write, in bytes.
    pub max_io_bytes: u32,
    /// Largest discard and write-zeroes, in bytes; 0 when unsupported.
    pub max_discard_bytes: u64,
    pub max_write_zeroes_bytes: u64,
    /// The backend has a volatile write cache (flush and FUA matter).
    pub volatile_cache: bool,
    /// Segments of one request must not cross this boundary mask (NVMe PRP pages).
    pub virt_boundary_mask: u64,
}

/// The part of a shared device a backend uses, so that two volumes never overlap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub path: PathBuf,
    /// `st_rdev` of the device.
    pub rdev: u64,
    pub start: u64,
    pub end: u64,
}

impl Claim {
    pub fn overlaps(&self, other: &Claim) -> bool {
        self.rdev == other.rdev && self.start < other.end && other.start < self.end
    }
}

/// How `Backend::start` left a request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Started {
    /// Finished: bytes for data requests, 0 for others, or a negative errno.
    Done(i32),
    /// One operation was pushed with `IoCtx::user_data`; `finish` gets its result.
    Submitted,
}

pub trait Backend: Send + Sync + Debug {
    fn kind(&self) -> &'static str;

    /// Serves `req`, at once or by pushing one ring operation.
    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started;

    /// Whether an operation that completed with `res` failed for a passing reason (a path
    /// error, a controller reset) and is worth sending again; the worker resends it a few
    /// times with a back-off before it fails the request.
    fn retryable(&self, _res: i32) -> bool {
        false
    }

    /// Turns the pushed operation's result into the request's result.
    fn finish(&self, req: &Request, res: i32) -> i32 {
        if res < 0 || req.has_data() {
            res
        } else {
            0
        }
    }

    /// Memory the backend holds (RAM volumes).
    fn memory_bytes(&self) -> u64 {
        0
    }

    /// Whether the backend reads and writes tag buffers through the ring (registered as fixed
    /// buffers, which pins their memory). Backends that copy in userspace leave them unpinned,
    /// so an idle volume holds no buffer memory.
    fn uses_fixed_buffers(&self) -> bool {
        false
    }

    /// Whether the backend can serve requests from kernel-registered pages (`Data::ZeroCopy`).
    fn zero_copy(&self) -> bool {
        false
    }

    /// Whether the backend's operations can be polled (NVMe poll queues).
    fn pollable(&self) -> bool {
        false
    }

    /// Whether a WRITE_ZEROES frees or unmaps its range rather than writing zeroes through a
    /// device (memory dropped, a hole punched or an unwritten extent in a file): the I/O limits
    /// then charge it like a discard, else its whole length (`qos::charged_bytes`).
    fn zeroes_deallocate(&self) -> bool {
        true
    }

    /// Device limits the volume must respect; None when the backend has none of its own.
    fn limits(&self) -> Option<Limits> {
        None
    }

    /// The range of a shared device the backend owns.
    fn claim(&self) -> Option<Claim> {
        None
    }

    /// Prepares for the volume to become `size` bytes (before the kernel is told); nothing to
    /// prepare unless the backend says otherwise. `growth` says whether the blocks a range grows
    /// onto are still to be erased.
    fn resize(&self, _size: u64, _growth: Growth) -> Result<(), BackendError> {
        Ok(())
    }

    /// Makes what an earlier user left in the backend's range unreadable, before a new
    /// volume's device appears: None when the backend starts empty by itself (a new file, new
    /// memory) or was told to keep its data.
    fn erase(&self) -> Result<Option<Erase>, BackendError> {
        Ok(None)
    }
}

/// What a resize does with the blocks an NVMe window grows onto, which may hold a deleted
/// volume's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Growth {
    /// Erased here, before the device's size reaches them (on the control thread).
    Erase,
    /// Already erased by the caller (`erase_window`), off the control thread.
    Erased,
}

/// Opens the backend `spec` for a volume of `size` bytes.
pub fn open(
    spec: &BackendSpec,
    size: u64,
    block_size: u32,
) -> Result<Arc<dyn Backend>, BackendError> {
    Ok(match spec {
        BackendSpec::Null => Arc::new(NullBackend),
        BackendSpec::Ram { path: None } => Arc::new(RamBackend::new(size)?),
        BackendSpec::Ram { path: Some(p) } => Arc::new(RamBackend::with_file(p, size)?),
        BackendSpec::File { path } => Arc::new(FileBackend::open(path, size, block_size)?),
        BackendSpec::Nvme {
            path,
            window,
            keep_data,
        } => {
            // Test hook: a window past the namespace's end, so that the device itself fails
            // an I/O (LBA out of range).
            let unchecked = crate::hooks::fire(crate::hooks::Fault::NvmeWindowUnchecked);
            Arc::new(NvmeBackend::open(
                path, *window, size, block_size, unchecked, *keep_data,
            )?)
        }
    })
}

/// The result of a data request that moved all its bytes.
fn full(req: &Request) -> i32 {
    i32::try_from(req.len).unwrap_or(i32::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_decodes_op_flags_and_sectors() {
        let d = ublksrv_io_desc {
            op_flags: u32::from(sys::UBLK_IO_OP_WRITE) | sys::UBLK_IO_F_FUA,
            nr_sectors: 8,
            start_sector: 16,
            addr: 0,
        };
        let r = Request::from_desc(&d);
        assert_eq!(r.op, OpKind::Write);
        assert!(r.fua && !r.nounmap);
        assert_eq!((r.offset, r.len), (8192, 4096));
        let z = Request::from_desc(&ublksrv_io_desc {
            op_flags: u32::from(sys::UBLK_IO_OP_WRITE_ZEROES) | sys::UBLK_IO_F_NOUNMAP,
            ..d
        });
        assert_eq!(z.op, OpKind::WriteZeroes);
        assert!(z.nounmap && !z.has_data());
        let odd = Request::from_desc(&ublksrv_io_desc { op_flags: 99, ..d });
        assert_eq!(odd.op, OpKind::Other);
    }
}
