//! What the base (`deploy/kubernetes`) must hold once rendered, and that it keeps gRPC on the
//! unix socket.

use super::yaml::{find, objects};

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
pub(super) fn check(rendered: &str) -> Vec<String> {
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

/// The base alone keeps gRPC off the network: no listener setting (the default is the unix
/// socket), no host port, no TLS Secret, no NetworkPolicy.
pub(super) fn check_base_is_local(rendered: &str) -> Vec<String> {
    let objs = objects(rendered);
    let mut problems = Vec::new();
    if let Some(ds) = find(&objs, "DaemonSet", "ublkd") {
        for s in ["UBLKD_GRPC__", "hostPort:", "secretName:"] {
            if ds.text.contains(s) {
                problems.push(format!("the base DaemonSet ublkd has {s:?}"));
            }
        }
    }
    for o in objs.iter().filter(|o| o.kind == "NetworkPolicy") {
        problems.push(format!("the base has NetworkPolicy {}", o.name));
    }
    problems
}
