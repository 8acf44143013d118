//! Fault injection for tests: named faults armed a number of times, fired at the step they name.
//!
//! Built only with the `test-hooks` feature (the VM tests and their ublkd enable it); without it
//! [`fire`] is a constant `false` and the compiler removes every call site. A fault is armed in
//! process (`arm`) or, for a daemon, from `UBLKD_TEST_FAULTS=name[=count[@skip][:offset+len]],...`
//! at start (`arm_from_env`). A fault armed with a byte range fires only at the steps that pass
//! it an I/O overlapping that range ([`fire_in`]); passes outside it are neither skipped nor
//! counted.

/// The faults the dataplane can be made to suffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// A batch commit carries a duplicate of its first element second: the kernel refuses it
    /// (the tag is no longer ours) and handles only the first element.
    CommitBadElement,
    /// A worker's attach of a queue other than the first fails after the queue's descriptors
    /// were mapped (the first queue is attached and armed by then).
    AttachFails,
    /// Taking a device over fails after START_USER_RECOVERY (while attaching its queues).
    RecoverAfterStart,
    /// START_USER_RECOVERY answers -EBUSY, as the driver does while the old server's files close.
    RecoverBusy,
    /// A worker's ring wait fails with an error no retry can fix.
    RingFatal,
    /// A worker's ring wait fails with -EAGAIN (the kernel is short of memory for a moment).
    RingTransient,
    /// An NVMe command's first attempt completes with a retryable path error (SCT 3, DNR
    /// clear); its resend goes through.
    NvmePathError,
    /// An NVMe command completes with a retryable path error, resends included (a path that
    /// stays down).
    NvmePathDown,
    /// A queue's QoS timer cannot be queued: its waiting requests are served over the limit.
    ThrottleTimer,
    /// A worker holds a device's new requests for a drain but never confirms it drained.
    DrainUnanswered,
    /// A file volume's backend read completes with -EIO (a disk that fails reads); writes
    /// still go through. Takes a byte range of the volume (`file_read_eio=N:offset+len`): only
    /// reads overlapping it fail (a disk with bad sectors there).
    FileReadEio,
    /// The next zero-copy device created hands the kernel a buffer slot it cannot use, so that
    /// every request takes the zero-copy fallback (UBLK_IO_F_NEED_REG_BUF, served by copy).
    EveryRequestByCopy,
    /// The next NVMe backend opened skips the check that its window lies inside the
    /// namespace, so that the device itself can be made to fail an I/O (LBA out of range).
    NvmeWindowUnchecked,
    /// DEL_DEV answers -EIO after STOP_DEV went through: the device stays in the kernel,
    /// stopped, while the dataplane has already forgotten it.
    DelDevFails,
    /// The next `Handle::start` takes the kernel for one whose IOPOLL rings refuse ublk
    /// commands (before Linux 7.1): polled queues get a second ring and copy.
    IopollSplit,
    /// Setting a new device's I/O scheduler to `none` fails (as on a read-only /sys).
    IoScheduler,
}

impl Fault {
    #[cfg(feature = "test-hooks")]
    const ALL: [Fault; 16] = [
        Fault::CommitBadElement,
        Fault::AttachFails,
        Fault::RecoverAfterStart,
        Fault::RecoverBusy,
        Fault::RingFatal,
        Fault::RingTransient,
        Fault::NvmePathError,
        Fault::NvmePathDown,
        Fault::ThrottleTimer,
        Fault::DrainUnanswered,
        Fault::FileReadEio,
        Fault::EveryRequestByCopy,
        Fault::NvmeWindowUnchecked,
        Fault::DelDevFails,
        Fault::IopollSplit,
        Fault::IoScheduler,
    ];

    /// The fault `name` names in `UBLKD_TEST_FAULTS`, if any.
    #[cfg(feature = "test-hooks")]
    pub fn named(name: &str) -> Option<Fault> {
        Fault::ALL.into_iter().find(|f| f.name() == name)
    }

    #[cfg(feature = "test-hooks")]
    pub fn name(self) -> &'static str {
        match self {
            Fault::CommitBadElement => "commit_bad_element",
            Fault::AttachFails => "attach_fails",
            Fault::RecoverAfterStart => "recover_after_start",
            Fault::RecoverBusy => "recover_busy",
            Fault::RingFatal => "ring_fatal",
            Fault::RingTransient => "ring_transient",
            Fault::NvmePathError => "nvme_path_error",
            Fault::NvmePathDown => "nvme_path_down",
            Fault::ThrottleTimer => "throttle_timer",
            Fault::DrainUnanswered => "drain_unanswered",
            Fault::FileReadEio => "file_read_eio",
            Fault::EveryRequestByCopy => "every_request_by_copy",
            Fault::NvmeWindowUnchecked => "nvme_window_unchecked",
            Fault::DelDevFails => "del_dev_fails",
            Fault::IopollSplit => "iopoll_split",
            Fault::IoScheduler => "io_scheduler",
        }
    }
}

#[cfg(feature = "test-hooks")]
mod armed {
    use super::Fault;
    use std::ops::Range;
    use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

    const N: usize = Fault::ALL.len();
    static COUNTS: [AtomicU32; N] = [const { AtomicU32::new(0) }; N];
    static SKIPS: [AtomicU32; N] = [const { AtomicU32::new(0) }; N];
    /// The byte range a fault is confined to, `[start, end)`; all of them when unconfined.
    static STARTS: [AtomicU64; N] = [const { AtomicU64::new(0) }; N];
    static ENDS: [AtomicU64; N] = [const { AtomicU64::new(u64::MAX) }; N];

    fn index(f: Fault) -> usize {
        Fault::ALL.iter().position(|&x| x == f).unwrap_or(0)
    }

    /// The next `times` passes through `f`'s step fail.
    pub fn arm(f: Fault, times: u32) {
        arm_after(f, times, 0);
    }

    /// After `skip` passes through `f`'s step, the next `times` fail.
    pub fn arm_after(f: Fault, times: u32, skip: u32) {
        arm_in(f, times, skip, 0..u64::MAX);
    }

    /// As [`arm_after`], counting only the passes whose I/O overlaps `bytes` ([`fire_in`]).
    pub fn arm_in(f: Fault, times: u32, skip: u32, bytes: Range<u64>) {
        let i = index(f);
        // The range first: the count is what makes the fault live.
        COUNTS[i].store(0, Ordering::SeqCst);
        STARTS[i].store(bytes.start, Ordering::SeqCst);
        ENDS[i].store(bytes.end, Ordering::SeqCst);
        SKIPS[i].store(skip, Ordering::SeqCst);
        COUNTS[i].store(times, Ordering::SeqCst);
    }

    /// Whether `f` fires now (consuming one pass to skip, else one arming).
    pub fn fire(f: Fault) -> bool {
        fire_in(f, 0, u64::MAX)
    }

    /// Whether `f` fires for an I/O of `len` bytes at `offset`: as [`fire`], for an I/O that
    /// overlaps the range `f` was armed with; never for one outside it.
    pub fn fire_in(f: Fault, offset: u64, len: u64) -> bool {
        let i = index(f);
        if COUNTS[i].load(Ordering::Relaxed) == 0 {
            return false;
        }
        let end = offset.saturating_add(len);
        if end <= STARTS[i].load(Ordering::SeqCst) || offset >= ENDS[i].load(Ordering::SeqCst) {
            return false;
        }
        let skipped = SKIPS[i]
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        !skipped
            && COUNTS[i]
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
    }

    /// Arms the faults named in `UBLKD_TEST_FAULTS` (`name[=count[@skip][:offset+len]],...`;
    /// count defaults to 1, skip to 0, the range to every byte).
    pub fn arm_from_env() {
        let Ok(spec) = std::env::var("UBLKD_TEST_FAULTS") else {
            return;
        };
        arm_from_spec(&spec);
    }

    /// A dataplane fault's entry of `UBLKD_TEST_FAULTS`, read: the fault, how many times it
    /// fires, how many passes it skips first, and the byte range it is confined to.
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub struct Armed {
        pub fault: Fault,
        pub times: u32,
        pub skip: u32,
        pub bytes: Range<u64>,
    }

    /// Reads one entry, `name[=count[@skip][:offset+len]]`: `Ok(None)` when `name` is no
    /// dataplane fault (the server's `abort_at=`, `delay_at=`), an error when it is one and
    /// the rest does not read (it would arm something else than asked, or nothing).
    pub fn parse_entry(item: &str) -> Result<Option<Armed>, String> {
        let item = item.trim();
        let (name, rest) = item.split_once('=').unwrap_or((item, "1"));
        let Some(fault) = Fault::named(name) else {
            return Ok(None);
        };
        let (rest, range) = match rest.split_once(':') {
            Some((r, range)) => (r, Some(range)),
            None => (rest, None),
        };
        let (count, skip) = rest.split_once('@').unwrap_or((rest, "0"));
        let number = |s: &str| {
            s.trim()
                .parse::<u32>()
                .map_err(|_| format!("test hook entry {item:?}: {s:?} is not a count"))
        };
        let bytes = match range {
            None => 0..u64::MAX,
            Some(r) => parse_range(r)
                .ok_or_else(|| format!("test hook entry {item:?}: {r:?} is not offset+len"))?,
        };
        Ok(Some(Armed {
            fault,
            times: number(count)?,
            skip: number(skip)?,
            bytes,
        }))
    }

    /// Arms the faults `spec` names, in `UBLKD_TEST_FAULTS`'s language; `name=0` disarms.
    /// A running daemon re-arms from a file this way (ublkd's SIGUSR2 hook). Entries this
    /// layer does not name (the server's `abort_at=`, `delay_at=`) are the server's to read;
    /// ublkd refuses a spec with an entry that reads as nothing before it gets here.
    pub fn arm_from_spec(spec: &str) {
        for item in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
            match parse_entry(item) {
                Ok(Some(a)) => arm_in(a.fault, a.times, a.skip, a.bytes),
                Ok(None) => {}
                // Armed anyway, it would fire where it was not asked to: not armed, said.
                Err(e) => eprintln!("{e}: not armed"),
            }
        }
    }

    /// `offset+len` in bytes.
    fn parse_range(s: &str) -> Option<Range<u64>> {
        let (offset, len) = s.split_once('+')?;
        let offset: u64 = offset.trim().parse().ok()?;
        let len: u64 = len.trim().parse().ok()?;
        Some(offset..offset.checked_add(len)?)
    }
}

#[cfg(feature = "test-hooks")]
pub use armed::{
    arm, arm_after, arm_from_env, arm_from_spec, arm_in, fire, fire_in, parse_entry, Armed,
};

/// Without `test-hooks` no fault ever fires.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn fire(_: Fault) -> bool {
    false
}

/// Without `test-hooks` no fault ever fires, whatever the I/O.
#[cfg(not(feature = "test-hooks"))]
#[inline(always)]
pub fn fire_in(_: Fault, _offset: u64, _len: u64) -> bool {
    false
}

/// Without `test-hooks` there is nothing to arm.
#[cfg(not(feature = "test-hooks"))]
pub fn arm_from_env() {}

#[cfg(all(test, feature = "test-hooks"))]
mod tests {
    use super::*;

    #[test]
    fn an_armed_fault_fires_as_often_as_armed() {
        arm(Fault::NvmePathError, 2);
        assert!(fire(Fault::NvmePathError));
        assert!(fire(Fault::NvmePathError));
        assert!(!fire(Fault::NvmePathError));
        assert!(!fire(Fault::RingFatal), "other faults stay unarmed");
        arm_after(Fault::RingFatal, 1, 2);
        assert!(!fire(Fault::RingFatal));
        assert!(!fire(Fault::RingFatal));
        assert!(fire(Fault::RingFatal), "fires after two skipped passes");
        assert!(!fire(Fault::RingFatal));
    }

    #[test]
    fn an_entry_reads_whole_or_not_at_all() {
        let a = parse_entry(" file_read_eio=2@1:8192+4096 ")
            .unwrap()
            .unwrap();
        assert_eq!(
            a,
            Armed {
                fault: Fault::FileReadEio,
                times: 2,
                skip: 1,
                bytes: 8192..12288
            }
        );
        assert_eq!(parse_entry("ring_fatal").unwrap().unwrap().times, 1);
        assert_eq!(parse_entry("abort_at=create:after_record"), Ok(None));
        for bad in [
            "ring_fatal=x",
            "ring_fatal=1@y",
            "file_read_eio=1:8192-4096",
        ] {
            assert!(parse_entry(bad).is_err(), "{bad} read");
        }
    }

    #[test]
    fn a_fault_armed_for_a_range_fires_only_for_io_overlapping_it() {
        // Each test its own fault: the armings are process-wide.
        arm_from_spec("file_read_eio=2@1:8192+4096");
        assert!(
            !fire_in(Fault::FileReadEio, 0, 8192),
            "ends where the range starts"
        );
        assert!(
            !fire_in(Fault::FileReadEio, 12288, 4096),
            "starts where it ends"
        );
        assert!(
            !fire_in(Fault::FileReadEio, 8192, 512),
            "the one pass skipped"
        );
        assert!(
            fire_in(Fault::FileReadEio, 4096, 8192),
            "overlaps its start"
        );
        assert!(fire_in(Fault::FileReadEio, 12287, 1), "its last byte");
        assert!(!fire_in(Fault::FileReadEio, 8192, 4096), "armed twice only");
        arm_from_spec("file_read_eio=1:8192+");
        assert!(
            !fire_in(Fault::FileReadEio, 8192, 4096),
            "a range that does not parse arms nothing"
        );
        arm_from_spec("file_read_eio=1");
        assert!(
            fire_in(Fault::FileReadEio, 1 << 40, 4096),
            "no range: every byte"
        );
        arm_from_spec("file_read_eio=3:0+4096");
        assert!(fire(Fault::FileReadEio), "fire is an I/O over every byte");
        arm_from_spec("file_read_eio=0");
        assert!(!fire(Fault::FileReadEio), "name=0 disarms");
    }
}
