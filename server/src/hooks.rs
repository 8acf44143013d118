//! Test hooks of the server, compiled in only with the `test-hooks` feature (each is a no-op
//! otherwise): named points where a test makes ublkd die or wait.
//!
//! One language for every fault a test arms in a daemon, the dataplane's and the server's:
//! `UBLKD_TEST_FAULTS`, comma-separated entries. `name[=count[@skip][:offset+len]]` arms a dataplane fault
//! (the range, in bytes of the volume, limits it to I/O overlapping it)
//! (`ublkd_dataplane::hooks`); `abort_at=<point>` makes ublkd die at a server point;
//! `delay_at=<point>:<ms>` makes it wait there. Each layer reads the entries it knows.

use std::time::Duration;

/// The variable every daemon fault is armed from.
pub const FAULTS_VAR: &str = "UBLKD_TEST_FAULTS";

/// The values of `spec`'s entries named `name` (`name=value`).
fn values<'a>(spec: &'a str, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
    spec.split(',')
        .filter_map(|e| e.trim().split_once('='))
        .filter(move |(n, _)| *n == name)
        .map(|(_, v)| v)
}

/// Whether `spec` has ublkd abort at `point`.
fn aborts_at(spec: &str, point: &str) -> bool {
    values(spec, "abort_at").any(|p| p == point)
}

/// How long `spec` has ublkd wait at `point`.
fn delay_in(spec: &str, point: &str) -> Option<Duration> {
    values(spec, "delay_at").find_map(|v| {
        let (p, ms) = v.rsplit_once(':')?;
        (p == point)
            .then(|| ms.parse::<u64>().ok())
            .flatten()
            .map(Duration::from_millis)
    })
}

fn armed() -> Option<String> {
    if cfg!(feature = "test-hooks") {
        std::env::var(FAULTS_VAR).ok()
    } else {
        None
    }
}

/// `abort_at=<point>` makes ublkd die (abort, no cleanup, as kill -9) when it reaches
/// `<point>`, e.g. `create:after_device`. Used by the crash-consistency tests.
pub fn fault_point(point: &str) {
    if armed().is_some_and(|spec| aborts_at(&spec, point)) {
        eprintln!("ublkd: fault point {point} reached: aborting");
        std::process::abort();
    }
}

/// How long `delay_at=<point>:<ms>` says to wait at `point`, if an entry names it.
fn delay_of(point: &str) -> Option<Duration> {
    delay_in(&armed()?, point)
}

/// `delay_at=<point>:<ms>` makes an async step wait `ms` milliseconds at `point`, e.g.
/// `create:after_record` for a create slower than its caller's deadline.
pub async fn delay_point(point: &str) {
    if let Some(d) = delay_of(point) {
        tracing::warn!(point, ms = d.as_millis() as u64, "test hook: delaying");
        tokio::time::sleep(d).await;
    }
}

/// The same for a blocking step (it blocks its thread, as a slow system call would), e.g.
/// `capacity:identify` for an NVMe Identify that takes seconds.
pub fn delay_point_blocking(point: &str) {
    if let Some(d) = delay_of(point) {
        tracing::warn!(point, ms = d.as_millis() as u64, "test hook: blocking");
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_spec_names_dataplane_faults_aborts_and_delays() {
        let spec = "drain_unanswered=1, abort_at=create:after_record,\
                    delay_at=capacity:identify:8000,ring_fatal=1@300";
        assert!(aborts_at(spec, "create:after_record"));
        assert!(!aborts_at(spec, "create:after_device"));
        assert!(
            !aborts_at(spec, "drain_unanswered"),
            "a dataplane fault is no point"
        );
        assert_eq!(
            delay_in(spec, "capacity:identify"),
            Some(Duration::from_millis(8000))
        );
        assert_eq!(delay_in(spec, "create:after_record"), None);
        assert_eq!(
            delay_in("delay_at=x:soon", "x"),
            None,
            "ms must be a number"
        );
        assert!(!aborts_at("", "x"));
    }
}
