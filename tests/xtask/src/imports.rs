//! The import map of every crate in the workspace, read from its sources: which module names
//! which through `crate::` and `super::` paths (in `use` lines and in code), outside its tests.
//! Kept as a host test so that no two modules of a crate come to import each other again, and
//! so that every crate's modules keep the layer order ARCHITECTURE.md draws for it (its
//! `layers` blocks: each line a layer, the top first; a module imports only modules on lower
//! lines).

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
    "tests/k8s/node",
    "tests/xtask/src",
];

/// The files under `src` that glob-import their parent (`use super::*;`) outside their tests,
/// relative to `src`: such a file reaches everything its parent can, so what it depends on
/// is written nowhere.
pub fn parent_globs(src: &Path) -> Result<Vec<PathBuf>> {
    Ok(sources(src)?
        .into_iter()
        .filter(|(_, code)| code.lines().any(|l| l.trim() == "use super::*;"))
        .map(|(rel, _)| rel)
        .collect())
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

/// Every `.rs` file under `src`, sorted: its path relative to `src`, and its text before its
/// inline tests (`without_tests`).
fn sources(src: &Path) -> Result<Vec<(PathBuf, String)>> {
    let mut found = Vec::new();
    let mut dirs = vec![src.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let entries = std::fs::read_dir(&dir).with_context(|| format!("reading {}", dir.display()));
        for entry in entries? {
            let path = entry?.path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path)
                    .with_context(|| format!("reading {}", path.display()))?;
                let rel = path.strip_prefix(src).unwrap_or(&path).to_path_buf();
                found.push((rel, without_tests(&text).to_owned()));
            }
        }
    }
    found.sort();
    Ok(found)
}

/// The text of a file before its inline test module (`#[cfg(test)]`, or
/// `#[cfg(all(test, ...))]`, followed by `mod name {`).
fn without_tests(text: &str) -> &str {
    let mut offset = 0;
    let mut lines = text.split_inclusive('\n').peekable();
    while let Some(line) = lines.next() {
        let attr = line.trim();
        if (attr == "#[cfg(test)]" || attr.starts_with("#[cfg(all(test,"))
            && lines.peek().is_some_and(|next| {
                // An inline test module; `mod sim;` only declares a file, read on its own.
                let next = next.trim();
                next.starts_with("mod ") && next.ends_with('{')
            })
        {
            return &text[..offset];
        }
        offset += line.len();
    }
    text
}

/// Whether `c` may be part of an identifier.
fn ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

/// Whether a `crate::` or `super::` right after `before` is a path of its own: not `$crate::`,
/// not the end of `ublkd_crate::` or of `a::super::`.
fn path_starts_after(before: Option<char>) -> bool {
    !before.is_some_and(|c| ident(c) || c == ':' || c == '$')
}

/// Every `crate::a::b` path in `code`, as its segments, expanding one level of `{a, b::c}`.
fn crate_paths(code: &str) -> Vec<Vec<String>> {
    let mut found = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        let before = rest[..at].chars().next_back();
        let tail = &rest[at + "crate::".len()..];
        rest = tail;
        if !path_starts_after(before) {
            continue; // `$crate::`, `ublkd_crate::`: not this crate's root.
        }
        // The path: identifiers and `::`, up to what follows it (a `{` group, a `(`, a `;`).
        let end = tail
            .find(|c: char| !ident(c) && c != ':')
            .unwrap_or(tail.len());
        let segs: Vec<String> = tail[..end]
            .split("::")
            .filter(|s| !s.is_empty())
            .map(str::to_owned)
            .collect();
        if let Some(group) = tail[end..].strip_prefix('{') {
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
    let texts: BTreeMap<String, String> = sources(src)?
        .into_iter()
        .map(|(rel, code)| (module_of(&rel), code))
        .collect();
    let modules: BTreeSet<String> = texts.keys().cloned().collect();
    let mut graph = Graph::new();
    for (module, text) in &texts {
        let targets = graph.entry(module.clone()).or_default();
        // `super::x` names the parent's `x`: read as the `crate::` path it is, so that two
        // sibling files calling each other show as the circle they are.
        let code = supers_as_crate_paths(text, module);
        for path in crate_paths(&code) {
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

/// `code` with every `super::` (not `$crate`'s, not part of a longer path) written as the
/// `crate::` path of `module`'s parent (the crate root's for a top-level module); a
/// `super::super::` is left alone.
fn supers_as_crate_paths(code: &str, module: &str) -> String {
    let parent = match module.rfind("::") {
        Some(i) => format!("crate::{}::", &module[..i]),
        None => "crate::".to_owned(),
    };
    let mut out = String::with_capacity(code.len());
    let mut rest = code;
    while let Some(at) = rest.find("super::") {
        out.push_str(&rest[..at]);
        let before = out.chars().next_back();
        let tail = &rest[at + "super::".len()..];
        if !path_starts_after(before) || tail.starts_with("super::") {
            out.push_str("super::");
        } else {
            out.push_str(&parent);
        }
        rest = tail;
    }
    out.push_str(rest);
    out
}

/// A crate's layers as the map draws them: the top layer first, each a set of top-level
/// modules (rooms). From a fenced block of ARCHITECTURE.md whose info string is
/// `layers <crate's src directory>`.
pub type Layers = Vec<BTreeSet<String>>;

/// Every `layers` block of `map` (ARCHITECTURE.md's text), by the crate source root it names.
pub fn layers_of_map(map: &str) -> BTreeMap<String, Layers> {
    let mut found = BTreeMap::new();
    let mut lines = map.lines();
    while let Some(line) = lines.next() {
        let Some(krate) = line.trim().strip_prefix("```layers ") else {
            continue;
        };
        let mut layers = Layers::new();
        for l in lines.by_ref() {
            if l.trim_start().starts_with("```") {
                break;
            }
            // `a b c` or `a  b  c   -- what they are`: the words before `--`.
            let names = l.split("--").next().unwrap_or("");
            let layer: BTreeSet<String> = names
                .split(|c: char| c.is_whitespace() || c == ',' || c == '│')
                .filter(|w| !w.is_empty() && w.chars().all(ident))
                .map(str::to_owned)
                .collect();
            if !layer.is_empty() {
                layers.push(layer);
            }
        }
        found.insert(krate.trim().to_owned(), layers);
    }
    found
}

/// The room a module lives in: its first path segment (`volumes::change` is in `volumes`).
fn room_of(module: &str) -> &str {
    module.split("::").next().unwrap_or(module)
}

/// Where `graph` contradicts `layers`: a room the map does not place, a room the map names
/// that the crate does not have, or an arrow between two rooms that does not point to a lower
/// line (an arrow within a room is the room's own).
pub fn contradictions(graph: &Graph, layers: &Layers) -> Vec<String> {
    let line_of = |room: &str| layers.iter().position(|l| l.contains(room));
    let mut found = BTreeSet::new();
    for (module, targets) in graph {
        let from = room_of(module);
        if from.is_empty() {
            continue; // The crate root declares the modules: no layer of its own.
        }
        let Some(a) = line_of(from) else {
            found.insert(format!("{from}: not on the map"));
            continue;
        };
        for target in targets {
            let to = room_of(target);
            if to == from || to.is_empty() {
                continue;
            }
            match line_of(to) {
                None => {
                    found.insert(format!("{to}: not on the map"));
                }
                Some(b) if b <= a => {
                    let where_ = if b == a { "beside" } else { "above" };
                    found.insert(format!(
                        "{module} imports {target}, which the map puts {where_} it"
                    ));
                }
                Some(_) => {}
            }
        }
    }
    // And the other way: every room the map names is a module of the crate.
    for room in layers.iter().flatten() {
        if !graph.keys().any(|m| room_of(m) == room) {
            found.insert(format!("{room}: on the map, but no such module"));
        }
    }
    found.into_iter().collect()
}

/// The `impl` blocks of the crate under `src` that sit outside their type's file, outside tests:
/// an inherent `impl T` anywhere but the file that defines `T`, a `impl Trait for T` in neither
/// `T`'s file nor `Trait`'s. Each as `file: impl header`. Types the crate does not define are
/// not its to place; a name two files define may be implemented in either.
pub fn foreign_impls(src: &Path) -> Result<Vec<String>> {
    let texts = sources(src)?;
    let mut types: BTreeMap<String, BTreeSet<PathBuf>> = BTreeMap::new();
    let mut traits: BTreeMap<String, BTreeSet<PathBuf>> = BTreeMap::new();
    for (rel, text) in &texts {
        for line in code_lines(text) {
            if let Some(name) = defined(line, &["struct", "enum", "union"]) {
                types.entry(name).or_default().insert(rel.clone());
            }
            if let Some(name) = defined(line, &["trait"]) {
                traits.entry(name).or_default().insert(rel.clone());
            }
        }
    }
    let mut found = Vec::new();
    for (rel, text) in &texts {
        let lines: Vec<&str> = code_lines(text).collect();
        for (i, line) in lines.iter().enumerate() {
            let t = line.trim_start();
            let t = t.strip_prefix("unsafe ").unwrap_or(t);
            let Some(rest) = t.strip_prefix("impl") else {
                continue;
            };
            if !rest.starts_with(['<', ' ']) {
                continue;
            }
            // The header, up to its opening brace (it may span lines).
            let mut header = rest.to_owned();
            let mut j = i;
            while !header.contains('{') && j + 1 < lines.len() && j < i + 8 {
                j += 1;
                header.push(' ');
                header.push_str(lines[j].trim());
            }
            let Some((of_trait, of_type)) = impl_names(&header) else {
                continue;
            };
            let Some(type_files) = types.get(&of_type) else {
                continue; // not this crate's type
            };
            let in_trait_file = |tr: &str| traits.get(tr).is_some_and(|fs| fs.contains(rel));
            let at_home =
                type_files.contains(rel) || of_trait.as_deref().is_some_and(in_trait_file);
            if !at_home {
                let of = of_trait.map(|tr| format!("{tr} for ")).unwrap_or_default();
                let homes: Vec<String> =
                    type_files.iter().map(|f| f.display().to_string()).collect();
                let (file, homes) = (rel.display(), homes.join(", "));
                found.push(format!(
                    "{file}: impl {of}{of_type} (the type is in {homes})"
                ));
            }
        }
    }
    Ok(found)
}

/// The lines of `text` that are not comments.
fn code_lines(text: &str) -> impl Iterator<Item = &str> {
    text.lines().filter(|l| !l.trim_start().starts_with("//"))
}

/// The name a line defines with one of `kinds` (`pub(crate) struct Name<T> {`), if it does.
fn defined(line: &str, kinds: &[&str]) -> Option<String> {
    let mut words = line
        .split_whitespace()
        .skip_while(|w| w.starts_with("pub") || *w == "unsafe");
    let kind = words.next()?;
    if !kinds.contains(&kind) {
        return None;
    }
    let name: String = words.next()?.chars().take_while(|c| ident(*c)).collect();
    (!name.is_empty()).then_some(name)
}

/// The trait (if any) and the type an impl header after `impl` names, each as its last path
/// segment: `<T> fmt::Display for Foo<T> where ... {` gives (Display, Foo).
fn impl_names(header: &str) -> Option<(Option<String>, String)> {
    let mut h = header.trim_start();
    if h.starts_with('<') {
        // The impl's own generics.
        h = &h[outside_brackets(h).next()? + 1..];
    }
    let h = h[..h.find('{').unwrap_or(h.len())].trim();
    let h = h.split(" where ").next().unwrap_or(h).trim();
    let last = |path: &str| -> Option<String> {
        let path = path
            .trim()
            .trim_start_matches('&')
            .trim_start_matches("mut ");
        let path = path.trim_start_matches("dyn ").trim();
        let path = &path[..path.find('<').unwrap_or(path.len())];
        let name = path.rsplit("::").next()?.trim();
        (!name.is_empty() && !name.starts_with('$')).then(|| name.to_owned())
    };
    // ` for ` outside the trait's own generics.
    match outside_brackets(h).find(|&k| h.as_bytes()[k..].starts_with(b" for ")) {
        Some(k) => Some((Some(last(&h[..k])?), last(&h[k + 5..])?)),
        None => Some((None, last(h)?)),
    }
}

/// The byte offsets of `h` outside every `<…>` and `(…)` (a closing bracket's own included).
fn outside_brackets(h: &str) -> impl Iterator<Item = usize> + '_ {
    let mut depth = 0i32;
    h.bytes().enumerate().filter_map(move |(k, b)| {
        match b {
            b'<' | b'(' => depth += 1,
            b'>' | b')' => depth -= 1,
            _ => {}
        }
        (depth == 0).then_some(k)
    })
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
        let declared = "#[cfg(test)]\nmod sim;\nuse crate::z;\n";
        assert_eq!(
            without_tests(declared),
            declared,
            "a declared test file hides nothing"
        );
        assert_eq!(module_of(Path::new("worker/mod.rs")), "worker");
        assert_eq!(module_of(Path::new("worker/queue.rs")), "worker::queue");
        assert_eq!(module_of(Path::new("lib.rs")), "");
    }

    #[test]
    fn super_paths_are_read_as_the_parents() {
        assert_eq!(
            supers_as_crate_paths(
                "use super::{a, B};\nsuper::c::f(); $super::x; super::super::y",
                "m::n"
            ),
            "use crate::m::{a, B};\ncrate::m::c::f(); $super::x; super::super::y"
        );
        assert_eq!(
            supers_as_crate_paths("use super::T;", "top"),
            "use crate::T;"
        );
    }

    /// A graph of `modules` (those that import nothing too) and the `imports` between them.
    fn graph_of(modules: &[&str], imports: &[(&str, &str)]) -> Graph {
        let mut g: Graph = modules.iter().map(|m| (m.to_string(), [].into())).collect();
        for (a, b) in imports {
            g.entry(a.to_string()).or_default().insert(b.to_string());
        }
        g
    }

    #[test]
    fn a_circle_is_found_once() {
        let g = graph_of(&[], &[("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")]);
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

    /// Fails, saying `what` and each finding after its crate's name, when `check` finds anything
    /// in a crate (given its source root as CRATES names it, and that root's path).
    fn none_in_every_crate(what: &str, check: impl Fn(&str, &Path) -> Vec<String>) {
        let ws = crate::workspace_root().unwrap();
        let found = CRATES.iter().map(|k| (k, check(k, &ws.join(k))));
        let all: Vec<String> = found
            .flat_map(|(k, f)| f.into_iter().map(move |f| format!("{k}: {f}")))
            .collect();
        assert!(all.is_empty(), "{what}:\n{}", all.join("\n"));
    }

    /// Every module names what it takes from its parent: no `use super::*;` outside tests.
    #[test]
    fn no_module_glob_imports_its_parent() {
        none_in_every_crate("use super::* outside tests", |_, src| {
            let found = parent_globs(src).unwrap();
            found.iter().map(|f| f.display().to_string()).collect()
        });
    }

    #[test]
    fn an_impl_outside_its_types_file_is_found() {
        let dir = std::env::temp_dir().join(format!("xtask-impls-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("m")).unwrap();
        std::fs::write(
            dir.join("m/mod.rs"),
            "mod a;\npub struct Queue { n: u32 }\npub trait Step {}\nimpl Queue { fn new() {} }\n",
        )
        .unwrap();
        std::fs::write(
            dir.join("m/a.rs"),
            "use super::{Queue, Step};\nstruct Local;\nimpl Local {}\nimpl Step for Local {}\n\
             impl<T> std::fmt::Debug for Queue where T: Sized {}\nimpl super::Queue {\n    fn moved() {}\n}\n\
             impl String {}\n#[cfg(test)]\nmod tests {\n    impl super::Queue {}\n}\n",
        )
        .unwrap();
        let found = foreign_impls(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir); // a temporary directory; its removal is tidiness
        assert_eq!(
            found,
            vec![
                "m/a.rs: impl Debug for Queue (the type is in m/mod.rs)".to_owned(),
                "m/a.rs: impl Queue (the type is in m/mod.rs)".to_owned(),
            ]
        );
    }

    /// A type's methods are in its file (a trait's impl in the trait's file or the type's): a
    /// file that is one step over another file's type holds functions of it, named at each call.
    #[test]
    fn every_impl_is_in_its_types_file() {
        none_in_every_crate("impl outside its type's file", |_, src| {
            foreign_impls(src).unwrap()
        });
    }

    /// No module of any crate imports another that imports it back, through any loop.
    #[test]
    fn no_crate_has_an_import_circle() {
        none_in_every_crate("import circles", |krate, src| {
            let g = graph(src).unwrap();
            assert!(g.len() > 1, "{krate}: no modules read");
            circles(&g).iter().map(|c| c.join(" -> ")).collect()
        });
    }

    #[test]
    fn layers_are_read_from_the_map_and_an_upward_arrow_is_found() {
        let map = "text\n```layers x/src\nservice   -- the API\nvolumes, capacity\nregistry\n```\n";
        let layers = layers_of_map(map);
        let x = &layers["x/src"];
        assert_eq!(x.len(), 3);
        assert!(x[1].contains("capacity"));
        // Every module is in the graph, those that import nothing too.
        let mut arrows = vec![
            ("service", "volumes::change"),
            ("volumes::change", "volumes"),
            ("volumes", "registry"),
        ];
        let g = graph_of(&["capacity", "registry"], &arrows);
        assert!(contradictions(&g, x).is_empty());
        arrows.extend([
            ("registry", "volumes"),
            ("capacity", "volumes"),
            ("error", "registry"),
        ]);
        let g = graph_of(&["capacity", "registry"], &arrows);
        assert_eq!(
            contradictions(&g, x),
            vec![
                "capacity imports volumes, which the map puts beside it".to_owned(),
                "error: not on the map".to_owned(),
                "registry imports volumes, which the map puts above it".to_owned(),
            ]
        );
        // A room the map names that the crate lacks (a module removed, its line left).
        let ghost = layers_of_map("```layers x/src\nservice\nghost volumes\n```\n");
        let g = graph_of(&["service", "volumes"], &[]);
        assert_eq!(
            contradictions(&g, &ghost["x/src"]),
            ["ghost: on the map, but no such module"]
        );
    }

    /// Every crate's imports keep the layer order ARCHITECTURE.md draws for it, and every
    /// crate has its drawing.
    #[test]
    fn every_crate_keeps_the_layers_of_the_map() {
        let map = crate::workspace_root().unwrap().join("ARCHITECTURE.md");
        let layers = layers_of_map(&std::fs::read_to_string(map).unwrap());
        none_in_every_crate("the map and the code disagree", |krate, src| {
            match layers.get(krate) {
                Some(l) => contradictions(&graph(src).unwrap(), l),
                None => vec![format!("no `layers {krate}` block in ARCHITECTURE.md")],
            }
        });
    }
}
