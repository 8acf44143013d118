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
//!
//! The `Worker` keeps its loop, the dispatch of each completion to the queue it is for, the
//! control thread's commands (attach and teardown in `attach.rs`, drains in `drain.rs`) and the
//! flush of batch commits. A `Queue` (`queue.rs`) owns what one of its requests goes through,
//! the ublk paths' own steps in `per_io.rs` and `batch.rs`.

use crate::backend::Backend;
use crate::device::IoPath;
use crate::ids::{DevId, QueueId};
use crate::qos::Throttle;
use crate::reply::Answer;
use crate::ring::{Completion, Op, RingError, WorkerRing};
use crate::stats::{CleanupStep, QueueStats, Wait, WorkerStats};
use crate::sys::os::{EventFd, Mapping};
use std::fs::File;
use std::sync::mpsc::{Receiver, Sender, SyncSender};
use std::sync::Arc;
use std::time::{Duration, Instant};

mod attach;
mod batch;
mod drain;
mod per_io;
mod queue;
mod state;
mod token;

use queue::Queue;
use token::Token;

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
                attach::answer_attaches(self);
            }
            if !self.drains.is_empty() {
                drain::answer_drains(self);
            }
            self.flush_commits();
            self.stats.batch(std::mem::take(&mut self.handled));
            attach::reap_dead_queues(self);
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
            self.rings.main.sleep()?;
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
            if let Some(poll) = self.rings.poll.as_mut() {
                // The poll ring's task work (a ublk request, on a ring that carries them) does
                // not interrupt a running worker: it is run by this enter.
                if poll.has_completions() || poll.needs_enter() {
                    self.stats.waited(Wait::Spun);
                    poll.submit()?;
                    return Ok(());
                }
            }
            looks = looks.wrapping_add(1);
            // The clock is read every 64 looks: a vDSO call costs more than a look.
            if looks % 64 == 0 && Instant::now() >= until {
                break;
            }
            std::hint::spin_loop();
        }
        self.stats.waited(Wait::Slept);
        self.rings.main.sleep()?;
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
            // The rest are a queue's: handed to it, if it is still there, with what of the
            // worker its request path needs.
            Token::Io { slot, tag } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    per_io::on_io_cmd(
                        q,
                        &mut self.rings,
                        &mut self.dirty,
                        &mut self.handled,
                        slot,
                        tag,
                        c.result,
                    );
                }
            }
            Token::Backend { slot, tag } => {
                if on_poll {
                    self.rings.polled = self.rings.polled.saturating_sub(1);
                }
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    q.on_backend(&mut self.rings, &mut self.dirty, slot, tag, c.result);
                }
            }
            Token::Prep { slot } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    batch::on_prep(q, c.result);
                }
            }
            Token::Fetch { slot, group } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    let rearmed = batch::on_fetch(
                        q,
                        &mut self.rings,
                        &mut self.dirty,
                        &mut self.handled,
                        slot,
                        group,
                        c,
                    );
                    // The queue stopped without its fetch: the volume's statistics count it
                    // as a protocol error, the worker's as a clean-up step that failed.
                    if let Err(e) = rearmed {
                        self.stats.cleanup_failed(CleanupStep::FetchRearm);
                        let errno = match &e {
                            WorkerError::Ring(r) => r.errno(),
                            _ => libc::EIO,
                        };
                        q.setup.stats.protocol_error(errno);
                    }
                }
            }
            Token::Commit { slot, buf } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    batch::on_commit(q, &mut self.dirty, slot, buf, c.result);
                }
            }
            Token::CopyIn { slot, tag } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    q.on_copy_in(&mut self.rings, &mut self.dirty, slot, tag, c.result);
                }
            }
            Token::CopyOut { slot, tag } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    q.on_copy_out(&mut self.rings, &mut self.dirty, slot, tag, c.result);
                }
            }
            Token::Retry { slot, tag } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    q.on_retry(&mut self.rings, &mut self.dirty, slot, tag);
                }
            }
            Token::Throttle { slot } => {
                if let Some(Some(q)) = self.queues.get_mut(usize::from(slot)) {
                    q.on_throttle_timer(&mut self.rings, &mut self.dirty, slot);
                }
            }
        }
        Ok(())
    }

    fn commands(&mut self) {
        while let Ok(cmd) = self.rx.try_recv() {
            match cmd {
                WorkerCmd::Attach { setup, reply } => {
                    if let Err(e) = attach::attach(self, setup, reply.clone()) {
                        reply.answer(Err(e));
                    }
                }
                WorkerCmd::Throttle { dev_id, throttle } => self.set_throttle(dev_id, throttle),
                WorkerCmd::Drain { dev_id, reply } => drain::drain(self, dev_id, reply),
                WorkerCmd::Resume { dev_id } => drain::resume(self, dev_id),
                WorkerCmd::Shutdown => self.shutdown = true,
                WorkerCmd::Abandon => self.abandon = true,
            }
        }
    }

    /// The control thread changed a device's limits from or to unlimited.
    fn set_throttle(&mut self, dev_id: DevId, throttle: Option<Arc<Throttle>>) {
        for slot in 0..self.queues.len() {
            let Some(Some(q)) = self.queues.get_mut(slot) else {
                continue;
            };
            if q.setup.dev_id != dev_id {
                continue;
            }
            q.setup.throttle = throttle.clone();
            if q.setup.throttle.is_none() && !q.throttle_timer {
                // Nothing will wake the waiters (none normally: the timer is armed while any
                // wait), so admit them now.
                q.admit_waiting(&mut self.rings, &mut self.dirty, slot as u16);
            }
        }
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
            if batch::commit(q, ring, &mut b, slot) {
                self.dirty.push(slot);
            }
            q.batch = Some(b);
        }
        dirty.clear();
        if self.dirty.is_empty() {
            self.dirty = dirty;
        }
    }
}
