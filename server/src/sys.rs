//! The server's only system calls that std lacks: FICLONE (reflink a whole file), renameat2
//! with RENAME_NOREPLACE (publish a file without replacing one), and statfs (which file system a
//! path is on, to say why a reflink was refused).

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// `_IOW(0x94, 9, int)` from `<linux/fs.h>`; the libc crate does not define it.
const FICLONE: libc::c_ulong = 0x4004_9409;

/// Makes `dst` (an empty regular file open for writing) share every block of `src` (open for
/// reading) on a file system with reflink (XFS with reflink=1, btrfs, bcachefs, OCFS2). The
/// kernel flushes `src`'s dirty pages first and takes both inodes' locks, so the clone is one
/// point in time against writes. Fails with EOPNOTSUPP (no reflink, e.g. ext4, tmpfs), EXDEV
/// (different file systems), EINVAL (not regular files, or the file system refuses) or EBADF.
pub fn reflink(dst: &File, src: &File) -> io::Result<()> {
    // SAFETY: FICLONE takes the source descriptor by value as its argument; both descriptors
    // are open for the duration of the call (borrowed Files) and no memory is passed.
    let r = unsafe { libc::ioctl(dst.as_raw_fd(), FICLONE as _, src.as_raw_fd()) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// Renames `from` to `to` unless `to` exists (EEXIST then): renameat2 with RENAME_NOREPLACE,
/// so a file that appeared at `to` meanwhile is never replaced.
pub fn rename_noreplace(from: &Path, to: &Path) -> io::Result<()> {
    let c = |p: &Path| {
        CString::new(p.as_os_str().as_bytes())
            .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
    };
    let (f, t) = (c(from)?, c(to)?);
    // SAFETY: both are NUL-terminated paths that outlive the call; AT_FDCWD resolves them as
    // rename(2) would; no other memory is passed.
    let r = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            f.as_ptr(),
            libc::AT_FDCWD,
            t.as_ptr(),
            libc::RENAME_NOREPLACE,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `_IOWR('f', 11, struct fiemap)` from `<linux/fs.h>`.
const FS_IOC_FIEMAP: libc::c_ulong = 0xC020_660B;
/// `struct fiemap` is 32 bytes, each `struct fiemap_extent` 56 (`<linux/fiemap.h>`).
const FIEMAP_HEADER: usize = 32;
const FIEMAP_EXTENT: usize = 56;
const FIEMAP_EXTENT_LAST: u32 = 0x1;
const FIEMAP_EXTENT_SHARED: u32 = 0x2000;
/// Extents asked for per call.
const FIEMAP_BATCH: usize = 256;

/// Bytes of `file` that it alone holds: its allocated extents less those it shares with
/// another file (a reflink: a snapshot, a clone or its origin). Writing over a shared extent
/// allocates anew, so only these bytes need no more space when rewritten. EOPNOTSUPP where the
/// file system has no FIEMAP.
pub fn exclusive_bytes(file: &File) -> io::Result<u64> {
    let words = (FIEMAP_HEADER + FIEMAP_EXTENT * FIEMAP_BATCH) / 8;
    // u64s, so the buffer has struct fiemap's alignment.
    let mut buf = vec![0u64; words];
    let mut start = 0u64;
    let mut exclusive = 0u64;
    loop {
        buf.fill(0);
        buf[0] = start;
        buf[1] = u64::MAX - start;
        // fm_flags 0, fm_mapped_extents 0 (out), fm_extent_count: the low half of word 3.
        buf[3] = FIEMAP_BATCH as u64;
        // SAFETY: `buf` is a struct fiemap followed by room for FIEMAP_BATCH extents (the
        // count it says), 8-byte aligned, borrowed mutably for this synchronous ioctl.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), FS_IOC_FIEMAP as _, buf.as_mut_ptr()) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        let bytes: Vec<u8> = buf.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let u32_at =
            |o: usize| u32::from_ne_bytes([bytes[o], bytes[o + 1], bytes[o + 2], bytes[o + 3]]);
        let u64_at = |o: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&bytes[o..o + 8]);
            u64::from_ne_bytes(b)
        };
        let mapped = (u32_at(20) as usize).min(FIEMAP_BATCH);
        if mapped == 0 {
            return Ok(exclusive);
        }
        let mut last = false;
        for i in 0..mapped {
            let e = FIEMAP_HEADER + i * FIEMAP_EXTENT;
            let (logical, length, flags) = (u64_at(e), u64_at(e + 16), u32_at(e + 40));
            if flags & FIEMAP_EXTENT_SHARED == 0 {
                exclusive = exclusive.saturating_add(length);
            }
            start = logical.saturating_add(length);
            last |= flags & FIEMAP_EXTENT_LAST != 0;
        }
        if last {
            return Ok(exclusive);
        }
    }
}

/// The name of the file system `path` is on, for the common ones; None if unknown.
pub fn fs_type_name(path: &Path) -> Option<&'static str> {
    let c = CString::new(path.as_os_str().as_bytes()).ok()?;
    // SAFETY: a zeroed `statfs` is a valid value of the plain C struct.
    let mut st: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a writable statfs.
    if unsafe { libc::statfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    Some(match st.f_type as i64 {
        0xEF53 => "ext4",
        0x5846_5342 => "xfs",
        0x9123_683E => "btrfs",
        0xCA45_1A4E => "bcachefs",
        0x0102_1994 => "tmpfs",
        0x6969 => "nfs",
        0x794C_7630 => "overlayfs",
        0x2FC1_2FC1 => "zfs",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exclusive_bytes_count_a_files_own_extents() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, vec![7u8; 1 << 20]).unwrap();
        let f = File::open(&path).unwrap();
        f.sync_all().unwrap();
        match exclusive_bytes(&f) {
            Ok(n) => assert!((1 << 20..=(1 << 20) + 65536).contains(&n), "{n}"),
            // tmpfs and some overlays have no FIEMAP: capacity then falls back to st_blocks.
            Err(e) => assert_eq!(e.raw_os_error(), Some(libc::EOPNOTSUPP), "{e}"),
        }
        let sparse = dir.path().join("sparse");
        File::create(&sparse).unwrap().set_len(1 << 30).unwrap();
        if let Ok(n) = exclusive_bytes(&File::open(&sparse).unwrap()) {
            assert_eq!(n, 0, "a hole holds nothing");
        }
    }

    #[test]
    fn names_the_file_system_of_a_path_or_none() {
        // /proc is procfs everywhere: not in the table.
        assert_eq!(fs_type_name(Path::new("/proc")), None);
        assert_eq!(fs_type_name(Path::new("/no/such/path")), None);
    }

    #[test]
    fn reflink_refusal_is_an_error_not_a_copy() {
        // Two anonymous-ish files in the temp dir: on a file system without reflink the call
        // fails; with reflink it succeeds and the clone holds the data. Either way, no lie.
        let dir = std::env::temp_dir().join(format!("ublkd-reflink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let src_path = dir.join("src");
        std::fs::write(&src_path, b"pattern-a").unwrap();
        let src = File::open(&src_path).unwrap();
        let dst = File::create(dir.join("dst")).unwrap();
        match reflink(&dst, &src) {
            Ok(()) => assert_eq!(std::fs::read(dir.join("dst")).unwrap(), b"pattern-a"),
            Err(e) => assert_eq!(std::fs::metadata(dir.join("dst")).unwrap().len(), 0, "{e}"),
        }
        // The test's scratch directory: a leftover in the temp dir harms nothing.
        let _ = std::fs::remove_dir_all(&dir);
    }
}
