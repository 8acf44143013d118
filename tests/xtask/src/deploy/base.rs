//! What the base (`deploy/kubernetes`) must hold once rendered, and that it keeps gRPC on the
//! unix socket.

use super::yaml::{find, items, named, objects, value, Object};

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
        &[
            "csistoragecapacities",
            "persistentvolumes",
            // Restores read the VolumeSnapshot and its content.
            "volumesnapshots",
        ],
    ),
    (
        "ClusterRole",
        "ublkd-csi-snapshotter",
        &[
            "volumesnapshotclasses",
            "volumesnapshotcontents",
            "volumesnapshotcontents/status",
        ],
    ),
    (
        "ClusterRoleBinding",
        "ublkd-csi-snapshotter",
        &["name: ublkd-csi-node", "name: ublkd-csi-snapshotter"],
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
    // Its pod's owner, for capacity objects, is read in its own namespace only.
    (
        "Role",
        "ublkd-csi-provisioner-owner",
        &["daemonsets", "namespace: ublkd-system"],
    ),
    (
        "RoleBinding",
        "ublkd-csi-provisioner-owner",
        &["name: ublkd-csi-node", "kind: Role"],
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
    problems.extend(check_snapshotter(&objs));
    problems
}

/// The arguments of a container (its own `args:` items).
pub(super) fn args(container: &[String]) -> Vec<String> {
    items(&container.join("\n"), "args")
        .iter()
        .map(|i| i[0].trim().trim_matches('"').to_owned())
        .collect()
}

/// The node plugin's csi-snapshotter: one per node (`--node-deployment`, which refuses leader
/// election) that knows its node (NODE_NAME from the downward API: it handles the snapshots the
/// snapshot-controller labels with that name), on the driver's socket.
pub(super) fn check_snapshotter(objs: &[Object]) -> Vec<String> {
    let Some(ds) = find(objs, "DaemonSet", "ublkd-csi-node") else {
        return Vec::new(); // reported as missing above
    };
    let containers = items(&ds.text, "containers");
    let Some(snap) = named(&containers, "csi-snapshotter") else {
        return vec!["DaemonSet ublkd-csi-node has no container csi-snapshotter".into()];
    };
    let mut problems = Vec::new();
    let args = args(snap);
    if !args.iter().any(|a| a == "--node-deployment") {
        problems.push(format!(
            "csi-snapshotter runs without --node-deployment: {args:?}"
        ));
    }
    if args.iter().any(|a| a.starts_with("--leader-election")) {
        problems.push(
            "csi-snapshotter asks for leader election, which --node-deployment refuses".into(),
        );
    }
    if !args.iter().any(|a| a == "--csi-address=/csi/csi.sock") {
        problems.push(format!(
            "csi-snapshotter does not use the driver's socket: {args:?}"
        ));
    }
    let env = items(&snap.join("\n"), "env");
    let node_name = named(&env, "NODE_NAME").map(|e| e.join("\n"));
    if !node_name.is_some_and(|e| e.contains("fieldPath: spec.nodeName")) {
        problems.push("csi-snapshotter has no NODE_NAME from spec.nodeName".into());
    }
    let mounts = items(&snap.join("\n"), "volumeMounts");
    if named(&mounts, "plugin-dir").and_then(|m| value(m, "mountPath")) != Some("/csi") {
        problems.push("csi-snapshotter does not mount plugin-dir at /csi".into());
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
    if find(&objs, "Deployment", "ublkd-csi-resizer")
        .is_some_and(|d| d.text.contains("UBLKD_REMOTE"))
    {
        problems.push(
            "the base resizer reaches the nodes' ublkd (that is components/csi-modify-volume's)"
                .into(),
        );
    }
    problems
}
