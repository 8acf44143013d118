//! Faults told to the people using a volume: a FAILED volume, a missing ublk driver, a pod stuck in ContainerCreating.

use super::{backing_file, kill_ublkd, unschedulable};
use crate::kube::{field, fill, has_line, Mode, Sc, NODE};
use anyhow::{ensure, Result};
use std::fs;
use std::path::Path;

/// Events of `reason` about the claim `name` (in default), their messages.
fn claim_events(s: &Sc, name: &str, reason: &str) -> String {
    let kind = "involvedObject.kind=PersistentVolumeClaim";
    let sel = format!("{kind},involvedObject.name={name},reason={reason}");
    s.events(&sel).unwrap_or_default()
}

/// A volume that cannot come back reaches the people using it: the backing file of a claim in
/// use is moved away and ublkd killed, so its takeover fails and the volume is FAILED.
/// `kubectl describe pvc` shows a VolumeFailed Warning within 60 s, and the pod has one too.
/// With the file back, ublkd's own retry brings the volume back, a VolumeRecovered Event
/// follows, and the pod reads its device again.
pub fn volume_fault(s: &Sc) -> Result<()> {
    s.pvc("f-data", "ublkd-file", "64Mi", Mode::Block)?;
    s.pod("p-fault", "f-data", Mode::Block)?;
    let read = "dd if=/dev/xvda of=/dev/null bs=4096 count=16 iflag=direct 2>&1";
    s.say(s.in_pod("p-fault", read)?);
    let vol = s.volume_of("f-data")?;
    let file = backing_file(&vol)?;
    let away = file.with_extension("away");
    fs::rename(&file, &away)?;
    s.say(format!("moved {} away", file.display()));
    kill_ublkd(s)?;
    let state = |want: &str| {
        s.ublkctl(&format!("get-volume {vol}"))
            .is_ok_and(|i| field(&i, "state") == Some(want))
    };
    let described = || s.shows("describe pvc f-data", "VolumeFailed");
    // From the moment ublkd reports the volume FAILED, the claim has 60 s to show it.
    let shown = s
        .wait(300, "ublkd back, the volume FAILED", || state("failed"))
        .and_then(|()| s.wait(60, "kubectl describe pvc shows VolumeFailed", described));
    // The file goes back whatever happened, so that the claim can be deleted.
    fs::rename(&away, &file)?;
    shown.inspect_err(|_| {
        s.tail(15, "describe pvc f-data");
        s.tail(30, &s.csi_node_logs());
    })?;
    let failed = claim_events(s, "f-data", "VolumeFailed");
    s.say(format!("VolumeFailed: {failed}"));
    ensure!(
        failed.contains(&vol) || failed.to_lowercase().contains("fail"),
        "the Event says nothing of the failure: {failed:?}"
    );
    let on_pod = || s.shows("describe pod p-fault", "VolumeFailed");
    s.wait(60, "the pod's Events show VolumeFailed too", on_pod)?;
    let recovered = || !claim_events(s, "f-data", "VolumeRecovered").is_empty();
    s.wait(180, "a VolumeRecovered Event on the claim", recovered)
        .inspect_err(|_| s.tail(20, &s.logs_on_node("ublkd", "ublkd")))?;
    s.wait(60, "the volume READY again", || state("ready"))?;
    s.say(s.in_pod("p-fault", read)?);
    let kinds = s.qw("get events --field-selector involvedObject.name=f-data -o custom-columns=TYPE:.type,REASON:.reason --no-headers")?;
    s.say(&kinds);
    ensure!(
        has_line(&kinds, "Normal VolumeRecovered"),
        "VolumeRecovered is not a Normal Event"
    );
    s.delete("pod p-fault")?;
    s.delete("pvc f-data")
}

/// Capacity where ublk cannot serve: /dev/ublk-control hidden on the node and ublkd's pod
/// restarted, as on a node whose kernel has no ublk_drv. ublkd stays up saying why, its pod
/// is not Ready, the Node has a UblkUnavailable Event, every CSIStorageCapacity of the node
/// reads 0, and a claim waiting for a pod stays Pending with the scheduler's reason. With the
/// device back and the pod restarted: Ready, capacity, the claim bound, UblkAvailable.
pub fn ublk_missing(s: &Sc) -> Result<()> {
    let ctl = Path::new("/dev/ublk-control");
    let hidden = Path::new("/dev/ublk-control.hidden");
    let restart = || -> Result<()> {
        let old = s.ublkd_pod()?;
        s.delete(&format!("-n ublkd-system pod {old}"))?;
        let new = || s.ublkd_pod().is_ok_and(|p| p != old);
        s.wait(120, "a new ublkd pod", new)
    };
    // this node's: another node's ublkd still has its ublk driver
    let capacities = || {
        let on_node = s.capacities_on_node().unwrap_or_default();
        let c: Vec<String> = on_node.into_iter().map(|(_, c)| c).collect();
        c.join(" ")
    };
    s.say(format!("capacities before: {}", capacities()));
    fs::rename(ctl, hidden)?;
    s.say("/dev/ublk-control hidden");
    let hidden_run = (|| -> Result<()> {
        restart()?;
        let logs = s.logs_on_node("ublkd", "ublkd");
        let logs = logs.as_str();
        let says = || s.shows(logs, "no ublk dataplane");
        s.wait(120, "ublkd's log says it has no ublk dataplane", says)?;
        // Not Ready because its readiness probe fails, saying why (not merely not yet probed).
        let pod = s.ublkd_pod()?;
        let sel = format!("involvedObject.name={pod},reason=Unhealthy");
        let probe = || {
            s.jp(
                &["-n", "ublkd-system", "events", "--field-selector", &sel],
                "{.items[*].message}",
            )
            .is_ok_and(|m| m.contains("serves no volume"))
        };
        s.wait(
            120,
            "the readiness probe fails: ublkd serves no volume",
            probe,
        )?;
        ensure!(!s.ublkd_ready(), "ublkd's pod is Ready without ublk");
        let event = || s.node_event(NODE, "UblkUnavailable");
        s.wait(120, "a UblkUnavailable Event on the Node", event)?;
        s.node_events(NODE);
        fleet_names_the_broken_node(s)?;
        let zero = || {
            let c = capacities();
            !c.is_empty() && c.split_whitespace().all(|q| q == "0")
        };
        s.wait(240, "every CSIStorageCapacity of the node reads 0", zero)?;
        s.pvc("u-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
        s.start_pod("p-u", "u-data", Mode::Filesystem)?;
        unschedulable(s, "p-u", "u-data", "storage")
    })();
    fs::rename(hidden, ctl)?;
    s.say("/dev/ublk-control back");
    restart()?;
    s.wait(300, "ublkd Ready again", || s.ublkd_ready())?;
    hidden_run?;
    s.ready("p-u", "u-data")?;
    s.wait(120, "a UblkAvailable Event on the Node", || {
        s.node_event(NODE, "UblkAvailable")
    })?;
    s.say(format!("capacities after: {}", capacities()));
    s.delete("pod p-u")?;
    s.delete("pvc u-data")
}

/// A pod stuck in ContainerCreating, looked at as docs/kubernetes.md ("Troubleshooting") says:
/// a PV naming a volume this node's ublkd does not have (as one deleted by hand would), so the
/// pod's volume can never be staged. `kubectl describe pod` shows the mount error and the node
/// plugin's log the reason, with the volume's name.
pub fn stuck(s: &Sc) -> Result<()> {
    s.apply(&fill(
        "apiVersion: v1
kind: PersistentVolume
metadata: {name: stuck-pv}
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: stuck}
  csi: {driver: ublkd.io, volumeHandle: stuck-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [@NODE@]}]}]
",
        &[("NODE", NODE)],
    ))?;
    s.claim("stuck", "ublkd-ram", "64Mi", "volumeName: stuck-pv")?;
    s.start_pod("p-stuck", "stuck", Mode::Filesystem)?;
    let describe = || s.qw("describe pod p-stuck").unwrap_or_default();
    s.wait(300, "a FailedMount event on p-stuck", || {
        describe().contains("FailedMount")
    })
    .inspect_err(|_| s.tail(20, "describe pod p-stuck"))?;
    s.tail(8, "describe pod p-stuck");
    let reason = s.jp(
        &["pod", "p-stuck"],
        "{.status.containerStatuses[0].state.waiting.reason}",
    )?;
    ensure!(
        reason == "ContainerCreating",
        "p-stuck is waiting in '{reason}', not ContainerCreating"
    );
    let failed = describe();
    ensure!(
        failed
            .lines()
            .any(|l| l.contains("FailedMount") && l.contains("stuck-vol")),
        "the mount error does not name the volume"
    );
    let logs = s.kw(&s.csi_node_logs())?;
    let why: Vec<&str> = logs.lines().filter(|l| l.contains("stuck-vol")).collect();
    s.say(why[why.len().saturating_sub(3)..].join("\n"));
    let refused = |l: &&str| {
        l.find("call refused")
            .is_some_and(|at| l[at..].contains("stuck-vol"))
    };
    ensure!(
        why.iter().any(refused),
        "the node plugin's log does not say why stuck-vol cannot be staged"
    );
    s.kw("delete pod p-stuck --wait=true --timeout=120s")?;
    s.delete("pvc stuck")?;
    s.delete("pv stuck-pv")
}

/// `kubectl ublkd nodes` and `check`, this node without its ublk driver: it is named failing
/// (check exits 1); on two nodes both are reported, the other one's checks ok.
fn fleet_names_the_broken_node(s: &Sc) -> Result<()> {
    let other = s.second_node();
    // the CHECKS cell (the sixth) of a node's line: `ok`, or the failing checks
    let checks = |out: &str, node: &str| -> Option<String> {
        let line = out
            .lines()
            .find(|l| l.split_whitespace().next() == Some(node))?;
        line.split_whitespace().nth(5).map(str::to_owned)
    };
    let failing = || {
        s.kw("ublkd nodes")
            .is_ok_and(|o| checks(&o, NODE).is_some_and(|c| c != "ok"))
    };
    s.wait(120, "kubectl ublkd nodes shows this node failing", failing)?;
    let nodes = s.kw("ublkd nodes")?;
    s.say(&nodes);
    if let Some(other) = other {
        ensure!(
            checks(&nodes, other).as_deref() == Some("ok"),
            "kubectl ublkd nodes does not show {other} healthy"
        );
    }
    let a = s.node.host.call("kubectl", &["ublkd", "check"], None)?;
    s.say(format!("{}{}", a.out, a.err));
    let results = |node: &str| -> Vec<String> {
        a.out
            .lines()
            .filter_map(|l| {
                let cells: Vec<&str> = l.split_whitespace().collect();
                (cells.get(1) == Some(&node)).then(|| cells.get(2).unwrap_or(&"").to_string())
            })
            .collect()
    };
    let mine = results(NODE);
    ensure!(
        a.rc == 1 && mine.iter().any(|r| r == "FAIL"),
        "kubectl ublkd check (exit {}) does not name {NODE} failing",
        a.rc
    );
    if let Some(other) = other {
        let theirs = results(other);
        ensure!(
            !theirs.is_empty() && theirs.iter().all(|r| r == "ok"),
            "kubectl ublkd check does not show {other} healthy: {theirs:?}"
        );
    }
    Ok(())
}
