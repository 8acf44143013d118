//! Layouts for any reply, knowing nothing of the API: columns aligned into a table, `label:
//! value` fields, JSON pretty-printed, and JSON turned into YAML. `output` and `snapshot` put
//! the API's messages into them.

use serde_json::Value;

/// Column alignment in [`table`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Align {
    Left,
    Right,
}

/// Columns separated by two spaces, each as wide as its widest cell; no trailing blanks. The
/// header line is left out unless `with_header` (`--no-headers`, for scripts).
pub fn table(headers: &[(&str, Align)], rows: &[Vec<String>], with_header: bool) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|(h, _)| h.chars().count()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let header: Vec<String> = headers.iter().map(|(h, _)| (*h).to_owned()).collect();
    std::iter::once(&header)
        .filter(|_| with_header)
        .chain(rows)
        .map(|row| {
            let cells: Vec<String> = row
                .iter()
                .zip(&widths)
                .zip(headers)
                .map(|((cell, &w), &(_, align))| match align {
                    Align::Left => format!("{cell:<w$}"),
                    Align::Right => format!("{cell:>w$}"),
                })
                .collect();
            cells.join("  ").trim_end().to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// `label: value` lines with the values aligned.
pub fn fields<K: AsRef<str>>(pairs: &[(K, String)]) -> String {
    let width = pairs
        .iter()
        .map(|(k, _)| k.as_ref().chars().count() + 1)
        .max()
        .unwrap_or(0);
    pairs
        .iter()
        .map(|(k, v)| {
            format!("{:<width$} {v}", format!("{}:", k.as_ref()))
                .trim_end()
                .to_owned()
        })
        .collect::<Vec<_>>()
        .join("\n")
}

/// The JSON text `json` (one of `output`'s or `snapshot`'s `*_json` replies) as YAML: block
/// style, keys plain, strings double-quoted (YAML reads JSON's escapes there), so no value
/// changes type. Text that is not JSON is returned as it is.
pub fn json_to_yaml(json: &str) -> String {
    let Ok(value) = serde_json::from_str::<Value>(json) else {
        return json.to_owned();
    };
    let mut out = String::new();
    yaml_value(&value, 0, &mut out);
    out.trim_end().to_owned()
}

fn yaml_scalar(v: &Value) -> String {
    match v {
        Value::String(s) => Value::String(s.clone()).to_string(),
        Value::Array(a) if a.is_empty() => "[]".into(),
        Value::Object(m) if m.is_empty() => "{}".into(),
        other => other.to_string(),
    }
}

/// A key YAML reads back as the same string unquoted: a word of `[a-z0-9_]` starting with a
/// letter or `_`, and none of YAML's null and boolean words (the API has a `null` backend).
fn plain_key(k: &str) -> bool {
    const SPECIAL: [&str; 9] = ["null", "true", "false", "yes", "no", "on", "off", "y", "n"];
    k.bytes()
        .next()
        .is_some_and(|b| b.is_ascii_alphabetic() || b == b'_')
        && k.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_')
        && !SPECIAL.contains(&k.to_ascii_lowercase().as_str())
}

fn is_block(v: &Value) -> bool {
    matches!(v, Value::Array(a) if !a.is_empty()) || matches!(v, Value::Object(m) if !m.is_empty())
}

/// Appends `v` at `indent` spaces: a mapping's `key: value` lines, a sequence's `- ` items, or
/// one scalar line.
fn yaml_value(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) if !m.is_empty() => {
            for (k, item) in m {
                let key = if plain_key(k) {
                    k.clone()
                } else {
                    Value::String(k.clone()).to_string()
                };
                if is_block(item) {
                    out.push_str(&format!("{pad}{key}:\n"));
                    yaml_value(item, indent + 2, out);
                } else {
                    out.push_str(&format!("{pad}{key}: {}\n", yaml_scalar(item)));
                }
            }
        }
        Value::Array(a) if !a.is_empty() => {
            for item in a {
                if is_block(item) {
                    // The item's first line takes the dash; the rest keep its indent.
                    let mut nested = String::new();
                    yaml_value(item, indent + 2, &mut nested);
                    out.push_str(&pad);
                    out.push_str("- ");
                    out.push_str(&nested[indent + 2..]);
                } else {
                    out.push_str(&format!("{pad}- {}\n", yaml_scalar(item)));
                }
            }
        }
        scalar => out.push_str(&format!("{pad}{}\n", yaml_scalar(scalar))),
    }
}

pub fn pretty(value: &Value) -> String {
    // Serialising a `Value` cannot fail: its map keys are strings.
    serde_json::to_string_pretty(value).unwrap_or_else(|_| value.to_string())
}

/// An empty cell shown as `-`.
pub fn or_dash(s: &str) -> String {
    if s.is_empty() {
        "-".into()
    } else {
        s.to_owned()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use serde_json::json;

    #[test]
    fn yaml_is_the_json_form_in_block_style() {
        let json = pretty(&json!({
            "volumes": [
                {"id": "a", "spec": {"size_bytes": 4096, "null": {}}, "tags": ["x", "y"]},
                {"id": "b: c", "state": null, "ok": true}
            ],
            "empty": [],
            "odd key": "line\nbreak"
        }));
        let expected = r#"empty: []
"odd key": "line\nbreak"
volumes:
  - id: "a"
    spec:
      "null": {}
      size_bytes: 4096
    tags:
      - "x"
      - "y"
  - id: "b: c"
    ok: true
    state: null"#;
        assert_eq!(json_to_yaml(&json), expected);
        assert_eq!(json_to_yaml("{}"), "{}");
        assert_eq!(json_to_yaml("deleted"), "deleted");
    }
}
