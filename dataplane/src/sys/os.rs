//! Thin wrappers over the few raw syscalls the dataplane needs that `std` lacks: memory mappings
//! (tag buffers, RAM volumes, the kernel's descriptor arrays), eventfd, CPU pinning, and
//! `fallocate`-free helpers. The crate's other `unsafe` outside the rings is in `sys/mod.rs`
//! (the UAPI structs as bytes, `Pod`) and `sys/nvme.rs` (the NVMe ioctls).

use super::ublksrv_io_desc;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::ptr::NonNull;

/// The system page size.
pub fn page_size() -> usize {
    // SAFETY: sysconf has no memory-safety preconditions.
    let v = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(v).ok().filter(|&v| v > 0).unwrap_or(4096)
}

/// A private read-write memory mapping owned by this value: tag buffers and RAM volumes.
///
/// The bytes are plain data shared with the kernel (which copies request data in and out) and,
/// for RAM volumes, with every worker serving the device. Access goes through raw copies, never
/// through `&mut [u8]`, so concurrent I/O to the same bytes is a data race only in the block-layer
/// sense (contents undefined until one write wins), as on any block device.
#[derive(Debug)]
pub struct Mapping {
    ptr: NonNull<u8>,
    len: usize,
    shared: bool,
}

// SAFETY: the mapping is plain memory owned by this value; all accesses are raw copies whose
// concurrent use is described above, and unmapping happens only in Drop (exclusive access).
unsafe impl Send for Mapping {}
// SAFETY: as for Send: shared access only performs raw byte copies.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Anonymous, lazily backed memory of `len` bytes (rounded up to pages), reading as zeros.
    pub fn anonymous(len: usize) -> io::Result<Self> {
        Self::map(
            len,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
        )
    }

    /// A shared mapping of `file`'s first `len` bytes (e.g. a tmpfs file that survives a crash).
    pub fn shared_file(file: &File, len: usize) -> io::Result<Self> {
        Self::map(len, libc::MAP_SHARED, file.as_raw_fd())
    }

    fn map(len: usize, flags: libc::c_int, fd: RawFd) -> io::Result<Self> {
        let len = len.max(1).next_multiple_of(page_size());
        // SAFETY: a fresh mapping at an address the kernel chooses aliases no Rust object.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self {
            ptr,
            len,
            shared: flags & libc::MAP_SHARED != 0,
        })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    /// Address of byte `offset`, for handing to the kernel. Panics never: offsets past the end
    /// are clamped by the caller's validation; this returns the base plus offset as an integer.
    pub fn addr(&self, offset: usize) -> u64 {
        self.ptr.as_ptr() as u64 + offset as u64
    }

    /// Copies `dst.len()` bytes from `offset`. Returns false (copying nothing) when out of range.
    pub fn read_at(&self, offset: usize, dst: &mut [u8]) -> bool {
        if offset
            .checked_add(dst.len())
            .is_none_or(|end| end > self.len)
        {
            return false;
        }
        // SAFETY: the range is inside the mapping (checked above); `dst` is a distinct Rust
        // buffer, so the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.ptr.as_ptr().wrapping_add(offset),
                dst.as_mut_ptr(),
                dst.len(),
            )
        };
        true
    }

    /// Copies `len` bytes from `src_off` of `src` into `offset` of this mapping.
    pub fn copy_from(&self, offset: usize, src: &Mapping, src_off: usize, len: usize) -> bool {
        let ok = |m: &Mapping, o: usize| o.checked_add(len).is_some_and(|end| end <= m.len);
        if !ok(self, offset) || !ok(src, src_off) || std::ptr::eq(self, src) {
            return false;
        }
        // SAFETY: both ranges are inside their (distinct) mappings, checked above.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.ptr.as_ptr().wrapping_add(src_off),
                self.ptr.as_ptr().wrapping_add(offset),
                len,
            )
        };
        true
    }

    /// Zeros `len` bytes at `offset`.
    pub fn zero(&self, offset: usize, len: usize) -> bool {
        if offset.checked_add(len).is_none_or(|end| end > self.len) {
            return false;
        }
        // SAFETY: the range is inside the mapping (checked above).
        unsafe { std::ptr::write_bytes(self.ptr.as_ptr().wrapping_add(offset), 0, len) };
        true
    }

    /// Copies `src` into `offset`. Returns false (copying nothing) when out of range.
    pub fn write_at(&self, offset: usize, src: &[u8]) -> bool {
        if offset
            .checked_add(src.len())
            .is_none_or(|end| end > self.len)
        {
            return false;
        }
        // SAFETY: the range is inside the mapping (checked above); `src` is a distinct Rust
        // buffer, so the regions do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(
                src.as_ptr(),
                self.ptr.as_ptr().wrapping_add(offset),
                src.len(),
            )
        };
        true
    }

    /// Zeros `[offset, offset+len)` and gives the whole pages inside it back to the kernel.
    pub fn discard(&self, offset: usize, len: usize) -> bool {
        let Some(end) = offset.checked_add(len).filter(|&e| e <= self.len) else {
            return false;
        };
        let page = page_size();
        let first = offset.next_multiple_of(page);
        let last = end / page * page;
        if first >= last {
            return self.zero(offset, len);
        }
        let advice = if self.shared {
            libc::MADV_REMOVE
        } else {
            libc::MADV_DONTNEED
        };
        // SAFETY: whole pages inside our own mapping; afterwards they read as zeros, which no
        // Rust invariant depends on.
        let rc = unsafe {
            libc::madvise(
                self.ptr.as_ptr().wrapping_add(first).cast(),
                last - first,
                advice,
            )
        };
        let middle = rc == 0 || self.zero(first, last - first);
        middle && self.zero(offset, first - offset) && self.zero(last, end - last)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: we own the mapping; callers guarantee (via the ring's in-flight pins) that the
        // kernel holds no pending operation on it.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// An anonymous tmpfs file (memfd): memory whose use the kernel counts in the file's blocks.
/// The process's soft limit on open files (RLIMIT_NOFILE), which also bounds the size of an
/// io_uring registered-file table; 1024 when it cannot be read.
pub fn open_files_limit() -> u64 {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit into the struct we own.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) };
    if rc == 0 {
        lim.rlim_cur
    } else {
        1024
    }
}

pub fn memfd(name: &str) -> io::Result<File> {
    let name =
        std::ffi::CString::new(name).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `name` is a valid NUL-terminated string for the duration of the call.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: memfd_create returned a fresh descriptor that nothing else owns.
    Ok(unsafe { File::from_raw_fd(fd) })
}

/// Bytes of storage a file holds (its allocated blocks): for a tmpfs file, the memory it uses.
/// One fstat, whatever the file's size.
pub fn allocated_bytes(file: &File) -> u64 {
    use std::os::unix::fs::MetadataExt;
    file.metadata()
        .map_or(0, |m| m.blocks().saturating_mul(512))
}

/// A queue's descriptor array on `/dev/ublkcN`, mapped read-only.
#[derive(Debug)]
pub struct DescMap {
    ptr: NonNull<ublksrv_io_desc>,
    len: usize,
    depth: u16,
}

// SAFETY: read-only shared memory written by the kernel; reads are volatile copies.
unsafe impl Send for DescMap {}

impl DescMap {
    /// Maps queue `q`'s descriptors of a device opened as `cdev` with `depth` tags.
    pub fn map(cdev: &File, q: u16, depth: u16) -> io::Result<Self> {
        let page = page_size();
        let stride = (usize::from(super::UBLK_MAX_QUEUE_DEPTH)
            * std::mem::size_of::<ublksrv_io_desc>())
        .next_multiple_of(page);
        let len =
            (usize::from(depth) * std::mem::size_of::<ublksrv_io_desc>()).next_multiple_of(page);
        let offset = super::UBLKSRV_CMD_BUF_OFFSET + (usize::from(q) * stride) as i64;
        // SAFETY: a fresh read-only shared mapping of the device at a kernel-chosen address.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_POPULATE,
                cdev.as_raw_fd(),
                offset,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(ptr.cast()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Self { ptr, len, depth })
    }

    /// The descriptor of `tag` as the kernel last wrote it; None for a tag out of range.
    pub fn get(&self, tag: u16) -> Option<ublksrv_io_desc> {
        if tag >= self.depth {
            return None;
        }
        // SAFETY: `tag < depth`, so the slot lies inside the mapping; volatile because the kernel
        // writes it, and the struct is plain integers valid for any bit pattern.
        Some(unsafe { std::ptr::read_volatile(self.ptr.as_ptr().wrapping_add(usize::from(tag))) })
    }
}

impl Drop for DescMap {
    fn drop(&mut self) {
        // SAFETY: our own mapping; no reference into it outlives this value.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), self.len) };
    }
}

/// A non-blocking eventfd used to wake a worker sleeping in its ring.
#[derive(Debug)]
pub struct EventFd(OwnedFd);

impl EventFd {
    pub fn new() -> io::Result<Self> {
        // SAFETY: eventfd has no memory-safety preconditions.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` is a fresh descriptor we exclusively own.
        Ok(Self(unsafe { OwnedFd::from_raw_fd(fd) }))
    }

    pub fn raw(&self) -> RawFd {
        self.0.as_raw_fd()
    }

    /// Adds one to the counter, waking any reader.
    pub fn notify(&self) -> io::Result<()> {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64.
        let n = unsafe { libc::write(self.raw(), (&one as *const u64).cast(), 8) };
        if n == 8 || io::Error::last_os_error().raw_os_error() == Some(libc::EAGAIN) {
            Ok(())
        } else {
            Err(io::Error::last_os_error())
        }
    }
}

fn empty_cpu_set() -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a plain bit array; all zeros is the empty set.
    unsafe { std::mem::zeroed() }
}

/// Pins the calling thread to `cpu`.
pub fn pin_current_thread(cpu: usize) -> io::Result<()> {
    if cpu >= 8 * size_of::<libc::cpu_set_t>() {
        return Err(io::Error::from_raw_os_error(libc::EINVAL));
    }
    let mut set = empty_cpu_set();
    // SAFETY: `cpu` is inside the set (checked above); CPU_SET only writes within it.
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: passes a valid, initialised cpu_set_t of the size given.
    let rc = unsafe { libc::sched_setaffinity(0, size_of::<libc::cpu_set_t>(), &set) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// CPUs this process may run on.
pub fn allowed_cpus() -> Vec<usize> {
    let mut set = empty_cpu_set();
    // SAFETY: the kernel fills a cpu_set_t of the size given.
    let rc = unsafe { libc::sched_getaffinity(0, size_of::<libc::cpu_set_t>(), &mut set) };
    if rc != 0 {
        return vec![0];
    }
    (0..8 * size_of::<libc::cpu_set_t>())
        // SAFETY: every index is inside the set.
        .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
        .collect()
}

/// Whether process `pid` exists.
pub fn pid_alive(pid: i32) -> bool {
    pid > 0 && std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// Whether `file` lives on tmpfs (which cannot FALLOC_FL_ZERO_RANGE).
pub fn is_tmpfs(file: &File) -> bool {
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    // SAFETY: statfs is plain data the kernel fills in.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs writes one statfs into `st`.
    let rc = unsafe { libc::fstatfs(file.as_raw_fd(), &mut st) };
    rc == 0 && st.f_type as i64 == TMPFS_MAGIC
}

/// Size in bytes of a block device (BLKGETSIZE64).
pub fn block_device_size(file: &File) -> io::Result<u64> {
    let mut size: u64 = 0;
    // SAFETY: BLKGETSIZE64 writes one u64 into `size`.
    let rc = unsafe { libc::ioctl(file.as_raw_fd(), 0x8008_1272, &mut size as *mut u64) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(size)
}

/// Bytes of the file system holding `path`: `(available, total)`, as an unprivileged writer
/// sees them (`f_bavail`, `f_blocks`, in fragment-size units).
pub fn fs_space(path: &std::path::Path) -> io::Result<(u64, u64)> {
    let dir = File::open(path)?;
    // SAFETY: statvfs is plain data; all zeros is a valid value for fstatvfs to overwrite.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is an open descriptor for the call's duration and `st` is a live, writable
    // statvfs the kernel fills.
    let rc = unsafe { libc::fstatvfs(dir.as_raw_fd(), &mut st) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let unit = st.f_frsize;
    Ok((
        st.f_bavail.saturating_mul(unit),
        st.f_blocks.saturating_mul(unit),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn anonymous_mapping_reads_zeros_and_keeps_writes() {
        let p = page_size();
        let a = Mapping::anonymous(3 * p).unwrap();
        let b = Mapping::anonymous(p).unwrap();
        let mut buf = [1u8; 16];
        assert!(a.read_at(100, &mut buf));
        assert_eq!(buf, [0; 16]);
        assert!(b.write_at(0, &[0xab; 16]));
        assert!(a.copy_from(p - 8, &b, 0, 16), "copy across a page boundary");
        assert!(a.read_at(p - 8, &mut buf));
        assert_eq!(buf, [0xab; 16]);
        assert!(
            !a.copy_from(a.len() - 8, &b, 0, 16),
            "past the end is refused"
        );
        assert!(!a.read_at(a.len(), &mut buf[..1]));
        assert!(!a.write_at(usize::MAX, &buf));
    }

    #[test]
    fn discard_zeros_partial_and_whole_pages_and_frees_memory() {
        let p = page_size();
        let f = memfd("discard-test").unwrap();
        f.set_len(4 * p as u64).unwrap();
        let m = Mapping::shared_file(&f, 4 * p).unwrap();
        assert_eq!(allocated_bytes(&f), 0, "a new memfd holds no memory");
        assert!(m.write_at(0, &vec![0x5a; 4 * p]));
        assert_eq!(allocated_bytes(&f), 4 * p as u64);
        assert!(m.discard(p / 2, 2 * p));
        assert_eq!(
            allocated_bytes(&f),
            3 * p as u64,
            "the whole page in the middle was freed"
        );
        let mut out = vec![0u8; 4 * p];
        assert!(m.read_at(0, &mut out));
        assert!(out[..p / 2].iter().all(|&b| b == 0x5a));
        assert!(out[p / 2..p / 2 + 2 * p].iter().all(|&b| b == 0));
        assert!(out[p / 2 + 2 * p..].iter().all(|&b| b == 0x5a));
        assert!(!m.discard(3 * p, 2 * p));
    }

    #[test]
    fn fs_space_reads_the_file_system_of_a_path() {
        let (avail, total) = fs_space(std::path::Path::new("/")).expect("statvfs /");
        assert!(total > 0 && avail <= total, "{avail} of {total}");
        assert!(fs_space(std::path::Path::new("/nonexistent-ublkd")).is_err());
    }
}
