//! The second node only slow, and the second node dead: what the node-loss controller keeps and
//! what it releases when the machine is real (its own guest, its own kubelet and ublkd).

use super::placement::TOLERATE_JOINED;
use crate::kube::{fill, has_line, Sc, NODE};
use anyhow::{ensure, Result};
use serde_json::json;

/// How long the paused kubelet stays stopped: its Lease expires after 40 s (the kubelet's
/// nodeLeaseDurationSeconds) and the node lifecycle controller marks the Node NotReady after
/// 50 s (its node-monitor-grace-period), so the controller sees it expired and NotReady for
/// about 10 s, and until the resumed kubelet reports Ready, under the tier's
/// `nodeLoss.lostAfter` (50 s, tests/k8s/values.yaml).
const PAUSE_S: u64 = 60;

/// How long after /tmp/restart the handler restarts the kubelet: time for the scenario to take
/// the finalizer off the Node, so that the Node is gone when the kubelet starts and registers
/// it again (no exec reaches a pod of a Node that is gone).
const RESTART_AFTER_S: u64 = 15;

/// A pod on `node` with the host's processes in view (`hostPID`): it stops the kubelet for
/// `PAUSE_S` once /tmp/pause exists, and kills it (its service starts it again, and it
/// registers its Node) `RESTART_AFTER_S` after /tmp/restart exists. Made, not waited for
/// (`handler_ready`).
fn kubelet_handler(s: &Sc, node: &str) -> Result<()> {
    let script = format!(
        "trap 'exit 0' TERM; \
         until [ -e /tmp/pause ]; do sleep 1; done; \
         k=$(pidof kubelet); kill -STOP $k; echo stopped $k; sleep {PAUSE_S}; kill -CONT $k; echo resumed $k; \
         until [ -e /tmp/restart ]; do sleep 1; done; sleep {RESTART_AFTER_S}; \
         kill $(pidof kubelet); echo restarted; while :; do sleep 1; done"
    );
    s.apply(&fill(
        r#"apiVersion: v1
kind: Pod
metadata: {name: kubelet-handler}
spec:
  nodeName: @NODE@
  hostPID: true
  terminationGracePeriodSeconds: 1
  tolerations: [{operator: Exists}]
  containers:
    - name: app
      image: ublkd.test/busybox:test
      securityContext: {privileged: true}
      command: ["/bin/sh", "-c", @SCRIPT@]
"#,
        &[("NODE", node), ("SCRIPT", &json!(script).to_string())],
    ))
}

fn handler_ready(s: &Sc) -> Result<()> {
    s.k(&[
        "wait",
        "--for=condition=Ready",
        "pod/kubelet-handler",
        "--timeout=300s",
    ])
    .map(drop)
}

/// A pod's lines that prefer `node`, and allow the first node too (`Sc::statefulset`'s).
fn prefer(node: &str) -> String {
    fill(
        "      @TOLERATE@
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [@NODE@, @FIRST@]}]
          preferredDuringSchedulingIgnoredDuringExecution:
            - weight: 100
              preference:
                matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [@NODE@]}]",
        &[("NODE", node), ("FIRST", NODE), ("TOLERATE", TOLERATE_JOINED)],
    )
}

/// A claim of the file class on `node` (its state disk, kept through a power-off), used by the
/// StatefulSet `name`'s one pod, which prefers `node` and may run on this node too.
fn statefulset_on(s: &Sc, name: &str, node: &str) -> Result<()> {
    // The scheduler places a claim only where the class's capacity is published: on a node
    // that joined a moment ago, not yet (the preference for it would lose to this node).
    let published = || s.published(node, "ublkd-file").is_some_and(|b| b > 0);
    s.wait(
        300,
        &format!("{node}'s ublkd-file capacity published"),
        published,
    )?;
    s.statefulset(name, 1, "ublkd-file", "", &prefer(node))?;
    let pod = format!("{name}-0");
    let on = || {
        s.jp(
            &["pod", &pod],
            "{.spec.nodeName} {.status.conditions[?(@.type==\"Ready\")].status}",
        )
        .is_ok_and(|o| o == format!("{node} True"))
    };
    s.wait(300, &format!("{pod} Ready on {node}"), on)
        .inspect_err(|_| s.tail(20, &format!("describe pod {pod}")))
}

/// The claim, its PV and its volume, as they are now.
struct Held {
    claim: String,
    uid: String,
    pv: String,
    volume: String,
}

fn held(s: &Sc, claim: &str) -> Result<Held> {
    Ok(Held {
        claim: claim.to_owned(),
        uid: s.jp(&["pvc", claim], "{.metadata.uid}")?,
        pv: s.jp(&["pvc", claim], "{.spec.volumeName}")?,
        volume: s.volume_of(claim)?,
    })
}

/// The second node's Node deleted (a cloud controller that thinks its instance stopped, an
/// operator's mistake), held by the node-loss controller's finalizer.
fn delete_node(s: &Sc, node: &str) -> Result<()> {
    s.kw(&format!("delete node {node} --wait=false"))?;
    let deleting = s.jp(&["node", node], "{.metadata.deletionTimestamp}")?;
    ensure!(
        !deleting.is_empty(),
        "node {node} went at once: the finalizer did not hold it"
    );
    Ok(())
}

/// A node only slow: the second node's Node deleted, which the controller's finalizer holds
/// while the kubelet renews its Lease (NodeLeaseRenewed, posted once); then its kubelet stopped
/// (SIGSTOP) for `PAUSE_S`, long enough for its Lease to expire and the Node to turn NotReady,
/// shorter than `lostAfter` with it. The controller says it waits (NodeNotReadyTooShort); once the kubelet
/// is back and the Node Ready, the claim (the same uid), its PV (still Delete) and the volume
/// on that node are still there, and the pod still reads its data. The Node is then given back (the finalizer off, the
/// kubelet restarted, which registers it again).
pub fn node_paused(s: &Sc) -> Result<()> {
    let other = s.other_node()?;
    // the handler's pod starts while the StatefulSet's does
    kubelet_handler(s, other)?;
    statefulset_on(s, "paused", other)?;
    s.in_pod("paused-0", "echo paused >/data/f && sync")?;
    let before = held(s, "data-paused-0")?;
    handler_ready(s)?;
    delete_node(s, other)?;
    // Deleted but alive: its kubelet renews its Lease, and the controller says so, once.
    s.wait(120, "a NodeLeaseRenewed Event", || {
        s.node_event(other, "NodeLeaseRenewed")
    })
    .inspect_err(|_| s.node_events(other))?;
    // two more looks of the controller (`nodeLoss.recheck` 2 s): the same decision, not posted again
    let looks = std::time::Duration::from_secs(4);
    std::thread::sleep(looks);
    s.posted_once(other, "NodeLeaseRenewed", looks)?;
    // (the image's one program is busybox as /bin/sh, whose shell runs its applets)
    s.in_pod("kubelet-handler", "touch /tmp/pause")?;
    s.say(format!("{other}'s kubelet stopped for {PAUSE_S} s"));
    s.wait(150, "a NodeNotReadyTooShort Event", || {
        s.node_event(other, "NodeNotReadyTooShort")
    })
    .inspect_err(|_| s.node_events(other))?;
    let resumed = || {
        s.q(&["logs", "kubelet-handler"])
            .is_ok_and(|l| l.contains("resumed"))
    };
    s.wait(150, "the kubelet resumed", resumed)?;
    s.wait(150, &format!("{other} Ready again"), || {
        s.node_is_ready(other)
    })?;
    // three looks of the controller (`nodeLoss.recheck` 2 s) with the kubelet back
    std::thread::sleep(std::time::Duration::from_secs(6));
    s.node_events(other);
    ensure!(
        !s.node_event(other, "NodeReleased"),
        "the controller released a node that was only paused"
    );
    let now = held(s, &before.claim)?;
    ensure!(
        (now.uid == before.uid && now.pv == before.pv && now.volume == before.volume),
        "the claim or its PV changed while the node was paused"
    );
    let policy = s.jp(&["pv", &now.pv], "{.spec.persistentVolumeReclaimPolicy}")?;
    ensure!(policy == "Delete", "{} was set to {policy}", now.pv);
    let vols = s.ublkctl_on(other, "list-volumes")?;
    ensure!(
        vols.contains(&before.volume),
        "the volume {} left {other}:\n{vols}",
        before.volume
    );
    let got = s.in_pod("paused-0", "cat /data/f")?;
    ensure!(got == "paused", "paused-0 reads '{got}'");
    // given back: the kubelet restarted (it registers its Node) once the finalizer is off and
    // the Node gone
    s.in_pod("kubelet-handler", "touch /tmp/restart")?;
    let off =
        json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", other, "-p", &off])?;
    s.wait(300, "the Node registered again, Ready", || {
        s.node_is_ready(other) && s.finalized(other)
    })?;
    s.delete("statefulset paused")?;
    // not waited for: the restarted kubelet took 34 s to stop it (2026-12-07), and it holds
    // nothing of the claim's
    s.kw("delete pod kubelet-handler --wait=false")?;
    s.delete("pvc data-paused-0")
}

/// A node that really dies: the second node's Node deleted and its guest powered off (QEMU
/// killed, no shutdown). Once its Lease has expired and it has been NotReady for `lostAfter`,
/// the controller releases its claims: the StatefulSet's pod starts on this node with a new,
/// empty volume. Powered on again, the node's ublkd restores the old volume from its state
/// disk, the node reports it as a volume without a PV, and nothing deletes it.
pub fn node_dies(s: &Sc) -> Result<()> {
    let other = s.other_node()?;
    statefulset_on(s, "dies", other)?;
    s.in_pod("dies-0", "echo on-the-dead-node >/data/f && sync")?;
    let before = held(s, "data-dies-0")?;
    delete_node(s, other)?;
    s.power(other, "off")?;
    let released = || !s.exists(&format!("node {other}"));
    s.wait(
        420,
        &format!("{other} released by the controller"),
        released,
    )
    .inspect_err(|_| s.node_events(other))?;
    ensure!(
        s.node_event(other, "NodeReleased"),
        "no NodeReleased Event on {other}"
    );
    // the dead node's pod is the pod GC's to delete, a minute later; the operator does it now
    s.kw("delete pod dies-0 --force --grace-period=0")?;
    let moved = || {
        s.jp(
            &["pod", "dies-0"],
            "{.spec.nodeName} {.status.conditions[?(@.type==\"Ready\")].status}",
        )
        .is_ok_and(|o| o == format!("{NODE} True"))
    };
    s.wait(600, "dies-0 up on this node", moved)
        .inspect_err(|_| s.tail(20, "describe pod dies-0"))?;
    let now = held(s, "data-dies-0")?;
    s.say(format!(
        "dies-0 on {NODE}: claim {} volume {}, was {} on {other}",
        now.uid, now.volume, before.volume
    ));
    ensure!(
        now.uid != before.uid && now.volume != before.volume,
        "dies-0 came back on the old claim or volume"
    );
    let got = s.in_pod("dies-0", "cat /data/f 2>/dev/null || echo empty")?;
    ensure!(got == "empty", "the new volume is not empty: '{got}'");
    s.power(other, "on")?;
    s.wait(900, &format!("{other} back and Ready"), || {
        s.node_is_ready(other)
    })?;
    let restored = || {
        s.ublkctl_on(other, &format!("get-volume {}", before.volume))
            .is_ok_and(|i| crate::kube::field(&i, "state") == Some("ready"))
    };
    s.wait(
        600,
        &format!("{other}'s ublkd restored {}", before.volume),
        restored,
    )?;
    let orphan = format!("{other} volume without PV {}", before.volume);
    s.wait(300, "kubectl ublkd orphans lists the old volume", || {
        s.kw("ublkd orphans").is_ok_and(|o| has_line(&o, &orphan))
    })?;
    s.say(s.kw("ublkd orphans")?);
    // two more of the node's reports: nothing deleted it
    std::thread::sleep(std::time::Duration::from_secs(30));
    let vols = s.ublkctl_on(other, "list-volumes")?;
    ensure!(
        vols.contains(&before.volume),
        "{other} deleted {} after it came back:\n{vols}",
        before.volume
    );
    s.delete("statefulset dies")?;
    s.delete("pvc data-dies-0")?;
    s.ublkctl_on(
        other,
        &format!("delete-volume {} --delete-backing", before.volume),
    )
    .map(drop)
}
