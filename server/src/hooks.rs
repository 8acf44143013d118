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

/// The named points of the server where a test makes ublkd die (`abort_at=`) or wait
/// (`delay_at=`). Every tier names them by [`Point::name`]; a name no point has is refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// A create, before its record is written.
    CreateBeforeRecord,
    /// A create, its record written, its device not yet added.
    CreateAfterRecord,
    /// A create, its device added, the volume not yet READY.
    CreateAfterDevice,
    /// A resize, its new size recorded, not yet applied.
    ResizeAfterRecord,
    /// A resize, applied to the device.
    ResizeAfterDevice,
    /// A delete, marked `deleting` in its record, its device still there.
    DeleteAfterMark,
    /// A delete, its device gone, its record still there.
    DeleteAfterDevice,
    /// A snapshot, its reflink made, its record not yet written.
    SnapshotAfterReflink,
    /// A clone, its backing file reflinked, the volume not yet created.
    CloneAfterReflink,
    /// An NVMe namespace's Identify for GetCapacity.
    CapacityIdentify,
    /// Each chunk of a window's erase.
    EraseChunk,
}

impl Point {
    pub const ALL: [Point; 11] = [
        Point::CreateBeforeRecord,
        Point::CreateAfterRecord,
        Point::CreateAfterDevice,
        Point::ResizeAfterRecord,
        Point::ResizeAfterDevice,
        Point::DeleteAfterMark,
        Point::DeleteAfterDevice,
        Point::SnapshotAfterReflink,
        Point::CloneAfterReflink,
        Point::CapacityIdentify,
        Point::EraseChunk,
    ];

    /// The point's name in `UBLKD_TEST_FAULTS`.
    pub fn name(self) -> &'static str {
        match self {
            Point::CreateBeforeRecord => "create:before_record",
            Point::CreateAfterRecord => "create:after_record",
            Point::CreateAfterDevice => "create:after_device",
            Point::ResizeAfterRecord => "resize:after_record",
            Point::ResizeAfterDevice => "resize:after_device",
            Point::DeleteAfterMark => "delete:after_mark",
            Point::DeleteAfterDevice => "delete:after_device",
            Point::SnapshotAfterReflink => "snapshot:after_reflink",
            Point::CloneAfterReflink => "clone:after_reflink",
            Point::CapacityIdentify => "capacity:identify",
            Point::EraseChunk => "erase:chunk",
        }
    }

    fn named(name: &str) -> Option<Point> {
        Point::ALL.into_iter().find(|p| p.name() == name)
    }
}

/// What a `UBLKD_TEST_FAULTS` entry asks of the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    Abort(Point),
    Delay(Point, Duration),
    /// Not the server's: a dataplane fault, armed by the dataplane.
    Dataplane,
}

/// The entries of `spec`, each one read, or the first that names nothing: a typo must fail
/// the test that made it, not arm nothing. `dataplane` reads an entry as a dataplane fault's
/// (false: it is none).
fn entries(
    spec: &str,
    dataplane: impl Fn(&str) -> Result<bool, String>,
) -> Result<Vec<Entry>, String> {
    let mut found = Vec::new();
    for item in spec.split(',').map(str::trim).filter(|e| !e.is_empty()) {
        let (name, value) = item.split_once('=').unwrap_or((item, ""));
        let entry = match name {
            "abort_at" => Point::named(value).map(Entry::Abort),
            "delay_at" => value.rsplit_once(':').and_then(|(p, ms)| {
                Some(Entry::Delay(
                    Point::named(p)?,
                    Duration::from_millis(ms.parse().ok()?),
                ))
            }),
            _ if dataplane(item)? => Some(Entry::Dataplane),
            _ => None,
        };
        found.push(entry.ok_or_else(|| {
            let points: Vec<&str> = Point::ALL.iter().map(|p| p.name()).collect();
            format!(
                "{FAULTS_VAR}: {item:?} names no fault (server points: {})",
                points.join(", ")
            )
        })?);
    }
    Ok(found)
}

/// Whether `item` is a dataplane fault's entry that reads (its count, skip and range too).
#[cfg(feature = "test-hooks")]
fn dataplane_fault(item: &str) -> Result<bool, String> {
    ublkd_dataplane::hooks::parse_entry(item).map(|a| a.is_some())
}

#[cfg(not(feature = "test-hooks"))]
fn dataplane_fault(_: &str) -> Result<bool, String> {
    Ok(false)
}

/// Checks `spec` (`UBLKD_TEST_FAULTS`'s language) names only faults and points that exist,
/// each with a value that reads.
#[cfg(feature = "test-hooks")]
pub fn check(spec: &str) -> Result<(), String> {
    entries(spec, dataplane_fault).map(drop)
}

/// Checks a faults file a running ublkd re-arms from (SIGUSR2): dataplane faults only, since
/// the server's points are read once, at start.
#[cfg(feature = "test-hooks")]
pub fn check_rearm(spec: &str) -> Result<(), String> {
    match entries(spec, dataplane_fault)?
        .iter()
        .find(|e| **e != Entry::Dataplane)
    {
        Some(e) => Err(format!(
            "{e:?}: a server point cannot be armed in a running ublkd, only at start"
        )),
        None => Ok(()),
    }
}

/// The server's entries of `UBLKD_TEST_FAULTS`, read once; none without `test-hooks`. The
/// daemon checks the variable at start ([`check`]), so what does not read here was refused.
fn armed() -> &'static [Entry] {
    static ARMED: std::sync::OnceLock<Vec<Entry>> = std::sync::OnceLock::new();
    ARMED.get_or_init(|| {
        if !cfg!(feature = "test-hooks") {
            return Vec::new();
        }
        std::env::var(FAULTS_VAR)
            .ok()
            .and_then(|s| entries(&s, dataplane_fault).ok())
            .unwrap_or_default()
    })
}

/// `abort_at=<point>` makes ublkd die (abort, no cleanup, as kill -9) when it reaches
/// `point`. Used by the crash-consistency tests.
pub fn fault_point(point: Point) {
    if armed().contains(&Entry::Abort(point)) {
        eprintln!("ublkd: fault point {} reached: aborting", point.name());
        std::process::abort();
    }
}

/// How long `delay_at=<point>:<ms>` says to wait at `point`, if an entry names it.
fn delay_of(point: Point) -> Option<Duration> {
    armed().iter().find_map(|e| match e {
        Entry::Delay(p, d) if *p == point => Some(*d),
        _ => None,
    })
}

/// `delay_at=<point>:<ms>` makes an async step wait `ms` milliseconds at `point`, e.g.
/// `create:after_record` for a create slower than its caller's deadline.
pub async fn delay_point(point: Point) {
    if let Some(d) = delay_of(point) {
        tracing::warn!(
            point = point.name(),
            ms = d.as_millis() as u64,
            "test hook: delaying"
        );
        tokio::time::sleep(d).await;
    }
}

/// The same for a blocking step (it blocks its thread, as a slow system call would), e.g.
/// `capacity:identify` for an NVMe Identify that takes seconds.
pub fn delay_point_blocking(point: Point) {
    if let Some(d) = delay_of(point) {
        tracing::warn!(
            point = point.name(),
            ms = d.as_millis() as u64,
            "test hook: blocking"
        );
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dataplane(item: &str) -> Result<bool, String> {
        let name = item.split_once('=').map_or(item, |(n, _)| n);
        Ok(matches!(name, "drain_unanswered" | "ring_fatal"))
    }

    #[test]
    fn one_spec_names_dataplane_faults_aborts_and_delays() {
        let spec = "drain_unanswered=1, abort_at=create:after_record,\
                    delay_at=capacity:identify:8000,ring_fatal=1@300";
        assert_eq!(
            entries(spec, dataplane).unwrap(),
            vec![
                Entry::Dataplane,
                Entry::Abort(Point::CreateAfterRecord),
                Entry::Delay(Point::CapacityIdentify, Duration::from_millis(8000)),
                Entry::Dataplane,
            ]
        );
        assert_eq!(entries("", dataplane).unwrap(), vec![]);
    }

    #[test]
    fn a_name_that_names_nothing_is_refused() {
        for bad in [
            "abort_at=create:after_recrod",
            "delay_at=x:10",
            "delay_at=create:after_record:soon",
            "ring_fatl=1",
        ] {
            let e = entries(bad, dataplane).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
    }

    #[test]
    fn every_point_reads_back_from_its_name() {
        for p in Point::ALL {
            assert_eq!(Point::named(p.name()), Some(p));
        }
    }
}
