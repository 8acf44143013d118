//! What a lost node leaves to release, decided from the API's objects alone (no calls): the
//! driver's PersistentVolumes whose topology is the node, the claims bound to them, and the
//! claims still waiting for a volume that the scheduler sent to the node.

use crate::{DRIVER_NAME, TOPOLOGY_KEY};
use k8s_openapi::api::core::v1::{PersistentVolume, PersistentVolumeClaim};

/// The annotation the scheduler puts on a WaitForFirstConsumer claim: the node it chose.
pub const SELECTED_NODE: &str = "volume.kubernetes.io/selected-node";
/// The annotations that name a claim's provisioner (the beta one on older claims).
const STORAGE_PROVISIONER: [&str; 2] = [
    "volume.kubernetes.io/storage-provisioner",
    "volume.beta.kubernetes.io/storage-provisioner",
];
/// The finalizer external-provisioner puts on the PersistentVolumes it made, removed when it
/// has deleted the volume: the lost node's provisioner never will.
pub const PROVISIONER_FINALIZER: &str = "external-provisioner.volume.kubernetes.io/finalizer";

/// A claim to delete: its name and, so that a new claim of the same name is never touched,
/// its uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A PersistentVolume to delete, and whether its provisioner's finalizer must go first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub name: String,
    /// The ublkd volume it names on the lost node, which stays there (never deleted from here).
    pub handle: String,
    pub strip_provisioner_finalizer: bool,
}

/// Everything the lost node's volumes hold in the API.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Release {
    pub claims: Vec<Claim>,
    pub volumes: Vec<Volume>,
}

/// The nodes of `pv`'s topology (the values of its `ublkd.io/node` terms) when `pv` is the
/// driver's; empty for one of the driver's without topology.
pub fn topology_nodes(pv: &PersistentVolume) -> Option<Vec<&str>> {
    let spec = pv.spec.as_ref()?;
    if spec.csi.as_ref()?.driver != DRIVER_NAME {
        return None;
    }
    Some(
        spec.node_affinity
            .iter()
            .flat_map(|a| a.required.iter())
            .flat_map(|r| r.node_selector_terms.iter())
            .flat_map(|t| t.match_expressions.iter().flatten())
            .filter(|e| e.key == TOPOLOGY_KEY && e.operator == "In")
            .flat_map(|e| e.values.iter().flatten())
            .map(String::as_str)
            .collect(),
    )
}

/// The node in `pv`'s topology, when `pv` is the driver's. A volume lives on one node: a
/// topology naming several is not one of the driver's.
fn node_of(pv: &PersistentVolume) -> Option<&str> {
    match topology_nodes(pv)?.as_slice() {
        [one] => Some(*one),
        _ => None,
    }
}

/// The claim `claim` when it waits for the driver to provision it on `node`.
fn pending_on(claim: &PersistentVolumeClaim, node: &str) -> Option<Claim> {
    let annotations = claim.metadata.annotations.as_ref()?;
    let ours = STORAGE_PROVISIONER
        .iter()
        .any(|k| annotations.get(*k).map(String::as_str) == Some(DRIVER_NAME));
    let unbound = claim
        .spec
        .as_ref()
        .is_none_or(|s| s.volume_name.as_deref().unwrap_or("").is_empty());
    if !ours || !unbound || annotations.get(SELECTED_NODE).map(String::as_str) != Some(node) {
        return None;
    }
    Some(Claim {
        namespace: claim.metadata.namespace.clone()?,
        name: claim.metadata.name.clone()?,
        uid: claim.metadata.uid.clone()?,
    })
}

/// What to release for lost node `node`, given every PersistentVolume and claim.
pub fn release(node: &str, pvs: &[PersistentVolume], claims: &[PersistentVolumeClaim]) -> Release {
    let mut out = Release::default();
    for pv in pvs.iter().filter(|pv| node_of(pv) == Some(node)) {
        let (Some(name), Some(spec)) = (pv.metadata.name.clone(), pv.spec.as_ref()) else {
            continue;
        };
        if let Some(c) = spec.claim_ref.as_ref() {
            if let (Some(namespace), Some(name), Some(uid)) =
                (c.namespace.clone(), c.name.clone(), c.uid.clone())
            {
                out.claims.push(Claim {
                    namespace,
                    name,
                    uid,
                });
            }
        }
        out.volumes.push(Volume {
            name,
            handle: spec
                .csi
                .as_ref()
                .map(|c| c.volume_handle.clone())
                .unwrap_or_default(),
            strip_provisioner_finalizer: pv
                .metadata
                .finalizers
                .iter()
                .flatten()
                .any(|f| f == PROVISIONER_FINALIZER),
        });
    }
    out.claims
        .extend(claims.iter().filter_map(|c| pending_on(c, node)));
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pv(
        name: &str,
        driver: &str,
        nodes: &[&str],
        claim: Option<(&str, &str)>,
    ) -> PersistentVolume {
        serde_json::from_value(json!({
            "metadata": {"name": name, "finalizers": ["kubernetes.io/pv-protection", PROVISIONER_FINALIZER]},
            "spec": {
                "csi": {"driver": driver, "volumeHandle": format!("vol-{name}")},
                "claimRef": claim.map(|(ns, n)| json!({"namespace": ns, "name": n, "uid": format!("uid-{n}")})),
                "nodeAffinity": {"required": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": nodes}]}
                ]}}
            }
        }))
        .expect("a PersistentVolume")
    }

    fn pending(name: &str, provisioner: &str, node: &str, bound: bool) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "apps", "uid": format!("uid-{name}"),
                "annotations": {SELECTED_NODE: node, "volume.kubernetes.io/storage-provisioner": provisioner}},
            "spec": {"volumeName": if bound { "pv-x" } else { "" }}
        }))
        .expect("a PersistentVolumeClaim")
    }

    #[test]
    fn the_lost_nodes_volumes_and_their_claims_are_released() {
        let pvs = [
            pv("a", DRIVER_NAME, &["lost"], Some(("apps", "data-0"))),
            pv("b", DRIVER_NAME, &["kept"], Some(("apps", "data-1"))),
            pv("c", "other.csi.io", &["lost"], Some(("apps", "data-2"))),
            pv("d", DRIVER_NAME, &["lost"], None),
            pv(
                "e",
                DRIVER_NAME,
                &["lost", "kept"],
                Some(("apps", "data-3")),
            ),
        ];
        let r = release("lost", &pvs, &[]);
        assert_eq!(
            r.claims,
            vec![Claim {
                namespace: "apps".into(),
                name: "data-0".into(),
                uid: "uid-data-0".into()
            }]
        );
        let names: Vec<_> = r.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            ["a", "d"],
            "only the driver's, on the lost node alone"
        );
        assert!(r.volumes.iter().all(|v| v.strip_provisioner_finalizer));
        assert_eq!(r.volumes[0].handle, "vol-a");
    }

    #[test]
    fn claims_waiting_for_the_lost_node_are_released_and_no_others() {
        let claims = [
            pending("w-0", DRIVER_NAME, "lost", false),
            pending("w-1", DRIVER_NAME, "kept", false),
            pending("w-2", "other.csi.io", "lost", false),
            // bound: its PV decides, not the annotation
            pending("w-3", DRIVER_NAME, "lost", true),
        ];
        let r = release("lost", &[], &claims);
        let names: Vec<_> = r.claims.iter().map(|c| c.name.as_str()).collect();
        assert_eq!(names, ["w-0"]);
        assert!(r.volumes.is_empty());
    }

    #[test]
    fn a_volume_without_the_provisioners_finalizer_keeps_its_finalizers() {
        let mut p = pv("a", DRIVER_NAME, &["lost"], None);
        p.metadata.finalizers = Some(vec!["kubernetes.io/pv-protection".into()]);
        let r = release("lost", &[p], &[]);
        assert!(!r.volumes[0].strip_provisioner_finalizer);
    }
}
