//! `kubectl ublkd check`: the preflight. Each node's own checks come from its report (its node
//! plugin ran them on the node: `ublk_drv` with user recovery, reflink roots, NVMe namespaces,
//! the kubelet directory's propagation); the cluster's are looked at here: the CSIDriver, a
//! fresh report from every node that runs ublkd, and, when a VolumeSnapshotClass of the driver
//! exists, a snapshot-controller run with `--enable-distributed-snapshotting` (without it, the
//! node-local snapshotter's contents are never bound).

use crate::cluster::{age_seconds, Cluster, Report, DRIVER};
use crate::report::table;
use anyhow::Result;
use k8s_openapi::api::apps::v1::Deployment;
use serde::Serialize;
use serde_json::json;

/// The flag the snapshot controller needs for node-local snapshots.
pub const DISTRIBUTED: &str = "--enable-distributed-snapshotting";

/// One finding: a check, where (a node, or `cluster`), and what was found.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Finding {
    pub check: String,
    #[serde(rename = "where")]
    pub at: String,
    pub ok: bool,
    pub detail: String,
}

fn finding(check: &str, at: &str, problem: Option<String>, fine: &str) -> Finding {
    Finding {
        check: check.into(),
        at: at.into(),
        ok: problem.is_none(),
        detail: problem.unwrap_or_else(|| fine.into()),
    }
}

/// Every node's checks from its report, and whether the report is fresh.
pub fn node_findings(reports: &[Report], ublkd_nodes: &[String], stale_after: i64) -> Vec<Finding> {
    let mut out = Vec::new();
    for node in ublkd_nodes {
        if !reports.iter().any(|r| &r.node == node) {
            out.push(finding(
                "node-report",
                node,
                Some("ublkd runs here but its node plugin wrote no UblkdNode".into()),
                "",
            ));
        }
    }
    for r in reports {
        let age = age_seconds(&r.status.reported_at);
        let stale = match age {
            Some(a) if a <= stale_after => None,
            Some(a) => Some(format!(
                "the last report is {a} s old (its node plugin is not reporting)"
            )),
            None => Some(format!("unreadable report time {:?}", r.status.reported_at)),
        };
        out.push(finding("node-report", &r.node, stale, "fresh"));
        for c in &r.status.checks {
            let name = json!(c.name).as_str().unwrap_or("?").to_owned();
            out.push(Finding {
                check: name,
                at: r.node.clone(),
                ok: c.ok,
                detail: c.detail.clone(),
            });
        }
    }
    out
}

/// The snapshot controller: a Deployment whose image is a snapshot-controller, run with
/// `DISTRIBUTED`.
pub fn snapshot_controller(deployments: &[Deployment]) -> Option<String> {
    let controllers: Vec<(String, bool)> = deployments
        .iter()
        .flat_map(|d| {
            let name = format!(
                "{}/{}",
                d.metadata.namespace.as_deref().unwrap_or_default(),
                d.metadata.name.as_deref().unwrap_or_default()
            );
            d.spec
                .iter()
                .flat_map(|s| s.template.spec.iter())
                .flat_map(|p| p.containers.iter())
                .filter(|c| {
                    c.image
                        .as_deref()
                        .is_some_and(|i| i.contains("snapshot-controller"))
                })
                .map(move |c| {
                    let flagged = c.args.iter().flatten().any(|a| a == DISTRIBUTED);
                    (name.clone(), flagged)
                })
        })
        .collect();
    if controllers.is_empty() {
        return Some(format!(
            "no snapshot-controller Deployment: VolumeSnapshots of the driver are never bound (it needs {DISTRIBUTED})"
        ));
    }
    let unflagged: Vec<&str> = controllers
        .iter()
        .filter(|(_, f)| !f)
        .map(|(n, _)| n.as_str())
        .collect();
    (!unflagged.is_empty()).then(|| {
        format!(
            "{} runs without {DISTRIBUTED}: node-local snapshots are never bound",
            unflagged.join(", ")
        )
    })
}

pub async fn gather(cluster: &Cluster, stale_after: i64) -> Result<Vec<Finding>> {
    let mut out = vec![finding(
        "csi-driver",
        "cluster",
        (!cluster.csi_driver().await?).then(|| format!("no CSIDriver {DRIVER}")),
        "registered",
    )];
    let nodes: Vec<String> = cluster.ublkd_pods().await?.into_keys().collect();
    out.extend(node_findings(
        &cluster.reports().await?,
        &nodes,
        stale_after,
    ));
    if cluster.snapshot_class().await? {
        out.push(finding(
            "snapshot-controller",
            "cluster",
            snapshot_controller(&cluster.deployments().await?),
            "runs with --enable-distributed-snapshotting",
        ));
    }
    Ok(out)
}

pub fn text(found: &[Finding]) -> String {
    let rows: Vec<Vec<String>> = found
        .iter()
        .map(|f| {
            vec![
                f.check.clone(),
                f.at.clone(),
                if f.ok { "ok" } else { "FAIL" }.into(),
                f.detail.clone(),
            ]
        })
        .collect();
    table(&["CHECK", "WHERE", "RESULT", "DETAIL"], &rows)
}

/// What failed, in one line: `check on where: detail; ...`.
pub fn failing(found: &[Finding]) -> String {
    found
        .iter()
        .filter(|f| !f.ok)
        .map(|f| format!("{} on {}: {}", f.check, f.at, f.detail))
        .collect::<Vec<_>>()
        .join("; ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use ublkd_csi::nodestatus::{Check, CheckName, NodeStatus};

    fn report(node: &str, at: &str, checks: Vec<Check>) -> Report {
        Report {
            node: node.into(),
            status: NodeStatus {
                reported_at: at.into(),
                checks,
                ..Default::default()
            },
        }
    }

    #[test]
    fn a_node_without_a_fresh_report_or_with_a_failing_check_fails() {
        let now = k8s_openapi::jiff::Timestamp::now().to_string();
        let bad = Check {
            name: CheckName::KubeletDir,
            ok: false,
            detail: "private".into(),
        };
        let reports = [
            report("n1", &now, vec![bad]),
            report("n2", "2020-01-01T00:00:00Z", vec![]),
        ];
        let nodes = ["n1", "n2", "n3"].map(String::from);
        let found = node_findings(&reports, &nodes, 60);
        let failing = failing(&found);
        assert!(
            failing.contains("node-report on n3: ublkd runs here"),
            "{failing}"
        );
        assert!(
            failing.contains("node-report on n2: the last report is"),
            "{failing}"
        );
        assert!(failing.contains("kubelet-dir on n1: private"), "{failing}");
        assert!(!failing.contains("node-report on n1"), "{failing}");
        assert!(text(&found).contains("FAIL"));
    }

    #[test]
    fn the_snapshot_controller_needs_its_flag() {
        let d = |args: Vec<&str>| -> Deployment {
            serde_json::from_value(json!({
                "metadata": {"name": "snapshot-controller", "namespace": "kube-system"},
                "spec": {"selector": {}, "template": {"spec": {"containers": [{
                    "name": "c",
                    "image": "registry.example/sig-storage/snapshot-controller:v8.2.1",
                    "args": args}]}}}
            }))
            .expect("a Deployment")
        };
        assert!(snapshot_controller(&[]).is_some_and(|e| e.contains("no snapshot-controller")));
        let e = snapshot_controller(&[d(vec!["--v=5"])]).unwrap_or_default();
        assert!(
            e.contains("kube-system/snapshot-controller runs without"),
            "{e}"
        );
        assert_eq!(snapshot_controller(&[d(vec![DISTRIBUTED])]), None);
    }
}
