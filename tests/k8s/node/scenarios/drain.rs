//! A node drained for maintenance and uncordoned: the claim's data stays.

use crate::kube::{field, Mode, Sc, NODE, UBLKD_PODS};
use anyhow::{ensure, Result};

/// Node maintenance as docs/kubernetes.md ("Drain a node for maintenance") says: cordon and
/// drain the node (ublkd's DaemonSet pods stay, the claim's pod goes), its volume stays with
/// its data, uncordon, and a new pod on the claim reads what the old one wrote.
pub fn drain(s: &Sc) -> Result<()> {
    s.pvc("r-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-r", "r-data", Mode::Filesystem)?;
    s.in_pod("p-r", "echo before-the-drain >/data/f && sync")?;
    let vol = s.volume_of("r-data")?;
    s.kw(&format!("cordon {NODE}"))?;
    let drain = "--ignore-daemonsets --delete-emptydir-data --force --timeout=300s";
    s.kw(&format!("drain {NODE} {drain}"))?;
    s.wait(300, "the drain took p-r", || !s.exists("pod p-r"))?;
    let info = s.ublkctl(&format!("get-volume {vol}"))?;
    ensure!(
        field(&info, "state") == Some("ready"),
        "the volume {vol} is not ready after the drain"
    );
    let ublkd = s.kw(&format!("get {UBLKD_PODS} --no-headers"))?;
    ensure!(ublkd.lines().count() == 1, "the drain took ublkd's pod");
    s.kw(&format!("uncordon {NODE}"))?;
    s.pod("p-r2", "r-data", Mode::Filesystem)?;
    let got = s.in_pod("p-r2", "cat /data/f")?;
    ensure!(
        got == "before-the-drain",
        "the claim's data after the drain is '{got}'"
    );
    s.delete("pod p-r2")?;
    s.delete("pvc r-data")
}
