//! What the plugin prints, from what it read: pure functions over plain data, tested on the
//! host.

use crate::cluster::Location;
use serde_json::Value;
use std::collections::BTreeMap;

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

/// The volume ids in `ublkctl -o json list-volumes`.
pub fn volume_ids(list: &Value) -> Vec<String> {
    list["volumes"]
        .as_array()
        .map(|vs| {
            vs.iter()
                .filter_map(|v| v["id"].as_str().map(str::to_owned))
                .collect()
        })
        .unwrap_or_default()
}

/// One node's line of `nodes`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeRow {
    pub node: String,
    pub pod: String,
    /// `ublkctl -o json node-info`, or why it could not be read.
    pub info: Result<Value, String>,
    /// (class, capacity) from the node's CSIStorageCapacity objects.
    pub capacity: Vec<(String, String)>,
}

/// `nodes`: each node with its ublkd pod, its volume and orphan-device counts and the capacity
/// the scheduler sees per class.
pub fn nodes_table(rows: &[NodeRow]) -> String {
    let cells: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let (volumes, orphans, version) = match &r.info {
                Ok(i) => (
                    i["volumes"].as_u64().map_or("?".into(), |n| n.to_string()),
                    i["orphans"]
                        .as_array()
                        .map_or("?".into(), |o| o.len().to_string()),
                    i["version"].as_str().unwrap_or("?").to_owned(),
                ),
                Err(e) => (format!("error: {e}"), "-".into(), "-".into()),
            };
            let capacity = if r.capacity.is_empty() {
                "-".to_owned()
            } else {
                r.capacity
                    .iter()
                    .map(|(c, b)| format!("{c}={b}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            };
            vec![
                r.node.clone(),
                r.pod.clone(),
                version,
                volumes,
                orphans,
                capacity,
            ]
        })
        .collect();
    table(
        &[
            "NODE",
            "UBLKD POD",
            "VERSION",
            "VOLUMES",
            "ORPHAN DEVICES",
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
    use serde_json::json;

    fn loc(volume: &str, node: Option<&str>) -> Location {
        Location {
            pv: format!("pv-{volume}"),
            volume: volume.into(),
            node: node.map(str::to_owned),
        }
    }

    /// A volume counts as without PV only when both looks found it so: one whose PV appeared
    /// in between (a claim being provisioned) is not listed, nor one that went.
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
    fn volume_ids_come_from_the_list() {
        let list = json!({"volumes": [{"id": "x"}, {"id": "y"}, {"no": 1}]});
        assert_eq!(volume_ids(&list), ["x", "y"]);
        assert!(volume_ids(&json!({})).is_empty());
    }

    #[test]
    fn the_nodes_table_has_counts_and_capacity() {
        let rows = [
            NodeRow {
                node: "n1".into(),
                pod: "ublkd-a".into(),
                info: Ok(json!({"version": "0.1.0", "volumes": 3, "orphans": [{}]})),
                capacity: vec![("ublkd-ram".into(), "1Gi".into())],
            },
            NodeRow {
                node: "n2".into(),
                pod: "ublkd-b".into(),
                info: Err("exec failed".into()),
                capacity: vec![],
            },
        ];
        let t = nodes_table(&rows);
        let lines: Vec<&str> = t.lines().collect();
        assert!(lines[0].starts_with("NODE"), "{t}");
        let n1: Vec<&str> = lines[1].split_whitespace().collect();
        assert_eq!(n1, ["n1", "ublkd-a", "0.1.0", "3", "1", "ublkd-ram=1Gi"]);
        assert!(lines[2].contains("error: exec failed"), "{t}");
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
