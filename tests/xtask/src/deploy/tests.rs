//! Host tests of the manifest checks, on renders written as kustomize writes them.

use super::base::{check, check_base_is_local};
use super::components::{check_overlay, check_remote_access, components_used};
use super::yaml::{items, leaves, named, objects, value};

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
    for (from, to, words) in cases {
        assert!(REMOTE.contains(from), "fixture has {from:?}");
        let problems = remote_problems(&REMOTE.replacen(from, to, 1));
        assert!(
            problems.iter().any(|p| p.contains(words)),
            "{from:?} -> {to:?}: {problems:?}"
        );
    }
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

#[test]
fn overlays_are_checked_for_each_component_they_name() {
    let k = "resources:\n  - ../../kubernetes\ncomponents:\n  - ../../kubernetes/components/remote-access\n  - ../../kubernetes/components/cert-manager-grpc-tls/ # why\n# - ../../kubernetes/components/nope\n";
    assert_eq!(
        components_used(k),
        ["remote-access", "cert-manager-grpc-tls"]
    );
    let problems = check_overlay(k, REMOTE);
    assert!(
        problems
            .iter()
            .any(|p| p == "Certificate ublkd-grpc is missing"),
        "{problems:?}"
    );
    assert!(
        problems
            .iter()
            .any(|p| p == "CSIDriver ublkd.io is missing"),
        "the base's objects are checked too: {problems:?}"
    );
    let problems = check_overlay("components:\n  - ../c/components/new-one\n", "");
    assert!(
        problems
            .iter()
            .any(|p| p == "component new-one has no check in deploy.rs"),
        "{problems:?}"
    );
}
