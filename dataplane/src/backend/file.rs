//! The file backend: a regular file or a block device, served with io_uring on the worker's ring.
//! O_DIRECT when the volume's block size allows it; reads and writes use the queue's registered
//! buffers; FLUSH is fdatasync, FUA a RWF_DSYNC write, DISCARD punches a hole (keeping the size),
//! WRITE_ZEROES zeroes the range.

use super::{Backend, BackendError, Data, Growth, IoCtx, Request, Started};
use crate::ring::Op;
use crate::stats::OpKind;
use crate::sys::os::block_device_size;
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};

#[derive(Debug)]
pub struct FileBackend {
    file: File,
    block_device: bool,
    /// FALLOC_FL_ZERO_RANGE failed with EOPNOTSUPP (tmpfs, some network file systems): write
    /// zeroes by punching holes instead, which read back as zeros too.
    no_zero_range: AtomicBool,
}

impl FileBackend {
    pub fn open(path: &Path, size: u64, block_size: u32) -> Result<Self, BackendError> {
        let open_err = |source| BackendError::Open {
            path: path.to_owned(),
            source,
        };
        let meta = std::fs::metadata(path).map_err(open_err)?;
        let block_device = meta.file_type().is_block_device();
        if !meta.is_file() && !block_device {
            return Err(BackendError::NotFileOrBlock(path.to_owned()));
        }
        let open = |direct: bool| {
            OpenOptions::new()
                .read(true)
                .write(true)
                .custom_flags(libc::O_CLOEXEC | if direct { libc::O_DIRECT } else { 0 })
                .open(path)
        };
        // O_DIRECT needs I/O aligned to the backing's DIO alignment; page-sized blocks always are.
        let want_direct = block_size >= 4096;
        // A file system without O_DIRECT (EINVAL) gets buffered I/O instead.
        let file = match open(want_direct) {
            Ok(f) => f,
            Err(e) if want_direct && e.raw_os_error() == Some(libc::EINVAL) => {
                open(false).map_err(open_err)?
            }
            Err(e) => return Err(open_err(e)),
        };
        let have = if block_device {
            block_device_size(&file).map_err(open_err)?
        } else {
            meta.len()
        };
        if have < size {
            return Err(BackendError::TooSmall {
                path: path.to_owned(),
                have,
                need: size,
            });
        }
        let no_zero_range = !block_device && crate::sys::os::is_tmpfs(&file);
        Ok(Self {
            file,
            block_device,
            no_zero_range: AtomicBool::new(no_zero_range),
        })
    }

    fn len(&self) -> std::io::Result<u64> {
        if self.block_device {
            block_device_size(&self.file)
        } else {
            Ok(self.file.metadata()?.len())
        }
    }
}

impl Backend for FileBackend {
    /// A regular file punches or zeroes extents; a block device behind the file backend is
    /// sent zeroes to write.
    fn zeroes_deallocate(&self) -> bool {
        !self.block_device
    }

    fn kind(&self) -> &'static str {
        "file"
    }

    fn finish(&self, req: &Request, res: i32) -> i32 {
        if req.op == OpKind::WriteZeroes && res == -libc::EOPNOTSUPP && !self.block_device {
            // This request fails (the kernel then writes zeroes itself); later ones punch holes.
            self.no_zero_range.store(true, Ordering::Relaxed);
        }
        if res < 0 || req.has_data() {
            res
        } else {
            0
        }
    }

    fn uses_fixed_buffers(&self) -> bool {
        true
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn resize(&self, size: u64, _: Growth) -> Result<(), BackendError> {
        let have = self.len().map_err(|source| BackendError::Open {
            path: "(backing file)".into(),
            source,
        })?;
        if have < size {
            return Err(BackendError::TooSmall {
                path: "(backing file)".into(),
                have,
                need: size,
            });
        }
        Ok(())
    }

    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started {
        let fd = self.file.as_raw_fd();
        let rw_flags = if req.fua { libc::RWF_DSYNC } else { 0 };
        let op = match (req.op, ctx.data) {
            (OpKind::Read, Data::Copy { buf, region, index }) => Op::ReadFixed {
                fd,
                buf,
                index: index.unwrap_or(u16::MAX),
                region,
                file_offset: req.offset,
            },
            (OpKind::Write, Data::Copy { buf, region, index }) => Op::WriteFixed {
                fd,
                buf,
                index: index.unwrap_or(u16::MAX),
                region,
                file_offset: req.offset,
                rw_flags,
            },
            (OpKind::Read, Data::ZeroCopy { index }) => Op::ReadKernelBuf {
                fd,
                index,
                len: req.len,
                file_offset: req.offset,
            },
            (OpKind::Write, Data::ZeroCopy { index }) => Op::WriteKernelBuf {
                fd,
                index,
                len: req.len,
                file_offset: req.offset,
                rw_flags,
            },
            (OpKind::Flush, _) => Op::Fsync { fd, datasync: true },
            (OpKind::Discard, _) => Op::Fallocate {
                fd,
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset: req.offset,
                len: u64::from(req.len),
            },
            (OpKind::WriteZeroes, _) => Op::Fallocate {
                fd,
                // NOUNMAP asks for the blocks to stay allocated; otherwise a hole reads as zeros.
                mode: if (req.nounmap && !self.no_zero_range.load(Ordering::Relaxed))
                    || self.block_device
                {
                    libc::FALLOC_FL_ZERO_RANGE | libc::FALLOC_FL_KEEP_SIZE
                } else {
                    libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE
                },
                offset: req.offset,
                len: u64::from(req.len),
            },
            (OpKind::Other, _) => return Started::Done(-libc::EOPNOTSUPP),
        };
        match ctx.ring.push(op, ctx.user_data) {
            Ok(()) => Started::Submitted,
            Err(_) => Started::Done(-libc::EIO),
        }
    }
}
