//! The rows of `needs` read and held to a render's objects (JSON, as kubectl prints them), what
//! a row cannot say, and the proof, on the render itself, that each of them can fail.

use super::needs::MUTATIONS;
use serde_json::{json, Value};

/// A check a row cannot say, of a render's objects.
pub(super) type Check = fn(&[Value]) -> Vec<String>;

/// One row of `needs`; its path is empty where the row is about the whole object.
pub(super) struct Row<'a> {
    pub(super) kind: &'a str,
    pub(super) name: &'a str,
    pub(super) path: &'a str,
    pub(super) test: Test<'a>,
}

pub(super) enum Test<'a> {
    Holds,
    Is(Value),
    Absent,
    Lacks(&'a str),
}

/// A row's value: JSON, else a string; `{version}` is the workspace's.
fn value(text: &str) -> Value {
    let text = text.replace("{version}", env!("CARGO_PKG_VERSION"));
    serde_json::from_str(&text).unwrap_or(Value::String(text))
}

pub(super) fn parse(row: &str) -> Row<'_> {
    let mut words = row.splitn(3, ' ');
    let (kind, name) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let rest = words.next().unwrap_or("");
    let (path, test) = if let Some(text) = rest.strip_prefix("lacks ") {
        ("", Test::Lacks(text))
    } else if let Some((path, v)) = rest.split_once(" = ") {
        (path, Test::Is(value(v)))
    } else if let Some(path) = rest.strip_suffix("absent") {
        (path.trim_end(), Test::Absent)
    } else {
        (rest, Test::Holds)
    };
    Row {
        kind,
        name,
        path,
        test,
    }
}

fn is(o: &Value, row: &Row) -> bool {
    o["kind"] == row.kind && (row.name == "*" || o["metadata"]["name"] == row.name)
}

/// A path's keys and items: split at each `/` outside `[...]`, `pod` for `spec/template/spec`.
fn segments(path: &str) -> Vec<&str> {
    let (mut out, mut start, mut depth) = (Vec::new(), 0, 0);
    for (i, c) in path.char_indices().chain([(path.len(), '/')]) {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            '/' if depth == 0 => {
                match &path[start..i] {
                    "pod" if start == 0 => out.extend(["spec", "template", "spec"]),
                    seg => out.push(seg),
                }
                start = i + 1;
            }
            _ => {}
        }
    }
    out.retain(|s| !s.is_empty());
    out
}

/// The JSON pointers of what `segs` name in `v`.
fn pointers(v: &Value, segs: &[&str]) -> Vec<String> {
    let mut found = vec![String::new()];
    for seg in segs {
        let key = seg.replace("~1", "/");
        found = found
            .into_iter()
            .flat_map(|p| match v.pointer(&p) {
                Some(Value::Array(items)) => (0..items.len())
                    .filter(|&i| selects(&items[i], i, seg))
                    .map(|i| format!("{p}/{i}"))
                    .collect(),
                Some(Value::Object(m)) if m.contains_key(&key) => vec![format!("{p}/{seg}")],
                _ => Vec::new(),
            })
            .collect();
    }
    found
}

/// Whether the item `i` of an array is the path's `seg`: `[x]` (named or equal to x), `*`, `i`.
fn selects(item: &Value, i: usize, seg: &str) -> bool {
    match seg.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        Some(x) => item["name"] == x || item == x,
        None => seg == "*" || seg == i.to_string(),
    }
}

/// What `path` names in `v`.
pub(super) fn at<'a>(v: &'a Value, path: &str) -> Vec<&'a Value> {
    let found = pointers(v, &segments(path));
    found.iter().filter_map(|p| v.pointer(p)).collect()
}

/// Sets what `path` names in `v` to `to`, or removes it; a last key that is missing is added.
pub(super) fn mutate(v: &mut Value, path: &str, to: Option<&Value>) {
    let segs = segments(path);
    let Some((last, parent)) = segs.split_last() else {
        return;
    };
    let key = last.replace("~1", "/");
    for p in pointers(v, parent) {
        match v.pointer_mut(&p) {
            Some(Value::Object(m)) => match to {
                Some(to) => drop(m.insert(key.clone(), to.clone())),
                None => drop(m.remove(&key)),
            },
            Some(Value::Array(items)) => {
                for (i, item) in std::mem::take(items).into_iter().enumerate() {
                    match (selects(&item, i, last), to) {
                        (false, _) => items.push(item),
                        (true, Some(to)) => items.push(to.clone()),
                        (true, None) => {}
                    }
                }
            }
            _ => {}
        }
    }
}

/// The problem with `objs` that `row` names, if any.
pub(super) fn fails(row: &Row, objs: &[Value]) -> Option<String> {
    let hits: Vec<&Value> = objs.iter().filter(|o| is(o, row)).collect();
    let (what, path) = (format!("{} {}", row.kind, row.name), row.path);
    match row.test {
        Test::Absent if path.is_empty() => {
            return (!hits.is_empty()).then(|| format!("{what} is there"))
        }
        _ if hits.is_empty() => return Some(format!("{what} is missing")),
        _ => {}
    }
    hits.iter().find_map(|o| {
        let found = at(o, path);
        match &row.test {
            Test::Is(want) if !found.contains(&want) => {
                let found: Vec<String> = found.iter().map(|v| v.to_string()).collect();
                let found = found.join(", ");
                Some(format!("{what}: {path} is [{found}], not {want}"))
            }
            Test::Absent if !found.is_empty() => Some(format!("{what} has {path}")),
            Test::Holds if found.is_empty() => Some(format!("{what} has no {path}")),
            Test::Lacks(t) if o.to_string().contains(t) => Some(format!("{what} has {t:?}")),
            _ => None,
        }
    })
}

/// `objs` changed so that `row` no longer holds: what it needs removed, what it forbids added.
pub(super) fn break_row(row: &Row, objs: &mut Vec<Value>) {
    let whole = row.path.is_empty();
    match row.test {
        Test::Absent if whole => {
            objs.push(json!({"kind": row.kind, "metadata": {"name": row.name}}))
        }
        Test::Holds if whole => objs.retain(|o| !is(o, row)),
        _ => {
            for o in objs.iter_mut().filter(|o| is(o, row)) {
                match row.test {
                    Test::Lacks(t) => o["metadata"]["xtask"] = json!(t),
                    Test::Absent => mutate(o, row.path, Some(&json!("xtask"))),
                    _ => mutate(o, row.path, None),
                }
            }
        }
    }
}

/// The problems of the render `name` against the rows of `tables` and `checks`; when there are
/// none, the proof that each can fail here: each row, broken, fails, and each of `MUTATIONS`
/// for this render is reported.
pub(super) fn render(
    name: &str,
    objs: &[Value],
    tables: &[&[&str]],
    checks: &[Check],
) -> Vec<String> {
    let rows = tables.concat();
    let all = |objs: &[Value]| -> Vec<String> {
        let found = rows.iter().filter_map(|r| fails(&parse(r), objs));
        found.chain(checks.iter().flat_map(|c| c(objs))).collect()
    };
    let mut problems = all(objs);
    let clean = problems.is_empty();
    for text in rows.iter().filter(|_| clean) {
        let (row, mut broken) = (parse(text), objs.to_vec());
        break_row(&row, &mut broken);
        if fails(&row, &broken).is_none() {
            problems.push(format!("the row {text:?} cannot fail"));
        }
    }
    for m in MUTATIONS.iter().filter(|m| clean && mutation(m)[0] == name) {
        let [_, target, to, words] = mutation(m);
        let (row, to, mut broken) = (parse(target), (to != "-").then(|| value(to)), objs.to_vec());
        for o in broken.iter_mut().filter(|o| is(o, &row)) {
            mutate(o, row.path, to.as_ref());
        }
        if !all(&broken).iter().any(|p| p.contains(words)) {
            problems.push(format!("the mutation {m:?} is not reported"));
        }
    }
    problems.iter().map(|p| format!("{name}: {p}")).collect()
}

/// A row of `MUTATIONS`: its render, `KIND NAME PATH`, the value, the problem's words.
pub(super) fn mutation(m: &str) -> [&str; 4] {
    let mut parts = m.split(" | ");
    [(); 4].map(|()| parts.next().unwrap_or(""))
}

/// What `KIND NAME PATH` names in `objs`.
fn values<'a>(objs: &'a [Value], target: &str) -> Vec<&'a Value> {
    let row = parse(target);
    let objs = objs.iter().filter(|o| is(o, &row));
    objs.flat_map(|o| at(o, row.path)).collect()
}

/// Whether a NetworkPolicy rule covers the port named or numbered `port` (none listed: all).
fn covers(rule: &Value, port: [&str; 2]) -> bool {
    let ports = at(rule, "ports/*/port");
    let named = |p: &&Value| port.contains(&p.as_str().unwrap_or(&p.to_string()));
    ports.is_empty() || ports.iter().any(named)
}

/// The NetworkPolicy ublkd-grpc: the gRPC port is admitted only from the sources it lists (and
/// from some), the metrics port from everyone (scraping, probes).
pub(super) fn grpc_ingress(objs: &[Value]) -> Vec<String> {
    let rules = values(objs, "NetworkPolicy ublkd-grpc spec/ingress/*");
    // For each rule that covers the port: whether it admits everyone (lists no source).
    let open = |port| -> Vec<bool> {
        let covering = rules.iter().filter(|r| covers(r, port));
        covering.map(|r| at(r, "from/*").is_empty()).collect()
    };
    let (grpc, metrics) = (open(["grpc", "7443"]), open(["metrics", "9580"]));
    [
        (grpc.contains(&true), "admits the gRPC port from anywhere"),
        (grpc.is_empty(), "admits no one to the gRPC port"),
        (
            !metrics.contains(&true),
            "does not admit everyone to the metrics port",
        ),
    ]
    .iter()
    .filter(|(bad, _)| *bad)
    .map(|(_, p)| format!("NetworkPolicy ublkd-grpc {p}"))
    .collect()
}

/// The keys ublkd-csi accepts in a VolumeAttributesClass (csi/src/qos.rs).
const QOS_KEYS: &str = "readIops writeIops readBandwidth writeBandwidth qosBurst";

/// ModifyVolume: a csi-resizer of v2 or later (which reads the v1 VolumeAttributesClass API),
/// and classes that name only keys the driver takes.
pub(super) fn modify_volume(objs: &[Value]) -> Vec<String> {
    let mut problems = Vec::new();
    let resizer = "Deployment ublkd-csi-resizer pod/containers/[csi-resizer]/image";
    for image in values(objs, resizer) {
        let tag = image.as_str().and_then(|i| i.rsplit_once(":v"));
        let major = tag.and_then(|(_, v)| v.split('.').next()?.parse::<u32>().ok());
        if major.is_none_or(|m| m < 2) {
            problems.push(format!("csi-resizer {image} is older than v2"));
        }
    }
    for params in values(objs, "VolumeAttributesClass * parameters") {
        let keys = params.as_object().into_iter().flat_map(|m| m.keys());
        for key in keys.filter(|k| !QOS_KEYS.split(' ').any(|q| q == *k)) {
            problems.push(format!("a class names {key:?}, which ublkd-csi refuses"));
        }
    }
    problems
}

/// Monitoring: the PrometheusRule holds every alert of the chart's rules file.
pub(super) fn alerts(objs: &[Value]) -> Vec<String> {
    let file = include_str!("../../../../deploy/helm/ublkd/files/ublkd-rules.yaml");
    let want = file.matches("- alert: ").count();
    let found = values(objs, "PrometheusRule * spec/groups/*/rules/*/alert").len();
    let problem = format!("the PrometheusRule has {found} alerts, files/ublkd-rules.yaml {want}");
    Vec::from_iter((found != want || want == 0).then_some(problem))
}
