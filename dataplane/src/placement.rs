//! Which worker serves each queue of a device, and why.
//!
//! blk-mq maps every CPU to one hardware queue; GET_QUEUE_AFFINITY gives a queue's CPUs, the
//! ones whose submissions land in it. A queue's worker can run on one of those CPUs
//! (`SameCpu`: a request is started and completed where it was submitted) or on one that does
//! not submit to it (`OtherCpu`: the application keeps its CPU and submits on while the worker
//! serves the previous requests elsewhere). On CPUs that also run the applications the two
//! differ by 2x: docs/performance.md, "Queue placement", has the measurements that made `OtherCpu`
//! the default there. On CPUs dedicated to the dataplane no application submits from a
//! worker's CPU, and the queues are spread over the workers by device and queue number
//! (`Spread`, which is also what a queue gets when no worker fits the policy).

/// What the operator asks for (`dataplane.queue_placement`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PlacementPolicy {
    /// `OtherCpu` where the workers share CPUs with applications, `Spread` on dedicated ones.
    #[default]
    Auto,
    SameCpu,
    OtherCpu,
    Spread,
}

/// Where a device's queues went.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueuePlacement {
    /// Each queue's worker runs on a CPU that submits to the queue.
    SameCpu,
    /// Each queue's worker runs on a CPU that does not submit to the queue.
    OtherCpu,
    /// Queues spread over the workers by device and queue number, whatever their CPUs.
    Spread,
}

/// Why a device's queues went where they did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PlacementReason {
    /// The operator's policy named it.
    Asked,
    /// `auto`, on CPUs shared with applications: measured fastest there.
    SharedCpus,
    /// `auto`, on CPUs dedicated to the workers: no application submits from them.
    DedicatedCpus,
    /// The policy could not be met for some queue (one worker only, the kernel gave no queue
    /// affinity, or no worker had buffer slots left on the CPUs it wanted): spread instead.
    NoWorkerFits,
}

impl PlacementReason {
    /// A phrase for logs and `ublkctl get-volume`.
    pub fn describe(self) -> &'static str {
        match self {
            PlacementReason::Asked => "asked for",
            PlacementReason::SharedCpus => {
                "the workers' CPUs also run applications, where serving on another CPU measured fastest"
            }
            PlacementReason::DedicatedCpus => "the workers have CPUs to themselves",
            PlacementReason::NoWorkerFits => {
                "no worker fitted the policy for every queue, so the queues were spread"
            }
        }
    }
}

/// What `policy` aims for, on workers whose CPUs are `dedicated` or not.
pub fn decide(policy: PlacementPolicy, dedicated: bool) -> (QueuePlacement, PlacementReason) {
    match policy {
        PlacementPolicy::Auto if dedicated => {
            (QueuePlacement::Spread, PlacementReason::DedicatedCpus)
        }
        PlacementPolicy::Auto => (QueuePlacement::OtherCpu, PlacementReason::SharedCpus),
        PlacementPolicy::SameCpu => (QueuePlacement::SameCpu, PlacementReason::Asked),
        PlacementPolicy::OtherCpu => (QueuePlacement::OtherCpu, PlacementReason::Asked),
        PlacementPolicy::Spread => (QueuePlacement::Spread, PlacementReason::Asked),
    }
}

/// The worker index that serves queue `q` of device `dev` under `want`, given the CPUs that
/// submit to the queue (`queue_cpus`; None when the kernel did not say) and each worker's CPU.
/// None when no worker fits `want` (the caller spreads, with [`spread`]).
pub fn home(
    want: QueuePlacement,
    dev: usize,
    q: usize,
    queue_cpus: Option<&[usize]>,
    worker_cpus: &[usize],
) -> Option<usize> {
    if worker_cpus.is_empty() {
        return None;
    }
    // The workers that do (or do not) run on a CPU submitting to the queue; the n-th of them.
    let pick = |submits: bool, n: usize| -> Option<usize> {
        let cpus = queue_cpus?;
        let fit: Vec<usize> = (0..worker_cpus.len())
            .filter(|&i| cpus.contains(&worker_cpus[i]) == submits)
            .collect();
        fit.get(n % fit.len().max(1)).copied()
    };
    match want {
        QueuePlacement::Spread => Some(spread(dev, q, worker_cpus.len())),
        // Devices that share a queue's CPUs take turns over its workers.
        QueuePlacement::SameCpu => pick(true, dev),
        QueuePlacement::OtherCpu => pick(false, dev + q),
    }
}

/// Queue `q` of device `dev` by number, over `workers` workers.
pub fn spread(dev: usize, q: usize, workers: usize) -> usize {
    (dev + q) % workers.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    // Two CPUs, two queues: blk-mq maps CPU 0 to queue 0 and CPU 1 to queue 1.
    const WORKERS: [usize; 2] = [0, 1];

    #[test]
    fn same_cpu_serves_where_the_queue_is_submitted() {
        let w = |q: usize| home(QueuePlacement::SameCpu, 0, q, Some(&[q]), &WORKERS);
        assert_eq!((w(0), w(1)), (Some(0), Some(1)));
    }

    #[test]
    fn other_cpu_serves_where_the_queue_is_not_submitted() {
        for dev in 0..4 {
            let w = |q: usize| home(QueuePlacement::OtherCpu, dev, q, Some(&[q]), &WORKERS);
            assert_eq!((w(0), w(1)), (Some(1), Some(0)), "device {dev}");
        }
        // Four workers, a queue submitted from CPUs 0 and 1: its worker is on 2 or 3.
        let four = [0, 1, 2, 3];
        for dev in 0..4 {
            let w = home(QueuePlacement::OtherCpu, dev, 0, Some(&[0, 1]), &four).unwrap();
            assert!(four[w] >= 2, "device {dev}: worker {w}");
        }
    }

    #[test]
    fn a_policy_that_cannot_be_met_says_so() {
        // One worker: no other CPU.
        assert_eq!(home(QueuePlacement::OtherCpu, 0, 0, Some(&[0]), &[0]), None);
        // Workers on CPUs that submit to nothing of this device (dedicated CPUs).
        assert_eq!(
            home(QueuePlacement::SameCpu, 0, 0, Some(&[0]), &[2, 3]),
            None
        );
        // The kernel did not give the queue's CPUs.
        assert_eq!(home(QueuePlacement::SameCpu, 0, 0, None, &WORKERS), None);
        assert_eq!(home(QueuePlacement::OtherCpu, 0, 0, None, &WORKERS), None);
        // Spreading always fits.
        assert_eq!(home(QueuePlacement::Spread, 3, 0, None, &WORKERS), Some(1));
    }

    #[test]
    fn auto_serves_on_another_cpu_unless_the_cpus_are_dedicated() {
        assert_eq!(
            decide(PlacementPolicy::Auto, false),
            (QueuePlacement::OtherCpu, PlacementReason::SharedCpus)
        );
        assert_eq!(
            decide(PlacementPolicy::Auto, true),
            (QueuePlacement::Spread, PlacementReason::DedicatedCpus)
        );
        assert_eq!(
            decide(PlacementPolicy::SameCpu, true),
            (QueuePlacement::SameCpu, PlacementReason::Asked)
        );
    }
}
