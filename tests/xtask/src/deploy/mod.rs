//! The Kubernetes manifests, rendered as an operator would (`kubectl kustomize
//! deploy/kubernetes`, and every overlay under `deploy/overlays`) and checked so they cannot
//! rot: every object is there, the sidecars get the arguments distributed provisioning needs, the
//! driver's mounts propagate, only the containers that must be privileged are, gRPC stays on the
//! unix socket unless the remote-access component is added, and each component an overlay uses
//! does what it says. The Helm chart (`helm`) must render the same objects as the base and each
//! overlay.

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

mod base;
mod components;
pub mod helm;
mod yaml;

#[cfg(test)]
mod tests;

use base::{check, check_base_is_local};
use components::{check_overlay, components_used};

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
    problems.extend(helm::checks(ws, &kubectl, |dir| render(&kubectl, ws, dir))?);
    if !problems.is_empty() {
        bail!(
            "the Kubernetes manifests render wrong:\n  {}",
            problems.join("\n  ")
        );
    }
    Ok(())
}
