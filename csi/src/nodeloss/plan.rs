//! What a lost node leaves to release, decided from the API's objects alone (no calls), and in
//! which order:
//!
//! - the driver's PersistentVolumes whose topology is the node alone and whose reclaim policy
//!   is Delete: each is first set to Retain, marked [`RELEASED_FROM`] and stripped of the
//!   provisioner's finalizer, all of them before any claim is touched. A released PV with
//!   policy Delete is what a provisioner deletes the volume of (the node's own, run with
//!   `--node-deployment`, when the node is alive after all); Retain makes it never do so.
//! - the claims bound to them (by uid: a new claim of the same name is never touched) are
//!   deleted, so that a StatefulSet makes them again elsewhere;
//! - the claims still waiting for a volume that the scheduler sent to the node (no PV, no
//!   data) are not deleted: the scheduler's choice (`volume.kubernetes.io/selected-node`) is
//!   taken off, as the provisioner does when it gives up on a node, so that the scheduler
//!   picks another;
//! - then the PersistentVolumes are deleted. Their ublkd volumes stay on the node.
//!
//! Left alone: PersistentVolumes that were Retain already (the user's choice, not the
//! driver's: neither they nor their claims are touched), those of other drivers or of several
//! nodes, and claims of other provisioners or bound elsewhere.

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
/// The annotation the controller puts on a PersistentVolume it set to Retain to release it:
/// the lost node's name. A release interrupted after that step finds the PV again by it.
pub const RELEASED_FROM: &str = "ublkd.io/released-from-node";

/// A claim: its name and, so that a new claim of the same name is never touched, its uid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    pub namespace: String,
    pub name: String,
    pub uid: String,
}

/// A PersistentVolume to retain, then delete.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Volume {
    pub name: String,
    /// The ublkd volume it names on the lost node, which stays there (never deleted from here).
    pub handle: String,
}

/// Everything the lost node's volumes hold in the API.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Release {
    /// The driver's PersistentVolumes of the node with policy Delete (or retained by an
    /// earlier, interrupted release).
    pub volumes: Vec<Volume>,
    /// The claims bound to `volumes`.
    pub claims: Vec<Claim>,
    /// The claims the scheduler sent to the node that wait for a volume.
    pub unselect: Vec<Claim>,
    /// The driver's PersistentVolumes of the node left alone: Retain was the user's choice.
    pub kept: Vec<String>,
}

/// One call of a release, in [`Release::steps`]' order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step<'a> {
    /// Policy Retain, the mark [`RELEASED_FROM`], the provisioner's finalizer removed.
    Retain(&'a Volume),
    /// Delete the claim, by uid.
    DeleteClaim(&'a Claim),
    /// Take the scheduler's choice of node off the claim, by uid.
    Unselect(&'a Claim),
    /// Delete the PersistentVolume.
    DeleteVolume(&'a Volume),
}

impl Release {
    /// The calls, in order: every volume retained before any claim is touched, the volumes
    /// deleted last.
    pub fn steps(&self) -> Vec<Step<'_>> {
        let retain = self.volumes.iter().map(Step::Retain);
        let claims = self.claims.iter().map(Step::DeleteClaim);
        let unselect = self.unselect.iter().map(Step::Unselect);
        let delete = self.volumes.iter().map(Step::DeleteVolume);
        retain.chain(claims).chain(unselect).chain(delete).collect()
    }

    /// What the release does, in words (an Event's note: short, the names of the first few).
    pub fn summary(&self) -> String {
        fn names<'a>(it: impl Iterator<Item = String> + 'a) -> String {
            let all: Vec<String> = it.collect();
            let shown = all.iter().take(5).cloned().collect::<Vec<_>>().join(", ");
            match all.len() {
                0 => "none".to_owned(),
                n if n > 5 => format!("{shown} and {} more", n - 5),
                _ => shown,
            }
        }
        let claim = |c: &Claim| format!("{}/{}", c.namespace, c.name);
        format!(
            "PersistentVolumes retained and deleted (their ublkd volumes stay on the node): {}; \
             claims deleted: {}; claims sent back to the scheduler: {}; Retain PersistentVolumes \
             left alone: {}",
            names(self.volumes.iter().map(|v| v.name.clone())),
            names(self.claims.iter().map(claim)),
            names(self.unselect.iter().map(claim)),
            names(self.kept.iter().cloned()),
        )
    }
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

/// Whether the release of `node` may take `pv`: its policy is Delete, or an earlier release
/// of the same node set it to Retain.
fn releasable(pv: &PersistentVolume, node: &str) -> bool {
    let policy = pv
        .spec
        .as_ref()
        .and_then(|s| s.persistent_volume_reclaim_policy.as_deref());
    let ours = pv
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(RELEASED_FROM))
        .is_some_and(|n| n == node);
    policy == Some("Delete") || ours
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
        if !releasable(pv, node) {
            out.kept.push(name);
            continue;
        }
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
        });
    }
    out.unselect
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
                "persistentVolumeReclaimPolicy": "Delete",
                "csi": {"driver": driver, "volumeHandle": format!("vol-{name}")},
                "claimRef": claim.map(|(ns, n)| json!({"namespace": ns, "name": n, "uid": format!("uid-{n}")})),
                "nodeAffinity": {"required": {"nodeSelectorTerms": [
                    {"matchExpressions": [{"key": TOPOLOGY_KEY, "operator": "In", "values": nodes}]}
                ]}}
            }
        }))
        .expect("a PersistentVolume")
    }

    fn retain(mut p: PersistentVolume) -> PersistentVolume {
        if let Some(s) = p.spec.as_mut() {
            s.persistent_volume_reclaim_policy = Some("Retain".into());
        }
        p
    }

    fn pending(name: &str, provisioner: &str, node: &str, bound: bool) -> PersistentVolumeClaim {
        serde_json::from_value(json!({
            "metadata": {"name": name, "namespace": "apps", "uid": format!("uid-{name}"),
                "annotations": {SELECTED_NODE: node, "volume.kubernetes.io/storage-provisioner": provisioner}},
            "spec": {"volumeName": if bound { "pv-x" } else { "" }}
        }))
        .expect("a PersistentVolumeClaim")
    }

    fn claim(name: &str) -> Claim {
        Claim {
            namespace: "apps".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
        }
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
        assert_eq!(r.claims, vec![claim("data-0")]);
        let names: Vec<_> = r.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(
            names,
            ["a", "d"],
            "only the driver's, on the lost node alone"
        );
        assert_eq!(r.volumes[0].handle, "vol-a");
        assert!(r.kept.is_empty());
    }

    #[test]
    fn retain_volumes_and_their_claims_are_left_alone() {
        let pvs = [
            retain(pv("a", DRIVER_NAME, &["lost"], Some(("apps", "data-0")))),
            pv("b", DRIVER_NAME, &["lost"], Some(("apps", "data-1"))),
        ];
        let r = release("lost", &pvs, &[]);
        assert_eq!(r.kept, ["a"]);
        assert_eq!(r.claims, vec![claim("data-1")]);
        let names: Vec<_> = r.volumes.iter().map(|v| v.name.as_str()).collect();
        assert_eq!(names, ["b"]);
    }

    #[test]
    fn a_volume_retained_by_an_interrupted_release_is_released_again() {
        let mut p = retain(pv("a", DRIVER_NAME, &["lost"], Some(("apps", "data-0"))));
        p.metadata.annotations = Some([(RELEASED_FROM.to_owned(), "lost".to_owned())].into());
        let mut other = retain(pv("b", DRIVER_NAME, &["lost"], None));
        other.metadata.annotations =
            Some([(RELEASED_FROM.to_owned(), "elsewhere".to_owned())].into());
        let r = release("lost", &[p, other], &[]);
        assert_eq!(r.volumes.len(), 1);
        assert_eq!(r.volumes[0].name, "a");
        assert_eq!(r.claims, vec![claim("data-0")]);
        assert_eq!(r.kept, ["b"], "the mark of another node is no mark");
    }

    #[test]
    fn claims_waiting_for_the_lost_node_are_sent_back_and_none_deleted() {
        let claims = [
            pending("w-0", DRIVER_NAME, "lost", false),
            pending("w-1", DRIVER_NAME, "kept", false),
            pending("w-2", "other.csi.io", "lost", false),
            // bound: its PV decides, not the annotation
            pending("w-3", DRIVER_NAME, "lost", true),
        ];
        let r = release("lost", &[], &claims);
        assert_eq!(r.unselect, vec![claim("w-0")]);
        assert!(r.claims.is_empty());
        assert!(r.volumes.is_empty());
    }

    #[test]
    fn every_volume_is_retained_before_any_claim_is_touched() {
        let pvs = [
            pv("a", DRIVER_NAME, &["lost"], Some(("apps", "data-0"))),
            pv("b", DRIVER_NAME, &["lost"], Some(("apps", "data-1"))),
        ];
        let claims = [pending("w-0", DRIVER_NAME, "lost", false)];
        let r = release("lost", &pvs, &claims);
        let steps: Vec<String> = r
            .steps()
            .iter()
            .map(|s| match s {
                Step::Retain(v) => format!("retain {}", v.name),
                Step::DeleteClaim(c) => format!("delete claim {}", c.name),
                Step::Unselect(c) => format!("unselect {}", c.name),
                Step::DeleteVolume(v) => format!("delete pv {}", v.name),
            })
            .collect();
        assert_eq!(
            steps,
            [
                "retain a",
                "retain b",
                "delete claim data-0",
                "delete claim data-1",
                "unselect w-0",
                "delete pv a",
                "delete pv b",
            ]
        );
        let s = r.summary();
        assert!(
            s.contains("retained and deleted") && s.contains("a, b"),
            "{s}"
        );
        assert!(
            s.contains("claims deleted: apps/data-0, apps/data-1"),
            "{s}"
        );
        assert!(s.contains("left alone: none"), "{s}");
    }
}
