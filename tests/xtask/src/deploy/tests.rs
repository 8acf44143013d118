//! Host tests of the manifest checks, on renders written as kustomize writes them.

use super::base::{check, check_base_is_local, check_snapshotter};
use super::components::{check_csi_modify_volume, check_csi_snapshots, check_remote_access};
use super::yaml::{items, leaves, named, objects, value};

/// For each `(from, to, words)`: the fixture holds `from`, and with it replaced by `to` the
/// check reports a problem containing `words`.
fn each_mutation_is_caught(
    fixture: &str,
    cases: &[(&str, &str, &str)],
    check: impl Fn(&str) -> Vec<String>,
) {
    for &(from, to, words) in cases {
        assert!(fixture.contains(from), "fixture has {from:?}");
        let problems = check(&fixture.replacen(from, to, 1));
        assert!(
            problems.iter().any(|p| p.contains(words)),
            "{from:?} -> {to:?}: {problems:?}"
        );
    }
}

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

/// The parts of the remote-access overlay's render that its check reads, as kustomize
/// writes them.
const REMOTE: &str = "apiVersion: v1
kind: Service
metadata:
  name: ublkd-grpc
  namespace: ublkd-system
spec:
  clusterIP: None
  ports:
  - name: grpc
    port: 7443
    protocol: TCP
    targetPort: grpc
  selector:
    app.kubernetes.io/name: ublkd
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ublkd
  namespace: ublkd-system
spec:
  selector:
    matchLabels:
      app.kubernetes.io/name: ublkd
  template:
    metadata:
      labels:
        app.kubernetes.io/name: ublkd
        app.kubernetes.io/part-of: ublkd
    spec:
      containers:
      - command:
        - /bin/sh
        env:
        - name: UBLKD_GRPC__LISTEN
          value: unix:///run/ublkd/ublkd.sock,0.0.0.0:7443
        - name: UBLKD_GRPC__TLS__CERT
          value: /etc/ublkd-tls/tls.crt
        - name: UBLKD_GRPC__TLS__KEY
          value: /etc/ublkd-tls/tls.key
        - name: UBLKD_GRPC__TLS__CLIENT_CA
          value: /etc/ublkd-tls/ca.crt
        - name: UBLKD_METRICS__NODE
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        name: ublkd
        ports:
        - containerPort: 7443
          hostPort: 7443
          name: grpc
          protocol: TCP
        - containerPort: 9580
          name: metrics
          protocol: TCP
        volumeMounts:
        - mountPath: /etc/ublkd-tls
          name: grpc-tls
          readOnly: true
        - mountPath: /etc/ublkd
          name: config
          readOnly: true
      volumes:
      - name: grpc-tls
        secret:
          defaultMode: 256
          secretName: ublkd-grpc-tls
      - configMap:
          name: ublkd-config
        name: config
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  name: ublkd-grpc
  namespace: ublkd-system
spec:
  ingress:
  - from:
    - ipBlock:
        cidr: 192.0.2.0/24
    - namespaceSelector:
        matchLabels:
          ublkd.io/grpc-client: \"true\"
    ports:
    - port: grpc
      protocol: TCP
  - ports:
    - port: metrics
      protocol: TCP
  podSelector:
    matchLabels:
      app.kubernetes.io/name: ublkd
  policyTypes:
  - Ingress
";

fn remote_problems(text: &str) -> Vec<String> {
    check_remote_access(&objects(text))
}

#[test]
fn sequences_are_read_as_kustomize_writes_them() {
    let ds = objects(REMOTE)
        .into_iter()
        .find(|o| o.kind == "DaemonSet")
        .unwrap();
    let containers = items(&ds.text, "containers");
    assert_eq!(containers.len(), 1);
    let ublkd = named(&containers, "ublkd").unwrap().join("\n");
    let env = items(&ublkd, "env");
    assert_eq!(env.len(), 5);
    assert_eq!(
        named(&env, "UBLKD_GRPC__TLS__KEY").and_then(|i| value(i, "value")),
        Some("/etc/ublkd-tls/tls.key")
    );
    assert_eq!(
        value(named(&env, "UBLKD_METRICS__NODE").unwrap(), "fieldPath"),
        None,
        "nested keys are not the item's own"
    );
    let volumes = items(&ds.text, "volumes");
    assert_eq!(volumes.len(), 2);
    assert!(
        named(&volumes, "config").is_some(),
        "name after another key"
    );
    assert_eq!(
        leaves(&ds.text, "  template:", "      labels:"),
        [
            "app.kubernetes.io/name: ublkd",
            "app.kubernetes.io/part-of: ublkd"
        ]
    );
    assert!(
        items("a:\n  b: c\n", "a").is_empty(),
        "a mapping is no sequence"
    );
}

#[test]
fn the_remote_access_render_passes_and_each_loss_is_named() {
    assert_eq!(remote_problems(REMOTE), Vec::<String>::new());
    let cases = [
        ("          hostPort: 7443\n", "", "hostPort 7443"),
        (
            "unix:///run/ublkd/ublkd.sock,0.0.0.0:7443",
            "0.0.0.0:7443",
            "drops the unix socket",
        ),
        (
            "unix:///run/ublkd/ublkd.sock,0.0.0.0:7443",
            "unix:///run/ublkd/ublkd.sock",
            "no TCP listener on 7443",
        ),
        (
            "secretName: ublkd-grpc-tls",
            "secretName: other",
            "not the Secret ublkd-grpc-tls",
        ),
        (
            "value: /etc/ublkd-tls/ca.crt",
            "value: /etc/ssl/ca.crt",
            "UBLKD_GRPC__TLS__CLIENT_CA",
        ),
        (
            "          name: grpc-tls\n          readOnly: true\n",
            "          name: grpc-tls\n          subPath: tls.crt\n",
            "subPath",
        ),
        (
            "  podSelector:\n    matchLabels:\n      app.kubernetes.io/name: ublkd\n",
            "  podSelector:\n    matchLabels:\n      app: other\n",
            "does not select the ublkd pods",
        ),
        (
            "  - ports:\n    - port: metrics\n",
            "  - from:\n    - ipBlock:\n        cidr: 10.0.0.0/8\n    ports:\n    - port: metrics\n",
            "metrics port",
        ),
        (
            "  - from:\n    - ipBlock:\n        cidr: 192.0.2.0/24\n    - namespaceSelector:\n        matchLabels:\n          ublkd.io/grpc-client: \"true\"\n    ports:\n    - port: grpc\n",
            "  - ports:\n    - port: grpc\n",
            "admits the gRPC port from anywhere",
        ),
        ("  clusterIP: None\n", "", "headless Service"),
    ];
    each_mutation_is_caught(REMOTE, &cases, remote_problems);
    let no_policy = REMOTE
        .split("\n---\n")
        .take(2)
        .collect::<Vec<_>>()
        .join("\n---\n");
    assert!(remote_problems(&no_policy).contains(&"NetworkPolicy ublkd-grpc is missing".to_owned()));
}

#[test]
fn the_base_keeps_grpc_on_the_unix_socket() {
    assert_eq!(
        check_base_is_local(
            "apiVersion: apps/v1\nkind: DaemonSet\nmetadata:\n  name: ublkd\nspec: {}\n"
        ),
        Vec::<String>::new()
    );
    let problems = check_base_is_local(REMOTE);
    for s in [
        "\"UBLKD_GRPC__\"",
        "\"hostPort:\"",
        "NetworkPolicy ublkd-grpc",
    ] {
        assert!(problems.iter().any(|p| p.contains(s)), "{s}: {problems:?}");
    }
}

/// The parts of the csi-modify-volume overlay's render that its check reads, as kustomize
/// writes them.
const MODIFY: &str = "apiVersion: v1
kind: Service
metadata:
  labels:
    app.kubernetes.io/name: ublkd
    app.kubernetes.io/part-of: ublkd
  name: ublkd-grpc
  namespace: ublkd-system
spec:
  clusterIP: None
  ports:
  - name: grpc
    port: 7443
    protocol: TCP
    targetPort: grpc
  publishNotReadyAddresses: true
  selector:
    app.kubernetes.io/name: ublkd
---
apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ublkd
  namespace: ublkd-system
spec:
  template:
    metadata:
      labels:
        app.kubernetes.io/name: ublkd
        app.kubernetes.io/part-of: ublkd
    spec:
      containers:
      - name: ublkd
---
apiVersion: apps/v1
kind: Deployment
metadata:
  labels:
    app.kubernetes.io/name: ublkd-csi-resizer
    app.kubernetes.io/part-of: ublkd
  name: ublkd-csi-resizer
  namespace: ublkd-system
spec:
  replicas: 1
  selector:
    matchLabels:
      app.kubernetes.io/name: ublkd-csi-resizer
  template:
    metadata:
      labels:
        app.kubernetes.io/name: ublkd-csi-resizer
        app.kubernetes.io/part-of: ublkd
    spec:
      containers:
      - args:
        - --csi-endpoint=unix:///csi/csi.sock
        - --resizer-only
        command:
        - /usr/local/bin/ublkd-csi
        env:
        - name: UBLKD_REMOTE
          value: https://ublkd-grpc.ublkd-system.svc:7443
        - name: UBLKD_REMOTE_TLS_CA
          value: /etc/ublkd-csi-tls/ca.crt
        - name: UBLKD_REMOTE_TLS_CERT
          value: /etc/ublkd-csi-tls/tls.crt
        - name: UBLKD_REMOTE_TLS_KEY
          value: /etc/ublkd-csi-tls/tls.key
        image: ghcr.io/example/ublkd:VERSION
        name: ublkd-csi
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /etc/ublkd-csi-tls
          name: client-tls
          readOnly: true
        - mountPath: /csi
          name: socket-dir
      - args:
        - --csi-address=/csi/csi.sock
        - --leader-election
        - --leader-election-namespace=$(NAMESPACE)
        - --handle-volume-inuse-error=false
        - --feature-gates=VolumeAttributesClass=true
        env:
        - name: NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        image: registry.k8s.io/sig-storage/csi-resizer:v2.0.0
        name: csi-resizer
        securityContext:
          allowPrivilegeEscalation: false
          readOnlyRootFilesystem: true
        volumeMounts:
        - mountPath: /csi
          name: socket-dir
      serviceAccountName: ublkd-csi-resizer
      volumes:
      - name: client-tls
        secret:
          defaultMode: 256
          secretName: ublkd-csi-resizer-tls
      - emptyDir: {}
        name: socket-dir
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata:
  labels:
    app.kubernetes.io/name: ublkd
    app.kubernetes.io/part-of: ublkd
  name: ublkd-grpc-csi-resizer
  namespace: ublkd-system
spec:
  ingress:
  - from:
    - podSelector:
        matchLabels:
          app.kubernetes.io/name: ublkd-csi-resizer
    ports:
    - port: grpc
      protocol: TCP
  podSelector:
    matchLabels:
      app.kubernetes.io/name: ublkd
  policyTypes:
  - Ingress
---
apiVersion: storage.k8s.io/v1
driverName: ublkd.io
kind: VolumeAttributesClass
metadata:
  labels:
    app.kubernetes.io/part-of: ublkd
  name: ublkd-limited
parameters:
  qosBurst: 500ms
  readBandwidth: 200Mi
  readIops: \"5000\"
  writeBandwidth: 100MiB/s
  writeIops: \"2000\"
";

#[test]
fn the_modify_volume_render_passes_and_each_loss_is_named() {
    assert_eq!(
        check_csi_modify_volume(&objects(MODIFY)),
        Vec::<String>::new()
    );
    let cases = [
        ("  publishNotReadyAddresses: true\n", "", "not ready"),
        (
            "value: https://ublkd-grpc.ublkd-system.svc:7443",
            "value: https://10.0.0.1:7443",
            "UBLKD_REMOTE",
        ),
        ("        - --resizer-only\n", "", "--resizer-only"),
        (
            "value: /etc/ublkd-csi-tls/tls.key",
            "value: /etc/ublkd-tls/tls.key",
            "UBLKD_REMOTE_TLS_KEY",
        ),
        (
            "          name: client-tls\n          readOnly: true\n",
            "          name: client-tls\n          subPath: tls.crt\n",
            "subPath",
        ),
        (
            "secretName: ublkd-csi-resizer-tls",
            "secretName: ublkd-grpc-tls",
            "not the Secret ublkd-csi-resizer-tls",
        ),
        (
            "        - --feature-gates=VolumeAttributesClass=true\n",
            "",
            "VolumeAttributesClass=true",
        ),
        ("csi-resizer:v2.0.0", "csi-resizer:v1.13.2", "older than v2"),
        (
            "          app.kubernetes.io/name: ublkd-csi-resizer\n    ports:",
            "          app.kubernetes.io/name: someone-else\n    ports:",
            "does not admit the resizer",
        ),
        (
            "    - port: grpc\n      protocol: TCP\n  podSelector:",
            "    - port: metrics\n      protocol: TCP\n  podSelector:",
            "does not admit the resizer",
        ),
        (
            "  podSelector:\n    matchLabels:\n      app.kubernetes.io/name: ublkd\n  policyTypes:",
            "  podSelector:\n    matchLabels:\n      app: other\n  policyTypes:",
            "does not select the ublkd pods",
        ),
        (
            "  readIops: \"5000\"\n",
            "  readIOPS: \"5000\"\n",
            "\"readIOPS\"",
        ),
        (
            "driverName: ublkd.io",
            "driverName: other.io",
            "not ublkd.io's",
        ),
    ];
    each_mutation_is_caught(MODIFY, &cases, |y| check_csi_modify_volume(&objects(y)));
    let without_service = MODIFY.split_once("\n---\n").unwrap().1;
    assert!(check_csi_modify_volume(&objects(without_service))[0].contains("remote-access"));
    // The base must keep the resizer off the network.
    assert!(check_base_is_local(MODIFY)
        .iter()
        .any(|p| p.contains("components/csi-modify-volume")));
}

/// The node plugin's snapshotter as kustomize writes it.
const SNAPSHOTTER: &str = "apiVersion: apps/v1
kind: DaemonSet
metadata:
  name: ublkd-csi-node
  namespace: ublkd-system
spec:
  template:
    spec:
      containers:
      - args:
        - --csi-address=/csi/csi.sock
        - --node-deployment
        env:
        - name: NODE_NAME
          valueFrom:
            fieldRef:
              fieldPath: spec.nodeName
        image: registry.k8s.io/sig-storage/csi-snapshotter:v8.2.1
        name: csi-snapshotter
        volumeMounts:
        - mountPath: /csi
          name: plugin-dir
      volumes:
      - hostPath:
          path: /var/lib/kubelet/plugins/ublkd.io
        name: plugin-dir
";

#[test]
fn the_node_plugin_runs_one_snapshotter_per_node() {
    assert_eq!(
        check_snapshotter(&objects(SNAPSHOTTER)),
        Vec::<String>::new()
    );
    let cases = [
        (
            "        - --node-deployment\n",
            "",
            "without --node-deployment",
        ),
        (
            "        - --node-deployment\n",
            "        - --node-deployment\n        - --leader-election\n",
            "leader election",
        ),
        (
            "fieldPath: spec.nodeName",
            "fieldPath: metadata.name",
            "NODE_NAME",
        ),
        (
            "- mountPath: /csi",
            "- mountPath: /run/csi",
            "plugin-dir at /csi",
        ),
        (
            "name: csi-snapshotter",
            "name: snapshotter",
            "no container csi-snapshotter",
        ),
    ];
    each_mutation_is_caught(SNAPSHOTTER, &cases, |y| check_snapshotter(&objects(y)));
}

#[test]
fn the_snapshot_class_names_the_driver() {
    let class = "apiVersion: snapshot.storage.k8s.io/v1\ndeletionPolicy: Delete\ndriver: ublkd.io\nkind: VolumeSnapshotClass\nmetadata:\n  name: ublkd-file\n";
    assert_eq!(check_csi_snapshots(&objects(class)), Vec::<String>::new());
    let other = class.replace("driver: ublkd.io", "driver: other.io");
    assert!(check_csi_snapshots(&objects(&other))[0].contains("driver: ublkd.io"));
    assert_eq!(check_csi_snapshots(&[]), ["no VolumeSnapshotClass"]);
}
