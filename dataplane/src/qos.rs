//! Per-device I/O limits: token buckets for read and write IOPS and bandwidth, shared by the
//! device's queues (which may sit on different workers), refilled from the caller's clock.
//!
//! Only limited devices have a [`Throttle`]: an unlimited device's queues hold `None` and their
//! requests pay one branch, no clock read. A limited device's queues, which may be served by
//! different workers, share its buckets without a lock: each bucket is one atomic word, so no
//! worker ever waits for another to admit a request.
//!
//! Each bucket is kept as its theoretical arrival time (GCRA): the instant `tat` at which it
//! would be full again if nothing more were taken. A bucket of rate `r` holding `burst` of it
//! has `(now + burst - tat) * r` tokens, so it is not empty while `tat < now + burst`, and
//! taking `cost` tokens moves `tat` to `max(tat, now) + cost / r` (the `max` is the cap at a
//! full bucket). Taking is one compare-and-swap, and the one word is the whole state.
//!
//! Buckets allow debt: a request is admitted when its buckets are not empty and then takes its
//! whole cost, so a request larger than the bucket still goes (and the next ones wait longer).
//! Two workers admitting at the same instant may both see the last token and both take it:
//! debt again, repaid by the next requests' waits, so the rate over time holds.
//! Requests the buckets refuse wait in their worker ([`Throttle::admit`] says how long); a
//! queue has at most its depth of them, so the wait is bounded by the queue depth.

use crate::stats::OpKind;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The bucket never holds less than this much of its rate, so a worker woken a little late
/// by its timer loses no tokens (the bucket would otherwise be full and discard them).
const MIN_DEPTH: Duration = Duration::from_millis(20);
/// Longest single wait: a changed limit is seen at the next wake.
pub const MAX_WAIT: Duration = Duration::from_millis(50);
/// Shortest wait worth a timer.
const MIN_WAIT: Duration = Duration::from_micros(20);

/// Limits of one device; 0 means unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[cfg_attr(
    feature = "serde",
    derive(serde::Serialize, serde::Deserialize),
    serde(default)
)]
pub struct QosLimits {
    pub read_iops: u64,
    pub write_iops: u64,
    pub read_bytes_per_sec: u64,
    pub write_bytes_per_sec: u64,
    /// How long an idle device may then run above its limits: each bucket holds this long of
    /// its rate (at least 20 ms). 0: the default, 100 ms.
    pub burst_ms: u32,
}

/// The burst when none is given.
pub const DEFAULT_BURST: Duration = Duration::from_millis(100);

impl QosLimits {
    pub fn is_unlimited(&self) -> bool {
        self.read_iops == 0
            && self.write_iops == 0
            && self.read_bytes_per_sec == 0
            && self.write_bytes_per_sec == 0
    }

    pub fn burst(&self) -> Duration {
        if self.burst_ms == 0 {
            DEFAULT_BURST
        } else {
            Duration::from_millis(u64::from(self.burst_ms))
        }
    }
}

/// Which limits a request counts against.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Direction {
    Read,
    Write,
}

impl Direction {
    /// Reads count as reads; writes, write-zeroes and discards as writes; flushes and
    /// anything else are never limited.
    pub fn of(op: OpKind) -> Option<Direction> {
        match op {
            OpKind::Read => Some(Direction::Read),
            OpKind::Write | OpKind::WriteZeroes | OpKind::Discard => Some(Direction::Write),
            _ => None,
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// What a discard, or a write-zeroes its backend deallocates, costs the byte bucket: one
/// sector, as the kernel's blk-throttle charges a discard (`throtl_bio_data_size`). Neither
/// moves data through a device, so charging their length would make a weekly fstrim of a
/// throttled volume stall its writes for hours.
pub const RANGE_OP_CHARGE: u64 = 512;

/// Bytes request `op` of `len` bytes takes from its byte bucket (one I/O from the IOPS bucket
/// whatever its kind). A write-zeroes whose backend writes real zeroes
/// (`zeroes_deallocate` false: NVMe Write Zeroes, a block device) pays its length, as
/// blk-throttle charges it: otherwise it would write past the limit unthrottled.
pub fn charged_bytes(op: OpKind, len: u32, zeroes_deallocate: bool) -> u64 {
    match op {
        OpKind::Discard => RANGE_OP_CHARGE.min(u64::from(len)),
        OpKind::WriteZeroes if zeroes_deallocate => RANGE_OP_CHARGE.min(u64::from(len)),
        _ => u64::from(len),
    }
}

const NANOS: f64 = 1e9;

/// One token bucket: its rate (per second; 0, unlimited) and its theoretical arrival time (ns
/// after the throttle's epoch).
#[derive(Debug, Default)]
struct Bucket {
    rate: AtomicU64,
    tat: AtomicU64,
}

impl Bucket {
    /// Sets the rate and fills the bucket (`tat` at the epoch is at or before any `now`).
    fn reset(&self, rate: u64) {
        self.rate.store(rate, Ordering::Relaxed);
        self.tat.store(0, Ordering::Relaxed);
    }

    /// The nanoseconds until the bucket holds a whole token, if it is empty at `now`; `None`
    /// when it is not empty (or unlimited).
    fn wait(&self, now: u64, burst: u64) -> Option<f64> {
        let rate = self.rate.load(Ordering::Relaxed);
        let tat = self.tat.load(Ordering::Relaxed);
        if rate == 0 || tat < now.saturating_add(burst) {
            return None;
        }
        // One token is there at `tat - burst + 1/r`.
        Some((tat - burst) as f64 + NANOS / rate as f64 - now as f64)
    }

    fn take(&self, now: u64, cost: u64) {
        let rate = self.rate.load(Ordering::Relaxed);
        if rate == 0 {
            return;
        }
        let span = (cost as f64 * NANOS / rate as f64) as u64;
        let mut tat = self.tat.load(Ordering::Relaxed);
        loop {
            let next = tat.max(now).saturating_add(span);
            match self
                .tat
                .compare_exchange_weak(tat, next, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return,
                Err(seen) => tat = seen,
            }
        }
    }
}

/// The shared buckets of one limited device: `[read, write]` × `[iops, bytes]`.
#[derive(Debug)]
pub struct Throttle {
    /// The zero of every bucket's `tat`.
    epoch: Instant,
    /// What a full bucket holds, as time at its rate (the burst, at least [`MIN_DEPTH`]).
    burst_ns: AtomicU64,
    /// The burst as asked (0: the default), to tell a change from a repeat (`set_limits`);
    /// the rates asked are the buckets' own.
    burst_ms: AtomicU32,
    buckets: [[Bucket; 2]; 2],
}

impl Throttle {
    pub fn new(limits: QosLimits) -> Self {
        let t = Self {
            epoch: Instant::now(),
            burst_ns: AtomicU64::new(0),
            burst_ms: AtomicU32::new(0),
            buckets: Default::default(),
        };
        t.install(limits);
        t
    }

    fn install(&self, l: QosLimits) {
        let burst = l.burst().max(MIN_DEPTH).as_nanos();
        self.burst_ns
            .store(u64::try_from(burst).unwrap_or(u64::MAX), Ordering::Relaxed);
        let rates = [
            l.read_iops,
            l.read_bytes_per_sec,
            l.write_iops,
            l.write_bytes_per_sec,
        ];
        for (i, rate) in rates.into_iter().enumerate() {
            self.buckets[i / 2][i % 2].reset(rate);
        }
        self.burst_ms.store(l.burst_ms, Ordering::Relaxed);
    }

    fn current(&self) -> QosLimits {
        let rate = |i: usize| self.buckets[i / 2][i % 2].rate.load(Ordering::Relaxed);
        QosLimits {
            read_iops: rate(0),
            read_bytes_per_sec: rate(1),
            write_iops: rate(2),
            write_bytes_per_sec: rate(3),
            burst_ms: self.burst_ms.load(Ordering::Relaxed),
        }
    }

    /// New limits, in effect for the next request; the buckets start full. Called by one
    /// thread at a time (the control thread); a request admitted meanwhile is charged at the
    /// old rates or the new.
    pub fn set_limits(&self, limits: QosLimits) {
        if self.current() != limits {
            self.install(limits);
        }
    }

    /// Admits a request of `bytes` in direction `dir` at `now` (taking its tokens), or says
    /// how long to wait before asking again (at most [`MAX_WAIT`]).
    pub fn admit(&self, dir: Direction, bytes: u64, now: Instant) -> Result<(), Duration> {
        let now =
            u64::try_from(now.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX);
        let burst = self.burst_ns.load(Ordering::Relaxed);
        let [iops, data] = &self.buckets[dir.index()];
        let wait = match (iops.wait(now, burst), data.wait(now, burst)) {
            (None, None) => None,
            (a, b) => Some(a.unwrap_or(0.0).max(b.unwrap_or(0.0))),
        };
        if let Some(ns) = wait {
            let d = Duration::from_nanos(ns.max(0.0) as u64);
            return Err(d.clamp(MIN_WAIT, MAX_WAIT));
        }
        iops.take(now, 1);
        data.take(now, bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(read_iops: u64, read_bw: u64) -> QosLimits {
        QosLimits {
            read_iops,
            read_bytes_per_sec: read_bw,
            burst_ms: 20,
            ..QosLimits::default()
        }
    }

    /// Drives the throttle with an always-waiting client on a simulated clock: the admitted
    /// count over `secs` seconds.
    fn admitted(t: &Throttle, dir: Direction, bytes: u64, start: Instant, secs: u64) -> u64 {
        let mut now = start;
        let end = start + Duration::from_secs(secs);
        let mut n = 0;
        while now < end {
            match t.admit(dir, bytes, now) {
                Ok(()) => n += 1,
                // Wake 10 % late, as a loaded worker would.
                Err(w) => now += w + w / 10,
            }
        }
        n
    }

    #[test]
    fn iops_limit_holds_over_time_even_with_late_wakes() {
        let t = Throttle::new(limits(1000, 0));
        let start = Instant::now();
        let n = admitted(&t, Direction::Read, 4096, start, 10);
        // 10 s at 1000/s, plus the initial bucket (20 ms = 20 requests).
        assert!((9_900..=10_100).contains(&n), "admitted {n}");
    }

    #[test]
    fn bandwidth_limit_admits_large_requests_on_debt() {
        // 1 MiB/s with 4 MiB requests: each takes four seconds of tokens.
        let t = Throttle::new(limits(0, 1 << 20));
        let n = admitted(&t, Direction::Read, 4 << 20, Instant::now(), 20);
        assert!((5..=6).contains(&n), "admitted {n}");
    }

    #[test]
    fn directions_are_independent_and_flushes_unlimited() {
        let t = Throttle::new(limits(10, 0));
        let now = Instant::now();
        while t.admit(Direction::Read, 0, now).is_ok() {}
        assert!(t.admit(Direction::Read, 0, now).is_err());
        assert!(t.admit(Direction::Write, 0, now).is_ok());
        assert_eq!(Direction::of(OpKind::Flush), None);
        assert_eq!(Direction::of(OpKind::Discard), Some(Direction::Write));
    }

    /// A discard or write-zeroes of a GiB costs a sector, not a GiB (issue 22, item 10): at
    /// 1 MiB/s a 1 GiB discard would otherwise hold the volume's writes for 17 minutes.
    #[test]
    fn discards_and_write_zeroes_cost_one_small_io() {
        let t = Throttle::new(QosLimits {
            write_bytes_per_sec: 1 << 20,
            burst_ms: 100,
            ..QosLimits::default()
        });
        let gib = 1u32 << 30;
        let start = Instant::now();
        for op in [OpKind::Discard, OpKind::WriteZeroes] {
            assert_eq!(charged_bytes(op, gib, true), RANGE_OP_CHARGE);
            // The 100 ms bucket (100 KiB) admits 200 of them at once.
            for i in 0..200 {
                assert!(
                    t.admit(Direction::Write, charged_bytes(op, gib, true), start)
                        .is_ok(),
                    "{op:?} {i} waited"
                );
            }
            t.set_limits(QosLimits::default());
            t.set_limits(QosLimits {
                write_bytes_per_sec: 1 << 20,
                burst_ms: 100,
                ..QosLimits::default()
            });
        }
        // Data-moving requests still pay their length.
        assert_eq!(charged_bytes(OpKind::Write, 4096, true), 4096);
        assert_eq!(charged_bytes(OpKind::Read, 1 << 20, true), 1 << 20);
        // A write after a discard is not held by it.
        assert!(t
            .admit(
                Direction::Write,
                charged_bytes(OpKind::Discard, gib, false),
                start
            )
            .is_ok());
        assert!(t.admit(Direction::Write, 4096, start).is_ok());
        // A write-zeroes its backend writes through (issue 38, defect 10) pays its length.
        assert_eq!(
            charged_bytes(OpKind::WriteZeroes, gib, false),
            u64::from(gib)
        );
        assert_eq!(
            charged_bytes(OpKind::Discard, gib, false),
            RANGE_OP_CHARGE,
            "a discard never writes"
        );
    }

    #[test]
    fn waits_are_bounded_so_a_raised_limit_is_seen_soon() {
        let t = Throttle::new(limits(1, 0));
        let now = Instant::now();
        while t.admit(Direction::Read, 0, now).is_ok() {}
        assert_eq!(t.admit(Direction::Read, 0, now), Err(MAX_WAIT));
        t.set_limits(limits(1_000_000, 0));
        assert!(t.admit(Direction::Read, 0, now).is_ok());
    }

    /// Four workers admitting from one full bucket at the same instant: the bucket's 100
    /// tokens go, no more than one extra per other worker (the documented debt), none lost.
    #[test]
    fn workers_share_the_buckets_without_a_lock() {
        let t = std::sync::Arc::new(Throttle::new(QosLimits {
            read_iops: 1000,
            burst_ms: 100,
            ..QosLimits::default()
        }));
        let now = Instant::now();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let t = std::sync::Arc::clone(&t);
                std::thread::spawn(move || {
                    let mut n = 0u64;
                    while t.admit(Direction::Read, 4096, now).is_ok() {
                        n += 1;
                    }
                    n
                })
            })
            .map(|h| h.join().unwrap_or(0))
            .collect();
        let n: u64 = threads.iter().sum();
        assert!((100..=103).contains(&n), "admitted {n} ({threads:?})");
        // And the debt is repaid: 100 ms later about 100 more, not 200.
        let later = now + Duration::from_millis(100);
        let mut more = 0;
        while t.admit(Direction::Read, 4096, later).is_ok() {
            more += 1;
        }
        assert!((97..=100).contains(&more), "then {more}");
    }

    #[test]
    fn unlimited_means_no_limit_set() {
        assert!(QosLimits::default().is_unlimited());
        assert!(!limits(1, 0).is_unlimited());
        assert_eq!(QosLimits::default().burst(), DEFAULT_BURST);
    }
}
