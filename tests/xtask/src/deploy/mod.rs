//! The Kubernetes objects have one source, the Helm chart `deploy/helm/ublkd`. `cargo xtask
//! manifests` renders its defaults into `deploy/kubernetes/ublkd.yaml` (what `kubectl apply -k
//! deploy/kubernetes` installs, for those without Helm); the host tier renders it again and fails
//! when the committed file is not that render. Then the chart is rendered with each option
//! (remote access, cert-manager, snapshots, ModifyVolume, another kubelet directory,
//! monitoring, classes of one's own), each render read as JSON, and held to the rows of `needs`
//! that apply to it and to the checks of `check` a row cannot say, each proven able to fail on
//! that very render; `helm` lints the chart and checks what it must refuse.

use anyhow::{bail, Context, Result};
use check::{alerts, grpc_ingress, modify_volume, Check};
use needs::*;
use serde_json::Value;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};

mod check;
pub mod helm;
mod needs;

#[cfg(test)]
mod tests;

/// The committed render of the chart's defaults, from the workspace root.
pub const RENDER: &str = "deploy/kubernetes/ublkd.yaml";
/// Every image of that render, for mirrors.
const IMAGES: &str = "deploy/kubernetes/images.txt";

/// The chart's renders the checks read: a name, the values set (Helm's `--set`), the tables of
/// `needs` that apply, and the checks a row cannot say.
type Render = (&'static str, &'static str, Tables, &'static [Check]);
type Tables = &'static [&'static [&'static str]];

const RENDERS: &[Render] = &[
    ("defaults", "", &[BASE, DEFAULTS], &[]),
    (
        "remote access",
        "remoteAccess.enabled=true",
        &[BASE, REMOTE],
        &[grpc_ingress],
    ),
    (
        "remote access with cert-manager",
        "remoteAccess.enabled=true,remoteAccess.certManager.enabled=true",
        &[BASE, REMOTE, CERT_MANAGER],
        &[grpc_ingress],
    ),
    (
        "snapshots",
        "snapshots.enabled=true",
        &[BASE, SNAPSHOTS],
        &[],
    ),
    (
        "ModifyVolume",
        "modifyVolume.enabled=true",
        &[BASE, MODIFY],
        &[modify_volume],
    ),
    (
        "another kubelet directory",
        "kubeletDir=/var/lib/k0s/kubelet",
        &[KUBELET_DIR],
        &[],
    ),
    (
        "monitoring",
        "monitoring.serviceMonitor.enabled=true,monitoring.prometheusRule.enabled=true,\
         monitoring.serviceMonitor.labels.release=prometheus,monitoring.dashboard.enabled=true,\
         monitoring.runbookUrl=https://runbooks.example.org/ublkd/runbooks.md",
        &[MONITORING],
        &[alerts],
    ),
    (
        "classes of one's own",
        "storageClasses[0].name=fast,storageClasses[0].backend=ram,\
         storageClasses[0].default=true,storageClasses[0].parameters.queues=4",
        &[CLASSES],
        &[],
    ),
    (
        "a platform team's values",
        "global.team=storage,labels.team=storage,podLabels.team=storage,\
         podAnnotations.owner=oncall,priorityClassName=ublkd-critical,\
         affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].\
         matchExpressions[0].key=storage,affinity.nodeAffinity.\
         requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms[0].matchExpressions[0].\
         operator=Exists,nodeLoss.enabled=false,storageClasses[0].name=fast,\
         storageClasses[0].backend=ram,storageClasses[0].mountOptions[0]=noatime,\
         storageClasses[0].annotations.team=storage",
        &[PLATFORM],
        &[],
    ),
];

/// The file `cargo xtask manifests` writes: a header, the Namespace (a release lives in a
/// namespace made before it, so the chart has none), then the chart's default render without
/// its hooks (the uninstall step is a command for kubectl users: docs/kubernetes.md), Helm's
/// own two labels (nothing here is managed by Helm) or its `# Source:` lines (the header names
/// the chart).
fn render(helm: &Path, ws: &Path) -> Result<String> {
    let chart = helm::template(helm, ws, "", false)?;
    let helms = ["helm.sh/chart: ", "app.kubernetes.io/managed-by: "];
    let body: Vec<&str> = chart
        .lines()
        .filter(|l| !helms.iter().any(|h| l.trim_start().starts_with(h)))
        .filter(|l| !l.starts_with("# Source: "))
        .collect();
    Ok(format!(
        "# The Helm chart deploy/helm/ublkd rendered with its default values by `cargo xtask\n\
         # manifests`; do not edit (the host tests fail when this is not the chart's render).\n\
         # `kubectl apply -k deploy/kubernetes` installs it; for remote access, snapshots,\n\
         # ModifyVolume or another kubelet directory use the chart's values (deploy/README.md).\n\
         # The namespace ublkd runs in: its pods are privileged (they drive the kernel's ublk\n\
         # driver), so Pod Security Admission must allow the \"privileged\" level here.\n\
         apiVersion: v1\n\
         kind: Namespace\n\
         metadata:\n  name: {}\n  labels:\n    app.kubernetes.io/part-of: ublkd\n\
         \x20   pod-security.kubernetes.io/enforce: privileged\n\
         \x20   pod-security.kubernetes.io/audit: privileged\n\
         \x20   pod-security.kubernetes.io/warn: privileged\n{}\n",
        helm::NAMESPACE,
        body.join("\n")
    ))
}

/// The objects kubectl reads from `input` (`-f -` for `yaml`, `-k DIR`), as JSON: offline,
/// `label --local` that removes a label no object has prints each object as it read it.
fn objects(kubectl: &Path, input: &[&str], yaml: &str) -> Result<Vec<Value>> {
    let mut child = Command::new(kubectl)
        .args(["label", "--local", "-o", "json", "xtask-none-"])
        .args(input)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("running kubectl label --local")?;
    let mut stdin = child.stdin.take().context("kubectl's stdin")?;
    // Written while kubectl's output is read: it prints each object as it reads the next.
    let yaml = yaml.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(yaml.as_bytes()));
    let out = child.wait_with_output().context("running kubectl")?;
    let _ = writer.join(); // a write kubectl cut short shows in its status
    if !out.status.success() {
        bail!(
            "kubectl label --local {}: {}",
            input.join(" "),
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    serde_json::Deserializer::from_slice(&out.stdout)
        .into_iter()
        .collect::<Result<_, _>>()
        .context("reading kubectl's JSON")
}

/// A committed file `cargo xtask manifests` makes: written (`write`), or what is wrong when it
/// is not `text`.
fn generated(ws: &Path, rel: &str, text: &str, write: bool) -> Result<Option<String>> {
    if write {
        std::fs::write(ws.join(rel), text).with_context(|| format!("writing {rel}"))?;
        eprintln!("xtask: manifests: wrote {rel}");
    }
    let stale = std::fs::read_to_string(ws.join(rel)).unwrap_or_default() != text;
    Ok(stale.then(|| format!("{rel} is stale: run `cargo xtask manifests` and commit it")))
}

/// `cargo xtask manifests`: writes the render (`write`) or checks that the committed one is
/// current, then runs every check; kubectl (Debian's kubernetes-client) and helm are installed
/// when missing, never skipped.
pub fn manifest_checks(ws: &Path, write: bool) -> Result<()> {
    let kubectl = crate::apt::require("kubectl", "kubernetes-client")?;
    let helm = crate::gotools::ensure(helm::HELM)?;
    let rendered = render(&helm, ws)?;
    let mut problems = Vec::new();
    problems.extend(generated(ws, RENDER, &rendered, write)?);
    let dir = ws.join("deploy/kubernetes");
    let installed = objects(&kubectl, &["-k", &dir.to_string_lossy()], "")?;
    // Every image the default install pulls, one per line: what an air-gapped site mirrors.
    let mut images: Vec<&str> = (installed.iter())
        .flat_map(|o| [o, o].into_iter().zip(["containers", "initContainers"]))
        .flat_map(|(o, c)| check::at(o, &format!("pod/{c}/*/image")))
        .filter_map(Value::as_str)
        .collect();
    images.sort();
    images.dedup();
    let images = images.iter().map(|i| format!("{i}\n")).collect::<String>();
    problems.extend(generated(ws, IMAGES, &images, write)?);
    let kustomize = "kubectl kustomize deploy/kubernetes";
    problems.extend(check::render(kustomize, &installed, &[KUSTOMIZE], &[]));
    for (name, sets, tables, checks) in RENDERS {
        eprintln!("xtask: manifests: the chart's {name}");
        let chart = helm::template(&helm, ws, sets, true)?;
        let objs = objects(&kubectl, &["-f", "-"], &chart)?;
        problems.extend(check::render(name, &objs, tables, checks));
    }
    problems.extend(helm::checks(&helm, ws)?);
    if !problems.is_empty() {
        bail!(
            "the Kubernetes manifests render wrong:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}
