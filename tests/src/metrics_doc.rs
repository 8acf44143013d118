//! docs/metrics.md as data, held against what ublkd exposes: each family its tables name, with
//! its type and every label a series of it carries (the section's own labels, then the row's),
//! and the same read from a scrape. The VM test `observability.rs` compares a real scrape with
//! the document; the host tests here compare the document with the server's sources.

use std::collections::{BTreeMap, BTreeSet};

/// A family: its type and its label names.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Family {
    pub kind: String,
    pub labels: BTreeSet<String>,
}

/// The labels every family of a section carries, by its heading.
fn section_labels(heading: &str) -> &'static [&'static str] {
    match heading {
        "Volumes" => &["volume", "pvc_namespace", "pvc"],
        "Capacity pools" => &["backend", "pool"],
        "Workers" => &["worker"],
        _ => &[],
    }
}

/// The backticked words of a table cell.
fn ticked(cell: &str) -> impl Iterator<Item = &str> {
    cell.split('`').skip(1).step_by(2)
}

/// Every family docs/metrics.md's tables name (`process_*`, the crate's collector, left out).
pub fn documented(doc: &str) -> BTreeMap<String, Family> {
    let mut out = BTreeMap::new();
    let (mut base, mut label_col): (&[&str], _) = (&[], None);
    for line in doc.lines() {
        if let Some(h) = line.strip_prefix("## ") {
            (base, label_col) = (section_labels(h.trim()), None);
            continue;
        }
        if !line.starts_with('|') {
            // A table the text says is "without labels" takes none of its section's.
            if line.contains("without labels") {
                base = &[];
            }
            label_col = None;
            continue;
        }
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        if cells.get(1) == Some(&"family") {
            label_col = cells.iter().position(|c| c.ends_with("labels"));
            continue;
        }
        let Some(name) = cells.get(1).and_then(|c| ticked(c).next()) else {
            continue;
        };
        if !name.starts_with("ublkd_") {
            continue;
        }
        let mut labels: BTreeSet<String> = base.iter().map(|l| (*l).to_owned()).collect();
        if let Some(cell) = label_col.and_then(|i| cells.get(i)) {
            labels.extend(ticked(cell).map(str::to_owned));
        }
        let kind = cells.get(2).copied().unwrap_or_default().to_owned();
        out.insert(name.to_owned(), Family { kind, labels });
    }
    out
}

/// Every family of a text exposition, with the label names its samples carry (`le` of a
/// histogram's buckets left out).
pub fn scraped(text: &str) -> BTreeMap<String, Family> {
    let mut out: BTreeMap<String, Family> = BTreeMap::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            if let Some((name, kind)) = rest.split_once(' ') {
                out.insert(
                    name.to_owned(),
                    Family {
                        kind: kind.trim().to_owned(),
                        labels: BTreeSet::new(),
                    },
                );
            }
            continue;
        }
        if line.starts_with('#') || line.trim().is_empty() {
            continue;
        }
        let series = line.rsplit_once(' ').map_or(line, |(s, _)| s);
        let (name, labels) = series.split_once('{').unwrap_or((series, ""));
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .filter_map(|s| name.strip_suffix(s))
            .find(|base| out.get(*base).is_some_and(|f| f.kind == "histogram"))
            .unwrap_or(name);
        let Some(f) = out.get_mut(family) else {
            continue;
        };
        for pair in labels.trim_end_matches('}').split("\",") {
            if let Some((k, _)) = pair.split_once("=\"") {
                if k != "le" {
                    f.labels.insert(k.trim_start_matches(',').to_owned());
                }
            }
        }
    }
    out
}

/// Where `scrape`'s ublkd families disagree with `doc`: undocumented ones, another type, other
/// labels.
pub fn disagreements(
    doc: &BTreeMap<String, Family>,
    scrape: &BTreeMap<String, Family>,
) -> Vec<String> {
    let mut wrong = Vec::new();
    for (name, got) in scrape.iter().filter(|(n, _)| n.starts_with("ublkd_")) {
        match doc.get(name) {
            None => wrong.push(format!("{name}: exposed, not in docs/metrics.md")),
            Some(want) if want.kind != got.kind => wrong.push(format!(
                "{name}: exposed as {}, documented as {}",
                got.kind, want.kind
            )),
            Some(want) if want.labels != got.labels => wrong.push(format!(
                "{name}: labels {:?} exposed, {:?} documented",
                got.labels, want.labels
            )),
            Some(_) => {}
        }
    }
    wrong
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn repo(path: &str) -> String {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(path);
        std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
    }

    #[test]
    fn the_document_reads_as_families_with_their_labels() {
        let doc = documented(&repo("docs/metrics.md"));
        assert!(doc.len() >= 30, "{}", doc.len());
        let info = &doc["ublkd_volume_info"];
        let want = [
            "volume",
            "pvc_namespace",
            "pvc",
            "backend",
            "device",
            "io_path",
            "zero_copy",
            "poll",
        ];
        assert_eq!(info.labels, want.iter().map(|s| s.to_string()).collect());
        assert_eq!(doc["ublkd_capacity_up"].labels.len(), 2);
        assert_eq!(doc["ublkd_volume_io_duration_seconds"].kind, "histogram");
        assert_eq!(doc["ublkd_grpc_requests_total"].labels.len(), 2);
        assert!(
            doc["ublkd_volumes"].labels.is_empty(),
            "node-wide, without labels"
        );
    }

    /// Both ways by name: each family the document names is written by the server (a string
    /// of its sources), and each `ublkd_` family the server writes is in the document.
    #[test]
    fn the_document_and_the_servers_sources_name_the_same_families() {
        let doc = documented(&repo("docs/metrics.md"));
        let mut code = BTreeSet::new();
        for dir in ["server/src", "server/src/metrics"] {
            let at = Path::new(env!("CARGO_MANIFEST_DIR")).join("..").join(dir);
            for f in std::fs::read_dir(at).unwrap() {
                let f = f.unwrap().path();
                if f.extension().is_some_and(|e| e == "rs") {
                    let text = std::fs::read_to_string(&f).unwrap();
                    // The shipped code: what its inline tests name is not exposed.
                    let shipped = text.split("#[cfg(test)]").next().unwrap_or_default();
                    for s in shipped.split('"').skip(1).step_by(2) {
                        let family = s.len() > 6
                            && s.starts_with("ublkd_")
                            && s.bytes().all(|b| b.is_ascii_lowercase() || b == b'_');
                        if family {
                            code.insert(s.to_owned());
                        }
                    }
                }
            }
        }
        let documented: BTreeSet<String> = doc.keys().cloned().collect();
        assert_eq!(
            documented.difference(&code).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "documented, never written"
        );
        assert_eq!(
            code.difference(&documented).collect::<Vec<_>>(),
            Vec::<&String>::new(),
            "written, not documented"
        );
    }

    #[test]
    fn a_scrape_reads_as_families_and_disagreements_are_named() {
        let text = "# TYPE ublkd_a_total counter\nublkd_a_total{volume=\"v\",op=\"read\"} 1\n\
                    # TYPE ublkd_h_seconds histogram\nublkd_h_seconds_bucket{m=\"x\",le=\"1\"} 1\n\
                    ublkd_h_seconds_sum{m=\"x\"} 1\nublkd_h_seconds_count{m=\"x\"} 1\n\
                    # TYPE ublkd_new gauge\nublkd_new 1\n";
        let s = scraped(text);
        assert_eq!(
            s["ublkd_h_seconds"].labels,
            BTreeSet::from(["m".to_owned()])
        );
        let mut doc = BTreeMap::new();
        doc.insert(
            "ublkd_a_total".to_owned(),
            Family {
                kind: "counter".into(),
                labels: BTreeSet::from(["volume".to_owned()]),
            },
        );
        doc.insert(
            "ublkd_h_seconds".to_owned(),
            Family {
                kind: "histogram".into(),
                labels: BTreeSet::from(["m".to_owned()]),
            },
        );
        let wrong = disagreements(&doc, &s);
        assert_eq!(wrong.len(), 2, "{wrong:?}");
        assert!(wrong[0].starts_with("ublkd_a_total: labels"), "{wrong:?}");
        assert!(wrong[1].starts_with("ublkd_new: exposed"), "{wrong:?}");
    }
}
