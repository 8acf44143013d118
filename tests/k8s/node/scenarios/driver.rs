//! The driver as installed: its pods, CSIDriver, classes and node registration.

use crate::kube::{words, Sc, NODE, UBLKD_PODS};
use anyhow::{ensure, Result};

/// The driver as the cluster sees it: CSINode with the topology key and a volume limit, and
/// capacity objects for every class.
pub fn driver(s: &Sc) -> Result<()> {
    // How long ublkd took from its container's start to binding the listener of its startup
    // probe (for the record: a probe before that bind is a warning event, warnings).
    let path =
        r#"{.items[0].status.containerStatuses[?(@.name=="ublkd")].state.running.startedAt}"#;
    let started = s.jp(&words(UBLKD_PODS), path)?;
    let logs = s.qw(&format!(
        "{} --timestamps",
        s.logs_on_node("ublkd", "ublkd")
    ))?;
    let bound = logs
        .lines()
        .find(|l| l.contains("metrics on"))
        .and_then(|l| l.split(' ').next());
    s.say(format!(
        "ublkd container started {started}; metrics listener bound {bound:?}"
    ));
    let drv = r#"{.spec.drivers[?(@.name=="ublkd.io")]"#;
    let keys = s.jp(&["csinode", NODE], &format!("{drv}.topologyKeys}}"))?;
    s.say(format!("topology keys: {keys}"));
    ensure!(
        !keys.is_empty() && keys != "[]",
        "CSINode lists ublkd.io with a topology key"
    );
    let count = s.jp(&["csinode", NODE], &format!("{drv}.allocatable.count}}"))?;
    s.say(format!("volume limit: {count}"));
    ensure!(
        count.parse::<u64>().unwrap_or(0) > 0,
        "CSINode gives ublkd.io a volume limit"
    );
    // the provisioner publishes them once it has synced; a slow emulated node takes minutes
    let capacities = || {
        s.qw("get csistoragecapacities -A --no-headers")
            .is_ok_and(|o| o.lines().count() >= 3)
    };
    s.wait(420, "3 CSIStorageCapacity objects", capacities)?;
    let cols =
        "custom-columns=CLASS:.storageClassName,CAPACITY:.capacity,NODE:.nodeTopology.matchLabels";
    s.show(&format!("get csistoragecapacities -A -o {cols}"));
    s.wait(120, "the finalizer ublkd.io/node on the node", || {
        s.finalized(NODE)
    })?;
    for sc in ["ublkd-file", "ublkd-ram", "ublkd-nvme"] {
        let path = format!(r#"{{.items[?(@.storageClassName=="{sc}")].capacity}}"#);
        let n = s.jp(&["csistoragecapacities", "-A"], &path)?;
        ensure!(!n.is_empty(), "a CSIStorageCapacity for {sc}");
    }
    Ok(())
}
