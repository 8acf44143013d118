//! Fields of the kernel's 128-byte SQE that the io-uring crate cannot set for `uring_cmd`, set
//! on the bytes directly.

use crate::sys::{ublk_batch_io, ublksrv_io_cmd};
use io_uring::squeue;

pub(super) const IORING_URING_CMD_MULTISHOT: u32 = 1 << 1;
/// Byte offsets inside an SQE.
pub(super) const SQE_LEN: usize = 24;
pub(super) const SQE_OP_FLAGS: usize = 28;
pub(super) const SQE_BUF_GROUP: usize = 40;
pub(super) const SQE_FLAGS: usize = 1;
pub(super) const SQE_FD: usize = 4;
pub(super) const IOSQE_FIXED_FILE: u8 = 1;

pub(super) fn io_cmd_bytes(c: &ublksrv_io_cmd) -> [u8; 80] {
    let mut b = [0u8; 80];
    b[0..2].copy_from_slice(&c.q_id.to_ne_bytes());
    b[2..4].copy_from_slice(&c.tag.to_ne_bytes());
    b[4..8].copy_from_slice(&c.result.to_ne_bytes());
    b[8..16].copy_from_slice(&c.addr.to_ne_bytes());
    b
}

pub(super) fn batch_cmd_bytes(c: &ublk_batch_io) -> [u8; 80] {
    let mut b = [0u8; 80];
    b[0..2].copy_from_slice(&c.q_id.to_ne_bytes());
    b[2..4].copy_from_slice(&c.flags.to_ne_bytes());
    b[4..6].copy_from_slice(&c.nr_elem.to_ne_bytes());
    b[6] = c.elem_bytes;
    b
}

/// `e` addressing registered file `slot` instead of its descriptor.
pub(super) fn use_fixed_file(e: squeue::Entry128, slot: u32) -> squeue::Entry128 {
    // SAFETY: as in `patch_sqe`: a byte view of the kernel's SQE layout and back.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[SQE_FLAGS] |= IOSQE_FIXED_FILE;
    raw[SQE_FD..SQE_FD + 4].copy_from_slice(&slot.to_ne_bytes());
    // SAFETY: as above; flags and fd are plain integers there.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// Sets the uring_cmd fields the io-uring crate cannot: `uring_cmd_flags` bits (multishot), the
/// buffer group, and the SQE `len` (batch element buffer size).
pub(super) fn patch_sqe(
    e: squeue::Entry128,
    cmd_flags: u32,
    group: Option<u16>,
    len: Option<u32>,
) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is a repr(C) wrapper of the kernel's 64-byte io_uring_sqe plus the 64-byte
    // command tail; every bit pattern is a valid byte array and back.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    let mut word = [0u8; 4];
    word.copy_from_slice(&raw[SQE_OP_FLAGS..SQE_OP_FLAGS + 4]);
    let flags = u32::from_ne_bytes(word) | cmd_flags;
    raw[SQE_OP_FLAGS..SQE_OP_FLAGS + 4].copy_from_slice(&flags.to_ne_bytes());
    if let Some(g) = group {
        raw[SQE_BUF_GROUP..SQE_BUF_GROUP + 2].copy_from_slice(&g.to_ne_bytes());
    }
    if let Some(l) = len {
        raw[SQE_LEN..SQE_LEN + 4].copy_from_slice(&l.to_ne_bytes());
    }
    // SAFETY: as above; the patched fields are plain integers in the kernel's SQE layout.
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// The 128 bytes of `e`, as the kernel will read them.
#[cfg(test)]
pub(super) fn sqe_bytes(e: squeue::Entry128) -> [u8; 128] {
    // SAFETY: as in `patch_sqe`: a byte view of the kernel's SQE layout.
    unsafe { std::mem::transmute(e) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use io_uring::{opcode, types};

    #[test]
    fn patch_sets_flags_group_and_len_only() {
        let e = opcode::UringCmd80::new(types::Fd(3), 0xc010_7527)
            .addr(Some(0))
            .build()
            .user_data(7);
        // SAFETY: test-only view of the bytes, see `multishot`.
        let before: [u8; 128] = unsafe { std::mem::transmute(e.clone()) };
        // SAFETY: as above.
        let after: [u8; 128] = unsafe {
            std::mem::transmute(patch_sqe(
                e,
                IORING_URING_CMD_MULTISHOT,
                Some(9),
                Some(0x40),
            ))
        };
        assert_eq!(after[SQE_OP_FLAGS] & 2, 2);
        assert_eq!(
            &after[SQE_BUF_GROUP..SQE_BUF_GROUP + 2],
            &9u16.to_ne_bytes()
        );
        assert_eq!(&after[SQE_LEN..SQE_LEN + 4], &0x40u32.to_ne_bytes());
        let changed: Vec<usize> = (0..128).filter(|&i| before[i] != after[i]).collect();
        assert!(changed
            .iter()
            .all(|&i| i == SQE_OP_FLAGS || i == SQE_BUF_GROUP || i == SQE_LEN));
    }
}
