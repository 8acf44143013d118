//! The driver's only system call that std lacks: statvfs, for NodeGetVolumeStats. In process,
//! not a `stat -f` child: the image carries no coreutils (the first real cluster found every
//! stats call failing there), and the kubelet asks for every mounted volume each minute.

use std::ffi::CString;
use std::io;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// What statvfs(3) says of a file system, in the units it gives them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FsStat {
    /// The fragment size: the unit of the block counts.
    pub fragment_bytes: u64,
    pub blocks: u64,
    pub blocks_free: u64,
    /// Free blocks an unprivileged user may take.
    pub blocks_available: u64,
    pub inodes: u64,
    pub inodes_free: u64,
}

/// statvfs(3) of the file system `path` is on.
pub fn statvfs(path: &Path) -> io::Result<FsStat> {
    let c = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a zeroed `statvfs` is a valid value of the plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is a NUL-terminated path that outlives the call; `st` is a writable statvfs
    // the call fills and does not keep.
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(FsStat {
        fragment_bytes: st.f_frsize,
        blocks: st.f_blocks,
        blocks_free: st.f_bfree,
        blocks_available: st.f_bavail,
        inodes: st.f_files,
        inodes_free: st.f_ffree,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statvfs_of_a_directory_and_of_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let st = statvfs(dir.path()).unwrap();
        assert!(st.fragment_bytes > 0 && st.blocks > 0, "{st:?}");
        assert!(st.blocks_available <= st.blocks_free && st.blocks_free <= st.blocks);
        let e = statvfs(&dir.path().join("absent")).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOENT));
    }
}
