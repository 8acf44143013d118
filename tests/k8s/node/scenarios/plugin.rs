//! The node plugin's own duties: UblkdNode reports, volumes without a PV, and `kubectl ublkd`.

use crate::kube::{field, has_line, words, Mode, Sc, NODE};
use anyhow::{ensure, Result};
use serde_json::Value;

/// `kubectl ublkd` (the plugin, found on kubectl's PATH like any plugin) run by on-call staff
/// who hold only the chart's read-only `ublkd-viewer` ClusterRole (a service account's token,
/// in a kubeconfig of its own, picked by `--kubeconfig` and `--context`): they cannot exec into
/// ublkd's pods, and need not. `pvc` shows a running pod's claim with its node, volume, state,
/// device and writes; `nodes` the node's report; `orphans -o json` lists a volume made outside
/// Kubernetes until it is deleted; `check` passes; `dump` writes the bundle; and the report is
/// `kubectl get ublkdnodes` for anyone with the role.
pub fn plugin(s: &Sc) -> Result<()> {
    s.pvc("x-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-x", "x-data", Mode::Filesystem)?;
    s.in_pod(
        "p-x",
        "dd if=/dev/zero of=/data/f bs=4096 count=256 conv=fsync",
    )?;
    let vol = s.volume_of("x-data")?;
    // on-call: a service account bound to ublkd-viewer and nothing else
    s.kw("create serviceaccount oncall -n default")?;
    s.kw("create clusterrolebinding oncall-ublkd --clusterrole=ublkd-viewer --serviceaccount=default:oncall")?;
    s.kw("create rolebinding oncall-ublkd-logs -n ublkd-system --role=ublkd-viewer-logs --serviceaccount=default:oncall")?;
    let token = s.qw("create token oncall -n default")?;
    let admin: Value =
        serde_json::from_str(&s.qw("config view --raw --minify --flatten -o json")?)?;
    let cluster = &admin["clusters"][0]["cluster"];
    let conf = "--kubeconfig=oncall.kubeconfig";
    let config = |line: &str| s.kw(&format!("config {conf} {line}"));
    let server = cluster["server"].as_str().unwrap_or_default();
    config(&format!("set-cluster tier --server={server}"))?;
    let ca = cluster["certificate-authority-data"].as_str();
    let ca_key = "clusters.tier.certificate-authority-data";
    s.q(&["config", conf, "set", ca_key, ca.unwrap_or_default()])?;
    let token = format!("--token={token}");
    s.q(&["config", conf, "set-credentials", "oncall", &token])?;
    config("set-context oncall --cluster=tier --user=oncall")?;
    let can_in = |verb: &str, what: &str, ns: &str| -> Result<String> {
        let line = format!("{conf} --context=oncall auth can-i {verb} {what} -n {ns}");
        let a = s.node.host.call("kubectl", &words(&line), None)?;
        Ok(a.out.trim().to_owned())
    };
    let can = |verb: &str, what: &str| can_in(verb, what, "ublkd-system");
    let logs = (
        can("get", "pods --subresource=log")?,
        can_in("get", "pods --subresource=log", "default")?,
    );
    ensure!(
        logs == ("yes".into(), "no".into()),
        "the viewer's pod logs, in ublkd's namespace and in default: {logs:?} (want yes, no)"
    );
    ensure!(
        can("create", "pods --subresource=exec")? == "no",
        "the viewer may exec into ublkd's pods"
    );
    ensure!(
        can("list", "ublkdnodes.ublkd.io")? == "yes",
        "the viewer may not list UblkdNodes"
    );
    let oncall = |line: &str| s.kw(&format!("ublkd {conf} --context=oncall {line}"));
    let out = oncall("nodes")?;
    s.say(&out);
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(NODE))
        .unwrap_or_default();
    let cells: Vec<&str> = line.split_whitespace().collect();
    let volumes = cells.get(3).and_then(|n| n.parse::<u64>().ok());
    ensure!(
        volumes.unwrap_or(0) >= 1,
        "kubectl ublkd nodes has no line for {NODE} with a volume"
    );
    ensure!(
        cells.get(5) == Some(&"ok"),
        "kubectl ublkd nodes shows failing checks for {NODE}"
    );
    ensure!(
        line.contains("ublkd-ram="),
        "kubectl ublkd nodes shows no capacity for ublkd-ram"
    );
    let other = s.second_node();
    if let Some(other) = other {
        ensure!(
            out.lines()
                .any(|l| l.split_whitespace().next() == Some(other)),
            "kubectl ublkd nodes has no line for {other}"
        );
    }
    let out = oncall("check")?;
    s.say(&out);
    let report: Value = serde_json::from_str(&s.qw(&format!("get ublkdnode {NODE} -o json"))?)?;
    let status = &report["status"];
    let vols = status["volumes"].as_array().cloned().unwrap_or_default();
    ensure!(
        vols.iter()
            .any(|v| v["id"] == vol.as_str() && v["claim"] == "default/x-data"),
        "the report does not name {vol}'s claim: {vols:?}"
    );
    let pools = status["pools"].as_array().cloned().unwrap_or_default();
    ensure!(
        pools
            .iter()
            .any(|p| p["storageClass"] == "ublkd-file" && p["reflink"] == true),
        "the report's ublkd-file pool is not reflink: {pools:?}"
    );
    s.ublkctl("create-volume stray-1 --size 16MiB --backend ram")?;
    // in the node's report first (written every csiNode.reportStatusEvery)
    s.wait(60, "the node's report lists stray-1", || {
        let report = s.jp(&["ublkdnode", NODE], "{.status.volumes[*].id}");
        report.is_ok_and(|ids| ids.split_whitespace().any(|id| id == "stray-1"))
    })?;
    let listed =
        |out: &str, name: &str| -> Result<bool> {
            let v: Value = serde_json::from_str(out)?;
            Ok(v["orphans"].as_array().into_iter().flatten().any(|o| {
                o["node"] == NODE && o["kind"] == "volume-without-pv" && o["name"] == name
            }))
        };
    let out = oncall("orphans -o json")?;
    s.say(&out);
    ensure!(
        listed(&out, "stray-1")?,
        "kubectl ublkd orphans does not list stray-1"
    );
    ensure!(
        !listed(&out, &vol)?,
        "kubectl ublkd orphans lists {vol}, whose PV exists"
    );
    let out = oncall("orphans -o yaml")?;
    ensure!(
        has_line(&out, "name: \"stray-1\""),
        "kubectl ublkd orphans -o yaml does not list stray-1: {out}"
    );
    s.ublkctl("delete-volume stray-1")?;
    let out = oncall("orphans -o json")?;
    ensure!(
        !listed(&out, "stray-1")?,
        "stray-1 is still listed after it was deleted"
    );
    let out = oncall("dump oncall-dump")?;
    s.say(&out);
    let other_report = other.map(|o| format!("nodes/{o}.json"));
    for file in [
        "nodes/ublkd-vm.json",
        other_report.as_deref().unwrap_or("nodes/ublkd-vm.json"),
        "orphans.json",
        "check.json",
        "pvs.json",
        "events.json",
    ] {
        ensure!(
            has_line(&out, file),
            "kubectl ublkd dump did not write {file}"
        );
    }
    ensure!(
        out.lines().any(|l| l.starts_with("logs/ublkd-")),
        "kubectl ublkd dump wrote no log of ublkd's pods"
    );
    ensure!(
        !out.contains(".error"),
        "kubectl ublkd dump could not read a part"
    );
    plugin_writes_only_its_own_report(s, conf)?;
    // the node plugin's report after the writes, looked at last: counters alone are written
    // within a minute (nodestatus::REFRESH), not at every look, and that minute passes in the
    // checks above (52 s of waiting when this came first, 2026-12-07)
    let mut out = String::new();
    let shown = s.wait(120, "kubectl ublkd pvc shows the writes", || {
        out = oncall("pvc x-data").unwrap_or_else(|e| format!("{e:#}"));
        // the write line: requests, then bytes (the file's 1 MiB, merged into few requests)
        let written = out.lines().find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.first() == Some(&"write")).then(|| w.get(2)?.parse::<u64>().ok())?
        });
        written.unwrap_or(0) >= 1 << 20
    });
    if let Err(e) = shown {
        s.say(&out);
        s.show("get ublkdnodes -o yaml");
        s.show(&s.csi_node_logs());
        return Err(e);
    }
    s.say(&out);
    for (key, want) in [("node", NODE), ("volume", vol.as_str()), ("state", "ready")] {
        ensure!(
            field(&out, key) == Some(want),
            "kubectl ublkd pvc: {key} is not {want}"
        );
    }
    ensure!(
        field(&out, "device").is_some_and(|d| d.starts_with("/dev/ublkb")),
        "kubectl ublkd pvc does not show the device"
    );
    ensure!(
        field(&out, "qos") == Some("unlimited"),
        "kubectl ublkd pvc does not show the limits"
    );
    s.delete("clusterrolebinding oncall-ublkd")?;
    s.delete("rolebinding oncall-ublkd-logs -n ublkd-system")?;
    s.delete("serviceaccount oncall -n default")?;
    s.delete("pod p-x")?;
    s.delete("pvc x-data")
}

/// Per-node trust: a token of the node plugin's service account, bound to this node's plugin
/// pod as the kubelet's is, may write this node's UblkdNode and no other (the chart's
/// ValidatingAdmissionPolicy on the token's node name; RBAC alone lets every node plugin patch
/// every report). Both writes are server-side dry runs: nothing changes.
fn plugin_writes_only_its_own_report(s: &Sc, conf: &str) -> Result<()> {
    let plugin = s.pod_on_node("ublkd-csi-node")?;
    let token = s.qw(&format!(
        "create token ublkd-csi-node -n ublkd-system --bound-object-kind=Pod --bound-object-name={plugin}"
    ))?;
    let token = format!("--token={}", token.trim());
    s.q(&["config", conf, "set-credentials", "plugin", &token])?;
    s.kw(&format!(
        "config {conf} set-context plugin --cluster=tier --user=plugin"
    ))?;
    let write = |node: &str| -> Result<crate::kube::Answer> {
        let report = format!(
            "{{\"apiVersion\":\"ublkd.io/v1alpha1\",\"kind\":\"UblkdNode\",\"metadata\":{{\"name\":\"{node}\"}}}}"
        );
        let line = format!(
            "{conf} --context=plugin apply --server-side --force-conflicts --field-manager=ublkd-csi --dry-run=server -f -"
        );
        s.node.host.call("kubectl", &words(&line), Some(&report))
    };
    let own = write(NODE)?;
    s.say(format!("own report: rc {} {}{}", own.rc, own.out, own.err));
    ensure!(
        own.rc == 0,
        "the node plugin may not write its own node's UblkdNode: {}",
        own.err
    );
    // the other node of the cluster when there is one, else a name no node has
    let nodes = s.jp(&["nodes"], "{.items[*].metadata.name}")?;
    let another = nodes
        .split_whitespace()
        .find(|n| *n != NODE)
        .unwrap_or("another-node")
        .to_owned();
    let other = write(&another)?;
    s.say(format!(
        "another node's report: rc {} {}",
        other.rc, other.err
    ));
    ensure!(
        other.rc != 0 && other.err.contains("writes only its own node's UblkdNode"),
        "the node plugin wrote another node's UblkdNode (or was refused for another reason)"
    );
    Ok(())
}
