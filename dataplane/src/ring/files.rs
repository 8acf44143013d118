//! The bookkeeping of a ring's registered-file table: which descriptor sits in which slot, and
//! how many queues use it. The ring makes the matching `IORING_REGISTER_FILES_UPDATE` calls.

use std::os::fd::RawFd;

/// Slots of one ring's table, by descriptor.
#[derive(Debug, Default)]
pub struct FileTable {
    /// Indexed by raw fd: (table slot, users).
    by_fd: Vec<Option<(u32, u32)>>,
    free: Vec<u32>,
}

/// What adding a user of a descriptor asks of the ring.
#[derive(Debug, PartialEq, Eq)]
pub enum Added {
    /// Already in the table: one more user counted.
    Counted,
    /// Put the descriptor into this slot (then `placed`, or `unplaced` if the kernel refused).
    Place(u32),
    /// No slot left: ops on it go by descriptor.
    Full,
}

impl FileTable {
    pub fn with_slots(slots: u32) -> Self {
        Self {
            by_fd: Vec::new(),
            free: (0..slots).rev().collect(),
        }
    }

    pub fn add(&mut self, fd: RawFd) -> Added {
        let Ok(at) = usize::try_from(fd) else {
            return Added::Full;
        };
        if let Some(Some((_, users))) = self.by_fd.get_mut(at) {
            *users += 1;
            return Added::Counted;
        }
        self.free.pop().map_or(Added::Full, Added::Place)
    }

    /// The kernel holds `fd` in `slot` now.
    pub fn placed(&mut self, fd: RawFd, slot: u32) {
        let Ok(at) = usize::try_from(fd) else {
            return;
        };
        if self.by_fd.len() <= at {
            self.by_fd.resize(at + 1, None);
        }
        self.by_fd[at] = Some((slot, 1));
    }

    /// The kernel refused `slot` (or cleared it): it is free again.
    pub fn unplaced(&mut self, slot: u32) {
        self.free.push(slot);
    }

    /// One user of `fd` is done; returns the slot to clear when it was the last.
    pub fn remove(&mut self, fd: RawFd) -> Option<u32> {
        let entry = self.by_fd.get_mut(usize::try_from(fd).ok()?)?;
        let (slot, users) = entry.as_mut()?;
        *users -= 1;
        if *users > 0 {
            return None;
        }
        let slot = *slot;
        *entry = None;
        Some(slot)
    }

    pub fn slot(&self, fd: RawFd) -> Option<u32> {
        let (slot, _) = (*self.by_fd.get(usize::try_from(fd).ok()?)?)?;
        Some(slot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_follow_their_users() {
        let mut t = FileTable::with_slots(1);
        assert_eq!(t.add(7), Added::Place(0));
        t.placed(7, 0);
        assert_eq!(
            t.add(7),
            Added::Counted,
            "a second queue of the same device"
        );
        assert_eq!(t.add(9), Added::Full, "one slot only");
        assert_eq!(t.slot(7), Some(0));
        assert_eq!(t.remove(7), None, "one user left");
        assert_eq!(t.remove(7), Some(0), "the last user frees the slot");
        assert_eq!(t.slot(7), None);
        t.unplaced(0);
        assert_eq!(t.add(9), Added::Place(0));
        assert_eq!(t.remove(3), None, "never added");
    }
}
