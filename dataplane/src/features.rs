//! The ublk feature mask: what the kernel offers (GET_FEATURES) and what a device was granted.

use crate::sys;
use std::fmt;

/// A set of `UBLK_F_*` bits.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Features(pub u64);

/// Every flag this crate knows, with the kernel's name (less the `UBLK_F_` prefix).
pub const KNOWN: &[(u64, &str)] = &[
    (sys::UBLK_F_SUPPORT_ZERO_COPY, "SUPPORT_ZERO_COPY"),
    (sys::UBLK_F_URING_CMD_COMP_IN_TASK, "URING_CMD_COMP_IN_TASK"),
    (sys::UBLK_F_NEED_GET_DATA, "NEED_GET_DATA"),
    (sys::UBLK_F_USER_RECOVERY, "USER_RECOVERY"),
    (sys::UBLK_F_USER_RECOVERY_REISSUE, "USER_RECOVERY_REISSUE"),
    (sys::UBLK_F_UNPRIVILEGED_DEV, "UNPRIVILEGED_DEV"),
    (sys::UBLK_F_CMD_IOCTL_ENCODE, "CMD_IOCTL_ENCODE"),
    (sys::UBLK_F_USER_COPY, "USER_COPY"),
    (sys::UBLK_F_ZONED, "ZONED"),
    (sys::UBLK_F_USER_RECOVERY_FAIL_IO, "USER_RECOVERY_FAIL_IO"),
    (sys::UBLK_F_UPDATE_SIZE, "UPDATE_SIZE"),
    (sys::UBLK_F_AUTO_BUF_REG, "AUTO_BUF_REG"),
    (sys::UBLK_F_QUIESCE, "QUIESCE"),
    (sys::UBLK_F_PER_IO_DAEMON, "PER_IO_DAEMON"),
    (sys::UBLK_F_BUF_REG_OFF_DAEMON, "BUF_REG_OFF_DAEMON"),
    (sys::UBLK_F_BATCH_IO, "BATCH_IO"),
    (sys::UBLK_F_INTEGRITY, "INTEGRITY"),
    (sys::UBLK_F_SAFE_STOP_DEV, "SAFE_STOP_DEV"),
    (sys::UBLK_F_NO_AUTO_PART_SCAN, "NO_AUTO_PART_SCAN"),
    (sys::UBLK_F_SHMEM_ZC, "SHMEM_ZC"),
    (sys::UBLK_F_IO_DESC_SIZE, "IO_DESC_SIZE"),
];

impl Features {
    pub const BATCH_IO: Features = Features(sys::UBLK_F_BATCH_IO);
    pub const AUTO_BUF_REG: Features = Features(sys::UBLK_F_AUTO_BUF_REG);
    pub const USER_RECOVERY: Features = Features(sys::UBLK_F_USER_RECOVERY);
    pub const USER_RECOVERY_REISSUE: Features = Features(sys::UBLK_F_USER_RECOVERY_REISSUE);
    pub const UPDATE_SIZE: Features = Features(sys::UBLK_F_UPDATE_SIZE);
    pub const QUIESCE: Features = Features(sys::UBLK_F_QUIESCE);
    /// What ublkd refuses to run without: a device outlives its server, and the next one takes
    /// it over, its in-flight requests reissued (ARCHITECTURE.md, "Crash safety").
    pub const RECOVERY: Features =
        Features(sys::UBLK_F_USER_RECOVERY | sys::UBLK_F_USER_RECOVERY_REISSUE);

    /// True when every bit of `other` is set here.
    pub fn contains(self, other: Features) -> bool {
        self.0 & other.0 == other.0
    }

    /// The bits of `wanted` not set here.
    pub fn missing(self, wanted: Features) -> Features {
        Features(wanted.0 & !self.0)
    }

    /// Names of the known flags that are set, in bit order.
    pub fn names(self) -> Vec<&'static str> {
        KNOWN
            .iter()
            .filter(|(bit, _)| self.0 & bit != 0)
            .map(|(_, name)| *name)
            .collect()
    }

    /// Bits set here that this crate has no name for (a newer kernel).
    pub fn unknown_bits(self) -> u64 {
        let known = KNOWN.iter().fold(0, |acc, (bit, _)| acc | bit);
        self.0 & !known
    }
}

impl std::ops::BitOr for Features {
    type Output = Features;
    fn bitor(self, rhs: Features) -> Features {
        Features(self.0 | rhs.0)
    }
}

impl fmt::Debug for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Features({:#x}: {})", self.0, self)
    }
}

impl fmt::Display for Features {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let names = self.names();
        if names.is_empty() {
            f.write_str("none")?;
        } else {
            f.write_str(&names.join("|"))?;
        }
        let unknown = self.unknown_bits();
        if unknown != 0 {
            write!(f, "|unknown({unknown:#x})")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_names_and_keeps_unknown_bits() {
        let f = Features(sys::UBLK_F_BATCH_IO | sys::UBLK_F_AUTO_BUF_REG | (1 << 40));
        assert_eq!(f.names(), vec!["AUTO_BUF_REG", "BATCH_IO"]);
        assert_eq!(f.unknown_bits(), 1 << 40);
        assert_eq!(
            f.to_string(),
            "AUTO_BUF_REG|BATCH_IO|unknown(0x10000000000)"
        );
        assert!(f.contains(Features::BATCH_IO));
        assert!(!f.contains(Features::QUIESCE));
    }

    #[test]
    fn known_table_has_one_entry_per_bit_in_order() {
        for (i, (bit, _)) in KNOWN.iter().enumerate() {
            assert_eq!(*bit, 1u64 << i);
        }
    }
}
