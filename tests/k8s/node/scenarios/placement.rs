//! Two nodes, and the scheduler choosing between them by what each node's driver publishes:
//! its CSIStorageCapacity, and the node a volume lives on.

use super::unschedulable;
use crate::kube::{bytes, local, localw, Mode, Sc, NODE};
use anyhow::{ensure, Context, Result};

/// The file class's root on the first node (tests/k8s/values.yaml).
const ROOT: &str = "/var/lib/ublkd/volumes";
/// What the filler leaves free on the first node: less than a claim of `CLAIM`.
const LEFT: u64 = 64 << 20;
const CLAIM: &str = "256Mi";
/// A pod's toleration of the second node's taint (the tier keeps other scenarios' pods off it).
pub const TOLERATE_JOINED: &str =
    "tolerations: [{key: ublkd.test/joined, operator: Exists, effect: NoSchedule}]";

/// The node in a PV's node affinity (the provisioner writes the volume's node there).
fn pv_node(s: &Sc, claim: &str) -> Result<String> {
    let pv = s.jp(&["pvc", claim], "{.spec.volumeName}")?;
    s.jp(
        &["pv", &pv],
        "{.spec.nodeAffinity.required.nodeSelectorTerms[0].matchExpressions[0].values[0]}",
    )
}

/// Placement by capacity: the first node's file pool filled (a file beside the volumes', as a
/// node's other tenants fill a disk) until its CSIStorageCapacity for `ublkd-file` is below a
/// claim; the next claim of the class, its pod free to run on either node, is provisioned on
/// the second. A claim no node can hold stays Pending with the scheduler's reason. Then a
/// StatefulSet of two with anti-affinity: one volume on each node, each where its pod runs.
pub fn placement(s: &Sc) -> Result<()> {
    let other = s.other_node()?;
    let df = localw(&format!("df -B1 --output=avail {ROOT}"))?;
    let avail: u64 = df
        .lines()
        .last()
        .and_then(|l| l.trim().parse().ok())
        .with_context(|| format!("df's available bytes: {df:?}"))?;
    let filler = format!("{ROOT}/placement.filler");
    let fill_bytes = avail.saturating_sub(LEFT);
    local("fallocate", &["-l", &fill_bytes.to_string(), &filler])?;
    s.say(format!(
        "{filler}: {fill_bytes} of {avail} free bytes taken"
    ));
    let run = (|| -> Result<()> {
        let claim = bytes(CLAIM)?;
        let below = || s.published(NODE, "ublkd-file").is_some_and(|b| b < claim);
        s.wait(
            120,
            &format!("{NODE}'s ublkd-file capacity below {CLAIM}"),
            below,
        )
        .inspect_err(|_| s.say(format!("{:?}", s.capacities_on_node())))?;
        s.say(format!(
            "published: {NODE} {:?}, {other} {:?}",
            s.capacities_on_node()?,
            s.capacities_on(other)?
        ));
        s.claim("place-b", "ublkd-file", CLAIM, "volumeMode: Filesystem")?;
        s.start_pod_with("p-place", "place-b", Mode::Filesystem, TOLERATE_JOINED)?;
        s.ready("p-place", "place-b")?;
        let ran = s.jp(&["pod", "p-place"], "{.spec.nodeName}")?;
        let lives = pv_node(s, "place-b")?;
        s.say(format!("p-place on {ran}, its volume on {lives}"));
        ensure!(
            ran == other && lives == other,
            "a claim the first node has no room for went to {ran} (volume on {lives}), not {other}"
        );
        s.in_pod("p-place", "echo placed >/data/f && sync")?;
        // more than either node's pool
        s.claim(
            "place-huge",
            "ublkd-file",
            "100Gi",
            "volumeMode: Filesystem",
        )?;
        s.start_pod_with(
            "p-place-huge",
            "place-huge",
            Mode::Filesystem,
            TOLERATE_JOINED,
        )?;
        unschedulable(s, "p-place-huge", "place-huge", "storage")
    })();
    let removed = local("rm", &["-f", &filler]);
    run?;
    removed?;
    s.delete("pod p-place p-place-huge")?;
    s.delete("pvc place-b place-huge")?;
    spread(s, other)
}

/// `spread`'s pods may not share a node (`Sc::statefulset`'s pod lines).
const APART: &str = "      affinity:
        podAntiAffinity:
          requiredDuringSchedulingIgnoredDuringExecution:
            - labelSelector: {matchLabels: {app: spread}}
              topologyKey: kubernetes.io/hostname";

/// A StatefulSet of two whose pods may not share a node: each gets its volume on its own node.
fn spread(s: &Sc, other: &str) -> Result<()> {
    let placement = format!("      {TOLERATE_JOINED}\n{APART}");
    s.statefulset(
        "spread",
        2,
        "ublkd-ram",
        "podManagementPolicy: Parallel",
        &placement,
    )?;
    let mut placed = Vec::new();
    for i in 0..2 {
        let (pod, claim) = (format!("spread-{i}"), format!("data-spread-{i}"));
        s.wait(300, &format!("{pod} made"), || {
            s.exists(&format!("pod {pod}"))
        })?;
        s.ready(&pod, &claim)?;
        let ran = s.jp(&["pod", &pod], "{.spec.nodeName}")?;
        let lives = pv_node(s, &claim)?;
        s.say(format!("{pod} on {ran}, its volume on {lives}"));
        ensure!(
            ran == lives,
            "{pod} runs on {ran} but its volume is on {lives}"
        );
        placed.push(ran);
    }
    placed.sort();
    let mut both = vec![NODE.to_owned(), other.to_owned()];
    both.sort();
    ensure!(
        placed == both,
        "the StatefulSet's volumes are on {placed:?}, not one on each of {both:?}"
    );
    s.delete("statefulset spread")?;
    s.delete("pvc data-spread-0 data-spread-1")
}
