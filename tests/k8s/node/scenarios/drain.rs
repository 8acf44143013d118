//! A node drained for maintenance and uncordoned: the claim's pod waits for its node, and its
//! data stays.

use super::placement::TOLERATE_JOINED;
use crate::kube::{field, fill, sleeper, Mode, Sc, NODE, UBLKD_PODS};
use anyhow::{ensure, Result};

/// Node maintenance as docs/kubernetes.md ("Drain a node for maintenance") says: cordon and
/// drain the node (ublkd's DaemonSet pods stay, the claim's pod goes), its volume stays with
/// its data. The claim's Deployment makes its pod again, free to run on the other node too,
/// but its volume is this node's: the pod waits Pending, and the scheduler's Event says why
/// (on two nodes the volume's node affinity; on one, this node unschedulable). Uncordoned,
/// the pod comes back here and reads what the old one wrote.
pub fn drain(s: &Sc) -> Result<()> {
    let other = s.second_node();
    s.pvc("r-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    // bound here: a pod without the toleration runs on this node only
    s.pod("p-r", "r-data", Mode::Filesystem)?;
    s.in_pod("p-r", "echo before-the-drain >/data/f && sync")?;
    s.delete("pod p-r")?;
    let vol = s.volume_of("r-data")?;
    s.apply(&fill(
        r#"apiVersion: apps/v1
kind: Deployment
metadata: {name: drained}
spec:
  replicas: 1
  strategy: {type: Recreate}
  selector: {matchLabels: {app: drained}}
  template:
    metadata: {labels: {app: drained}}
    spec:
      terminationGracePeriodSeconds: 1
      @TOLERATE@
      @SLEEPER@
      volumes: [{name: v, persistentVolumeClaim: {claimName: r-data}}]
"#,
        &[
            ("TOLERATE", TOLERATE_JOINED),
            (
                "SLEEPER",
                &sleeper("volumeMounts: [{name: v, mountPath: /data}]"),
            ),
        ],
    ))?;
    let pod = || s.jp(&["pod", "-l", "app=drained"], "{.items[0].metadata.name}");
    let on = |node: &str| {
        s.jp(
            &["pod", "-l", "app=drained"],
            "{.items[0].spec.nodeName} {.items[0].status.conditions[?(@.type==\"Ready\")].status}",
        )
        .is_ok_and(|o| o == format!("{node} True"))
    };
    s.wait(300, "the Deployment's pod Ready on this node", || on(NODE))?;
    let before = pod()?;
    s.kw(&format!("cordon {NODE}"))?;
    let drain = "--ignore-daemonsets --delete-emptydir-data --force --timeout=300s";
    s.kw(&format!("drain {NODE} {drain}"))?;
    s.wait(300, "the drain took the pod", || {
        !s.exists(&format!("pod {before}"))
    })?;
    let info = s.ublkctl(&format!("get-volume {vol}"))?;
    ensure!(
        field(&info, "state") == Some("ready"),
        "the volume {vol} is not ready after the drain"
    );
    let ublkd = s.kw(&format!("get {UBLKD_PODS} --no-headers"))?;
    ensure!(ublkd.lines().count() == 1, "the drain took ublkd's pod");
    let pending = pod()?;
    let sel = format!("involvedObject.name={pending},reason=FailedScheduling");
    let why = match other {
        Some(_) => "didn't match PersistentVolume's node affinity",
        None => "unschedulable",
    };
    let said = || s.events(&sel).is_ok_and(|m| m.contains(why));
    s.wait(
        300,
        &format!("{pending}'s FailedScheduling says {why}"),
        said,
    )
    .inspect_err(|_| s.tail(10, &format!("describe pod {pending}")))?;
    s.say(s.events(&sel)?);
    ensure!(
        s.phase(&format!("pod {pending}"))? == "Pending"
            && s.jp(&["pod", &pending], "{.spec.nodeName}")?.is_empty(),
        "the claim's pod left its volume's node (for {other:?})"
    );
    s.kw(&format!("uncordon {NODE}"))?;
    s.wait(300, "the pod back on this node, Ready", || on(NODE))?;
    let got = s.in_pod(&pod()?, "cat /data/f")?;
    ensure!(
        got == "before-the-drain",
        "the claim's data after the drain is '{got}'"
    );
    s.delete("deployment drained")?;
    s.delete("pvc r-data")
}
