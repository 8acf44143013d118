//! What a worker asks its ring to do (`Op`), and what comes back (`Completion`).

use super::BufRing;
use crate::sys::nvme::NvmeCmd;
use crate::sys::os::Mapping;
use crate::sys::{ublk_batch_io, ublksrv_io_cmd};
use io_uring::cqueue;
use std::os::fd::RawFd;
use std::sync::Arc;

/// One reaped completion.
#[derive(Debug, Clone, Copy)]
pub struct Completion {
    pub user_data: u64,
    pub result: i32,
    pub flags: u32,
}

impl Completion {
    pub fn more(&self) -> bool {
        cqueue::more(self.flags)
    }

    pub fn buffer_id(&self) -> Option<u16> {
        cqueue::buffer_select(self.flags)
    }
}

/// A region of a mapping: `len` bytes at `offset`.
#[derive(Debug, Clone, Copy)]
pub struct Region {
    pub offset: usize,
    pub len: usize,
}

/// Operations a worker submits.
#[derive(Debug)]
pub enum Op<'a> {
    /// A per-IO ublk command (FETCH_REQ, COMMIT_AND_FETCH_REQ). `buf` is the tag's data buffer
    /// in copy mode; `auto_buf` the AUTO_BUF_REG word (buffer slot and flags) in zero-copy mode,
    /// which the kernel reads from the SQE's `addr`.
    UblkIo {
        fd: RawFd,
        cmd_op: u32,
        cmd: ublksrv_io_cmd,
        buf: Option<(&'a Arc<Mapping>, Region)>,
        auto_buf: Option<u64>,
    },
    /// A batch ublk command (PREP_IO_CMDS, COMMIT_IO_CMDS) whose elements are in `elems`.
    UblkBatch {
        fd: RawFd,
        cmd_op: u32,
        cmd: ublk_batch_io,
        elems: (&'a Arc<Mapping>, Region),
        /// Tag buffers the elements point at (copy mode), kept alive with the command.
        bufs: Option<&'a Arc<Mapping>>,
    },
    /// A multishot FETCH_IO_CMDS taking tag buffers from provided-buffer group `group`.
    UblkFetchMultishot {
        fd: RawFd,
        cmd_op: u32,
        cmd: ublk_batch_io,
        group: &'a BufRing,
    },
    /// Read into (or write from) registered buffer `index` = `buf`.
    ReadFixed {
        fd: RawFd,
        buf: &'a Arc<Mapping>,
        index: u16,
        region: Region,
        file_offset: u64,
    },
    WriteFixed {
        fd: RawFd,
        buf: &'a Arc<Mapping>,
        index: u16,
        region: Region,
        file_offset: u64,
        rw_flags: i32,
    },
    /// Read into (or write from) `region` of `buf`, not registered (e.g. user copy of a
    /// request's data through `/dev/ublkcN`).
    Read {
        fd: RawFd,
        buf: &'a Arc<Mapping>,
        region: Region,
        file_offset: u64,
    },
    Write {
        fd: RawFd,
        buf: &'a Arc<Mapping>,
        region: Region,
        file_offset: u64,
    },
    /// Read into (or write from) the request pages the kernel registered at fixed-buffer slot
    /// `index` (AUTO_BUF_REG zero copy); the kernel owns those pages until the ublk commit.
    ReadKernelBuf {
        fd: RawFd,
        index: u16,
        len: u32,
        file_offset: u64,
    },
    WriteKernelBuf {
        fd: RawFd,
        index: u16,
        len: u32,
        file_offset: u64,
        rw_flags: i32,
    },
    /// An NVMe I/O command (`NVME_URING_CMD_IO`) on an ng char device.
    Nvme {
        fd: RawFd,
        cmd: NvmeCmd,
        data: NvmeData<'a>,
    },
    Fsync {
        fd: RawFd,
        datasync: bool,
    },
    /// Completes (with -ETIME) after the `struct __kernel_timespec` (16 bytes) at `ts`.
    Timeout {
        ts: (&'a Arc<Mapping>, Region),
    },
    Fallocate {
        fd: RawFd,
        mode: i32,
        offset: u64,
        len: u64,
    },
    /// Read 8 bytes (an eventfd counter) into `buf`.
    Read8 {
        fd: RawFd,
        buf: &'a Arc<Mapping>,
        offset: usize,
    },
}

impl Op<'_> {
    /// The descriptor the op works on (none for a timeout).
    pub(super) fn fd(&self) -> Option<RawFd> {
        match self {
            Op::UblkIo { fd, .. }
            | Op::UblkBatch { fd, .. }
            | Op::UblkFetchMultishot { fd, .. }
            | Op::ReadFixed { fd, .. }
            | Op::WriteFixed { fd, .. }
            | Op::Read { fd, .. }
            | Op::Write { fd, .. }
            | Op::ReadKernelBuf { fd, .. }
            | Op::WriteKernelBuf { fd, .. }
            | Op::Nvme { fd, .. }
            | Op::Fsync { fd, .. }
            | Op::Fallocate { fd, .. }
            | Op::Read8 { fd, .. } => Some(*fd),
            Op::Timeout { .. } => None,
        }
    }
}

/// Where an NVMe command's data lives.
#[derive(Debug)]
pub enum NvmeData<'a> {
    None,
    /// Plain memory the kernel maps per command (a DSM range list).
    User(&'a Arc<Mapping>, Region),
    /// Part of registered user buffer `index` (copy mode).
    Fixed(&'a Arc<Mapping>, Region, u16),
    /// Request pages registered by the kernel at slot `index` (zero copy), from offset 0.
    Kernel {
        index: u16,
        len: u32,
    },
}
