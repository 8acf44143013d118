//! `-o text|json|yaml`: every command builds one JSON value and its text form; this prints the
//! one asked for. YAML is written here (block style, strings double-quoted as JSON quotes them,
//! which YAML reads the same) rather than with a crate: the output is data, never parsed back.

use serde_json::Value;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Output {
    Text,
    Json,
    Yaml,
}

impl Output {
    /// What to print: `text` for people, `value` otherwise.
    pub fn render(self, value: &Value, text: impl FnOnce() -> String) -> String {
        match self {
            Output::Text => text(),
            Output::Json => {
                serde_json::to_string_pretty(value).unwrap_or_else(|e| format!("{{}} # {e}")) + "\n"
            }
            Output::Yaml => yaml(value),
        }
    }
}

fn scalar(v: &Value) -> String {
    match v {
        Value::String(s) => Value::String(s.clone()).to_string(),
        other => other.to_string(),
    }
}

/// A key as YAML reads it: bare when plain, quoted otherwise.
fn key(k: &str) -> String {
    let plain = !k.is_empty()
        && k.chars()
            .all(|c| c.is_ascii_alphanumeric() || "_-./".contains(c))
        && !k.starts_with(['-', '.']);
    if plain {
        k.to_owned()
    } else {
        Value::String(k.to_owned()).to_string()
    }
}

fn empty_or_scalar(v: &Value) -> Option<String> {
    match v {
        Value::Object(m) if m.is_empty() => Some("{}".into()),
        Value::Array(a) if a.is_empty() => Some("[]".into()),
        Value::Object(_) | Value::Array(_) => None,
        other => Some(scalar(other)),
    }
}

fn block(v: &Value, indent: usize, out: &mut String) {
    let pad = " ".repeat(indent);
    match v {
        Value::Object(m) => {
            for (k, v) in m {
                match empty_or_scalar(v) {
                    Some(s) => out.push_str(&format!("{pad}{}: {s}\n", key(k))),
                    None => {
                        out.push_str(&format!("{pad}{}:\n", key(k)));
                        // a list under a key is indented like YAML's writers do: as a block
                        block(v, indent + 2, out);
                    }
                }
            }
        }
        Value::Array(a) => {
            for item in a {
                match empty_or_scalar(item) {
                    Some(s) => out.push_str(&format!("{pad}- {s}\n")),
                    None => {
                        let mut inner = String::new();
                        block(item, indent + 2, &mut inner);
                        // the item's first line goes after the dash
                        out.push_str(&format!("{pad}- {}", &inner[indent + 2..]));
                    }
                }
            }
        }
        other => out.push_str(&format!("{pad}{}\n", scalar(other))),
    }
}

/// `v` as a YAML document.
pub fn yaml(v: &Value) -> String {
    match empty_or_scalar(v) {
        Some(s) => s + "\n",
        None => {
            let mut out = String::new();
            block(v, 0, &mut out);
            out
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn yaml_is_block_style_with_quoted_strings() {
        let v = json!({
            "node": "n1",
            "count": 3,
            "ok": true,
            "empty": [],
            "none": {},
            "odd key": "a \"b\"\nc",
            "volumes": [{"id": "v1", "io": {"reads": 1}}, "x", [1, 2]],
        });
        let want = "count: 3\n\
                    empty: []\n\
                    node: \"n1\"\n\
                    none: {}\n\
                    \"odd key\": \"a \\\"b\\\"\\nc\"\n\
                    ok: true\n\
                    volumes:\n  \
                      - id: \"v1\"\n    \
                        io:\n      \
                          reads: 1\n  \
                      - \"x\"\n  \
                      - - 1\n    \
                        - 2\n";
        assert_eq!(yaml(&v), want);
        assert_eq!(yaml(&json!([])), "[]\n");
        assert_eq!(yaml(&json!("s")), "\"s\"\n");
    }

    #[test]
    fn each_format_prints_its_own() {
        let v = json!({"a": 1});
        assert_eq!(Output::Text.render(&v, || "text\n".into()), "text\n");
        assert_eq!(
            Output::Json.render(&v, || unreachable!()),
            "{\n  \"a\": 1\n}\n"
        );
        assert_eq!(Output::Yaml.render(&v, || unreachable!()), "a: 1\n");
    }
}
