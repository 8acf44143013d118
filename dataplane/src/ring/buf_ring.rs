//! A provided-buffer ring: buffers the kernel picks from for multishot FETCH_IO_CMDS.

use crate::sys::os::Mapping;
use std::io;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::Arc;

/// A provided-buffer ring: `entries` buffers of `buf_len` bytes in `bufs`, published to the
/// kernel through the ring in `ring`.
#[derive(Debug)]
pub struct BufRing {
    pub(super) ring: Arc<Mapping>,
    pub(super) bufs: Arc<Mapping>,
    pub(super) entries: u16,
    buf_len: u32,
    pub(super) group: u16,
    tail: std::cell::Cell<u16>,
}

impl BufRing {
    /// `entries` must be a power of two.
    pub fn new(group: u16, entries: u16, buf_len: u32) -> io::Result<Self> {
        if !entries.is_power_of_two() {
            return Err(io::Error::from_raw_os_error(libc::EINVAL));
        }
        Ok(Self {
            ring: Arc::new(Mapping::anonymous(usize::from(entries) * 16)?),
            bufs: Arc::new(Mapping::anonymous(usize::from(entries) * buf_len as usize)?),
            entries,
            buf_len,
            group,
            tail: std::cell::Cell::new(0),
        })
    }

    pub fn group(&self) -> u16 {
        self.group
    }

    /// Copies the u16 values the kernel wrote into buffer `bid` (`bytes` long) into `out`.
    pub fn read_u16s(&self, bid: u16, bytes: usize, out: &mut Vec<u16>) {
        out.clear();
        if bid >= self.entries || bytes > self.buf_len as usize {
            return;
        }
        let base = usize::from(bid) * self.buf_len as usize;
        let mut pair = [0u8; 2];
        for i in 0..bytes / 2 {
            if self.bufs.read_at(base + 2 * i, &mut pair) {
                out.push(u16::from_ne_bytes(pair));
            }
        }
    }

    /// Gives buffer `bid` back to the kernel.
    pub fn recycle(&self, bid: u16) {
        if bid >= self.entries {
            return;
        }
        let tail = self.tail.get();
        let idx = usize::from(tail & (self.entries - 1));
        let mut entry = [0u8; 16];
        entry[0..8].copy_from_slice(
            &self
                .bufs
                .addr(usize::from(bid) * self.buf_len as usize)
                .to_ne_bytes(),
        );
        entry[8..12].copy_from_slice(&self.buf_len.to_ne_bytes());
        entry[12..14].copy_from_slice(&bid.to_ne_bytes());
        // Bytes 14..16 of entry 0 are the shared tail: never overwrite them with an entry.
        let len = if idx == 0 { 14 } else { 16 };
        self.ring.write_at(idx * 16, &entry[..len]);
        let new_tail = tail.wrapping_add(1);
        self.tail.set(new_tail);
        // SAFETY: offset 14 of the (page-aligned) ring mapping is the kernel's u16 tail, aligned
        // to 2; the release store publishes the entry written above.
        let tail_ref = unsafe { &*(self.ring.addr(14) as *const AtomicU16) };
        tail_ref.store(new_tail, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buf_ring_publishes_entries_and_tail() {
        let r = BufRing::new(1, 4, 64).unwrap();
        for bid in 0..4 {
            r.recycle(bid);
        }
        let mut tail = [0u8; 2];
        assert!(r.ring.read_at(14, &mut tail));
        assert_eq!(u16::from_ne_bytes(tail), 4);
        let mut e = [0u8; 12];
        assert!(r.ring.read_at(16 * 2, &mut e));
        assert_eq!(
            u64::from_ne_bytes(e[0..8].try_into().unwrap()),
            r.bufs.addr(128)
        );
        assert_eq!(u32::from_ne_bytes(e[8..12].try_into().unwrap()), 64);
    }
}
