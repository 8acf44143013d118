//! Kernel UAPI for ublk: command encodings, flag bits and `#[repr(C)]` structure layouts,
//! transcribed from `include/uapi/linux/ublk_cmd.h` (Linux 7.3).
//!
//! Kernel spellings live here and nowhere else; the rest of the crate uses Rust names.
//! Layout tests at the bottom pin every structure's size to the header's.

#![allow(non_camel_case_types)]

pub mod nvme;
pub mod os;

/// `_IOC` direction bits.
const IOC_WRITE: u32 = 1;
const IOC_READ: u32 = 2;

/// The kernel's `_IOC(dir, type, nr, size)`.
const fn ioc(dir: u32, ty: u8, nr: u8, size: usize) -> u32 {
    (dir << 30) | ((size as u32) << 16) | ((ty as u32) << 8) | nr as u32
}

const fn ior<T>(nr: u8) -> u32 {
    ioc(IOC_READ, b'u', nr, size_of::<T>())
}

const fn iowr<T>(nr: u8) -> u32 {
    ioc(IOC_READ | IOC_WRITE, b'u', nr, size_of::<T>())
}

// Control commands, issued as IORING_OP_URING_CMD on /dev/ublk-control.
pub const UBLK_U_CMD_GET_QUEUE_AFFINITY: u32 = ior::<ublksrv_ctrl_cmd>(0x01);
pub const UBLK_U_CMD_GET_DEV_INFO: u32 = ior::<ublksrv_ctrl_cmd>(0x02);
pub const UBLK_U_CMD_ADD_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(0x04);
pub const UBLK_U_CMD_DEL_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(0x05);
pub const UBLK_U_CMD_START_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(0x06);
pub const UBLK_U_CMD_STOP_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(0x07);
pub const UBLK_U_CMD_SET_PARAMS: u32 = iowr::<ublksrv_ctrl_cmd>(0x08);
pub const UBLK_U_CMD_GET_PARAMS: u32 = ior::<ublksrv_ctrl_cmd>(0x09);
pub const UBLK_U_CMD_START_USER_RECOVERY: u32 = iowr::<ublksrv_ctrl_cmd>(0x10);
pub const UBLK_U_CMD_END_USER_RECOVERY: u32 = iowr::<ublksrv_ctrl_cmd>(0x11);
pub const UBLK_U_CMD_GET_FEATURES: u32 = ior::<ublksrv_ctrl_cmd>(0x13);
pub const UBLK_U_CMD_DEL_DEV_ASYNC: u32 = ior::<ublksrv_ctrl_cmd>(0x14);
pub const UBLK_U_CMD_UPDATE_SIZE: u32 = iowr::<ublksrv_ctrl_cmd>(0x15);
pub const UBLK_U_CMD_QUIESCE_DEV: u32 = iowr::<ublksrv_ctrl_cmd>(0x16);

// Per-IO commands, issued on /dev/ublkcN.
pub const UBLK_U_IO_FETCH_REQ: u32 = iowr::<ublksrv_io_cmd>(0x20);
pub const UBLK_U_IO_COMMIT_AND_FETCH_REQ: u32 = iowr::<ublksrv_io_cmd>(0x21);
// Batch commands (UBLK_F_BATCH_IO), issued on /dev/ublkcN.
pub const UBLK_U_IO_PREP_IO_CMDS: u32 = iowr::<ublk_batch_io>(0x25);
pub const UBLK_U_IO_COMMIT_IO_CMDS: u32 = iowr::<ublk_batch_io>(0x26);
pub const UBLK_U_IO_FETCH_IO_CMDS: u32 = iowr::<ublk_batch_io>(0x27);

pub const UBLK_FEATURES_LEN: u16 = 8;
pub const UBLK_IO_RES_OK: i32 = 0;
pub const UBLK_IO_RES_ABORT: i32 = -libc::ENODEV;
pub const UBLKSRV_CMD_BUF_OFFSET: i64 = 0;
pub const UBLKSRV_IO_BUF_OFFSET: i64 = 0x8000_0000;
/// User-copy offsets: `UBLKSRV_IO_BUF_OFFSET + (q_id << UBLK_QID_OFF) + (tag << UBLK_TAG_OFF)`.
pub const UBLK_TAG_OFF: u32 = 25;
pub const UBLK_QID_OFF: u32 = 41;

/// The `sqe->addr` word of `struct ublk_auto_buf_reg { index, flags, reserved }`.
pub const fn auto_buf_reg(index: u16, flags: u8) -> u64 {
    index as u64 | (flags as u64) << 16
}

/// Offset on `/dev/ublkcN` of tag `tag`'s request data in queue `q_id` (UBLK_F_USER_COPY).
pub const fn user_copy_offset(q_id: u16, tag: u16) -> u64 {
    UBLKSRV_IO_BUF_OFFSET as u64 + ((q_id as u64) << UBLK_QID_OFF) + ((tag as u64) << UBLK_TAG_OFF)
}
pub const UBLK_MAX_QUEUE_DEPTH: u16 = 4096;
pub const UBLK_MAX_NR_QUEUES: u16 = 1 << 12;

// Feature flags (ublksrv_ctrl_dev_info.flags and the GET_FEATURES mask).
pub const UBLK_F_SUPPORT_ZERO_COPY: u64 = 1 << 0;
pub const UBLK_F_URING_CMD_COMP_IN_TASK: u64 = 1 << 1;
pub const UBLK_F_NEED_GET_DATA: u64 = 1 << 2;
pub const UBLK_F_USER_RECOVERY: u64 = 1 << 3;
pub const UBLK_F_USER_RECOVERY_REISSUE: u64 = 1 << 4;
pub const UBLK_F_UNPRIVILEGED_DEV: u64 = 1 << 5;
pub const UBLK_F_CMD_IOCTL_ENCODE: u64 = 1 << 6;
pub const UBLK_F_USER_COPY: u64 = 1 << 7;
pub const UBLK_F_ZONED: u64 = 1 << 8;
pub const UBLK_F_USER_RECOVERY_FAIL_IO: u64 = 1 << 9;
pub const UBLK_F_UPDATE_SIZE: u64 = 1 << 10;
pub const UBLK_F_AUTO_BUF_REG: u64 = 1 << 11;
pub const UBLK_F_QUIESCE: u64 = 1 << 12;
pub const UBLK_F_PER_IO_DAEMON: u64 = 1 << 13;
pub const UBLK_F_BUF_REG_OFF_DAEMON: u64 = 1 << 14;
pub const UBLK_F_BATCH_IO: u64 = 1 << 15;
pub const UBLK_F_INTEGRITY: u64 = 1 << 16;
pub const UBLK_F_SAFE_STOP_DEV: u64 = 1 << 17;
pub const UBLK_F_NO_AUTO_PART_SCAN: u64 = 1 << 18;
pub const UBLK_F_SHMEM_ZC: u64 = 1 << 19;
pub const UBLK_F_IO_DESC_SIZE: u64 = 1 << 20;

// Device states (ublksrv_ctrl_dev_info.state).
pub const UBLK_S_DEV_DEAD: u16 = 0;
pub const UBLK_S_DEV_LIVE: u16 = 1;
pub const UBLK_S_DEV_QUIESCED: u16 = 2;
pub const UBLK_S_DEV_FAIL_IO: u16 = 3;

// Request operations (low 8 bits of ublksrv_io_desc.op_flags) and flags.
pub const UBLK_IO_OP_READ: u8 = 0;
pub const UBLK_IO_OP_WRITE: u8 = 1;
pub const UBLK_IO_OP_FLUSH: u8 = 2;
pub const UBLK_IO_OP_DISCARD: u8 = 3;
pub const UBLK_IO_OP_WRITE_ZEROES: u8 = 5;
pub const UBLK_IO_F_FUA: u32 = 1 << 13;
pub const UBLK_IO_F_NOUNMAP: u32 = 1 << 15;
pub const UBLK_IO_F_NEED_REG_BUF: u32 = 1 << 17;

pub const UBLK_AUTO_BUF_REG_FALLBACK: u8 = 1 << 0;

pub const UBLK_BATCH_F_HAS_BUF_ADDR: u16 = 1 << 1;
pub const UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK: u16 = 1 << 2;

// Parameter groups (ublk_params.types) and block attributes.
pub const UBLK_PARAM_TYPE_BASIC: u32 = 1 << 0;
pub const UBLK_PARAM_TYPE_DISCARD: u32 = 1 << 1;
pub const UBLK_ATTR_VOLATILE_CACHE: u32 = 1 << 2;
pub const UBLK_ATTR_FUA: u32 = 1 << 3;

/// Payload of every control command (lives in the SQE's 80-byte command area).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublksrv_ctrl_cmd {
    pub dev_id: u32,
    pub queue_id: u16,
    pub len: u16,
    pub addr: u64,
    pub data: [u64; 1],
    pub dev_path_len: u16,
    pub pad: u16,
    pub reserved: u32,
}

/// Device description exchanged by ADD_DEV and GET_DEV_INFO.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublksrv_ctrl_dev_info {
    pub nr_hw_queues: u16,
    pub queue_depth: u16,
    pub state: u16,
    pub io_desc_size: u16,
    pub max_io_buf_bytes: u32,
    pub dev_id: u32,
    pub ublksrv_pid: i32,
    pub pad1: u32,
    pub flags: u64,
    pub ublksrv_flags: u64,
    pub owner_uid: u32,
    pub owner_gid: u32,
    pub reserved1: u64,
    pub reserved2: u64,
}

/// One request as the kernel describes it in the queue's mmap'ed descriptor array.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublksrv_io_desc {
    pub op_flags: u32,
    pub nr_sectors: u32,
    pub start_sector: u64,
    pub addr: u64,
}

/// Payload of the per-IO commands (FETCH_REQ, COMMIT_AND_FETCH_REQ, ...).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublksrv_io_cmd {
    pub q_id: u16,
    pub tag: u16,
    pub result: i32,
    pub addr: u64,
}

/// Payload of the batch commands (PREP_IO_CMDS, COMMIT_IO_CMDS, FETCH_IO_CMDS).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_batch_io {
    pub q_id: u16,
    pub flags: u16,
    pub nr_elem: u16,
    pub elem_bytes: u8,
    pub reserved: u8,
    pub reserved2: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_basic {
    pub attrs: u32,
    pub logical_bs_shift: u8,
    pub physical_bs_shift: u8,
    pub io_opt_shift: u8,
    pub io_min_shift: u8,
    pub max_sectors: u32,
    pub chunk_sectors: u32,
    pub dev_sectors: u64,
    pub virt_boundary_mask: u64,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_discard {
    pub discard_alignment: u32,
    pub discard_granularity: u32,
    pub max_discard_sectors: u32,
    pub max_write_zeroes_sectors: u32,
    pub max_discard_segments: u16,
    pub reserved0: u16,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_devt {
    pub char_major: u32,
    pub char_minor: u32,
    pub disk_major: u32,
    pub disk_minor: u32,
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_zoned {
    pub max_open_zones: u32,
    pub max_active_zones: u32,
    pub max_zone_append_sectors: u32,
    pub reserved: [u8; 20],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_dma_align {
    pub alignment: u32,
    pub pad: [u8; 4],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_segment {
    pub seg_boundary_mask: u64,
    pub max_segment_size: u32,
    pub max_segments: u16,
    pub pad: [u8; 2],
}

#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_param_integrity {
    pub flags: u32,
    pub max_integrity_segments: u16,
    pub interval_exp: u8,
    pub metadata_size: u8,
    pub pi_offset: u8,
    pub csum_type: u8,
    pub tag_size: u8,
    pub pad: [u8; 5],
}

/// All parameter groups; `len` must hold the structure's size and `types` which groups are valid.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ublk_params {
    pub len: u32,
    pub types: u32,
    pub basic: ublk_param_basic,
    pub discard: ublk_param_discard,
    pub devt: ublk_param_devt,
    pub zoned: ublk_param_zoned,
    pub dma: ublk_param_dma_align,
    /// Explicit form of the C compiler's padding before `seg` (8-byte aligned), so the struct
    /// has no implicit padding and can be copied as bytes.
    pub _pad0: u32,
    pub seg: ublk_param_segment,
    pub integrity: ublk_param_integrity,
}

/// Structures made only of integers and explicit padding: any bit pattern is valid and they
/// have no implicit padding, so they can be copied to and from kernel byte buffers.
///
/// # Safety
/// Implement only for `#[repr(C)]` structs of integer fields without implicit padding.
pub unsafe trait Pod: Copy + Default {}
// SAFETY: integer-only repr(C) structs; sizes pinned by the layout tests below.
unsafe impl Pod for ublksrv_ctrl_dev_info {}
// SAFETY: as above (the padding before `seg` is the explicit `_pad0`).
unsafe impl Pod for ublk_params {}
// SAFETY: as above.
unsafe impl Pod for ublksrv_io_desc {}

/// `v` as a heap byte buffer for the kernel.
pub fn to_bytes<T: Pod>(v: &T) -> Box<[u8]> {
    let mut b = vec![0u8; size_of::<T>()].into_boxed_slice();
    // SAFETY: `b` holds exactly size_of::<T>() bytes; T is Pod (no padding, any bytes valid).
    unsafe { std::ptr::write_unaligned(b.as_mut_ptr().cast::<T>(), *v) };
    b
}

/// A `T` read from the start of `b`, or None when `b` is too short.
pub fn from_bytes<T: Pod>(b: &[u8]) -> Option<T> {
    if b.len() < size_of::<T>() {
        return None;
    }
    // SAFETY: length checked; T is Pod, so any bytes form a valid value.
    Some(unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) })
}

impl ublksrv_ctrl_cmd {
    /// The command as the bytes of an SQE128's 80-byte command area (native endian, zero padded).
    pub fn to_sqe_cmd(self) -> [u8; 80] {
        let mut out = [0u8; 80];
        out[0..4].copy_from_slice(&self.dev_id.to_ne_bytes());
        out[4..6].copy_from_slice(&self.queue_id.to_ne_bytes());
        out[6..8].copy_from_slice(&self.len.to_ne_bytes());
        out[8..16].copy_from_slice(&self.addr.to_ne_bytes());
        out[16..24].copy_from_slice(&self.data[0].to_ne_bytes());
        out[24..26].copy_from_slice(&self.dev_path_len.to_ne_bytes());
        out[26..28].copy_from_slice(&self.pad.to_ne_bytes());
        out[28..32].copy_from_slice(&self.reserved.to_ne_bytes());
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use core::mem::size_of;

    #[test]
    fn struct_sizes_match_the_uapi_header() {
        assert_eq!(size_of::<ublksrv_ctrl_cmd>(), 32);
        assert_eq!(size_of::<ublksrv_ctrl_dev_info>(), 64);
        assert_eq!(size_of::<ublksrv_io_desc>(), 24);
        assert_eq!(size_of::<ublksrv_io_cmd>(), 16);
        assert_eq!(size_of::<ublk_batch_io>(), 16);
        assert_eq!(size_of::<ublk_param_basic>(), 32);
        assert_eq!(size_of::<ublk_param_discard>(), 20);
        assert_eq!(size_of::<ublk_param_zoned>(), 32);
        assert_eq!(size_of::<ublk_param_segment>(), 16);
        assert_eq!(size_of::<ublk_param_integrity>(), 16);
        // 148 bytes of fields; `seg` starts on an 8-byte boundary (u64), as in C: 4 bytes of padding.
        assert_eq!(size_of::<ublk_params>(), 152);
        assert_eq!(core::mem::offset_of!(ublk_params, seg), 120);
    }

    #[test]
    fn ctrl_cmd_bytes_follow_the_struct_layout() {
        let cmd = ublksrv_ctrl_cmd {
            dev_id: u32::MAX,
            queue_id: 0xabcd,
            len: 8,
            addr: 0x1122_3344_5566_7788,
            data: [42],
            ..Default::default()
        };
        let b = cmd.to_sqe_cmd();
        assert_eq!(&b[0..4], &u32::MAX.to_ne_bytes());
        assert_eq!(&b[4..6], &0xabcdu16.to_ne_bytes());
        assert_eq!(&b[8..16], &0x1122_3344_5566_7788u64.to_ne_bytes());
        assert_eq!(&b[16..24], &42u64.to_ne_bytes());
        assert!(b[32..].iter().all(|&x| x == 0));
    }

    #[test]
    fn pod_round_trips_through_bytes() {
        let p = ublk_params {
            len: size_of::<ublk_params>() as u32,
            types: UBLK_PARAM_TYPE_BASIC,
            basic: ublk_param_basic {
                dev_sectors: 12345,
                ..Default::default()
            },
            ..Default::default()
        };
        let b = to_bytes(&p);
        assert_eq!(b.len(), 152);
        assert_eq!(&b[0..4], &152u32.to_ne_bytes());
        let back: ublk_params = from_bytes(&b).unwrap();
        assert_eq!(back.basic.dev_sectors, 12345);
        assert!(from_bytes::<ublk_params>(&b[..10]).is_none());
    }

    #[test]
    fn command_encodings_match_the_kernel() {
        assert_eq!(UBLK_U_CMD_GET_FEATURES, 0x8020_7513);
        assert_eq!(UBLK_U_CMD_ADD_DEV, 0xc020_7504);
        assert_eq!(UBLK_U_CMD_DEL_DEV_ASYNC, 0x8020_7514);
        assert_eq!(UBLK_U_IO_FETCH_REQ, 0xc010_7520);
        assert_eq!(UBLK_U_IO_COMMIT_AND_FETCH_REQ, 0xc010_7521);
        assert_eq!(UBLK_U_IO_PREP_IO_CMDS, 0xc010_7525);
        assert_eq!(UBLK_U_IO_FETCH_IO_CMDS, 0xc010_7527);
    }
}
