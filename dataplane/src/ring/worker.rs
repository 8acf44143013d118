//! A worker's io_uring (SQE128/CQE32, single issuer) with an in-flight table.
//!
//! Every operation that points the kernel at memory takes an `Arc<Mapping>` for it; the ring keeps
//! that `Arc` in its in-flight table until the operation's last completion is reaped (for
//! multishot commands, the one without `IORING_CQE_F_MORE`). Buffers therefore outlive the
//! kernel's use however the caller's state changes. Offsets and lengths are checked against the
//! mapping, so every push is safe to call.

use super::files::{Added, FileTable};
use super::op::{FixedTable, Pins};
use super::sqe::use_fixed_file;
use super::RingError;
use super::{BufRing, Completion, Op};
use crate::sys::os::Mapping;
use io_uring::{cqueue, squeue, IoUring};
use std::os::fd::RawFd;
use std::sync::Arc;

/// Most io-wq helper threads one worker may have, for bounded and unbounded work, however many
/// queues it serves (`iowq_limits`).
pub const IOWQ_MAX_BOUNDED: u32 = 64;
pub const IOWQ_MAX_UNBOUNDED: u32 = 16;

/// The io-wq helper threads a worker serving `queues` queues may start: `[bounded, unbounded]`.
///
/// Work io_uring cannot do inline goes to io-wq: bounded work is regular files and block devices
/// (fsync, allocating or extending writes, a backing device whose queue is full), unbounded work
/// is everything else, here the copy fallback's READ/WRITE of `/dev/ublkcN`. One volume's flush
/// on a slow device holds its thread for the device's whole latency, and any other volume's
/// flush queued behind it waits as long: head-of-line blocking between tenants. So the bounded
/// limit grows by one per queue served (every queue can have a blocking operation running), the
/// unbounded one (only the rare copy fallback) by one per four, each from a floor of two and up
/// to the caps above. Helpers start on demand and exit after a few idle seconds, so a limit
/// costs nothing until it is used.
pub fn iowq_limits(queues: usize) -> [u32; 2] {
    let grow = |per: usize, cap: u32| (2 + queues / per).min(cap as usize) as u32;
    [grow(1, IOWQ_MAX_BOUNDED), grow(4, IOWQ_MAX_UNBOUNDED)]
}

/// What a fixed-buffer slot of the ring holds.
#[derive(Debug, Clone)]
enum Fixed {
    Free,
    /// Our memory, registered and pinned until unregistered.
    User(Arc<Mapping>),
    /// Reserved for request pages the kernel registers and unregisters itself (AUTO_BUF_REG).
    Kernel,
}

struct Slot {
    user_data: u64,
    /// Completes while it is submitted (`push_prompt`).
    prompt: bool,
    /// Held, never read: keeps the memory the kernel uses alive until the last completion.
    _pins: Pins,
}

/// The worker's ring.
pub struct WorkerRing {
    ring: IoUring<squeue::Entry128, cqueue::Entry32>,
    slots: Vec<Option<Slot>>,
    free: Vec<u32>,
    fixed: Vec<Fixed>,
    /// Registered files: an op on a registered fd is submitted as a fixed file, sparing the
    /// kernel a file lookup and reference per op.
    files: FileTable,
    in_flight: usize,
    /// Of `in_flight`, the ops pushed by `push_prompt` whose completion is not reaped yet.
    prompt_in_flight: usize,
}

impl FixedTable for WorkerRing {
    fn holds(&self, index: u16, buf: &Arc<Mapping>) -> bool {
        matches!(self.fixed.get(usize::from(index)), Some(Fixed::User(m)) if Arc::ptr_eq(m, buf))
    }

    fn is_kernel(&self, index: u16) -> bool {
        matches!(self.fixed.get(usize::from(index)), Some(Fixed::Kernel))
    }
}

/// Slots in each ring's registered-file table (one per ublk char device served), at most.
const FIXED_FILES: u32 = 4096;

impl std::fmt::Debug for WorkerRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkerRing")
            .field("in_flight", &self.in_flight)
            .finish()
    }
}

/// Sorts an `io_uring_enter` error: nothing to worry about (interrupted; EBUSY: the completion
/// queue is full or overflowed, which reaping clears; ETIME), transient (EAGAIN, ENOMEM: the
/// kernel is short of memory for a moment), or fatal (EBADR: completions were dropped; any
/// other).
fn enter_error(e: std::io::Error) -> Result<(), RingError> {
    match e.raw_os_error() {
        Some(libc::EINTR | libc::EBUSY | libc::ETIME) => Ok(()),
        Some(libc::EAGAIN | libc::ENOMEM) => Err(RingError::Transient(e)),
        _ => Err(RingError::Submit(e)),
    }
}

impl WorkerRing {
    /// Creates the ring on the calling thread, which becomes its only submitter.
    ///
    /// An `iopoll` ring polls for completions of polled I/O (NVMe passthrough on poll queues)
    /// instead of waiting for interrupts. It never sleeps in the kernel, so a worker sleeps on
    /// its other ring, which this one wakes through a registered eventfd; task work for it must
    /// therefore run on wakeup (no DEFER_TASKRUN; with the eventfd it measured no faster in the
    /// VM). It is cooperative (COOP_TASKRUN): task work still wakes a sleeping worker, but one
    /// that runs is not interrupted by an IPI, it sees IORING_SQ_TASKRUN and enters when it
    /// looks (a spinning worker looks all the time). Without it every ublk request of a spinning
    /// worker cost a reschedule IPI (docs/performance.md, "Polling with a dedicated worker CPU").
    ///
    /// The completion queue has `cq_entries` slots. Every ublk command a worker holds can
    /// complete at once, so it is sized for the most a worker serves; beyond that the kernel
    /// keeps overflowed completions in a list (IORING_FEAT_NODROP) that the next enter flushes,
    /// and reports -EBADR only if it could not allocate one, which the worker treats as fatal.
    pub fn new(
        entries: u32,
        cq_entries: u32,
        fixed_buffers: u32,
        iopoll: bool,
    ) -> Result<Self, RingError> {
        let mut b = IoUring::<squeue::Entry128, cqueue::Entry32>::builder();
        b.setup_single_issuer().setup_cqsize(cq_entries);
        b.setup_coop_taskrun().setup_taskrun_flag();
        if iopoll {
            b.setup_iopoll();
        } else {
            b.setup_defer_taskrun();
        }
        let ring = b.build(entries).map_err(RingError::Setup)?;
        ring.submitter()
            .register_buffers_sparse(fixed_buffers)
            .map_err(RingError::Setup)?;
        // The kernel refuses a table larger than RLIMIT_NOFILE; without one, ops go by
        // descriptor (`register_file` finds no free slot), which works as well, a bit slower.
        let files = FIXED_FILES
            .min(u32::try_from(crate::sys::os::open_files_limit()).unwrap_or(FIXED_FILES));
        let files = if ring.submitter().register_files_sparse(files).is_ok() {
            files
        } else {
            0
        };
        // Operations that block (fsync, fallocate, buffered I/O) run on io_uring's io-wq
        // threads; bounded by what the worker serves (`set_iowq_limits`), none yet.
        let mut max = iowq_limits(0);
        ring.submitter()
            .register_iowq_max_workers(&mut max)
            .map_err(RingError::Setup)?;
        Ok(Self {
            ring,
            slots: Vec::new(),
            free: Vec::new(),
            fixed: vec![Fixed::Free; fixed_buffers as usize],
            files: FileTable::with_slots(files),
            in_flight: 0,
            prompt_in_flight: 0,
        })
    }

    /// Sets the io-wq thread limits `[bounded, unbounded]` of the calling thread's io_uring
    /// context (shared by every ring the thread owns), so call it on the worker's own thread.
    pub fn set_iowq_limits(&self, limits: [u32; 2]) -> Result<(), RingError> {
        let mut max = limits;
        self.ring
            .submitter()
            .register_iowq_max_workers(&mut max)
            .map_err(RingError::Register)
    }

    /// Has every completion posted on this ring signal `fd` (an eventfd another ring reads).
    pub fn register_eventfd(&mut self, fd: RawFd) -> Result<(), RingError> {
        self.ring
            .submitter()
            .register_eventfd(fd)
            .map_err(RingError::Register)
    }

    /// Turns the registered eventfd's signals off (while the worker spins on this ring anyway)
    /// or back on (before it sleeps elsewhere).
    pub fn set_eventfd(&mut self, enabled: bool) {
        let cq = self.ring.completion();
        if enabled {
            cq.enable_eventfd();
        } else {
            cq.disable_eventfd();
        }
    }

    /// Reserves `n` fixed-buffer slots for the kernel to register request pages into
    /// (AUTO_BUF_REG); None when the table has fewer free slots.
    pub fn reserve_kernel_slots(&mut self, n: usize) -> Option<Vec<u16>> {
        let free: Vec<u16> = self
            .fixed
            .iter()
            .enumerate()
            .filter(|(_, f)| matches!(f, Fixed::Free))
            .filter_map(|(i, _)| u16::try_from(i).ok())
            .take(n)
            .collect();
        if free.len() < n {
            return None;
        }
        for &i in &free {
            self.fixed[usize::from(i)] = Fixed::Kernel;
        }
        Some(free)
    }

    /// Gives reserved slots back. The kernel unregisters request pages at each commit, and a
    /// queue releases its slots only once the kernel has answered all its commands.
    pub fn release_kernel_slots(&mut self, slots: &[u16]) {
        for &i in slots {
            if let Some(f @ Fixed::Kernel) = self.fixed.get_mut(usize::from(i)) {
                *f = Fixed::Free;
            }
        }
    }

    /// Registers `map` as a fixed buffer; returns its index.
    pub fn register_fixed(&mut self, map: &Arc<Mapping>) -> Result<u16, RingError> {
        let index = self
            .fixed
            .iter()
            .position(|f| matches!(f, Fixed::Free))
            .ok_or(RingError::NoFixedSlot)?;
        let iov = libc::iovec {
            iov_base: map.addr(0) as *mut libc::c_void,
            iov_len: map.len(),
        };
        // SAFETY: the iovec covers exactly `map`, which `self.fixed` keeps alive until the slot
        // is unregistered (the kernel pins the pages while registered).
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(index as u32, &[iov], None)
        }
        .map_err(RingError::Register)?;
        self.fixed[index] = Fixed::User(Arc::clone(map));
        u16::try_from(index).map_err(|_| RingError::NoFixedSlot)
    }

    /// Clears fixed buffer `index`. In-flight operations keep their own pins.
    pub fn unregister_fixed(&mut self, index: u16) -> Result<(), RingError> {
        let iov = libc::iovec {
            iov_base: std::ptr::null_mut(),
            iov_len: 0,
        };
        // SAFETY: an empty iovec clears the slot; no memory is handed over.
        unsafe {
            self.ring
                .submitter()
                .register_buffers_update(u32::from(index), &[iov], None)
        }
        .map_err(RingError::Register)?;
        if let Some(slot) = self.fixed.get_mut(usize::from(index)) {
            *slot = Fixed::Free;
        }
        Ok(())
    }

    /// Registers a provided-buffer ring for group `group`, filled with all its buffers.
    pub fn register_buf_ring(&mut self, group: &BufRing) -> Result<(), RingError> {
        // SAFETY: the ring memory is page-aligned, sized for `entries` entries and kept alive by
        // the BufRing's Arc, which the caller keeps until `unregister_buf_ring`; the kernel
        // additionally only reads buffers we publish through the tail.
        unsafe {
            self.ring.submitter().register_buf_ring_with_flags(
                group.ring.addr(0),
                group.entries,
                group.group,
                0,
            )
        }
        .map_err(RingError::Register)?;
        for bid in 0..group.entries {
            group.recycle(bid);
        }
        Ok(())
    }

    pub fn unregister_buf_ring(&mut self, group: u16) -> Result<(), RingError> {
        self.ring
            .submitter()
            .unregister_buf_ring(group)
            .map_err(RingError::Register)
    }

    /// Registers `fd` in this ring's file table (counting its users), so that ops on it are
    /// submitted as fixed files. The caller keeps `fd` open until its last `unregister_file`.
    /// A full table is no error: ops on `fd` then go by descriptor, as before.
    pub fn register_file(&mut self, fd: RawFd) -> Result<(), RingError> {
        let Added::Place(slot) = self.files.add(fd) else {
            return Ok(());
        };
        match self.ring.submitter().register_files_update(slot, &[fd]) {
            Ok(_) => {
                self.files.placed(fd, slot);
                Ok(())
            }
            Err(e) => {
                self.files.unplaced(slot);
                Err(RingError::Register(e))
            }
        }
    }

    /// One user of `fd` is done with it; the last one removes it from the table (ops in
    /// flight keep their own reference to the file).
    pub fn unregister_file(&mut self, fd: RawFd) {
        if let Some(slot) = self.files.remove(fd) {
            if self
                .ring
                .submitter()
                .register_files_update(slot, &[-1])
                .is_ok()
            {
                self.files.unplaced(slot);
            }
        }
    }

    /// Pushes `op`; its completion(s) will carry `user_data`.
    pub fn push(&mut self, op: Op<'_>, user_data: u64) -> Result<(), RingError> {
        self.push_op(op, user_data, false)
    }

    /// Pushes `op`, one the kernel completes while submitting it (a batch COMMIT): `sleep`
    /// waits for its completion on top of the one it sleeps for, so the enter that submits it
    /// does not return at once only to be followed by the enter that sleeps. If it completes
    /// later after all, the sleep lasts until it has.
    pub fn push_prompt(&mut self, op: Op<'_>, user_data: u64) -> Result<(), RingError> {
        self.push_op(op, user_data, true)
    }

    fn push_op(&mut self, op: Op<'_>, user_data: u64, prompt: bool) -> Result<(), RingError> {
        let fixed_file = op.fd().and_then(|fd| self.files.slot(fd));
        let (entry, pins) = op.encode(&*self)?;
        let slot = match self.free.pop() {
            Some(i) => i,
            None => {
                self.slots.push(None);
                u32::try_from(self.slots.len() - 1).map_err(|_| RingError::QueueFull)?
            }
        };
        let mut entry = entry.user_data(u64::from(slot));
        if let Some(file) = fixed_file {
            entry = use_fixed_file(entry, file);
        }
        if self.ring.submission().is_full() {
            self.submit()?;
        }
        // SAFETY: every address in `entry` lies inside a mapping that `Op::encode` checked and
        // returned in `pins`, stored in `self.slots[slot]` until the final completion for `slot` is reaped, or is an
        // offset into a kernel-owned buffer in a slot reserved for the kernel (the kernel checks
        // it against that buffer's length); fds are the kernel's business (a closed fd fails the
        // op, it does not touch memory).
        let pushed = unsafe { self.ring.submission().push(&entry) };
        if pushed.is_err() {
            self.free.push(slot);
            return Err(RingError::QueueFull);
        }
        self.slots[slot as usize] = Some(Slot {
            user_data,
            prompt,
            _pins: pins,
        });
        self.in_flight += 1;
        self.prompt_in_flight += usize::from(prompt);
        Ok(())
    }

    /// Submits pending SQEs without waiting.
    pub fn submit(&mut self) -> Result<(), RingError> {
        loop {
            match self.ring.submit() {
                Ok(_) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                Err(e) => return enter_error(e),
            }
        }
    }

    /// Submits pending SQEs and sleeps in the kernel until at least `want` completions arrive.
    pub fn submit_and_wait(&mut self, want: usize) -> Result<(), RingError> {
        match self.ring.submit_and_wait(want) {
            Ok(_) => Ok(()),
            Err(e) => enter_error(e),
        }
    }

    /// Submits pending SQEs and sleeps in the kernel until a completion arrives beyond those of
    /// prompt ops (`push_prompt`) still unreaped: one enter where a prompt op would take two.
    pub fn sleep(&mut self) -> Result<(), RingError> {
        self.submit_and_wait(1 + self.prompt_in_flight)
    }

    /// Whether entering the kernel would do anything without waiting: SQEs to submit, deferred
    /// task work to run, or an overflowed completion queue to flush.
    pub fn needs_enter(&mut self) -> bool {
        let sq = self.ring.submission();
        !sq.is_empty() || sq.taskrun() || sq.cq_overflow()
    }

    /// Whether completions wait to be reaped.
    pub fn has_completions(&mut self) -> bool {
        !self.ring.completion().is_empty()
    }

    /// Moves available completions into `out` (cleared first), releasing finished slots.
    pub fn reap(&mut self, out: &mut Vec<Completion>) {
        out.clear();
        for cqe in self.ring.completion() {
            let slot = cqe.user_data() as usize;
            let flags = cqe.flags();
            let Some(Some(entry)) = self.slots.get(slot) else {
                continue;
            };
            out.push(Completion {
                user_data: entry.user_data,
                result: cqe.result(),
                flags,
            });
            if !cqueue::more(flags) {
                self.prompt_in_flight -= usize::from(entry.prompt);
                self.slots[slot] = None;
                self.free.push(slot as u32);
                self.in_flight -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ring::{kernel_timespec, Region};
    use crate::sys::os::EventFd;
    use std::time::Duration;

    /// The sleep that submits a prompt op (an eventfd read with a count waiting, which
    /// completes inline as a batch COMMIT does) lasts until one more completion, the timeout's:
    /// one enter, not one that returns at once and another that sleeps.
    #[test]
    fn a_sleep_outlasts_the_prompt_completions_it_submits() {
        let mut ring = WorkerRing::new(8, 16, 1, false).unwrap();
        let event = EventFd::new().unwrap();
        event.notify().unwrap();
        let buf = Arc::new(Mapping::anonymous(4096).unwrap());
        assert!(buf.write_at(16, &kernel_timespec(Duration::from_millis(20))));
        let ts = Region {
            offset: 16,
            len: 16,
        };
        ring.push(Op::Timeout { ts: (&buf, ts) }, 2).unwrap();
        let read = Op::Read8 {
            fd: event.raw(),
            buf: &buf,
            offset: 0,
        };
        ring.push_prompt(read, 1).unwrap();
        ring.sleep().unwrap();
        let mut done = Vec::new();
        ring.reap(&mut done);
        let mut seen: Vec<(u64, i32)> = done.iter().map(|c| (c.user_data, c.result)).collect();
        seen.sort_unstable();
        assert_eq!(seen, [(1, 8), (2, -libc::ETIME)]);
        assert_eq!((ring.in_flight, ring.prompt_in_flight), (0, 0));
    }

    #[test]
    fn iowq_limits_grow_with_queues_up_to_the_caps() {
        assert_eq!(iowq_limits(0), [2, 2]);
        assert_eq!(iowq_limits(4), [6, 3]);
        assert_eq!(iowq_limits(32), [34, 10]);
        assert_eq!(iowq_limits(100_000), [IOWQ_MAX_BOUNDED, IOWQ_MAX_UNBOUNDED]);
        let mut last = iowq_limits(0);
        for q in 1..1000 {
            let l = iowq_limits(q);
            assert!(l[0] >= last[0] && l[1] >= last[1], "monotone at {q}");
            last = l;
        }
    }
}
