//! Reading kustomize's rendered YAML: its documents as objects, and the sequences and values
//! inside them (kustomize writes every document in one block style, keys sorted, two-space
//! indents, so lines are enough).

/// One rendered object: its kind, its name, and its text.
#[derive(Debug)]
pub(super) struct Object {
    pub(super) kind: String,
    pub(super) name: String,
    pub(super) text: String,
}

/// The top-level `kind:` and `metadata.name` of each document of kustomize's output (which
/// writes every document in the same block style, keys sorted, two-space indents).
pub(super) fn objects(rendered: &str) -> Vec<Object> {
    rendered
        .split("\n---\n")
        .filter_map(|doc| {
            let kind = doc
                .lines()
                .find_map(|l| l.strip_prefix("kind: "))?
                .trim()
                .to_owned();
            let mut in_meta = false;
            let name = doc.lines().find_map(|l| {
                if l == "metadata:" {
                    in_meta = true;
                    return None;
                }
                if in_meta && !l.starts_with(' ') {
                    in_meta = false;
                }
                if in_meta {
                    l.strip_prefix("  name: ").map(|n| n.trim().to_owned())
                } else {
                    None
                }
            })?;
            Some(Object {
                kind,
                name,
                text: doc.to_owned(),
            })
        })
        .collect()
}

pub(super) fn find<'a>(objs: &'a [Object], kind: &str, name: &str) -> Option<&'a Object> {
    objs.iter().find(|o| o.kind == kind && o.name == name)
}

pub(super) fn indent(line: &str) -> usize {
    line.len() - line.trim_start().len()
}

/// The items of the sequence under the first `key:` line of `text`. kustomize writes a
/// sequence at its key's indent, each item starting with `- `; in each returned item that
/// dash is a space, so the item's own keys share one indent.
pub(super) fn items(text: &str, key: &str) -> Vec<Vec<String>> {
    let head = format!("{key}:");
    let mut lines = text.lines().skip_while(|l| l.trim() != head);
    let Some(head_line) = lines.next() else {
        return Vec::new();
    };
    let at = indent(head_line);
    let mut out: Vec<Vec<String>> = Vec::new();
    for l in lines {
        let i = indent(l);
        if i == at && l[i..].starts_with("- ") {
            out.push(vec![format!("{}  {}", " ".repeat(i), &l[i + 2..])]);
        } else if i > at {
            match out.last_mut() {
                Some(item) => item.push(l.to_owned()),
                None => break, // a mapping, not a sequence
            }
        } else {
            break;
        }
    }
    out
}

/// The value of the item's own `key: value` line (not a nested one).
pub(super) fn value<'a>(item: &'a [String], key: &str) -> Option<&'a str> {
    let at = indent(item.first()?);
    let prefix = format!("{key}: ");
    item.iter()
        .filter(|l| indent(l) == at)
        .find_map(|l| l.trim_start().strip_prefix(prefix.as_str()))
        .map(|v| v.trim().trim_matches('"'))
}

/// The `key: value` lines, trimmed, nested anywhere under the first line that is exactly `key`
/// (indent included) after the first line that is exactly `after`.
pub(super) fn leaves<'a>(text: &'a str, after: &str, key: &str) -> Vec<&'a str> {
    let at = indent(key);
    text.lines()
        .skip_while(|l| *l != after)
        .skip_while(|l| *l != key)
        .skip(1)
        .take_while(|l| indent(l) > at)
        .map(str::trim)
        .filter(|l| !l.ends_with(':'))
        .collect()
}

/// The item whose own `name` is `name`.
pub(super) fn named<'a>(items: &'a [Vec<String>], name: &str) -> Option<&'a [String]> {
    items
        .iter()
        .find(|i| value(i, "name") == Some(name))
        .map(Vec::as_slice)
}
