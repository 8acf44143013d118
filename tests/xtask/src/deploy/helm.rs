//! The Helm chart `deploy/helm/ublkd`: `helm template`, the render put through `kubectl
//! kustomize` (one style, keys sorted, which the checks read), and what only the chart does:
//! `helm lint`, its values schema and refusals, the kubelet directory, the uninstall hook, the
//! Prometheus Operator objects, and the versions.

use super::yaml::objects;
use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// Where the chart is, from the workspace root.
pub const CHART: &str = "deploy/helm/ublkd";
/// The release's namespace in every render.
pub const NAMESPACE: &str = "ublkd-system";

/// Helm built from its module (`go install`), cached by version.
pub const HELM: crate::gotools::GoTool = crate::gotools::GoTool {
    package: "helm.sh/helm/v4/cmd/helm",
    version: "v4.3.2",
    binary: "helm",
};

/// Lines Helm adds that a render for kubectl users leaves out (every object's `helm.sh/chart`
/// and `app.kubernetes.io/managed-by` labels).
pub fn is_helm_label(line: &str) -> bool {
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

/// `rendered` put through `kubectl kustomize` (keys sorted, one style), as the checks read it.
pub fn normalise(kubectl: &Path, rendered: &str, scratch: &Path) -> Result<String> {
    std::fs::create_dir_all(scratch)?;
    std::fs::write(scratch.join("chart.yaml"), rendered)?;
    std::fs::write(
        scratch.join("kustomization.yaml"),
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\nresources:\n  - chart.yaml\n",
    )?;
    kustomize(kubectl, scratch)
}

/// `kubectl kustomize DIR`.
pub fn kustomize(kubectl: &Path, dir: &Path) -> Result<String> {
    let out = Command::new(kubectl)
        .arg("kustomize")
        .arg(dir)
        .output()
        .context("running kubectl kustomize")?;
    if !out.status.success() {
        bail!(
            "kubectl kustomize {} failed: {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `helm lint --strict`, what only the chart does, and the versions; problems are returned,
/// not raised, so that one run lists them all.
pub fn checks(helm: &Path, ws: &Path) -> Result<Vec<String>> {
    let mut problems = Vec::new();
    let lint = Command::new(helm)
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
    problems.extend(chart_only(helm, ws)?);
    problems.extend(versions(ws));
    Ok(problems)
}

/// What the chart does beyond its default render.
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

/// The chart's version and appVersion, and the render's image tag, are the workspace's.
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
    let render = std::fs::read_to_string(ws.join(super::RENDER)).unwrap_or_default();
    if !render.contains(&format!("image: ghcr.io/example/ublkd:{version}")) {
        problems.push(format!(
            "{}'s image is not tagged {version}, the workspace's version",
            super::RENDER
        ));
    }
    problems
}
