//! NVMe passthrough UAPI (`include/uapi/linux/nvme_ioctl.h`, Linux 7.3) and the few NVM command
//! set facts the NVMe backend needs: command layouts, opcodes, Identify offsets, and the two
//! ioctls used at open (namespace id, Identify). I/O itself goes through io_uring
//! (`NVME_URING_CMD_IO`), built here as the 80-byte SQE command area.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;

/// `_IO('N', 0x40)`: returns the namespace id of an ng/nvme namespace fd.
pub const NVME_IOCTL_ID: u64 = 0x4E40;
/// `_IOWR('N', 0x41, struct nvme_passthru_cmd)` (72 bytes).
pub const NVME_IOCTL_ADMIN_CMD: u64 = 0xC048_4E41;
/// `_IOWR('N', 0x43, struct nvme_passthru_cmd)`: one synchronous I/O command (used only
/// outside the I/O path: erasing a new window before its device appears).
pub const NVME_IOCTL_IO_CMD: u64 = 0xC048_4E43;
/// `_IOWR('N', 0x80, struct nvme_uring_cmd)`: an I/O command sent as IORING_OP_URING_CMD.
pub const NVME_URING_CMD_IO: u32 = 0xC048_4E80;

pub const OPC_FLUSH: u8 = 0x00;
pub const OPC_WRITE: u8 = 0x01;
pub const OPC_READ: u8 = 0x02;
pub const OPC_WRITE_ZEROES: u8 = 0x08;
pub const OPC_DSM: u8 = 0x09;
pub const OPC_ADMIN_IDENTIFY: u8 = 0x06;

/// cdw12 bit 30 of Read/Write/Write Zeroes: Force Unit Access.
pub const CDW12_FUA: u32 = 1 << 30;
/// cdw12 bit 25 of Write Zeroes: deallocate the blocks too (DEAC).
pub const CDW12_DEAC: u32 = 1 << 25;
/// Most ranges one Dataset Management command carries (NR is an 8-bit, 0-based field).
pub const MAX_DSM_RANGES: usize = 256;
/// cdw11 bit 2 of Dataset Management: deallocate the ranges.
pub const DSM_ATTR_DEALLOCATE: u32 = 1 << 2;
/// Largest block count one Read/Write/Write Zeroes carries (NLB is a 16-bit, 0-based field).
pub const MAX_NLB: u32 = 1 << 16;

/// Identify Controller: ONCS bits (optional NVM commands supported).
pub const ONCS_DSM: u16 = 1 << 2;
pub const ONCS_WRITE_ZEROES: u16 = 1 << 3;

/// `struct nvme_uring_cmd` / the first 72 bytes of `struct nvme_passthru_cmd` (whose `result`
/// follows at offset 68 in place of `rsvd2`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NvmeCmd {
    pub opcode: u8,
    pub flags: u8,
    pub rsvd1: u16,
    pub nsid: u32,
    pub cdw2: u32,
    pub cdw3: u32,
    pub metadata: u64,
    pub addr: u64,
    pub metadata_len: u32,
    pub data_len: u32,
    pub cdw10: u32,
    pub cdw11: u32,
    pub cdw12: u32,
    pub cdw13: u32,
    pub cdw14: u32,
    pub cdw15: u32,
    pub timeout_ms: u32,
    /// `rsvd2` in the uring form; `result` (written back) in the ioctl form.
    pub rsvd2: u32,
}

const _: () = assert!(size_of::<NvmeCmd>() == 72);

impl NvmeCmd {
    /// Read or Write of `blocks` blocks at `slba` (`addr`/`data_len` set by the caller).
    pub fn rw(opcode: u8, nsid: u32, slba: u64, blocks: u32, fua: bool) -> Self {
        Self {
            opcode,
            nsid,
            cdw10: slba as u32,
            cdw11: (slba >> 32) as u32,
            cdw12: (blocks.saturating_sub(1) & 0xffff) | if fua { CDW12_FUA } else { 0 },
            ..Default::default()
        }
    }

    /// The command as the SQE128 command area (`sqe->cmd`, 80 bytes).
    pub fn to_sqe_cmd(self) -> [u8; 80] {
        let mut b = [0u8; 80];
        b[0] = self.opcode;
        b[1] = self.flags;
        b[2..4].copy_from_slice(&self.rsvd1.to_ne_bytes());
        let words = [
            (4, self.nsid),
            (8, self.cdw2),
            (12, self.cdw3),
            (32, self.metadata_len),
            (36, self.data_len),
            (40, self.cdw10),
            (44, self.cdw11),
            (48, self.cdw12),
            (52, self.cdw13),
            (56, self.cdw14),
            (60, self.cdw15),
            (64, self.timeout_ms),
            (68, self.rsvd2),
        ];
        for (off, v) in words {
            b[off..off + 4].copy_from_slice(&v.to_ne_bytes());
        }
        b[16..24].copy_from_slice(&self.metadata.to_ne_bytes());
        b[24..32].copy_from_slice(&self.addr.to_ne_bytes());
        b
    }
}

/// One Dataset Management range (16 bytes): `blocks` is a 1-based count.
pub fn dsm_range(slba: u64, blocks: u32) -> [u8; 16] {
    let mut r = [0u8; 16];
    r[4..8].copy_from_slice(&blocks.to_le_bytes());
    r[8..16].copy_from_slice(&slba.to_le_bytes());
    r
}

/// The namespace id behind an ng (or nvme block) fd; ENOTTY for anything that is not NVMe.
pub fn namespace_id(file: &File) -> io::Result<u32> {
    // SAFETY: NVME_IOCTL_ID takes no argument and returns the id; it touches no user memory.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), NVME_IOCTL_ID as _) };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    u32::try_from(rc).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Runs Identify with `cns` for `nsid` through the admin ioctl; returns the 4096-byte page.
/// A positive NVMe status comes back as an `io::Error` of kind Other.
pub fn identify(file: &File, nsid: u32, cns: u32) -> io::Result<Box<[u8; 4096]>> {
    let mut page = Box::new([0u8; 4096]);
    let mut cmd = NvmeCmd {
        opcode: OPC_ADMIN_IDENTIFY,
        nsid,
        addr: page.as_mut_ptr() as u64,
        data_len: 4096,
        cdw10: cns,
        ..Default::default()
    };
    // SAFETY: the command points at `page`, 4096 writable bytes that outlive this synchronous
    // ioctl; the kernel writes at most data_len bytes there and the 72-byte command back.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            NVME_IOCTL_ADMIN_CMD as _,
            &mut cmd as *mut NvmeCmd,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if rc > 0 {
        return Err(io::Error::other(format!("NVMe status {rc:#x}")));
    }
    Ok(page)
}

/// Runs one I/O command synchronously through the I/O ioctl; `data` (when given) is the
/// command's buffer, read or written by the controller. A positive NVMe status comes back as an
/// `io::Error` of kind Other.
pub fn io_cmd(file: &File, mut cmd: NvmeCmd, data: Option<&mut [u8]>) -> io::Result<()> {
    if let Some(d) = data {
        cmd.addr = d.as_mut_ptr() as u64;
        cmd.data_len =
            u32::try_from(d.len()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    } else {
        cmd.addr = 0;
        cmd.data_len = 0;
    }
    // SAFETY: `cmd` is a valid 72-byte passthrough command; its `addr` is null with
    // `data_len` 0, or points at `data`, `data_len` bytes that are borrowed mutably for this
    // synchronous ioctl and so outlive it; the kernel writes only there and into `cmd`.
    let rc = unsafe {
        libc::ioctl(
            file.as_raw_fd(),
            NVME_IOCTL_IO_CMD as _,
            &mut cmd as *mut NvmeCmd,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    if rc > 0 {
        return Err(io::Error::other(format!("NVMe status {rc:#x}")));
    }
    Ok(())
}

/// What Identify Namespace says about a namespace's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NamespaceFormat {
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
    pub lba_shift: u8,
    /// Metadata bytes per block in the active format (the backend needs 0).
    pub metadata: u16,
    /// DLFEAT (byte 33): bits 2:0 say what a deallocated block reads as (1: zeroes), bit 3
    /// that Write Zeroes with DEAC deallocates.
    pub dlfeat: u8,
    /// NGUID (bytes 119:104): the namespace's globally unique id, all zeroes when not reported.
    pub nguid: [u8; 16],
    /// EUI-64 (bytes 127:120), all zeroes when not reported.
    pub eui64: [u8; 8],
}

impl NamespaceFormat {
    /// Deallocated blocks read as zeroes (DLFEAT bits 2:0 = 001b).
    pub fn deallocated_reads_zero(&self) -> bool {
        self.dlfeat & 0x7 == 1
    }

    /// Write Zeroes with DEAC set deallocates the blocks (DLFEAT bit 3).
    pub fn write_zeroes_deallocates(&self) -> bool {
        self.dlfeat & 0x8 != 0
    }
}

pub fn parse_identify_ns(page: &[u8; 4096]) -> NamespaceFormat {
    let u64_at = |o: usize| {
        let mut b = [0u8; 8];
        b.copy_from_slice(&page[o..o + 8]);
        u64::from_le_bytes(b)
    };
    let nlbaf = page[25];
    let flbas = page[26];
    let mut idx = usize::from(flbas & 0xf);
    if nlbaf >= 16 {
        idx |= usize::from((flbas >> 5) & 3) << 4;
    }
    let f = 128 + 4 * idx.min(63);
    NamespaceFormat {
        blocks: u64_at(0),
        lba_shift: page[f + 2],
        metadata: u16::from_le_bytes([page[f], page[f + 1]]),
        dlfeat: page[33],
        nguid: page[104..120].try_into().unwrap_or([0; 16]),
        eui64: page[120..128].try_into().unwrap_or([0; 8]),
    }
}

/// SUBNQN of Identify Controller (bytes 1023:768): the subsystem's NVMe Qualified Name, NUL
/// padded; empty when the controller reports none.
pub fn parse_subnqn(page: &[u8; 4096]) -> String {
    let field = &page[768..1024];
    let end = field.iter().position(|b| *b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).trim().to_owned()
}

/// What Identify Controller says that the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ControllerInfo {
    /// Maximum data transfer size as a power of two of the minimum page size (0: no limit).
    pub mdts: u8,
    pub oncs: u16,
    /// A volatile write cache is present (Flush matters).
    pub volatile_cache: bool,
}

pub fn parse_identify_ctrl(page: &[u8; 4096]) -> ControllerInfo {
    ControllerInfo {
        mdts: page[77],
        oncs: u16::from_le_bytes([page[520], page[521]]),
        volatile_cache: page[525] & 1 != 0,
    }
}

/// Turns a passthrough completion's `res` into the errno a ublk request completes with:
/// negative values are already errnos; positive ones are NVMe status (SCT bits 10:8, SC 7:0).
pub fn status_to_errno(res: i32) -> i32 {
    if res <= 0 {
        return res;
    }
    let sct = (res >> 8) & 0x7;
    let sc = res & 0xff;
    match (sct, sc) {
        // Invalid Command Opcode / Invalid Field: the device cannot do this.
        (0, 0x01) => -libc::EOPNOTSUPP,
        // Capacity Exceeded.
        (0, 0x81) => -libc::ENOSPC,
        _ => -libc::EIO,
    }
}

/// Do Not Retry, in the status the kernel returns for a passthrough command (the NVMe status
/// field shifted right by one: SC bits 0-7, SCT 8-10, CRD 11-12, More 13, DNR 14).
const STATUS_DNR: i32 = 1 << 14;

/// Whether a passthrough completion failed for a passing reason. Passthrough commands are
/// FAILFAST in the kernel, so what its block layer would retry comes back to us: an
/// interrupted or refused submission (-EINTR, -EAGAIN, -ETIMEDOUT, -ENOLINK, -EBUSY: a
/// controller resetting or a path going away), and, with DNR clear, a path-related status
/// (SCT 3, host aborts included), Namespace Not Ready or Command Abort Requested.
pub fn is_retryable(res: i32) -> bool {
    if res < 0 {
        return matches!(
            -res,
            libc::EINTR | libc::EAGAIN | libc::ETIMEDOUT | libc::ENOLINK | libc::EBUSY
        );
    }
    if res == 0 || res & STATUS_DNR != 0 {
        return false;
    }
    let sct = (res >> 8) & 0x7;
    let sc = res & 0xff;
    sct == 3 || (sct == 0 && matches!(sc, 0x82 | 0x07))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn command_bytes_follow_the_uapi_layout() {
        let mut c = NvmeCmd::rw(OPC_WRITE, 1, 0x1_0000_0002, 8, true);
        c.addr = 0xdead_beef;
        c.data_len = 4096;
        let b = c.to_sqe_cmd();
        assert_eq!(b[0], OPC_WRITE);
        assert_eq!(&b[4..8], &1u32.to_ne_bytes());
        assert_eq!(&b[24..32], &0xdead_beefu64.to_ne_bytes());
        assert_eq!(&b[36..40], &4096u32.to_ne_bytes());
        assert_eq!(&b[40..44], &2u32.to_ne_bytes(), "SLBA low");
        assert_eq!(&b[44..48], &1u32.to_ne_bytes(), "SLBA high");
        assert_eq!(
            &b[48..52],
            &(7 | CDW12_FUA).to_ne_bytes(),
            "0-based NLB + FUA"
        );
        assert!(b[72..].iter().all(|&x| x == 0));
    }

    #[test]
    fn identify_pages_decode() {
        let mut ns = [0u8; 4096];
        ns[0..8].copy_from_slice(&1000u64.to_le_bytes());
        ns[25] = 1; // two formats
        ns[26] = 1; // format 1 in use
        ns[128 + 4 + 2] = 12;
        ns[33] = 0x9; // DLFEAT: deallocated blocks read zeroes, Write Zeroes can deallocate
        let f = parse_identify_ns(&ns);
        assert_eq!((f.blocks, f.lba_shift, f.metadata), (1000, 12, 0));
        assert!(f.deallocated_reads_zero() && f.write_zeroes_deallocates());
        ns[33] = 0x2; // deallocated blocks read as ones: no deallocate instead of zeroing
        let f = parse_identify_ns(&ns);
        assert!(!f.deallocated_reads_zero() && !f.write_zeroes_deallocates());
        let mut ctrl = [0u8; 4096];
        ctrl[77] = 7;
        ctrl[520] = (ONCS_DSM | ONCS_WRITE_ZEROES) as u8;
        ctrl[525] = 1;
        let c = parse_identify_ctrl(&ctrl);
        assert_eq!(c.mdts, 7);
        assert_eq!(c.oncs, ONCS_DSM | ONCS_WRITE_ZEROES);
        assert!(c.volatile_cache);
    }

    #[test]
    fn path_errors_and_resets_are_retryable_unless_dnr() {
        assert!(is_retryable(-libc::EINTR));
        assert!(is_retryable(-libc::EAGAIN));
        assert!(!is_retryable(-libc::EIO));
        assert!(!is_retryable(0));
        assert!(is_retryable(0x371), "host aborted command (SCT 3)");
        assert!(is_retryable(0x300), "internal path error");
        assert!(!is_retryable(0x371 | STATUS_DNR), "DNR set");
        assert!(is_retryable(0x82), "namespace not ready");
        assert!(!is_retryable(0x80), "LBA out of range");
        assert!(!is_retryable(0x281), "media error");
    }

    #[test]
    fn nvme_status_becomes_an_errno() {
        assert_eq!(status_to_errno(0), 0);
        assert_eq!(status_to_errno(-libc::EINTR), -libc::EINTR);
        assert_eq!(status_to_errno(0x80), -libc::EIO, "LBA out of range");
        assert_eq!(status_to_errno(0x81), -libc::ENOSPC);
        assert_eq!(status_to_errno(0x01), -libc::EOPNOTSUPP);
        assert_eq!(status_to_errno(0x281), -libc::EIO, "media error");
        let r = dsm_range(5, 3);
        assert_eq!(&r[4..8], &3u32.to_le_bytes());
        assert_eq!(&r[8..16], &5u64.to_le_bytes());
    }
}
