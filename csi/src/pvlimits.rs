//! A VolumeAttributesClass's limits carried to the volume's node on its PersistentVolume, so
//! that ControllerModifyVolume needs no way into the nodes (no host port, no client
//! certificate).
//!
//! The central driver beside the csi-resizer (`--resizer-only`) records the class's parameters
//! on the volume's PV (annotation `ublkd.io/limits-wanted`) and labels it for the volume's node
//! (`ublkd.io/limits-pending=NODE`). The node plugin of that node lists the PVs labelled for it
//! (`--apply-limits-every`), applies each over the local socket (ublkd's SetVolumeQos, merged
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
    #[error("connecting to the API server: {0}")]
    Connect(#[source] kube::Error),
    #[error("listing the PersistentVolumes pending for this node: {0}")]
    ListPending(#[source] kube::Error),
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

/// Lists this node's pending PVs every `every` and answers each, until the process ends; a
/// failed round is logged and the next one tried.
pub async fn run(ublkd: Ublkd, node: Node, every: Duration) -> Result<(), LimitsError> {
    let client = Client::try_default().await.map_err(LimitsError::Connect)?;
    let api: Api<PersistentVolume> = Api::all(client);
    let pending = ListParams::default().labels(&format!("{PENDING}={}", node.0));
    loop {
        for e in round(&api, &ublkd, &pending).await {
            tracing::error!(error = %e, "applying the limits recorded on PersistentVolumes failed; trying again in {every:?}");
        }
        tokio::time::sleep(every).await;
    }
}

/// One look: every pending PV answered that can be; what failed, each PV on its own.
async fn round(
    api: &Api<PersistentVolume>,
    ublkd: &Ublkd,
    pending: &ListParams,
) -> Vec<LimitsError> {
    let list = match api.list(pending).await {
        Ok(l) => l,
        Err(e) => return vec![LimitsError::ListPending(e)],
    };
    let mut failed = Vec::new();
    for pv in &list.items {
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
                continue;
            }
        };
        let patch =
            serde_json::json!({"metadata": {"annotations": answers, "labels": {PENDING: null}}});
        if let Err(source) =
            (api.patch(&name, &PatchParams::default(), &Patch::Merge(&patch))).await
        {
            failed.push(LimitsError::Answer { pv: name, source });
        }
    }
    failed
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

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
