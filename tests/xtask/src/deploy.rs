//! The Kubernetes manifests, rendered as an operator would (`kubectl kustomize
//! deploy/kubernetes`, and every overlay under `deploy/overlays`) and checked so they cannot
//! rot: every object is there, the sidecars get the arguments distributed provisioning needs, the
//! driver's mounts propagate, only the containers that must be privileged are, gRPC stays on the
//! unix socket unless the remote-access component is added, and each component an overlay uses
//! does what it says.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
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

/// The base alone keeps gRPC off the network: no listener setting (the default is the unix
/// socket), no host port, no TLS Secret, no NetworkPolicy.
fn check_base_is_local(rendered: &str) -> Vec<String> {
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

fn find<'a>(objs: &'a [Object], kind: &str, name: &str) -> Option<&'a Object> {
    objs.iter().find(|o| o.kind == kind && o.name == name)
}

fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The items of the sequence under the first `key:` line of `text`. kustomize writes a
/// sequence at its key's indent, each item starting with `- `; in each returned item that
/// dash is a space, so the item's own keys share one indent.
fn items(text: &str, key: &str) -> Vec<Vec<String>> {
    let head = format!("{key}:");
    let mut lines = text.lines().skip_while(|l| l.trim() != head);
    let Some(head_line) = lines.next() else {
        return Vec::new();
    };
    let at = indent(head_line);
    let mut out: Vec<Vec<String>> = Vec::new();
    for l in lines {
        let i = indent(l);
        if i == at && l[i..].starts_with("- ") {
            out.push(vec![format!("{}  {}", " ".repeat(i), &l[i + 2..])]);
        } else if i > at {
            match out.last_mut() {
                Some(item) => item.push(l.to_owned()),
                None => break, // a mapping, not a sequence
            }
        } else {
            break;
        }
    }
    out
}

/// The value of the item's own `key: value` line (not a nested one).
fn value<'a>(item: &'a [String], key: &str) -> Option<&'a str> {
    let at = indent(item.first()?);
    let prefix = format!("{key}: ");
    item.iter()
        .filter(|l| indent(l) == at)
        .find_map(|l| l.trim_start().strip_prefix(prefix.as_str()))
        .map(|v| v.trim().trim_matches('"'))
}

/// The `key: value` lines, trimmed, nested anywhere under the first line that is exactly `key`
/// (indent included) after the first line that is exactly `after`.
fn leaves<'a>(text: &'a str, after: &str, key: &str) -> Vec<&'a str> {
    let at = indent(key);
    text.lines()
        .skip_while(|l| *l != after)
        .skip_while(|l| *l != key)
        .skip(1)
        .take_while(|l| indent(l) > at)
        .map(str::trim)
        .filter(|l| !l.ends_with(':'))
        .collect()
}

/// The item whose own `name` is `name`.
fn named<'a>(items: &'a [Vec<String>], name: &str) -> Option<&'a [String]> {
    items
        .iter()
        .find(|i| value(i, "name") == Some(name))
        .map(Vec::as_slice)
}

/// What the remote-access component must give: ublkd listening on its socket and on TCP 7443
/// with mutual TLS from the Secret ublkd-grpc-tls (mounted whole, so renewals arrive), that
/// port on every node's address, a headless Service for it, and a NetworkPolicy on the ublkd
/// pods that admits the gRPC port only from listed sources and leaves the metrics port open.
fn check_remote_access(objs: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut problem = |p: String| problems.push(p);
    let Some(ds) = find(objs, "DaemonSet", "ublkd") else {
        return vec!["DaemonSet ublkd is missing".into()];
    };
    let containers = items(&ds.text, "containers");
    let Some(ublkd) = named(&containers, "ublkd") else {
        return vec!["DaemonSet ublkd has no container ublkd".into()];
    };
    let ublkd = ublkd.join("\n");
    let env = items(&ublkd, "env");
    let var = |name: &str| named(&env, name).and_then(|i| value(i, "value"));
    match var("UBLKD_GRPC__LISTEN") {
        Some(listen) => {
            let listen: Vec<&str> = listen.split(',').collect();
            if !listen.contains(&"unix:///run/ublkd/ublkd.sock") {
                problem(format!(
                    "UBLKD_GRPC__LISTEN {listen:?} drops the unix socket the CSI driver and the \
                     readiness probe use"
                ));
            }
            if !listen
                .iter()
                .any(|l| l.ends_with(":7443") && !l.starts_with("unix:"))
            {
                problem(format!(
                    "UBLKD_GRPC__LISTEN {listen:?} has no TCP listener on 7443"
                ));
            }
        }
        None => problem("the ublkd container does not set UBLKD_GRPC__LISTEN".into()),
    }
    let mounts = items(&ublkd, "volumeMounts");
    let tls_dir = named(&mounts, "grpc-tls").and_then(|m| {
        if value(m, "readOnly") != Some("true") {
            problem("the grpc-tls mount is not read-only".into());
        }
        if value(m, "subPath").is_some() {
            problem("the grpc-tls mount uses subPath, which never sees a renewed Secret".into());
        }
        value(m, "mountPath")
    });
    let Some(tls_dir) = tls_dir else {
        problem("the ublkd container does not mount the volume grpc-tls".into());
        return problems;
    };
    for (var_name, file) in [
        ("UBLKD_GRPC__TLS__CERT", "tls.crt"),
        ("UBLKD_GRPC__TLS__KEY", "tls.key"),
        ("UBLKD_GRPC__TLS__CLIENT_CA", "ca.crt"),
    ] {
        let want = format!("{tls_dir}/{file}");
        if var(var_name) != Some(want.as_str()) {
            problem(format!(
                "{var_name} is {:?}, not {want:?} from the Secret",
                var(var_name)
            ));
        }
    }
    let volumes = items(&ds.text, "volumes");
    let secret = named(&volumes, "grpc-tls").map(|v| v.join("\n"));
    if !secret
        .as_deref()
        .is_some_and(|v| v.contains("secretName: ublkd-grpc-tls"))
    {
        problem("the volume grpc-tls is not the Secret ublkd-grpc-tls".into());
    }
    let ports = items(&ublkd, "ports");
    match named(&ports, "grpc") {
        Some(p)
            if value(p, "containerPort") == Some("7443")
                && value(p, "hostPort") == Some("7443") => {}
        _ => problem("the ublkd container has no port grpc 7443 with hostPort 7443".into()),
    }
    match find(objs, "Service", "ublkd-grpc") {
        Some(svc)
            if svc.text.contains("clusterIP: None") && svc.text.contains("targetPort: grpc") => {}
        _ => problem("no headless Service ublkd-grpc over the port grpc".into()),
    }

    let Some(np) = find(objs, "NetworkPolicy", "ublkd-grpc") else {
        problem("NetworkPolicy ublkd-grpc is missing".into());
        return problems;
    };
    // It must select the ublkd pods: its podSelector's labels are among the pod template's.
    let selector = leaves(&np.text, "spec:", "  podSelector:");
    let pod_labels = leaves(&ds.text, "  template:", "      labels:");
    if selector.is_empty() || !selector.iter().all(|l| pod_labels.contains(l)) {
        problem(format!(
            "NetworkPolicy ublkd-grpc's podSelector {selector:?} does not select the ublkd pods"
        ));
    }
    if !items(&np.text, "policyTypes")
        .iter()
        .any(|i| i[0].trim() == "Ingress")
    {
        problem("NetworkPolicy ublkd-grpc does not restrict Ingress".into());
    }
    let rules = items(&np.text, "ingress");
    let port_of = |rule: &Vec<String>| -> Vec<String> {
        items(&rule.join("\n"), "ports")
            .iter()
            .filter_map(|p| value(p, "port").map(str::to_owned))
            .collect()
    };
    let mut grpc_limited = false;
    let mut metrics_open = false;
    for rule in &rules {
        let ports = port_of(rule);
        let from = items(&rule.join("\n"), "from");
        let unrestricted = !rule.iter().any(|l| l.trim() == "from:");
        let covers = |names: [&str; 2]| {
            ports.is_empty() || ports.iter().any(|p| names.contains(&p.as_str()))
        };
        if covers(["grpc", "7443"]) {
            if unrestricted {
                problem("NetworkPolicy ublkd-grpc admits the gRPC port from anywhere".into());
            } else if !from.is_empty() {
                grpc_limited = true;
            }
        }
        if covers(["metrics", "9580"]) && unrestricted {
            metrics_open = true;
        }
    }
    if !grpc_limited {
        problem("NetworkPolicy ublkd-grpc admits no one to the gRPC port".into());
    }
    if !metrics_open {
        problem(
            "NetworkPolicy ublkd-grpc does not admit everyone to the metrics port (scraping, \
             probes)"
                .into(),
        );
    }
    problems
}

/// The cert-manager component: a Certificate that writes the Secret remote-access mounts, for
/// the name clients check, usable by a TLS server.
fn check_cert_manager(objs: &[Object]) -> Vec<String> {
    let Some(cert) = find(objs, "Certificate", "ublkd-grpc") else {
        return vec!["Certificate ublkd-grpc is missing".into()];
    };
    [
        "secretName: ublkd-grpc-tls",
        "- ublkd-grpc.ublkd-system.svc",
        "- server auth",
        "issuerRef:",
    ]
    .iter()
    .filter(|s| !cert.text.contains(*s))
    .map(|s| format!("Certificate ublkd-grpc lacks {s:?}"))
    .collect()
}

/// Checks a rendered overlay for what one component adds; returns the problems.
type ComponentCheck = fn(&[Object]) -> Vec<String>;

/// Each component under deploy/kubernetes/components, by directory name, and its check on an
/// overlay that uses it. A component without a check here fails the run: it would go untested.
const COMPONENTS: &[(&str, ComponentCheck)] = &[
    ("remote-access", check_remote_access),
    ("cert-manager-grpc-tls", check_cert_manager),
];

/// The components an overlay's kustomization names (`.../components/NAME`).
fn components_used(kustomization: &str) -> Vec<String> {
    kustomization
        .lines()
        .map(|l| l.split('#').next().unwrap_or("").trim())
        .filter_map(|l| l.strip_prefix("- "))
        .filter_map(|path| {
            let (_, name) = path.trim_end_matches('/').rsplit_once("components/")?;
            (!name.contains('/')).then(|| name.to_owned())
        })
        .collect()
}

/// Checks one overlay's render: everything the base must hold, and each component it uses.
fn check_overlay(kustomization: &str, rendered: &str) -> Vec<String> {
    let mut problems = check(rendered);
    let objs = objects(rendered);
    for name in components_used(kustomization) {
        match COMPONENTS.iter().find(|(n, _)| *n == name) {
            Some((_, check)) => problems.extend(check(&objs)),
            None => problems.push(format!("component {name} has no check in deploy.rs")),
        }
    }
    problems
}

/// The subdirectories of `dir` that hold a kustomization.yaml, sorted.
fn kustomizations(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir(dir).with_context(|| format!("listing {}", dir.display()))? {
        let path = entry?.path();
        if path.join("kustomization.yaml").is_file() {
            found.push(path);
        }
    }
    found.sort();
    Ok(found)
}

/// Where the overlays are: outside deploy/kubernetes, because kustomize refuses a base that
/// contains its overlay.
const OVERLAYS: &str = "deploy/overlays";
const COMPONENTS_DIR: &str = "deploy/kubernetes/components";

fn render(kubectl: &Path, ws: &Path, dir: &str) -> Result<String> {
    eprintln!("xtask: manifests: kubectl kustomize {dir}");
    let out = Command::new(kubectl)
        .args(["kustomize", dir])
        .current_dir(ws)
        .output()
        .context("running kubectl kustomize")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize {dir} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Renders `deploy/kubernetes` and every overlay under `deploy/overlays` with `kubectl
/// kustomize` and checks them; kubectl is installed when missing (Debian's kubernetes-client),
/// never skipped. Every component must be used by some overlay, so that each is rendered.
pub fn manifest_checks(ws: &Path) -> Result<()> {
    if crate::apt::which("kubectl").is_none() {
        crate::apt::install_packages(&["kubernetes-client"])?;
    }
    let kubectl = crate::apt::which("kubectl").context("kubectl not found after installing it")?;
    let mut problems = Vec::new();
    let base = render(&kubectl, ws, "deploy/kubernetes")?;
    problems.extend(
        check(&base)
            .into_iter()
            .chain(check_base_is_local(&base))
            .map(|p| format!("deploy/kubernetes: {p}")),
    );
    let mut used = Vec::new();
    for dir in kustomizations(&ws.join(OVERLAYS))? {
        let rel = dir.strip_prefix(ws).unwrap_or(&dir).display().to_string();
        let kustomization = std::fs::read_to_string(dir.join("kustomization.yaml"))?;
        used.extend(components_used(&kustomization));
        let rendered = render(&kubectl, ws, &rel)?;
        problems.extend(
            check_overlay(&kustomization, &rendered)
                .into_iter()
                .map(|p| format!("{rel}: {p}")),
        );
    }
    for dir in kustomizations(&ws.join(COMPONENTS_DIR))? {
        let name = dir.file_name().map(|n| n.to_string_lossy().into_owned());
        if let Some(name) = name.filter(|n| !used.contains(n)) {
            problems.push(format!(
                "{COMPONENTS_DIR}/{name} is used by no overlay in {OVERLAYS}, so never rendered"
            ));
        }
    }
    if !problems.is_empty() {
        bail!(
            "the Kubernetes manifests render wrong:\n  {}",
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
        assert!(
            remote_problems(&no_policy).contains(&"NetworkPolicy ublkd-grpc is missing".to_owned())
        );
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
}
