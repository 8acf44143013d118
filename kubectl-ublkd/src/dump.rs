//! `kubectl ublkd dump DIR`: what support asks for first, in one directory a read-only user can
//! make: `logs/POD.CONTAINER.log` for every container of every pod in ublkd's namespace,
//! `nodes/NODE.json` (each node's report), `orphans.json` (one look: volumes no PV names,
//! devices no volume owns), `check.json`, `pvs.json` (the driver's PersistentVolumes) and
//! `events.json` (ublkd's namespace, and every claim, PV and Node the driver touches). A part
//! that cannot be read is written as `FILE.error` with why, and the rest goes on.

use crate::cluster::{Cluster, Location};
use crate::{check, report};
use anyhow::{Context, Result};
use k8s_openapi::api::core::v1::Event;
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::path::Path;

/// The events a support engineer wants: those in ublkd's namespace, and those on the driver's
/// claims (`namespace/name`), PVs and on Nodes.
pub fn relevant_events(
    events: Vec<Event>,
    namespace: &str,
    claims: &BTreeSet<String>,
    pvs: &BTreeSet<String>,
) -> Vec<Event> {
    events
        .into_iter()
        .filter(|e| {
            let o = &e.involved_object;
            let name = o.name.clone().unwrap_or_default();
            let ns = o.namespace.clone().unwrap_or_default();
            e.metadata.namespace.as_deref() == Some(namespace)
                || match o.kind.as_deref() {
                    Some("PersistentVolumeClaim") => claims.contains(&format!("{ns}/{name}")),
                    Some("PersistentVolume") => pvs.contains(&name),
                    Some("Node") => true,
                    _ => false,
                }
        })
        .collect()
}

/// Writes `value` (or why it could not be read) to `dir/name`, and names the file written.
fn put(dir: &Path, name: &str, value: Result<Value>, written: &mut Vec<String>) -> Result<()> {
    let (name, text) = match value {
        Ok(v) => (name.to_owned(), serde_json::to_string_pretty(&v)?),
        Err(e) => (format!("{name}.error"), format!("{e:#}\n")),
    };
    let path = dir.join(&name);
    std::fs::write(&path, text).with_context(|| format!("writing {}", path.display()))?;
    written.push(name);
    Ok(())
}

/// Writes the bundle; the files written, relative to `dir`.
pub async fn write(cluster: &Cluster, dir: &Path) -> Result<Vec<String>> {
    for sub in ["logs", "nodes"] {
        std::fs::create_dir_all(dir.join(sub))
            .with_context(|| format!("making {}", dir.join(sub).display()))?;
    }
    let mut n = Vec::new();
    match cluster.pods().await {
        Ok(pods) => {
            for p in &pods {
                let pod = p.metadata.name.clone().unwrap_or_default();
                let containers = p.spec.iter().flat_map(|s| {
                    s.init_containers
                        .iter()
                        .flatten()
                        .chain(s.containers.iter())
                });
                for c in containers {
                    let file = dir.join("logs").join(format!("{pod}.{}.log", c.name));
                    let text = match cluster.log(&pod, &c.name).await {
                        Ok(t) => t,
                        Err(e) => format!("(no log: {e:#})\n"),
                    };
                    std::fs::write(&file, text)
                        .with_context(|| format!("writing {}", file.display()))?;
                    n.push(format!("logs/{pod}.{}.log", c.name));
                }
            }
        }
        Err(e) => put(dir, "logs", Err(e), &mut n)?,
    }
    let reports = cluster.reports().await;
    match &reports {
        Ok(reports) => {
            for r in reports {
                let name = format!("nodes/{}.json", r.node);
                put(dir, &name, Ok(json!(r.status)), &mut n)?;
            }
        }
        Err(e) => put(dir, "nodes", Err(anyhow::anyhow!("{e:#}")), &mut n)?,
    }
    let locations: Result<Vec<Location>> = cluster.locations().await;
    let orphans = match (&reports, &locations) {
        (Ok(reports), Ok(pvs)) => Ok(json!(reports
            .iter()
            .map(|r| {
                let ids = report::settled_ids(&r.status.volumes);
                json!({
                    "node": r.node,
                    "reportedAt": r.status.reported_at,
                    "volumesWithoutPv": report::volumes_without_pv(&r.node, &ids, pvs),
                    "orphanDevices": r.status.orphan_devices,
                })
            })
            .collect::<Vec<_>>())),
        (Err(e), _) | (_, Err(e)) => Err(anyhow::anyhow!("{e:#}")),
    };
    put(dir, "orphans.json", orphans, &mut n)?;
    let found = check::gather(cluster, 120).await.map(|f| json!(f));
    put(dir, "check.json", found, &mut n)?;
    let mut claims = BTreeSet::new();
    let mut pv_names = BTreeSet::new();
    let pvs = cluster.driver_volumes().await;
    if let Ok(pvs) = &pvs {
        for pv in pvs {
            pv_names.insert(pv.metadata.name.clone().unwrap_or_default());
            if let Some(c) = pv.spec.as_ref().and_then(|s| s.claim_ref.as_ref()) {
                claims.insert(format!(
                    "{}/{}",
                    c.namespace.as_deref().unwrap_or_default(),
                    c.name.as_deref().unwrap_or_default()
                ));
            }
        }
    }
    put(dir, "pvs.json", pvs.map(|p| json!(p)), &mut n)?;
    let events = cluster.events().await.map(|all| {
        json!(relevant_events(
            all,
            cluster.ublkd_namespace(),
            &claims,
            &pv_names
        ))
    });
    put(dir, "events.json", events, &mut n)?;
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(ns: &str, kind: &str, obj_ns: &str, name: &str) -> Event {
        serde_json::from_value(json!({
            "metadata": {"namespace": ns, "name": "e"},
            "involvedObject": {"kind": kind, "namespace": obj_ns, "name": name}
        }))
        .expect("an Event")
    }

    #[test]
    fn events_of_the_driver_and_its_namespace_are_kept() {
        let claims = BTreeSet::from(["app/data".to_owned()]);
        let pvs = BTreeSet::from(["pvc-1".to_owned()]);
        let all = vec![
            event("ublkd-system", "Pod", "ublkd-system", "ublkd-x"),
            event("app", "PersistentVolumeClaim", "app", "data"),
            event("app", "PersistentVolumeClaim", "app", "other"),
            event("default", "PersistentVolume", "", "pvc-1"),
            event("default", "Node", "", "n1"),
            event("app", "Pod", "app", "web"),
        ];
        let kept = relevant_events(all, "ublkd-system", &claims, &pvs);
        let names: Vec<String> = kept
            .iter()
            .map(|e| e.involved_object.name.clone().unwrap_or_default())
            .collect();
        assert_eq!(names, ["ublkd-x", "data", "pvc-1", "n1"]);
    }
}
