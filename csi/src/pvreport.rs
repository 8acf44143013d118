//! The node's volumes that no PersistentVolume names, told to its ublkd
//! (`--report-without-pv-every`): the node plugin reads ublkd's volumes and the driver's
//! PersistentVolumes (from its watch, `watch`), and reports the volumes no PV of this node (or
//! of no node) names in two rounds in a row, so that a volume
//! whose PV the provisioner is about to make is never counted. ublkd shows them (the metric
//! `ublkd_volumes_without_pv`, `ublkctl orphans`) and never deletes them: they are what a
//! deleted node leaves when its machine comes back (`nodeloss`), or volumes made by hand.

use crate::nodeloss::plan::topology_nodes;
use crate::ublkd::{Ublkd, UblkdError};
use crate::Node;
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::runtime::reflector::Store;
use std::borrow::Borrow;
use std::collections::BTreeSet;
use std::time::Duration;

#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    #[error("listing ublkd's volumes: {0}")]
    ListUblkd(#[source] UblkdError),
    #[error("reporting to ublkd: {0}")]
    Report(#[source] UblkdError),
}

/// The volume ids the driver's PVs name for `node`: those whose topology is `node`, or that
/// have none.
fn named<P: Borrow<PersistentVolume>>(node: &Node, pvs: &[P]) -> BTreeSet<String> {
    pvs.iter()
        .filter_map(|pv| {
            let pv: &PersistentVolume = pv.borrow();
            let nodes = topology_nodes(pv)?;
            let handle = &pv.spec.as_ref()?.csi.as_ref()?.volume_handle;
            (nodes.is_empty() || nodes.contains(&node.0.as_str())).then(|| handle.clone())
        })
        .collect()
}

/// One round: the volumes no PV names now (`unnamed`), and of them those that were unnamed in
/// the round before too (`report`).
#[derive(Debug, PartialEq, Eq)]
pub struct Round {
    pub unnamed: BTreeSet<String>,
    pub report: Vec<String>,
}

pub fn round<P: Borrow<PersistentVolume>>(
    node: &Node,
    volumes: &[String],
    pvs: &[P],
    before: &BTreeSet<String>,
) -> Round {
    let named = named(node, pvs);
    let unnamed: BTreeSet<String> = volumes
        .iter()
        .filter(|v| !named.contains(*v))
        .cloned()
        .collect();
    let report = unnamed.intersection(before).cloned().collect();
    Round { unnamed, report }
}

async fn once(
    pvs: &Store<PersistentVolume>,
    ublkd: &Ublkd,
    node: &Node,
    before: &BTreeSet<String>,
) -> Result<Round, ReportError> {
    // ublkd's list first: a volume made after it is named by a PV the watch holds after it, or
    // unseen
    let volumes: Vec<String> = ublkd
        .list()
        .await
        .map_err(ReportError::ListUblkd)?
        .into_iter()
        // One still CREATING has no PV yet by rule: the provisioner makes it once
        // CreateVolume returns (an NVMe window's erase can take minutes).
        .filter(|v| v.state() != ublkd_proto::v1::VolumeState::Creating)
        .map(|v| v.id)
        .collect();
    // The watch's store, a moment behind the API server at most: a PV it has not seen yet
    // changes nothing under the two-rounds rule.
    let r = round(node, &volumes, &pvs.state(), before);
    ublkd
        .report_without_pv(r.report.clone())
        .await
        .map_err(ReportError::Report)?;
    Ok(r)
}

/// Reports every `every` until the process ends, once `pvs` holds its first list; a failed
/// round is logged and the next one tried (a round that fails changes nothing in ublkd).
pub async fn run(
    ublkd: Ublkd,
    node: Node,
    every: Duration,
    pvs: crate::watch::Kept<PersistentVolume>,
) {
    let Some(pvs) = pvs.listed().await else {
        return;
    };
    tracing::info!("reporting the volumes no PersistentVolume names every {every:?}");
    let mut before = BTreeSet::new();
    let mut reported: Vec<String> = Vec::new();
    loop {
        match once(&pvs, &ublkd, &node, &before).await {
            Ok(r) => {
                if r.report != reported {
                    tracing::warn!(volumes = ?r.report, "volumes no PersistentVolume names, reported to ublkd");
                    reported = r.report;
                }
                before = r.unnamed;
            }
            Err(e) => {
                tracing::error!(error = %e, "reporting the volumes without a PersistentVolume failed; trying again in {every:?}")
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{DRIVER_NAME, TOPOLOGY_KEY};
    use serde_json::json;

    fn pv(handle: &str, driver: &str, node: Option<&str>) -> PersistentVolume {
        let affinity = node.map(|n| {
            json!({"required": {"nodeSelectorTerms": [
                {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": [n]}]}
            ]}})
        });
        serde_json::from_value(json!({
            "metadata": {"name": format!("pv-{handle}")},
            "spec": {"csi": {"driver": driver, "volumeHandle": handle}, "nodeAffinity": affinity}
        }))
        .expect("a PersistentVolume")
    }

    #[test]
    fn a_volume_is_reported_after_two_rounds_without_its_pv() {
        let me = Node("n1".into());
        let vols: Vec<String> = ["a", "b", "c", "d", "e"].map(String::from).into();
        let pvs = [
            pv("a", DRIVER_NAME, Some("n1")),
            // another node's PV naming the same id does not name this node's volume
            pv("b", DRIVER_NAME, Some("n2")),
            pv("c", "other.csi.io", Some("n1")),
            // a PV without topology names it wherever it is
            pv("d", DRIVER_NAME, None),
        ];
        let first = round(&me, &vols, &pvs, &BTreeSet::new());
        assert_eq!(
            first.unnamed,
            BTreeSet::from(["b".to_owned(), "c".to_owned(), "e".to_owned()])
        );
        assert!(first.report.is_empty(), "never on the first sight");
        // "e" got its PV in between (it was being provisioned)
        let mut pvs2 = pvs.to_vec();
        pvs2.push(pv("e", DRIVER_NAME, Some("n1")));
        let second = round(&me, &vols, &pvs2, &first.unnamed);
        assert_eq!(second.report, ["b", "c"]);
    }
}
