//! A claim's life in each class: mounted, written, grown online, block access, and a claim no node can hold left Pending.

use super::{df_grew, files_named, kib, unschedulable, DF, VOLUMES};
use crate::kube::{field, mib, Mode, Sc};
use anyhow::{ensure, Result};
use std::path::Path;

pub fn file_ext4(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-file")
}

pub fn ram(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-ram")
}

pub fn nvme_xfs(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-nvme")
}

/// A filesystem class: data written survives the pod, online expansion reaches df, and the
/// claim's deletion takes the ublkd volume (and its backing file) with it.
fn filesystem(s: &Sc, class: &str) -> Result<()> {
    let (claim, pod) = (format!("d-{class}"), format!("p-{class}"));
    s.pvc(&claim, class, "64Mi", Mode::Filesystem)?;
    let phase = s.jp(&["pvc", &claim], "{.status.phase}")?;
    s.say(format!("before a consumer: {phase}"));
    ensure!(
        phase == "Pending",
        "WaitForFirstConsumer leaves the claim Pending until a pod"
    );
    s.pod(&pod, &claim, Mode::Filesystem)?;
    s.in_pod(&pod, "echo ublkd-k8s-data >/data/f && sync")?;
    s.delete(&format!("pod {pod}"))?;
    s.pod(&pod, &claim, Mode::Filesystem)?;
    let out = s.in_pod(&pod, &format!("cat /data/f && {DF}"))?;
    let (got, line) = out.rsplit_once('\n').unwrap_or(("", &out));
    ensure!(
        got == "ublkd-k8s-data",
        "the data is there after the pod is recreated ({got})"
    );
    let before = kib(line)?;
    // What the driver gave (an xfs class rounds a claim up to xfs's smallest, 300 MiB), and
    // 64 MiB more of it.
    let have = mib(&s.jp(&["pvc", &claim], "{.status.capacity.storage}")?)?;
    s.say(format!("claimed 64 MiB, got {have} MiB"));
    ensure!(have >= 64, "the claim got at least what it asked for");
    s.grow(&claim, &pod, have + 64)?;
    df_grew(s, &claim, &pod, before)?;
    let pv = s.jp(&["pvc", &claim], "{.spec.volumeName}")?;
    let vol = s.jp(&["pv", &pv], "{.spec.csi.volumeHandle}")?;
    s.say(format!("volume {vol}"));
    let list = s.ublkctl("list-volumes")?;
    ensure!(list.contains(&vol), "ublkd does not list {vol}:\n{list}");
    // The claim the volume was made for, kept with it (the provisioner's --extra-create-metadata).
    let info = s.ublkctl(&format!("get-volume {vol}"))?;
    let claimed = field(&info, "claim").unwrap_or_default();
    s.say(format!("claim: {claimed}"));
    ensure!(
        claimed == format!("default/{claim} (pv {pv})"),
        "get-volume names the claim default/{claim} and its PV {pv}"
    );
    let root = Path::new(VOLUMES);
    if class == "ublkd-file" {
        // The root is a hostPath: the node sees the backing file itself.
        ensure!(
            !files_named(root, &vol).is_empty(),
            "no backing file of {vol} on the node"
        );
    }
    s.delete(&format!("pod {pod}"))?;
    s.delete(&format!("pvc {claim}"))?;
    let gone = || {
        !s.exists(&format!("pv {pv}")) && s.ublkctl("list-volumes").is_ok_and(|l| !l.contains(&vol))
    };
    s.wait(300, "the volume went with its claim", gone)?;
    if class == "ublkd-file" {
        ensure!(
            files_named(root, &vol).is_empty(),
            "the backing file of {vol} outlived its claim"
        );
    }
    Ok(())
}

/// A raw-block claim: the device itself in the pod, its bytes kept across pods.
pub fn block(s: &Sc) -> Result<()> {
    s.pvc("d-block", "ublkd-ram", "64Mi", Mode::Block)?;
    s.pod("p-block", "d-block", Mode::Block)?;
    s.in_pod(
        "p-block",
        "echo ublkd-k8s-block | dd of=/dev/xvda bs=512 count=1 conv=fsync",
    )?;
    s.delete("pod p-block")?;
    s.pod("p-block", "d-block", Mode::Block)?;
    let got = s.in_pod("p-block", "dd if=/dev/xvda bs=15 count=1 2>/dev/null")?;
    ensure!(
        got == "ublkd-k8s-block",
        "the block device kept its bytes across pods ({got})"
    );
    s.delete("pod p-block")?;
    s.delete("pvc d-block")
}

/// A claim larger than the node can hold: the pod stays Pending, and the scheduler says why.
pub fn pending(s: &Sc) -> Result<()> {
    s.pvc("d-huge", "ublkd-ram", "100Ti", Mode::Filesystem)?;
    s.apply(
        r#"apiVersion: v1
kind: Pod
metadata: {name: p-huge}
spec:
  containers:
    - {name: app, image: ublkd.test/busybox:test, command: ["/bin/sh", "-c", "sleep 3600"],
       volumeMounts: [{name: v, mountPath: /data}]}
  volumes: [{name: v, persistentVolumeClaim: {claimName: d-huge}}]
"#,
    )?;
    unschedulable(s, "p-huge", "d-huge", "storage")?;
    ensure!(s.phase("pod p-huge")? == "Pending", "p-huge left Pending");
    s.delete("pod p-huge")?;
    s.delete("pvc d-huge")
}
