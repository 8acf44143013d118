//! The pinned worker thread: one io_uring, the queues of every device mapped to it, and the
//! backends' I/O for them.
//!
//! A worker sleeps in `io_uring_enter` until something completes: a ublk fetch (a new request),
//! a backend operation, a commit, or a read of its eventfd (a command from the control thread).
//! Per loop iteration it handles every completion, then sends each batch queue's finished tags in
//! one COMMIT_IO_CMDS.
//!
//! Queues of polled NVMe volumes live on a second ring with IORING_SETUP_IOPOLL (created on first
//! use). While passthrough I/O is in flight there, the worker spins on it; when none is, it
//! sleeps on the main ring, which the poll ring wakes through the same eventfd.

use crate::backend::{Backend, Data, IoCtx, Request, Started};
use crate::device::IoPath;
use crate::ring::{BufRing, Completion, Op, Region, RingError, WorkerRing};
use crate::stats::{OpKind, QueueStats, WorkerStats};
use crate::sys::os::{DescMap, EventFd, Mapping};
use crate::sys::{self, ublk_batch_io, ublksrv_io_cmd};
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::Instant;

const K_EVENT: u64 = 1;
const K_IO: u64 = 2;
const K_BACKEND: u64 = 3;
const K_PREP: u64 = 4;
const K_FETCH: u64 = 5;
const K_COMMIT: u64 = 6;
const K_COPY_IN: u64 = 7;
const K_COPY_OUT: u64 = 8;
const K_RETRY: u64 = 9;

/// Times a backend operation that failed for a passing reason is sent again, and the first
/// back-off (doubled each time: 1, 2, 4, 8, 16 ms).
const MAX_RETRIES: u8 = 5;
const FIRST_BACKOFF_NS: i64 = 1_000_000;

fn ud(kind: u64, slot: u16, low: u16) -> u64 {
    (kind << 56) | (u64::from(slot) << 32) | u64::from(low)
}

fn ud_parts(ud: u64) -> (u64, u16, u16) {
    (ud >> 56, (ud >> 32) as u16, ud as u16)
}

/// Fixed-buffer slots per worker ring: the kernel's maximum, since zero copy takes one per tag.
const FIXED_BUFFERS: u32 = 16384;
/// Completion-queue slots of a worker's main ring: one for every zero-copy tag it can serve
/// (the buffer table bounds those), plus its own commands.
const MAIN_CQ_ENTRIES: u32 = FIXED_BUFFERS * 2;
/// Completion-queue slots of a worker's poll ring.
const POLL_CQ_ENTRIES: u32 = POLL_FIXED_BUFFERS * 2;
/// Fixed-buffer slots of a worker's poll ring.
const POLL_FIXED_BUFFERS: u32 = 8192;
/// The buffer slot handed to the kernel when every registration must fail (test hook).
const NO_SLOT: u16 = u16::MAX;
/// Commit buffers per batch queue, so a new commit can go out while one is in flight.
const COMMIT_BUFS: usize = 2;
/// Most fetch buffers per provided-buffer group. Each multishot completion takes a whole buffer
/// and carries at least one tag, and a tag is not delivered again before we commit it, so
/// `depth` buffers per group mean the kernel never runs out (-ENOBUFS). Running out would end
/// the fetch with tags still queued in the kernel, and with both fetches ended those tags wait
/// for the next request to arrive: a stall if none comes.
const MAX_FETCH_BUFS: u16 = 256;
/// Batch element sizes: with a buffer address (copy mode), and the bare header (zero copy).
const ELEM_BYTES_COPY: u8 = 16;
const ELEM_BYTES_ZC: u8 = 8;

/// Which of the worker's rings a queue's commands go on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// ublk and backend commands on the main (interrupt-driven) ring.
    Main,
    /// ublk and backend commands on the poll ring (Linux >= 7.1 lets ublk commands share an
    /// IOPOLL ring), so zero copy and polling work together.
    Poll,
    /// ublk commands on the main ring, backend commands on the poll ring (older kernels; the
    /// data is copied, since a kernel buffer lives in one ring's table only).
    Split,
}

impl Placement {
    fn ublk_on_poll(self) -> bool {
        self == Placement::Poll
    }

    fn backend_on_poll(self) -> bool {
        self != Placement::Main
    }
}

/// Everything a worker needs to serve one queue of a device.
#[derive(Debug)]
pub struct QueueSetup {
    pub dev_id: u32,
    pub q_id: u16,
    pub depth: u16,
    pub max_io: u32,
    pub path: IoPath,
    /// The kernel registers each request's pages in a slot of the ublk ring (AUTO_BUF_REG).
    pub zero_copy: bool,
    /// The device has UBLK_F_USER_COPY: requests whose registration failed are copied through
    /// `/dev/ublkcN` (the AUTO_BUF_REG fallback).
    pub user_copy: bool,
    pub force_fallback: bool,
    /// With zero copy and no buffer slot left on this worker: serve every request by copy
    /// (the AUTO_BUF_REG fallback) instead of refusing the queue.
    pub copy_if_no_slots: bool,
    pub placement: Placement,
    pub cdev: Arc<File>,
    pub backend: Arc<dyn Backend>,
    pub stats: Arc<QueueStats>,
    /// Told when the queue has been torn down (after the kernel aborted its commands).
    pub gone: Sender<(u32, u16)>,
}

/// Errors of a worker, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("worker ring")]
    Ring(#[from] RingError),
    #[error("cannot map the queue's descriptors")]
    MapDescriptors(#[source] std::io::Error),
    #[error("cannot allocate buffers")]
    Buffers(#[source] std::io::Error),
    #[error("worker has no free queue slot")]
    Full,
    #[error("the kernel refused the queue's commands (errno {0})")]
    Refused(i32),
    #[error("the queue stopped before the kernel accepted its commands")]
    Stopped,
    #[error("fault injected by a test hook")]
    Injected,
}

/// A failed attach. `held`: the worker still holds commands of the queue in the kernel and
/// reports the queue gone (as for any other queue) once the kernel lets go of them; otherwise
/// nothing of the queue remains and no report follows.
#[derive(Debug, thiserror::Error)]
#[error("{source}")]
pub struct AttachError {
    #[source]
    pub source: WorkerError,
    pub held: bool,
}

type AttachReply = SyncSender<Result<(), AttachError>>;

/// Commands a worker takes from the control thread.
#[derive(Debug)]
pub enum WorkerCmd {
    /// Start serving a queue: map it, arm its fetches; reply once the kernel has accepted them
    /// (batch: PREP_IO_CMDS completed; per-IO: the FETCH_REQs were submitted and none failed).
    Attach(Box<QueueSetup>, AttachReply),
    /// Exit once no queue is left.
    Shutdown,
    /// Stop serving at once and never release the ring: the process is about to exit and the
    /// kernel's own cleanup (as after a crash) hands the devices to the next server.
    Abandon,
}

#[derive(Debug, Clone, Copy)]
struct Tag {
    req: Request,
    started: Option<Instant>,
    /// Zero copy failed to register this request's buffer: it is served by copy.
    fallback: bool,
    /// The backend's result while a fallback read's data is copied out to the kernel.
    result: i32,
    /// Times the backend operation was sent again.
    retries: u8,
}

#[derive(Debug)]
struct Batch {
    groups: [BufRing; 2],
    commit: [Arc<Mapping>; COMMIT_BUFS],
    /// Elements (tag, result) of the commit in flight in each commit buffer.
    committing: [Vec<(u16, i32)>; COMMIT_BUFS],
    busy: [bool; COMMIT_BUFS],
    pending: Vec<(u16, i32)>,
    scratch: Vec<u16>,
}

#[derive(Debug)]
struct Queue {
    setup: Box<QueueSetup>,
    desc: DescMap,
    /// Copy buffers, one `max_io` region per tag. With zero copy they exist only once a request
    /// needs the fallback.
    bufs: Option<Arc<Mapping>>,
    /// Fixed-buffer slot of `bufs` on the backend's ring, when the backend reads and writes
    /// through the ring.
    buf_index: Option<u16>,
    /// Zero copy: each tag's slot in the ublk ring's buffer table (reserved for the kernel).
    zc_slots: Vec<u16>,
    /// Per-tag command payload memory (16 bytes per tag).
    scratch: Arc<Mapping>,
    tags: Vec<Tag>,
    batch: Option<Batch>,
    /// Operations of this queue the kernel still holds.
    outstanding: usize,
    /// The kernel aborted a fetch: the device is going away.
    stopping: bool,
    /// The control thread waits for the kernel to accept this queue's commands.
    attach_reply: Option<AttachReply>,
}

impl Queue {
    fn fd(&self) -> i32 {
        self.setup.cdev.as_raw_fd()
    }

    fn tag_region(&self, tag: u16) -> Region {
        Region {
            offset: usize::from(tag) * self.setup.max_io as usize,
            len: self.setup.max_io as usize,
        }
    }

    fn elem_bytes(&self) -> u8 {
        if self.setup.zero_copy {
            ELEM_BYTES_ZC
        } else {
            ELEM_BYTES_COPY
        }
    }

    /// The kernel buffer slot of `tag` (zero copy).
    fn zc_slot(&self, tag: u16) -> u16 {
        self.zc_slots
            .get(usize::from(tag))
            .copied()
            .unwrap_or(NO_SLOT)
    }

    /// The AUTO_BUF_REG word for `tag`'s next request (zero copy), else None.
    fn auto_buf(&self, tag: u16) -> Option<u64> {
        self.setup
            .zero_copy
            .then(|| sys::auto_buf_reg(self.zc_slot(tag), self.fallback_flag()))
    }

    fn fallback_flag(&self) -> u8 {
        if self.setup.user_copy {
            sys::UBLK_AUTO_BUF_REG_FALLBACK
        } else {
            0
        }
    }

    /// Copy mode's per-tag buffer for a ublk command (None with zero copy).
    fn cmd_buf(&self, tag: u16) -> Option<(&Arc<Mapping>, Region)> {
        if self.setup.zero_copy {
            return None;
        }
        self.bufs.as_ref().map(|b| (b, self.tag_region(tag)))
    }

    /// `tag`'s command payload (one NVMe DSM range).
    fn scratch_region(&self, tag: u16) -> Region {
        Region {
            offset: usize::from(tag) * SCRATCH_BYTES,
            len: PAYLOAD_BYTES,
        }
    }

    /// `tag`'s back-off timespec, apart from its payload (a retried discard still needs it).
    fn timespec_region(&self, tag: u16) -> Region {
        Region {
            offset: usize::from(tag) * SCRATCH_BYTES + PAYLOAD_BYTES,
            len: 16,
        }
    }
}

/// Command payload bytes per tag (one NVMe DSM range).
const PAYLOAD_BYTES: usize = 16;
/// Scratch bytes per tag: the payload, then a `__kernel_timespec` for retry back-offs.
const SCRATCH_BYTES: usize = PAYLOAD_BYTES + 16;

/// A worker's rings: the main one, and the IOPOLL one once a polled queue needs it.
#[derive(Debug)]
struct Rings {
    main: WorkerRing,
    poll: Option<WorkerRing>,
    /// Backend operations in flight on the poll ring: while any are, the worker spins.
    polled: usize,
}

impl Rings {
    fn get(&mut self, on_poll: bool) -> &mut WorkerRing {
        match (on_poll, self.poll.as_mut()) {
            (true, Some(p)) => p,
            _ => &mut self.main,
        }
    }
}

/// One worker thread's state.
#[derive(Debug)]
pub struct Worker {
    rings: Rings,
    queues: Vec<Option<Queue>>,
    rx: Receiver<WorkerCmd>,
    event: Arc<EventFd>,
    event_buf: Arc<Mapping>,
    stats: Arc<WorkerStats>,
    cqes: Vec<Completion>,
    dirty: Vec<u16>,
    /// Requests started in this loop iteration.
    handled: u64,
    /// Queues whose attach is not answered yet.
    attaching: Vec<u16>,
    /// Stopping queues to look at for teardown (those whose commands may all be back).
    dying: Vec<u16>,
    /// Queues in `queues` (attached, attaching or stopping): what the io-wq limits follow.
    live: usize,
    shutdown: bool,
    abandon: bool,
}

impl Worker {
    pub fn new(
        rx: Receiver<WorkerCmd>,
        event: Arc<EventFd>,
        stats: Arc<WorkerStats>,
    ) -> Result<Self, WorkerError> {
        stats.set_iowq_limits(crate::ring::iowq_limits(0));
        Ok(Self {
            rings: Rings {
                main: WorkerRing::new(1024, MAIN_CQ_ENTRIES, FIXED_BUFFERS, false)?,
                poll: None,
                polled: 0,
            },
            queues: Vec::new(),
            rx,
            event,
            event_buf: Arc::new(Mapping::anonymous(8).map_err(WorkerError::Buffers)?),
            stats,
            cqes: Vec::with_capacity(1024),
            dirty: Vec::new(),
            handled: 0,
            attaching: Vec::new(),
            dying: Vec::new(),
            live: 0,
            shutdown: false,
            abandon: false,
        })
    }

    /// Serves until shut down with no queue left. A fatal ring error stops the service, not
    /// the thread: the worker marks its queues failed, reports itself down and parks with the
    /// ring and every buffer the kernel may still write to kept mapped until the process exits.
    pub fn run(mut self) {
        if let Err(e) = self.serve() {
            let errno = match &e {
                WorkerError::Ring(r) => r.errno(),
                _ => libc::EIO,
            };
            self.stats.down(errno);
            for q in self.queues.iter_mut().flatten() {
                q.setup.stats.worker_failed(errno);
                if let Some(reply) = q.attach_reply.take() {
                    let _ = reply.send(Err(AttachError {
                        source: WorkerError::Stopped,
                        held: true,
                    }));
                }
            }
            // Attaches still coming get an answer; nothing else is served.
            while let Ok(cmd) = self.rx.recv() {
                if let WorkerCmd::Attach(_, reply) = cmd {
                    let _ = reply.send(Err(AttachError {
                        source: WorkerError::Stopped,
                        held: false,
                    }));
                }
            }
            loop {
                std::thread::park();
            }
        }
    }

    fn serve(&mut self) -> Result<(), WorkerError> {
        self.arm_event()?;
        let mut pause = std::time::Duration::from_micros(100);
        loop {
            let idle_from = Instant::now();
            match self.wait() {
                Ok(()) => pause = std::time::Duration::from_micros(100),
                Err(WorkerError::Ring(RingError::Transient(_))) => {
                    // Short of memory for a moment: back off, then reap what did complete.
                    self.stats.ring_retry();
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(std::time::Duration::from_millis(50));
                }
                Err(e) => return Err(e),
            }
            let busy_from = Instant::now();
            self.stats.idle(busy_from - idle_from);
            let mut cqes = std::mem::take(&mut self.cqes);
            for on_poll in [false, true] {
                if on_poll && self.rings.poll.is_none() {
                    continue;
                }
                self.rings.get(on_poll).reap(&mut cqes);
                for c in &cqes {
                    self.dispatch(*c, on_poll)?;
                    // Only a queue that just had a completion can have become dead.
                    let (_, slot, _) = ud_parts(c.user_data);
                    if matches!(self.queues.get(usize::from(slot)), Some(Some(q)) if q.stopping) {
                        self.dying.push(slot);
                    }
                }
            }
            self.cqes = cqes;
            if !self.attaching.is_empty() {
                self.answer_attaches();
            }
            self.flush_commits();
            self.stats.batch(std::mem::take(&mut self.handled));
            self.reap_dead_queues();
            self.stats.busy(busy_from.elapsed());
            if self.shutdown && self.queues.iter().all(Option::is_none) {
                return Ok(());
            }
            if self.abandon {
                // Keep the ring and every buffer it points at alive until the process exits.
                loop {
                    std::thread::park();
                }
            }
        }
    }

    /// Submits what is queued and waits for work: spins on the poll ring while polled I/O is in
    /// flight, else sleeps on the main ring (the poll ring's completions signal its eventfd).
    fn wait(&mut self) -> Result<(), WorkerError> {
        if crate::hooks::fire(crate::hooks::Fault::RingTransient) {
            let e = std::io::Error::from_raw_os_error(libc::EAGAIN);
            return Err(RingError::Transient(e).into());
        }
        if crate::hooks::fire(crate::hooks::Fault::RingFatal) {
            return Err(RingError::Submit(std::io::Error::from_raw_os_error(libc::EBADR)).into());
        }
        let Some(poll) = self.rings.poll.as_mut() else {
            self.rings.main.submit_and_wait(1)?;
            return Ok(());
        };
        if self.rings.polled > 0 {
            // Each enter on an IOPOLL ring polls the device once; the main ring is entered only
            // when it has something to do, so a spinning worker makes one syscall per pass.
            poll.set_eventfd(false);
            poll.submit()?;
            if self.rings.main.needs_enter() {
                self.rings.main.submit()?;
            }
            return Ok(());
        }
        // Work queued while the eventfd was off did not signal it: run it and look first.
        // (Skipping this enter when nothing is queued measured slower for polled NVMe.)
        poll.set_eventfd(true);
        poll.submit()?;
        if poll.has_completions() || poll.needs_enter() {
            self.rings.main.submit()?;
        } else {
            self.rings.main.submit_and_wait(1)?;
        }
        Ok(())
    }

    fn arm_event(&mut self) -> Result<(), WorkerError> {
        self.rings.main.push(
            Op::Read8 {
                fd: self.event.raw(),
                buf: &self.event_buf,
                offset: 0,
            },
            ud(K_EVENT, 0, 0),
        )?;
        Ok(())
    }

    fn dispatch(&mut self, c: Completion, on_poll: bool) -> Result<(), WorkerError> {
        let (kind, slot, low) = ud_parts(c.user_data);
        match kind {
            K_EVENT => {
                self.commands();
                self.arm_event()?;
            }
            K_IO => self.on_io_cmd(slot, low, c.result),
            K_BACKEND => {
                if on_poll {
                    self.rings.polled = self.rings.polled.saturating_sub(1);
                }
                self.on_backend(slot, low, c.result)
            }
            K_PREP => self.on_prep(slot, c.result),
            K_FETCH => self.on_fetch(slot, low, c),
            K_COMMIT => self.on_commit(slot, low, c.result),
            K_COPY_IN => self.on_copy_in(slot, low, c.result),
            K_COPY_OUT => self.on_copy_out(slot, low, c.result),
            K_RETRY => self.on_retry(slot, low),
            _ => {}
        }
        Ok(())
    }

    fn commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                WorkerCmd::Attach(setup, reply) => {
                    if let Err(e) = self.attach(setup, reply.clone()) {
                        let _ = reply.send(Err(e));
                    }
                }
                WorkerCmd::Shutdown => self.shutdown = true,
                WorkerCmd::Abandon => self.abandon = true,
            }
        }
    }

    /// Maps the queue and arms its commands. On success the reply is sent once the kernel has
    /// accepted them (`answer_attaches`); on failure the caller sends it.
    fn attach(&mut self, setup: Box<QueueSetup>, reply: AttachReply) -> Result<(), AttachError> {
        let clean = |source| AttachError {
            source,
            held: false,
        };
        let slot = match self.queues.iter().position(Option::is_none) {
            Some(i) => i,
            None => {
                self.queues.push(None);
                self.queues.len() - 1
            }
        };
        let slot16 = u16::try_from(slot).map_err(|_| clean(WorkerError::Full))?;
        if setup.placement != Placement::Main && self.rings.poll.is_none() {
            let mut poll = WorkerRing::new(1024, POLL_CQ_ENTRIES, POLL_FIXED_BUFFERS, true)
                .map_err(|e| clean(e.into()))?;
            poll.register_eventfd(self.event.raw())
                .map_err(|e| clean(e.into()))?;
            self.rings.poll = Some(poll);
        }
        let desc = DescMap::map(&setup.cdev, setup.q_id, setup.depth)
            .map_err(|e| clean(WorkerError::MapDescriptors(e)))?;
        if setup.q_id > 0 && crate::hooks::fire(crate::hooks::Fault::AttachFails) {
            return Err(clean(WorkerError::Injected));
        }
        let depth = usize::from(setup.depth);
        let zc_slots = if !setup.zero_copy {
            Vec::new()
        } else if setup.force_fallback {
            vec![NO_SLOT; depth]
        } else {
            match self
                .rings
                .get(setup.placement.ublk_on_poll())
                .reserve_kernel_slots(depth)
            {
                Some(slots) => slots,
                // Out of slots: every request takes the fallback, served by copy, only when
                // asked; otherwise the queue is refused so it can go where slots are.
                None if setup.copy_if_no_slots && setup.user_copy => vec![NO_SLOT; depth],
                None => return Err(clean(WorkerError::Ring(RingError::NoFixedSlot))),
            }
        };
        let idle = Tag {
            req: Request::from_desc(&sys::ublksrv_io_desc::default()),
            started: None,
            fallback: false,
            result: 0,
            retries: 0,
        };
        let scratch = match Mapping::anonymous(depth * SCRATCH_BYTES) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                self.release_zc_slots(&setup, &zc_slots);
                return Err(clean(WorkerError::Buffers(e)));
            }
        };
        let mut q = Queue {
            tags: vec![idle; depth],
            setup,
            desc,
            bufs: None,
            buf_index: None,
            zc_slots,
            scratch,
            batch: None,
            outstanding: 0,
            stopping: false,
            attach_reply: None,
        };
        if !q.setup.zero_copy {
            if let Err(e) = Self::ensure_bufs(&mut self.rings, &mut q) {
                self.release_slots(&q);
                return Err(clean(e));
            }
        }
        let armed = match q.setup.path {
            IoPath::Batch => self.arm_batch(&mut q, slot16),
            _ => self.arm_per_io(&mut q, slot16),
        };
        let on_poll = q.setup.placement.ublk_on_poll();
        // From here the queue stays in place until the kernel has answered every command
        // pushed for it (`reap_dead_queues` then reports it gone).
        let result = armed.and_then(|()| Ok(self.rings.get(on_poll).submit()?));
        self.register_files(&q);
        self.live += 1;
        self.fit_iowq();
        match result {
            Ok(()) => {
                q.attach_reply = Some(reply);
                self.queues[slot] = Some(q);
                self.attaching.push(slot16);
                Ok(())
            }
            Err(source) => {
                q.stopping = true;
                self.queues[slot] = Some(q);
                self.dying.push(slot16);
                Err(AttachError { source, held: true })
            }
        }
    }

    /// Registers the queue's char device with the ring its commands go to, for the rest of its
    /// life (`unregister_files` at teardown): its commands then skip the kernel's per-op file
    /// lookup. Commands already pushed went by descriptor, which is as good; a refusal leaves
    /// them so. Backend descriptors stay unregistered: measured, it bought nothing there.
    fn register_files(&mut self, q: &Queue) {
        let _ = self
            .rings
            .get(q.setup.placement.ublk_on_poll())
            .register_file(q.setup.cdev.as_raw_fd());
    }

    fn unregister_files(&mut self, q: &Queue) {
        self.rings
            .get(q.setup.placement.ublk_on_poll())
            .unregister_file(q.setup.cdev.as_raw_fd());
    }

    /// Sets this thread's io-wq limits for the queues it now serves (`ring::iowq_limits`). A
    /// refusal keeps the previous limits, which the worker's stats go on showing.
    fn fit_iowq(&mut self) {
        let want = crate::ring::iowq_limits(self.live);
        if want != self.stats.iowq_limits() && self.rings.main.set_iowq_limits(want).is_ok() {
            self.stats.set_iowq_limits(want);
        }
    }

    /// Answers attaches whose commands the kernel has accepted or refused. Batch queues are
    /// answered by their PREP completion (`on_prep`); a per-IO queue once its FETCH_REQs were
    /// submitted and no completion is left to look at (a refused fetch completes at once).
    fn answer_attaches(&mut self) {
        let mut waiting = std::mem::take(&mut self.attaching);
        waiting.retain(|&slot| {
            let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
                return false;
            };
            let Some(reply) = q.attach_reply.as_ref() else {
                return false;
            };
            if q.stopping {
                let _ = reply.send(Err(AttachError {
                    source: WorkerError::Stopped,
                    held: true,
                }));
                q.attach_reply = None;
                return false;
            }
            if q.batch.is_some() {
                return true;
            }
            let on_poll = q.setup.placement.ublk_on_poll();
            if self.rings.get(on_poll).has_completions() {
                return true;
            }
            let _ = reply.send(Ok(()));
            q.attach_reply = None;
            false
        });
        self.attaching = waiting;
    }

    /// Allocates the queue's copy buffers (and registers them with the backend's ring) unless
    /// they exist.
    fn ensure_bufs(rings: &mut Rings, q: &mut Queue) -> Result<(), WorkerError> {
        if q.bufs.is_some() {
            return Ok(());
        }
        let bufs = Arc::new(
            Mapping::anonymous(usize::from(q.setup.depth) * q.setup.max_io as usize)
                .map_err(WorkerError::Buffers)?,
        );
        if q.setup.backend.uses_fixed_buffers() {
            let ring = rings.get(q.setup.placement.backend_on_poll());
            q.buf_index = Some(ring.register_fixed(&bufs)?);
        }
        q.setup.stats.copy_buffers(bufs.len() as u64);
        q.bufs = Some(bufs);
        Ok(())
    }

    fn release_slots(&mut self, q: &Queue) {
        self.release_zc_slots(&q.setup, &q.zc_slots);
    }

    fn release_zc_slots(&mut self, setup: &QueueSetup, zc_slots: &[u16]) {
        let slots: Vec<u16> = zc_slots.iter().copied().filter(|&s| s != NO_SLOT).collect();
        self.rings
            .get(setup.placement.ublk_on_poll())
            .release_kernel_slots(&slots);
    }

    fn arm_per_io(&mut self, q: &mut Queue, slot: u16) -> Result<(), WorkerError> {
        for tag in 0..q.setup.depth {
            let cmd = ublksrv_io_cmd {
                q_id: q.setup.q_id,
                tag,
                result: 0,
                addr: 0,
            };
            self.rings.get(q.setup.placement.ublk_on_poll()).push(
                Op::UblkIo {
                    fd: q.fd(),
                    cmd_op: sys::UBLK_U_IO_FETCH_REQ,
                    cmd,
                    buf: q.cmd_buf(tag),
                    auto_buf: q.auto_buf(tag),
                },
                ud(K_IO, slot, tag),
            )?;
            q.outstanding += 1;
        }
        Ok(())
    }

    fn arm_batch(&mut self, q: &mut Queue, slot: u16) -> Result<(), WorkerError> {
        let depth = usize::from(q.setup.depth);
        let eb = q.elem_bytes();
        let elems = depth * usize::from(eb);
        let alloc = |len| Mapping::anonymous(len).map(Arc::new);
        let prep = alloc(elems).map_err(WorkerError::Buffers)?;
        for tag in 0..q.setup.depth {
            let e = Self::elem_for(q, tag, 0);
            prep.write_at(usize::from(tag) * usize::from(eb), &e[..usize::from(eb)]);
        }
        let fetch_len = u32::try_from((depth * 2).next_multiple_of(64)).unwrap_or(u32::MAX);
        let fetch_bufs = q.setup.depth.next_power_of_two().clamp(4, MAX_FETCH_BUFS);
        let group =
            |k: u16| BufRing::new(slot.wrapping_mul(2).wrapping_add(k), fetch_bufs, fetch_len);
        let groups = [
            group(0).map_err(WorkerError::Buffers)?,
            group(1).map_err(WorkerError::Buffers)?,
        ];
        let commit = [
            alloc(elems).map_err(WorkerError::Buffers)?,
            alloc(elems).map_err(WorkerError::Buffers)?,
        ];
        let ring = self.rings.get(q.setup.placement.ublk_on_poll());
        ring.push(
            Op::UblkBatch {
                fd: q.fd(),
                cmd_op: sys::UBLK_U_IO_PREP_IO_CMDS,
                cmd: ublk_batch_io {
                    q_id: q.setup.q_id,
                    flags: Self::batch_flags(q),
                    nr_elem: q.setup.depth,
                    elem_bytes: eb,
                    ..Default::default()
                },
                elems: (
                    &prep,
                    Region {
                        offset: 0,
                        len: elems,
                    },
                ),
                bufs: q.cmd_buf(0).map(|(b, _)| b),
            },
            ud(K_PREP, slot, 0),
        )?;
        q.outstanding += 1;
        for g in &groups {
            ring.register_buf_ring(g)?;
        }
        q.batch = Some(Batch {
            groups,
            commit,
            committing: [Vec::with_capacity(depth), Vec::with_capacity(depth)],
            busy: [false; COMMIT_BUFS],
            pending: Vec::with_capacity(depth),
            scratch: Vec::with_capacity(depth),
        });
        for k in 0..2 {
            self.arm_fetch(q, slot, k)?;
        }
        Ok(())
    }

    /// Batch flags for PREP and COMMIT: buffer addresses in copy mode; with zero copy, the
    /// fallback when the device can copy.
    fn batch_flags(q: &Queue) -> u16 {
        if !q.setup.zero_copy {
            sys::UBLK_BATCH_F_HAS_BUF_ADDR
        } else if q.setup.user_copy {
            sys::UBLK_BATCH_F_AUTO_BUF_REG_FALLBACK
        } else {
            0
        }
    }

    /// The batch element for `tag`: header (tag, buffer slot, result), plus the tag's buffer
    /// address in copy mode. Only the first `elem_bytes()` bytes are sent.
    fn elem_for(q: &Queue, tag: u16, result: i32) -> [u8; 16] {
        let addr = match q.cmd_buf(tag) {
            Some((b, r)) => b.addr(r.offset),
            None => 0,
        };
        elem(tag, q.zc_slot(tag), result, addr)
    }

    fn arm_fetch(&mut self, q: &mut Queue, slot: u16, k: u16) -> Result<(), WorkerError> {
        let Some(b) = q.batch.as_ref() else {
            return Ok(());
        };
        let group = &b.groups[usize::from(k)];
        self.rings.get(q.setup.placement.ublk_on_poll()).push(
            Op::UblkFetchMultishot {
                fd: q.setup.cdev.as_raw_fd(),
                cmd_op: sys::UBLK_U_IO_FETCH_IO_CMDS,
                cmd: ublk_batch_io {
                    q_id: q.setup.q_id,
                    flags: 0,
                    nr_elem: q.setup.depth,
                    elem_bytes: 2,
                    ..Default::default()
                },
                group,
            },
            ud(K_FETCH, slot, k),
        )?;
        q.outstanding += 1;
        Ok(())
    }

    /// Starts request `tag`; returns its result if it finished at once. A zero-copy request
    /// whose pages the kernel could not lend (fallback) is served by copy: a write's data is
    /// first read from `/dev/ublkcN` on the ring (`on_copy_in` then starts the backend).
    fn start_request(rings: &mut Rings, q: &mut Queue, slot: u16, tag: u16) -> Option<i32> {
        let Some(desc) = q.desc.get(tag) else {
            return Some(-libc::EINVAL);
        };
        let req = Request::from_desc(&desc);
        let fallback = q.setup.zero_copy && desc.op_flags & sys::UBLK_IO_F_NEED_REG_BUF != 0;
        q.tags[usize::from(tag)] = Tag {
            req,
            started: Some(Instant::now()),
            fallback,
            result: 0,
            retries: 0,
        };
        q.setup.stats.started();
        if req.has_data() && req.len > q.setup.max_io {
            return Some(-libc::EIO);
        }
        if fallback {
            q.setup.stats.zero_copy_fallback();
            if Self::ensure_bufs(rings, q).is_err() {
                return Some(-libc::ENOMEM);
            }
            if req.op == OpKind::Write && req.len > 0 {
                return Self::copy_user(rings, q, slot, tag, K_COPY_IN, req.len as usize);
            }
        }
        Self::start_backend(rings, q, slot, tag)
    }

    /// Copies `len` bytes of `tag`'s data between its copy buffer and the kernel's request
    /// (user copy through `/dev/ublkcN`, on the main ring: never a blocking call on the
    /// worker). `kind` K_COPY_IN reads the request's data, K_COPY_OUT writes it.
    fn copy_user(
        rings: &mut Rings,
        q: &mut Queue,
        slot: u16,
        tag: u16,
        kind: u64,
        len: usize,
    ) -> Option<i32> {
        let Some(buf) = q.bufs.as_ref() else {
            return Some(-libc::EIO);
        };
        let region = Region {
            offset: q.tag_region(tag).offset,
            len,
        };
        let file_offset = sys::user_copy_offset(q.setup.q_id, tag);
        let fd = q.fd();
        let op = if kind == K_COPY_IN {
            Op::Read {
                fd,
                buf,
                region,
                file_offset,
            }
        } else {
            Op::Write {
                fd,
                buf,
                region,
                file_offset,
            }
        };
        match rings.main.push(op, ud(kind, slot, tag)) {
            Ok(()) => {
                q.outstanding += 1;
                None
            }
            Err(_) => Some(-libc::EIO),
        }
    }

    /// Hands request `tag` to the backend; returns its result if it finished at once.
    fn start_backend(rings: &mut Rings, q: &mut Queue, slot: u16, tag: u16) -> Option<i32> {
        let t = q.tags[usize::from(tag)];
        let req = t.req;
        let region = Region {
            offset: q.tag_region(tag).offset,
            len: if req.has_data() { req.len as usize } else { 0 },
        };
        let data = match &q.bufs {
            Some(buf) if !q.setup.zero_copy || t.fallback => Data::Copy {
                buf,
                region,
                index: q.buf_index,
            },
            _ => Data::ZeroCopy {
                index: q.zc_slot(tag),
            },
        };
        let on_poll = q.setup.placement.backend_on_poll();
        let ctx = IoCtx {
            ring: rings.get(on_poll),
            user_data: ud(K_BACKEND, slot, tag),
            data,
            scratch: (&q.scratch, q.scratch_region(tag)),
        };
        match q.setup.backend.start(&req, ctx) {
            Started::Done(res) => Some(res),
            Started::Submitted => {
                q.outstanding += 1;
                if on_poll {
                    rings.polled += 1;
                }
                None
            }
        }
    }

    /// Request `tag` finished with `res`. A fallback read first copies its data out to the
    /// kernel (`on_copy_out` then commits); everything else is recorded and committed.
    fn done(rings: &mut Rings, q: &mut Queue, dirty: &mut Vec<u16>, slot: u16, tag: u16, res: i32) {
        let t = q.tags[usize::from(tag)];
        if t.fallback && t.req.op == OpKind::Read && res > 0 {
            q.tags[usize::from(tag)].result = res;
            match Self::copy_user(rings, q, slot, tag, K_COPY_OUT, res as usize) {
                None => return,
                Some(err) => return Self::commit(rings, q, dirty, slot, tag, err),
            }
        }
        Self::commit(rings, q, dirty, slot, tag, res)
    }

    /// Records request `tag`'s final result and commits it: per-IO with the tag's next
    /// COMMIT_AND_FETCH_REQ, batch by queueing it for this iteration's COMMIT_IO_CMDS.
    fn commit(
        rings: &mut Rings,
        q: &mut Queue,
        dirty: &mut Vec<u16>,
        slot: u16,
        tag: u16,
        res: i32,
    ) {
        let t = q.tags[usize::from(tag)];
        let lat = t.started.map_or(0, |s| s.elapsed().as_nanos() as u64);
        q.setup
            .stats
            .finished(t.req.op, u64::from(t.req.len), res, lat);
        if let Some(b) = q.batch.as_mut() {
            b.pending.push((tag, res));
            dirty.push(slot);
        } else {
            Self::commit_one(rings, q, slot, tag, res);
        }
    }

    /// Per-IO: a FETCH or COMMIT_AND_FETCH completed for `tag`.
    fn on_io_cmd(&mut self, slot: u16, tag: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        if res != sys::UBLK_IO_RES_OK {
            // ABORT (-ENODEV) or an error: this tag gets no more requests.
            if res != sys::UBLK_IO_RES_ABORT {
                q.setup.stats.protocol_error(res);
            }
            q.stopping = true;
            return;
        }
        q.setup.stats.batch(1);
        self.handled += 1;
        if let Some(r) = Self::start_request(&mut self.rings, q, slot, tag) {
            Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, r);
        }
    }

    fn commit_one(rings: &mut Rings, q: &mut Queue, slot: u16, tag: u16, res: i32) {
        let cmd = ublksrv_io_cmd {
            q_id: q.setup.q_id,
            tag,
            result: res,
            addr: 0,
        };
        let pushed = rings.get(q.setup.placement.ublk_on_poll()).push(
            Op::UblkIo {
                fd: q.setup.cdev.as_raw_fd(),
                cmd_op: sys::UBLK_U_IO_COMMIT_AND_FETCH_REQ,
                cmd,
                buf: q.cmd_buf(tag),
                auto_buf: q.auto_buf(tag),
            },
            ud(K_IO, slot, tag),
        );
        match pushed {
            Ok(()) => q.outstanding += 1,
            Err(_) => q.stopping = true,
        }
    }

    fn on_backend(&mut self, slot: u16, tag: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        let t = q.tags[usize::from(tag)];
        use crate::hooks::{fire, Fault};
        // Test hook; `cfg!` keeps the backend check off the I/O path of shipped builds.
        let res = if cfg!(feature = "test-hooks")
            && q.setup.backend.kind() == "nvme"
            && ((t.retries == 0 && fire(Fault::NvmePathError)) || fire(Fault::NvmePathDown))
        {
            0x371 // Host Aborted Command: a path-related status, DNR clear
        } else {
            res
        };
        if t.retries < MAX_RETRIES
            && q.setup.backend.retryable(res)
            && Self::retry_later(&mut self.rings, q, slot, tag)
        {
            return;
        }
        let res = q.setup.backend.finish(&t.req, res);
        Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, res);
    }

    /// Sends request `tag`'s backend operation again after a back-off (a timeout on the main
    /// ring; its completion resends). False if the timeout could not be queued.
    fn retry_later(rings: &mut Rings, q: &mut Queue, slot: u16, tag: u16) -> bool {
        let n = q.tags[usize::from(tag)].retries;
        let ns = FIRST_BACKOFF_NS << n;
        let mut ts = [0u8; 16];
        ts[0..8].copy_from_slice(&(ns / 1_000_000_000).to_ne_bytes());
        ts[8..16].copy_from_slice(&(ns % 1_000_000_000).to_ne_bytes());
        let region = q.timespec_region(tag);
        if !q.scratch.write_at(region.offset, &ts) {
            return false;
        }
        let pushed = rings.main.push(
            Op::Timeout {
                ts: (&q.scratch, region),
            },
            ud(K_RETRY, slot, tag),
        );
        if pushed.is_err() {
            return false;
        }
        q.outstanding += 1;
        q.tags[usize::from(tag)].retries = n + 1;
        q.setup.stats.retry();
        true
    }

    /// A back-off ended: send request `tag`'s backend operation again.
    fn on_retry(&mut self, slot: u16, tag: u16) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        if let Some(r) = Self::start_backend(&mut self.rings, q, slot, tag) {
            Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, r);
        }
    }

    /// A fallback write's data arrived from the kernel: start the backend.
    fn on_copy_in(&mut self, slot: u16, tag: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        let want = q.tags[usize::from(tag)].req.len;
        let started = if u32::try_from(res).ok() == Some(want) {
            Self::start_backend(&mut self.rings, q, slot, tag)
        } else {
            Some(-libc::EIO)
        };
        if let Some(r) = started {
            Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, r);
        }
    }

    /// A fallback read's data reached the kernel: commit the backend's result.
    fn on_copy_out(&mut self, slot: u16, tag: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        let want = q.tags[usize::from(tag)].result;
        let r = if res == want { want } else { -libc::EIO };
        Self::commit(&mut self.rings, q, &mut self.dirty, slot, tag, r);
    }

    fn on_prep(&mut self, slot: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        if res < 0 {
            q.setup.stats.protocol_error(res);
            q.stopping = true;
        }
        if let Some(reply) = q.attach_reply.take() {
            let answer = if res < 0 {
                Err(AttachError {
                    source: WorkerError::Refused(-res),
                    held: true,
                })
            } else {
                Ok(())
            };
            let _ = reply.send(answer);
        }
    }

    /// Batch: a multishot fetch delivered tags (or ended).
    fn on_fetch(&mut self, slot: u16, k: u16, c: Completion) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        let mut rearm = false;
        if !c.more() {
            q.outstanding = q.outstanding.saturating_sub(1);
            rearm = c.result >= 0 || c.result == -libc::ENOBUFS;
        }
        if c.result < 0 && c.result != -libc::ENOBUFS {
            if c.result != -libc::ENODEV {
                q.setup.stats.protocol_error(c.result);
            }
            q.stopping = true;
        }
        // A completion that selected a buffer gives it back whatever it carried: one kept
        // would shrink the group until the kernel runs out (-ENOBUFS) and stops the fetch.
        let mut tags = q
            .batch
            .as_mut()
            .map(|b| std::mem::take(&mut b.scratch))
            .unwrap_or_default();
        tags.clear();
        if let (Some(b), Some(bid)) = (q.batch.as_ref(), c.buffer_id()) {
            let group = &b.groups[usize::from(k & 1)];
            if c.result > 0 {
                group.read_u16s(bid, c.result as usize, &mut tags);
            }
            group.recycle(bid);
        }
        if c.result > 0 {
            q.setup.stats.batch(tags.len() as u64);
            self.handled += tags.len() as u64;
            for &tag in &tags {
                if tag >= q.setup.depth {
                    continue;
                }
                if let Some(r) = Self::start_request(&mut self.rings, q, slot, tag) {
                    Self::done(&mut self.rings, q, &mut self.dirty, slot, tag, r);
                }
            }
            self.dirty.push(slot);
        }
        if let Some(b) = q.batch.as_mut() {
            b.scratch = tags;
        }
        if rearm && !q.stopping {
            let _ = self.arm_fetch_slot(slot, k);
        }
    }

    fn arm_fetch_slot(&mut self, slot: u16, k: u16) -> Result<(), WorkerError> {
        let Some(mut q) = self
            .queues
            .get_mut(usize::from(slot))
            .and_then(Option::take)
        else {
            return Ok(());
        };
        let r = self.arm_fetch(&mut q, slot, k);
        if r.is_err() {
            q.stopping = true;
        }
        self.queues[usize::from(slot)] = Some(q);
        r
    }

    fn on_commit(&mut self, slot: u16, idx: u16, res: i32) {
        let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
            return;
        };
        q.outstanding = q.outstanding.saturating_sub(1);
        let eb = usize::from(q.elem_bytes());
        let Some(b) = q.batch.as_mut() else { return };
        let i = usize::from(idx) % COMMIT_BUFS;
        b.busy[i] = false;
        let sent = std::mem::take(&mut b.committing[i]);
        if res >= 0 {
            // A partial commit: the kernel handled the first res/elem_bytes elements and refused
            // the next one. Sending that one again would be refused again; it is dropped and
            // counted (its request stays with the kernel until the device stops), and the
            // elements after it, which the kernel never looked at, go out again.
            let done = (res as usize) / eb;
            if done < sent.len() {
                q.setup.stats.protocol_error(-libc::EINVAL);
                if done + 1 < sent.len() {
                    b.pending.extend_from_slice(&sent[done + 1..]);
                    self.dirty.push(slot);
                }
            }
        } else if res != -libc::ENODEV || !q.stopping {
            // The kernel refused the whole commit: these requests will never complete. Only an
            // abort (the device going away, after a fetch saw -ENODEV) makes that expected.
            q.setup.stats.protocol_error(res);
            q.stopping = true;
        }
        let mut sent = sent;
        sent.clear();
        b.committing[i] = sent;
    }

    /// Sends each touched batch queue's finished tags in one COMMIT_IO_CMDS.
    fn flush_commits(&mut self) {
        let mut dirty = std::mem::take(&mut self.dirty);
        dirty.sort_unstable();
        dirty.dedup();
        for &slot in &dirty {
            let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) else {
                continue;
            };
            // Out of the queue while its commit is built, so the queue's other fields stay
            // readable; put back below.
            let Some(mut b) = q.batch.take() else {
                continue;
            };
            let ring = self.rings.get(q.setup.placement.ublk_on_poll());
            if Self::commit_batch(ring, q, &mut b, slot) {
                self.dirty.push(slot);
            }
            q.batch = Some(b);
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }

    /// Sends up to `depth` of the queue's finished tags in one COMMIT_IO_CMDS, when a commit
    /// buffer is free. Returns whether tags are left for the next iteration.
    fn commit_batch(ring: &mut WorkerRing, q: &mut Queue, b: &mut Batch, slot: u16) -> bool {
        if b.pending.is_empty() {
            return false;
        }
        let Some(i) = b.busy.iter().position(|busy| !busy) else {
            // Both commit buffers are in flight; their completions will flush again.
            return true;
        };
        let eb = q.elem_bytes();
        let n_max = usize::from(q.setup.depth);
        let n = b.pending.len().min(n_max);
        let mut sent = std::mem::take(&mut b.committing[i]);
        sent.clear();
        sent.extend(b.pending.drain(..n));
        if (2..n_max).contains(&sent.len())
            && crate::hooks::fire(crate::hooks::Fault::CommitBadElement)
        {
            // Test hook: the first element again, second; the kernel no longer owes us that tag.
            sent.insert(1, sent[0]);
        }
        let n = sent.len();
        for (j, &(tag, res)) in sent.iter().enumerate() {
            let e = Self::elem_for(q, tag, res);
            b.commit[i].write_at(j * usize::from(eb), &e[..usize::from(eb)]);
        }
        let pushed = ring.push(
            Op::UblkBatch {
                fd: q.fd(),
                cmd_op: sys::UBLK_U_IO_COMMIT_IO_CMDS,
                cmd: ublk_batch_io {
                    q_id: q.setup.q_id,
                    flags: Self::batch_flags(q),
                    nr_elem: n as u16,
                    elem_bytes: eb,
                    ..Default::default()
                },
                elems: (
                    &b.commit[i],
                    Region {
                        offset: 0,
                        len: n * usize::from(eb),
                    },
                ),
                bufs: q.cmd_buf(0).map(|(m, _)| m),
            },
            ud(K_COMMIT, slot, i as u16),
        );
        b.committing[i] = sent;
        match pushed {
            Ok(()) => {
                b.busy[i] = true;
                q.outstanding += 1;
            }
            Err(_) => q.stopping = true,
        }
        !b.pending.is_empty()
    }

    /// Tears down queues the kernel has let go of (stopping, nothing outstanding).
    fn reap_dead_queues(&mut self) {
        if self.dying.is_empty() {
            return;
        }
        let mut dying = std::mem::take(&mut self.dying);
        dying.sort_unstable();
        dying.dedup();
        for &slot in &dying {
            let slot = usize::from(slot);
            let dead = matches!(&self.queues[slot], Some(q) if q.stopping && q.outstanding == 0);
            if !dead {
                continue;
            }
            if let Some(q) = self.queues[slot].take() {
                if let Some(reply) = &q.attach_reply {
                    let _ = reply.send(Err(AttachError {
                        source: WorkerError::Stopped,
                        held: true,
                    }));
                }
                if let Some(index) = q.buf_index {
                    let _ = self
                        .rings
                        .get(q.setup.placement.backend_on_poll())
                        .unregister_fixed(index);
                }
                self.release_slots(&q);
                self.unregister_files(&q);
                if let Some(b) = &q.batch {
                    let ring = self.rings.get(q.setup.placement.ublk_on_poll());
                    for g in &b.groups {
                        let _ = ring.unregister_buf_ring(g.group());
                    }
                }
                // Limits first, so that whoever waits for `gone` sees them follow.
                self.live -= 1;
                self.fit_iowq();
                let _ = q.setup.gone.send((q.setup.dev_id, q.setup.q_id));
            }
        }
        dying.clear();
        if self.dying.is_empty() {
            self.dying = dying;
        }
    }
}

/// One batch element: header (tag, buf_index, result) plus the tag's buffer address.
fn elem(tag: u16, buf_index: u16, result: i32, addr: u64) -> [u8; 16] {
    let mut e = [0u8; 16];
    e[0..2].copy_from_slice(&tag.to_ne_bytes());
    e[2..4].copy_from_slice(&buf_index.to_ne_bytes());
    e[4..8].copy_from_slice(&result.to_ne_bytes());
    e[8..16].copy_from_slice(&addr.to_ne_bytes());
    e
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn user_data_round_trips() {
        let u = ud(K_COMMIT, 0xbeef, 0x1234);
        assert_eq!(ud_parts(u), (K_COMMIT, 0xbeef, 0x1234));
    }

    #[test]
    fn batch_element_layout_matches_the_uapi() {
        let e = elem(7, 3, -5, 0x1000);
        assert_eq!(&e[0..2], &7u16.to_ne_bytes());
        assert_eq!(&e[2..4], &3u16.to_ne_bytes(), "buf_index");
        assert_eq!(&e[4..8], &(-5i32).to_ne_bytes());
        assert_eq!(&e[8..16], &0x1000u64.to_ne_bytes());
    }
}
