//! A VolumeAttributesClass's limits carried to the volume's node on its PersistentVolume, so
//! that ControllerModifyVolume needs no way into the nodes (no host port, no client
//! certificate).
//!
//! The central driver beside the csi-resizer (`--resizer-only`) records the class's parameters
//! on the volume's PV (annotation `ublkd.io/limits-wanted`) and labels it for the volume's node
//! (`ublkd.io/limits-pending=NODE`). The node plugin of that node finds the PVs labelled for it
//! in its watch (`watch`; looked at every `--apply-limits-every`, no request to the API server), applies each over the local socket (ublkd's SetVolumeQos, merged
//! over the limits the volume has, as `modify` does), and answers on the PV: the parameters it
//! applied (`ublkd.io/limits-applied`), or why it could not (`ublkd.io/limits-refused`), the
//! label then removed. ControllerModifyVolume returns OK only once the node's answer is the
//! class it was given; until then UNAVAILABLE, which the resizer retries, and a refusal is
//! FAILED_PRECONDITION with the node's reason (the resizer's Event on the claim says it).

use crate::error::CsiError;
use crate::nodeloss::plan::topology_nodes;
use crate::qos::QosChange;
use crate::ublkd::Ublkd;
use crate::{Node, DRIVER_NAME};
use k8s_openapi::api::core::v1::PersistentVolume;
use kube::api::{Api, ListParams, Patch, PatchParams};
use kube::Client;
use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

/// The class's parameters the driver was given, as JSON (keys sorted).
pub const WANTED: &str = "ublkd.io/limits-wanted";
/// The parameters the node applied, as JSON: equal to `WANTED` once done.
pub const APPLIED: &str = "ublkd.io/limits-applied";
/// Why the node could not apply `WANTED`: `{"wanted": ..., "why": ...}`.
pub const REFUSED: &str = "ublkd.io/limits-refused";
/// On a PV whose `WANTED` its node has still to answer; the value is the node.
pub const PENDING: &str = "ublkd.io/limits-pending";

#[derive(Debug, thiserror::Error)]
pub enum LimitsError {
    #[error("answering on PersistentVolume {pv}: {source}")]
    Answer {
        pv: String,
        #[source]
        source: kube::Error,
    },
}

/// A PV's annotation.
fn annotation<'a>(pv: &'a PersistentVolume, key: &str) -> Option<&'a str> {
    pv.metadata
        .annotations
        .as_ref()?
        .get(key)
        .map(String::as_str)
}

/// What a PV says of `wanted` (the JSON of a class's parameters).
#[derive(Debug, PartialEq, Eq)]
pub enum Answer {
    Applied,
    Refused(String),
    Pending,
}

pub fn answer(pv: &PersistentVolume, wanted: &str) -> Answer {
    if annotation(pv, APPLIED) == Some(wanted) {
        return Answer::Applied;
    }
    let refused = annotation(pv, REFUSED)
        .and_then(|r| serde_json::from_str::<serde_json::Value>(r).ok())
        .filter(|r| r["wanted"].as_str() == Some(wanted));
    match refused {
        Some(r) => Answer::Refused(r["why"].as_str().unwrap_or("no reason given").to_owned()),
        None => Answer::Pending,
    }
}

/// The driver's PV of volume `id`.
fn pv_of<'a>(pvs: &'a [PersistentVolume], id: &str) -> Option<&'a PersistentVolume> {
    pvs.iter().find(|pv| {
        let csi = pv.spec.as_ref().and_then(|s| s.csi.as_ref());
        csi.is_some_and(|c| c.driver == DRIVER_NAME && c.volume_handle == id)
    })
}

/// ControllerModifyVolume of the central driver: `params` (already checked) recorded on volume
/// `id`'s PV for its node, then the node's answer awaited for up to `wait`.
pub async fn record(
    client: &Client,
    id: &str,
    params: &HashMap<String, String>,
    wait: Duration,
) -> Result<(), CsiError> {
    let api: Api<PersistentVolume> = Api::all(client.clone());
    let kube = |e: kube::Error| CsiError::LimitsNotRecorded {
        id: id.to_owned(),
        why: e.to_string(),
    };
    let list = api.list(&ListParams::default()).await.map_err(kube)?;
    let pv = pv_of(&list.items, id).ok_or_else(|| CsiError::VolumeNotFound(id.to_owned()))?;
    let name = pv.metadata.name.clone().unwrap_or_default();
    let node = topology_nodes(pv)
        .and_then(|n| n.first().map(|n| n.to_string()))
        .ok_or_else(|| CsiError::LimitsNotRecorded {
            id: id.to_owned(),
            why: format!("PersistentVolume {name} names no node"),
        })?;
    let sorted: BTreeMap<&String, &String> = params.iter().collect();
    // A map of strings always serializes; an empty string would be refused by the node.
    let wanted = serde_json::to_string(&sorted).unwrap_or_default();
    if answer(pv, &wanted) == Answer::Applied {
        return Ok(());
    }
    let patch = serde_json::json!({"metadata": {
        "annotations": {WANTED: wanted, REFUSED: null},
        "labels": {PENDING: node},
    }});
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(kube)?;
    tracing::info!(volume = %id, pv = %name, %node, %wanted, "limits recorded for the node to apply");
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let pv = api.get(&name).await.map_err(kube)?;
        match answer(&pv, &wanted) {
            Answer::Applied => return Ok(()),
            Answer::Refused(why) => {
                return Err(CsiError::LimitsRefused {
                    id: id.to_owned(),
                    node,
                    why,
                })
            }
            Answer::Pending if tokio::time::Instant::now() >= deadline => {
                return Err(CsiError::LimitsPending {
                    id: id.to_owned(),
                    node,
                })
            }
            Answer::Pending => {}
        }
    }
}

/// What the node plugin made of one PV pending for it.
#[derive(Debug)]
enum Outcome {
    Applied,
    /// Answered on the PV: the limits cannot be applied here.
    Refused(String),
    /// Not answered: ublkd did not answer (it may be restarting); the next round tries again.
    Unanswered(String),
}

/// The node plugin's side: what one PV pending for this node asks (`WANTED`), applied.
async fn apply(ublkd: &Ublkd, pv: &PersistentVolume, wanted: &str) -> Outcome {
    use crate::ublkd::UblkdError;
    let id = (pv.spec.as_ref().and_then(|s| s.csi.as_ref()))
        .map(|c| c.volume_handle.clone())
        .unwrap_or_default();
    let params: HashMap<String, String> = match serde_json::from_str(wanted) {
        Ok(p) => p,
        Err(e) => {
            return Outcome::Refused(format!("{WANTED} is not a JSON object of strings: {e}"))
        }
    };
    let change = match QosChange::from_mutable(&params) {
        Ok(c) => c,
        Err(e) => return Outcome::Refused(e.to_string()),
    };
    let volume = match ublkd.get(&id).await {
        Ok(Some(v)) => v,
        Ok(None) => return Outcome::Refused(format!("volume {id} is not in this node's ublkd")),
        Err(e) => return Outcome::Unanswered(format!("asking ublkd for volume {id}: {e}")),
    };
    let current = volume.spec.and_then(|s| s.qos).unwrap_or_default();
    let limits = change.apply(&current);
    if limits != current {
        match ublkd.set_qos(&id, limits).await {
            Ok(_) => {}
            Err(e @ UblkdError::Connect(_)) => return Outcome::Unanswered(e.to_string()),
            Err(e) => return Outcome::Refused(format!("ublkd refused the limits: {e}")),
        }
    }
    tracing::info!(volume = %id, ?limits, "limits applied from the PersistentVolume");
    Outcome::Applied
}

/// Whether `pv` waits for `node`'s answer.
fn pending_for(pv: &PersistentVolume, node: &Node) -> bool {
    pv.metadata.labels.as_ref().and_then(|l| l.get(PENDING)) == Some(&node.0)
}

/// Of the PVs the watch holds, those pending for `node` and not answered at their version yet;
/// `answered` forgets those the watch shows answered.
fn to_answer<P: std::ops::Deref<Target = PersistentVolume>>(
    pvs: Vec<P>,
    node: &Node,
    answered: &mut HashMap<String, Option<String>>,
) -> Vec<P> {
    let mine: Vec<P> = pvs.into_iter().filter(|pv| pending_for(pv, node)).collect();
    answered.retain(|name, _| {
        mine.iter()
            .any(|pv| pv.metadata.name.as_ref() == Some(name))
    });
    mine.into_iter()
        .filter(|pv| {
            let name = pv.metadata.name.clone().unwrap_or_default();
            answered.get(&name) != Some(&pv.metadata.resource_version)
        })
        .collect()
}

/// Answers the PVs pending for `node` every `every` until the process ends, once `pvs` holds
/// its first list; a PV that could not be answered is tried again in the next round.
pub async fn run(
    ublkd: Ublkd,
    node: Node,
    every: Duration,
    client: Client,
    pvs: crate::watch::Kept<PersistentVolume>,
) {
    let Some(pvs) = pvs.listed().await else {
        return;
    };
    let api: Api<PersistentVolume> = Api::all(client);
    // The version of each PV answered, by name: the store shows it pending until the watch
    // brings the answer back, and it is not answered twice.
    let mut answered: HashMap<String, Option<String>> = HashMap::new();
    loop {
        for pv in to_answer(pvs.state(), &node, &mut answered) {
            let name = pv.metadata.name.clone().unwrap_or_default();
            match answer_one(&api, &ublkd, &pv).await {
                Ok(true) => {
                    answered.insert(name, pv.metadata.resource_version.clone());
                }
                Ok(false) => {}
                Err(e) => {
                    tracing::error!(error = %e, "applying the limits recorded on PersistentVolumes failed; trying again in {every:?}")
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

/// Applies one pending PV's limits and answers on it: true once answered, false when ublkd did
/// not answer (nothing written; the next round tries again).
async fn answer_one(
    api: &Api<PersistentVolume>,
    ublkd: &Ublkd,
    pv: &PersistentVolume,
) -> Result<bool, LimitsError> {
    let name = pv.metadata.name.clone().unwrap_or_default();
    let wanted = annotation(pv, WANTED).unwrap_or("");
    let answers = match apply(ublkd, pv, wanted).await {
        Outcome::Applied => serde_json::json!({APPLIED: wanted, REFUSED: null}),
        Outcome::Refused(why) => {
            tracing::warn!(pv = %name, %wanted, %why, "limits refused");
            let refused = serde_json::json!({"wanted": wanted, "why": why}).to_string();
            serde_json::json!({REFUSED: refused})
        }
        Outcome::Unanswered(why) => {
            tracing::warn!(pv = %name, %wanted, %why, "limits not applied yet: ublkd did not answer");
            return Ok(false);
        }
    };
    let patch =
        serde_json::json!({"metadata": {"annotations": answers, "labels": {PENDING: null}}});
    api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))
        .await
        .map_err(|source| LimitsError::Answer { pv: name, source })?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// A PV pending for this node is answered once per version: not again while the watch
    /// still shows it pending, again when it is changed, and forgotten once answered.
    #[test]
    fn each_pending_version_is_answered_once() {
        let me = Node("node-a".into());
        let pending = |name: &str, node: &str, version: &str| -> Box<PersistentVolume> {
            Box::new(
                serde_json::from_value(json!({"metadata": {
                    "name": name, "resourceVersion": version, "labels": {PENDING: node}
                }}))
                .expect("a PersistentVolume"),
            )
        };
        let mut answered = HashMap::new();
        let names = |pvs: Vec<Box<PersistentVolume>>| -> Vec<String> {
            pvs.iter()
                .map(|p| p.metadata.name.clone().unwrap())
                .collect()
        };
        let round = vec![
            pending("pv-1", "node-a", "5"),
            pending("pv-2", "node-b", "6"),
        ];
        assert_eq!(names(to_answer(round, &me, &mut answered)), ["pv-1"]);
        answered.insert("pv-1".into(), Some("5".into()));
        let round = vec![pending("pv-1", "node-a", "5")];
        assert!(to_answer(round, &me, &mut answered).is_empty());
        let round = vec![pending("pv-1", "node-a", "7")];
        assert_eq!(names(to_answer(round, &me, &mut answered)), ["pv-1"]);
        assert!(to_answer(Vec::<Box<PersistentVolume>>::new(), &me, &mut answered).is_empty());
        assert!(answered.is_empty());
    }

    fn pv(annotations: serde_json::Value) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": "pv-1", "annotations": annotations},
            "spec": {"csi": {"driver": DRIVER_NAME, "volumeHandle": "v1"}}
        }))
        .expect("a PersistentVolume")
    }

    #[test]
    fn only_the_answer_to_the_same_class_counts() {
        let a = r#"{"writeIops":"2000"}"#;
        let b = r#"{"writeIops":"unlimited"}"#;
        assert_eq!(answer(&pv(json!({WANTED: a})), a), Answer::Pending);
        assert_eq!(answer(&pv(json!({APPLIED: a})), a), Answer::Applied);
        // the node applied the class before: the new one is still to do
        assert_eq!(answer(&pv(json!({APPLIED: a})), b), Answer::Pending);
        let refused = json!({"wanted": b, "why": "volume v1 is not in this node's ublkd"});
        let p = pv(json!({APPLIED: a, REFUSED: refused.to_string()}));
        assert_eq!(
            answer(&p, b),
            Answer::Refused("volume v1 is not in this node's ublkd".into())
        );
        // a refusal of another class is no answer to this one
        assert_eq!(answer(&p, r#"{"readIops":"1"}"#), Answer::Pending);
    }

    #[test]
    fn the_pv_is_found_by_driver_and_handle() {
        let p = pv(json!({}));
        assert!(pv_of(std::slice::from_ref(&p), "v1").is_some());
        assert!(pv_of(std::slice::from_ref(&p), "v2").is_none());
    }
}
