//! The reading of `needs` and the checks of `check` on small objects; that each can fail on
//! the chart's own renders is proven by `check::render` (`cargo xtask manifests`, host tier).

use super::check::{at, break_row, fails, grpc_ingress, mutate, mutation, parse, Test};
use super::{needs, RENDERS};
use serde_json::{json, Value};

#[test]
fn every_row_and_mutation_reads() {
    let tables = RENDERS
        .iter()
        .flat_map(|r| r.2.iter())
        .chain([&needs::KUSTOMIZE]);
    for row in tables.flat_map(|t| t.iter()) {
        let r = parse(row);
        assert!(!r.kind.is_empty() && !r.name.is_empty(), "{row}");
        assert!(
            !r.path.is_empty() || !matches!(r.test, Test::Is(_)),
            "{row}"
        );
    }
    for m in needs::MUTATIONS {
        let [render, target, to, words] = mutation(m);
        assert!(RENDERS.iter().any(|r| r.0 == render), "{m}");
        assert!(
            !parse(target).path.is_empty() && !to.is_empty() && !words.is_empty(),
            "{m}"
        );
    }
}

#[test]
fn each_kind_of_row_holds_then_fails_once_broken() {
    let objs = vec![
        json!({"kind": "DaemonSet", "metadata": {"name": "d", "labels": {"a.io/n": "d"}},
        "spec": {"template": {"spec": {"containers": [
            {"name": "c", "args": ["--x", "--y=/a"], "env": [{"name": "E", "value": "v"}]}]}}}}),
    ];
    for row in [
        "DaemonSet d",
        "DaemonSet * pod/containers/[c]/env/[E]/value = v",
        "DaemonSet d pod/containers/*/args/[--y=/a]",
        "DaemonSet d metadata/labels/a.io~1n = d",
        "DaemonSet d pod/containers/0/subPath absent",
        "DaemonSet d lacks privileged",
        "NetworkPolicy * absent",
    ] {
        let r = parse(row);
        assert_eq!(fails(&r, &objs), None, "{row}");
        let mut broken = objs.clone();
        break_row(&r, &mut broken);
        assert!(fails(&r, &broken).is_some(), "{row}");
    }
    let wrong = parse("DaemonSet d pod/containers/[c]/env/[E]/value = w");
    let problem = r#"DaemonSet d: pod/containers/[c]/env/[E]/value is ["v"], not "w""#;
    assert_eq!(fails(&wrong, &objs).as_deref(), Some(problem));
    assert_eq!(
        fails(&parse("Service s"), &objs).as_deref(),
        Some("Service s is missing")
    );
    let mut o = objs[0].clone();
    mutate(&mut o, "pod/containers/[c]/args/[--x]", None);
    assert_eq!(at(&o, "pod/containers/[c]/args"), [&json!(["--y=/a"])]);
}

#[test]
fn the_grpc_port_is_admitted_from_listed_sources_and_metrics_from_all() {
    let policy = |ingress: Value| {
        [
            json!({"kind": "NetworkPolicy", "metadata": {"name": "ublkd-grpc"},
            "spec": {"ingress": ingress}}),
        ]
    };
    let from = json!([{"ipBlock": {"cidr": "192.0.2.0/24"}}]);
    let grpc = json!({"from": from, "ports": [{"port": "grpc"}]});
    let metrics = json!({"ports": [{"port": 9580}]});
    assert!(grpc_ingress(&policy(json!([grpc, metrics]))).is_empty());
    for (ingress, words) in [
        (
            json!([{"ports": [{"port": 7443}]}, metrics]),
            "from anywhere",
        ),
        (json!([metrics]), "no one to the gRPC port"),
        (
            json!([grpc, {"from": from, "ports": [{"port": "metrics"}]}]),
            "metrics port",
        ),
    ] {
        let problems = grpc_ingress(&policy(ingress));
        assert!(
            problems.iter().any(|p| p.contains(words)),
            "{words}: {problems:?}"
        );
    }
}
