//! What the docs name exists: every repository path in a code span, a code block or a link of
//! docs/*.md, README.md, tests/README.md and deploy/**/README.md is a file or directory here,
//! and every `cargo xtask`, `ublkctl` and `kubectl ublkd` command names a subcommand its
//! program has, read from the clap enums in its source. A host test: moving a file or renaming
//! a subcommand without fixing the docs fails it.

use anyhow::Result;
use std::fs;
use std::path::{Path, PathBuf};

/// Path-like spans that are not this repository's: kubernetes-csi/external-snapshotter's
/// directories, which deploy/csi/README.md and docs/kubernetes.md tell an admin to apply, and
/// the logs a Kubernetes-tier run writes into its run directory (tests/README.md).
const NOT_OURS: &[&str] = &[
    "client/config/crd",
    "deploy/kubernetes/snapshot-controller",
    "logs/cpu.log",
    "logs/requests.log",
];

/// Commands a doc names that are gone, on purpose: docs/performance.md records each
/// measurement with the command it was run with, `compare` before it was folded into `bench`.
const GONE: &[(&str, &str)] = &[("docs/performance.md", "cargo xtask compare")];

/// The programs whose subcommands the docs name, and the sources of their clap enums.
const PROGRAMS: &[(&str, &str)] = &[
    ("cargo xtask", "tests/xtask/src"),
    ("ublkctl", "cli/src"),
    ("kubectl ublkd", "kubectl-ublkd/src"),
];

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn docs(root: &Path) -> Result<Vec<PathBuf>> {
    let mut files = vec![root.join("README.md"), root.join("tests/README.md")];
    for e in fs::read_dir(root.join("docs"))? {
        let p = e?.path();
        if p.extension().is_some_and(|x| x == "md") {
            files.push(p);
        }
    }
    let mut dirs = vec![root.join("deploy")];
    while let Some(d) = dirs.pop() {
        for e in fs::read_dir(d)? {
            let p = e?.path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.file_name().is_some_and(|n| n == "README.md") {
                files.push(p);
            }
        }
    }
    Ok(files)
}

/// A Markdown file's code: inline spans (a span broken across lines joined with a space), and
/// the lines of its fenced blocks.
fn code(text: &str) -> (Vec<String>, Vec<String>) {
    let (mut prose, mut fenced, mut inside) = (String::new(), Vec::new(), false);
    for line in text.lines() {
        if line.trim_start().starts_with("```") {
            inside = !inside;
        } else if inside {
            fenced.push(line.to_owned());
        } else {
            prose.push_str(line);
            prose.push('\n');
        }
    }
    let spans = prose.split('`').skip(1).step_by(2);
    (spans.map(|s| s.replace('\n', " ")).collect(), fenced)
}

/// Link targets: `[text](target)`.
fn links(text: &str) -> Vec<&str> {
    let ends = text.split("](").skip(1);
    ends.filter_map(|s| s.split(')').next()).collect()
}

/// `t` as a repository path, if it reads as one: relative, of path characters, with a slash;
/// a first part that is a directory here (of the repository or of the doc), or a file name
/// with an extension, or a trailing slash. Not a label or an API group (`ublkd.io/node`,
/// `storage.k8s.io/v1`: a first part with a dot that is no file), nor a placeholder
/// (`REGISTRY/ublkd`), nor a build output (`target/`, there only after a build).
fn repo_path(t: &str, dir: &Path, root: &Path) -> Option<String> {
    let t = t.split('#').next()?;
    // `file.rs:120`: the file.
    let t = (t.rsplit_once(':'))
        .filter(|(_, n)| n.parse::<u32>().is_ok())
        .map_or(t, |(p, _)| p);
    let path_chars = |c: char| c.is_ascii_alphanumeric() || "_.-/".contains(c);
    if !t.contains('/') || t.starts_with('/') || t.contains("//") || !t.chars().all(path_chars) {
        return None;
    }
    let first = t.split('/').next()?;
    let here = |p: &str| root.join(p).exists() || dir.join(p).exists();
    let dotted = first.contains('.') && first != "." && first != "..";
    let placeholder = first.chars().all(|c| c.is_ascii_uppercase() || c == '_');
    if first == "target" || placeholder || (dotted && !here(first)) {
        return None;
    }
    let (parent, last) = t.trim_end_matches('/').rsplit_once('/')?;
    let named = here(first) || last.contains('.') || t.ends_with('/');
    // `scenarios/THEME.rs`: a name to fill in, in a directory that must be there.
    let stem = last.split('.').next()?;
    let real = ["README", "CHANGELOG", "ARCHITECTURE"].contains(&stem);
    let filled = !real && stem.chars().all(|c| c.is_ascii_uppercase() || c == '_');
    let path = if filled {
        format!("{parent}/")
    } else {
        t.into()
    };
    named.then_some(path)
}

/// The subcommands of the clap enums (`#[derive(.. Subcommand ..)]`) in the files of `src`:
/// each variant in kebab case, as clap names it; flattened ones left out.
fn subcommands(src: &Path) -> Result<Vec<String>> {
    let mut names = Vec::new();
    for f in fs::read_dir(src)? {
        let f = f?.path();
        if f.extension().is_none_or(|x| x != "rs") {
            continue;
        }
        let text = fs::read_to_string(f)?;
        let mut lines = text.lines();
        while let Some(line) = lines.next() {
            if !(line.starts_with("#[derive(") && line.contains("Subcommand")) {
                continue;
            }
            let mut flatten = false;
            for l in lines.by_ref().skip_while(|l| !l.contains("enum ")).skip(1) {
                if l.starts_with('}') {
                    break;
                }
                let Some(v) = l
                    .strip_prefix("    ")
                    .filter(|v| v.starts_with(char::is_uppercase))
                else {
                    flatten |= l.trim() == "#[command(flatten)]";
                    continue;
                };
                let ident: String = v.chars().take_while(char::is_ascii_alphanumeric).collect();
                if !std::mem::take(&mut flatten) {
                    names.push(kebab(&ident));
                }
            }
        }
    }
    Ok(names)
}

/// `K8sTest` as `k8s-test`, `NodeInfo` as `node-info`.
fn kebab(ident: &str) -> String {
    let mut out = String::new();
    let mut prev_lower = false;
    for c in ident.chars() {
        if c.is_uppercase() && prev_lower {
            out.push('-');
        }
        prev_lower = c.is_lowercase() || c.is_ascii_digit();
        out.extend(c.to_lowercase());
    }
    out
}

/// The subcommand each `program ARGS` in `code` names: the first word after its flags, where a
/// word right after a flag that is no subcommand is the flag's value (`--node n1`).
fn invocations<'a>(code: &'a str, program: &str, subs: &[String]) -> Vec<&'a str> {
    let mut found = Vec::new();
    for (at, _) in code.match_indices(&format!("{program} ")) {
        let before = code[..at].chars().next_back();
        if before.is_some_and(|c| c.is_alphanumeric() || c == '-' || c == '_') {
            continue;
        }
        let mut after_flag = false;
        for word in code[at + program.len()..].split_whitespace() {
            if word.starts_with('-') {
                after_flag = !word.contains('=');
                continue;
            }
            if std::mem::take(&mut after_flag) && !subs.iter().any(|s| s == word) {
                continue;
            }
            let kebab = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-';
            if word.starts_with(|c: char| c.is_ascii_lowercase()) && word.chars().all(kebab) {
                found.push(word);
            }
            break;
        }
    }
    found
}

#[test]
fn every_path_and_command_the_docs_name_exists() -> Result<()> {
    let root = root();
    let programs = (PROGRAMS.iter())
        .map(|(p, src)| Ok((*p, subcommands(&root.join(src))?)))
        .collect::<Result<Vec<(&str, Vec<String>)>>>()?;
    for (program, subs) in &programs {
        assert!(subs.len() > 2, "read no subcommands of {program}: {subs:?}");
    }
    let mut wrong = Vec::new();
    for doc in docs(&root)? {
        let text = fs::read_to_string(&doc)?;
        let dir = doc.parent().unwrap();
        let name = doc.strip_prefix(&root).unwrap().display();
        let (spans, fenced) = code(&text);
        let single = spans
            .iter()
            .filter(|s| !s.trim().contains(' '))
            .map(|s| s.trim());
        let words = (spans.iter().chain(&fenced)).flat_map(|s| s.split_whitespace());
        let words = words.map(|w| w.trim_matches(|c: char| "\"'(),;".contains(c)));
        let files = words.filter(|w| w.rsplit('/').next().is_some_and(|l| l.contains('.')));
        let named: Vec<String> = (single.chain(links(&text)).chain(files))
            .filter_map(|t| repo_path(t, dir, &root))
            .collect();
        // A path may be short for one in a directory the same doc names: `scenarios/` after
        // `tests/k8s/node/`, `nodeloss/plan.rs` after `csi/src/nodeloss.rs`, `daemon/` after
        // the glob `tests/tests/*.rs`.
        let globs = spans
            .iter()
            .filter_map(|s| Some(s.trim().split_once("/*")?.0));
        let mut bases = vec![root.clone(), dir.to_owned()];
        for p in named.iter().map(String::as_str).chain(globs) {
            let Some(p) = [root.join(p), dir.join(p)].into_iter().find(|p| p.exists()) else {
                continue;
            };
            bases.push(p.parent().filter(|_| !p.is_dir()).unwrap_or(&p).to_owned());
        }
        for p in &named {
            let exists = bases.iter().any(|b| b.join(p).exists());
            if !exists && !NOT_OURS.contains(&p.trim_end_matches('/')) {
                wrong.push(format!("{name}: `{p}` is no path of the repository"));
            }
        }
        for code in spans.iter().chain(&fenced) {
            for (program, subs) in &programs {
                for sub in invocations(code, program, subs) {
                    let gone = GONE.contains(&(&*name.to_string(), &*format!("{program} {sub}")));
                    if !subs.iter().any(|s| s == sub) && !gone {
                        wrong.push(format!("{name}: `{program} {sub}`: no such subcommand"));
                    }
                }
            }
        }
    }
    wrong.sort();
    wrong.dedup();
    let wrong = wrong.join("\n  ");
    anyhow::ensure!(
        wrong.is_empty(),
        "the docs name what is not there:\n  {wrong}"
    );
    Ok(())
}

#[test]
fn reading_finds_paths_and_subcommands() -> Result<()> {
    let root = root();
    let dir = root.join("deploy");
    for (t, path) in [
        ("csi/README.md#install", Some("csi/README.md")),
        (
            "grafana/ublkd-dashboard.json",
            Some("grafana/ublkd-dashboard.json"),
        ),
        ("scenarios/THEME.rs", Some("scenarios/")),
        ("ublkd.io/node", None),
        ("/dev/ublkbN", None),
        ("REGISTRY/ublkd", None),
        ("target/release/ublkd", None),
    ] {
        assert_eq!(repo_path(t, &dir, &root).as_deref(), path, "{t}");
    }
    assert_eq!(kebab("K8sTest"), "k8s-test");
    let subs = subcommands(&root.join("cli/src"))?;
    assert!(subs.contains(&"create-snapshot".into()) && !subs.contains(&"call".into()));
    let code = "ublkctl --node n1 node-info\nublkctl -o json get-volume V\n/bin/ublkctl stats";
    let code =
        format!("{code}\ntarget/release/ublkctl /usr/local/bin/\nublkctl --node n1 nodeinfo");
    let found = invocations(&code, "ublkctl", &subs);
    assert_eq!(found, ["node-info", "get-volume", "stats", "nodeinfo"]);
    Ok(())
}
