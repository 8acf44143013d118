//! What a worker asks its ring to do (`Op`), how each is written into an SQE (`Op::encode`), and
//! what comes back (`Completion`).
//!
//! Encoding is safe code: it checks every region against its mapping and every fixed-buffer
//! index against the ring's table, and returns the mappings the SQE points into so that the ring
//! can hold them until the last completion. Only handing the SQE to the kernel is unsafe
//! (`WorkerRing::push`).

use super::sqe::{batch_cmd_bytes, io_cmd_bytes, patch_sqe, IORING_URING_CMD_MULTISHOT};
use super::{BufRing, RingError};
use crate::sys::nvme::NvmeCmd;
use crate::sys::os::Mapping;
use crate::sys::{ublk_batch_io, ublksrv_io_cmd};
use io_uring::{cqueue, opcode, squeue, types};
use std::os::fd::RawFd;
use std::sync::Arc;
use std::time::Duration;

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

/// The mappings an encoded SQE points into, held by the ring until its last completion.
pub(super) type Pins = [Option<Arc<Mapping>>; 2];

/// The ring's fixed-buffer table, as an op's encoding checks it.
pub(super) trait FixedTable {
    /// Whether slot `index` holds `buf`, registered by us.
    fn holds(&self, index: u16, buf: &Arc<Mapping>) -> bool;
    /// Whether slot `index` is reserved for request pages the kernel registers itself.
    fn is_kernel(&self, index: u16) -> bool;
}

/// A `struct __kernel_timespec` (two native `i64`: seconds, nanoseconds) for `d`, as a timeout
/// op reads it from memory: the one encoder of a wait for the kernel.
pub fn kernel_timespec(d: Duration) -> [u8; 16] {
    let secs = i64::try_from(d.as_secs()).unwrap_or(i64::MAX);
    let mut b = [0u8; 16];
    b[0..8].copy_from_slice(&secs.to_ne_bytes());
    b[8..16].copy_from_slice(&i64::from(d.subsec_nanos()).to_ne_bytes());
    b
}

fn check(map: &Mapping, r: Region) -> Result<(), RingError> {
    match r.offset.checked_add(r.len) {
        Some(end) if end <= map.len() => Ok(()),
        _ => Err(RingError::BadRegion),
    }
}

fn len32(r: Region) -> Result<u32, RingError> {
    u32::try_from(r.len).map_err(|_| RingError::BadRegion)
}

fn fixed(table: &impl FixedTable, buf: &Arc<Mapping>, index: u16) -> Result<(), RingError> {
    if table.holds(index, buf) {
        Ok(())
    } else {
        Err(RingError::BadRegion)
    }
}

fn kernel(table: &impl FixedTable, index: u16) -> Result<(), RingError> {
    if table.is_kernel(index) {
        Ok(())
    } else {
        Err(RingError::BadRegion)
    }
}

impl Op<'_> {
    /// The SQE for this op (without `user_data` or a fixed-file slot, which the ring sets) and
    /// the mappings it points into. Fails with `BadRegion` when a region lies outside its mapping
    /// or a fixed-buffer index does not hold what the op says.
    pub(super) fn encode(
        self,
        table: &impl FixedTable,
    ) -> Result<(squeue::Entry128, Pins), RingError> {
        let mut pins: Pins = [None, None];
        let entry: squeue::Entry128 = match self {
            Op::UblkIo {
                fd,
                cmd_op,
                mut cmd,
                buf,
                auto_buf,
            } => {
                if let Some((map, r)) = buf {
                    check(map, r)?;
                    cmd.addr = map.addr(r.offset);
                    pins[0] = Some(Arc::clone(map));
                }
                opcode::UringCmd80::new(types::Fd(fd), cmd_op)
                    .cmd(io_cmd_bytes(&cmd))
                    .addr(auto_buf)
                    .build()
            }
            Op::UblkBatch {
                fd,
                cmd_op,
                cmd,
                elems: (map, r),
                bufs,
            } => {
                check(map, r)?;
                if usize::from(cmd.nr_elem) * usize::from(cmd.elem_bytes) > r.len {
                    return Err(RingError::BadRegion);
                }
                pins[0] = Some(Arc::clone(map));
                pins[1] = bufs.map(Arc::clone);
                let e = opcode::UringCmd80::new(types::Fd(fd), cmd_op)
                    .cmd(batch_cmd_bytes(&cmd))
                    .addr(Some(map.addr(r.offset)))
                    .build();
                let len = u32::from(cmd.nr_elem) * u32::from(cmd.elem_bytes);
                patch_sqe(e, 0, None, Some(len))
            }
            Op::UblkFetchMultishot {
                fd,
                cmd_op,
                cmd,
                group,
            } => {
                pins[0] = Some(Arc::clone(&group.ring));
                pins[1] = Some(Arc::clone(&group.bufs));
                let e = opcode::UringCmd80::new(types::Fd(fd), cmd_op)
                    .cmd(batch_cmd_bytes(&cmd))
                    .addr(Some(0))
                    .build()
                    .flags(squeue::Flags::BUFFER_SELECT);
                patch_sqe(e, IORING_URING_CMD_MULTISHOT, Some(group.group), None)
            }
            Op::Read {
                fd,
                buf,
                region,
                file_offset,
            } => {
                check(buf, region)?;
                pins[0] = Some(Arc::clone(buf));
                let ptr = buf.addr(region.offset) as *mut u8;
                squeue::Entry128::from(
                    opcode::Read::new(types::Fd(fd), ptr, len32(region)?)
                        .offset(file_offset)
                        .build(),
                )
            }
            Op::Write {
                fd,
                buf,
                region,
                file_offset,
            } => {
                check(buf, region)?;
                pins[0] = Some(Arc::clone(buf));
                let ptr = buf.addr(region.offset) as *const u8;
                squeue::Entry128::from(
                    opcode::Write::new(types::Fd(fd), ptr, len32(region)?)
                        .offset(file_offset)
                        .build(),
                )
            }
            Op::ReadFixed {
                fd,
                buf,
                index,
                region,
                file_offset,
            } => {
                check(buf, region)?;
                fixed(table, buf, index)?;
                pins[0] = Some(Arc::clone(buf));
                let ptr = buf.addr(region.offset) as *mut u8;
                squeue::Entry128::from(
                    opcode::ReadFixed::new(types::Fd(fd), ptr, len32(region)?, index)
                        .offset(file_offset)
                        .build(),
                )
            }
            Op::WriteFixed {
                fd,
                buf,
                index,
                region,
                file_offset,
                rw_flags,
            } => {
                check(buf, region)?;
                fixed(table, buf, index)?;
                pins[0] = Some(Arc::clone(buf));
                let ptr = buf.addr(region.offset) as *const u8;
                squeue::Entry128::from(
                    opcode::WriteFixed::new(types::Fd(fd), ptr, len32(region)?, index)
                        .offset(file_offset)
                        .rw_flags(rw_flags)
                        .build(),
                )
            }
            Op::ReadKernelBuf {
                fd,
                index,
                len,
                file_offset,
            } => {
                kernel(table, index)?;
                // Address 0 is offset 0 of the kernel's buffer, not a pointer into our memory.
                squeue::Entry128::from(
                    opcode::ReadFixed::new(types::Fd(fd), std::ptr::null_mut(), len, index)
                        .offset(file_offset)
                        .build(),
                )
            }
            Op::WriteKernelBuf {
                fd,
                index,
                len,
                file_offset,
                rw_flags,
            } => {
                kernel(table, index)?;
                squeue::Entry128::from(
                    opcode::WriteFixed::new(types::Fd(fd), std::ptr::null(), len, index)
                        .offset(file_offset)
                        .rw_flags(rw_flags)
                        .build(),
                )
            }
            Op::Nvme { fd, mut cmd, data } => {
                let mut index = None;
                match data {
                    NvmeData::None => {
                        cmd.addr = 0;
                        cmd.data_len = 0;
                    }
                    NvmeData::User(map, r) => {
                        check(map, r)?;
                        cmd.addr = map.addr(r.offset);
                        cmd.data_len = len32(r)?;
                        pins[0] = Some(Arc::clone(map));
                    }
                    NvmeData::Fixed(map, r, i) => {
                        check(map, r)?;
                        fixed(table, map, i)?;
                        cmd.addr = map.addr(r.offset);
                        cmd.data_len = len32(r)?;
                        pins[0] = Some(Arc::clone(map));
                        index = Some(i);
                    }
                    NvmeData::Kernel { index: i, len } => {
                        kernel(table, i)?;
                        cmd.addr = 0;
                        cmd.data_len = len;
                        index = Some(i);
                    }
                }
                opcode::UringCmd80::new(types::Fd(fd), crate::sys::nvme::NVME_URING_CMD_IO)
                    .cmd(cmd.to_sqe_cmd())
                    .buf_index(index)
                    .build()
            }
            Op::Timeout { ts: (buf, region) } => {
                if region.len < std::mem::size_of::<types::Timespec>() {
                    return Err(RingError::BadRegion);
                }
                check(buf, region)?;
                pins[0] = Some(Arc::clone(buf));
                let ptr = buf.addr(region.offset) as *const types::Timespec;
                squeue::Entry128::from(opcode::Timeout::new(ptr).build())
            }
            Op::Fsync { fd, datasync } => {
                let mut o = opcode::Fsync::new(types::Fd(fd));
                if datasync {
                    o = o.flags(types::FsyncFlags::DATASYNC);
                }
                squeue::Entry128::from(o.build())
            }
            Op::Fallocate {
                fd,
                mode,
                offset,
                len,
            } => squeue::Entry128::from(
                opcode::Fallocate::new(types::Fd(fd), len)
                    .offset(offset)
                    .mode(mode)
                    .build(),
            ),
            Op::Read8 { fd, buf, offset } => {
                check(buf, Region { offset, len: 8 })?;
                pins[0] = Some(Arc::clone(buf));
                squeue::Entry128::from(
                    opcode::Read::new(types::Fd(fd), buf.addr(offset) as *mut u8, 8).build(),
                )
            }
        };
        Ok((entry, pins))
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

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::super::sqe::sqe_bytes;
    use super::*;
    use crate::sys::nvme::NVME_URING_CMD_IO;

    /// A fixed-buffer table: slot 1 holds `user`, slot 2 is the kernel's, the rest are free.
    struct Table {
        user: Arc<Mapping>,
    }

    impl FixedTable for Table {
        fn holds(&self, index: u16, buf: &Arc<Mapping>) -> bool {
            index == 1 && Arc::ptr_eq(&self.user, buf)
        }
        fn is_kernel(&self, index: u16) -> bool {
            index == 2
        }
    }

    fn map() -> Arc<Mapping> {
        Arc::new(Mapping::anonymous(8192).unwrap())
    }

    /// The SQE's fields, read from its bytes at the kernel's offsets.
    struct Sqe([u8; 128]);

    impl Sqe {
        fn u16(&self, at: usize) -> u16 {
            u16::from_ne_bytes(self.0[at..at + 2].try_into().unwrap())
        }
        fn u32(&self, at: usize) -> u32 {
            u32::from_ne_bytes(self.0[at..at + 4].try_into().unwrap())
        }
        fn u64(&self, at: usize) -> u64 {
            u64::from_ne_bytes(self.0[at..at + 8].try_into().unwrap())
        }
        fn opcode(&self) -> u8 {
            self.0[0]
        }
        fn flags(&self) -> u8 {
            self.0[1]
        }
        fn fd(&self) -> u32 {
            self.u32(4)
        }
        fn off(&self) -> u64 {
            self.u64(8)
        }
        fn addr(&self) -> u64 {
            self.u64(16)
        }
        fn len(&self) -> u32 {
            self.u32(24)
        }
        fn op_flags(&self) -> u32 {
            self.u32(28)
        }
        fn buf_index(&self) -> u16 {
            self.u16(40)
        }
        /// The uring_cmd payload, at byte 48.
        fn cmd(&self) -> &[u8] {
            &self.0[48..]
        }
    }

    fn encode(op: Op<'_>, table: &Table) -> Result<(Sqe, Pins), RingError> {
        op.encode(table).map(|(e, pins)| (Sqe(sqe_bytes(e)), pins))
    }

    fn pinned(pins: &Pins) -> Vec<*const Mapping> {
        pins.iter().flatten().map(Arc::as_ptr).collect()
    }

    fn bad(r: Result<(Sqe, Pins), RingError>) -> bool {
        matches!(r, Err(RingError::BadRegion))
    }

    const R: Region = Region {
        offset: 4096,
        len: 512,
    };
    const OUTSIDE: Region = Region {
        offset: 8000,
        len: 512,
    };

    #[test]
    fn ublk_io_points_the_command_at_the_tags_buffer_or_the_auto_buf_word() {
        let t = Table { user: map() };
        let buf = map();
        let cmd = ublksrv_io_cmd {
            q_id: 3,
            tag: 9,
            result: 4096,
            addr: 0,
        };
        let op = |buf, auto_buf| Op::UblkIo {
            fd: 7,
            cmd_op: 0xc010_7521,
            cmd,
            buf,
            auto_buf,
        };
        let (sqe, pins) = encode(op(Some((&buf, R)), None), &t).unwrap();
        assert_eq!(sqe.opcode(), opcode::UringCmd80::CODE);
        assert_eq!(sqe.fd(), 7);
        assert_eq!(sqe.u32(8), 0xc010_7521, "cmd_op");
        assert_eq!(&sqe.cmd()[0..2], &3u16.to_ne_bytes());
        assert_eq!(&sqe.cmd()[2..4], &9u16.to_ne_bytes());
        assert_eq!(&sqe.cmd()[4..8], &4096i32.to_ne_bytes());
        assert_eq!(&sqe.cmd()[8..16], &buf.addr(4096).to_ne_bytes());
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&buf)]);

        let (sqe, pins) = encode(op(None, Some(0x5_0002)), &t).unwrap();
        assert_eq!(sqe.addr(), 0x5_0002, "AUTO_BUF_REG word in addr");
        assert_eq!(&sqe.cmd()[8..16], &0u64.to_ne_bytes());
        assert!(pinned(&pins).is_empty());

        assert!(bad(encode(op(Some((&buf, OUTSIDE)), None), &t)));
    }

    #[test]
    fn ublk_batch_sets_the_element_buffer_and_its_length_and_pins_both_mappings() {
        let t = Table { user: map() };
        let (elems, bufs) = (map(), map());
        let cmd = ublk_batch_io {
            q_id: 1,
            nr_elem: 4,
            elem_bytes: 16,
            ..Default::default()
        };
        let (sqe, pins) = encode(
            Op::UblkBatch {
                fd: 5,
                cmd_op: 0xc010_7525,
                cmd,
                elems: (&elems, R),
                bufs: Some(&bufs),
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::UringCmd80::CODE);
        assert_eq!(sqe.addr(), elems.addr(4096));
        assert_eq!(sqe.len(), 64);
        assert_eq!(sqe.cmd()[6], 16, "elem_bytes");
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&elems), Arc::as_ptr(&bufs)]);
        // 40 elements of 16 bytes do not fit the 512-byte region.
        let too_many = ublk_batch_io { nr_elem: 40, ..cmd };
        assert!(bad(encode(
            Op::UblkBatch {
                fd: 5,
                cmd_op: 0,
                cmd: too_many,
                elems: (&elems, R),
                bufs: None,
            },
            &t,
        )));
    }

    #[test]
    fn multishot_fetch_selects_from_its_buffer_group() {
        let t = Table { user: map() };
        let group = BufRing::new(6, 8, 256).unwrap();
        let (sqe, pins) = encode(
            Op::UblkFetchMultishot {
                fd: 5,
                cmd_op: 0xc010_7527,
                cmd: ublk_batch_io::default(),
                group: &group,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.flags() & (1 << 5), 1 << 5, "IOSQE_BUFFER_SELECT");
        assert_eq!(
            sqe.op_flags() & IORING_URING_CMD_MULTISHOT,
            IORING_URING_CMD_MULTISHOT
        );
        assert_eq!(sqe.buf_index(), 6, "buf_group");
        assert_eq!(
            pinned(&pins),
            vec![Arc::as_ptr(&group.ring), Arc::as_ptr(&group.bufs)]
        );
    }

    #[test]
    fn plain_reads_and_writes_address_the_region_at_the_file_offset() {
        let t = Table { user: map() };
        let buf = map();
        for (op, code) in [
            (
                Op::Read {
                    fd: 4,
                    buf: &buf,
                    region: R,
                    file_offset: 1 << 20,
                },
                opcode::Read::CODE,
            ),
            (
                Op::Write {
                    fd: 4,
                    buf: &buf,
                    region: R,
                    file_offset: 1 << 20,
                },
                opcode::Write::CODE,
            ),
        ] {
            let (sqe, pins) = encode(op, &t).unwrap();
            assert_eq!(sqe.opcode(), code);
            assert_eq!(sqe.fd(), 4);
            assert_eq!(sqe.addr(), buf.addr(4096));
            assert_eq!(sqe.len(), 512);
            assert_eq!(sqe.off(), 1 << 20);
            assert_eq!(pinned(&pins), vec![Arc::as_ptr(&buf)]);
        }
        let outside = Op::Read {
            fd: 4,
            buf: &buf,
            region: OUTSIDE,
            file_offset: 0,
        };
        assert!(bad(encode(outside, &t)));
    }

    #[test]
    fn fixed_reads_and_writes_need_the_buffer_registered_at_their_index() {
        let t = Table { user: map() };
        let (sqe, _) = encode(
            Op::ReadFixed {
                fd: 4,
                buf: &t.user,
                index: 1,
                region: R,
                file_offset: 512,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::ReadFixed::CODE);
        assert_eq!((sqe.addr(), sqe.len()), (t.user.addr(4096), 512));
        assert_eq!((sqe.buf_index(), sqe.off()), (1, 512));

        let (sqe, pins) = encode(
            Op::WriteFixed {
                fd: 4,
                buf: &t.user,
                index: 1,
                region: R,
                file_offset: 512,
                rw_flags: libc::RWF_DSYNC,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::WriteFixed::CODE);
        assert_eq!(sqe.op_flags(), libc::RWF_DSYNC as u32);
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&t.user)]);

        let other = map();
        for (buf, index) in [(&other, 1), (&t.user, 3), (&t.user, 2)] {
            let op = Op::ReadFixed {
                fd: 4,
                buf,
                index,
                region: R,
                file_offset: 0,
            };
            assert!(bad(encode(op, &t)), "index {index}");
        }
    }

    #[test]
    fn kernel_buffer_ops_start_at_offset_zero_of_a_kernel_slot() {
        let t = Table { user: map() };
        let (sqe, pins) = encode(
            Op::ReadKernelBuf {
                fd: 4,
                index: 2,
                len: 8192,
                file_offset: 4096,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::ReadFixed::CODE);
        assert_eq!((sqe.addr(), sqe.len(), sqe.buf_index()), (0, 8192, 2));
        assert_eq!(sqe.off(), 4096);
        assert!(pinned(&pins).is_empty());

        let (sqe, _) = encode(
            Op::WriteKernelBuf {
                fd: 4,
                index: 2,
                len: 4096,
                file_offset: 0,
                rw_flags: libc::RWF_DSYNC,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::WriteFixed::CODE);
        assert_eq!(sqe.op_flags(), libc::RWF_DSYNC as u32);

        let user_slot = Op::WriteKernelBuf {
            fd: 4,
            index: 1,
            len: 4096,
            file_offset: 0,
            rw_flags: 0,
        };
        assert!(bad(encode(user_slot, &t)));
    }

    #[test]
    fn nvme_commands_carry_their_data_as_the_data_kind_says() {
        let t = Table { user: map() };
        let plain = map();
        let cmd = NvmeCmd {
            nsid: 1,
            addr: 0xdead,
            data_len: 77,
            ..Default::default()
        };
        // In the uring_cmd payload: addr at 24, data_len at 36 (struct nvme_uring_cmd).
        let data_of = |s: &Sqe| (s.u64(48 + 24), s.u32(48 + 36));
        let nvme = |data| Op::Nvme { fd: 9, cmd, data };

        let (sqe, pins) = encode(nvme(NvmeData::None), &t).unwrap();
        assert_eq!(sqe.opcode(), opcode::UringCmd80::CODE);
        assert_eq!(sqe.u32(8), NVME_URING_CMD_IO, "cmd_op");
        assert_eq!(data_of(&sqe), (0, 0));
        assert!(pinned(&pins).is_empty());

        let (sqe, pins) = encode(nvme(NvmeData::User(&plain, R)), &t).unwrap();
        assert_eq!(data_of(&sqe), (plain.addr(4096), 512));
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&plain)]);

        let (sqe, _) = encode(nvme(NvmeData::Fixed(&t.user, R, 1)), &t).unwrap();
        assert_eq!(data_of(&sqe), (t.user.addr(4096), 512));
        assert_eq!(sqe.buf_index(), 1);
        assert_eq!(sqe.op_flags() & 1, 1, "IORING_URING_CMD_FIXED");

        let (sqe, pins) = encode(
            nvme(NvmeData::Kernel {
                index: 2,
                len: 4096,
            }),
            &t,
        )
        .unwrap();
        assert_eq!(data_of(&sqe), (0, 4096));
        assert_eq!(sqe.buf_index(), 2);
        assert!(pinned(&pins).is_empty());

        assert!(bad(encode(nvme(NvmeData::Fixed(&plain, R, 1)), &t)));
        assert!(bad(encode(nvme(NvmeData::Kernel { index: 1, len: 1 }), &t)));
        assert!(bad(encode(nvme(NvmeData::User(&plain, OUTSIDE)), &t)));
    }

    #[test]
    fn a_timeout_points_at_a_whole_timespec() {
        let t = Table { user: map() };
        let buf = map();
        let ts = Region {
            offset: 64,
            len: 16,
        };
        let (sqe, pins) = encode(Op::Timeout { ts: (&buf, ts) }, &t).unwrap();
        assert_eq!(sqe.opcode(), opcode::Timeout::CODE);
        assert_eq!((sqe.addr(), sqe.len()), (buf.addr(64), 1));
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&buf)]);
        let short = Region { offset: 64, len: 8 };
        assert!(bad(encode(Op::Timeout { ts: (&buf, short) }, &t)));
    }

    #[test]
    fn fsync_fallocate_and_the_eventfd_read() {
        let t = Table { user: map() };
        let (sqe, _) = encode(
            Op::Fsync {
                fd: 3,
                datasync: true,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::Fsync::CODE);
        assert_eq!(sqe.op_flags(), 1, "IORING_FSYNC_DATASYNC");
        let (sqe, _) = encode(
            Op::Fsync {
                fd: 3,
                datasync: false,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.op_flags(), 0);

        let (sqe, _) = encode(
            Op::Fallocate {
                fd: 3,
                mode: libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
                offset: 1 << 30,
                len: 1 << 20,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::Fallocate::CODE);
        // io_uring's fallocate: offset in off, length in addr, mode in len.
        assert_eq!((sqe.off(), sqe.addr()), (1 << 30, 1 << 20));
        assert_eq!(
            sqe.len(),
            (libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE) as u32
        );

        let buf = map();
        let (sqe, pins) = encode(
            Op::Read8 {
                fd: 11,
                buf: &buf,
                offset: 8,
            },
            &t,
        )
        .unwrap();
        assert_eq!(sqe.opcode(), opcode::Read::CODE);
        assert_eq!((sqe.fd(), sqe.addr(), sqe.len()), (11, buf.addr(8), 8));
        assert_eq!(pinned(&pins), vec![Arc::as_ptr(&buf)]);
        let past_end = Op::Read8 {
            fd: 11,
            buf: &buf,
            offset: 8190,
        };
        assert!(bad(encode(past_end, &t)));
    }

    #[test]
    fn a_timespec_is_seconds_then_nanoseconds() {
        let b = kernel_timespec(Duration::from_millis(1500));
        assert_eq!(&b[0..8], &1i64.to_ne_bytes());
        assert_eq!(&b[8..16], &500_000_000i64.to_ne_bytes());
        let b = kernel_timespec(Duration::from_nanos(1_000_000 << 3));
        assert_eq!(&b[0..8], &0i64.to_ne_bytes());
        assert_eq!(&b[8..16], &8_000_000i64.to_ne_bytes());
    }
}
