//! The import map of every crate in the workspace, read from its sources: which module names
//! which through `crate::` paths (in `use` lines and in code), outside its tests. Kept as a
//! host test so that no two modules of a crate come to import each other again: each module
//! points one way (ARCHITECTURE.md, "Crates and dependency direction").

use anyhow::{Context, Result};
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The source roots of the workspace's crates, relative to the workspace.
pub const CRATES: &[&str] = &[
    "proto/src",
    "client/src",
    "dataplane/src",
    "server/src",
    "cli/src",
    "csi/src",
    "kubectl-ublkd/src",
    "tests/src",
    "tests/xtask/src",
];

/// The files under `src` that glob-import their parent (`use super::*;`) outside their tests,
/// relative to `src`: such a file reaches everything its parent can, so what it depends on
/// is written nowhere.
pub fn parent_globs(src: &Path) -> Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    sources(src, &mut files)?;
    let mut found = Vec::new();
    for file in files {
        let text = std::fs::read_to_string(&file)
            .with_context(|| format!("reading {}", file.display()))?;
        if without_tests(&text)
            .lines()
            .any(|l| l.trim() == "use super::*;")
        {
            found.push(file.strip_prefix(src).unwrap_or(&file).to_path_buf());
        }
    }
    found.sort();
    Ok(found)
}

/// Module path (`worker::queue`; the crate root is empty) to the modules it imports.
pub type Graph = BTreeMap<String, BTreeSet<String>>;

/// The module a source file is, from its path under the crate's `src`.
fn module_of(rel: &Path) -> String {
    let mut parts: Vec<String> = rel
        .iter()
        .map(|p| p.to_string_lossy().into_owned())
        .collect();
    if let Some(last) = parts.pop() {
        let stem = last.trim_end_matches(".rs");
        if !matches!(stem, "mod" | "lib" | "main") {
            parts.push(stem.to_owned());
        }
    }
    parts.join("::")
}

fn sources(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            sources(&path, out)?;
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
    Ok(())
}

/// The text of a file before its test module (`#[cfg(test)]`, or `#[cfg(all(test, ...))]`,
/// followed by `mod`).
fn without_tests(text: &str) -> &str {
    let mut offset = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        let attr = line.trim();
        if (attr == "#[cfg(test)]" || attr.starts_with("#[cfg(all(test,"))
            && lines
                .peek()
                .is_some_and(|next| next.trim_start().starts_with("mod "))
        {
            return &text[..offset];
        }
        offset += line.len();
    }
    text
}

/// Every `crate::a::b` path in `code`, as its segments, expanding one level of `{a, b::c}`.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at + "crate::".len()..];
        rest = tail;
        if before.is_some_and(|c| ident(c) || c == ':' || c == '$') {
            continue; // `$crate::`, `ublkd_crate::`: not this crate's root.
        }
        let mut segs = Vec::new();
        let mut t = tail;
        loop {
            let len = t.find(|c: char| !ident(c)).unwrap_or(t.len());
            if len == 0 {
                break;
            }
            segs.push(t[..len].to_owned());
            t = &t[len..];
            if let Some(next) = t.strip_prefix("::") {
                t = next;
            } else {
                break;
            }
        }
        if let Some(group) = t.strip_prefix('{') {
            let inner = &group[..group.find('}').unwrap_or(group.len())];
            for item in inner.split(',') {
                let mut path = segs.clone();
                path.extend(
                    item.trim()
                        .split("::")
                        .map(|s| s.trim().to_owned())
                        .filter(|s| !s.is_empty() && s.chars().all(ident)),
                );
                found.push(path);
            }
        } else if !segs.is_empty() {
            found.push(segs);
        }
    }
    found
}

/// The import graph of the crate whose sources are under `src`.
pub fn graph(src: &Path) -> Result<Graph> {
    let mut files = Vec::new();
    sources(src, &mut files)?;
    let mut texts = BTreeMap::new();
    for f in &files {
        let rel = f.strip_prefix(src).unwrap_or(f);
        let text =
            std::fs::read_to_string(f).with_context(|| format!("reading {}", f.display()))?;
        texts.insert(module_of(rel), text);
    }
    let modules: BTreeSet<String> = texts.keys().cloned().collect();
    let mut graph = Graph::new();
    for (module, text) in &texts {
        let targets = graph.entry(module.clone()).or_default();
        for path in crate_paths(without_tests(text)) {
            // The longest prefix of the path that is a module of this crate.
            let target = (1..=path.len())
                .rev()
                .map(|n| path[..n].join("::"))
                .find(|m| modules.contains(m));
            if let Some(t) = target {
                // A module naming its own items or a parent's re-export is no arrow.
                if &t != module && !t.is_empty() {
                    targets.insert(t);
                }
            }
        }
    }
    Ok(graph)
}

/// The circles of `graph`: each as the modules on one loop, found once from its least module.
pub fn circles(graph: &Graph) -> Vec<Vec<String>> {
    let mut found = BTreeSet::new();
    for start in graph.keys() {
        // Depth-first from `start`, over modules not less than it, back to it.
        let mut stack: Vec<(String, Vec<String>)> = vec![(start.clone(), vec![start.clone()])];
        while let Some((at, path)) = stack.pop() {
            for next in graph.get(&at).into_iter().flatten() {
                if next == start {
                    found.insert(path.clone());
                } else if next > start && !path.contains(next) && path.len() < 8 {
                    let mut longer = path.clone();
                    longer.push(next.clone());
                    stack.push((next.clone(), longer));
                }
            }
        }
    }
    found.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_read_from_use_lines_groups_and_code() {
        let code =
            "use crate::a::{b, c::D};\nuse crate::e::F;\nfn f() { crate::g::h(); $crate::x::y; }";
        let paths = crate_paths(code);
        let want: Vec<Vec<String>> = [&["a", "b"][..], &["a", "c", "D"], &["e", "F"], &["g", "h"]]
            .iter()
            .map(|p| p.iter().map(|s| (*s).to_owned()).collect())
            .collect();
        assert_eq!(paths, want);
        assert_eq!(
            without_tests("a\n#[cfg(test)]\nmod tests {\n use crate::z;\n}\n"),
            "a\n"
        );
        assert_eq!(module_of(Path::new("worker/mod.rs")), "worker");
        assert_eq!(module_of(Path::new("worker/queue.rs")), "worker::queue");
        assert_eq!(module_of(Path::new("lib.rs")), "");
    }

    #[test]
    fn a_circle_is_found_once() {
        let mut g = Graph::new();
        for (a, b) in [("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")] {
            g.entry(a.into()).or_default().insert(b.into());
        }
        assert_eq!(circles(&g), vec![vec!["a", "b", "c"]]);
    }

    #[test]
    fn a_parent_glob_is_found_outside_tests_only() {
        let dir = std::env::temp_dir().join(format!("xtask-globs-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("m")).unwrap();
        std::fs::write(dir.join("m/a.rs"), "use super::*;\nfn f() {}\n").unwrap();
        std::fs::write(
            dir.join("m/b.rs"),
            "use super::Thing;\n#[cfg(test)]\nmod tests {\n    use super::*;\n}\n",
        )
        .unwrap();
        let found = parent_globs(&dir).unwrap();
        // The scratch directory goes whether or not the assertion holds: nothing to report.
        let _ = std::fs::remove_dir_all(&dir);
        assert_eq!(found, vec![PathBuf::from("m/a.rs")]);
    }

    /// Every module names what it takes from its parent: no `use super::*;` outside tests.
    #[test]
    fn no_module_glob_imports_its_parent() {
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut all = Vec::new();
        for krate in CRATES {
            for f in parent_globs(&ws.join(krate)).unwrap() {
                all.push(format!("{krate}/{}", f.display()));
            }
        }
        assert!(
            all.is_empty(),
            "use super::* outside tests:\n{}",
            all.join("\n")
        );
    }

    /// No module of any crate imports another that imports it back, through any loop.
    #[test]
    fn no_crate_has_an_import_circle() {
        let ws = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
        let mut all = Vec::new();
        for krate in CRATES {
            let g = graph(&ws.join(krate)).unwrap();
            assert!(g.len() > 1, "{krate}: no modules read");
            for c in circles(&g) {
                all.push(format!("{krate}: {}", c.join(" -> ")));
            }
        }
        assert!(all.is_empty(), "import circles:\n{}", all.join("\n"));
    }
}
