//! helm uninstall: the driver goes, the volumes' data stays.

use crate::kube::{Sc, NODE};
use anyhow::{ensure, Result};
use serde_json::json;
use std::fs;

/// Uninstall as docs/kubernetes.md ("Uninstall") says, last: every claim deleted first (with
/// whatever pods a failed scenario left), then helm uninstall; the driver's objects, pods and
/// devices are gone, the namespace is left.
pub fn uninstall(s: &Sc) -> Result<()> {
    // what a failed scenario left behind goes first, as a user would delete their workloads
    for kind in ["pod", "pvc"] {
        s.kw(&format!(
            "delete {kind} --all --namespace default --wait=true --timeout=300s"
        ))?;
    }
    let left = s.kw("get pvc -A --no-headers")?;
    ensure!(
        left.trim().is_empty(),
        "claims left before the uninstall:\n{left}"
    );
    // classes a failed scenario made itself (the chart's carry managed-by=Helm)
    s.kw("delete storageclass -l app.kubernetes.io/managed-by!=Helm --ignore-not-found")?;
    s.helmw("uninstall ublkd --namespace ublkd-system --wait --timeout 600s")?;
    // the pre-delete hook took the controller's finalizer off the node
    ensure!(
        !s.finalized(NODE),
        "the finalizer ublkd.io/node outlived the uninstall"
    );
    // the kubectl users' step for the same (docs/kubernetes.md, "Uninstall"), on a finalizer
    // put back by hand
    let on = json!({"metadata": {"finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "--type=merge", "-p", &on])?;
    let off =
        json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "-p", &off])?;
    ensure!(
        !s.finalized(NODE),
        "the documented patch left the finalizer on the node"
    );
    let driver = s.kw("get csidriver ublkd.io --ignore-not-found -o name")?;
    ensure!(
        driver.trim().is_empty(),
        "the CSIDriver outlived the uninstall"
    );
    let classes = s.kw("get storageclass -o name")?;
    ensure!(
        !classes.contains("ublkd"),
        "a StorageClass outlived the uninstall"
    );
    let no_pods = || {
        s.qw("-n ublkd-system get pods --no-headers")
            .is_ok_and(|p| p.trim().is_empty())
    };
    s.wait(300, "ublkd's pods went", no_pods)
        .inspect_err(|_| s.show("-n ublkd-system get pods"))?;
    let devices: Vec<String> = fs::read_dir("/dev")?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ublkb"))
        .collect();
    ensure!(
        devices.is_empty(),
        "ublk devices outlived the uninstall: {devices:?}"
    );
    s.kw("delete namespace ublkd-system --wait=true --timeout=300s")
        .map(drop)
}
