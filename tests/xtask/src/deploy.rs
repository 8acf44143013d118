//! The Kubernetes manifests, rendered as an operator would (`kubectl kustomize
//! deploy/kubernetes`) and checked so they cannot rot: every object is there, the sidecars get
//! the arguments distributed provisioning needs, the driver's mounts propagate, and only the
//! containers that must be privileged are.

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// One rendered object: its kind, its name, and its text.
#[derive(Debug)]
struct Object {
    kind: String,
    name: String,
    text: String,
}

/// The top-level `kind:` and `metadata.name` of each document of kustomize's output (which
/// writes every document in the same block style, keys sorted, two-space indents).
fn objects(rendered: &str) -> Vec<Object> {
    rendered
        .split("\n---\n")
        .filter_map(|doc| {
            let kind = doc
                .lines()
                .find_map(|l| l.strip_prefix("kind: "))?
                .trim()
                .to_owned();
            let mut in_meta = false;
            let name = doc.lines().find_map(|l| {
                if l == "metadata:" {
                    in_meta = true;
                    return None;
                }
                if in_meta && !l.starts_with(' ') {
                    in_meta = false;
                }
                if in_meta {
                    l.strip_prefix("  name: ").map(|n| n.trim().to_owned())
                } else {
                    None
                }
            })?;
            Some(Object {
                kind,
                name,
                text: doc.to_owned(),
            })
        })
        .collect()
}

/// What the rendered manifests must hold, as (kind, name, snippets that must appear).
const EXPECTED: &[(&str, &str, &[&str])] = &[
    (
        "CSIDriver",
        "ublkd.io",
        &[
            "attachRequired: false",
            "podInfoOnMount: false",
            "storageCapacity: true",
            "fsGroupPolicy: File",
        ],
    ),
    (
        "StorageClass",
        "ublkd-file",
        &[
            "provisioner: ublkd.io",
            "volumeBindingMode: WaitForFirstConsumer",
            "allowVolumeExpansion: true",
            "backend: file",
        ],
    ),
    (
        "StorageClass",
        "ublkd-ram",
        &["volumeBindingMode: WaitForFirstConsumer", "backend: ram"],
    ),
    (
        "StorageClass",
        "ublkd-nvme",
        &["volumeBindingMode: WaitForFirstConsumer", "backend: nvme"],
    ),
    (
        "DaemonSet",
        "ublkd-csi-node",
        &[
            "type: RollingUpdate",
            "--node-deployment",
            "--strict-topology",
            "--enable-capacity",
            "--capacity-ownerref-level=1",
            "--kubelet-registration-path=/var/lib/kubelet/plugins/ublkd.io/csi.sock",
            "mountPropagation: Bidirectional",
            "fieldPath: spec.nodeName",
            "serviceAccountName: ublkd-csi-node",
            "path: /run/ublkd",
            "privileged: true",
        ],
    ),
    (
        "Deployment",
        "ublkd-csi-resizer",
        &[
            "--resizer-only",
            "--leader-election",
            "serviceAccountName: ublkd-csi-resizer",
        ],
    ),
    (
        "DaemonSet",
        "ublkd",
        &["type: OnDelete", "privileged: true"],
    ),
    (
        "ClusterRole",
        "ublkd-csi-provisioner",
        &["csistoragecapacities", "persistentvolumes"],
    ),
    (
        "ClusterRole",
        "ublkd-csi-resizer",
        &["persistentvolumeclaims/status"],
    ),
    (
        "ClusterRoleBinding",
        "ublkd-csi-provisioner",
        &["name: ublkd-csi-node"],
    ),
    (
        "ClusterRoleBinding",
        "ublkd-csi-resizer",
        &["name: ublkd-csi-resizer"],
    ),
    ("ServiceAccount", "ublkd-csi-node", &[]),
    ("ServiceAccount", "ublkd-csi-resizer", &[]),
    (
        "Namespace",
        "ublkd-system",
        &["pod-security.kubernetes.io/enforce: privileged"],
    ),
];

/// Checks rendered manifests; every problem, not just the first.
fn check(rendered: &str) -> Vec<String> {
    let objs = objects(rendered);
    let mut problems = Vec::new();
    for (kind, name, snippets) in EXPECTED {
        let Some(o) = objs.iter().find(|o| o.kind == *kind && o.name == *name) else {
            problems.push(format!("{kind} {name} is missing"));
            continue;
        };
        for s in *snippets {
            if !o.text.contains(s) {
                problems.push(format!("{kind} {name} lacks {s:?}"));
            }
        }
    }
    // The resizer never needs privileges; the mounting driver's Bidirectional propagation is
    // the only one (ublkd's own pod must not share its devices' mounts).
    for o in &objs {
        if o.name == "ublkd-csi-resizer"
            && o.kind == "Deployment"
            && o.text.contains("privileged: true")
        {
            problems.push("the resizer Deployment is privileged".into());
        }
        if o.name == "ublkd"
            && o.kind == "DaemonSet"
            && o.text.contains("mountPropagation: Bidirectional")
        {
            problems.push("ublkd's DaemonSet has Bidirectional mount propagation".into());
        }
    }
    problems
}

/// Renders `deploy/kubernetes` with `kubectl kustomize` and checks it; kubectl is installed
/// when missing (Debian's kubernetes-client), never skipped.
pub fn manifest_checks(ws: &Path) -> Result<()> {
    if crate::apt::which("kubectl").is_none() {
        crate::apt::install_packages(&["kubernetes-client"])?;
    }
    let kubectl = crate::apt::which("kubectl").context("kubectl not found after installing it")?;
    eprintln!("xtask: manifests: kubectl kustomize deploy/kubernetes");
    let out = Command::new(kubectl)
        .args(["kustomize", "deploy/kubernetes"])
        .current_dir(ws)
        .output()
        .context("running kubectl kustomize")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize deploy/kubernetes failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let problems = check(&String::from_utf8_lossy(&out.stdout));
    if !problems.is_empty() {
        bail!(
            "deploy/kubernetes renders wrong:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn objects_are_found_by_kind_and_name_and_missing_ones_reported() {
        let doc = "apiVersion: v1\nkind: ServiceAccount\nmetadata:\n  labels:\n    name: x\n  name: ublkd-csi-node\n  namespace: ublkd-system\n---\napiVersion: v1\nkind: Namespace\nmetadata:\n  name: ublkd-system\n";
        let o = objects(doc);
        assert_eq!(o.len(), 2);
        assert_eq!(
            (o[0].kind.as_str(), o[0].name.as_str()),
            ("ServiceAccount", "ublkd-csi-node")
        );
        let problems = check(doc);
        assert!(
            problems
                .iter()
                .any(|p| p == "CSIDriver ublkd.io is missing"),
            "{problems:?}"
        );
        assert!(
            problems
                .iter()
                .any(|p| p.starts_with("Namespace ublkd-system lacks")),
            "{problems:?}"
        );
    }
}
