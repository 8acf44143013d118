//! Node loss and a node still alive: what the node-loss controller releases, and what it keeps.

use super::restarts::restart_kubelet;
use crate::kube::{field, fill, has_line, localw, words, Mode, Sc, NODE, UBLKD_PODS};
use anyhow::{bail, ensure, Result};
use serde_json::json;
use std::time::Duration;

/// The other node of node-loss: a Node object without a kubelet.
const LOST: &str = "ublkd-vm-lost";

/// Where the node-loss StatefulSet's pod may run (`Sc::statefulset`'s pod lines).
fn lost_placement() -> String {
    fill(
        "      # node B has no kubelet: the node lifecycle controller taints it unreachable
      tolerations: [{operator: Exists}]
      # B, then this node: not another node of the cluster, which the toleration admits too
      affinity:
        nodeAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            nodeSelectorTerms:
              - matchExpressions: [{key: kubernetes.io/hostname, operator: In, values: [@LOST@, @NODE@]}]",
        &[("LOST", LOST), ("NODE", NODE)],
    )
}

/// kubectl's arguments for the node-loss controller's log.
const CONTROLLER_LOGS: &str = "-n ublkd-system logs deploy/ublkd-csi-controller";

/// What the node-loss controller said of `node`, in its Events and its log, into the log.
fn controller_said(s: &Sc, node: &str) {
    s.node_events(node);
    s.tail(30, CONTROLLER_LOGS);
}

/// Node loss (docs/kubernetes.md, "Retire a node"): a StatefulSet's pod on node B, B deleted,
/// and the pod comes up on this node with a new volume. Node B is a Node object without a
/// kubelet (two kubelets on one guest would need two containerds, mount namespaces and cgroup
/// roots). Its volume is a real ublkd volume on this node standing in for B's, named by a
/// PersistentVolume whose topology is B, as the provisioner writes them (its finalizer too).
/// Deleted, B is not lost yet (NotReady for less than the chart's 5 minutes): the controller
/// keeps everything and says why in an Event. Marked lost (the annotation ublkd.io/node-lost),
/// it must set the PV to Retain, delete the claim and the PV and leave the volume: afterwards
/// `kubectl ublkd orphans` lists it.
pub fn node_loss(s: &Sc) -> Result<()> {
    s.apply(&fill(
        "apiVersion: v1
kind: Node
metadata:
  name: @LOST@
  labels: {kubernetes.io/hostname: @LOST@, kubernetes.io/os: linux, ublkd.io/node: @LOST@}
",
        &[("LOST", LOST)],
    ))?;
    // room for pods, as a kubelet would report it (the scheduler fits none on a Node without)
    let room = json!({"cpu": "2", "memory": "2Gi", "pods": "10"});
    let status = json!({"status": {"capacity": room, "allocatable": room}}).to_string();
    // (none of its values holds a space)
    s.kw(&format!(
        "patch node {LOST} --subresource=status --type=merge -p {status}"
    ))?;
    s.wait(120, "the controller's finalizer on the lost node", || {
        s.finalized(LOST)
    })?;
    s.ublkctl("create-volume lost-vol --size 64MiB --backend ram")?;
    s.apply(&fill(
        "apiVersion: v1
kind: PersistentVolume
metadata:
  name: lost-pv
  annotations: {pv.kubernetes.io/provisioned-by: ublkd.io}
  finalizers: [kubernetes.io/pv-protection, external-provisioner.volume.kubernetes.io/finalizer]
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  # Delete, as the provisioner makes them: the controller sets it to Retain before it deletes
  # the claim, so that no provisioner deletes the volume (it stands in for B's on this node);
  # a PV that was Retain already it would leave alone.
  persistentVolumeReclaimPolicy: Delete
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: data-lost-0}
  csi: {driver: ublkd.io, volumeHandle: lost-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [@LOST@]}]}]
",
        &[("LOST", LOST)],
    ))?;
    s.statefulset("lost", 1, "ublkd-ram", "", &lost_placement())?;
    let on_node = |n: &str| s.jp_is(&["pod", "lost-0"], "{.spec.nodeName}", n);
    s.wait(300, "lost-0 scheduled to the lost node", || on_node(LOST))
        .inspect_err(|_| s.tail(20, "describe pod lost-0"))?;
    let bound = s.jp(&["pvc", "data-lost-0"], "{.spec.volumeName}")?;
    ensure!(
        bound == "lost-pv",
        "data-lost-0 is not bound to lost-pv ({bound})"
    );
    // B's kubelet "stops" now: Ready Unknown from this moment (the node lifecycle controller
    // keeps the time of a condition already Unknown), and B has no Lease.
    let t = localw("date -u +%Y-%m-%dT%H:%M:%SZ")?.trim().to_owned();
    let cond = json!({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
        "message": "the test's lost node", "lastHeartbeatTime": t, "lastTransitionTime": t});
    let patch = json!({"status": {"conditions": [cond]}}).to_string();
    s.k(&["patch", "node", LOST, "--subresource=status", "-p", &patch])?;
    s.say("lost-0 on the lost node with lost-pv; deleting the node");
    s.kw(&format!("delete node {LOST} --wait=false"))?;
    // NotReady for seconds, not the tier's nodeLoss.lostAfter: kept, and said so
    s.wait(120, "a NodeNotReadyTooShort Event", || {
        s.node_event(LOST, "NodeNotReadyTooShort")
    })
    .inspect_err(|_| controller_said(s, LOST))?;
    s.node_events(LOST);
    ensure!(
        s.finalized(LOST),
        "the controller let the lost node go before it was lost"
    );
    let bound = s.jp(&["pvc", "data-lost-0"], "{.spec.volumeName}")?;
    ensure!(
        bound == "lost-pv",
        "data-lost-0 was released before its node was lost"
    );
    let policy = s.jp(&["pv", "lost-pv"], "{.spec.persistentVolumeReclaimPolicy}")?;
    ensure!(
        policy == "Delete",
        "lost-pv was touched before its node was lost"
    );
    // the operator says the machine is gone
    s.kw(&format!("annotate node {LOST} ublkd.io/node-lost=true"))?;
    s.wait(300, "the lost node released", || {
        !s.exists(&format!("node {LOST}"))
    })
    .inspect_err(|_| controller_said(s, LOST))?;
    s.tail(20, CONTROLLER_LOGS);
    s.node_events(LOST);
    ensure!(
        s.node_event(LOST, "NodeReleased"),
        "no NodeReleased Event on the lost node"
    );
    // The pod of a node that has gone is the pod GC's to delete, about a minute later (51 s in
    // CI, 2026-12-06); the operator who said the machine is gone deletes it at once, as
    // docs/kubernetes.md says. The claim goes with it, and the StatefulSet makes both again:
    // scheduled here, provisioned here.
    s.kw("delete pod lost-0 --force --grace-period=0")?;
    let moved = || {
        on_node(NODE)
            && s.qw("wait --for=condition=Ready pod/lost-0 --timeout=5s")
                .is_ok()
    };
    s.wait(600, "lost-0 up on this node", moved)
        .inspect_err(|_| {
            s.tail(20, "describe pod lost-0");
            s.tail(15, "describe pvc data-lost-0");
            s.tail(30, CONTROLLER_LOGS);
        })?;
    s.wait(120, "lost-pv went with its node", || {
        !s.exists("pv lost-pv")
    })?;
    let new = s.volume_of("data-lost-0")?;
    s.say(format!("lost-0 Ready on {NODE} with volume {new}"));
    ensure!(
        !new.is_empty() && new != "lost-vol",
        "lost-0 came back on the old volume ({new})"
    );
    s.in_pod("lost-0", "echo moved >/data/f && sync")?;
    // the lost node's volume is never deleted from the cluster: an orphan to decide on
    let info = s.ublkctl("get-volume lost-vol")?;
    ensure!(
        field(&info, "state") == Some("ready"),
        "lost-vol was deleted or is not ready"
    );
    let out = s.kw("ublkd orphans")?;
    s.say(&out);
    ensure!(
        has_line(&out, &format!("{NODE} volume without PV lost-vol")),
        "kubectl ublkd orphans does not list lost-vol"
    );
    // and the node's own report: the driver tells ublkd (every 15 s here, after two lists in a
    // row), ublkd shows it in `ublkctl orphans` and its metric
    let reported = || {
        s.ublkctl("orphans")
            .is_ok_and(|o| o.lines().any(|l| l.trim() == "lost-vol"))
    };
    s.wait(300, "ublkctl orphans lists lost-vol", reported)?;
    let ip = s.jp(&words(UBLKD_PODS), "{.items[0].status.podIP}")?;
    let metrics = localw(&format!("curl -fsS http://{ip}:9580/metrics"))?;
    let n = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ublkd_volumes_without_pv "))
        .map(str::trim);
    s.say(format!("ublkd_volumes_without_pv {n:?}"));
    ensure!(
        n.and_then(|n| n.parse::<f64>().ok()).unwrap_or(0.0) >= 1.0,
        "ublkd_volumes_without_pv is {n:?}, not 1 or more"
    );
    s.delete("statefulset lost")?;
    s.delete("pvc data-lost-0")?;
    s.ublkctl("delete-volume lost-vol").map(drop)
}

/// A deleted Node is not a lost one (docs/kubernetes.md, "Retire a node"): the Node object of
/// this, the running node, deleted with one claim in use by a pod and one bound but unused. The
/// controller's finalizer holds the Node (Terminating) and its kubelet keeps renewing its
/// Lease, so nothing may be released: after looks enough for a provisioner to have deleted a
/// released volume, both claims (the same uids), both PVs (still Delete) and both ublkd
/// volumes are there, the pod still reads its data, and an Event on the Node says why. Then
/// the Node is given back as the document says (the finalizer off, the kubelet restarted,
/// which registers it again) and, a minute after, nothing is released either.
pub fn node_alive(s: &Sc) -> Result<()> {
    // Two looks of the controller and a margin (`nodeLoss.recheck`, tests/k8s/values.yaml).
    const LOOKS: Duration = Duration::from_secs(6);
    // file volumes: should the pod garbage collector restart ublkd while the Node is away, they
    // are its registry's, taken back at start
    s.pvc("a-used", "ublkd-file", "64Mi", Mode::Filesystem)?;
    s.pvc("a-idle", "ublkd-file", "64Mi", Mode::Filesystem)?;
    s.start_pod("p-alive", "a-used", Mode::Filesystem)?;
    // bound by a pod of its own (WaitForFirstConsumer), then unused
    s.pod("p-alive-idle", "a-idle", Mode::Filesystem)?;
    s.ready("p-alive", "a-used")?;
    s.in_pod("p-alive", "echo alive >/data/f && sync")?;
    s.delete("pod p-alive-idle")?;
    let mut claims = Vec::new();
    for c in ["a-used", "a-idle"] {
        let uid = s.jp(&["pvc", c], "{.metadata.uid}")?;
        let pv = s.jp(&["pvc", c], "{.spec.volumeName}")?;
        let vol = s.volume_of(c)?;
        s.say(format!("{c}: {uid} {pv} {vol}"));
        ensure!(!vol.is_empty(), "{c} bound to a volume");
        claims.push((c, uid, pv, vol));
    }
    ensure!(
        s.finalized(NODE),
        "no finalizer ublkd.io/node on the node before its deletion"
    );
    let node_uid = s.jp(&["node", NODE], "{.metadata.uid}")?;
    // nothing released: the claims, their PVs as the provisioner made them, the volumes
    let intact = || -> Result<()> {
        let vols = s.ublkctl("list-volumes")?;
        for (c, uid, pv, vol) in &claims {
            let now = s.jp(&["pvc", c], "{.metadata.uid} {.status.phase}")?;
            ensure!(
                now == format!("{uid} Bound"),
                "{c} was deleted or unbound ({now})"
            );
            let got = s.jp(
                &["pv", pv],
                "{.spec.persistentVolumeReclaimPolicy} {.metadata.deletionTimestamp}",
            )?;
            ensure!(
                got.trim_end() == "Delete",
                "{pv} was deleted or changed ('{got}')"
            );
            ensure!(
                vols.contains(vol.as_str()),
                "ublkd's volume {vol} disappeared:\n{vols}"
            );
        }
        if s.node_event(NODE, "NodeReleased") {
            s.node_events(NODE);
            bail!("the controller released the running node");
        }
        Ok(())
    };
    s.kw(&format!("delete node {NODE} --wait=false"))?;
    let deleting = s.jp(&["node", NODE], "{.metadata.deletionTimestamp}")?;
    ensure!(
        !deleting.is_empty(),
        "the node went at once: its finalizer did not hold it"
    );
    s.wait(120, "a NodeLeaseRenewed Event", || {
        s.node_event(NODE, "NodeLeaseRenewed")
    })
    .inspect_err(|_| controller_said(s, NODE))?;
    s.node_events(NODE);
    // The controller looks every 2 s here (tests/k8s/values.yaml): two more looks. In issue 38
    // the node's provisioner deleted the volumes of the released PVs within seconds.
    std::thread::sleep(LOOKS);
    intact()?;
    let got = s.in_pod("p-alive", "cat /data/f")?;
    ensure!(
        got == "alive",
        "p-alive lost its data while its Node was Terminating ({got})"
    );
    s.posted_once(NODE, "NodeLeaseRenewed", LOOKS)?;
    s.say("nothing released while the node was Terminating; giving it back");
    let off =
        json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "-p", &off])?;
    // gone, or registered again already by a kubelet that does so on its own
    let replaced = || {
        s.jp(&["node", NODE], "{.metadata.uid}")
            .map_or(true, |u| u != node_uid)
    };
    s.wait(120, "the node went once its finalizer was off", replaced)?;
    // the kubelet registers the Node at start
    restart_kubelet(s)?;
    s.wait(600, "the kubelet registered the node again", || {
        s.node_ready()
    })?;
    s.wait(300, "the driver registered on the new node", || {
        s.registered()
    })?;
    s.wait(300, "the controller's finalizer on the new node", || {
        s.finalized(NODE)
    })?;
    s.wait(600, "the driver's pods Ready again", || s.all_ready())
        .inspect_err(|_| s.show("-n ublkd-system get pods -o wide"))?;
    s.say("the node registered again; one more look");
    std::thread::sleep(LOOKS / 2);
    intact()?;
    s.node_events(NODE);
    s.tail(10, CONTROLLER_LOGS);
    s.kw("delete pod p-alive --wait=true --ignore-not-found")?;
    s.delete("pvc a-used a-idle")
}
