//! What the plugin prints, from what it read: pure functions over plain data, tested on the
//! host.

use crate::cluster::{age_seconds, Location, Report};
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::BTreeMap;
use ublkd_csi::nodestatus::{Limits, NodeStatus, VolumeStatus};

/// Columns padded to their widest cell, two spaces apart, the header first.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for r in rows {
        for (i, c) in r.iter().enumerate() {
            if let Some(w) = widths.get_mut(i) {
                *w = (*w).max(c.len());
            }
        }
    }
    let line = |cells: Vec<&str>| -> String {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                s.push_str(c);
            } else {
                s.push_str(&format!("{c:<w$}  ", w = widths[i]));
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(header.to_vec());
    for r in rows {
        out.push_str(&line(r.iter().map(String::as_str).collect()));
    }
    out
}

/// The ids of a node's volumes that could be without a PV: not those still CREATING (an NVMe
/// window's erase can take minutes before CreateVolume returns and the provisioner makes the
/// PV; review L5, issue 55).
pub fn settled_ids(volumes: &[ublkd_csi::nodestatus::VolumeStatus]) -> Vec<String> {
    volumes
        .iter()
        .filter(|v| !v.is_creating())
        .map(|v| v.id.clone())
        .collect()
}

/// The ublkd volumes of `node` that no PersistentVolume of the driver names: their PV is gone
/// (deleted with the reclaim policy Retain, or removed by hand), or they were made outside
/// Kubernetes. Never deleted by the plugin; each is for a person to look at.
pub fn volumes_without_pv(node: &str, volumes: &[String], pvs: &[Location]) -> Vec<String> {
    volumes
        .iter()
        .filter(|v| {
            !pvs.iter()
                .any(|l| &l.volume == *v && l.node.as_deref().is_none_or(|n| n == node))
        })
        .cloned()
        .collect()
}

/// Per node, the volumes both looks found without a PV, in the second look's order.
pub fn in_both(
    first: &BTreeMap<String, Vec<String>>,
    second: &BTreeMap<String, Vec<String>>,
) -> BTreeMap<String, Vec<String>> {
    second
        .iter()
        .map(|(node, now)| {
            let before = first.get(node).map(Vec::as_slice).unwrap_or_default();
            let kept = now.iter().filter(|v| before.contains(v)).cloned().collect();
            (node.clone(), kept)
        })
        .collect()
}

/// What an orphan is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum OrphanKind {
    VolumeWithoutPv,
    DeviceWithoutVolume,
}

/// One line of `orphans`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Orphan {
    pub node: String,
    pub kind: OrphanKind,
    pub name: String,
}

pub fn orphans_text(rows: &[Orphan]) -> String {
    if rows.is_empty() {
        return "no orphans\n".into();
    }
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|o| {
            let kind = match o.kind {
                OrphanKind::VolumeWithoutPv => "volume without PV",
                OrphanKind::DeviceWithoutVolume => "device without volume",
            };
            vec![o.node.clone(), kind.into(), o.name.clone()]
        })
        .collect();
    table(&["NODE", "KIND", "NAME"], &cells)
}

/// ` (the report is partial: ...)` when the node plugin could not read everything.
pub fn partial(s: &NodeStatus) -> String {
    if s.error.is_empty() {
        String::new()
    } else {
        format!(" (the report is partial: {})", s.error)
    }
}

/// A volume's limits as `read 100 IOPS, write 4194304 B/s`, or `unlimited`.
pub fn limits_text(l: &Limits) -> String {
    let parts: Vec<String> = [
        (l.read_iops, "read", "IOPS"),
        (l.write_iops, "write", "IOPS"),
        (l.read_bytes_per_second, "read", "B/s"),
        (l.write_bytes_per_second, "write", "B/s"),
    ]
    .iter()
    .filter(|(n, _, _)| *n > 0)
    .map(|(n, dir, unit)| format!("{dir} {n} {unit}"))
    .collect();
    if parts.is_empty() {
        "unlimited".into()
    } else {
        parts.join(", ")
    }
}

/// `pvc`'s text: one `key: value` per line, then the I/O counters.
pub fn pvc_text(claim: &str, pv: &str, report: &Report, v: &VolumeStatus) -> String {
    let age = age_seconds(&report.status.reported_at).map_or("?".into(), |s| format!("{s}s"));
    let mut out = String::new();
    for (k, val) in [
        ("claim", claim.to_owned()),
        ("pv", pv.to_owned()),
        ("node", report.node.clone()),
        ("volume", v.id.clone()),
        ("state", v.state.clone()),
        ("device", v.device.clone()),
        ("backend", v.backend.name().to_owned()),
        ("size", format!("{} bytes", v.size_bytes)),
        ("qos", limits_text(&v.limits)),
        (
            "reported",
            format!("{} ({age} ago)", report.status.reported_at),
        ),
    ] {
        out.push_str(&format!("{:<13} {val}\n", format!("{k}:")));
    }
    if !v.message.is_empty() {
        out.push_str(&format!("{:<13} {}\n", "message:", v.message));
    }
    out.push('\n');
    match &v.io {
        Some(io) => out.push_str(&table(
            &["OP", "COUNT", "BYTES"],
            &[
                vec![
                    "read".into(),
                    io.reads.to_string(),
                    io.read_bytes.to_string(),
                ],
                vec![
                    "write".into(),
                    io.writes.to_string(),
                    io.write_bytes.to_string(),
                ],
                vec!["errors".into(), io.errors.to_string(), "-".into()],
            ],
        )),
        None => out.push_str(&format!("no I/O counters{}\n", partial(&report.status))),
    }
    out
}

/// One node's line of `nodes`.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRow {
    pub node: String,
    /// The node's ublkd pod, when one runs.
    pub pod: Option<String>,
    /// Its node plugin's report, when it wrote one.
    pub status: Option<NodeStatus>,
    /// (class, capacity) from the node's CSIStorageCapacity objects.
    pub capacity: Vec<(String, String)>,
}

fn failing_checks(s: &NodeStatus) -> Vec<String> {
    s.checks
        .iter()
        .filter(|c| !c.ok)
        .map(|c| json!(c.name).as_str().unwrap_or("?").to_owned())
        .collect()
}

/// A node's row as JSON: its report whole, and what the table shows.
pub fn node_json(r: &NodeRow) -> Value {
    json!({
        "node": r.node,
        "ublkdPod": r.pod,
        "reportAgeSeconds": r.status.as_ref().and_then(|s| age_seconds(&s.reported_at)),
        "capacity": r.capacity.iter().cloned().collect::<BTreeMap<String, String>>(),
        "status": r.status,
    })
}

/// `nodes`: each node with its report's age, ublkd's version, its volume and orphan-device
/// counts, its failing checks and the capacity the scheduler sees per class.
pub fn nodes_table(rows: &[NodeRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let capacity = if r.capacity.is_empty() {
                "-".to_owned()
            } else {
                r.capacity
                    .iter()
                    .map(|(c, b)| format!("{c}={b}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            let (age, version, volumes, orphans, checks) = match &r.status {
                Some(s) => {
                    let failing = failing_checks(s);
                    (
                        age_seconds(&s.reported_at).map_or("?".into(), |a| format!("{a}s")),
                        if s.ublkd_version.is_empty() {
                            "?".into()
                        } else {
                            s.ublkd_version.clone()
                        },
                        s.volumes.len().to_string(),
                        s.orphan_devices.len().to_string(),
                        if failing.is_empty() {
                            "ok".into()
                        } else {
                            failing.join(",")
                        },
                    )
                }
                None => (
                    "never".into(),
                    "-".into(),
                    "-".into(),
                    "-".into(),
                    "no-report".into(),
                ),
            };
            vec![
                r.node.clone(),
                age,
                version,
                volumes,
                orphans,
                checks,
                capacity,
            ]
        })
        .collect();
    table(
        &[
            "NODE",
            "REPORTED",
            "VERSION",
            "VOLUMES",
            "ORPHAN DEVICES",
            "CHECKS",
            "CAPACITY (per class)",
        ],
        &cells,
    )
}

/// The capacity objects grouped by node: class and bytes, in class order.
pub fn capacity_by_node(
    list: &[(String, String, String)],
) -> BTreeMap<String, Vec<(String, String)>> {
    let mut by: BTreeMap<String, Vec<(String, String)>> = BTreeMap::new();
    for (node, class, bytes) in list {
        by.entry(node.clone())
            .or_default()
            .push((class.clone(), bytes.clone()));
    }
    for v in by.values_mut() {
        v.sort();
    }
    by
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(volume: &str, node: Option<&str>) -> Location {
        Location {
            pv: format!("pv-{volume}"),
            volume: volume.into(),
            node: node.map(str::to_owned),
        }
    }

    /// A volume counts as without PV only when both looks found it so: one whose PV appeared
    /// in between (a claim being provisioned) is not listed, nor one that went.
    /// A volume still CREATING (an NVMe window erasing for minutes) is never listed as
    /// without a PV: the provisioner makes the PV once CreateVolume returns (review L5).
    #[test]
    fn a_volume_still_creating_is_not_without_a_pv() {
        let vol = |id: &str, state: &str| ublkd_csi::nodestatus::VolumeStatus {
            id: id.into(),
            state: state.into(),
            ..Default::default()
        };
        let vols = [
            vol("erasing", "creating"),
            vol("stray", "ready"),
            vol("bad", "failed"),
        ];
        assert_eq!(settled_ids(&vols), ["stray", "bad"]);
    }

    #[test]
    fn only_volumes_without_pv_in_both_looks_are_listed() {
        let map = |v: &[(&str, &[&str])]| -> BTreeMap<String, Vec<String>> {
            v.iter()
                .map(|(n, vs)| (n.to_string(), vs.iter().map(|s| s.to_string()).collect()))
                .collect()
        };
        let first = map(&[("n1", &["stray", "new"]), ("n2", &["gone"])]);
        let second = map(&[("n1", &["stray", "later"]), ("n2", &[])]);
        assert_eq!(
            in_both(&first, &second),
            map(&[("n1", &["stray"]), ("n2", &[])])
        );
    }

    #[test]
    fn a_volume_named_by_a_pv_of_its_node_is_not_an_orphan() {
        let pvs = [loc("a", Some("n1")), loc("b", Some("n2")), loc("c", None)];
        let on_n1 = ["a", "b", "c", "d"].map(String::from);
        assert_eq!(volumes_without_pv("n1", &on_n1, &pvs), ["b", "d"]);
        assert!(volumes_without_pv("n1", &[], &pvs).is_empty());
    }

    #[test]
    fn the_nodes_table_has_counts_checks_and_capacity() {
        use ublkd_csi::nodestatus::{Check, CheckName, OrphanDevice};
        let status = NodeStatus {
            reported_at: "2026-12-05T20:00:00Z".into(),
            ublkd_version: "0.1.0".into(),
            volumes: vec![VolumeStatus::default(); 3],
            orphan_devices: vec![OrphanDevice::default()],
            checks: vec![Check {
                name: CheckName::ReflinkRoots,
                ok: false,
                detail: "x".into(),
            }],
            ..Default::default()
        };
        let rows = [
            NodeRow {
                node: "n1".into(),
                pod: Some("ublkd-a".into()),
                status: Some(status),
                capacity: vec![("ublkd-ram".into(), "1Gi".into())],
            },
            NodeRow {
                node: "n2".into(),
                pod: Some("ublkd-b".into()),
                status: None,
                capacity: vec![],
            },
        ];
        let t = nodes_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NODE"), "{t}");
        let n1: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(n1[0], "n1");
        assert!(n1[1].ends_with('s'), "{t}");
        assert_eq!(
            n1[2..],
            ["0.1.0", "3", "1", "reflink-roots", "ublkd-ram=1Gi"]
        );
        assert!(
            lines[2].contains("never") && lines[2].contains("no-report"),
            "{t}"
        );
        assert_eq!(node_json(&rows[1])["status"], Value::Null);
        assert_eq!(node_json(&rows[0])["status"]["ublkdVersion"], "0.1.0");
    }

    #[test]
    fn limits_and_orphans_read_as_words() {
        assert_eq!(limits_text(&Limits::default()), "unlimited");
        let l = Limits {
            write_bytes_per_second: 4 << 20,
            read_iops: 100,
            ..Default::default()
        };
        assert_eq!(limits_text(&l), "read 100 IOPS, write 4194304 B/s");
        assert_eq!(orphans_text(&[]), "no orphans\n");
        let o = Orphan {
            node: "n1".into(),
            kind: OrphanKind::VolumeWithoutPv,
            name: "stray".into(),
        };
        assert!(orphans_text(std::slice::from_ref(&o)).contains("n1    volume without PV  stray"));
        assert_eq!(json!(o)["kind"], "volume-without-pv");
    }

    #[test]
    fn capacity_is_grouped_by_node_in_class_order() {
        let by = capacity_by_node(&[
            ("n1".into(), "b".into(), "2".into()),
            ("n1".into(), "a".into(), "1".into()),
            ("n2".into(), "a".into(), "3".into()),
        ]);
        assert_eq!(
            by["n1"],
            [("a".into(), "1".into()), ("b".into(), "2".into())]
        );
        assert_eq!(by["n2"].len(), 1);
    }
}
