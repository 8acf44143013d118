//! io_uring wrappers. Pushing an SQE is the one `unsafe` step: the kernel reads the memory an SQE
//! points at until the matching completion is reaped, so every buffer handed over here is owned by
//! the ring's in-flight table until then, even when the caller has stopped waiting.

mod buf_ring;
mod files;
mod op;
mod sqe;
mod worker;

pub use buf_ring::BufRing;
pub use op::{kernel_timespec, Completion, NvmeData, Op, Region};
pub use worker::{iowq_limits, WorkerRing, IOWQ_MAX_BOUNDED, IOWQ_MAX_UNBOUNDED};

use crate::sys::ublksrv_ctrl_cmd;
use io_uring::{cqueue, opcode, squeue, types, IoUring};
use std::collections::HashMap;
use std::io;
use std::os::fd::RawFd;
use std::time::{Duration, Instant};

/// Errors of the ring layer, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum RingError {
    #[error("io_uring setup failed")]
    Setup(#[source] io::Error),
    #[error("io_uring submission failed")]
    Submit(#[source] io::Error),
    /// The kernel is short of memory or resources for a moment (-EAGAIN, -ENOMEM): try again.
    #[error("io_uring_enter failed for now")]
    Transient(#[source] io::Error),
    #[error("submission queue full")]
    QueueFull,
    #[error("no completion within {0:?}")]
    Timeout(Duration),
    #[error("buffer registration failed")]
    Register(#[source] io::Error),
    #[error("no free fixed-buffer slot")]
    NoFixedSlot,
    #[error("buffer region outside its mapping or not registered")]
    BadRegion,
}

impl RingError {
    /// The errno behind the error, for reports (EIO when there is none).
    pub fn errno(&self) -> i32 {
        match self {
            RingError::Setup(e)
            | RingError::Submit(e)
            | RingError::Transient(e)
            | RingError::Register(e) => e.raw_os_error().unwrap_or(libc::EIO),
            RingError::QueueFull => libc::EBUSY,
            RingError::Timeout(_) => libc::ETIME,
            RingError::NoFixedSlot => libc::ENOBUFS,
            RingError::BadRegion => libc::EFAULT,
        }
    }
}

/// A heap buffer lent to the kernel for one command; its address is stable while the Box moves.
pub type KernelBuf = Box<[u8]>;

/// A small SQE128 ring for `/dev/ublk-control` commands, used from one thread at a time.
///
/// Each command waits for its own completion with a deadline: some kernels hang ADD_DEV, and a
/// caller must get an error rather than a stuck thread. A buffer whose command timed out stays in
/// `orphans` until the kernel completes it.
pub struct ControlRing {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    next_id: u64,
    orphans: HashMap<u64, Option<KernelBuf>>,
}

impl std::fmt::Debug for ControlRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlRing")
            .field("next_id", &self.next_id)
            .field("orphans", &self.orphans.len())
            .finish()
    }
}

impl ControlRing {
    pub fn new(entries: u32) -> Result<Self, RingError> {
        Self::build(entries, false)
    }

    /// A control ring with IORING_SETUP_IOPOLL, only to probe whether such rings take ublk
    /// commands (Linux 7.1 lets uring_cmds on files that cannot be polled share them).
    pub fn with_iopoll(entries: u32) -> Result<Self, RingError> {
        Self::build(entries, true)
    }

    fn build(entries: u32, iopoll: bool) -> Result<Self, RingError> {
        let mut b = IoUring::<squeue::Entry128, cqueue::Entry>::builder();
        if iopoll {
            b.setup_iopoll();
        }
        let ring = b.build(entries).map_err(RingError::Setup)?;
        Ok(Self {
            ring,
            next_id: 1,
            orphans: HashMap::new(),
        })
    }

    /// Issues `cmd_op` on `fd` with payload `cmd`, pointing `cmd.addr`/`cmd.len` at `buf` when
    /// given, and waits up to `timeout`. Returns the completion's result and the buffer.
    pub fn uring_cmd(
        &mut self,
        fd: RawFd,
        cmd_op: u32,
        mut cmd: ublksrv_ctrl_cmd,
        mut buf: Option<KernelBuf>,
        timeout: Duration,
    ) -> Result<(i32, Option<KernelBuf>), RingError> {
        if let Some(b) = buf.as_mut() {
            cmd.addr = b.as_mut_ptr() as u64;
            cmd.len = u16::try_from(b.len()).unwrap_or(u16::MAX);
        }
        let id = self.next_id;
        self.next_id += 1;
        let sqe = opcode::UringCmd80::new(types::Fd(fd), cmd_op)
            .cmd(cmd.to_sqe_cmd())
            .build()
            .user_data(id);
        // SAFETY: the SQE points at `buf` (when present), a heap allocation whose address does not
        // change when the Box moves. The Box is returned only after the completion for `id` is
        // reaped, or parked in `self.orphans` until it is, so it outlives the kernel's use.
        unsafe { self.ring.submission().push(&sqe) }.map_err(|_| RingError::QueueFull)?;
        self.orphans.insert(id, buf);

        let deadline = Instant::now() + timeout;
        loop {
            if let Some(res) = self.reap(id) {
                let buf = self.orphans.remove(&id).flatten();
                return Ok((res, buf));
            }
            let now = Instant::now();
            if now >= deadline {
                // The buffer stays parked in `orphans` until the kernel completes the command.
                return Err(RingError::Timeout(timeout));
            }
            let left = deadline - now;
            let ts = types::Timespec::new()
                .sec(left.as_secs())
                .nsec(left.subsec_nanos());
            let args = types::SubmitArgs::new().timespec(&ts);
            match self.ring.submitter().submit_with_args(1, &args) {
                Ok(_) => {}
                Err(e)
                    if e.raw_os_error() == Some(libc::ETIME)
                        || e.raw_os_error() == Some(libc::EINTR)
                        || e.raw_os_error() == Some(libc::EBUSY) => {}
                Err(e) => return Err(RingError::Submit(e)),
            }
        }
    }

    /// Drains the completion queue; returns the result for `want` if it was seen. Completions of
    /// earlier timed-out commands free their parked buffers.
    fn reap(&mut self, want: u64) -> Option<i32> {
        let mut found = None;
        for cqe in self.ring.completion() {
            if cqe.user_data() == want {
                found = Some(cqe.result());
            } else {
                self.orphans.remove(&cqe.user_data());
            }
        }
        found
    }
}
