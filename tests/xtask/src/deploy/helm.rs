//! The Helm chart `deploy/helm/ublkd`, checked against the kustomize manifests so that the two
//! never drift: rendered with the values that match `deploy/kubernetes` and each overlay, and
//! put through the same `kubectl kustomize` normalisation, every object must be the same (Helm's
//! own two labels aside). Then `helm lint`, and what only the chart has: its values schema,
//! its refusals, the kubelet directory, a default class, and the Prometheus Operator objects.

use super::yaml::{objects, Object};
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Where the chart is, from the workspace root.
pub const CHART: &str = "deploy/helm/ublkd";
/// The namespace the manifests use, and so the release's in every comparison.
const NAMESPACE: &str = "ublkd-system";

/// Helm built from its module (`go install`), cached by version.
pub const HELM: crate::gotools::GoTool = crate::gotools::GoTool {
    package: "helm.sh/helm/v4/cmd/helm",
    version: "v4.3.2",
    binary: "helm",
};

/// Each kustomization and the chart values that must render the same objects.
pub const EQUIVALENTS: &[(&str, &[&str])] = &[
    ("deploy/kubernetes", &[]),
    (
        "deploy/overlays/remote-access",
        &["remoteAccess.enabled=true"],
    ),
    (
        "deploy/overlays/remote-access-cert-manager",
        &[
            "remoteAccess.enabled=true",
            "remoteAccess.certManager.enabled=true",
        ],
    ),
    ("deploy/overlays/csi-snapshots", &["snapshots.enabled=true"]),
    (
        "deploy/overlays/csi-modify-volume",
        &["remoteAccess.enabled=true", "modifyVolume.enabled=true"],
    ),
];

/// Lines Helm adds that the manifests do not have (every object's `helm.sh/chart` and
/// `app.kubernetes.io/managed-by` labels).
fn is_helm_label(line: &str) -> bool {
    let l = line.trim_start();
    l.starts_with("helm.sh/chart: ") || l.starts_with("app.kubernetes.io/managed-by: ")
}

/// `helm template` of the chart with `sets`, in the manifests' namespace.
pub fn template(helm: &Path, ws: &Path, sets: &[&str], with_hooks: bool) -> Result<String> {
    let mut c = Command::new(helm);
    c.current_dir(ws)
        .args(["template", "ublkd", CHART, "--namespace", NAMESPACE]);
    // Hooks are Helm's alone (the uninstall step); the manifests have a command for it.
    if !with_hooks {
        c.arg("--no-hooks");
    }
    for s in sets {
        c.args(["--set", s]);
    }
    let out = c.output().context("running helm template")?;
    if !out.status.success() {
        bail!(
            "helm template --set {} failed: {}",
            sets.join(","),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `rendered` put through `kubectl kustomize` (keys sorted, one style), as the manifests are.
fn normalise(kubectl: &Path, rendered: &str, scratch: &Path) -> Result<String> {
    std::fs::create_dir_all(scratch)?;
    std::fs::write(scratch.join("chart.yaml"), rendered)?;
    std::fs::write(
        scratch.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - chart.yaml\n",
    )?;
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(scratch)
        .output()
        .context("running kubectl kustomize")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize of the chart's render failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// What differs between the chart's objects and the manifests' (both normalised): objects only
/// one side has, and for the others the first line that differs. The manifests' Namespace is
/// not the chart's (a release lives in a namespace made before it).
pub fn differences(chart: &str, manifests: &str) -> Vec<String> {
    let strip = |o: &Object| -> Vec<String> {
        o.text
            .lines()
            .filter(|l| !is_helm_label(l))
            .map(str::to_owned)
            .collect()
    };
    let chart = objects(chart);
    let manifests: Vec<Object> = objects(manifests)
        .into_iter()
        .filter(|o| o.kind != "Namespace")
        .collect();
    let mut out = Vec::new();
    for m in &manifests {
        match chart.iter().find(|c| c.kind == m.kind && c.name == m.name) {
            None => out.push(format!("{} {}: not in the chart", m.kind, m.name)),
            Some(c) => {
                let (a, b) = (strip(c), strip(m));
                if let Some(i) = (0..a.len().max(b.len())).find(|&i| a.get(i) != b.get(i)) {
                    out.push(format!(
                        "{} {}: line {}: chart {:?}, manifests {:?}",
                        m.kind,
                        m.name,
                        i + 1,
                        a.get(i).map_or("(end)", String::as_str),
                        b.get(i).map_or("(end)", String::as_str)
                    ));
                }
            }
        }
    }
    for c in &chart {
        if !manifests
            .iter()
            .any(|m| m.kind == c.kind && m.name == c.name)
        {
            out.push(format!("{} {}: only in the chart", c.kind, c.name));
        }
    }
    out
}

/// The chart's checks (see the module's comment); problems are returned, not raised, so that
/// one run lists them all. `render_manifests` renders a kustomization as the other checks do.
pub fn checks(
    ws: &Path,
    kubectl: &Path,
    render_manifests: impl Fn(&str) -> Result<String>,
) -> Result<Vec<String>> {
    let helm = crate::gotools::ensure(HELM)?;
    let mut problems = Vec::new();
    let lint = Command::new(&helm)
        .current_dir(ws)
        .args(["lint", "--strict", CHART])
        .output()
        .context("running helm lint")?;
    if !lint.status.success() {
        problems.push(format!(
            "helm lint --strict: {}",
            String::from_utf8_lossy(&lint.stdout).trim()
        ));
    }
    let scratch = scratch_dir();
    for (dir, sets) in EQUIVALENTS {
        eprintln!(
            "xtask: manifests: helm template {CHART} {} against {dir}",
            sets.iter()
                .map(|s| format!("--set {s}"))
                .collect::<Vec<_>>()
                .join(" ")
        );
        let chart = normalise(kubectl, &template(&helm, ws, sets, false)?, &scratch)?;
        let manifests = render_manifests(dir)?;
        problems.extend(
            differences(&chart, &manifests)
                .into_iter()
                .map(|p| format!("{CHART} vs {dir}: {p}")),
        );
    }
    // Only the scratch copy of a render: nothing to keep.
    let _ = std::fs::remove_dir_all(&scratch);
    problems.extend(chart_only(&helm, ws)?);
    problems.extend(versions(ws));
    Ok(problems)
}

fn scratch_dir() -> PathBuf {
    std::env::temp_dir().join(format!("xtask-helm-{}", std::process::id()))
}

/// What the chart does that the manifests cannot show.
fn chart_only(helm: &Path, ws: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    // Another kubelet directory: every path of the driver under it, none left at the default.
    let moved = template(helm, ws, &["kubeletDir=/var/lib/k0s/kubelet"], false)?;
    let node = objects(&moved)
        .into_iter()
        .find(|o| o.kind == "DaemonSet" && o.name == "ublkd-csi-node");
    match node {
        None => problems.push("no ublkd-csi-node DaemonSet in the render".into()),
        Some(o) => {
            if o.text.contains("/var/lib/kubelet") {
                problems.push(
                    "kubeletDir=/var/lib/k0s/kubelet left /var/lib/kubelet in the node plugin"
                        .into(),
                );
            }
            for want in [
                "--kubelet-dir=/var/lib/k0s/kubelet",
                "--kubelet-registration-path=/var/lib/k0s/kubelet/plugins/ublkd.io/csi.sock",
                "path: /var/lib/k0s/kubelet/plugins_registry",
            ] {
                if !o.text.contains(want) {
                    problems.push(format!("kubeletDir=/var/lib/k0s/kubelet: no {want:?}"));
                }
            }
        }
    }
    // Monitoring: off by default, both objects when asked for, the rules file whole.
    let plain = template(helm, ws, &[], true)?;
    // The uninstall hook: before helm deletes anything, the controller stops and its finalizer
    // leaves the nodes, run by the controller's service account.
    match objects(&plain)
        .into_iter()
        .find(|o| o.kind == "Job" && o.name == "ublkd-csi-uninstall")
    {
        None => problems.push("no ublkd-csi-uninstall Job (the pre-delete hook)".into()),
        Some(o) => {
            for want in [
                "helm.sh/hook: pre-delete",
                r#"args: ["node-loss", "uninstall"]"#,
                "serviceAccountName: ublkd-csi-controller",
            ] {
                if !o.text.contains(want) {
                    problems.push(format!("the uninstall hook has no {want:?}"));
                }
            }
        }
    }
    if plain.contains("kind: ServiceMonitor") || plain.contains("kind: PrometheusRule") {
        problems.push("the default render has Prometheus Operator objects".into());
    }
    let mon = template(
        helm,
        ws,
        &[
            "monitoring.serviceMonitor.enabled=true",
            "monitoring.prometheusRule.enabled=true",
            "monitoring.serviceMonitor.labels.release=prometheus",
        ],
        false,
    )?;
    let rules = std::fs::read_to_string(ws.join(CHART).join("files/ublkd-rules.yaml"))?;
    let alerts = rules.matches("- alert: ").count();
    let objs = objects(&mon);
    match objs.iter().find(|o| o.kind == "PrometheusRule") {
        None => {
            problems.push("monitoring.prometheusRule.enabled rendered no PrometheusRule".into())
        }
        Some(o) if o.text.matches("- alert: ").count() != alerts || alerts == 0 => {
            problems.push(format!(
                "the PrometheusRule has {} alerts, files/ublkd-rules.yaml {alerts}",
                o.text.matches("- alert: ").count()
            ))
        }
        Some(_) => {}
    }
    match objs.iter().find(|o| o.kind == "ServiceMonitor") {
        None => {
            problems.push("monitoring.serviceMonitor.enabled rendered no ServiceMonitor".into())
        }
        Some(o) => {
            for want in ["replacement: ublkd", "release: prometheus", "port: metrics"] {
                if !o.text.contains(want) {
                    problems.push(format!("the ServiceMonitor has no {want:?}"));
                }
            }
        }
    }
    // A default class, and classes of the user's own.
    let classes = template(
        helm,
        ws,
        &[
            "storageClasses[0].name=fast",
            "storageClasses[0].backend=ram",
            "storageClasses[0].default=true",
            "storageClasses[0].parameters.queues=4",
        ],
        false,
    )?;
    let objs = objects(&classes);
    let fast = objs
        .iter()
        .find(|o| o.kind == "StorageClass" && o.name == "fast");
    match fast {
        None => problems.push("storageClasses[0].name=fast rendered no class fast".into()),
        Some(o) => {
            for want in [
                "storageclass.kubernetes.io/is-default-class: \"true\"",
                "queues: \"4\"",
                "backend: ram",
            ] {
                if !o.text.contains(want) {
                    problems.push(format!("StorageClass fast has no {want:?}"));
                }
            }
        }
    }
    // Refusals: each must fail the render, saying why.
    for (sets, why) in [
        (
            &["modifyVolume.enabled=true"][..],
            "needs remoteAccess.enabled",
        ),
        (
            &["storageClasses[0].name=x", "storageClasses[0].backend=tape"][..],
            "/storageClasses/0/backend",
        ),
        (
            &[
                "storageClasses[0].name=x",
                "storageClasses[0].backend=file",
                "storageClasses[0].root=/elsewhere",
            ][..],
            "is not one of ublkd.fileRoots",
        ),
        (
            &["storageClasses[0].name=x", "storageClasses[0].backend=nvme"][..],
            "namespace",
        ),
        (&["kubeletDir=relative"][..], "kubeletDir"),
        (&["typo=1"][..], "typo"),
    ] {
        match template(helm, ws, sets, false) {
            Ok(_) => problems.push(format!(
                "--set {} rendered; it must be refused",
                sets.join(",")
            )),
            Err(e) if !format!("{e:#}").contains(why) => problems.push(format!(
                "--set {} was refused without saying {why:?}: {e:#}",
                sets.join(",")
            )),
            Err(_) => {}
        }
    }
    Ok(problems)
}

/// The chart's version and appVersion, and the manifests' image tag, are the workspace's.
fn versions(ws: &Path) -> Vec<String> {
    let version = env!("CARGO_PKG_VERSION");
    let mut problems = Vec::new();
    let chart = std::fs::read_to_string(ws.join(CHART).join("Chart.yaml")).unwrap_or_default();
    for key in ["version: ", "appVersion: "] {
        let found = chart
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .map(|v| v.trim().trim_matches('"'));
        if found != Some(version) {
            problems.push(format!(
                "{CHART}/Chart.yaml {key}{found:?}, the workspace's version is {version}"
            ));
        }
    }
    let ds =
        std::fs::read_to_string(ws.join("deploy/kubernetes/daemonset.yaml")).unwrap_or_default();
    if !ds.contains(&format!("image: ghcr.io/example/ublkd:{version}")) {
        problems.push(format!(
            "deploy/kubernetes/daemonset.yaml's image is not tagged {version}, the workspace's version"
        ));
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    const CM: &str = "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  labels:\n    app.kubernetes.io/part-of: ublkd\n  name: c\n  namespace: ublkd-system\ndata:\n  k: v\n";

    #[test]
    fn helm_labels_and_the_namespace_are_no_difference_and_the_rest_is() {
        let helm = CM.replace(
            "    app.kubernetes.io/part-of: ublkd\n",
            "    app.kubernetes.io/managed-by: Helm\n    app.kubernetes.io/part-of: ublkd\n    helm.sh/chart: ublkd-0.1.0\n",
        );
        let ns = "apiVersion: v1\nkind: Namespace\nmetadata:\n  name: ublkd-system\n";
        assert!(differences(&helm, &format!("{ns}---\n{CM}")).is_empty());
        let changed = helm.replace("k: v", "k: w");
        let d = differences(&changed, CM);
        assert_eq!(d.len(), 1, "{d:?}");
        assert!(
            d[0].starts_with("ConfigMap c: line ") && d[0].contains("k: w"),
            "{d:?}"
        );
        let extra = format!("{CM}---\n{}", CM.replace("name: c", "name: d"));
        assert_eq!(differences(&extra, CM), ["ConfigMap d: only in the chart"]);
        assert_eq!(differences(CM, &extra), ["ConfigMap d: not in the chart"]);
    }
}
