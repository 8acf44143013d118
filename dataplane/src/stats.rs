//! Per-queue I/O statistics.
//!
//! Each queue's counters are written by the one worker that serves it (plain relaxed load+store,
//! no read-modify-write) and read by anyone holding the `Arc` (the server's collector at scrape
//! time). Nothing here locks or allocates on the I/O path.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// Request kinds counted separately.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read = 0,
    Write = 1,
    Flush = 2,
    Discard = 3,
    WriteZeroes = 4,
    Other = 5,
}

impl OpKind {
    pub const ALL: [OpKind; 6] = [
        OpKind::Read,
        OpKind::Write,
        OpKind::Flush,
        OpKind::Discard,
        OpKind::WriteZeroes,
        OpKind::Other,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Read => "read",
            OpKind::Write => "write",
            OpKind::Flush => "flush",
            OpKind::Discard => "discard",
            OpKind::WriteZeroes => "write_zeroes",
            OpKind::Other => "other",
        }
    }
}

/// Upper bounds (seconds) of the latency histogram's buckets; a last bucket counts the rest.
pub const LATENCY_BOUNDS: [f64; 16] = [
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6, 1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3,
    250e-3, 500e-3, 1.0,
];
const LATENCY_BOUNDS_NS: [u64; 16] = [
    10_000,
    25_000,
    50_000,
    100_000,
    250_000,
    500_000,
    1_000_000,
    2_500_000,
    5_000_000,
    10_000_000,
    25_000_000,
    50_000_000,
    100_000_000,
    250_000_000,
    500_000_000,
    1_000_000_000,
];
/// Upper bounds of the batch-size histogram (requests handled per loop iteration).
pub const BATCH_BOUNDS: [u64; 9] = [1, 2, 4, 8, 16, 32, 64, 128, 256];

#[derive(Debug, Default)]
pub struct QueueStats {
    ops: [AtomicU64; 6],
    bytes: [AtomicU64; 6],
    errors: AtomicU64,
    inflight: AtomicU64,
    /// Per op (`OpKind as usize`).
    latency: [Histogram<17>; 6],
    batch: Histogram<10>,
    protocol_errors: AtomicU64,
    last_protocol_errno: AtomicU64,
    zero_copy_fallbacks: AtomicU64,
    copy_buffer_bytes: AtomicU64,
    /// The errno that stopped the worker serving this queue (0: it serves).
    worker_failed_errno: AtomicU64,
    /// The errno with which the kernel refused a request's completion (0: none refused).
    commit_refused_errno: AtomicU64,
    /// Backend operations sent again after a passing failure.
    retries: AtomicU64,
    /// Requests that waited for the device's limits, and their total wait.
    throttled: AtomicU64,
    throttled_ns: AtomicU64,
    /// Requests served over the limits because no timer could be armed for them.
    throttle_overruns: AtomicU64,
}

/// Adds `n` to a counter that only the calling (owning) thread writes.
fn bump(c: &AtomicU64, n: u64) {
    c.store(c.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

/// The one histogram of ublkd: a count per upper bound, one for larger values (`N` = bounds +
/// 1), and the sum of the observed values, all relaxed atomics that any thread may read.
///
/// Two ways to write it: `observe` for a histogram only one thread writes (a queue's, on its
/// worker: a load and a store, no locked instruction on the I/O path), `observe_shared` for
/// one that several threads write (an atomic add each).
#[derive(Debug)]
pub struct Histogram<const N: usize> {
    counts: [AtomicU64; N],
    sum: AtomicU64,
}

impl<const N: usize> Default for Histogram<N> {
    fn default() -> Self {
        Self {
            counts: std::array::from_fn(|_| AtomicU64::new(0)),
            sum: AtomicU64::new(0),
        }
    }
}

impl<const N: usize> Histogram<N> {
    fn bucket(bounds: &[u64], v: u64) -> usize {
        bounds
            .iter()
            .position(|&ub| v <= ub)
            .unwrap_or(bounds.len())
            .min(N - 1)
    }

    /// Counts `v` against `bounds`; only ever called from one thread.
    pub fn observe(&self, bounds: &[u64], v: u64) {
        bump(&self.counts[Self::bucket(bounds, v)], 1);
        bump(&self.sum, v);
    }

    /// Counts `v` against `bounds`, from any thread.
    pub fn observe_shared(&self, bounds: &[u64], v: u64) {
        self.counts[Self::bucket(bounds, v)].fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(v, Ordering::Relaxed);
    }

    /// Non-cumulative counts and the sum.
    pub fn load(&self) -> (Vec<u64>, u64) {
        (
            self.counts
                .iter()
                .map(|c| c.load(Ordering::Relaxed))
                .collect(),
            self.sum.load(Ordering::Relaxed),
        )
    }
}

impl QueueStats {
    /// A request was handed to the backend.
    pub fn started(&self) {
        bump(&self.inflight, 1);
    }

    /// A request finished with `result` (bytes or negative errno) after `latency_ns`.
    pub fn finished(&self, op: OpKind, bytes: u64, result: i32, latency_ns: u64) {
        let i = op as usize;
        bump(&self.ops[i], 1);
        if result < 0 {
            bump(&self.errors, 1);
        } else {
            bump(&self.bytes[i], bytes);
        }
        let left = self.inflight.load(Ordering::Relaxed);
        self.inflight
            .store(left.saturating_sub(1), Ordering::Relaxed);
        self.latency[i].observe(&LATENCY_BOUNDS_NS, latency_ns);
    }

    /// One loop iteration handled `n` requests of this queue.
    pub fn batch(&self, n: u64) {
        if n > 0 {
            self.batch.observe(&BATCH_BOUNDS, n);
        }
    }

    /// A ublk command (FETCH, COMMIT, PREP) failed with `errno` other than the kernel's normal
    /// "device going away": the queue stops serving. Counted so it never goes unnoticed.
    pub fn protocol_error(&self, errno: i32) {
        bump(&self.protocol_errors, 1);
        self.last_protocol_errno
            .store(u64::from(errno.unsigned_abs()), Ordering::Relaxed);
    }

    /// A request whose pages the kernel could not register was served by copy.
    pub fn zero_copy_fallback(&self) {
        bump(&self.zero_copy_fallbacks, 1);
    }

    /// The worker serving this queue stopped on a fatal ring error `errno`: the queue gets no
    /// more service from this process.
    pub fn worker_failed(&self, errno: i32) {
        self.worker_failed_errno
            .store(u64::from(errno.unsigned_abs().max(1)), Ordering::Relaxed);
    }

    /// The kernel refused the completion of one of this queue's requests with `errno` (an
    /// element of a batch commit): that request cannot complete from this process.
    pub fn commit_refused(&self, errno: i32) {
        self.commit_refused_errno
            .store(u64::from(errno.unsigned_abs().max(1)), Ordering::Relaxed);
    }

    /// A backend operation failed for a passing reason and is sent again.
    pub fn retry(&self) {
        bump(&self.retries, 1);
    }

    /// A request waited `ns` for the device's limits before it started.
    pub fn throttled(&self, ns: u64) {
        bump(&self.throttled, 1);
        bump(&self.throttled_ns, ns);
    }

    /// A request over the limits was served at once: no timer could wake it later.
    pub fn throttle_overrun(&self) {
        bump(&self.throttle_overruns, 1);
    }

    /// Whether the worker serving this queue has failed.
    pub fn is_worker_failed(&self) -> bool {
        self.worker_failed_errno.load(Ordering::Relaxed) != 0
    }

    /// The queue allocated `bytes` of per-tag copy buffers.
    pub fn copy_buffers(&self, bytes: u64) {
        self.copy_buffer_bytes.store(bytes, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> StatsSnapshot {
        let load = |a: &[AtomicU64]| a.iter().map(|c| c.load(Ordering::Relaxed)).collect();
        let op_latency: Vec<Latency> = self
            .latency
            .iter()
            .map(|h| {
                let (buckets, sum_ns) = h.load();
                Latency { buckets, sum_ns }
            })
            .collect();
        let mut all = Latency::default();
        for l in &op_latency {
            all.merge(l);
        }
        let (batch_buckets, batch_sum) = self.batch.load();
        StatsSnapshot {
            ops: load(&self.ops),
            bytes: load(&self.bytes),
            errors: self.errors.load(Ordering::Relaxed),
            inflight: self.inflight.load(Ordering::Relaxed),
            latency_buckets: all.buckets,
            latency_sum_ns: all.sum_ns,
            op_latency,
            batch_buckets,
            batch_sum,
            protocol_errors: self.protocol_errors.load(Ordering::Relaxed),
            last_protocol_errno: self.last_protocol_errno.load(Ordering::Relaxed),
            zero_copy_fallbacks: self.zero_copy_fallbacks.load(Ordering::Relaxed),
            copy_buffer_bytes: self.copy_buffer_bytes.load(Ordering::Relaxed),
            worker_failed_errno: self.worker_failed_errno.load(Ordering::Relaxed),
            commit_refused_errno: self.commit_refused_errno.load(Ordering::Relaxed),
            retries: self.retries.load(Ordering::Relaxed),
            throttled: self.throttled.load(Ordering::Relaxed),
            throttled_ns: self.throttled_ns.load(Ordering::Relaxed),
            throttle_overruns: self.throttle_overruns.load(Ordering::Relaxed),
        }
    }
}

/// A point-in-time copy of one queue's (or, merged, one device's) counters.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StatsSnapshot {
    /// Indexed by `OpKind as usize`.
    pub ops: Vec<u64>,
    pub bytes: Vec<u64>,
    pub errors: u64,
    pub inflight: u64,
    /// Non-cumulative counts per `LATENCY_BOUNDS` bucket, then one for larger values.
    pub latency_buckets: Vec<u64>,
    pub latency_sum_ns: u64,
    /// The same per op, indexed by `OpKind as usize`.
    pub op_latency: Vec<Latency>,
    /// Non-cumulative counts per `BATCH_BOUNDS` bucket, then one for larger values.
    pub batch_buckets: Vec<u64>,
    pub batch_sum: u64,
    /// ublk commands that failed unexpectedly (each stops its queue), and the last errno.
    pub protocol_errors: u64,
    pub last_protocol_errno: u64,
    /// Zero-copy requests served by copy because the kernel could not register their pages.
    pub zero_copy_fallbacks: u64,
    /// Memory held in per-tag copy buffers (none with zero copy, until a fallback needs them).
    pub copy_buffer_bytes: u64,
    /// Nonzero: the worker serving a queue stopped on this errno (a fatal ring error).
    pub worker_failed_errno: u64,
    /// Nonzero: the kernel refused the completion of a request of a queue with this errno;
    /// that request hangs until the device is taken over (which reissues it).
    pub commit_refused_errno: u64,
    /// Backend operations sent again after a passing failure (NVMe path errors, resets).
    pub retries: u64,
    /// Requests that waited for the device's limits, their total wait, and requests served
    /// over the limits because no timer could be armed.
    pub throttled: u64,
    pub throttled_ns: u64,
    pub throttle_overruns: u64,
}

impl StatsSnapshot {
    /// Adds `other` into `self` (queues of one device).
    pub fn merge(&mut self, other: &StatsSnapshot) {
        fn add(a: &mut Vec<u64>, b: &[u64]) {
            if a.len() < b.len() {
                a.resize(b.len(), 0);
            }
            for (x, y) in a.iter_mut().zip(b) {
                *x += y;
            }
        }
        add(&mut self.ops, &other.ops);
        add(&mut self.bytes, &other.bytes);
        add(&mut self.latency_buckets, &other.latency_buckets);
        if self.op_latency.len() < other.op_latency.len() {
            self.op_latency
                .resize(other.op_latency.len(), Latency::default());
        }
        for (a, b) in self.op_latency.iter_mut().zip(&other.op_latency) {
            a.merge(b);
        }
        add(&mut self.batch_buckets, &other.batch_buckets);
        self.errors += other.errors;
        self.inflight += other.inflight;
        self.latency_sum_ns += other.latency_sum_ns;
        self.batch_sum += other.batch_sum;
        self.protocol_errors += other.protocol_errors;
        self.last_protocol_errno = self.last_protocol_errno.max(other.last_protocol_errno);
        self.zero_copy_fallbacks += other.zero_copy_fallbacks;
        self.copy_buffer_bytes += other.copy_buffer_bytes;
        self.worker_failed_errno = self.worker_failed_errno.max(other.worker_failed_errno);
        self.commit_refused_errno = self.commit_refused_errno.max(other.commit_refused_errno);
        self.retries += other.retries;
        self.throttled += other.throttled;
        self.throttled_ns += other.throttled_ns;
        self.throttle_overruns += other.throttle_overruns;
    }

    /// The latency histogram of `op` (empty when none completed).
    pub fn latency_of(&self, op: OpKind) -> Latency {
        self.op_latency
            .get(op as usize)
            .cloned()
            .unwrap_or_default()
    }

    pub fn ops_of(&self, op: OpKind) -> u64 {
        self.ops.get(op as usize).copied().unwrap_or(0)
    }

    pub fn bytes_of(&self, op: OpKind) -> u64 {
        self.bytes.get(op as usize).copied().unwrap_or(0)
    }
}

/// A latency histogram: non-cumulative counts per `LATENCY_BOUNDS` bucket, then one for larger
/// values, and the sum of the latencies in nanoseconds.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Latency {
    pub buckets: Vec<u64>,
    pub sum_ns: u64,
}

impl Latency {
    pub fn count(&self) -> u64 {
        self.buckets.iter().sum()
    }

    fn merge(&mut self, other: &Latency) {
        if self.buckets.len() < other.buckets.len() {
            self.buckets.resize(other.buckets.len(), 0);
        }
        for (a, b) in self.buckets.iter_mut().zip(&other.buckets) {
            *a += b;
        }
        self.sum_ns += other.sum_ns;
    }

    /// The `q` quantile (0..=1) in seconds, estimated as Prometheus' `histogram_quantile` does:
    /// linear within the bucket it falls in (from 0 for the first); the last bound for values
    /// past it. None when nothing was observed.
    pub fn quantile(&self, q: f64) -> Option<f64> {
        let total = self.count();
        if total == 0 {
            return None;
        }
        let rank = q.clamp(0.0, 1.0) * total as f64;
        let mut below = 0u64;
        for (i, &n) in self.buckets.iter().enumerate() {
            let Some(&upper) = LATENCY_BOUNDS.get(i) else {
                return LATENCY_BOUNDS.last().copied();
            };
            if n > 0 && (below + n) as f64 >= rank {
                let lower = if i == 0 { 0.0 } else { LATENCY_BOUNDS[i - 1] };
                let within = (rank - below as f64) / n as f64;
                return Some(lower + (upper - lower) * within);
            }
            below += n;
        }
        LATENCY_BOUNDS.last().copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_histogram_counts_each_value_under_its_first_bound_and_larger_ones_last() {
        const BOUNDS: [u64; 3] = [10, 100, 1000];
        let h = Histogram::<4>::default();
        for v in [0, 10, 11, 100, 5000] {
            h.observe(&BOUNDS, v);
        }
        assert_eq!(h.load(), (vec![2, 2, 0, 1], 5121));
        // Written from several threads at once, nothing is lost.
        let shared = std::sync::Arc::new(Histogram::<4>::default());
        let writers: Vec<_> = (0..4)
            .map(|_| {
                let h = std::sync::Arc::clone(&shared);
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        h.observe_shared(&BOUNDS, 50);
                    }
                })
            })
            .collect();
        for w in writers {
            assert!(w.join().is_ok());
        }
        assert_eq!(shared.load(), (vec![0, 40_000, 0, 0], 2_000_000));
    }

    #[test]
    fn cleanup_failures_are_counted_per_step_under_distinct_names() {
        let c = CleanupErrors::default();
        c.failed(CleanupStep::Wake);
        c.failed(CleanupStep::Wake);
        c.failed(CleanupStep::DelDevAsync);
        let counts = c.counts();
        assert_eq!(counts.len(), CleanupStep::ALL.len());
        let of = |step| counts.iter().find(|(s, _)| *s == step).map(|&(_, n)| n);
        assert_eq!(of(CleanupStep::Wake), Some(2));
        assert_eq!(of(CleanupStep::DelDevAsync), Some(1));
        assert_eq!(of(CleanupStep::FetchRearm), Some(0));
        let names: std::collections::BTreeSet<_> =
            CleanupStep::ALL.iter().map(|s| s.name()).collect();
        assert_eq!(names.len(), CleanupStep::ALL.len());
        for (i, s) in CleanupStep::ALL.iter().enumerate() {
            assert_eq!(s.index(), i, "ALL is in declaration order");
        }
    }

    #[test]
    fn counts_bytes_errors_latency_and_batches() {
        let s = QueueStats::default();
        s.started();
        s.started();
        s.finished(OpKind::Read, 4096, 4096, 7_000);
        s.finished(OpKind::Write, 8192, -5, 2_000_000_000);
        s.batch(3);
        let snap = s.snapshot();
        assert_eq!(snap.ops_of(OpKind::Read), 1);
        assert_eq!(snap.bytes_of(OpKind::Read), 4096);
        assert_eq!(snap.bytes_of(OpKind::Write), 0, "failed I/O moves no bytes");
        assert_eq!(snap.errors, 1);
        assert_eq!(snap.inflight, 0);
        assert_eq!(snap.latency_buckets[0], 1);
        assert_eq!(
            snap.latency_buckets[16], 1,
            "over 1 s lands in the last bucket"
        );
        assert_eq!(snap.batch_buckets[2], 1, "3 falls in the <=4 bucket");
        let mut total = snap.clone();
        total.merge(&snap);
        assert_eq!(total.ops_of(OpKind::Read), 2);
        assert_eq!(total.latency_of(OpKind::Read).count(), 2);
        assert_eq!(total.latency_of(OpKind::Write).buckets[16], 2);
        assert_eq!(total.latency_of(OpKind::Flush).count(), 0);
    }

    #[test]
    fn latency_quantiles_follow_histogram_quantile() {
        let s = QueueStats::default();
        assert_eq!(s.snapshot().latency_of(OpKind::Read).quantile(0.5), None);
        // 90 reads in (10, 25] µs, 10 in (1, 2.5] ms.
        for _ in 0..90 {
            s.finished(OpKind::Read, 4096, 4096, 20_000);
        }
        for _ in 0..10 {
            s.finished(OpKind::Read, 4096, 4096, 2_000_000);
        }
        s.finished(OpKind::Write, 4096, 4096, 5_000_000_000);
        let snap = s.snapshot();
        let read = snap.latency_of(OpKind::Read);
        let p50 = read.quantile(0.5).unwrap();
        assert!((10e-6..=25e-6).contains(&p50), "{p50}");
        let p99 = read.quantile(0.99).unwrap();
        assert!((1e-3..=2.5e-3).contains(&p99), "{p99}");
        assert_eq!(
            snap.latency_of(OpKind::Write).quantile(0.99),
            Some(1.0),
            "past the last bound: the last bound"
        );
        assert_eq!(
            snap.latency_buckets.iter().sum::<u64>(),
            101,
            "totals over ops"
        );
    }
}

/// A step that tidies up after another, or keeps a worker in step with the control thread,
/// whose failure no caller can act on: the work it belongs to has already succeeded or failed
/// on its own. It is never silent for that: each failure is counted here, per worker (the
/// control thread's own under `control`), as `ublkd_worker_cleanup_errors_total{worker,
/// step}`, and the server logs every rise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CleanupStep {
    /// A batch queue's fetch, ended by the kernel, could not be armed again: the queue stops
    /// serving (also counted as its protocol error).
    FetchRearm,
    /// A queue's char device could not join the ring's registered files: its commands go by
    /// descriptor, which works as well.
    RegisterFile,
    /// A queue's registered buffer could not be released at teardown: the slot stays taken.
    UnregisterBuffer,
    /// A batch queue's provided-buffer ring could not be unregistered at teardown.
    UnregisterBufRing,
    /// A worker's eventfd could not be written: it sees the command at its next completion.
    Wake,
    /// A worker thread panicked (seen when it was joined at shutdown).
    WorkerPanicked,
    /// After a drain that timed out, a worker could not be told to resume the device.
    ResumeAfterDrainTimeout,
    /// A device whose creation failed could not be torn down in full.
    UndoFailedAdd,
    /// DEL_DEV_ASYNC of a device whose queues are held by a failed worker: the next start
    /// deletes it.
    DelDevAsync,
    /// The shutdown that follows the last handle's drop did not finish cleanly.
    ShutdownWithoutHandles,
    /// A new device's I/O scheduler could not be set to `none`: it keeps the kernel's default
    /// (mq-deadline for one queue, which costs a kblockd wake-up per request).
    IoScheduler,
}

impl CleanupStep {
    pub const ALL: [CleanupStep; 11] = [
        CleanupStep::FetchRearm,
        CleanupStep::RegisterFile,
        CleanupStep::UnregisterBuffer,
        CleanupStep::UnregisterBufRing,
        CleanupStep::Wake,
        CleanupStep::WorkerPanicked,
        CleanupStep::ResumeAfterDrainTimeout,
        CleanupStep::UndoFailedAdd,
        CleanupStep::DelDevAsync,
        CleanupStep::ShutdownWithoutHandles,
        CleanupStep::IoScheduler,
    ];

    /// Its `step` label.
    pub fn name(self) -> &'static str {
        match self {
            CleanupStep::FetchRearm => "fetch_rearm",
            CleanupStep::RegisterFile => "register_file",
            CleanupStep::UnregisterBuffer => "unregister_buffer",
            CleanupStep::UnregisterBufRing => "unregister_buf_ring",
            CleanupStep::Wake => "wake",
            CleanupStep::WorkerPanicked => "worker_panicked",
            CleanupStep::ResumeAfterDrainTimeout => "resume_after_drain_timeout",
            CleanupStep::UndoFailedAdd => "undo_failed_add",
            CleanupStep::DelDevAsync => "del_dev_async",
            CleanupStep::ShutdownWithoutHandles => "shutdown_without_handles",
            CleanupStep::IoScheduler => "io_scheduler",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Failures of [`CleanupStep`]s. Written by the worker and by the control thread (a wake, a
/// join), so counted with a read-modify-write; none of them is on the I/O path.
#[derive(Debug, Default)]
pub struct CleanupErrors([AtomicU64; CleanupStep::ALL.len()]);

impl CleanupErrors {
    pub fn failed(&self, step: CleanupStep) {
        self.0[step.index()].fetch_add(1, Ordering::Relaxed);
    }

    /// Every step with its count so far, in [`CleanupStep::ALL`]'s order.
    pub fn counts(&self) -> Vec<(CleanupStep, u64)> {
        CleanupStep::ALL
            .iter()
            .map(|&s| (s, self.0[s.index()].load(Ordering::Relaxed)))
            .collect()
    }
}

/// Per-worker counters: time spent handling completions vs. sleeping in the kernel.
#[derive(Debug, Default)]
pub struct WorkerStats {
    busy_ns: AtomicU64,
    idle_ns: AtomicU64,
    batch: Histogram<10>,
    /// Transient ring errors (EAGAIN, ENOMEM) waited out.
    ring_retries: AtomicU64,
    /// The errno of the fatal ring error that stopped the worker (0: it runs).
    down_errno: AtomicU64,
    /// The io-wq thread limits in force, bounded in the high half, unbounded in the low
    /// (`ring::iowq_limits`); a failed update leaves the previous ones here.
    iowq_limits: AtomicU64,
    /// Whether the worker's thread runs pinned to its CPU (set once, at its start).
    pinned: AtomicBool,
    cleanup: CleanupErrors,
    /// Waits for work that ended while spinning, then those that slept (`Wait`).
    waits: [AtomicU64; 2],
}

/// How a worker's wait for work ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Wait {
    /// Work came while it spun in user space (`crate::poll::idle_spin`).
    Spun,
    /// It spun for its whole bound, then slept in the kernel.
    Slept,
}

impl Wait {
    pub const ALL: [Wait; 2] = [Wait::Spun, Wait::Slept];

    /// The label value in metrics.
    pub fn name(self) -> &'static str {
        match self {
            Wait::Spun => "spun",
            Wait::Slept => "slept",
        }
    }
}

impl WorkerStats {
    /// Whether pinning the worker to its CPU worked: without it the worker still serves, but
    /// the placement it reports is not the one in force.
    pub fn set_pinned(&self, pinned: bool) {
        self.pinned.store(pinned, Ordering::Relaxed);
    }

    pub fn pinned(&self) -> bool {
        self.pinned.load(Ordering::Relaxed)
    }

    pub fn cleanup_failed(&self, step: CleanupStep) {
        self.cleanup.failed(step);
    }

    pub fn cleanup_errors(&self) -> Vec<(CleanupStep, u64)> {
        self.cleanup.counts()
    }

    /// A wait for work ended `how`. Waits of a worker that does not spin are not counted.
    pub fn waited(&self, how: Wait) {
        bump(&self.waits[how as usize], 1);
    }

    /// Waits that ended spinning, then sleeping.
    pub fn waits(&self) -> [u64; 2] {
        [
            self.waits[0].load(Ordering::Relaxed),
            self.waits[1].load(Ordering::Relaxed),
        ]
    }

    pub fn ring_retry(&self) {
        bump(&self.ring_retries, 1);
    }

    pub fn ring_retries(&self) -> u64 {
        self.ring_retries.load(Ordering::Relaxed)
    }

    /// The worker stopped serving on a fatal ring error.
    pub fn down(&self, errno: i32) {
        self.down_errno
            .store(u64::from(errno.unsigned_abs().max(1)), Ordering::Relaxed);
    }

    /// None while the worker runs, else the errno that stopped it.
    pub fn down_errno(&self) -> Option<u64> {
        Some(self.down_errno.load(Ordering::Relaxed)).filter(|&e| e != 0)
    }

    pub fn set_iowq_limits(&self, [bounded, unbounded]: [u32; 2]) {
        self.iowq_limits.store(
            u64::from(bounded) << 32 | u64::from(unbounded),
            Ordering::Relaxed,
        );
    }

    /// `[bounded, unbounded]` io-wq threads the worker may have now.
    pub fn iowq_limits(&self) -> [u32; 2] {
        let v = self.iowq_limits.load(Ordering::Relaxed);
        [(v >> 32) as u32, v as u32]
    }

    pub fn busy(&self, d: std::time::Duration) {
        bump(&self.busy_ns, d.as_nanos() as u64);
    }

    pub fn idle(&self, d: std::time::Duration) {
        bump(&self.idle_ns, d.as_nanos() as u64);
    }

    /// One loop iteration started `n` requests (over all its queues).
    pub fn batch(&self, n: u64) {
        if n > 0 {
            self.batch.observe(&BATCH_BOUNDS, n);
        }
    }

    /// Non-cumulative batch-size buckets (per `BATCH_BOUNDS`, then larger) and their sum.
    pub fn batches(&self) -> (Vec<u64>, u64) {
        self.batch.load()
    }

    /// (busy, idle) seconds so far.
    pub fn seconds(&self) -> (f64, f64) {
        (
            self.busy_ns.load(Ordering::Relaxed) as f64 / 1e9,
            self.idle_ns.load(Ordering::Relaxed) as f64 / 1e9,
        )
    }
}
