//! What the renders must hold, one row a fact (read by `check`):
//! - `KIND NAME PATH = VALUE`: the object's value at PATH is VALUE (JSON, else a string)
//! - `KIND NAME PATH`: the object has PATH; `KIND NAME PATH absent`: it has not
//! - `KIND NAME`: the object is there; `KIND NAME absent`: it is not
//! - `KIND NAME lacks TEXT`: TEXT is nowhere in the object
//!
//! NAME `*` is every object of the kind (at least one). A PATH is keys and items separated by
//! `/` (`~1` is a `/` within a key): `[x]` is the items named x or equal to x, `*` every item,
//! a number that item; `pod` stands for `spec/template/spec`. `{version}` is the workspace's.

/// Every option's render: the driver, its file classes, the node plugin (a provisioner and a
/// snapshotter per node, refusing leader election, on the node's name), the resizer and the
/// controller (Pod Security "restricted"), ublkd (privileged, updated only by deleting its pod,
/// sharing no mount of its devices back), limits on the sidecars, the RBAC each account needs.
pub(super) const BASE: &[&str] = &[
    "CSIDriver ublkd.io spec/attachRequired = false",
    "CSIDriver ublkd.io spec/podInfoOnMount = false",
    "CSIDriver ublkd.io spec/storageCapacity = true",
    "CSIDriver ublkd.io spec/fsGroupPolicy = File",
    "StorageClass ublkd-file provisioner = ublkd.io",
    "StorageClass ublkd-file volumeBindingMode = WaitForFirstConsumer",
    "StorageClass ublkd-file allowVolumeExpansion = true",
    "StorageClass ublkd-file parameters/backend = file",
    "Deployment * pod/nodeSelector/kubernetes.io~1arch = amd64",
    "DaemonSet * pod/nodeSelector/kubernetes.io~1arch = amd64",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--http-endpoint=:9809]",
    "Service ublkd-csi-sidecars spec/ports/[metrics-resize]/targetPort = metrics-resize",
    "Deployment * pod/securityContext/runAsNonRoot = true",
    "Deployment * pod/securityContext/seccompProfile/type = RuntimeDefault",
    r#"Deployment ublkd-csi-resizer pod/containers/[csi-resizer]/securityContext/capabilities/drop = ["ALL"]"#,
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/resources/limits/memory = 256Mi",
    "DaemonSet ublkd-csi-node spec/updateStrategy/type = RollingUpdate",
    "DaemonSet ublkd-csi-node pod/serviceAccountName = ublkd-csi-node",
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/securityContext/privileged = true",
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/volumeMounts/[kubelet-dir]/mountPropagation = Bidirectional",
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/env/[NODE_NAME]/valueFrom/fieldRef/fieldPath = spec.nodeName",
    "DaemonSet ublkd-csi-node pod/volumes/[ublkd-run]/hostPath/path = /run/ublkd",
    "DaemonSet ublkd-csi-node pod/containers/[node-driver-registrar]/args/[--kubelet-registration-path=/var/lib/kubelet/plugins/ublkd.io/csi.sock]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--node-deployment]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--strict-topology]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--enable-capacity]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--capacity-ownerref-level=1]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/env/[NODE_NAME]/valueFrom/fieldRef/fieldPath = spec.nodeName",
    // It handles the snapshots the snapshot-controller labels with its node's name.
    "DaemonSet ublkd-csi-node pod/containers/[csi-snapshotter]/args/[--node-deployment]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-snapshotter]/args/[--csi-address=/csi/csi.sock]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-snapshotter]/env/[NODE_NAME]/valueFrom/fieldRef/fieldPath = spec.nodeName",
    "DaemonSet ublkd-csi-node pod/containers/[csi-snapshotter]/volumeMounts/[plugin-dir]/mountPath = /csi",
    "DaemonSet ublkd-csi-node lacks --leader-election",
    // Its faults as Events (ublkd_csi::faults), with the RBAC to post them and find the pods.
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/args/[--fault-events-every=10]",
    "DaemonSet ublkd-csi-node pod/containers/[csi-provisioner]/args/[--capacity-poll-interval=1m]",
    // cryptsetup's locks under a read-only root (encryption: luks2)
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/volumeMounts/[cryptsetup-run]/mountPath = /run/cryptsetup",
    "ClusterRoleBinding ublkd-csi-faults subjects/[ublkd-csi-node]",
    "ClusterRole ublkd-csi-faults rules/*/apiGroups/[events.k8s.io]",
    "ClusterRole ublkd-csi-faults rules/*/resources/[pods]",
    // the viewer reads logs in ublkd's namespace only
    "ClusterRole ublkd-viewer lacks pods/log",
    "Role ublkd-viewer-logs rules/*/resources/[pods/log]",
    // each node plugin writes its own node's UblkdNode only (RBAC cannot say which)
    r#"ValidatingAdmissionPolicyBinding ublkd-node-writes-its-own-report spec/validationActions = ["Deny"]"#,
    "ValidatingAdmissionPolicy ublkd-node-writes-its-own-report spec/matchConditions/*/expression",
    "Deployment ublkd-csi-resizer pod/containers/[ublkd-csi]/args/[--resizer-only]",
    "Deployment ublkd-csi-resizer pod/containers/[csi-resizer]/args/[--leader-election]",
    "Deployment ublkd-csi-resizer pod/serviceAccountName = ublkd-csi-resizer",
    "Deployment ublkd-csi-resizer lacks privileged",
    "DaemonSet ublkd spec/updateStrategy/type = OnDelete",
    "DaemonSet ublkd pod/containers/[ublkd]/securityContext/privileged = true",
    "DaemonSet ublkd lacks Bidirectional",
    // A ublkd without a usable ublk_drv is not Ready (ublkctl exits 4).
    "DaemonSet ublkd pod/containers/[ublkd]/readinessProbe/exec/command/[--ready]",
    "ServiceAccount ublkd-csi-node",
    "ServiceAccount ublkd-csi-resizer",
    "ClusterRoleBinding ublkd-csi-provisioner subjects/[ublkd-csi-node]",
    "ClusterRole ublkd-csi-provisioner rules/*/resources/[csistoragecapacities]",
    "ClusterRole ublkd-csi-provisioner rules/*/resources/[persistentvolumes]",
    // Restores read the VolumeSnapshot and its content.
    "ClusterRole ublkd-csi-provisioner rules/*/resources/[volumesnapshots]",
    // Its pod's owner, for capacity objects, is read in its own namespace only.
    "Role ublkd-csi-provisioner-owner rules/*/resources/[daemonsets]",
    "Role ublkd-csi-provisioner-owner metadata/namespace = ublkd-system",
    "RoleBinding ublkd-csi-provisioner-owner subjects/[ublkd-csi-node]",
    "RoleBinding ublkd-csi-provisioner-owner roleRef/kind = Role",
    "ClusterRoleBinding ublkd-csi-snapshotter subjects/[ublkd-csi-node]",
    "ClusterRoleBinding ublkd-csi-snapshotter roleRef/name = ublkd-csi-snapshotter",
    "ClusterRole ublkd-csi-snapshotter rules/*/resources/[volumesnapshotclasses]",
    "ClusterRole ublkd-csi-snapshotter rules/*/resources/[volumesnapshotcontents]",
    "ClusterRole ublkd-csi-snapshotter rules/*/resources/[volumesnapshotcontents/status]",
    "ClusterRoleBinding ublkd-csi-resizer subjects/[ublkd-csi-resizer]",
    "ClusterRole ublkd-csi-resizer rules/*/resources/[persistentvolumeclaims/status]",
];

/// The defaults alone: gRPC on the unix socket only (no listener setting, host port, TLS Secret,
/// NetworkPolicy; a resizer that reaches no node), no Prometheus Operator objects, no RAM or
/// NVMe class (opt-in); the uninstall hook takes the controller's finalizer off the nodes before
/// Helm deletes anything; the chart's version and appVersion (the image tag) are the workspace's.
pub(super) const DEFAULTS: &[&str] = &[
    "StorageClass ublkd-ram absent",
    "StorageClass ublkd-nvme absent",
    "DaemonSet ublkd lacks UBLKD_GRPC__",
    "DaemonSet ublkd lacks hostPort",
    "DaemonSet ublkd lacks secretName",
    "NetworkPolicy * absent",
    "Deployment ublkd-csi-resizer lacks UBLKD_REMOTE",
    "ServiceMonitor * absent",
    "PrometheusRule * absent",
    "Job ublkd-csi-uninstall metadata/annotations/helm.sh~1hook = pre-delete",
    r#"Job ublkd-csi-uninstall pod/containers/*/args = ["node-loss","uninstall"]"#,
    "Job ublkd-csi-uninstall pod/serviceAccountName = ublkd-csi-controller",
    "DaemonSet ublkd metadata/labels/helm.sh~1chart = ublkd-{version}",
    "DaemonSet ublkd pod/containers/[ublkd]/image = ghcr.io/example/ublkd:{version}",
];

/// Remote access: ublkd listens on its socket (the CSI driver's and the probe's) and on TCP
/// 7443, with mutual TLS from the Secret ublkd-grpc-tls mounted whole and read-only (a subPath
/// never sees a renewal), that port on every node's address, a headless Service for it, and a
/// NetworkPolicy on the ublkd pods (its rules: `check::grpc_ingress`).
pub(super) const REMOTE: &[&str] = &[
    "DaemonSet ublkd pod/containers/[ublkd]/env/[UBLKD_GRPC__LISTEN]/value = unix:///run/ublkd/ublkd.sock,0.0.0.0:7443",
    "DaemonSet ublkd pod/containers/[ublkd]/volumeMounts/[grpc-tls]/mountPath = /etc/ublkd-tls",
    "DaemonSet ublkd pod/containers/[ublkd]/volumeMounts/[grpc-tls]/readOnly = true",
    "DaemonSet ublkd pod/containers/[ublkd]/volumeMounts/[grpc-tls]/subPath absent",
    "DaemonSet ublkd pod/containers/[ublkd]/env/[UBLKD_GRPC__TLS__CERT]/value = /etc/ublkd-tls/tls.crt",
    "DaemonSet ublkd pod/containers/[ublkd]/env/[UBLKD_GRPC__TLS__KEY]/value = /etc/ublkd-tls/tls.key",
    "DaemonSet ublkd pod/containers/[ublkd]/env/[UBLKD_GRPC__TLS__CLIENT_CA]/value = /etc/ublkd-tls/ca.crt",
    "DaemonSet ublkd pod/volumes/[grpc-tls]/secret/secretName = ublkd-grpc-tls",
    "DaemonSet ublkd pod/containers/[ublkd]/ports/[grpc]/containerPort = 7443",
    "DaemonSet ublkd pod/containers/[ublkd]/ports/[grpc]/hostPort = 7443",
    "DaemonSet ublkd spec/template/metadata/labels/app.kubernetes.io~1name = ublkd",
    "Service ublkd-grpc spec/clusterIP = None",
    "Service ublkd-grpc spec/ports/[grpc]/targetPort = grpc",
    r#"NetworkPolicy ublkd-grpc spec/podSelector = {"matchLabels":{"app.kubernetes.io/name":"ublkd"}}"#,
    "NetworkPolicy ublkd-grpc spec/policyTypes/[Ingress]",
];

/// cert-manager: a Certificate that writes the Secret remote access mounts, for the name
/// clients check, usable by a TLS server.
pub(super) const CERT_MANAGER: &[&str] = &[
    "Certificate ublkd-grpc spec/secretName = ublkd-grpc-tls",
    "Certificate ublkd-grpc spec/dnsNames/[ublkd-grpc.ublkd-system.svc]",
    "Certificate ublkd-grpc spec/usages/[server auth]",
    "Certificate ublkd-grpc spec/issuerRef/name",
];

/// Snapshots: a VolumeSnapshotClass for the driver (its per-node snapshotter is the base's).
pub(super) const SNAPSHOTS: &[&str] = &[
    "VolumeSnapshotClass * driver = ublkd.io",
    "VolumeSnapshotClass * deletionPolicy",
];

/// ModifyVolume: no way into the nodes (no client certificate, no remote-access Service or
/// NetworkPolicy for the resizer); the node plugin looks for the limits recorded on its PVs;
/// the resizer's VolumeAttributesClass gate is on (its version and the classes' keys:
/// `check::modify_volume`).
pub(super) const MODIFY: &[&str] = &[
    "Deployment ublkd-csi-resizer pod/containers/[ublkd-csi]/env absent",
    "Deployment ublkd-csi-resizer lacks ublkd-csi-tls",
    "Service ublkd-grpc absent",
    "NetworkPolicy ublkd-grpc-csi-resizer absent",
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/args/[--apply-limits-every=2]",
    "Deployment ublkd-csi-resizer pod/containers/[csi-resizer]/args/[--feature-gates=VolumeAttributesClass=true]",
    "Deployment ublkd-csi-resizer spec/template/metadata/labels/app.kubernetes.io~1name = ublkd-csi-resizer",
    "VolumeAttributesClass * driverName = ublkd.io",
];

/// Another kubelet directory: every path of the node plugin under it, none left at the default.
pub(super) const KUBELET_DIR: &[&str] = &[
    "DaemonSet ublkd-csi-node lacks /var/lib/kubelet",
    "DaemonSet ublkd-csi-node pod/containers/[ublkd-csi]/args/[--kubelet-dir=/var/lib/k0s/kubelet]",
    "DaemonSet ublkd-csi-node pod/containers/[node-driver-registrar]/args/[--kubelet-registration-path=/var/lib/k0s/kubelet/plugins/ublkd.io/csi.sock]",
    "DaemonSet ublkd-csi-node pod/volumes/[registration-dir]/hostPath/path = /var/lib/k0s/kubelet/plugins_registry",
];

/// Monitoring: ServiceMonitors on ublkd's and the sidecars' metrics ports that name each
/// series' node, labelled for the user's Prometheus; a PrometheusRule with the rules file whole
/// (`check::alerts`); the dashboard for Grafana's sidecar.
pub(super) const MONITORING: &[&str] = &[
    "ServiceMonitor ublkd spec/endpoints/*/port = metrics",
    "ServiceMonitor ublkd-csi-sidecars spec/endpoints/*/port = metrics-resize",
    "ServiceMonitor ublkd-csi-sidecars spec/endpoints/*/relabelings/*/targetLabel = node",
    r#"ConfigMap ublkd-dashboard metadata/labels/grafana_dashboard = "1""#,
    "ServiceMonitor ublkd spec/endpoints/*/relabelings/*/replacement = ublkd",
    "ServiceMonitor ublkd spec/endpoints/*/relabelings/*/targetLabel = node",
    "ServiceMonitor ublkd metadata/labels/release = prometheus",
];

/// A class of the user's own, made the default.
pub(super) const CLASSES: &[&str] = &[
    r#"StorageClass fast metadata/annotations/storageclass.kubernetes.io~1is-default-class = "true""#,
    r#"StorageClass fast parameters/queues = "4""#,
    "StorageClass fast parameters/backend = ram",
];

/// A platform team's values: `global` accepted (a subchart's parent passes it), their labels
/// on every object, pod labels, annotations, affinity and priority on every pod, no node-loss
/// controller, a class with its mount options and annotations.
pub(super) const PLATFORM: &[&str] = &[
    "DaemonSet * metadata/labels/team = storage",
    "Deployment * metadata/labels/team = storage",
    "DaemonSet * metadata/labels/app.kubernetes.io~1instance = ublkd",
    "DaemonSet * spec/template/metadata/labels/team = storage",
    "Deployment * spec/template/metadata/labels/team = storage",
    "DaemonSet * spec/template/metadata/annotations/owner = oncall",
    "Deployment * spec/template/metadata/annotations/owner = oncall",
    "DaemonSet * pod/priorityClassName = ublkd-critical",
    "DaemonSet * pod/affinity/nodeAffinity/requiredDuringSchedulingIgnoredDuringExecution/nodeSelectorTerms/0/matchExpressions/0/key = storage",
    "Deployment ublkd-csi-controller absent",
    r#"StorageClass fast mountOptions = ["noatime"]"#,
    "StorageClass fast metadata/annotations/team = storage",
];

/// What `kubectl apply -k deploy/kubernetes` installs: the Namespace too (a release lives in one
/// made before it), where Pod Security Admission must allow privileged pods.
pub(super) const KUSTOMIZE: &[&str] =
    &["Namespace ublkd-system metadata/labels/pod-security.kubernetes.io~1enforce = privileged"];

/// What a row cannot say, proven able to fail on the render it names: `RENDER | KIND NAME PATH
/// | VALUE (JSON, else a string; `-` removes) | what the problem must say`.
pub(super) const MUTATIONS: &[&str] = &[
    "remote access | NetworkPolicy ublkd-grpc spec/ingress/0/from | - | admits the gRPC port from anywhere",
    "remote access | NetworkPolicy ublkd-grpc spec/ingress/0/ports/0/port | metrics | admits no one to the gRPC port",
    r#"remote access | NetworkPolicy ublkd-grpc spec/ingress/1/from | [{"ipBlock":{"cidr":"10.0.0.0/8"}}] | the metrics port"#,
    "ModifyVolume | Deployment ublkd-csi-resizer pod/containers/[csi-resizer]/image | registry.k8s.io/sig-storage/csi-resizer:v1.13.2 | older than v2",
    "ModifyVolume | VolumeAttributesClass ublkd-limited parameters/readIOPS | 5000 | \"readIOPS\", which ublkd-csi refuses",
    "monitoring | PrometheusRule ublkd spec/groups/0/rules/0 | - | alerts, files/ublkd-rules.yaml",
];
