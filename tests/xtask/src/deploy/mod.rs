//! The Kubernetes objects have one source, the Helm chart `deploy/helm/ublkd`. `cargo xtask
//! manifests` renders its defaults into `deploy/kubernetes/ublkd.yaml` (what `kubectl apply -k
//! deploy/kubernetes` installs, for those without Helm); the host tier renders it again and fails
//! when the committed file is not that render. Then the chart, rendered with each option on
//! (remote access, cert-manager, snapshots, ModifyVolume), must hold what the option needs
//! (`base`, `components`), and `helm` checks what only the chart does (lint, schema, hooks,
//! monitoring, another kubelet directory, versions).

use anyhow::{bail, Context, Result};
use std::path::Path;

mod base;
mod components;
pub mod helm;
mod yaml;

#[cfg(test)]
mod tests;

use components::{
    check_cert_manager, check_csi_modify_volume, check_csi_snapshots, check_remote_access,
};
use yaml::{objects, Object};

/// The committed render of the chart's defaults, from the workspace root.
pub const RENDER: &str = "deploy/kubernetes/ublkd.yaml";

/// What one option of the chart must add to the render, given its objects.
type OptionCheck = fn(&[Object]) -> Vec<String>;

/// The chart's options as the checks render them: a name, the values set, and the checks of
/// what each must add (the base's checks run on every render).
const OPTIONS: &[(&str, &[&str], &[OptionCheck])] = &[
    ("defaults", &[], &[]),
    (
        "remote access",
        &["remoteAccess.enabled=true"],
        &[check_remote_access],
    ),
    (
        "remote access with cert-manager",
        &[
            "remoteAccess.enabled=true",
            "remoteAccess.certManager.enabled=true",
        ],
        &[check_remote_access, check_cert_manager],
    ),
    (
        "snapshots",
        &["snapshots.enabled=true"],
        &[check_csi_snapshots],
    ),
    (
        "ModifyVolume",
        &["remoteAccess.enabled=true", "modifyVolume.enabled=true"],
        &[check_remote_access, check_csi_modify_volume],
    ),
];

/// The release's Namespace: a release lives in a namespace made before it, so the chart has
/// none; the render for kubectl users carries it.
fn namespace() -> String {
    format!(
        "# The namespace ublkd runs in: its pods are privileged (they drive the kernel's ublk\n\
         # driver), so Pod Security Admission must allow the \"privileged\" level here.\n\
         apiVersion: v1\n\
         kind: Namespace\n\
         metadata:\n  name: {}\n  labels:\n    app.kubernetes.io/part-of: ublkd\n\
         \x20   pod-security.kubernetes.io/enforce: privileged\n\
         \x20   pod-security.kubernetes.io/audit: privileged\n\
         \x20   pod-security.kubernetes.io/warn: privileged\n",
        helm::NAMESPACE
    )
}

/// The chart rendered with `sets`, without its hooks (the uninstall step is a command for
/// kubectl users: docs/kubernetes.md), without Helm's own two labels (nothing here is
/// managed by Helm) and without Helm's `# Source:` line above each object (the header names
/// the chart), after the Namespace.
fn render_with(helm: &Path, ws: &Path, sets: &[&str]) -> Result<String> {
    let chart = helm::template(helm, ws, sets, false)?;
    let body: Vec<&str> = chart
        .lines()
        .filter(|l| !helm::is_helm_label(l) && !l.starts_with("# Source: "))
        .collect();
    Ok(format!("{}{}\n", namespace(), body.join("\n")))
}

/// The file `cargo xtask manifests` writes: a header, then the chart's default render.
pub fn render(helm: &Path, ws: &Path) -> Result<String> {
    Ok(format!(
        "# The Helm chart deploy/helm/ublkd rendered with its default values by `cargo xtask\n\
         # manifests`; do not edit (the host tests fail when this is not the chart's render).\n\
         # `kubectl apply -k deploy/kubernetes` installs it; for remote access, snapshots,\n\
         # ModifyVolume or another kubelet directory use the chart's values (deploy/README.md).\n{}",
        render_with(helm, ws, &[])?
    ))
}

/// `cargo xtask manifests`: writes the render (`write`) or checks that the committed one is
/// current, then runs every check; kubectl (Debian's kubernetes-client) and helm are installed
/// when missing, never skipped.
pub fn manifest_checks(ws: &Path, write: bool) -> Result<()> {
    if crate::apt::which("kubectl").is_none() {
        crate::apt::install_packages(&["kubernetes-client"])?;
    }
    let kubectl = crate::apt::which("kubectl").context("kubectl not found after installing it")?;
    let helm = crate::gotools::ensure(helm::HELM)?;
    let mut problems = Vec::new();
    let rendered = render(&helm, ws)?;
    let path = ws.join(RENDER);
    if write {
        std::fs::write(&path, &rendered).with_context(|| format!("writing {RENDER}"))?;
        eprintln!("xtask: manifests: wrote {RENDER}");
    } else if std::fs::read_to_string(&path).unwrap_or_default() != rendered {
        problems.push(format!(
            "{RENDER} is not the chart's render: run `cargo xtask manifests` and commit it"
        ));
    }
    // What kubectl users install renders, and holds the Namespace and the chart's objects.
    let kustomized = helm::kustomize(&kubectl, &ws.join("deploy/kubernetes"))?;
    if !objects(&kustomized)
        .iter()
        .any(|o| o.kind == "Namespace" && o.name == helm::NAMESPACE)
    {
        problems.push("kubectl kustomize deploy/kubernetes has no Namespace".into());
    }
    let scratch = std::env::temp_dir().join(format!("xtask-manifests-{}", std::process::id()));
    for (name, sets, checks) in OPTIONS {
        eprintln!("xtask: manifests: the chart's {name}");
        let text = helm::normalise(&kubectl, &render_with(&helm, ws, sets)?, &scratch)?;
        let mut found = base::check(&text);
        if sets.is_empty() {
            found.extend(base::check_base_is_local(&text));
        }
        let objs = objects(&text);
        for check in *checks {
            found.extend(check(&objs));
        }
        problems.extend(found.into_iter().map(|p| format!("{name}: {p}")));
    }
    // Only the scratch copy of a render: nothing to keep.
    let _ = std::fs::remove_dir_all(&scratch);
    problems.extend(helm::checks(&helm, ws)?);
    if !problems.is_empty() {
        bail!(
            "the Kubernetes manifests render wrong:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}
