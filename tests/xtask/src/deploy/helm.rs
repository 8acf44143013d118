//! The Helm chart `deploy/helm/ublkd`: `helm template`, and what only Helm does with it:
//! `helm lint --strict`, and the values it must refuse (its schema and its `fail`s).

use anyhow::{Context, Result};
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

/// `helm template` of the chart with `sets` (Helm's `--set`, comma-separated), in the
/// manifests' namespace, with or without its hooks.
pub(super) fn template(helm: &Path, ws: &Path, sets: &str, hooks: bool) -> Result<String> {
    let mut c = Command::new(helm);
    c.current_dir(ws)
        .args(["template", "ublkd", CHART, "--namespace", NAMESPACE]);
    if !hooks {
        c.arg("--no-hooks");
    }
    if !sets.is_empty() {
        c.args(["--set", sets]);
    }
    crate::apt::output_ok(&mut c).with_context(|| format!("helm template --set {sets}"))
}

/// Values the chart must refuse: `--set VALUES => what the refusal must say`.
const REFUSED: &[&str] = &[
    "storageClasses[0].name=x,storageClasses[0].backend=tape => /storageClasses/0/backend",
    "storageClasses[0].name=x,storageClasses[0].backend=file,storageClasses[0].root=/elsewhere => is not one of ublkd.fileRoots",
    "storageClasses[0].name=x,storageClasses[0].backend=nvme => namespace",
    "kubeletDir=relative => kubeletDir",
    "nodeLoss.lostAfter=0s => lostAfter",
    "typo=1 => typo",
    "monitoring.prometheusRule.enabled=true => monitoring.runbookUrl is required",
];

/// `helm lint --strict`, and each of `REFUSED` refused for its reason; problems are returned,
/// not raised, so that one run lists them all.
pub(super) fn checks(helm: &Path, ws: &Path) -> Result<Vec<String>> {
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
    for (sets, why) in REFUSED.iter().filter_map(|r| r.split_once(" => ")) {
        match template(helm, ws, sets, false) {
            Ok(_) => problems.push(format!("--set {sets} rendered; it must be refused")),
            Err(e) if !format!("{e:#}").contains(why) => problems.push(format!(
                "--set {sets} was refused without saying {why:?}: {e:#}"
            )),
            Err(_) => {}
        }
    }
    problems.extend(values_reference(ws)?);
    Ok(problems)
}

/// The chart README's values table against the schema: every key of the schema is a row, or
/// inside one, or around some; every row is a key of the schema.
fn values_reference(ws: &Path) -> Result<Vec<String>> {
    let schema: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(
        ws.join(CHART).join("values.schema.json"),
    )?)?;
    let mut keys = Vec::new();
    let mut walk = vec![(String::new(), &schema)];
    while let Some((at, v)) = walk.pop() {
        // A `$ref` (the sidecars' shared definition) read where it points.
        let v = (v["$ref"].as_str())
            .and_then(|r| schema.pointer(r.trim_start_matches('#')))
            .unwrap_or(v);
        for (k, v) in v["properties"].as_object().into_iter().flatten() {
            keys.push(format!("{at}{k}"));
            walk.push((format!("{at}{k}."), v));
        }
    }
    let readme = std::fs::read_to_string(ws.join(CHART).join("README.md"))?;
    let table: Vec<&str> = (readme.lines().filter_map(|l| l.strip_prefix("| `")))
        .filter_map(|l| l.split('`').next())
        .collect();
    let within = |k: &str, t: &str| k == t || k.starts_with(&format!("{t}."));
    let missing = (keys.iter()).filter(|k| !table.iter().any(|t| within(k, t) || within(t, k)));
    let unknown = table.iter().filter(|t| !keys.iter().any(|k| k == *t));
    Ok(
        (missing.map(|k| format!("{CHART}/README.md's values table lacks {k}")))
            .chain(unknown.map(|t| {
                format!("{CHART}/README.md's values table names {t}, which the schema lacks")
            }))
            .collect(),
    )
}
