//! Mounts and the tools that make them: the mount table read from `/proc/self/mountinfo` (the
//! driver's own mount namespace, which mount propagation shares with the kubelet), and the
//! util-linux, e2fsprogs and xfsprogs commands the driver runs.

use crate::error::CsiError;
use crate::params::FsType;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One line of mountinfo: what is mounted where.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// `major:minor` of the mounted device (for a bind mount, of the device underneath).
    pub dev: String,
    /// The path inside that file system which is mounted (`/` for the whole of it).
    pub root: PathBuf,
    pub target: PathBuf,
    pub fs_type: String,
    pub source: String,
}

/// Undoes mountinfo's octal escapes (`\040` is a space).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\' && i + 3 < b.len() && b[i + 1..i + 4].iter().all(u8::is_ascii_digit) {
            let v = (b[i + 1] - b'0') * 64 + (b[i + 2] - b'0') * 8 + (b[i + 3] - b'0');
            out.push(v);
            i += 4;
        } else {
            out.push(b[i]);
            i += 1;
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// Parses mountinfo text.
pub fn parse_mountinfo(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|l| {
            let (left, right) = l.split_once(" - ")?;
            let f: Vec<&str> = left.split(' ').collect();
            let r: Vec<&str> = right.split(' ').collect();
            Some(Mount {
                dev: (*f.get(2)?).to_owned(),
                root: PathBuf::from(unescape(f.get(3)?)),
                target: PathBuf::from(unescape(f.get(4)?)),
                fs_type: (*r.first()?).to_owned(),
                source: unescape(r.get(1)?),
            })
        })
        .collect()
}

/// The mount at `target` (the last, when several are stacked there).
pub fn mounted_at(target: &Path) -> Result<Option<Mount>, CsiError> {
    Ok(mounts()?.into_iter().rev().find(|m| m.target == target))
}

impl Mount {
    /// Whether this mount shows block device `dev` (number `num`): a file system on it (or a
    /// bind of one), or the device node itself bound onto a file (which mountinfo lists as
    /// devtmpfs's `/ublkbN`).
    pub fn holds(&self, dev: &Path, num: &str) -> bool {
        if self.dev == num {
            return true;
        }
        let node = dev.file_name().map(|n| Path::new("/").join(n));
        self.fs_type == "devtmpfs" && node.as_deref() == Some(self.root.as_path())
    }
}

/// Every mount of the mount table.
pub fn mounts() -> Result<Vec<Mount>, CsiError> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| CsiError::Io {
        step: "reading",
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    Ok(parse_mountinfo(&text))
}

/// `major:minor` of block device `dev`, as mountinfo writes it.
pub fn dev_number(dev: &Path) -> Result<String, CsiError> {
    let rdev = std::fs::metadata(dev)
        .map_err(|source| CsiError::Io {
            step: "reading",
            path: dev.to_owned(),
            source,
        })?
        .rdev();
    let major = ((rdev >> 32) & 0xffff_f000) | ((rdev >> 8) & 0xfff);
    let minor = ((rdev >> 12) & 0xffff_ff00) | (rdev & 0xff);
    Ok(format!("{major}:{minor}"))
}

/// Runs blocking work (a command, a read of a device that may hang) without holding up the
/// runtime: on the multi-threaded runtime the worker hands its other tasks on first, so two
/// slow mkfs never stop the driver's probes and other calls. Plain calls elsewhere (tests).
fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(h) if h.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => {
            tokio::task::block_in_place(f)
        }
        _ => f(),
    }
}

/// Runs a command; its output on success, its stderr (or stdout) in the error otherwise.
pub fn run(program: &str, args: &[&str]) -> Result<String, CsiError> {
    let shown = || format!("{program} {}", args.join(" "));
    let out = off_runtime(|| Command::new(program).args(args).output()).map_err(|e| {
        CsiError::Command {
            command: shown(),
            output: e.to_string(),
        }
    })?;
    if out.status.success() {
        return Ok(String::from_utf8_lossy(&out.stdout).into_owned());
    }
    let mut text = String::from_utf8_lossy(&out.stderr).trim().to_owned();
    if text.is_empty() {
        text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    }
    Err(CsiError::Command {
        command: shown(),
        output: format!("{} ({})", text, out.status),
    })
}

/// How much of a device is read before anything decides to format it.
const PROBE_BYTES: usize = 1 << 20;

/// Reads `dev`'s first MiB with O_DIRECT (from the device, not the page cache). `blkid -p`
/// exits 2 both for "nothing found" and for "could not read", so its "nothing" counts only
/// between two reads that succeeded: a device that cannot be read is never formatted.
pub fn read_head(dev: &Path) -> Result<(), CsiError> {
    off_runtime(|| read_head_now(dev))
}

fn read_head_now(dev: &Path) -> Result<(), CsiError> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let unreadable = |source| CsiError::DeviceUnreadable {
        device: dev.to_path_buf(),
        source,
    };
    let mut f = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(unreadable)?;
    // O_DIRECT wants a buffer aligned to the logical block: 4 KiB inside a larger Vec.
    const ALIGN: usize = 4096;
    let mut raw = vec![0u8; PROBE_BYTES + ALIGN];
    let off = raw.as_ptr().align_offset(ALIGN);
    let buf = raw
        .get_mut(off..off + PROBE_BYTES)
        .ok_or_else(|| unreadable(std::io::Error::other("cannot align the read buffer")))?;
    let mut done = 0;
    while done < buf.len() {
        match f.read(&mut buf[done..]) {
            // A device smaller than a MiB: all of it was read.
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(unreadable(e)),
        }
    }
    Ok(())
}

/// The file system (or other) signature on `dev`, if any: `blkid -p` probes the device itself,
/// not a cache. Exit 2 means it found nothing, or could not read: callers that act on "nothing"
/// read the device themselves around it ([`read_head`]).
pub fn signature(dev: &Path) -> Result<Option<String>, CsiError> {
    let d = dev.to_string_lossy();
    let out = off_runtime(|| {
        Command::new("blkid")
            .args(["-p", "-o", "value", "-s", "TYPE", &d])
            .output()
    })
    .map_err(|e| CsiError::Command {
        command: format!("blkid -p {d}"),
        output: e.to_string(),
    })?;
    match out.status.code() {
        Some(0) => {
            let t = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            // A signature without a TYPE (a partition table) is still something to keep.
            Ok(Some(if t.is_empty() { "unknown".into() } else { t }))
        }
        Some(2) => Ok(None),
        _ => Err(CsiError::Command {
            command: format!("blkid -p {d}"),
            output: String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        }),
    }
}

/// Makes a file system on `dev` (checked blank by the caller). Never forced: should the tool
/// find a signature after all, it refuses (its question meets a closed stdin) rather than
/// format over it.
pub fn mkfs(fs: FsType, dev: &Path) -> Result<(), CsiError> {
    let d = dev.to_string_lossy();
    match fs {
        // No discard pass: a new volume holds nothing (a fresh sparse file, fresh RAM, or an
        // NVMe window just wiped), and discarding a large one costs seconds.
        FsType::Ext4 => run("mkfs.ext4", &["-q", "-E", "nodiscard", &d]),
        FsType::Xfs => run("mkfs.xfs", &["-q", "-K", &d]),
    }
    .map(drop)
}

pub fn mount(dev: &Path, target: &Path, fs: FsType, flags: &[String]) -> Result<(), CsiError> {
    let (d, t) = (dev.to_string_lossy(), target.to_string_lossy());
    let mut args = vec!["-t", fs.name()];
    let opts = mount_options(fs, flags).join(",");
    if !opts.is_empty() {
        args.extend(["-o", &opts]);
    }
    args.extend([&*d, &*t]);
    run("mount", &args).map(drop)
}

/// The options a volume's file system is mounted with: the capability's flags, and for XFS
/// `nouuid`. A restore or a clone is a reflink of its source's file, so its XFS has the
/// source's UUID, and the kernel refuses a second XFS with a mounted one's UUID (the first
/// real cluster's restore never mounted: "wrong fs type, bad option, bad superblock"). The
/// UUID cannot be changed instead: a snapshot taken under a live mount has a dirty log, which
/// `xfs_admin -U` refuses. ext4 mounts duplicates as they are.
pub fn mount_options(fs: FsType, flags: &[String]) -> Vec<String> {
    let mut opts = flags.to_vec();
    if fs == FsType::Xfs && !opts.iter().any(|o| o == "nouuid") {
        opts.push("nouuid".into());
    }
    opts
}

/// Bind-mounts `source` on `target`, read-only when asked (a second remount: the kernel
/// ignores `ro` on the bind itself).
pub fn bind(source: &Path, target: &Path, read_only: bool) -> Result<(), CsiError> {
    let (s, t) = (source.to_string_lossy(), target.to_string_lossy());
    run("mount", &["--bind", &s, &t])?;
    if read_only {
        if let Err(e) = run("mount", &["-o", "remount,bind,ro", &t]) {
            let _ = run("umount", &[&t]);
            return Err(e);
        }
    }
    Ok(())
}

/// Unmounts everything stacked at `target`; nothing mounted there is done.
pub fn unmount_all(target: &Path) -> Result<(), CsiError> {
    while mounted_at(target)?.is_some() {
        run("umount", &[&target.to_string_lossy()])?;
    }
    Ok(())
}

/// Bytes and inodes of the file system at `path`: (total, available, used) bytes and (total,
/// free, used) inodes.
pub fn fs_usage(path: &Path) -> Result<([u64; 3], [u64; 3]), CsiError> {
    let st = crate::sys::statvfs(path).map_err(|source| CsiError::Io {
        step: "statvfs of",
        path: path.to_owned(),
        source,
    })?;
    let unit = st.fragment_bytes;
    Ok((
        [
            st.blocks * unit,
            st.blocks_available * unit,
            st.blocks.saturating_sub(st.blocks_free) * unit,
        ],
        [
            st.inodes,
            st.inodes_free,
            st.inodes.saturating_sub(st.inodes_free),
        ],
    ))
}

/// Size in bytes of block device `dev`.
pub fn device_size(dev: &Path) -> Result<u64, CsiError> {
    let out = run("blockdev", &["--getsize64", &dev.to_string_lossy()])?;
    out.trim().parse().map_err(|_| CsiError::Command {
        command: format!("blockdev --getsize64 {}", dev.display()),
        output: out,
    })
}

/// Grows the file system mounted at `mount` from `dev` to fill the device.
pub fn grow(fs_type: &str, dev: &Path, mount: &Path) -> Result<(), CsiError> {
    match fs_type {
        "ext4" | "ext3" | "ext2" => run("resize2fs", &[&dev.to_string_lossy()]).map(drop),
        "xfs" => run("xfs_growfs", &[&mount.to_string_lossy()]).map(drop),
        other => Err(CsiError::UnsupportedCapability(format!(
            "growing file system {other}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xfs_is_mounted_with_nouuid_once_and_ext4_as_asked() {
        let flags = vec!["noatime".to_owned()];
        assert_eq!(mount_options(FsType::Xfs, &flags), ["noatime", "nouuid"]);
        assert_eq!(mount_options(FsType::Xfs, &["nouuid".into()]), ["nouuid"]);
        assert_eq!(mount_options(FsType::Ext4, &flags), ["noatime"]);
        assert!(mount_options(FsType::Ext4, &[]).is_empty());
    }

    #[test]
    fn mountinfo_lines_are_read_with_their_escapes() {
        let text = "36 35 98:0 /mnt1 /mnt/parent\\040dir rw,noatime master:1 - ext3 /dev/root rw,errors=continue\n\
                    40 22 259:3 / /var/lib/kubelet/pods/x/volumes/v rw shared:5 - xfs /dev/ublkb3 rw\n\
                    garbage\n";
        let m = parse_mountinfo(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].target, PathBuf::from("/mnt/parent dir"));
        assert_eq!(m[0].root, PathBuf::from("/mnt1"));
        assert_eq!((m[1].dev.as_str(), m[1].fs_type.as_str()), ("259:3", "xfs"));
        assert_eq!(m[1].source, "/dev/ublkb3");
    }

    #[test]
    fn device_numbers_read_as_mountinfo_writes_them() {
        // /dev/null is 1:3 everywhere.
        assert_eq!(dev_number(Path::new("/dev/null")).unwrap(), "1:3");
    }
}
