//! Whether the host itself uses an NVMe namespace: a disk with holders (device-mapper, md,
//! LVM), partitions, a mount, an exclusive opener, or a partition table or file system at its
//! start. Cloud VMs boot from an NVMe namespace, often the first one probed (`/dev/ng0n1`);
//! carving windows out of it would erase the host's own data. Read from sysfs, mountinfo and
//! the first blocks of the namespace's block device; nothing is written.

use std::io::Read;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

/// Why the host seems to use the namespace whose block device's sysfs directory is `disk`
/// (`/sys/.../nvmeXnY`), or None. `dev_dir` is where its block device node is (`/dev`).
pub fn host_use(disk: &Path, dev_dir: &Path, mountinfo: &str) -> Option<String> {
    let name = disk.file_name()?.to_string_lossy().into_owned();
    let holders: Vec<String> = std::fs::read_dir(disk.join("holders"))
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if !holders.is_empty() {
        return Some(format!("{name} is held by {}", holders.join(", ")));
    }
    let partitions: Vec<String> = std::fs::read_dir(disk)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.path().join("partition").is_file())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    if !partitions.is_empty() {
        return Some(format!("{name} has partitions {}", partitions.join(", ")));
    }
    if let Ok(dev) = std::fs::read_to_string(disk.join("dev")) {
        let dev = dev.trim();
        // mountinfo: id parent major:minor root mount-point ...
        if let Some(at) = mountinfo.lines().find_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.get(2) == Some(&dev)).then(|| f.get(4).copied().unwrap_or("?").to_owned())
        }) {
            return Some(format!("{name} is mounted at {at}"));
        }
    }
    let node = dev_dir.join(&name);
    // One probe at a time in this process: two at once (two creates, a capacity call) would
    // each find the disk open exclusively by the other.
    let _one = PROBE
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_EXCL | libc::O_CLOEXEC)
        .open(&node);
    let mut file = match opened {
        Ok(f) => f,
        Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
            return Some(format!(
                "{name} is open exclusively (a mount, a swap, a holder)"
            ))
        }
        // No node to read (a container without the disk): the sysfs checks are what we have.
        Err(_) => return None,
    };
    let mut head = vec![0u8; HEAD];
    let mut got = 0;
    while got < HEAD {
        match file.read(&mut head[got..]) {
            Ok(0) | Err(_) => break,
            Ok(n) => got += n,
        }
    }
    signature(&head[..got]).map(|what| format!("{name} starts with {what}"))
}

/// Serialises the exclusive-open probes of this process.
static PROBE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// How much of a disk's start `signature` looks at: past btrfs's superblock at 64 KiB.
const HEAD: usize = 68 << 10;

/// The partition table or file system whose signature `head` (a disk's first bytes) carries.
pub fn signature(head: &[u8]) -> Option<&'static str> {
    let at = |off: usize, magic: &[u8]| head.get(off..off + magic.len()) == Some(magic);
    let le_u32 = |off: usize| {
        head.get(off..off + 4)
            .map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    };
    if at(512, b"EFI PART") || at(4096, b"EFI PART") {
        return Some("a GPT partition table");
    }
    if at(0, b"XFSB") {
        return Some("an XFS file system");
    }
    if at(0, b"LUKS\xba\xbe") {
        return Some("a LUKS header");
    }
    if (0..4).any(|s| at(s * 512, b"LABELONE")) {
        return Some("an LVM physical volume");
    }
    if at(0x10040, b"_BHRfS_M") {
        return Some("a btrfs file system");
    }
    if at(4086, b"SWAPSPACE2") || at(4086, b"SWAP-SPACE") {
        return Some("a swap area");
    }
    // ext2/3/4: the magic at 1080, with a block size and a block count that make sense (two
    // bytes alone would match random data one time in 65,536).
    if at(1080, &[0x53, 0xef])
        && le_u32(1024 + 24).is_some_and(|log| log <= 6)
        && le_u32(1024 + 4).is_some_and(|blocks| blocks != 0)
    {
        return Some("an ext2/3/4 file system");
    }
    // An MBR: the boot signature and at least one partition entry with a type.
    if at(510, &[0x55, 0xaa]) && (0..4).any(|i| head.get(446 + 16 * i + 4).is_some_and(|t| *t != 0))
    {
        return Some("an MBR partition table");
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn signatures_of_partition_tables_and_file_systems_are_named() {
        let blank = vec![0u8; HEAD];
        assert_eq!(signature(&blank), None);
        let with = |off: usize, magic: &[u8]| {
            let mut b = blank.clone();
            b[off..off + magic.len()].copy_from_slice(magic);
            b
        };
        assert_eq!(
            signature(&with(512, b"EFI PART")),
            Some("a GPT partition table")
        );
        assert_eq!(signature(&with(0, b"XFSB")), Some("an XFS file system"));
        assert_eq!(
            signature(&with(0x10040, b"_BHRfS_M")),
            Some("a btrfs file system")
        );
        assert_eq!(
            signature(&with(1536, b"LABELONE")),
            Some("an LVM physical volume")
        );
        let mut ext = with(1080, &[0x53, 0xef]);
        assert_eq!(
            signature(&ext),
            None,
            "a magic alone is not an ext superblock"
        );
        ext[1028] = 1;
        assert_eq!(signature(&ext), Some("an ext2/3/4 file system"));
        let mut mbr = with(510, &[0x55, 0xaa]);
        assert_eq!(signature(&mbr), None, "no partition entry");
        mbr[446 + 4] = 0x83;
        assert_eq!(signature(&mbr), Some("an MBR partition table"));
        // What a test's fio leaves: a fill pattern.
        assert_eq!(signature(&vec![0xef; HEAD]), None);
    }

    #[test]
    fn a_disk_with_holders_partitions_or_a_mount_is_the_hosts() {
        let sys = tempfile::tempdir().unwrap();
        let disk = sys.path().join("nvme1n1");
        std::fs::create_dir_all(disk.join("holders")).unwrap();
        std::fs::write(disk.join("dev"), "259:3\n").unwrap();
        let dev = sys.path().join("dev");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("nvme1n1"), vec![0u8; 8192]).unwrap();
        assert_eq!(host_use(&disk, &dev, ""), None, "a blank, unused disk");
        let mounts = "36 25 259:3 / /data rw,relatime shared:1 - xfs /dev/nvme1n1 rw\n";
        assert_eq!(
            host_use(&disk, &dev, mounts).as_deref(),
            Some("nvme1n1 is mounted at /data")
        );
        std::fs::create_dir_all(disk.join("nvme1n1p1")).unwrap();
        std::fs::write(disk.join("nvme1n1p1/partition"), "1\n").unwrap();
        assert_eq!(
            host_use(&disk, &dev, "").as_deref(),
            Some("nvme1n1 has partitions nvme1n1p1")
        );
        std::fs::create_dir_all(disk.join("holders/dm-0")).unwrap();
        assert_eq!(
            host_use(&disk, &dev, "").as_deref(),
            Some("nvme1n1 is held by dm-0")
        );
    }
}
