//! No Warning Event from the driver's objects after the ordinary scenarios.

use crate::kube::Sc;
use anyhow::{ensure, Result};

/// No warning events from the driver's objects: anything in ublkd-system, on a storage object,
/// or about a volume on a pod (mount, map, resize, provisioning, snapshot). Run after the
/// scenarios that use the driver and before those that restart ublkd on purpose: while ublkd
/// is down, the kubelet reports its readiness probe failing, as it should. The pending
/// scenario's FailedScheduling is the scheduler saying what it must.
pub fn warnings(s: &Sc) -> Result<()> {
    let cols = "custom-columns=NS:.metadata.namespace,KIND:.involvedObject.kind,\
                NAME:.involvedObject.name,REASON:.reason,FROM:.source.component,MESSAGE:.message";
    let all = s.kw(&format!(
        "get events -A --field-selector type=Warning --no-headers -o {cols}"
    ))?;
    let lines: Vec<&str> = all.lines().filter(|l| !l.trim().is_empty()).collect();
    s.say(format!("warning events: {}", lines.len()));
    for l in &lines {
        s.say(l.chars().take(220).collect::<String>());
    }
    const KINDS: &[&str] = &[
        "PersistentVolumeClaim",
        "PersistentVolume",
        "VolumeSnapshot",
        "VolumeSnapshotContent",
        "CSINode",
        "CSIStorageCapacity",
        "StorageClass",
    ];
    // external-snapshotter before 8.x's fix of 2026-07 (kubernetes-csi/external-snapshotter PR
    // 1460) posts SnapshotContentObjectDeleteError when the sidecar deleted the content first
    // and its own delete finds it gone: spurious while no content is left behind, a failed
    // delete if one is.
    let contents = s.qw("get volumesnapshotcontents -o name")?;
    let raced =
        |reason: &str| reason == "SnapshotContentObjectDeleteError" && contents.trim().is_empty();
    let bad: Vec<&&str> = lines
        .iter()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let reason = f.get(3).copied().unwrap_or_default();
            if raced(reason) {
                return false;
            }
            f.first() == Some(&"ublkd-system")
                || f.get(1).is_some_and(|k| KINDS.contains(k))
                || ["Mount", "Volume", "Provision", "Resiz", "Snapshot"]
                    .iter()
                    .any(|r| reason.contains(r))
        })
        .collect();
    ensure!(
        bad.is_empty(),
        "warning events from the driver's objects:\n{bad:#?}"
    );
    Ok(())
}
