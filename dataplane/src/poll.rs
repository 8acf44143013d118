//! Whether a device's backend I/O is polled, and why.
//!
//! Polling spins the worker's CPU while NVMe commands are in flight. Measured in the test VM
//! (`cargo xtask bench`, docs/performance.md "The life of one NVMe I/O, measured"), on CPUs that
//! also run the submitting application it lost to interrupts at QD32 (15.8k vs 18.8k IOPS, 2.4 vs
//! 1.2 `io_uring_enter` per I/O, twice the CPU per I/O) and gained 4 % at QD1: the spinning worker
//! takes the CPU the application needs to submit. So `auto` polls only where a worker has its CPU
//! to itself: CPUs isolated from the scheduler (`isolcpus=`, `nohz_full=`), or declared dedicated
//! by the operator (`dataplane.dedicated_cpus`, e.g. exclusive CPUs from the Kubernetes static CPU
//! manager).

use crate::device::{SpecError, Toggle};
use std::time::Duration;

/// Why polling is on or off for a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PollReason {
    /// `poll = on`.
    Asked,
    /// `poll = off`.
    Declined,
    /// `auto`, and the backend cannot be polled (not NVMe, or no poll queues).
    NotOffered,
    /// `auto`, and the workers' CPUs also run other tasks: interrupts measured faster there.
    SharedCpus,
    /// `auto`, and the workers' CPUs are dedicated to them: polling pays.
    DedicatedCpus,
    /// `auto`, on a kernel before 7.1 where zero copy and polling cannot share a ring: zero
    /// copy was kept.
    ZeroCopyKept,
}

impl PollReason {
    /// A phrase for logs and `ublkctl get-volume`.
    pub fn describe(self) -> &'static str {
        match self {
            PollReason::Asked => "asked for",
            PollReason::Declined => "declined",
            PollReason::NotOffered => "the backend cannot be polled",
            PollReason::SharedCpus => {
                "the workers' CPUs also run applications, where interrupts measured faster"
            }
            PollReason::DedicatedCpus => "the workers have CPUs to themselves",
            PollReason::ZeroCopyKept => "zero copy kept: this kernel cannot do both (Linux < 7.1)",
        }
    }
}

/// Resolves `poll` for a backend that is `pollable` (or says why not), on workers whose CPUs
/// are `dedicated` or not.
pub fn decide(
    poll: Toggle,
    pollable: Result<(), &'static str>,
    dedicated: bool,
) -> Result<(bool, PollReason), SpecError> {
    Ok(match (poll, pollable) {
        (Toggle::Off, _) => (false, PollReason::Declined),
        (Toggle::On, Ok(())) => (true, PollReason::Asked),
        (Toggle::On, Err(why)) => return Err(SpecError::Unsupported(why)),
        (Toggle::Auto, Err(_)) => (false, PollReason::NotOffered),
        (Toggle::Auto, Ok(())) if dedicated => (true, PollReason::DedicatedCpus),
        (Toggle::Auto, Ok(())) => (false, PollReason::SharedCpus),
    })
}

/// How long a worker looks for work in user space before it sleeps: what the operator asked
/// for (`dataplane.idle_spin_us`), at most [`MAX_SPIN`]; unasked, [`DEDICATED_SPIN`] on CPUs
/// dedicated to the workers and zero on CPUs they share with applications.
///
/// A sleeping worker pays a wake-up for each request that finds it idle and for each backend
/// completion it waits for; at QD1 those two wake-ups are what loop and a polled namespace do
/// not pay (docs/performance.md, "The file backend at QD1 against loop, counted"). A spinning
/// worker sees them without sleeping, but takes its CPU: where applications share it, that is
/// CPU they need; where the CPU is the dataplane's alone, nothing else wants it, and polling
/// (which `auto` turns on there) pays only if the worker is awake when the next request comes
/// (docs/performance.md, "Polling with a dedicated worker CPU").
pub fn idle_spin(asked: Option<Duration>, dedicated: bool) -> Duration {
    match asked {
        Some(spin) => spin.min(MAX_SPIN),
        None if dedicated => DEDICATED_SPIN,
        None => Duration::ZERO,
    }
}

/// An idle worker's spin on dedicated CPUs unless the operator says otherwise: longer than the
/// gap between a QD1 completion and the application's next request (tens of microseconds on
/// hardware, 80-150 in the test VM), short enough that an idle node's workers sleep at once.
pub const DEDICATED_SPIN: Duration = Duration::from_millis(1);

/// The most an operator may ask for: beyond it a worker would be a polling loop that does
/// not sleep while any I/O trickles in.
pub const MAX_SPIN: Duration = Duration::from_millis(100);

/// Whether every one of `cpus` is isolated from the scheduler's load balancing, per the
/// kernel's `isolated` and `nohz_full` lists (`/sys/devices/system/cpu/`).
pub fn cpus_isolated(cpus: &[usize], isolated: &str, nohz_full: &str) -> bool {
    let mut set = parse_cpu_list(isolated);
    set.extend(parse_cpu_list(nohz_full));
    !cpus.is_empty() && cpus.iter().all(|c| set.contains(c))
}

/// A kernel CPU list (`0-3,8,10-11`); malformed parts are skipped.
pub fn parse_cpu_list(s: &str) -> Vec<usize> {
    let mut out = Vec::new();
    for part in s.trim().split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                if let (Ok(a), Ok(b)) = (a.parse::<usize>(), b.parse::<usize>()) {
                    out.extend(a..=b.min(a + 4096));
                }
            }
            None => out.extend(part.parse::<usize>().ok()),
        }
    }
    out
}

/// The CPUs the running kernel isolates (`isolcpus=`, `nohz_full=`) include all of `cpus`.
pub fn host_cpus_isolated(cpus: &[usize]) -> bool {
    let read = |f: &str| std::fs::read_to_string(format!("/sys/devices/system/cpu/{f}"));
    cpus_isolated(
        cpus,
        &read("isolated").unwrap_or_default(),
        &read("nohz_full").unwrap_or_default(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    const NVME: Result<(), &str> = Ok(());
    const NULL: Result<(), &str> = Err("polling needs NVMe");

    #[test]
    fn workers_spin_on_dedicated_cpus_or_when_asked_and_never_without_bound() {
        assert_eq!(idle_spin(None, false), Duration::ZERO);
        assert_eq!(idle_spin(None, true), DEDICATED_SPIN);
        assert_eq!(idle_spin(Some(Duration::ZERO), true), Duration::ZERO);
        let asked = Duration::from_micros(250);
        assert_eq!(idle_spin(Some(asked), false), asked);
        assert_eq!(idle_spin(Some(asked), true), asked);
        assert_eq!(idle_spin(Some(Duration::from_secs(5)), false), MAX_SPIN);
    }

    #[test]
    fn auto_polls_only_on_dedicated_cpus() {
        assert_eq!(
            decide(Toggle::Auto, NVME, false).unwrap(),
            (false, PollReason::SharedCpus)
        );
        assert_eq!(
            decide(Toggle::Auto, NVME, true).unwrap(),
            (true, PollReason::DedicatedCpus)
        );
        assert_eq!(
            decide(Toggle::Auto, NULL, true).unwrap(),
            (false, PollReason::NotOffered)
        );
    }

    #[test]
    fn explicit_choices_win_and_on_needs_a_pollable_backend() {
        assert_eq!(
            decide(Toggle::On, NVME, false).unwrap(),
            (true, PollReason::Asked)
        );
        assert_eq!(
            decide(Toggle::Off, NVME, true).unwrap(),
            (false, PollReason::Declined)
        );
        assert!(matches!(
            decide(Toggle::On, NULL, true),
            Err(SpecError::Unsupported("polling needs NVMe"))
        ));
    }

    #[test]
    fn cpu_lists_and_isolation() {
        assert_eq!(parse_cpu_list("0-2,5,7-8\n"), vec![0, 1, 2, 5, 7, 8]);
        assert_eq!(parse_cpu_list("\n"), Vec::<usize>::new());
        assert_eq!(parse_cpu_list("x,3"), vec![3]);
        assert!(cpus_isolated(&[2, 3], "2-3\n", ""));
        assert!(cpus_isolated(&[2, 3], "2\n", "3\n"));
        assert!(!cpus_isolated(&[1, 2], "2-3\n", ""));
        assert!(!cpus_isolated(&[], "0-3", ""));
        assert!(!cpus_isolated(&[0], "", ""));
    }
}
