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
pub(crate) fn off_runtime<T>(f: impl FnOnce() -> T) -> T {
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

/// How much of each end of a device is read before anything decides to format it.
const PROBE_BYTES: u64 = 1 << 20;

/// O_DIRECT wants buffers, offsets and lengths aligned to the logical block (at most 4 KiB).
const ALIGN: u64 = 4096;

/// Reads `dev`'s first MiB with O_DIRECT (from the device, not the page cache): a device that
/// cannot be read right now is refused before anything probes it.
pub fn read_head(dev: &Path) -> Result<(), CsiError> {
    off_runtime(|| {
        let f = open_direct(dev)?;
        read_range(&f, 0, PROBE_BYTES)
            .map(drop)
            .map_err(|source| CsiError::DeviceUnreadable {
                device: dev.to_path_buf(),
                source,
            })
    })
}

/// One end of a device, read for the blank check: where it starts, and its bytes or why they
/// could not be read.
#[derive(Debug)]
pub struct End {
    /// "first MiB" or "last MiB", for the message.
    pub what: &'static str,
    pub offset: u64,
    pub bytes: std::io::Result<Vec<u8>>,
}

/// Reads `dev`'s first and last MiB with O_DIRECT ([`read_ends_of`]).
pub fn read_ends(dev: &Path) -> Result<[End; 2], CsiError> {
    off_runtime(|| {
        let f = open_direct(dev)?;
        read_ends_of(&f).map_err(|source| CsiError::DeviceUnreadable {
            device: dev.to_path_buf(),
            source,
        })
    })
}

/// Reads the first and the last MiB of `f` (a block device, or a regular file), each with its
/// own outcome; the error is the size's, which says where the last MiB is. The last MiB starts
/// on a 4 KiB boundary, so that it may be a little more than a MiB.
pub fn read_ends_of(f: &std::fs::File) -> std::io::Result<[End; 2]> {
    use std::io::{Seek, SeekFrom};
    // A block device's metadata says 0 bytes; the end of it is its size.
    let size = (&*f).seek(SeekFrom::End(0))?;
    let tail = size.saturating_sub(PROBE_BYTES) / ALIGN * ALIGN;
    Ok([
        End {
            what: "first MiB",
            offset: 0,
            bytes: read_range(f, 0, PROBE_BYTES.min(size)),
        },
        End {
            what: "last MiB",
            offset: tail,
            bytes: read_range(f, tail, size - tail),
        },
    ])
}

/// Whether a device on which no file system was recognised may be formatted, from what its
/// two ends read ([`read_ends`]): only when both read back whole and all zeroes, as ublkd
/// makes every new volume. blkid's "nothing found" is also what it says when it could not read
/// (the device's end, which it probes too), and mke2fs asks before formatting over a file
/// system only on a TTY: this is the check that keeps a live file system from being formatted.
/// A read error refuses before a non-zero byte does: it is why blkid saw nothing.
pub fn check_blank(dev: &Path, ends: [End; 2]) -> Result<(), CsiError> {
    let mut read = Vec::with_capacity(ends.len());
    for end in ends {
        match end.bytes {
            Ok(b) => read.push((end.offset, b)),
            Err(source) => {
                return Err(CsiError::BlankCheckRead {
                    device: dev.to_path_buf(),
                    what: end.what,
                    source,
                })
            }
        }
    }
    for (offset, bytes) in read {
        if let Some(i) = bytes.iter().position(|&b| b != 0) {
            return Err(CsiError::DeviceNotBlank {
                device: dev.to_path_buf(),
                offset: offset + i as u64,
            });
        }
    }
    Ok(())
}

fn open_direct(dev: &Path) -> Result<std::fs::File, CsiError> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_DIRECT)
        .open(dev)
        .map_err(|source| CsiError::DeviceUnreadable {
            device: dev.to_path_buf(),
            source,
        })
}

/// Reads `len` bytes of `f` at `offset` (fewer at its end) into a buffer aligned for O_DIRECT
/// (`offset` and `len` aligned by the caller).
fn read_range(f: &std::fs::File, offset: u64, len: u64) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let len = usize::try_from(len).map_err(std::io::Error::other)?;
    let align = ALIGN as usize;
    let mut raw = vec![0u8; len + align];
    let start = raw.as_ptr().align_offset(align);
    let buf = raw
        .get_mut(start..start + len)
        .ok_or_else(|| std::io::Error::other("cannot align the read buffer"))?;
    let mut done = 0;
    while done < buf.len() {
        match f.read_at(&mut buf[done..], offset + done as u64) {
            // The end of the device (or file).
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    raw.truncate(start + done);
    raw.drain(..start);
    Ok(raw)
}

/// The file system (or other) signature on `dev`, if any: `blkid -p` probes the device itself,
/// not a cache. Exit 2 means it found nothing, or could not read: callers that act on "nothing"
/// read the device themselves ([`check_blank`]).
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

/// Makes a file system on `dev`, which the caller checked blank ([`check_blank`]): mke2fs
/// looks for an existing file system only when it can ask on a TTY, so not forcing it protects
/// nothing.
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
            // The bind goes with the refusal; should it stay, it stays writable: said, and the
            // caller's retry meets it (publish checks what is mounted there).
            if let Err(u) = run("umount", &[&t]) {
                tracing::error!(target = %t, error = %u, "a bind mount that could not be made read-only could not be removed either: it stays read-write");
            }
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

    fn end(what: &'static str, offset: u64, bytes: std::io::Result<Vec<u8>>) -> End {
        End {
            what,
            offset,
            bytes,
        }
    }

    #[test]
    fn only_two_ends_of_zeroes_are_blank() {
        let dev = Path::new("/dev/ublkb0");
        let zeroes = || Ok(vec![0u8; 4096]);
        let eio = || Err(std::io::Error::from_raw_os_error(libc::EIO));
        assert!(check_blank(
            dev,
            [
                end("first MiB", 0, zeroes()),
                end("last MiB", 1 << 30, zeroes())
            ]
        )
        .is_ok());
        // An ext4 superblock at 1 KiB.
        let mut ext4 = vec![0u8; 4096];
        ext4[1024 + 56] = 0x53;
        let e = check_blank(
            dev,
            [
                end("first MiB", 0, Ok(ext4.clone())),
                end("last MiB", 1 << 30, zeroes()),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(e, CsiError::DeviceNotBlank { offset: 1080, .. }),
            "{e:?}"
        );
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.to_string()
                .contains("not blank: non-zero bytes at offset 1080"),
            "{e}"
        );
        let mut tail = vec![0u8; 4096];
        tail[4095] = 1;
        let e = check_blank(
            dev,
            [
                end("first MiB", 0, zeroes()),
                end("last MiB", 1 << 30, Ok(tail)),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(e, CsiError::DeviceNotBlank { offset, .. } if offset == (1 << 30) + 4095),
            "{e:?}"
        );
        // The defect: the end fails to read (so blkid found nothing) on a live file system.
        let e = check_blank(
            dev,
            [
                end("first MiB", 0, Ok(ext4)),
                end("last MiB", 1 << 30, eio()),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                CsiError::BlankCheckRead {
                    what: "last MiB",
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.code(), tonic::Code::Unavailable);
        let shown = ublkd_client::cause_chain(&e);
        assert!(
            shown.starts_with("/dev/ublkb0 is not formatted: its last MiB could not be read: ")
                && shown.contains("os error 5"),
            "{shown}"
        );
        let e = check_blank(
            dev,
            [
                end("first MiB", 0, eio()),
                end("last MiB", 1 << 30, zeroes()),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(
                e,
                CsiError::BlankCheckRead {
                    what: "first MiB",
                    ..
                }
            ),
            "{e:?}"
        );
    }

    #[test]
    fn the_ends_of_a_file_are_its_first_and_last_mib() {
        use std::os::unix::fs::FileExt;
        // Not a multiple of 4 KiB: the last MiB starts on the 4 KiB boundary below.
        let size = 5 * (1 << 20) + 512;
        let f = tempfile::tempfile().unwrap();
        f.set_len(size).unwrap();
        let dev = Path::new("/tmp/file");
        let ends = read_ends_of(&f).unwrap();
        assert_eq!((ends[0].offset, ends[1].offset), (0, 4 << 20));
        let lens: Vec<usize> = ends
            .iter()
            .map(|e| e.bytes.as_ref().unwrap().len())
            .collect();
        assert_eq!(lens, [1 << 20, (1 << 20) + 512]);
        assert!(
            check_blank(dev, ends).is_ok(),
            "a sparse file reads as zeroes"
        );
        // Data between the ends is not looked at.
        f.write_all_at(b"x", 2 << 20).unwrap();
        assert!(check_blank(dev, read_ends_of(&f).unwrap()).is_ok());
        f.write_all_at(b"x", size - 1).unwrap();
        let e = check_blank(dev, read_ends_of(&f).unwrap()).unwrap_err();
        assert!(
            matches!(e, CsiError::DeviceNotBlank { offset, .. } if offset == size - 1),
            "{e:?}"
        );
        f.write_all_at(b"x", 4096).unwrap();
        let e = check_blank(dev, read_ends_of(&f).unwrap()).unwrap_err();
        assert!(
            matches!(e, CsiError::DeviceNotBlank { offset: 4096, .. }),
            "{e:?}"
        );
        // Smaller than a MiB: both ends are the whole of it.
        let small = tempfile::tempfile().unwrap();
        small.set_len(8192).unwrap();
        small.write_all_at(b"x", 8191).unwrap();
        let ends = read_ends_of(&small).unwrap();
        assert_eq!((ends[0].offset, ends[1].offset), (0, 0));
        let e = check_blank(dev, ends).unwrap_err();
        assert!(
            matches!(e, CsiError::DeviceNotBlank { offset: 8191, .. }),
            "{e:?}"
        );
    }

    #[test]
    fn device_numbers_read_as_mountinfo_writes_them() {
        // /dev/null is 1:3 everywhere.
        assert_eq!(dev_number(Path::new("/dev/null")).unwrap(), "1:3");
    }
}
