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

use crate::backend::{Backend, Request};
use crate::device::IoPath;
use crate::ids::{DevId, QueueId, Tag};
use crate::qos::Throttle;
use crate::reply::Answer;
use crate::ring::{BufRing, Completion, Op, Region, RingError, WorkerRing};
use crate::stats::{QueueStats, Wait, WorkerStats};
use crate::sys::os::{DescMap, EventFd, Mapping};
use crate::sys::{self};
use std::collections::VecDeque;
use std::fs::File;
use std::os::fd::AsRawFd;
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod batch;
mod drain;
mod per_io;
mod queue;
mod request;
mod state;
mod throttle;
mod token;

use state::{Commits, Life, COMMIT_BUFS};
use token::Token;

/// Times a backend operation that failed for a passing reason is sent again, and the first
/// back-off (doubled each time: 1, 2, 4, 8, 16 ms).
const MAX_RETRIES: u8 = 5;
const FIRST_BACKOFF_NS: u64 = 1_000_000;

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
    pub dev_id: DevId,
    pub q_id: QueueId,
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
    /// The device's shared I/O limits; None: unlimited (its requests never look at a clock or
    /// a lock for them).
    pub throttle: Option<Arc<Throttle>>,
    /// Told when the queue has been torn down (after the kernel aborted its commands).
    pub gone: Sender<(DevId, QueueId)>,
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
    #[error("a completion carried user_data {0:#x}, which no token of this worker makes")]
    UnknownToken(u64),
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
    Attach {
        setup: Box<QueueSetup>,
        reply: AttachReply,
    },
    /// The device's limits changed from or to unlimited: its queues on this worker take this
    /// throttle (requests already waiting are admitted by it, or at once when None).
    Throttle {
        dev_id: DevId,
        throttle: Option<Arc<Throttle>>,
    },
    /// Hold the device's new requests in the worker and reply once none of its requests is
    /// with the backend (a snapshot is taken while it stays so).
    Drain {
        dev_id: DevId,
        reply: SyncSender<()>,
    },
    /// Start the requests held since `Drain`, and serve the device as before.
    Resume { dev_id: DevId },
    /// Exit once no queue is left.
    Shutdown,
    /// Stop serving at once and never release the ring: the process is about to exit and the
    /// kernel's own cleanup (as after a crash) hands the devices to the next server.
    Abandon,
}

#[derive(Debug, Clone, Copy)]
struct TagState {
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
    /// Finished tags on their way to the kernel, pending or in flight.
    commits: Commits,
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
    tags: Vec<TagState>,
    batch: Option<Batch>,
    /// What the kernel still holds of the queue, and whether it is stopping.
    life: Life,
    /// The control thread waits for the kernel to accept this queue's commands.
    attach_reply: Option<AttachReply>,
    /// Requests over the device's limits, `[reads, writes]`, in arrival order: each waits in
    /// the worker until its direction's buckets admit it (at most `depth` of them).
    waiting: [VecDeque<Tag>; 2],
    /// A timer to look at `waiting` again is in flight.
    throttle_timer: bool,
    /// Requests fetched and not yet committed (waiting, held or with the backend).
    active: usize,
    /// Drained: new requests are held in `held`, not started, until resumed.
    paused: bool,
    held: VecDeque<Tag>,
}

impl Queue {
    fn fd(&self) -> i32 {
        self.setup.cdev.as_raw_fd()
    }

    fn tag_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * self.setup.max_io as usize,
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
    fn zc_slot(&self, tag: Tag) -> u16 {
        self.zc_slots.get(tag.index()).copied().unwrap_or(NO_SLOT)
    }

    /// The AUTO_BUF_REG word for `tag`'s next request (zero copy), else None.
    fn auto_buf(&self, tag: Tag) -> Option<u64> {
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
    fn cmd_buf(&self, tag: Tag) -> Option<(&Arc<Mapping>, Region)> {
        if self.setup.zero_copy {
            return None;
        }
        self.bufs.as_ref().map(|b| (b, self.tag_region(tag)))
    }

    /// `tag`'s command payload (one NVMe DSM range).
    fn scratch_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * SCRATCH_BYTES,
            len: PAYLOAD_BYTES,
        }
    }

    /// `tag`'s back-off timespec, apart from its payload (a retried discard still needs it).
    fn timespec_region(&self, tag: Tag) -> Region {
        Region {
            offset: tag.index() * SCRATCH_BYTES + PAYLOAD_BYTES,
            len: 16,
        }
    }

    /// The queue's own timespec (the throttle timer), after every tag's scratch.
    fn throttle_timespec(&self) -> Region {
        Region {
            offset: usize::from(self.setup.depth) * SCRATCH_BYTES + PAYLOAD_BYTES,
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
    /// Drains to answer once the device's requests are out of the backend.
    drains: Vec<(DevId, SyncSender<()>)>,
    shutdown: bool,
    abandon: bool,
    /// How long to look for work in user space before sleeping in the kernel
    /// (`crate::poll::idle_spin`); zero sleeps at once.
    spin: Duration,
}

impl Worker {
    pub fn new(
        rx: Receiver<WorkerCmd>,
        event: Arc<EventFd>,
        stats: Arc<WorkerStats>,
        spin: Duration,
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
            drains: Vec::new(),
            shutdown: false,
            abandon: false,
            spin,
        })
    }

    /// Serves until shut down with no queue left. A fatal ring error stops the service, not
    /// the thread: the worker marks its queues failed, reports itself down and parks with the
    /// ring and every buffer the kernel may still write to kept mapped until the process exits.
    pub fn run(mut self) {
        if let Err(e) = self.serve() {
            let errno = match &e {
                WorkerError::Ring(r) => r.errno(),
                WorkerError::MapDescriptors(e) | WorkerError::Buffers(e) => {
                    e.raw_os_error().unwrap_or(libc::EIO)
                }
                WorkerError::Refused(errno) => errno.abs(),
                WorkerError::Full
                | WorkerError::Stopped
                | WorkerError::Injected
                | WorkerError::UnknownToken(_) => libc::EIO,
            };
            self.stats.down(errno);
            for q in self.queues.iter_mut().flatten() {
                q.setup.stats.worker_failed(errno);
                if let Some(reply) = q.attach_reply.take() {
                    reply.answer(Err(AttachError {
                        source: WorkerError::Stopped,
                        held: true,
                    }));
                }
            }
            // Attaches still coming get an answer; nothing else is served.
            while let Ok(cmd) = self.rx.recv() {
                if let WorkerCmd::Attach { reply, .. } = cmd {
                    reply.answer(Err(AttachError {
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
                    let Some(slot) = Token::decode(c.user_data).and_then(Token::slot) else {
                        continue;
                    };
                    if matches!(self.queues.get(usize::from(slot)), Some(Some(q)) if q.life.stopping())
                    {
                        self.dying.push(slot);
                    }
                }
            }
            self.cqes = cqes;
            if !self.attaching.is_empty() {
                self.answer_attaches();
            }
            if !self.drains.is_empty() {
                self.answer_drains();
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
            self.sleep_on_main()?;
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
            self.sleep_on_main()?;
        }
        Ok(())
    }

    /// Waits for the main ring's next completion: first in user space for up to `spin`, then
    /// asleep in the kernel. A spinning worker sees a completion or deferred task work (a ublk
    /// request, a backend completion, a command) without the wake-up a sleeping one pays, at
    /// the cost of its CPU; `spin` is zero unless the operator asked (`crate::poll::idle_spin`).
    fn sleep_on_main(&mut self) -> Result<(), WorkerError> {
        if self.spin.is_zero() {
            self.rings.main.submit_and_wait(1)?;
            return Ok(());
        }
        // Commits and backend I/O go out before the worker starts looking.
        self.rings.main.submit()?;
        let until = Instant::now() + self.spin;
        let mut looks = 0u32;
        loop {
            if self.rings.main.has_completions() {
                self.stats.waited(Wait::Spun);
                return Ok(());
            }
            if self.rings.main.needs_enter() {
                // Deferred task work (IORING_SQ_TASKRUN): an enter with GETEVENTS runs it.
                self.stats.waited(Wait::Spun);
                self.rings.main.submit()?;
                return Ok(());
            }
            looks = looks.wrapping_add(1);
            // The clock is read every 64 looks: a vDSO call costs more than a look.
            if looks % 64 == 0 && Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        self.stats.waited(Wait::Slept);
        self.rings.main.submit_and_wait(1)?;
        Ok(())
    }

    fn arm_event(&mut self) -> Result<(), WorkerError> {
        self.rings.main.push(
            Op::Read8 {
                fd: self.event.raw(),
                buf: &self.event_buf,
                offset: 0,
            },
            Token::Event.encode(),
        )?;
        Ok(())
    }

    fn dispatch(&mut self, c: Completion, on_poll: bool) -> Result<(), WorkerError> {
        let Some(token) = Token::decode(c.user_data) else {
            // Every SQE of this ring carries a token `encode` made: other bits are a bug, and
            // its worker stops like one whose ring failed (each volume's state says so).
            return Err(WorkerError::UnknownToken(c.user_data));
        };
        match token {
            Token::Event => {
                self.commands();
                self.arm_event()?;
            }
            Token::Io { slot, tag } => self.on_io_cmd(slot, tag, c.result),
            Token::Backend { slot, tag } => {
                if on_poll {
                    self.rings.polled = self.rings.polled.saturating_sub(1);
                }
                self.on_backend(slot, tag, c.result)
            }
            Token::Prep { slot } => self.on_prep(slot, c.result),
            Token::Fetch { slot, group } => self.on_fetch(slot, group, c),
            Token::Commit { slot, buf } => self.on_commit(slot, buf, c.result),
            Token::CopyIn { slot, tag } => self.on_copy_in(slot, tag, c.result),
            Token::CopyOut { slot, tag } => self.on_copy_out(slot, tag, c.result),
            Token::Retry { slot, tag } => self.on_retry(slot, tag),
            Token::Throttle { slot } => self.on_throttle_timer(slot),
        }
        Ok(())
    }

    fn commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                WorkerCmd::Attach { setup, reply } => {
                    if let Err(e) = self.attach(setup, reply.clone()) {
                        reply.answer(Err(e));
                    }
                }
                WorkerCmd::Throttle { dev_id, throttle } => self.set_throttle(dev_id, throttle),
                WorkerCmd::Drain { dev_id, reply } => self.drain(dev_id, reply),
                WorkerCmd::Resume { dev_id } => self.resume(dev_id),
                WorkerCmd::Shutdown => self.shutdown = true,
                WorkerCmd::Abandon => self.abandon = true,
            }
        }
    }
}
