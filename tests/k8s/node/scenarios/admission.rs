//! The chart's pods under the admission policies: requests, limits, securityContext, Pod Security "restricted" and the OPA rules.

use crate::kube::Sc;
use anyhow::{ensure, Context, Result};
use serde_json::{json, Value};

/// What admission policies ask of the installed chart: every container of ublkd-system's pods
/// requests CPU and memory, has a memory limit (ublkd admits volumes within its own) and a
/// securityContext;
/// each Deployment's pod is admitted in a namespace that enforces Pod Security "restricted";
/// and OPA, built from its module, denies nothing in the packaged chart's default render.
pub fn admission(s: &Sc) -> Result<()> {
    let json = |args: &[&str]| -> Result<Value> { Ok(serde_json::from_str(&s.q(args)?)?) };
    let pods = json(&["-n", "ublkd-system", "get", "pods", "-o", "json"])?;
    let (mut wrong, mut seen) = (Vec::new(), 0);
    for p in pods["items"].as_array().into_iter().flatten() {
        let (pod, spec) = (p["metadata"]["name"].as_str().unwrap_or("?"), &p["spec"]);
        let all = ["initContainers", "containers"].map(|k| spec[k].as_array().cloned());
        for c in all.into_iter().flatten().flatten() {
            let (name, r) = (c["name"].as_str().unwrap_or("?"), &c["resources"]);
            seen += 1;
            if r["requests"]["cpu"].is_null() || r["requests"]["memory"].is_null() {
                wrong.push(format!("{pod}/{name}: no CPU or memory request"));
            }
            if r["limits"]["memory"].is_null() {
                wrong.push(format!("{pod}/{name}: no memory limit"));
            }
            if c["securityContext"].is_null() {
                wrong.push(format!("{pod}/{name}: no securityContext"));
            }
        }
    }
    s.say(format!("{seen} containers looked at; wrong: {wrong:?}"));
    ensure!(
        seen >= 8 && wrong.is_empty(),
        "every container fits the policies: {wrong:?}"
    );
    let ns = "ublkd-restricted";
    let labels = json!({"pod-security.kubernetes.io/enforce": "restricted"});
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns, "labels": labels}});
    s.apply(&namespace.to_string())?;
    let deployments = json(&["-n", "ublkd-system", "get", "deployments", "-o", "json"])?;
    let (mut admitted, mut refused) = (0, None);
    for d in deployments["items"].as_array().into_iter().flatten() {
        let name = d["metadata"]["name"].as_str().unwrap_or("?");
        // Its service account is in ublkd-system only: the namespace's default stands in.
        let mut spec = d["spec"]["template"]["spec"].clone();
        if let Some(m) = spec.as_object_mut() {
            m.remove("serviceAccountName");
            m.remove("serviceAccount");
        }
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns}, "spec": spec});
        let out = s.dry_run(ns, &pod.to_string());
        s.say(format!("{name}: {out:?}"));
        refused = refused.or(out
            .err()
            .map(|e| e.context(format!("{name}'s pod under Pod Security \"restricted\""))));
        admitted += 1;
    }
    // The namespace goes whether or not a pod was refused.
    s.delete(&format!("namespace {ns}"))?;
    if let Some(e) = refused {
        return Err(e);
    }
    ensure!(admitted >= 2, "the controller and the resizer were tried");
    // A policy engine's verdict (OPA, its rules in tests/k8s/policy) on the packaged chart's
    // default render, and on a Deployment made as those rules forbid: the rules can refuse.
    let deny = |render: &str| -> Result<Vec<String>> {
        let v = s.opa(&json!({"render": render}), "data.ublkd.admission.deny")?;
        let list = v.as_array().context("OPA's deny is not a set")?;
        Ok(list
            .iter()
            .filter_map(|m| m.as_str().map(str::to_owned))
            .collect())
    };
    let render = s.helm_chart("template", &[])?;
    let denied = deny(&render)?;
    s.say(format!("OPA on the default render: {denied:?}"));
    ensure!(
        denied.is_empty(),
        "OPA denies the default render: {denied:?}"
    );
    let bad = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: bad}\nspec: {template: \
               {metadata: {labels: {}}, spec: {containers: [{name: c, image: busybox}]}}}\n";
    let denied = deny(&format!("{render}\n---\n{bad}"))?;
    s.say(format!("OPA on a bad Deployment: {denied:?}"));
    for rule in [
        "no resources.requests.cpu",
        "no securityContext",
        "no tag or digest",
        "lack the label app.kubernetes.io/name",
        "runAsNonRoot is not true",
        "capabilities do not drop ALL",
    ] {
        ensure!(
            denied
                .iter()
                .any(|m| m.starts_with("Deployment bad") && m.contains(rule)),
            "OPA did not deny a Deployment with {rule}: {denied:?}"
        );
    }
    Ok(())
}
