//! Test hooks of the server, compiled in only with the `test-hooks` feature (each is a no-op
//! otherwise): named points where a test makes ublkd die or wait. The dataplane's own faults
//! are `ublkd_dataplane::hooks`.

use std::time::Duration;

/// `UBLKD_FAULT_POINT=<point>` makes ublkd die (abort, no cleanup, as kill -9) when it reaches
/// `<point>`, e.g. `create:after_device`. Used by the crash-consistency tests.
pub fn fault_point(point: &str) {
    if cfg!(feature = "test-hooks") && std::env::var("UBLKD_FAULT_POINT").is_ok_and(|p| p == point)
    {
        eprintln!("ublkd: fault point {point} reached: aborting");
        std::process::abort();
    }
}

/// How long `UBLKD_DELAY_POINT=<point>:<ms>` says to wait at `point`, if it names it.
fn delay_of(point: &str) -> Option<Duration> {
    if !cfg!(feature = "test-hooks") {
        return None;
    }
    let spec = std::env::var("UBLKD_DELAY_POINT").ok()?;
    let (p, ms) = spec.rsplit_once(':')?;
    (p == point)
        .then(|| ms.parse::<u64>().ok())
        .flatten()
        .map(Duration::from_millis)
}

/// `UBLKD_DELAY_POINT=<point>:<ms>` makes an async step wait `ms` milliseconds at `point`, e.g.
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
