//! What each kustomize component must add to an overlay that uses it.

use super::base::check;
use super::yaml::{find, items, leaves, named, objects, value, Object};

/// What the remote-access component must give: ublkd listening on its socket and on TCP 7443
/// with mutual TLS from the Secret ublkd-grpc-tls (mounted whole, so renewals arrive), that
/// port on every node's address, a headless Service for it, and a NetworkPolicy on the ublkd
/// pods that admits the gRPC port only from listed sources and leaves the metrics port open.
pub(super) fn check_remote_access(objs: &[Object]) -> Vec<String> {
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
pub(super) fn check_cert_manager(objs: &[Object]) -> Vec<String> {
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
pub(super) fn components_used(kustomization: &str) -> Vec<String> {
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
pub(super) fn check_overlay(kustomization: &str, rendered: &str) -> Vec<String> {
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
