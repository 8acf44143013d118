//! A queue's protocol state, apart from the rings: what the kernel still holds of the queue,
//! what each fetch and commit completion means, and which finished tags go out in which commit.
//! The worker pushes the commands these decide on; the decisions themselves are plain data and
//! are tested on the host below, with synthetic completions.

use crate::ids::Tag;

/// Commit buffers per batch queue, so a new commit can go out while one is in flight.
pub(super) const COMMIT_BUFS: usize = 2;

/// What the kernel holds of a queue, and whether the queue is on its way out. A queue is torn
/// down only once it is stopping and every command pushed for it has completed: its buffers
/// stay the kernel's until then.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Life {
    outstanding: usize,
    stopping: bool,
}

impl Life {
    /// A command of the queue was pushed: the kernel will answer it.
    pub(super) fn pushed(&mut self) {
        self.outstanding += 1;
    }

    /// A command of the queue was answered for the last time.
    pub(super) fn completed(&mut self) {
        self.outstanding = self.outstanding.saturating_sub(1);
    }

    /// The queue serves no new requests: the device is going away or the protocol broke.
    pub(super) fn stop(&mut self) {
        self.stopping = true;
    }

    pub(super) fn stopping(&self) -> bool {
        self.stopping
    }

    #[cfg(test)]
    pub(super) fn outstanding(&self) -> usize {
        self.outstanding
    }

    /// Stopping, and the kernel holds nothing of the queue: it can be torn down.
    pub(super) fn is_dead(&self) -> bool {
        self.stopping && self.outstanding == 0
    }
}

/// What one completion of a ublk command means for its queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Verdict {
    /// The command is finished (not a multishot completion with more to come).
    pub(super) ended: bool,
    /// Arm the command again (a multishot fetch that ended for a passing reason).
    pub(super) rearm: bool,
    /// The queue stops serving.
    pub(super) stop: bool,
    /// A result the protocol does not expect, to count (negative errno).
    pub(super) protocol_error: Option<i32>,
}

/// A multishot FETCH_IO_CMDS completion: `more` while the fetch stays armed. It ends when its
/// buffer group ran dry (-ENOBUFS: arm again), when the device goes away (-ENODEV: stop,
/// expected), or on any other error (stop, counted).
pub(super) fn fetch_verdict(result: i32, more: bool) -> Verdict {
    let failed = result < 0 && result != -libc::ENOBUFS;
    Verdict {
        ended: !more,
        rearm: !more && !failed,
        stop: failed,
        protocol_error: (failed && result != -libc::ENODEV).then_some(result),
    }
}

/// A per-IO FETCH_REQ or COMMIT_AND_FETCH_REQ completion: OK carries a new request for the tag;
/// ABORT means the device goes away; anything else is a protocol error. Each ends its command.
pub(super) fn io_cmd_verdict(result: i32) -> Verdict {
    let ok = result == crate::sys::UBLK_IO_RES_OK;
    Verdict {
        ended: true,
        rearm: false,
        stop: !ok,
        protocol_error: (!ok && result != crate::sys::UBLK_IO_RES_ABORT).then_some(result),
    }
}

/// What a COMMIT_IO_CMDS completion says of the elements it carried.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum CommitOutcome {
    /// The kernel took every element.
    Done,
    /// The kernel took the first `taken` and refused the next: that one is dropped (resending
    /// it would be refused again; its request stays with the kernel until the device stops),
    /// and `resent` elements after it, never looked at, are pending again.
    Partial {
        taken: usize,
        dropped: (Tag, i32),
        resent: usize,
    },
    /// The kernel refused the whole commit (errno): those requests never complete.
    Refused(i32),
    /// Refused because the device is going away, which the queue already knows: expected.
    Aborted,
}

/// The finished tags of a batch queue on their way to the kernel: pending ones, and those of
/// the commit in flight in each commit buffer.
#[derive(Debug)]
pub(super) struct Commits {
    pending: Vec<(Tag, i32)>,
    committing: [Vec<(Tag, i32)>; COMMIT_BUFS],
    busy: [bool; COMMIT_BUFS],
}

impl Commits {
    pub(super) fn new(depth: usize) -> Self {
        Self {
            pending: Vec::with_capacity(depth),
            committing: [Vec::with_capacity(depth), Vec::with_capacity(depth)],
            busy: [false; COMMIT_BUFS],
        }
    }

    /// Request `tag` finished with `result`: it goes out with the next commit.
    pub(super) fn finished(&mut self, tag: Tag, result: i32) {
        self.pending.push((tag, result));
    }

    pub(super) fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Moves up to `max` pending elements into a free commit buffer and returns its index, or
    /// None when nothing is pending or both buffers are in flight (their completions flush
    /// again). The caller writes `committing(i)` out, then calls `sent` or `unsent`.
    pub(super) fn take(&mut self, max: usize) -> Option<usize> {
        if self.pending.is_empty() {
            return None;
        }
        let i = self.busy.iter().position(|busy| !busy)?;
        let n = self.pending.len().min(max);
        let sent = &mut self.committing[i];
        sent.clear();
        sent.extend(self.pending.drain(..n));
        Some(i)
    }

    /// The elements of commit buffer `i`.
    pub(super) fn committing(&self, i: usize) -> &[(Tag, i32)] {
        &self.committing[i]
    }

    /// Test hook: changes what commit buffer `i` carries before it is sent.
    pub(super) fn committing_mut(&mut self, i: usize) -> &mut Vec<(Tag, i32)> {
        &mut self.committing[i]
    }

    /// Commit buffer `i` was pushed: in flight until its completion.
    pub(super) fn sent(&mut self, i: usize) {
        self.busy[i] = true;
    }

    /// Commit buffer `i` could not be pushed; the queue stops, and its elements are dropped.
    pub(super) fn unsent(&mut self, i: usize) {
        self.committing[i].clear();
    }

    /// The commit of buffer `i` completed with `result` (bytes of elements the kernel took, or
    /// a negative errno); `elem_bytes` is the size of one element, `stopping` whether the
    /// queue already knows its device is going away.
    pub(super) fn completed(
        &mut self,
        i: usize,
        result: i32,
        elem_bytes: usize,
        stopping: bool,
    ) -> CommitOutcome {
        let i = i % COMMIT_BUFS;
        self.busy[i] = false;
        let sent = std::mem::take(&mut self.committing[i]);
        let outcome = if result >= 0 {
            let taken = (result as usize) / elem_bytes.max(1);
            if taken < sent.len() {
                let rest = &sent[taken + 1..];
                self.pending.extend_from_slice(rest);
                CommitOutcome::Partial {
                    taken,
                    dropped: sent[taken],
                    resent: rest.len(),
                }
            } else {
                CommitOutcome::Done
            }
        } else if result == -libc::ENODEV && stopping {
            CommitOutcome::Aborted
        } else {
            CommitOutcome::Refused(result)
        };
        let mut sent = sent;
        sent.clear();
        self.committing[i] = sent;
        outcome
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const EB: usize = 8;

    fn tags(v: &[u16]) -> Vec<(Tag, i32)> {
        v.iter().map(|&t| (Tag(t), 4096)).collect()
    }

    #[test]
    fn a_queue_is_dead_only_when_stopping_with_nothing_outstanding() {
        let mut life = Life::default();
        // PREP plus two multishot fetches.
        for _ in 0..3 {
            life.pushed();
        }
        life.completed(); // PREP
        life.stop();
        assert!(!life.is_dead(), "two fetches still armed");
        life.completed();
        assert!(!life.is_dead());
        life.completed();
        assert!(life.is_dead());
        // A stray extra completion does not wrap the count.
        life.completed();
        assert_eq!(life.outstanding(), 0);
        let mut serving = Life::default();
        serving.pushed();
        serving.completed();
        assert!(!serving.is_dead(), "not stopping: idle, not dead");
    }

    #[test]
    fn fetch_completions_rearm_stop_or_count() {
        // Tags delivered, fetch still armed.
        let v = fetch_verdict(8, true);
        assert_eq!(
            (v.ended, v.rearm, v.stop, v.protocol_error),
            (false, false, false, None)
        );
        // Ended with tags (the kernel ends multishot on its own): armed again.
        let v = fetch_verdict(8, false);
        assert_eq!(
            (v.ended, v.rearm, v.stop, v.protocol_error),
            (true, true, false, None)
        );
        // Buffer group ran dry: armed again, not an error.
        let v = fetch_verdict(-libc::ENOBUFS, false);
        assert_eq!(
            (v.ended, v.rearm, v.stop, v.protocol_error),
            (true, true, false, None)
        );
        // Device going away: stop, expected.
        let v = fetch_verdict(-libc::ENODEV, false);
        assert_eq!(
            (v.ended, v.rearm, v.stop, v.protocol_error),
            (true, false, true, None)
        );
        // Anything else: stop and count it.
        let v = fetch_verdict(-libc::EINVAL, false);
        assert_eq!(
            (v.ended, v.rearm, v.stop, v.protocol_error),
            (true, false, true, Some(-libc::EINVAL))
        );
    }

    #[test]
    fn per_io_completions_serve_abort_or_count() {
        let ok = io_cmd_verdict(crate::sys::UBLK_IO_RES_OK);
        assert!(ok.ended && !ok.stop && ok.protocol_error.is_none());
        let abort = io_cmd_verdict(crate::sys::UBLK_IO_RES_ABORT);
        assert!(abort.stop && abort.protocol_error.is_none());
        let bad = io_cmd_verdict(-libc::EINVAL);
        assert!(bad.stop);
        assert_eq!(bad.protocol_error, Some(-libc::EINVAL));
    }

    #[test]
    fn a_full_commit_leaves_nothing_pending() {
        let mut c = Commits::new(4);
        for (t, r) in tags(&[0, 1, 2]) {
            c.finished(t, r);
        }
        let i = c.take(4).expect("a free buffer");
        assert_eq!(c.committing(i), tags(&[0, 1, 2]).as_slice());
        assert!(!c.has_pending());
        c.sent(i);
        assert_eq!(
            c.completed(i, 3 * EB as i32, EB, false),
            CommitOutcome::Done
        );
        assert!(!c.has_pending());
        assert!(c.committing(i).is_empty());
    }

    #[test]
    fn a_partial_commit_drops_the_refused_element_and_resends_the_rest() {
        let mut c = Commits::new(8);
        for (t, r) in tags(&[0, 1, 2, 3, 4]) {
            c.finished(t, r);
        }
        let i = c.take(8).expect("a free buffer");
        c.sent(i);
        // The kernel took two elements and refused the third.
        let out = c.completed(i, 2 * EB as i32, EB, false);
        assert_eq!(
            out,
            CommitOutcome::Partial {
                taken: 2,
                dropped: (Tag(2), 4096),
                resent: 2
            }
        );
        let j = c.take(8).expect("the rest goes out again");
        assert_eq!(c.committing(j), tags(&[3, 4]).as_slice());
    }

    #[test]
    fn a_partial_commit_refusing_the_last_element_resends_nothing() {
        let mut c = Commits::new(4);
        for (t, r) in tags(&[5, 6]) {
            c.finished(t, r);
        }
        let i = c.take(4).expect("a free buffer");
        c.sent(i);
        let out = c.completed(i, EB as i32, EB, false);
        assert_eq!(
            out,
            CommitOutcome::Partial {
                taken: 1,
                dropped: (Tag(6), 4096),
                resent: 0
            }
        );
        assert!(!c.has_pending());
    }

    #[test]
    fn a_refused_commit_is_an_error_unless_the_device_is_going_away() {
        let mut c = Commits::new(4);
        c.finished(Tag(0), 0);
        let i = c.take(4).expect("a free buffer");
        c.sent(i);
        assert_eq!(
            c.completed(i, -libc::EINVAL, EB, false),
            CommitOutcome::Refused(-libc::EINVAL)
        );
        c.finished(Tag(1), 0);
        let i = c.take(4).expect("a free buffer");
        c.sent(i);
        assert_eq!(
            c.completed(i, -libc::ENODEV, EB, false),
            CommitOutcome::Refused(-libc::ENODEV),
            "ENODEV before the queue knew is still unexpected"
        );
        c.finished(Tag(2), 0);
        let i = c.take(4).expect("a free buffer");
        c.sent(i);
        assert_eq!(
            c.completed(i, -libc::ENODEV, EB, true),
            CommitOutcome::Aborted
        );
    }

    #[test]
    fn two_commits_fly_at_once_and_a_third_waits_for_one_to_complete() {
        let mut c = Commits::new(2);
        for (t, r) in tags(&[0, 1, 2, 3, 4]) {
            c.finished(t, r);
        }
        let a = c.take(2).expect("first buffer");
        c.sent(a);
        let b = c.take(2).expect("second buffer");
        c.sent(b);
        assert_ne!(a, b);
        assert_eq!(
            c.committing(a),
            tags(&[0, 1]).as_slice(),
            "at most depth each"
        );
        assert_eq!(c.committing(b), tags(&[2, 3]).as_slice());
        assert_eq!(c.take(2), None, "both buffers in flight");
        assert!(c.has_pending());
        assert_eq!(
            c.completed(a, 2 * EB as i32, EB, false),
            CommitOutcome::Done
        );
        let again = c.take(2).expect("a buffer came free");
        assert_eq!(again, a);
        assert_eq!(c.committing(again), tags(&[4]).as_slice());
    }

    #[test]
    fn an_unsent_commit_frees_its_buffer_without_resending() {
        let mut c = Commits::new(4);
        c.finished(Tag(0), 0);
        let i = c.take(4).expect("a free buffer");
        c.unsent(i);
        assert!(c.committing(i).is_empty());
        assert!(!c.has_pending());
        assert_eq!(c.take(4), None, "nothing left to send");
    }

    /// A batch queue's life driven by completions only: armed, serving, aborted, torn down.
    #[test]
    fn a_batch_queue_from_arm_to_teardown() {
        let mut life = Life::default();
        let mut commits = Commits::new(4);
        life.pushed(); // PREP
        life.pushed(); // fetch 0
        life.pushed(); // fetch 1
        life.completed(); // PREP done
                          // Fetch 0 delivers tags 0 and 1 and stays armed.
        let v = fetch_verdict(4, true);
        assert!(!v.ended);
        commits.finished(Tag(0), 4096);
        commits.finished(Tag(1), 4096);
        let i = commits.take(4).expect("a free buffer");
        commits.sent(i);
        life.pushed();
        // The device stops: both fetches end with -ENODEV, then the commit with -ENODEV.
        for _ in 0..2 {
            let v = fetch_verdict(-libc::ENODEV, false);
            assert!(v.ended && v.stop && v.protocol_error.is_none());
            life.completed();
            life.stop();
        }
        assert!(!life.is_dead(), "the commit is still the kernel's");
        assert_eq!(
            commits.completed(i, -libc::ENODEV, EB, life.stopping()),
            CommitOutcome::Aborted
        );
        life.completed();
        assert!(life.is_dead());
    }

    /// Seeded random histories of a batch queue's commits against a synthetic kernel that takes
    /// all, part or none of each commit, with stops and unsent buffers: every finished tag is
    /// accounted for exactly once (pending, in flight, taken, dropped or lost with a refused or
    /// unsent commit), never two commits in flight per buffer, nothing taken while both
    /// buffers fly, and the queue's life counts what the kernel holds. 2,000 histories;
    /// `UBLKD_STATE_SEED=N` replays one.
    #[test]
    fn seeded_commit_histories_account_for_every_finished_request() {
        #[derive(Default)]
        struct Tally {
            taken: usize,
            dropped: usize,
            lost: usize,
        }
        let seeds: Vec<u64> = match std::env::var("UBLKD_STATE_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
        {
            Some(one) => vec![one],
            None => (0..2_000).collect(),
        };
        for seed in seeds {
            let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
            let mut roll = |n: u64| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % n
            };
            let depth = 1 + roll(16) as usize;
            let mut c = Commits::new(depth);
            let mut life = Life::default();
            // Tags the queue holds (not yet finished), as the kernel handed them out.
            let mut free: Vec<u16> = (0..depth as u16).collect();
            let mut finished = 0usize;
            let mut t = Tally::default();
            let mut in_flight: Vec<usize> = Vec::new();
            let mut log = Vec::new();
            for step in 0..200 {
                match roll(6) {
                    // A request finishes.
                    0 | 1 if !free.is_empty() => {
                        let tag = free.remove(roll(free.len() as u64) as usize);
                        c.finished(Tag(tag), 4096);
                        finished += 1;
                        log.push(format!("{step}: finished {tag}"));
                    }
                    // A commit goes out (or cannot be pushed).
                    2 => {
                        let max = 1 + roll(depth as u64) as usize;
                        if let Some(i) = c.take(max) {
                            assert!(
                                !in_flight.contains(&i),
                                "seed {seed}: buffer {i} twice in flight: {log:?}"
                            );
                            if roll(10) == 0 {
                                t.lost += c.committing(i).len();
                                c.unsent(i);
                                life.stop();
                                log.push(format!("{step}: unsent {i}"));
                            } else {
                                c.sent(i);
                                life.pushed();
                                in_flight.push(i);
                                log.push(format!("{step}: sent {i} ({})", c.committing(i).len()));
                            }
                        } else {
                            assert!(
                                !c.has_pending() || in_flight.len() == COMMIT_BUFS,
                                "seed {seed}: pending work and a free buffer, nothing taken: {log:?}"
                            );
                        }
                    }
                    // The kernel answers a commit in flight.
                    3 | 4 if !in_flight.is_empty() => {
                        let i = in_flight.remove(roll(in_flight.len() as u64) as usize);
                        let n = c.committing(i).len();
                        let result = match roll(5) {
                            0 => -libc::EINVAL,
                            1 => -libc::ENODEV,
                            2 => (roll(n as u64 + 1) as usize * EB) as i32,
                            _ => (n * EB) as i32,
                        };
                        let stopping = life.stopping();
                        let outcome = c.completed(i, result, EB, stopping);
                        life.completed();
                        log.push(format!("{step}: completed {i} with {result}: {outcome:?}"));
                        match outcome {
                            CommitOutcome::Done => t.taken += n,
                            CommitOutcome::Partial { taken, resent, .. } => {
                                assert_eq!(taken + 1 + resent, n, "seed {seed}: {log:?}");
                                t.taken += taken;
                                t.dropped += 1;
                            }
                            CommitOutcome::Refused(_) | CommitOutcome::Aborted => {
                                assert!(result < 0, "seed {seed}: a success refused: {log:?}");
                                assert_eq!(
                                    outcome == CommitOutcome::Aborted,
                                    result == -libc::ENODEV && stopping,
                                    "seed {seed}: {log:?}"
                                );
                                t.lost += n;
                                life.stop();
                            }
                        }
                    }
                    // The device goes away.
                    5 if roll(20) == 0 => {
                        life.stop();
                        log.push(format!("{step}: stop"));
                    }
                    _ => {}
                }
                let pending = c.pending.len();
                let flying: usize = in_flight.iter().map(|&i| c.committing(i).len()).sum();
                assert_eq!(
                    finished,
                    pending + flying + t.taken + t.dropped + t.lost,
                    "seed {seed}: a finished request went missing or was counted twice: {log:?}"
                );
                let mut seen: Vec<u16> = c.pending.iter().map(|(tag, _)| tag.0).collect();
                for &i in &in_flight {
                    seen.extend(c.committing(i).iter().map(|(tag, _)| tag.0));
                }
                let all = seen.len();
                seen.sort_unstable();
                seen.dedup();
                assert_eq!(
                    seen.len(),
                    all,
                    "seed {seed}: one tag twice on its way: {log:?}"
                );
                assert_eq!(life.outstanding(), in_flight.len(), "seed {seed}: {log:?}");
                assert_eq!(
                    life.is_dead(),
                    life.stopping() && in_flight.is_empty(),
                    "seed {seed}: {log:?}"
                );
            }
        }
    }
}
