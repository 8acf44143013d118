//! VolumeSnapshots: taken, restored into new claims, and deleted.

use super::{files_named, VOLUMES};
use crate::kube::{words, Mode, Sc};
use anyhow::{ensure, Result};
use std::path::Path;

/// A VolumeSnapshot of a file-xfs claim, a claim restored from it and a clone of the claim, on
/// the node's reflink XFS: each holds the data of its moment, and deleting them leaves no file.
pub fn snapshots(s: &Sc) -> Result<()> {
    let enabled = words("--reuse-values --set snapshots.enabled=true");
    s.helm_chart("upgrade", &enabled)?;
    s.kw("-n kube-system rollout status deploy/snapshot-controller --timeout=600s")?;
    s.pvc("s-src", "ublkd-file-xfs", "300Mi", Mode::Filesystem)?;
    s.pod("p-src", "s-src", Mode::Filesystem)?;
    s.in_pod("p-src", "echo at-the-snapshot >/data/f && sync")?;
    s.apply(
        "apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap1}
spec:
  volumeSnapshotClassName: ublkd-file
  source: {persistentVolumeClaimName: s-src}
",
    )?;
    let ready = || s.jp_is(&["volumesnapshot", "snap1"], "{.status.readyToUse}", "true");
    s.wait(420, "snap1 readyToUse", ready).inspect_err(|_| {
        s.tail(20, "describe volumesnapshot snap1");
        s.tail(30, "get volumesnapshotcontents -o yaml");
        s.tail(20, "-n kube-system logs deploy/snapshot-controller");
        s.tail(20, &s.logs_on_node("ublkd-csi-node", "csi-snapshotter"));
    })?;
    let status = "{.status.restoreSize} {.status.boundVolumeSnapshotContentName}";
    s.say(format!(
        "snapshot: {}",
        s.jp(&["volumesnapshot", "snap1"], status)?
    ));
    s.in_pod("p-src", "echo after-the-snapshot >/data/f && sync")?;
    // Both made after the second write, at once.
    let from = "dataSource: {apiGroup: snapshot.storage.k8s.io, kind: VolumeSnapshot, name: snap1}";
    s.claim("s-restore", "ublkd-file-xfs", "300Mi", from)?;
    let from = "dataSource: {kind: PersistentVolumeClaim, name: s-src}";
    s.claim("s-clone", "ublkd-file-xfs", "300Mi", from)?;
    s.start_pod("p-restore", "s-restore", Mode::Filesystem)?;
    s.pod("p-clone", "s-clone", Mode::Filesystem)?;
    s.ready("p-restore", "s-restore")?;
    let got = s.in_pod("p-restore", "cat /data/f")?;
    ensure!(
        got == "at-the-snapshot",
        "the restore holds the snapshot's data ({got})"
    );
    let got = s.in_pod("p-clone", "cat /data/f")?;
    ensure!(
        got == "after-the-snapshot",
        "the clone holds its source's data ({got})"
    );
    s.in_pod("p-restore", "echo the-restore-wrote >/data/f && sync")?;
    let got = s.in_pod("p-src", "cat /data/f")?;
    ensure!(
        got == "after-the-snapshot",
        "a write to the restore stays out of its source ({got})"
    );
    let vols = [
        s.volume_of("s-src")?,
        s.volume_of("s-restore")?,
        s.volume_of("s-clone")?,
    ];
    s.say(format!("volumes: {vols:?}"));
    s.delete("pod p-src p-restore p-clone")?;
    s.delete("volumesnapshot snap1")?;
    s.delete("pvc s-src s-restore s-clone")?;
    let gone = || {
        s.qw("get volumesnapshotcontents --no-headers")
            .is_ok_and(|c| c.trim().is_empty())
            && s.ublkctl("list-volumes")
                .is_ok_and(|l| vols.iter().all(|v| !l.contains(v.as_str())))
            && files_named(Path::new(VOLUMES), ".img").is_empty()
    };
    s.wait(
        420,
        "every snapshot, volume and file went with its object",
        gone,
    )
    .inspect_err(|_| {
        s.show("get volumesnapshotcontents");
        s.say(format!("{:?}", files_named(Path::new(VOLUMES), "")));
    })
}
