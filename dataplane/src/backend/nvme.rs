//! The NVMe backend: a namespace (or an LBA window of one) driven with NVMe passthrough
//! (`NVME_URING_CMD_IO` on `/dev/ngXnY`) from the worker's ring, with no block layer or file
//! system in between.
//!
//! READ and WRITE become NVMe Read and Write (FUA as the FUA bit), FLUSH a Flush (only when the
//! controller has a volatile write cache), DISCARD a Dataset Management deallocate of one range,
//! WRITE_ZEROES a Write Zeroes. Data moves through the queue's registered buffers (copy mode) or
//! straight through the request's pages the kernel registered (zero copy). Completions carry
//! NVMe status, turned into an errno here.

use super::namespace_id::NamespaceIdentity;
use super::{
    full, Backend, BackendError, Claim, Data, Erase, Growth, IoCtx, Limits, Request, Started,
};
use crate::ring::{NvmeData, Op, Region};
use crate::stats::OpKind;
use crate::sys::nvme::{self, NvmeCmd};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileTypeExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A byte range of a namespace: `len` bytes from `offset` (0: to the end of the namespace).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    pub offset: u64,
    pub len: u64,
}

#[derive(Debug)]
pub struct NvmeBackend {
    file: File,
    path: PathBuf,
    rdev: u64,
    nsid: u32,
    lba_shift: u32,
    /// First block and length in bytes of the volume's window.
    start_lba: u64,
    /// Bytes of the namespace the volume may use; grows with the volume (`resize`).
    window_len: AtomicU64,
    /// The namespace's size, which a growing window must stay inside.
    ns_bytes: u64,
    unchecked: bool,
    /// Serve earlier content as it is (no erase at creation or growth).
    keep_data: bool,
    ns: nvme::NamespaceFormat,
    controller: nvme::ControllerInfo,
    max_io_bytes: u32,
    poll_queues: bool,
}

impl NvmeBackend {
    pub fn open(
        path: &Path,
        window: Option<Window>,
        size: u64,
        block_size: u32,
        unchecked: bool,
        keep_data: bool,
    ) -> Result<Self, BackendError> {
        let (file, nsid, ns, rdev) = open_namespace(path)?;
        let identify_err = |source| BackendError::Identify {
            path: path.to_owned(),
            source,
        };
        let controller =
            nvme::parse_identify_ctrl(&*nvme::identify(&file, 0, 1).map_err(identify_err)?);
        if ns.metadata != 0 {
            return Err(BackendError::NvmeMetadata {
                path: path.to_owned(),
                metadata: ns.metadata,
            });
        }
        if !(9..=12).contains(&ns.lba_shift) {
            return Err(identify_err(std::io::Error::other(format!(
                "unsupported block size 2^{}",
                ns.lba_shift
            ))));
        }
        let lba = 1u32 << ns.lba_shift;
        if block_size < lba {
            return Err(BackendError::BlockSmallerThanLba {
                path: path.to_owned(),
                block_size,
                lba,
            });
        }
        let ns_bytes = ns.blocks << ns.lba_shift;
        let w = match window {
            None => Window {
                offset: 0,
                len: ns_bytes,
            },
            // Length 0: to the end of the namespace.
            Some(w) if w.len == 0 => Window {
                offset: w.offset,
                len: ns_bytes.saturating_sub(w.offset),
            },
            Some(w) => w,
        };
        if !unchecked && w.offset >= ns_bytes {
            // Nothing of the namespace is left at that offset (a window "to the end" included).
            return Err(BackendError::WindowPastEnd {
                path: path.to_owned(),
                offset: w.offset,
                len: w.len,
                size: ns_bytes,
            });
        }
        let mask = u64::from(lba) - 1;
        if w.offset & mask != 0 || w.len & mask != 0 || w.len == 0 {
            return Err(BackendError::WindowUnaligned {
                path: path.to_owned(),
                offset: w.offset,
                len: w.len,
                lba,
            });
        }
        if !unchecked && w.offset.checked_add(w.len).is_none_or(|end| end > ns_bytes) {
            return Err(BackendError::WindowPastEnd {
                path: path.to_owned(),
                offset: w.offset,
                len: w.len,
                size: ns_bytes,
            });
        }
        if w.len < size {
            return Err(BackendError::TooSmall {
                path: path.to_owned(),
                have: w.len,
                need: size,
            });
        }
        let sysfs = namespace_sysfs(Path::new("/sys"), path, nsid);
        // MDTS counts pages of the controller's minimum page size, 4 KiB on every controller
        // Linux drives; the kernel's own limit for the namespace (when it has a block device)
        // can be lower still. Passthrough is never split, so volumes must not exceed either.
        let mdts_bytes = match controller.mdts {
            0 => u64::MAX,
            m => 4096u64 << m.min(20),
        };
        let sysfs_bytes = sysfs
            .as_ref()
            .and_then(|d| read_sysfs_u64(&d.join("queue/max_hw_sectors_kb")))
            .map_or(u64::MAX, |kb| kb * 1024);
        let max_io_bytes = mdts_bytes.min(sysfs_bytes).min(1 << 25) as u32 & !4095;
        let poll_queues = sysfs
            .as_ref()
            .and_then(|d| read_sysfs_u64(&d.join("queue/io_poll")))
            == Some(1);
        Ok(Self {
            rdev,
            file,
            path: path.to_owned(),
            nsid,
            lba_shift: u32::from(ns.lba_shift),
            start_lba: w.offset >> ns.lba_shift,
            window_len: AtomicU64::new(w.len),
            ns_bytes,
            unchecked,
            keep_data,
            ns,
            controller,
            max_io_bytes: max_io_bytes.max(4096),
            poll_queues,
        })
    }

    fn has(&self, oncs_bit: u16) -> bool {
        self.controller.oncs & oncs_bit != 0
    }

    /// Makes `len` bytes of the namespace at byte `offset` read as zeroes: Write Zeroes (with
    /// DEAC where that deallocates, so nothing is written on controllers that thin-provision),
    /// which the spec guarantees reads back zeroes; else Dataset Management deallocate where
    /// Identify says deallocated blocks read as zeroes; else refused. Synchronous, before the
    /// range is served: on the control thread for a resize's growth, on the server's blocking
    /// pool for a window (`erase_window`).
    fn erase_range(&self, offset: u64, len: u64) -> Result<Erase, BackendError> {
        let failed = |source| BackendError::EraseFailed {
            path: self.path.clone(),
            offset,
            len,
            source,
        };
        let mut slba = offset >> self.lba_shift;
        let mut left = len >> self.lba_shift;
        if self.has(nvme::ONCS_WRITE_ZEROES) {
            let deallocate = self.ns.write_zeroes_deallocates();
            while left > 0 {
                let n = left.min(u64::from(nvme::MAX_NLB)) as u32;
                let mut cmd = nvme::NvmeCmd::rw(nvme::OPC_WRITE_ZEROES, self.nsid, slba, n, false);
                if deallocate {
                    cmd.cdw12 |= nvme::CDW12_DEAC;
                }
                nvme::io_cmd(&self.file, cmd, None).map_err(failed)?;
                slba += u64::from(n);
                left -= u64::from(n);
            }
            return Ok(Erase::WriteZeroes { deallocate });
        }
        if self.has(nvme::ONCS_DSM) && self.ns.deallocated_reads_zero() {
            while left > 0 {
                let mut ranges = Vec::with_capacity(nvme::MAX_DSM_RANGES * 16);
                while left > 0 && ranges.len() < nvme::MAX_DSM_RANGES * 16 {
                    let n = left.min(u64::from(u32::MAX)) as u32;
                    ranges.extend_from_slice(&nvme::dsm_range(slba, n));
                    slba += u64::from(n);
                    left -= u64::from(n);
                }
                let nr = (ranges.len() / 16) as u32;
                let cmd = nvme::NvmeCmd {
                    opcode: nvme::OPC_DSM,
                    nsid: self.nsid,
                    cdw10: nr - 1,
                    cdw11: nvme::DSM_ATTR_DEALLOCATE,
                    ..Default::default()
                };
                nvme::io_cmd(&self.file, cmd, Some(&mut ranges)).map_err(failed)?;
            }
            return Ok(Erase::Deallocate);
        }
        Err(BackendError::CannotErase {
            path: self.path.clone(),
            offset,
            len,
        })
    }
}

/// A namespace as NVMe Identify describes it: its size, logical block size and identity.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Namespace {
    pub size_bytes: u64,
    pub block_size: u32,
    /// None when the controller reports no NGUID, EUI-64 or subsystem NQN.
    pub identity: Option<NamespaceIdentity>,
}

/// Identifies the namespace behind generic char device `path` (`/dev/ngXnY`) without serving it:
/// what a control plane needs to tell how much of it is free, and which namespace it is.
pub fn identify_namespace(path: &Path) -> Result<Namespace, BackendError> {
    let (file, nsid, ns, _) = open_namespace(path)?;
    let page = nvme::identify(&file, 0, 1).map_err(|source| BackendError::Identify {
        path: path.to_owned(),
        source,
    })?;
    let nqn = nvme::parse_subnqn(&page);
    Ok(Namespace {
        size_bytes: ns.blocks << ns.lba_shift,
        block_size: 1u32 << ns.lba_shift.min(31),
        identity: NamespaceIdentity::from_identify(ns.nguid, ns.eui64, &nqn, nsid),
    })
}

/// Why the host itself seems to use the namespace behind `path` (holders, partitions, a
/// mount, an exclusive opener, a partition table or file system at its start), or None.
pub fn namespace_host_use(path: &Path) -> Result<Option<String>, BackendError> {
    let (_, nsid, _, _) = open_namespace(path)?;
    let Some(disk) = namespace_sysfs(Path::new("/sys"), path, nsid) else {
        return Ok(None);
    };
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    Ok(super::host_use::host_use(
        &disk,
        Path::new("/dev"),
        &mountinfo,
    ))
}

/// The generic char device (`/dev/ngXnY`) of the namespace with `identity`, wherever this boot
/// named it: every char device of the kernel's `nvme-generic` class is identified in turn.
/// None when no namespace has it (one that cannot be identified is passed over).
pub fn find_namespace(identity: &NamespaceIdentity) -> Option<PathBuf> {
    let mut names: Vec<String> = std::fs::read_dir("/sys/class/nvme-generic")
        .ok()?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| Path::new("/dev").join(n))
        .find(|p| identify_namespace(p).is_ok_and(|ns| ns.identity.as_ref() == Some(identity)))
}

/// Makes `len` bytes of the namespace behind `path` at byte `offset` unreadable, as a new
/// window's erase does (`Backend::erase`), without serving them: the volume manager finishes
/// with it an erase that a crash interrupted (the record's pending erase) before the range is
/// served again.
pub fn erase_window(path: &Path, offset: u64, len: u64) -> Result<Erase, BackendError> {
    let window = Window { offset, len };
    let backend = NvmeBackend::open(path, Some(window), len, 4096, false, false)?;
    backend.erase_range(offset, len)
}

/// Opens `path` (which must be an NVMe generic char device) and identifies its namespace.
/// Also returns the char device's number (`rdev`), which names the namespace in claims.
fn open_namespace(path: &Path) -> Result<(File, u32, nvme::NamespaceFormat, u64), BackendError> {
    let open_err = |source| BackendError::Open {
        path: path.to_owned(),
        source,
    };
    let meta = std::fs::metadata(path).map_err(open_err)?;
    if !meta.file_type().is_char_device() {
        return Err(BackendError::NotNvme(path.to_owned()));
    }
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags(libc::O_CLOEXEC)
        .open(path)
        .map_err(open_err)?;
    let nsid = match nvme::namespace_id(&file) {
        Ok(id) => id,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTTY | libc::EINVAL)) => {
            return Err(BackendError::NotNvme(path.to_owned()))
        }
        Err(e) => return Err(open_err(e)),
    };
    let identify_err = |source| BackendError::Identify {
        path: path.to_owned(),
        source,
    };
    let ns = nvme::parse_identify_ns(&*nvme::identify(&file, nsid, 0).map_err(identify_err)?);
    Ok((file, nsid, ns, meta.rdev()))
}

/// The sysfs directory of the namespace `nsid` behind the generic char device `path`
/// (`/dev/ngXnY`), whose `queue/` holds the kernel's limits for it. Found through the char
/// device's controller (`class/nvme-generic/ngXnY/device`) and the namespace id, never by
/// renaming `ngXnY` to `nvmeXnY`: under native multipath `X` numbers controllers for one and
/// subsystems for the other, and the path's own disk is the hidden `nvmeScCnN`.
fn namespace_sysfs(sys: &Path, path: &Path, nsid: u32) -> Option<PathBuf> {
    let real = std::fs::canonicalize(path).ok()?;
    let name = real.file_name()?.to_str()?;
    let ctrl =
        std::fs::canonicalize(sys.join("class/nvme-generic").join(name).join("device")).ok()?;
    let mut found: Vec<PathBuf> = std::fs::read_dir(&ctrl)
        .ok()?
        .flatten()
        .map(|e| e.path())
        .filter(|d| {
            let is_ns = d
                .file_name()
                .and_then(|n| n.to_str())
                .and_then(|n| n.strip_prefix("nvme"))
                .is_some_and(|n| n.contains('n'));
            is_ns
                && d.join("queue").is_dir()
                && read_sysfs_u64(&d.join("nsid")) == Some(u64::from(nsid))
        })
        .collect();
    // One disk per namespace and controller; sorted so the choice never depends on readdir.
    found.sort();
    found.into_iter().next()
}

fn read_sysfs_u64(path: &Path) -> Option<u64> {
    std::fs::read_to_string(path).ok()?.trim().parse().ok()
}

impl Backend for NvmeBackend {
    /// Write Zeroes is sent without DEAC: the controller may write every block.
    fn zeroes_deallocate(&self) -> bool {
        false
    }

    fn kind(&self) -> &'static str {
        "nvme"
    }

    fn uses_fixed_buffers(&self) -> bool {
        true
    }

    fn zero_copy(&self) -> bool {
        true
    }

    fn pollable(&self) -> bool {
        self.poll_queues
    }

    fn limits(&self) -> Option<Limits> {
        let lba = 1u32 << self.lba_shift;
        Some(Limits {
            block_size: lba,
            max_io_bytes: self.max_io_bytes,
            max_discard_bytes: if self.has(nvme::ONCS_DSM) {
                u64::from(u32::MAX) << self.lba_shift
            } else {
                0
            },
            max_write_zeroes_bytes: if self.has(nvme::ONCS_WRITE_ZEROES) {
                u64::from(nvme::MAX_NLB) << self.lba_shift
            } else {
                0
            },
            volatile_cache: self.controller.volatile_cache,
            // NVMe PRPs describe whole controller pages: no segment may cross a 4 KiB boundary.
            virt_boundary_mask: 4095,
        })
    }

    fn claim(&self) -> Option<Claim> {
        let start = self.start_lba << self.lba_shift;
        Some(Claim {
            path: self.path.clone(),
            rdev: self.rdev,
            start,
            end: start + self.window_len.load(Ordering::Relaxed),
        })
    }

    /// A window grows into the namespace after it (the control thread has checked that no
    /// other device claims that range); it never shrinks, and never past the namespace's end.
    fn resize(&self, size: u64, growth: Growth) -> Result<(), BackendError> {
        let have = self.window_len.load(Ordering::Relaxed);
        if size <= have {
            return Ok(());
        }
        let start = self.start_lba << self.lba_shift;
        if !self.unchecked
            && start
                .checked_add(size)
                .is_none_or(|end| end > self.ns_bytes)
        {
            return Err(BackendError::WindowPastEnd {
                path: self.path.clone(),
                offset: start,
                len: size,
                size: self.ns_bytes,
            });
        }
        // The blocks the window grows onto may hold a deleted volume's data.
        if !self.keep_data && growth == Growth::Erase {
            self.erase_range(start + have, size - have)?;
        }
        self.window_len.store(size, Ordering::Relaxed);
        Ok(())
    }

    fn erase(&self) -> Result<Option<Erase>, BackendError> {
        if self.keep_data {
            return Ok(None);
        }
        let start = self.start_lba << self.lba_shift;
        self.erase_range(start, self.window_len.load(Ordering::Relaxed))
            .map(Some)
    }

    fn finish(&self, req: &Request, res: i32) -> i32 {
        match nvme::status_to_errno(res) {
            e if e < 0 => e,
            // A passthrough success is 0, not a byte count.
            _ if req.has_data() => full(req),
            _ => 0,
        }
    }

    fn retryable(&self, res: i32) -> bool {
        nvme::is_retryable(res)
    }

    fn start(&self, req: &Request, ctx: IoCtx<'_>) -> Started {
        let blocks = u64::from(req.len) >> self.lba_shift;
        // A flush's sector is meaningless; every other request addresses a range.
        let in_window = req.op == OpKind::Flush
            || req
                .offset
                .checked_add(u64::from(req.len))
                // Relaxed: the window grows before the kernel learns the new size (UPDATE_SIZE),
                // so a request past the old end comes after the store.
                .is_some_and(|end| end <= self.window_len.load(Ordering::Relaxed));
        if !in_window && !self.unchecked {
            return Started::Done(-libc::EIO);
        }
        let slba = self.start_lba + (req.offset >> self.lba_shift);
        let nsid = self.nsid;
        let (cmd, data) = match req.op {
            OpKind::Read | OpKind::Write => {
                let write = req.op == OpKind::Write;
                let op = if write {
                    nvme::OPC_WRITE
                } else {
                    nvme::OPC_READ
                };
                let cmd = NvmeCmd::rw(op, nsid, slba, blocks as u32, write && req.fua);
                let data = match ctx.data {
                    Data::Copy {
                        buf,
                        region,
                        index: Some(i),
                    } => NvmeData::Fixed(buf, region, i),
                    Data::Copy {
                        buf,
                        region,
                        index: None,
                    } => NvmeData::User(buf, region),
                    Data::ZeroCopy { index } => NvmeData::Kernel {
                        index,
                        len: req.len,
                    },
                };
                (cmd, data)
            }
            OpKind::Flush if !self.controller.volatile_cache => return Started::Done(0),
            OpKind::Flush => (
                NvmeCmd {
                    opcode: nvme::OPC_FLUSH,
                    nsid,
                    ..Default::default()
                },
                NvmeData::None,
            ),
            OpKind::Discard if self.has(nvme::ONCS_DSM) => {
                let (scratch, r) = ctx.scratch;
                let range = nvme::dsm_range(slba, blocks as u32);
                if r.len < range.len() || !scratch.write_at(r.offset, &range) {
                    return Started::Done(-libc::EIO);
                }
                let cmd = NvmeCmd {
                    opcode: nvme::OPC_DSM,
                    nsid,
                    cdw10: 0, // one range
                    cdw11: nvme::DSM_ATTR_DEALLOCATE,
                    ..Default::default()
                };
                let region = Region {
                    offset: r.offset,
                    len: range.len(),
                };
                (cmd, NvmeData::User(scratch, region))
            }
            OpKind::WriteZeroes
                if self.has(nvme::ONCS_WRITE_ZEROES) && blocks <= u64::from(nvme::MAX_NLB) =>
            {
                let cmd = NvmeCmd::rw(nvme::OPC_WRITE_ZEROES, nsid, slba, blocks as u32, req.fua);
                (cmd, NvmeData::None)
            }
            _ => return Started::Done(-libc::EOPNOTSUPP),
        };
        let op = Op::Nvme {
            fd: self.file.as_raw_fd(),
            cmd,
            data,
        };
        match ctx.ring.push(op, ctx.user_data) {
            Ok(()) => Started::Submitted,
            Err(_) => Started::Done(-libc::EIO),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("ublkd-nvme-{tag}-{}", std::process::id()));
        // Left by an earlier run, or absent: either way it is made afresh next.
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn namespace_sysfs_follows_the_controller_and_nsid_under_multipath() {
        // ng0n2 is controller 0's view of namespace 2 of subsystem 1: its disk is the hidden
        // path nvme1c0n2, and the head nvme0n2 (subsystem 0's!) is a different namespace.
        let root = tmpdir("mpath");
        let sys = root.join("sys");
        let ctrl = sys.join("devices/pci0/nvme/nvme0");
        for (disk, nsid) in [("nvme1c0n1", 1), ("nvme1c0n2", 2)] {
            std::fs::create_dir_all(ctrl.join(disk).join("queue")).unwrap();
            std::fs::write(ctrl.join(disk).join("nsid"), format!("{nsid}\n")).unwrap();
        }
        std::fs::create_dir_all(ctrl.join("ng0n2")).unwrap();
        std::fs::create_dir_all(sys.join("block/nvme0n2/queue")).unwrap();
        let class = sys.join("class/nvme-generic/ng0n2");
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(&ctrl, class.join("device")).unwrap();
        let dev = root.join("ng0n2");
        std::fs::write(&dev, b"").unwrap();
        assert_eq!(
            namespace_sysfs(&sys, &dev, 2),
            Some(ctrl.join("nvme1c0n2")),
            "resolved by nsid through the controller"
        );
        assert_eq!(namespace_sysfs(&sys, &dev, 3), None, "no such namespace");
        // Tidying a test's scratch directory; the next run removes it if this fails.
        let _ = std::fs::remove_dir_all(&root);
    }
}
