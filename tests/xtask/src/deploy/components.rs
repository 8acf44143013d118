//! What each of the chart's options must add to its render (remote access, cert-manager,
//! snapshots, ModifyVolume).

use super::base::args;
use super::yaml::{find, indent, items, leaves, named, value, Object};

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

/// The snapshot component: a VolumeSnapshotClass for the driver (the per-node snapshotter it
/// needs is the base's, checked there).
pub(super) fn check_csi_snapshots(objs: &[Object]) -> Vec<String> {
    let classes: Vec<&Object> = objs
        .iter()
        .filter(|o| o.kind == "VolumeSnapshotClass")
        .collect();
    if classes.is_empty() {
        return vec!["no VolumeSnapshotClass".into()];
    }
    let mut problems = Vec::new();
    for c in classes {
        for s in ["driver: ublkd.io", "deletionPolicy: "] {
            if !c.text.contains(s) {
                problems.push(format!("VolumeSnapshotClass {} lacks {s:?}", c.name));
            }
        }
    }
    problems
}

/// The `key: value` leaves nested under the first line of `text` that is `key:` (any indent).
fn under<'a>(text: &'a str, key: &str) -> Vec<&'a str> {
    let head = format!("{key}:");
    let mut lines = text.lines().skip_while(|l| l.trim() != head);
    let Some(h) = lines.next() else {
        return Vec::new();
    };
    let at = indent(h);
    lines
        .take_while(|l| indent(l) > at)
        .map(str::trim)
        .filter(|l| !l.ends_with(':'))
        .collect()
}

/// The keys ublkd-csi accepts in a VolumeAttributesClass (csi/src/qos.rs).
const QOS_KEYS: [&str; 5] = [
    "readIops",
    "writeIops",
    "readBandwidth",
    "writeBandwidth",
    "qosBurst",
];

/// The ModifyVolume component: the resizer's ublkd-csi reaches every node's ublkd through the
/// remote-access Service with a client certificate from a whole-Secret mount, the resizer's
/// VolumeAttributesClass gate is on (a v2 resizer, which reads the v1 API), the Service lists
/// ublkd pods that are not ready (a silent node must fail the call, not hide its volumes), a
/// NetworkPolicy admits the resizer's pods to the gRPC port, and the example classes name only
/// keys the driver takes.
pub(super) fn check_csi_modify_volume(objs: &[Object]) -> Vec<String> {
    let mut problems = Vec::new();
    let mut problem = |p: String| problems.push(p);
    let Some(svc) = find(objs, "Service", "ublkd-grpc") else {
        return vec![
            "csi-modify-volume needs components/remote-access: no Service ublkd-grpc".into(),
        ];
    };
    if !svc.text.contains("publishNotReadyAddresses: true") {
        problem("Service ublkd-grpc does not publish ublkd pods that are not ready".into());
    }
    let Some(dep) = find(objs, "Deployment", "ublkd-csi-resizer") else {
        return vec!["Deployment ublkd-csi-resizer is missing".into()];
    };
    let containers = items(&dep.text, "containers");
    let Some(driver) = named(&containers, "ublkd-csi") else {
        return vec!["Deployment ublkd-csi-resizer has no container ublkd-csi".into()];
    };
    if !args(driver).iter().any(|a| a == "--resizer-only") {
        problem("the resizer's ublkd-csi lost --resizer-only".into());
    }
    let env = items(&driver.join("\n"), "env");
    let var = |name: &str| named(&env, name).and_then(|i| value(i, "value"));
    // The Service's own name, which the shared server certificate holds.
    let namespace = svc
        .text
        .lines()
        .find_map(|l| l.strip_prefix("  namespace: "))
        .unwrap_or("default");
    let want = format!("https://ublkd-grpc.{namespace}.svc:7443");
    if var("UBLKD_REMOTE") != Some(want.as_str()) {
        problem(format!(
            "the resizer's ublkd-csi has UBLKD_REMOTE {:?}, not the remote-access Service {want:?}",
            var("UBLKD_REMOTE")
        ));
    }
    if !svc.text.contains("port: 7443") {
        problem("Service ublkd-grpc is not on port 7443".into());
    }
    let mounts = items(&driver.join("\n"), "volumeMounts");
    let tls_dir = named(&mounts, "client-tls").and_then(|m| {
        if value(m, "readOnly") != Some("true") {
            problem("the client-tls mount is not read-only".into());
        }
        if value(m, "subPath").is_some() {
            problem("the client-tls mount uses subPath, which never sees a renewed Secret".into());
        }
        value(m, "mountPath")
    });
    match tls_dir {
        None => problem("the resizer's ublkd-csi does not mount the volume client-tls".into()),
        Some(dir) => {
            for (name, file) in [
                ("UBLKD_REMOTE_TLS_CA", "ca.crt"),
                ("UBLKD_REMOTE_TLS_CERT", "tls.crt"),
                ("UBLKD_REMOTE_TLS_KEY", "tls.key"),
            ] {
                let want = format!("{dir}/{file}");
                if var(name) != Some(want.as_str()) {
                    problem(format!(
                        "{name} is {:?}, not {want:?} from the Secret",
                        var(name)
                    ));
                }
            }
        }
    }
    let volumes = items(&dep.text, "volumes");
    if !named(&volumes, "client-tls")
        .is_some_and(|v| v.join("\n").contains("secretName: ublkd-csi-resizer-tls"))
    {
        problem("the volume client-tls is not the Secret ublkd-csi-resizer-tls".into());
    }
    match named(&containers, "csi-resizer") {
        None => problem("Deployment ublkd-csi-resizer has no container csi-resizer".into()),
        Some(resizer) => {
            let gate = args(resizer).iter().any(|a| {
                a.strip_prefix("--feature-gates=")
                    .is_some_and(|g| g.split(',').any(|f| f == "VolumeAttributesClass=true"))
            });
            if !gate {
                problem(
                    "csi-resizer runs without --feature-gates=VolumeAttributesClass=true".into(),
                );
            }
            let major = value(resizer, "image")
                .and_then(|i| i.rsplit_once(":v"))
                .and_then(|(_, v)| v.split('.').next()?.parse::<u32>().ok());
            if major.is_none_or(|m| m < 2) {
                problem(format!(
                    "csi-resizer {:?} is older than v2, which reads the v1 VolumeAttributesClass API",
                    value(resizer, "image")
                ));
            }
        }
    }

    match find(objs, "NetworkPolicy", "ublkd-grpc-csi-resizer") {
        None => problem("NetworkPolicy ublkd-grpc-csi-resizer is missing".into()),
        Some(np) => {
            let selector = leaves(&np.text, "spec:", "  podSelector:");
            let ublkd = find(objs, "DaemonSet", "ublkd")
                .map(|ds| leaves(&ds.text, "  template:", "      labels:"))
                .unwrap_or_default();
            if selector.is_empty() || !selector.iter().all(|l| ublkd.contains(l)) {
                problem(format!(
                    "NetworkPolicy ublkd-grpc-csi-resizer's podSelector {selector:?} does not \
                     select the ublkd pods"
                ));
            }
            let resizer_labels = leaves(&dep.text, "  template:", "      labels:");
            let admits = items(&np.text, "ingress").iter().any(|rule| {
                let rule = rule.join("\n");
                let ports = items(&rule, "ports");
                let grpc = ports
                    .iter()
                    .any(|p| matches!(value(p, "port"), Some("grpc" | "7443")));
                let from = items(&rule, "from").iter().any(|f| {
                    let f = f.join("\n");
                    let labels = under(&f, "podSelector");
                    !f.contains("namespaceSelector:")
                        && !labels.is_empty()
                        && labels.iter().all(|l| resizer_labels.contains(l))
                });
                grpc && from
            });
            if !admits {
                problem(
                    "NetworkPolicy ublkd-grpc-csi-resizer does not admit the resizer's pods to \
                     the gRPC port"
                        .into(),
                );
            }
        }
    }

    let classes: Vec<&Object> = objs
        .iter()
        .filter(|o| o.kind == "VolumeAttributesClass")
        .collect();
    if classes.is_empty() {
        problem("no VolumeAttributesClass".into());
    }
    for c in classes {
        if !c.text.contains("driverName: ublkd.io") {
            problem(format!(
                "VolumeAttributesClass {} is not ublkd.io's",
                c.name
            ));
        }
        for leaf in under(&c.text, "parameters") {
            let key = leaf.split(':').next().unwrap_or("").trim_matches('"');
            if !QOS_KEYS.contains(&key) {
                problem(format!(
                    "VolumeAttributesClass {} names {key:?}, which ublkd-csi refuses",
                    c.name
                ));
            }
        }
    }
    problems
}
