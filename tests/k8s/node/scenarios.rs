//! The Kubernetes tier's scenarios, run by the node (`node`) once the driver is installed: one
//! function each, read top to bottom, every call it makes in its own log
//! (`logs/scenario-NAME.log` in the run directory).

use crate::kube::{
    field, fill, has_line, local, mib, Daemon, Mode, Node, Sc, CSI_NODE_LOGS, NODE, UBLKD_PODS,
};
use anyhow::{bail, ensure, Context, Result};
use serde_json::{json, Value};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

type Scenario = (&'static str, fn(&Sc) -> Result<()>);

/// The scenarios, in the order they run; those in one group run at once (they share no
/// object, no pool that one of them fills and no component that one of them restarts).
pub const PLAN: &[&[Scenario]] = &[
    &[("driver", driver)],
    &[("file-ext4", file_ext4), ("admission", admission)],
    &[("ram", ram)],
    &[("nvme-xfs", nvme_xfs)],
    // Light pairs only. All five of the lines above and this one at once saturated the guest's
    // two CPUs for 680 s in one boot, long enough for the node plugin's liveness probe to time
    // out (10 s), a warning the warnings scenario then rightly refused.
    &[("block", block), ("pending", pending)],
    // monitoring fills the file pool; plugin's volumes are RAM, its orphans its own.
    &[("monitoring", monitoring), ("plugin", plugin)],
    &[("snapshots", snapshots)],
    &[("warnings", warnings)],
    // After warnings: a wrong key is a Warning on purpose. modify's claim, class and fio are
    // its own.
    &[("modify", modify), ("encrypted", encrypted)],
    &[("ublkd-restart", ublkd_restart)],
    &[("kubelet-restart", kubelet_restart)],
    &[("drain", drain)],
    &[("stuck", stuck)],
    // After warnings: both make Warning Events on purpose. Alone: one kills ublkd, the other
    // takes its driver away.
    &[("volume-fault", volume_fault)],
    &[("ublk-missing", ublk_missing)],
    &[("node-loss", node_loss)],
    // deletes and re-registers this node: after every scenario that needs it untouched
    &[("node-alive", node_alive)],
    &[("uninstall", uninstall)],
];

/// Every scenario's name, in order.
pub fn names() -> impl Iterator<Item = &'static str> {
    PLAN.iter().flat_map(|g| g.iter().map(|(n, _)| *n))
}

/// Runs the scenarios the input names (all when none), group by group; how many failed.
pub fn run(node: &Node) -> usize {
    let wanted =
        |n: &str| node.input.scenarios.is_empty() || node.input.scenarios.iter().any(|s| s == n);
    let mut failed = 0;
    for group in PLAN {
        let chosen: Vec<&Scenario> = group.iter().filter(|(n, _)| wanted(n)).collect();
        failed += std::thread::scope(|s| {
            let hs: Vec<_> = chosen
                .iter()
                .map(|sc| s.spawn(|| run_one(node, sc)))
                .collect();
            hs.into_iter()
                .map(|h| h.join().map_or(1, usize::from))
                .sum::<usize>()
        });
    }
    failed
}

/// One scenario: its log, its verdict and time on the console (one write, so that scenarios
/// run together do not interleave their reports); 1 when it failed.
fn run_one(node: &Node, (name, f): &Scenario) -> bool {
    let path = node.logs.join(format!("scenario-{name}.log"));
    let log = match File::create(&path) {
        Ok(f) => f,
        Err(e) => {
            println!(
                "SCENARIO {name} FAILED 0.0\n  cannot create {}: {e}",
                path.display()
            );
            return true;
        }
    };
    let sc = Sc::new(node, log);
    let started = Instant::now();
    let c0 = cpu_ticks();
    node.say(format!("scenario {name}"));
    let result = f(&sc);
    let took = started.elapsed().as_secs_f64();
    // How busy the guest's CPUs were meanwhile: near 100 % says the scenario waited on the
    // emulated CPUs, well under says it waited on Kubernetes's own loops.
    let busy = match (c0, cpu_ticks()) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => 100 * (b1 - b0) / (t1 - t0),
        _ => 0,
    };
    let mut report = match &result {
        Ok(()) => format!("SCENARIO {name} ok {took:.1}\n"),
        Err(e) => {
            sc.say(format!("check failed: {e:#}"));
            let text = fs::read_to_string(&path).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            // "> " marks the lines the host's summary repeats under the verdict.
            let tail: Vec<String> = lines[lines.len().saturating_sub(40)..]
                .iter()
                .map(|l| format!("> {l}"))
                .collect();
            let tail = tail.join("\n");
            format!("SCENARIO {name} FAILED {took:.1}\n{tail}\n")
        }
    };
    report.push_str(&format!(
        "k8s [{:.1}] scenario {name} ended: the guest's CPUs {busy} % busy while it ran",
        node.now()
    ));
    println!("{report}");
    result.is_err()
}

/// The guest's busy and total CPU time so far, in ticks (/proc/stat's first line).
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)?;
    Some((busy, busy + f.get(3)? + f.get(4)?))
}

/// The size of the file system at /data in `pod`, in KiB. `-P`: one line per file system
/// (busybox wraps a long device name, such as an encrypted volume's mapping).
fn df_kib(s: &Sc, pod: &str) -> Result<u64> {
    let out = s.in_pod(pod, "df -kP /data | tail -1")?;
    let kib = out
        .split_whitespace()
        .nth(1)
        .context("df printed no size")?;
    kib.parse().with_context(|| format!("df's size {kib:?}"))
}

/// Files under `dir` whose name contains `part`.
fn files_named(dir: &Path, part: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_named(&p, part));
        } else if e.file_name().to_string_lossy().contains(part) {
            found.push(p);
        }
    }
    found
}

/// The driver as the cluster sees it: CSINode with the topology key and a volume limit, and
/// capacity objects for every class.
fn driver(s: &Sc) -> Result<()> {
    // How long ublkd took from its container's start to binding the listener of its startup
    // probe (for the record: a probe before that bind is a warning event, warnings).
    let sel = UBLKD_PODS;
    let path =
        r#"{.items[0].status.containerStatuses[?(@.name=="ublkd")].state.running.startedAt}"#;
    let started = s.jp(&sel, path)?;
    let logs = s.q(&[
        "-n",
        "ublkd-system",
        "logs",
        "ds/ublkd",
        "-c",
        "ublkd",
        "--timestamps",
    ])?;
    let bound = logs
        .lines()
        .find(|l| l.contains("metrics on"))
        .and_then(|l| l.split(' ').next());
    s.say(format!(
        "ublkd container started {started}; metrics listener bound {bound:?}"
    ));
    let drv = r#"{.spec.drivers[?(@.name=="ublkd.io")]"#;
    let keys = s.jp(&["csinode", NODE], &format!("{drv}.topologyKeys}}"))?;
    s.say(format!("topology keys: {keys}"));
    ensure!(
        !keys.is_empty() && keys != "[]",
        "CSINode lists ublkd.io with a topology key"
    );
    let count = s.jp(&["csinode", NODE], &format!("{drv}.allocatable.count}}"))?;
    s.say(format!("volume limit: {count}"));
    ensure!(
        count.parse::<u64>().unwrap_or(0) > 0,
        "CSINode gives ublkd.io a volume limit"
    );
    // the provisioner publishes them once it has synced; a slow emulated node takes minutes
    let capacities = || {
        s.q(&["get", "csistoragecapacities", "-A", "--no-headers"])
            .is_ok_and(|o| o.lines().count() >= 3)
    };
    s.wait(420, "3 CSIStorageCapacity objects", capacities)?;
    let cols =
        "custom-columns=CLASS:.storageClassName,CAPACITY:.capacity,NODE:.nodeTopology.matchLabels";
    s.show(&["get", "csistoragecapacities", "-A", "-o", cols]);
    s.wait(120, "the finalizer ublkd.io/node on the node", || {
        s.finalized(NODE)
    })?;
    for sc in ["ublkd-file", "ublkd-ram", "ublkd-nvme"] {
        let path = format!(r#"{{.items[?(@.storageClassName=="{sc}")].capacity}}"#);
        let n = s.jp(&["csistoragecapacities", "-A"], &path)?;
        ensure!(!n.is_empty(), "a CSIStorageCapacity for {sc}");
    }
    Ok(())
}

/// What admission policies ask of the installed chart: every container of ublkd-system's pods
/// requests CPU and memory, has a memory limit (ublkd admits volumes within its own) and a
/// securityContext;
/// each Deployment's pod is admitted in a namespace that enforces Pod Security "restricted";
/// and OPA, built from its module, denies nothing in the packaged chart's default render.
fn admission(s: &Sc) -> Result<()> {
    let json = |args: &[&str]| -> Result<Value> { Ok(serde_json::from_str(&s.q(args)?)?) };
    let pods = json(&["-n", "ublkd-system", "get", "pods", "-o", "json"])?;
    let (mut wrong, mut seen) = (Vec::new(), 0);
    for p in pods["items"].as_array().into_iter().flatten() {
        let (pod, spec) = (p["metadata"]["name"].as_str().unwrap_or("?"), &p["spec"]);
        let all = ["initContainers", "containers"].map(|k| spec[k].as_array().cloned());
        for c in all.into_iter().flatten().flatten() {
            let (name, r) = (c["name"].as_str().unwrap_or("?"), &c["resources"]);
            seen += 1;
            if r["requests"]["cpu"].is_null() || r["requests"]["memory"].is_null() {
                wrong.push(format!("{pod}/{name}: no CPU or memory request"));
            }
            if r["limits"]["memory"].is_null() {
                wrong.push(format!("{pod}/{name}: no memory limit"));
            }
            if c["securityContext"].is_null() {
                wrong.push(format!("{pod}/{name}: no securityContext"));
            }
        }
    }
    s.say(format!("{seen} containers looked at; wrong: {wrong:?}"));
    ensure!(
        seen >= 8 && wrong.is_empty(),
        "every container fits the policies: {wrong:?}"
    );
    let ns = "ublkd-restricted";
    let labels = json!({"pod-security.kubernetes.io/enforce": "restricted"});
    let namespace = json!({"apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": ns, "labels": labels}});
    s.apply(&namespace.to_string())?;
    let deployments = json(&["-n", "ublkd-system", "get", "deployments", "-o", "json"])?;
    let (mut admitted, mut refused) = (0, None);
    for d in deployments["items"].as_array().into_iter().flatten() {
        let name = d["metadata"]["name"].as_str().unwrap_or("?");
        // Its service account is in ublkd-system only: the namespace's default stands in.
        let mut spec = d["spec"]["template"]["spec"].clone();
        if let Some(m) = spec.as_object_mut() {
            m.remove("serviceAccountName");
            m.remove("serviceAccount");
        }
        let pod = json!({"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": ns}, "spec": spec});
        let out = s.dry_run(ns, &pod.to_string());
        s.say(format!("{name}: {out:?}"));
        refused = refused.or(out
            .err()
            .map(|e| e.context(format!("{name}'s pod under Pod Security \"restricted\""))));
        admitted += 1;
    }
    // The namespace goes whether or not a pod was refused.
    s.delete(&["namespace", ns])?;
    if let Some(e) = refused {
        return Err(e);
    }
    ensure!(admitted >= 2, "the controller and the resizer were tried");
    // A policy engine's verdict (OPA, its rules in tests/k8s/policy) on the packaged chart's
    // default render, and on a Deployment made as those rules forbid: the rules can refuse.
    let deny = |render: &str| -> Result<Vec<String>> {
        let v = s.opa(&json!({"render": render}), "data.ublkd.admission.deny")?;
        let list = v.as_array().context("OPA's deny is not a set")?;
        Ok(list
            .iter()
            .filter_map(|m| m.as_str().map(str::to_owned))
            .collect())
    };
    let render = s.helm_chart("template", &[])?;
    let denied = deny(&render)?;
    s.say(format!("OPA on the default render: {denied:?}"));
    ensure!(
        denied.is_empty(),
        "OPA denies the default render: {denied:?}"
    );
    let bad = "apiVersion: apps/v1\nkind: Deployment\nmetadata: {name: bad}\nspec: {template: \
               {metadata: {labels: {}}, spec: {containers: [{name: c, image: busybox}]}}}\n";
    let denied = deny(&format!("{render}\n---\n{bad}"))?;
    s.say(format!("OPA on a bad Deployment: {denied:?}"));
    for rule in [
        "no resources.requests.cpu",
        "no securityContext",
        "no tag or digest",
        "lack the label app.kubernetes.io/name",
        "runAsNonRoot is not true",
        "capabilities do not drop ALL",
    ] {
        ensure!(
            denied
                .iter()
                .any(|m| m.starts_with("Deployment bad") && m.contains(rule)),
            "OPA did not deny a Deployment with {rule}: {denied:?}"
        );
    }
    Ok(())
}

fn file_ext4(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-file")
}

fn ram(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-ram")
}

fn nvme_xfs(s: &Sc) -> Result<()> {
    filesystem(s, "ublkd-nvme")
}

/// A filesystem class: data written survives the pod, online expansion reaches df, and the
/// claim's deletion takes the ublkd volume (and its backing file) with it.
fn filesystem(s: &Sc, class: &str) -> Result<()> {
    let (claim, pod) = (format!("d-{class}"), format!("p-{class}"));
    s.pvc(&claim, class, "64Mi", Mode::Filesystem)?;
    let phase = s.jp(&["pvc", &claim], "{.status.phase}")?;
    s.say(format!("before a consumer: {phase}"));
    ensure!(
        phase == "Pending",
        "WaitForFirstConsumer leaves the claim Pending until a pod"
    );
    s.pod(&pod, &claim, Mode::Filesystem)?;
    s.in_pod(&pod, "echo ublkd-k8s-data >/data/f && sync")?;
    s.delete(&["pod", &pod])?;
    s.pod(&pod, &claim, Mode::Filesystem)?;
    let got = s.in_pod(&pod, "cat /data/f")?;
    ensure!(
        got == "ublkd-k8s-data",
        "the data is there after the pod is recreated ({got})"
    );
    let df = || df_kib(s, &pod);
    let before = df()?;
    // What the driver gave (an xfs class rounds a claim up to xfs's smallest, 300 MiB), and
    // 64 MiB more of it.
    let have = mib(&s.jp(&["pvc", &claim], "{.status.capacity.storage}")?)?;
    s.say(format!("claimed 64 MiB, got {have} MiB"));
    ensure!(have >= 64, "the claim got at least what it asked for");
    let pv = s.jp(&["pvc", &claim], "{.spec.volumeName}")?;
    let grow =
        json!({"spec": {"resources": {"requests": {"storage": format!("{}Mi", have + 64)}}}});
    s.k(&["patch", "pvc", &claim, "-p", &grow.to_string()])?;
    // The kubelet grows a mounted file system (NodeExpandVolume) when it next syncs the pod, a
    // minute and more after the PV grew; an update to the pod syncs it at once (a kubelet
    // resyncing every 10 s instead cost the guest a tenth of its CPUs). The growth is still the
    // resizer's, the kubelet's and the driver's.
    let pv_grown = || {
        s.jp(&["pv", &pv], "{.spec.capacity.storage}")
            .is_ok_and(|c| mib(&c).is_ok_and(|m| m > have))
    };
    s.wait(300, "the PV grew", pv_grown)
        .inspect_err(|_| s.tail(15, &["describe", "pvc", &claim]))?;
    let resync = format!("ublkd.test/resync={:.0}", s.node.now());
    s.k(&["annotate", "pod", &pod, "--overwrite", &resync])?;
    s.wait(420, "df grew", || df().is_ok_and(|k| k > before + 32768))
        .inspect_err(|_| s.tail(15, &["describe", "pvc", &claim]))?;
    s.say(format!("df: {before} KiB, then {} KiB", df()?));
    let vol = s.jp(&["pv", &pv], "{.spec.csi.volumeHandle}")?;
    s.say(format!("volume {vol}"));
    let list = s.ublkctl(&["list-volumes"])?;
    ensure!(list.contains(&vol), "ublkd does not list {vol}:\n{list}");
    // The claim the volume was made for, kept with it (the provisioner's --extra-create-metadata).
    let info = s.ublkctl(&["get-volume", &vol])?;
    let claimed = field(&info, "claim").unwrap_or_default();
    s.say(format!("claim: {claimed}"));
    ensure!(
        claimed == format!("default/{claim} (pv {pv})"),
        "get-volume names the claim default/{claim} and its PV {pv}"
    );
    let root = Path::new("/var/lib/ublkd/volumes");
    if class == "ublkd-file" {
        // The root is a hostPath: the node sees the backing file itself.
        ensure!(
            !files_named(root, &vol).is_empty(),
            "no backing file of {vol} on the node"
        );
    }
    s.delete(&["pod", &pod])?;
    s.delete(&["pvc", &claim])?;
    let gone = || {
        !s.exists(&["pv", &pv])
            && s.ublkctl(&["list-volumes"])
                .is_ok_and(|l| !l.contains(&vol))
    };
    s.wait(300, "the volume went with its claim", gone)?;
    if class == "ublkd-file" {
        ensure!(
            files_named(root, &vol).is_empty(),
            "the backing file of {vol} outlived its claim"
        );
    }
    Ok(())
}

/// A raw-block claim: the device itself in the pod, its bytes kept across pods.
fn block(s: &Sc) -> Result<()> {
    s.pvc("d-block", "ublkd-ram", "64Mi", Mode::Block)?;
    s.pod("p-block", "d-block", Mode::Block)?;
    s.in_pod(
        "p-block",
        "echo ublkd-k8s-block | dd of=/dev/xvda bs=512 count=1 conv=fsync",
    )?;
    s.delete(&["pod", "p-block"])?;
    s.pod("p-block", "d-block", Mode::Block)?;
    let got = s.in_pod("p-block", "dd if=/dev/xvda bs=15 count=1 2>/dev/null")?;
    ensure!(
        got == "ublkd-k8s-block",
        "the block device kept its bytes across pods ({got})"
    );
    s.delete(&["pod", "p-block"])?;
    s.delete(&["pvc", "d-block"])
}

/// A claim larger than the node can hold: the pod stays Pending, and the scheduler says why.
fn pending(s: &Sc) -> Result<()> {
    s.pvc("d-huge", "ublkd-ram", "100Ti", Mode::Filesystem)?;
    s.apply(
        r#"apiVersion: v1
kind: Pod
metadata: {name: p-huge}
spec:
  containers:
    - {name: app, image: ublkd.test/busybox:test, command: ["/bin/sh", "-c", "sleep 3600"],
       volumeMounts: [{name: v, mountPath: /data}]}
  volumes: [{name: v, persistentVolumeClaim: {claimName: d-huge}}]
"#,
    )?;
    let events = |sel: &str| s.jp(&["events", "--field-selector", sel], "{.items[*].message}");
    let why = || {
        events("involvedObject.name=p-huge,reason=FailedScheduling")
            .is_ok_and(|m| m.to_lowercase().contains("storage"))
    };
    s.wait(300, "a FailedScheduling event naming storage", why)
        .inspect_err(|_| s.tail(10, &["describe", "pod", "p-huge"]))?;
    s.say(events("involvedObject.name=p-huge")?);
    ensure!(
        s.jp(&["pod", "p-huge"], "{.status.phase}")? == "Pending",
        "p-huge left Pending"
    );
    ensure!(
        s.jp(&["pvc", "d-huge"], "{.status.phase}")? == "Pending",
        "d-huge left Pending"
    );
    s.delete(&["pod", "p-huge"])?;
    s.delete(&["pvc", "d-huge"])
}

/// Prometheus (built from its module: Debian's has no Kubernetes discovery) on the node,
/// scraping the way the chart's ServiceMonitor does (tests/k8s/node/prometheus.yml). Its rules
/// are the chart's files/ublkd-rules.yaml with one change: UblkdPoolAlmostFull's `for: 10m`
/// cut to 20s. The file pool is then filled with files beside the volumes' (fallocate, to 5 %
/// free as ublkd reports it): the alert fires for that pool, and clears once they are gone.
fn monitoring(s: &Sc) -> Result<()> {
    let i = &s.node.input;
    let w = Path::new("/tmp/prometheus");
    // A directory left by an earlier run in this guest, if any.
    let _ = fs::remove_dir_all(w);
    fs::create_dir_all(w.join("data"))?;
    let rules = fs::read_to_string(i.chart.join("files/ublkd-rules.yaml"))?;
    let at = rules
        .find("alert: UblkdPoolAlmostFull")
        .context("no UblkdPoolAlmostFull rule")?;
    let end = rules[at + 1..]
        .find("alert:")
        .map_or(rules.len(), |e| at + 1 + e);
    let rule = &rules[at..end];
    ensure!(
        rule.contains("for: 10m"),
        "the pool alert's for: was not where the test expects it"
    );
    let rules = format!(
        "{}{}{}",
        &rules[..at],
        rule.replacen("for: 10m", "for: 20s", 1),
        &rules[end..]
    );
    fs::write(w.join("rules.yaml"), rules)?;
    let conf = include_str!("prometheus.yml");
    let pki = i.pki.to_string_lossy();
    fs::write(
        w.join("prometheus.yml"),
        fill(conf, &[("DIR", &w.to_string_lossy()), ("PKI", &pki)]),
    )?;
    let config = format!("--config.file={}/prometheus.yml", w.display());
    let tsdb = format!("--storage.tsdb.path={}/data", w.display());
    let args = [
        config.as_str(),
        &tsdb,
        "--web.listen-address=127.0.0.1:9090",
    ];
    let _prom = Daemon::start(
        &i.prometheus,
        &args,
        &[],
        &s.node.logs.join("prometheus.log"),
    )?;
    let q = |query: &str| -> Result<Vec<Value>> {
        let arg = format!("query={query}");
        let url = "http://127.0.0.1:9090/api/v1/query";
        let out = local("curl", &["-fsS", "--get", url, "--data-urlencode", &arg])?;
        let v: Value = serde_json::from_str(&out)?;
        v["data"]["result"]
            .as_array()
            .cloned()
            .context("no result in Prometheus's answer")
    };
    let value = |query: &str| -> Result<f64> {
        let r = q(query)?;
        let v = r
            .first()
            .and_then(|r| r["value"][1].as_str())
            .context("no value")?;
        v.parse().with_context(|| format!("{query} = {v:?}"))
    };
    s.wait(300, "Prometheus scraped ublkd", || {
        value(r#"up{job="ublkd"}"#).is_ok_and(|v| v == 1.0)
    })
    .inspect_err(|_| {
        let t = local("curl", &["-fsS", "http://127.0.0.1:9090/api/v1/targets"]);
        s.say(t.unwrap_or_else(|e| format!("{e:#}")));
    })?;
    // The sidecars' own metrics: every CSI call the provisioner and the resizer made (their
    // start's GetPluginInfo and Probe at least), by node and container.
    let sidecars = || -> Result<Vec<(String, String)>> {
        let r = q("count by (container, node) (csi_sidecar_operations_seconds_count)")?;
        let label = |r: &Value, l: &str| r["metric"][l].as_str().unwrap_or("").to_owned();
        Ok(r.iter()
            .map(|r| (label(r, "container"), label(r, "node")))
            .collect())
    };
    s.wait(
        120,
        "the provisioner's and resizer's metrics scraped",
        || {
            sidecars().is_ok_and(|seen| {
                ["csi-provisioner", "csi-resizer"]
                    .iter()
                    .all(|c| seen.contains(&(c.to_string(), NODE.to_owned())))
            })
        },
    )
    .inspect_err(|_| s.say(format!("sidecar series: {:?}", sidecars())))?;
    // The dashboard as Grafana's sidecar finds it (by its label), and its variables' queries
    // against these series: the node variable lists this node by name.
    let cms = s.k(&[
        "-n",
        "ublkd-system",
        "get",
        "cm",
        "-l",
        "grafana_dashboard=1",
        "-o",
        "json",
    ])?;
    let cms: Value = serde_json::from_str(&cms)?;
    let json = cms["items"][0]["data"]["ublkd-dashboard.json"]
        .as_str()
        .context("no ConfigMap labelled grafana_dashboard=1 with ublkd-dashboard.json")?;
    let dash: Value = serde_json::from_str(json)?;
    for v in dash["templating"]["list"].as_array().into_iter().flatten() {
        let Some(query) = v["query"]["query"].as_str() else {
            continue;
        };
        let (sel, label) = (query.strip_prefix("label_values("))
            .and_then(|r| r.strip_suffix(')')?.rsplit_once(", "))
            .with_context(|| format!("variable {}: {query}", v["name"]))?;
        let sel = ["$node", "$instance", "$namespace", "$claim"]
            .iter()
            .fold(sel.to_owned(), |q, var| q.replace(var, ".*"));
        let values: Vec<String> = (q(&sel)?.iter())
            .filter_map(|r| r["metric"][label].as_str().map(str::to_owned))
            .collect();
        s.say(format!("dashboard variable {}: {values:?}", v["name"]));
        if v["name"] == "node" {
            ensure!(
                values.iter().any(|n| n == NODE),
                "the node variable lacks {NODE}"
            );
        }
    }
    let pool = "/var/lib/ublkd/volumes";
    let sel = format!(r#"backend="file",pool="{pool}""#);
    let total = value(&format!("ublkd_capacity_bytes{{{sel}}}"))?;
    let free = || value(&format!("ublkd_capacity_free_bytes{{{sel}}}"));
    let up = q(r#"up{job="ublkd"}"#)?;
    s.say(format!(
        "scraped: {}; file pool {total} bytes, {} free",
        up[0]["metric"],
        free()?
    ));
    let firing = || {
        let alert =
            format!(r#"ALERTS{{alertname="UblkdPoolAlmostFull",alertstate="firing",{sel}}}"#);
        q(&alert).is_ok_and(|r| r.len() == 1)
    };
    ensure!(
        !firing(),
        "UblkdPoolAlmostFull fired before the pool was filled"
    );
    let fill_to = |free: f64| (free - total * 0.05).round();
    ensure!(
        fill_to(free()?) > 0.0,
        "the file pool has under 5 % free before the test fills it"
    );
    // Filled in steps, each to 5 % of what ublkd last reported free, until it reports under 8 %.
    let fillers = || files_named(Path::new(pool), "filler.");
    let result = (|| -> Result<()> {
        for n in 1..=5 {
            let before = free()?;
            let bytes = format!("{}", fill_to(before));
            local("fallocate", &["-l", &bytes, &format!("{pool}/filler.{n}")])?;
            s.say(format!(
                "filler.{n}: {bytes} bytes; df: {}",
                local("df", &["-B1", "--output=avail", pool])?
            ));
            // Until Prometheus has scraped what ublkd saw of it (a fixed 15 s before).
            let seen = || free().is_ok_and(|f| f < before);
            s.wait(
                120,
                &format!("ublkd's report scraped after filler.{n}"),
                seen,
            )?;
            let f = free()?;
            s.say(format!("ublkd reports {f} free of {total}"));
            if f < total * 0.08 {
                s.wait(300, "UblkdPoolAlmostFull fired", firing)?;
                s.say(format!(
                    "firing: {:?}",
                    q(r#"ALERTS{alertname="UblkdPoolAlmostFull"}"#)?
                ));
                // What on-call sees: the node by name, and where the runbook is.
                let all = local("curl", &["-fsS", "http://127.0.0.1:9090/api/v1/alerts"])?;
                let all: Value = serde_json::from_str(&all)?;
                let mut alerts = all["data"]["alerts"].as_array().into_iter().flatten();
                let alert = alerts
                    .find(|a| a["labels"]["alertname"] == "UblkdPoolAlmostFull")
                    .context("UblkdPoolAlmostFull not in /api/v1/alerts")?;
                s.say(format!("the alert: {alert}"));
                ensure!(alert["labels"]["node"] == NODE, "the alert names its node");
                let url = alert["annotations"]["runbook_url"].as_str().unwrap_or("");
                ensure!(
                    url.ends_with("docs/runbooks.md#ublkdpoolalmostfull"),
                    "the alert links its runbook section: {url:?}"
                );
                return Ok(());
            }
        }
        bail!("the pool never reported under 8 % free")
    })();
    for f in fillers() {
        fs::remove_file(&f).with_context(|| format!("removing {}", f.display()))?;
    }
    result?;
    s.wait(
        300,
        "UblkdPoolAlmostFull cleared once the pool was freed",
        || !firing(),
    )?;
    s.say(format!("cleared: free {}", free()?));
    Ok(())
}

/// A VolumeSnapshot of a file-xfs claim, a claim restored from it and a clone of the claim, on
/// the node's reflink XFS: each holds the data of its moment, and deleting them leaves no file.
fn snapshots(s: &Sc) -> Result<()> {
    s.helm_chart(
        "upgrade",
        &["--reuse-values", "--set", "snapshots.enabled=true"],
    )?;
    s.k(&[
        "-n",
        "kube-system",
        "rollout",
        "status",
        "deploy/snapshot-controller",
        "--timeout=600s",
    ])?;
    s.pvc("s-src", "ublkd-file-xfs", "300Mi", Mode::Filesystem)?;
    s.pod("p-src", "s-src", Mode::Filesystem)?;
    s.in_pod("p-src", "echo at-the-snapshot >/data/f && sync")?;
    s.apply(
        "apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap1}
spec:
  volumeSnapshotClassName: ublkd-file
  source: {persistentVolumeClaimName: s-src}
",
    )?;
    let ready = || {
        s.jp(&["volumesnapshot", "snap1"], "{.status.readyToUse}")
            .is_ok_and(|r| r == "true")
    };
    s.wait(420, "snap1 readyToUse", ready).inspect_err(|_| {
        s.tail(20, &["describe", "volumesnapshot", "snap1"]);
        s.tail(30, &["get", "volumesnapshotcontents", "-o", "yaml"]);
        s.tail(
            20,
            &["-n", "kube-system", "logs", "deploy/snapshot-controller"],
        );
        s.tail(
            20,
            &[
                "-n",
                "ublkd-system",
                "logs",
                "ds/ublkd-csi-node",
                "-c",
                "csi-snapshotter",
            ],
        );
    })?;
    let status = "{.status.restoreSize} {.status.boundVolumeSnapshotContentName}";
    s.say(format!(
        "snapshot: {}",
        s.jp(&["volumesnapshot", "snap1"], status)?
    ));
    s.in_pod("p-src", "echo after-the-snapshot >/data/f && sync")?;
    s.pvc_from(
        "s-restore",
        "ublkd-file-xfs",
        "300Mi",
        "VolumeSnapshot",
        "snap1",
    )?;
    s.pod("p-restore", "s-restore", Mode::Filesystem)?;
    let got = s.in_pod("p-restore", "cat /data/f")?;
    ensure!(
        got == "at-the-snapshot",
        "the restore holds the snapshot's data ({got})"
    );
    s.pvc_from(
        "s-clone",
        "ublkd-file-xfs",
        "300Mi",
        "PersistentVolumeClaim",
        "s-src",
    )?;
    s.pod("p-clone", "s-clone", Mode::Filesystem)?;
    let got = s.in_pod("p-clone", "cat /data/f")?;
    ensure!(
        got == "after-the-snapshot",
        "the clone holds its source's data ({got})"
    );
    s.in_pod("p-restore", "echo the-restore-wrote >/data/f && sync")?;
    let got = s.in_pod("p-src", "cat /data/f")?;
    ensure!(
        got == "after-the-snapshot",
        "a write to the restore stays out of its source ({got})"
    );
    let vols = [
        s.volume_of("s-src")?,
        s.volume_of("s-restore")?,
        s.volume_of("s-clone")?,
    ];
    s.say(format!("volumes: {vols:?}"));
    s.delete(&["pod", "p-src", "p-restore", "p-clone"])?;
    s.delete(&["volumesnapshot", "snap1"])?;
    s.delete(&["pvc", "s-src", "s-restore", "s-clone"])?;
    let gone = || {
        s.q(&["get", "volumesnapshotcontents", "--no-headers"])
            .is_ok_and(|c| c.trim().is_empty())
            && s.ublkctl(&["list-volumes"])
                .is_ok_and(|l| vols.iter().all(|v| !l.contains(v.as_str())))
            && files_named(Path::new("/var/lib/ublkd/volumes"), ".img").is_empty()
    };
    s.wait(
        420,
        "every snapshot, volume and file went with its object",
        gone,
    )
    .inspect_err(|_| {
        s.show(&["get", "volumesnapshotcontents"]);
        s.say(format!(
            "{:?}",
            files_named(Path::new("/var/lib/ublkd/volumes"), "")
        ));
    })
}

/// VolumeAttributesClasses on the install as it is, without remote access: no host port,
/// no client certificate. A claim's class changed three times: each becomes the claim's
/// current class once the node's ublkd holds its limits, and a 4 MiB/s write limit holds a
/// writer in the pod within 10 % of it (and lifted, the writer runs faster).
fn modify(s: &Sc) -> Result<()> {
    let ports = s.jp(&["-n", "ublkd-system", "ds", "ublkd"], "{..hostPort}")?;
    ensure!(
        ports.trim().is_empty(),
        "ublkd's pod has host ports: {ports}"
    );
    let logs = s.k(&[
        "-n",
        "ublkd-system",
        "logs",
        "deploy/ublkd-csi-resizer",
        "-c",
        "ublkd-csi",
    ])?;
    ensure!(
        logs.contains("recorded on the PersistentVolume"),
        "the resizer's driver does not record limits on PersistentVolumes: {logs}"
    );
    s.apply(
        "apiVersion: storage.k8s.io/v1
kind: VolumeAttributesClass
metadata: {name: m-capped}
driverName: ublkd.io
parameters: {writeBandwidth: 4Mi, qosBurst: 100ms}
",
    )?;
    s.pvc("m-data", "ublkd-file", "128Mi", Mode::Filesystem)?;
    s.pod("p-m", "m-data", Mode::Filesystem)?;
    let vol = s.volume_of("m-data")?;
    let qos = || -> Result<String> {
        Ok(field(&s.ublkctl(&["get-volume", &vol])?, "qos")
            .unwrap_or_default()
            .to_owned())
    };
    s.say(format!("volume {vol}, qos: {}", qos()?));
    let applied = |class: &str| {
        let patch = json!({"spec": {"volumeAttributesClassName": class}}).to_string();
        s.k(&["patch", "pvc", "m-data", "-p", &patch])?;
        let now = || {
            s.jp(
                &["pvc", "m-data"],
                "{.status.currentVolumeAttributesClassName}",
            )
            .is_ok_and(|c| c == class)
        };
        s.wait(180, &format!("the claim's class became {class}"), now)
            .inspect_err(|_| {
                s.tail(15, &["describe", "pvc", "m-data"]);
                s.tail(20, &CSI_NODE_LOGS);
                for c in ["csi-resizer", "ublkd-csi"] {
                    s.tail(
                        20,
                        &[
                            "-n",
                            "ublkd-system",
                            "logs",
                            "deploy/ublkd-csi-resizer",
                            "-c",
                            c,
                        ],
                    );
                }
            })?;
        let q = qos()?;
        s.say(format!("{class} applied, qos: {q}"));
        Ok::<_, anyhow::Error>(q)
    };
    // 32 MiB written and synced in the pod: bytes per second, timed by the guest's clock
    // (/proc/uptime, 10 ms; the pod's busybox dd prints no rate). Direct writes, so each MiB
    // meets the limit as it is written: buffered, the time also held dd's filling of the page
    // cache, unthrottled and as slow as a busy guest's CPU (10.08 s for 8 s of writes).
    let write_rate = || -> Result<f64> {
        let out = s.in_pod(
            "p-m",
            "rm -f /data/f; a=$(cut -d' ' -f1 /proc/uptime); \
             dd if=/dev/zero of=/data/f bs=1M count=32 oflag=direct conv=fsync 2>/dev/null && \
             echo \"$a $(cut -d' ' -f1 /proc/uptime)\"",
        )?;
        let t: Vec<f64> = (out.split_whitespace())
            .filter_map(|w| w.parse().ok())
            .collect();
        let [t0, t1] = t[..] else {
            bail!("no start and end time from the pod: {out:?}");
        };
        s.say(format!("32 MiB written and synced in {:.2} s", t1 - t0));
        Ok(32.0 * 1048576.0 / (t1 - t0))
    };
    let q = applied("ublkd-limited")?;
    let (r, w) = (q.find("read 5000 IOPS"), q.find("write 2000 IOPS"));
    ensure!(
        matches!((r, w), (Some(r), Some(w)) if r < w),
        "ublkd's limits are not ublkd-limited's ({q})"
    );
    applied("m-capped")?;
    let cap = 4.0 * 1024.0 * 1024.0;
    let capped = write_rate()?;
    s.say(format!(
        "capped at 4 MiB/s: {:.3} MiB/s",
        capped / 1048576.0
    ));
    ensure!(
        (capped / cap - 1.0).abs() <= 0.10,
        "the writer ran at {:.3} MiB/s under a 4 MiB/s limit (over 10 % off)",
        capped / 1048576.0
    );
    let q = applied("ublkd-unlimited")?;
    ensure!(q == "unlimited", "ublkd's limits were not lifted ({q})");
    let free = write_rate()?;
    s.say(format!("unlimited: {:.3} MiB/s", free / 1048576.0));
    ensure!(
        free > cap * 1.5,
        "lifted, the writer still ran at {:.3} MiB/s: the cap was not the limit",
        free / 1048576.0
    );
    s.delete(&["pod", "p-m"])?;
    s.delete(&["pvc", "m-data"])?;
    s.delete(&["volumeattributesclass", "m-capped"])
}

/// Two pods write with fsync (each write a new block, each checked), one of them through
/// dm-crypt (`encryption: luks2`), while ublkd is killed with SIGKILL and then upgraded to a new image the way docs/kubernetes.md ("Upgrading") says (helm
/// upgrade, then the node's pod deleted: OnDelete). The devices wait for the next ublkd; the
/// writers end with no I/O error.
fn ublkd_restart(s: &Sc) -> Result<()> {
    // Two writers: one on a plain file volume, one through dm-crypt on an encrypted one.
    luks_classes(s, "right-key-51c7")?;
    let writers = [
        ("p-writer", "w-data", "ublkd-file"),
        ("p-e-writer", "we-data", "ublkd-file-luks"),
    ];
    for (pod, claim, class) in writers {
        s.pvc(claim, class, "64Mi", Mode::Filesystem)?;
        s.apply(&fill(
            r#"apiVersion: v1
kind: Pod
metadata: {name: @POD@}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: ublkd.test/busybox:test
      command:
        - /bin/sh
        - -c
        - |
          i=0
          while [ ! -e /data/stop ]; do
            echo "block $i" | dd of=/data/log bs=4096 seek=$((i % 8192)) conv=fsync,notrunc 2>/tmp/err ||
              { echo "write $i failed: $(cat /tmp/err)"; exit 1; }
            i=$((i + 1))
          done
          echo "wrote $i blocks with fsync, none failed"
      volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: @CLAIM@}}]
"#,
            &[("POD", pod), ("CLAIM", claim)],
        ))?;
    }
    for (pod, _, _) in writers {
        let pod = format!("pod/{pod}");
        s.k(&["wait", "--for=condition=Ready", &pod, "--timeout=600s"])?;
    }
    std::thread::sleep(Duration::from_secs(5));
    let before = s.ublkd_restarts()?;
    let pids = local("pidof", &["ublkd"]).context("no ublkd process on the node")?;
    let pid = pids
        .split_whitespace()
        .next()
        .context("no ublkd process on the node")?;
    local("kill", &["-9", pid])?;
    s.say(format!(
        "SIGKILL to ublkd (pid {pid}); restarts were {before}"
    ));
    let restarted = || s.ublkd_restarts().is_ok_and(|n| n > before) && s.ublkd_ready();
    s.wait(600, "ublkd back after SIGKILL", restarted)
        .inspect_err(|_| {
            let pod = s.ublkd_pod().unwrap_or_default();
            s.tail(20, &["-n", "ublkd-system", "describe", "pod", &pod]);
        })?;
    for (pod, _, _) in writers {
        s.say(format!(
            "{pod}: {}",
            s.jp(&["pod", pod], "{.status.phase}")?
        ));
    }
    // The roll, as docs/kubernetes.md ("Upgrading") says: helm upgrade to a new image tag (the
    // same build pushed to the node's registry as :roll), then the node's pod deleted.
    let old = s.ublkd_pod()?;
    let ns = ["--namespace", "ublkd-system"];
    // The packaged chart pins its image by digest: the roll names a tag instead.
    let roll = [
        "--reuse-values",
        "--set",
        "image.tag=roll",
        "--set",
        "image.digest=",
    ];
    s.helm_chart("upgrade", &roll)?;
    s.say(s.helm(&[&["history", "ublkd"][..], &ns].concat())?);
    let on_node = format!("spec.nodeName={NODE}");
    s.delete(&[&UBLKD_PODS[..], &["--field-selector", &on_node]].concat())?;
    let image = r#"{.spec.containers[?(@.name=="ublkd")].image}"#;
    let rolled = || {
        s.ublkd_pod().is_ok_and(|p| {
            p != old
                && s.jp(&["-n", "ublkd-system", "pod", &p], image)
                    .is_ok_and(|i| i.ends_with(":roll"))
        }) && s.ublkd_ready()
    };
    s.wait(600, "the rolled ublkd pod Ready", rolled)
        .inspect_err(|_| s.show(&["-n", "ublkd-system", "get", "pods", "-o", "wide"]))?;
    std::thread::sleep(Duration::from_secs(5));
    for (pod, claim, _) in writers {
        // The writer may see the file and end, and its PID namespace take the exec's shell
        // with it (SIGKILL, 137), before the exec returns: stop 48's CI failed that way.
        // Whether the writer ended cleanly is what is judged.
        if let Err(e) = s.in_pod(pod, "touch /data/stop") {
            s.say(format!("(the exec that stops {pod}: {e:#})"));
        }
        let done = || {
            s.jp(&["pod", pod], "{.status.phase}")
                .is_ok_and(|p| p == "Succeeded")
        };
        s.wait(300, &format!("{pod} finished cleanly"), done)
            .inspect_err(|_| {
                s.tail(5, &["logs", pod]);
                s.tail(20, &["describe", "pod", pod]);
                if let Ok(k) = local("dmesg", &[]) {
                    let k: Vec<_> = k.lines().rev().take(40).collect();
                    s.say(format!("dmesg, newest first:\n{}", k.join("\n")));
                }
            })?;
        s.show(&["logs", pod]);
        s.delete(&["pod", pod])?;
        s.delete(&["pvc", claim])?;
    }
    luks_classes_gone(s)
}

/// `kubectl ublkd` (the plugin, found on kubectl's PATH like any plugin) run by on-call staff
/// who hold only the chart's read-only `ublkd-viewer` ClusterRole (a service account's token,
/// in a kubeconfig of its own, picked by `--kubeconfig` and `--context`): they cannot exec into
/// ublkd's pods, and need not. `pvc` shows a running pod's claim with its node, volume, state,
/// device and writes; `nodes` the node's report; `orphans -o json` lists a volume made outside
/// Kubernetes until it is deleted; `check` passes; `dump` writes the bundle; and the report is
/// `kubectl get ublkdnodes` for anyone with the role.
fn plugin(s: &Sc) -> Result<()> {
    s.pvc("x-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-x", "x-data", Mode::Filesystem)?;
    s.in_pod(
        "p-x",
        "dd if=/dev/zero of=/data/f bs=4096 count=256 conv=fsync",
    )?;
    let vol = s.volume_of("x-data")?;
    // on-call: a service account bound to ublkd-viewer and nothing else
    s.k(&["create", "serviceaccount", "oncall", "-n", "default"])?;
    s.k(&[
        "create",
        "clusterrolebinding",
        "oncall-ublkd",
        "--clusterrole=ublkd-viewer",
        "--serviceaccount=default:oncall",
    ])?;
    let token = s.q(&["create", "token", "oncall", "-n", "default"])?;
    let admin: Value = serde_json::from_str(&s.q(&[
        "config",
        "view",
        "--raw",
        "--minify",
        "--flatten",
        "-o",
        "json",
    ])?)?;
    let cluster = &admin["clusters"][0]["cluster"];
    let conf = "--kubeconfig=oncall.kubeconfig";
    let server = format!(
        "--server={}",
        cluster["server"].as_str().unwrap_or_default()
    );
    s.k(&["config", conf, "set-cluster", "tier", &server])?;
    let ca = cluster["certificate-authority-data"]
        .as_str()
        .unwrap_or_default();
    s.q(&[
        "config",
        conf,
        "set",
        "clusters.tier.certificate-authority-data",
        ca,
    ])?;
    s.q(&[
        "config",
        conf,
        "set-credentials",
        "oncall",
        &format!("--token={token}"),
    ])?;
    s.k(&[
        "config",
        conf,
        "set-context",
        "oncall",
        "--cluster=tier",
        "--user=oncall",
    ])?;
    let can = |verb: &str, what: &str| -> Result<String> {
        let a = s.node.host.call(
            "kubectl",
            &[
                conf,
                "--context=oncall",
                "auth",
                "can-i",
                verb,
                what,
                "-n",
                "ublkd-system",
            ],
            None,
        )?;
        Ok(a.out.trim().to_owned())
    };
    ensure!(
        can("create", "pods/exec")? == "no",
        "the viewer may exec into ublkd's pods"
    );
    ensure!(
        can("list", "ublkdnodes.ublkd.io")? == "yes",
        "the viewer may not list UblkdNodes"
    );
    let oncall = |args: &[&str]| -> Result<String> {
        let mut all = vec!["ublkd", conf, "--context=oncall"];
        all.extend_from_slice(args);
        s.k(&all)
    };
    // the node plugin's report after the writes (written every csiNode.reportStatusEvery)
    let mut out = String::new();
    let shown = s.wait(60, "kubectl ublkd pvc shows the writes", || {
        out = oncall(&["pvc", "x-data"]).unwrap_or_else(|e| format!("{e:#}"));
        // the write line: requests, then bytes (the file's 1 MiB, merged into few requests)
        let written = out.lines().find_map(|l| {
            let w: Vec<&str> = l.split_whitespace().collect();
            (w.first() == Some(&"write")).then(|| w.get(2)?.parse::<u64>().ok())?
        });
        written.unwrap_or(0) >= 1 << 20
    });
    if let Err(e) = shown {
        s.say(&out);
        s.show(&["get", "ublkdnodes", "-o", "yaml"]);
        s.show(&CSI_NODE_LOGS);
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
    let out = oncall(&["nodes"])?;
    s.say(&out);
    let line = out
        .lines()
        .find(|l| l.split_whitespace().next() == Some(NODE))
        .unwrap_or_default();
    let cells: Vec<&str> = line.split_whitespace().collect();
    ensure!(
        cells
            .get(3)
            .and_then(|n| n.parse::<u64>().ok())
            .unwrap_or(0)
            >= 1,
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
    let out = oncall(&["check"])?;
    s.say(&out);
    let report: Value = serde_json::from_str(&s.q(&["get", "ublkdnode", NODE, "-o", "json"])?)?;
    let vols = report["status"]["volumes"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        vols.iter()
            .any(|v| v["id"] == vol.as_str() && v["claim"] == "default/x-data"),
        "the report does not name {vol}'s claim: {vols:?}"
    );
    let pools = report["status"]["pools"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    ensure!(
        pools
            .iter()
            .any(|p| p["storageClass"] == "ublkd-file" && p["reflink"] == true),
        "the report's ublkd-file pool is not reflink: {pools:?}"
    );
    s.ublkctl(&[
        "create-volume",
        "stray-1",
        "--size",
        "16MiB",
        "--backend",
        "ram",
    ])?;
    // in the node's report first (written every csiNode.reportStatusEvery)
    s.wait(60, "the node's report lists stray-1", || {
        let report = s.q(&[
            "get",
            "ublkdnode",
            NODE,
            "-o",
            "jsonpath={.status.volumes[*].id}",
        ]);
        report.is_ok_and(|ids| ids.split_whitespace().any(|id| id == "stray-1"))
    })?;
    let listed =
        |out: &str, name: &str| -> Result<bool> {
            let v: Value = serde_json::from_str(out)?;
            Ok(v["orphans"].as_array().into_iter().flatten().any(|o| {
                o["node"] == NODE && o["kind"] == "volume-without-pv" && o["name"] == name
            }))
        };
    let out = oncall(&["orphans", "-o", "json"])?;
    s.say(&out);
    ensure!(
        listed(&out, "stray-1")?,
        "kubectl ublkd orphans does not list stray-1"
    );
    ensure!(
        !listed(&out, &vol)?,
        "kubectl ublkd orphans lists {vol}, whose PV exists"
    );
    let out = oncall(&["orphans", "-o", "yaml"])?;
    ensure!(
        has_line(&out, "name: \"stray-1\""),
        "kubectl ublkd orphans -o yaml does not list stray-1: {out}"
    );
    s.ublkctl(&["delete-volume", "stray-1"])?;
    let out = oncall(&["orphans", "-o", "json"])?;
    ensure!(
        !listed(&out, "stray-1")?,
        "stray-1 is still listed after it was deleted"
    );
    let out = oncall(&["dump", "oncall-dump"])?;
    s.say(&out);
    for file in [
        "nodes/ublkd-vm.json",
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
    s.delete(&["clusterrolebinding", "oncall-ublkd"])?;
    s.delete(&["serviceaccount", "oncall", "-n", "default"])?;
    s.delete(&["pod", "p-x"])?;
    s.delete(&["pvc", "x-data"])
}

/// The running kubelet's pid (the node's kubelet service writes it).
fn kubelet_pid() -> Option<u32> {
    fs::read_to_string("/run/kubelet.pid")
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// The kubelet stopped with SIGTERM; the node's kubelet service starts it again, as systemd would.
fn restart_kubelet(s: &Sc) -> Result<()> {
    let old = kubelet_pid().context("no kubelet pid")?;
    local("kill", &[&old.to_string()])?;
    let alive = |pid: u32| Path::new(&format!("/proc/{pid}")).exists();
    s.wait(30, "the kubelet stopped", || !alive(old))?;
    s.wait(60, "the kubelet started again", || {
        kubelet_pid().is_some_and(|p| p != old && alive(p))
    })
}

/// The kubelet restarted: the mounted volume stays mounted and keeps its data, the registrar
/// registers the driver again, and a new pod still gets a new volume.
fn kubelet_restart(s: &Sc) -> Result<()> {
    s.pvc("k-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-keep", "k-data", Mode::Filesystem)?;
    s.in_pod("p-keep", "echo kept >/data/f && sync")?;
    restart_kubelet(s)?;
    s.wait(600, "the node Ready again", || s.node_ready())?;
    // The new kubelet takes the running pods back before it answers for them.
    s.wait(300, "the kubelet took p-keep back", || {
        s.q(&["exec", "p-keep", "--", "/bin/sh", "-c", "true"])
            .is_ok()
    })?;
    s.wait(300, "the driver registered after the restart", || {
        s.registered()
    })?;
    let got = s.in_pod("p-keep", "cat /data/f")?;
    ensure!(got == "kept", "the mounted volume kept its data ({got})");
    s.pvc("k-new", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-new", "k-new", Mode::Filesystem)?;
    s.in_pod("p-new", "echo new >/data/f && sync")?;
    s.say("a new pod got a volume after the restart");
    s.delete(&["pod", "p-keep", "p-new"])?;
    s.delete(&["pvc", "k-data", "k-new"])
}

/// No warning events from the driver's objects: anything in ublkd-system, on a storage object,
/// or about a volume on a pod (mount, map, resize, provisioning, snapshot). Run after the
/// scenarios that use the driver and before those that restart ublkd on purpose: while ublkd
/// is down, the kubelet reports its readiness probe failing, as it should. The pending
/// scenario's FailedScheduling is the scheduler saying what it must.
fn warnings(s: &Sc) -> Result<()> {
    let cols = "custom-columns=NS:.metadata.namespace,KIND:.involvedObject.kind,\
                NAME:.involvedObject.name,REASON:.reason,FROM:.source.component,MESSAGE:.message";
    let all = s.k(&[
        "get",
        "events",
        "-A",
        "--field-selector",
        "type=Warning",
        "--no-headers",
        "-o",
        cols,
    ])?;
    let lines: Vec<&str> = all.lines().filter(|l| !l.trim().is_empty()).collect();
    s.say(format!("warning events: {}", lines.len()));
    for l in &lines {
        s.say(l.chars().take(220).collect::<String>());
    }
    const KINDS: &[&str] = &[
        "PersistentVolumeClaim",
        "PersistentVolume",
        "VolumeSnapshot",
        "VolumeSnapshotContent",
        "CSINode",
        "CSIStorageCapacity",
        "StorageClass",
    ];
    let bad: Vec<&&str> = lines
        .iter()
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let reason = f.get(3).copied().unwrap_or_default();
            f.first() == Some(&"ublkd-system")
                || f.get(1).is_some_and(|k| KINDS.contains(k))
                || ["Mount", "Volume", "Provision", "Resiz", "Snapshot"]
                    .iter()
                    .any(|r| reason.contains(r))
        })
        .collect();
    ensure!(
        bad.is_empty(),
        "warning events from the driver's objects:\n{bad:#?}"
    );
    Ok(())
}

/// Node maintenance as docs/kubernetes.md ("Drain a node for maintenance") says: cordon and
/// drain the node (ublkd's DaemonSet pods stay, the claim's pod goes), its volume stays with
/// its data, uncordon, and a new pod on the claim reads what the old one wrote.
fn drain(s: &Sc) -> Result<()> {
    s.pvc("r-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
    s.pod("p-r", "r-data", Mode::Filesystem)?;
    s.in_pod("p-r", "echo before-the-drain >/data/f && sync")?;
    let vol = s.volume_of("r-data")?;
    s.k(&["cordon", NODE])?;
    s.k(&[
        "drain",
        NODE,
        "--ignore-daemonsets",
        "--delete-emptydir-data",
        "--force",
        "--timeout=300s",
    ])?;
    s.wait(300, "the drain took p-r", || !s.exists(&["pod", "p-r"]))?;
    let info = s.ublkctl(&["get-volume", &vol])?;
    ensure!(
        field(&info, "state") == Some("ready"),
        "the volume {vol} is not ready after the drain"
    );
    let ublkd = s.k(&[
        "-n",
        "ublkd-system",
        "get",
        "pods",
        "-l",
        "app.kubernetes.io/name=ublkd",
        "--no-headers",
    ])?;
    ensure!(ublkd.lines().count() == 1, "the drain took ublkd's pod");
    s.k(&["uncordon", NODE])?;
    s.pod("p-r2", "r-data", Mode::Filesystem)?;
    let got = s.in_pod("p-r2", "cat /data/f")?;
    ensure!(
        got == "before-the-drain",
        "the claim's data after the drain is '{got}'"
    );
    s.delete(&["pod", "p-r2"])?;
    s.delete(&["pvc", "r-data"])
}

/// Events of `reason` about the claim `name` (in default), their messages.
fn claim_events(s: &Sc, name: &str, reason: &str) -> String {
    let sel = format!(
        "involvedObject.kind=PersistentVolumeClaim,involvedObject.name={name},reason={reason}"
    );
    s.jp(&["events", "--field-selector", &sel], "{.items[*].message}")
        .unwrap_or_default()
}

/// A volume that cannot come back reaches the people using it: the backing file of a claim in
/// use is moved away and ublkd killed, so its takeover fails and the volume is FAILED.
/// `kubectl describe pvc` shows a VolumeFailed Warning within 60 s, and the pod has one too.
/// With the file back, ublkd's own retry brings the volume back, a VolumeRecovered Event
/// follows, and the pod reads its device again.
fn volume_fault(s: &Sc) -> Result<()> {
    s.pvc("f-data", "ublkd-file", "64Mi", Mode::Block)?;
    s.pod("p-fault", "f-data", Mode::Block)?;
    let read = "dd if=/dev/xvda of=/dev/null bs=4096 count=16 iflag=direct 2>&1";
    s.say(s.in_pod("p-fault", read)?);
    let vol = s.volume_of("f-data")?;
    let files = files_named(Path::new("/var/lib/ublkd/volumes"), &vol);
    let [file] = files.as_slice() else {
        bail!("not one backing file of {vol}: {files:?}");
    };
    let away = file.with_extension("away");
    fs::rename(file, &away)?;
    s.say(format!("moved {} away", file.display()));
    let pids = local("pidof", &["ublkd"]).context("no ublkd process on the node")?;
    let pid = pids.split_whitespace().next().context("no ublkd pid")?;
    local("kill", &["-9", pid])?;
    s.say(format!("SIGKILL to ublkd (pid {pid})"));
    let state = |want: &str| {
        s.ublkctl(&["get-volume", &vol])
            .is_ok_and(|i| field(&i, "state") == Some(want))
    };
    let described = || {
        s.q(&["describe", "pvc", "f-data"])
            .is_ok_and(|d| d.contains("VolumeFailed"))
    };
    // From the moment ublkd reports the volume FAILED, the claim has 60 s to show it.
    let shown = s
        .wait(300, "ublkd back, the volume FAILED", || state("failed"))
        .and_then(|()| s.wait(60, "kubectl describe pvc shows VolumeFailed", described));
    // The file goes back whatever happened, so that the claim can be deleted.
    fs::rename(&away, file)?;
    shown.inspect_err(|_| {
        s.tail(15, &["describe", "pvc", "f-data"]);
        s.tail(30, &CSI_NODE_LOGS);
    })?;
    let failed = claim_events(s, "f-data", "VolumeFailed");
    s.say(format!("VolumeFailed: {failed}"));
    ensure!(
        failed.contains(&vol) || failed.to_lowercase().contains("fail"),
        "the Event says nothing of the failure: {failed:?}"
    );
    let on_pod = || {
        s.q(&["describe", "pod", "p-fault"])
            .is_ok_and(|d| d.contains("VolumeFailed"))
    };
    s.wait(60, "the pod's Events show VolumeFailed too", on_pod)?;
    let recovered = || !claim_events(s, "f-data", "VolumeRecovered").is_empty();
    s.wait(180, "a VolumeRecovered Event on the claim", recovered)
        .inspect_err(|_| {
            s.tail(
                20,
                &["-n", "ublkd-system", "logs", "ds/ublkd", "-c", "ublkd"],
            )
        })?;
    s.wait(60, "the volume READY again", || state("ready"))?;
    s.say(s.in_pod("p-fault", read)?);
    let kinds = s.q(&[
        "get",
        "events",
        "--field-selector",
        "involvedObject.name=f-data",
        "-o",
        "custom-columns=TYPE:.type,REASON:.reason",
        "--no-headers",
    ])?;
    s.say(&kinds);
    ensure!(
        has_line(&kinds, "Normal VolumeRecovered"),
        "VolumeRecovered is not a Normal Event"
    );
    s.delete(&["pod", "p-fault"])?;
    s.delete(&["pvc", "f-data"])
}

/// Capacity where ublk cannot serve: /dev/ublk-control hidden on the node and ublkd's pod
/// restarted, as on a node whose kernel has no ublk_drv. ublkd stays up saying why, its pod
/// is not Ready, the Node has a UblkUnavailable Event, every CSIStorageCapacity of the node
/// reads 0, and a claim waiting for a pod stays Pending with the scheduler's reason. With the
/// device back and the pod restarted: Ready, capacity, the claim bound, UblkAvailable.
fn ublk_missing(s: &Sc) -> Result<()> {
    let ctl = Path::new("/dev/ublk-control");
    let hidden = Path::new("/dev/ublk-control.hidden");
    let restart = || -> Result<()> {
        let old = s.ublkd_pod()?;
        s.delete(&["-n", "ublkd-system", "pod", &old])?;
        let new = || s.ublkd_pod().is_ok_and(|p| p != old);
        s.wait(120, "a new ublkd pod", new)
    };
    let capacities = || {
        s.jp(&["csistoragecapacities", "-A"], "{.items[*].capacity}")
            .unwrap_or_default()
    };
    s.say(format!("capacities before: {}", capacities()));
    fs::rename(ctl, hidden)?;
    s.say("/dev/ublk-control hidden");
    let hidden_run = (|| -> Result<()> {
        restart()?;
        let logs = ["-n", "ublkd-system", "logs", "ds/ublkd", "-c", "ublkd"];
        let says = || s.q(&logs).is_ok_and(|l| l.contains("no ublk dataplane"));
        s.wait(120, "ublkd's log says it has no ublk dataplane", says)?;
        // Not Ready because its readiness probe fails, saying why (not merely not yet probed).
        let pod = s.ublkd_pod()?;
        let sel = format!("involvedObject.name={pod},reason=Unhealthy");
        let probe = || {
            s.jp(
                &["-n", "ublkd-system", "events", "--field-selector", &sel],
                "{.items[*].message}",
            )
            .is_ok_and(|m| m.contains("serves no volume"))
        };
        s.wait(
            120,
            "the readiness probe fails: ublkd serves no volume",
            probe,
        )?;
        ensure!(!s.ublkd_ready(), "ublkd's pod is Ready without ublk");
        let event = || s.node_event(NODE, "UblkUnavailable");
        s.wait(120, "a UblkUnavailable Event on the Node", event)?;
        s.node_events(NODE);
        let zero = || {
            let c = capacities();
            !c.is_empty() && c.split_whitespace().all(|q| q == "0")
        };
        s.wait(240, "every CSIStorageCapacity reads 0", zero)?;
        s.pvc("u-data", "ublkd-ram", "64Mi", Mode::Filesystem)?;
        s.start_pod("p-u", "u-data", Mode::Filesystem)?;
        let sel = "involvedObject.name=p-u,reason=FailedScheduling";
        let why = || {
            s.jp(&["events", "--field-selector", sel], "{.items[*].message}")
                .is_ok_and(|m| m.to_lowercase().contains("storage"))
        };
        s.wait(300, "a FailedScheduling event naming storage", why)?;
        ensure!(
            s.jp(&["pvc", "u-data"], "{.status.phase}")? == "Pending",
            "u-data left Pending"
        );
        Ok(())
    })();
    fs::rename(hidden, ctl)?;
    s.say("/dev/ublk-control back");
    restart()?;
    s.wait(300, "ublkd Ready again", || s.ublkd_ready())?;
    hidden_run?;
    s.k(&["wait", "--for=condition=Ready", "pod/p-u", "--timeout=600s"])
        .inspect_err(|_| s.tail(15, &["describe", "pod", "p-u"]))?;
    s.wait(120, "a UblkAvailable Event on the Node", || {
        s.node_event(NODE, "UblkAvailable")
    })?;
    s.say(format!("capacities after: {}", capacities()));
    s.delete(&["pod", "p-u"])?;
    s.delete(&["pvc", "u-data"])
}

/// The Secret and the two encrypted classes (a file and an NVMe one) of `encrypted` and
/// `ublkd-restart`; `key` is the Secret's key (applied again: the same, or another).
fn luks_classes(s: &Sc, key: &str) -> Result<()> {
    let class = |name: &str, backend: &str| {
        fill(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: @NAME@}
provisioner: ublkd.io
volumeBindingMode: WaitForFirstConsumer
allowVolumeExpansion: true
parameters:
  @BACKEND@
  encryption: luks2
  csi.storage.k8s.io/node-stage-secret-name: e-key
  csi.storage.k8s.io/node-stage-secret-namespace: default
  csi.storage.k8s.io/node-expand-secret-name: e-key
  csi.storage.k8s.io/node-expand-secret-namespace: default
"#,
            &[("NAME", name), ("BACKEND", backend)],
        )
    };
    s.apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: e-key}}\nstringData: {{key: {key}}}\n"
    ))?;
    s.apply(&class(
        "ublkd-file-luks",
        "backend: file\n  root: /var/lib/ublkd/volumes",
    ))?;
    s.apply(&class(
        "ublkd-nvme-luks",
        "backend: nvme\n  namespace: /dev/ng0n1",
    ))
}

/// Takes away what `luks_classes` made: the chart's uninstall must leave no StorageClass.
fn luks_classes_gone(s: &Sc) -> Result<()> {
    s.delete(&["storageclass", "ublkd-file-luks", "ublkd-nvme-luks"])?;
    s.delete(&["secret", "e-key"])
}

/// Whether ASCII `marker` occurs in the `len` bytes of `path` from `offset`, read 4 MiB at a
/// time. Searched as text (std's searcher, fast in a debug build too): a lossy conversion
/// replaces only bytes that are not ASCII, so an ASCII marker is found wherever it is.
fn holds(path: &Path, offset: u64, len: u64, marker: &str) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.seek(SeekFrom::Start(offset))?;
    let mut f = f.take(len);
    let mut buf = vec![0u8; 4 << 20];
    // Each chunk keeps the end of the last, so that a match across two reads is found.
    let mut carry: Vec<u8> = Vec::new();
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            return Ok(false);
        }
        carry.extend_from_slice(&buf[..n]);
        if String::from_utf8_lossy(&carry).contains(marker) {
            return Ok(true);
        }
        let keep = carry.len().saturating_sub(marker.len());
        carry.drain(..keep);
    }
}

/// Whether a LUKS header starts at `offset` of `path` (its magic, `LUKS\xba\xbe`).
fn luks_at(path: &Path, offset: u64) -> Result<bool> {
    use std::io::{Read, Seek, SeekFrom};
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.seek(SeekFrom::Start(offset))?;
    let mut magic = [0u8; 6];
    f.read_exact(&mut magic)?;
    Ok(&magic == b"LUKS\xba\xbe")
}

/// Encrypted volumes (`encryption: luks2`, the key in a Secret): a marker written in the pod
/// is nowhere in the file volume's backing file nor in the NVMe volume's window, which start
/// with a LUKS2 header; the file system grows online through the mapping; a wrong key fails
/// the pod's mount with an event that says so and changes nothing, and the right one opens the
/// same data again. (A SIGKILL of ublkd under an fsync writer through dm-crypt is
/// `ublkd-restart`'s.)
fn encrypted(s: &Sc) -> Result<()> {
    luks_classes(s, "right-key-51c7")?;
    let marker = format!("ublkd-secret-marker-{}", std::process::id());
    s.pvc("e-file", "ublkd-file-luks", "64Mi", Mode::Filesystem)?;
    s.pvc("e-nvme", "ublkd-nvme-luks", "64Mi", Mode::Block)?;
    s.start_pod("p-e-file", "e-file", Mode::Filesystem)?;
    s.pod("p-e-nvme", "e-nvme", Mode::Block)?;
    let file_pod_ready = || {
        let ready = [
            "wait",
            "--for=condition=Ready",
            "pod/p-e-file",
            "--timeout=600s",
        ];
        s.k(&ready)
            .inspect_err(|_| s.tail(30, &CSI_NODE_LOGS))
            .map(drop)
    };
    file_pod_ready()?;
    // The marker many times over, pushed to the device.
    s.in_pod(
        "p-e-file",
        &format!("for i in $(seq 256); do echo {marker}; done >/data/m && sync"),
    )?;
    s.in_pod(
        "p-e-nvme",
        &format!(
            "for i in $(seq 256); do echo {marker}; done >/tmp/m && \
             dd if=/tmp/m of=/dev/xvda bs=4096 seek=100 oflag=direct conv=fsync 2>&1"
        ),
    )?;
    let back = s.in_pod(
        "p-e-nvme",
        "dd if=/dev/xvda bs=4096 skip=100 count=1 2>/dev/null | head -1",
    )?;
    ensure!(back == marker, "the block device reads back {back:?}");
    // The file volume's backing file.
    let vol = s.volume_of("e-file")?;
    let files = files_named(Path::new("/var/lib/ublkd/volumes"), &vol);
    let [file] = files.as_slice() else {
        bail!("not one backing file of {vol}: {files:?}");
    };
    let len = fs::metadata(file)?.len();
    ensure!(
        luks_at(file, 0)?,
        "{} starts with no LUKS header",
        file.display()
    );
    ensure!(
        !holds(file, 0, len, &marker)?,
        "the marker is in the clear in {}",
        file.display()
    );
    s.say(format!(
        "{}: LUKS header, no marker in its {len} bytes",
        file.display()
    ));
    // The NVMe volume's window of the namespace.
    let nvol = s.volume_of("e-nvme")?;
    let info: Value = serde_json::from_str(&s.ublkctl(&["-o", "json", "get-volume", &nvol])?)?;
    let window = &info["spec"]["nvme"];
    let (offset, length) = (
        window["offset_bytes"]
            .as_u64()
            .context("no window offset")?,
        window["length_bytes"]
            .as_u64()
            .context("no window length")?,
    );
    let ns = Path::new("/dev/nvme0n1");
    ensure!(
        luks_at(ns, offset)?,
        "the window at {offset} has no LUKS header"
    );
    ensure!(
        !holds(ns, offset, length, &marker)?,
        "the marker is in the clear in the window at {offset}"
    );
    s.say(format!(
        "nvme window {offset}+{length}: LUKS header, no marker"
    ));
    s.delete(&["pod", "p-e-nvme"])?;
    s.delete(&["pvc", "e-nvme"])?;
    // Online growth: the ublk device, then the mapping (with the node-expand Secret's key),
    // then ext4.
    let df = || df_kib(s, "p-e-file");
    let before = df()?;
    s.k(&[
        "patch",
        "pvc",
        "e-file",
        "-p",
        r#"{"spec":{"resources":{"requests":{"storage":"128Mi"}}}}"#,
    ])?;
    let pv = s.jp(&["pvc", "e-file"], "{.spec.volumeName}")?;
    let pv_grown = || {
        s.jp(&["pv", &pv], "{.spec.capacity.storage}")
            .is_ok_and(|c| mib(&c).is_ok_and(|m| m >= 128))
    };
    s.wait(300, "the PV grew", pv_grown)?;
    // An update to the pod makes the kubelet sync it (and expand) at once (`filesystem`).
    let resync = format!("ublkd.test/resync={:.0}", s.node.now());
    s.k(&["annotate", "pod", "p-e-file", "--overwrite", &resync])?;
    let grown = || df().is_ok_and(|k| k > before + 32768);
    s.wait(420, "df grew through the mapping", grown)
        .inspect_err(|_| s.tail(15, &["describe", "pvc", "e-file"]))?;
    s.say(format!("df: {before} KiB, then {} KiB", df()?));
    // A wrong key: the pod's mount fails, saying so, and nothing is written.
    s.delete(&["pod", "p-e-file"])?;
    luks_classes(s, "wrong-key-0000")?;
    s.start_pod("p-e-file", "e-file", Mode::Filesystem)?;
    let said = || {
        s.q(&["describe", "pod", "p-e-file"])
            .is_ok_and(|d| d.contains("wrong key"))
    };
    let shown = s.wait(180, "the pod's events say: wrong key", said);
    s.show(&["describe", "pod", "p-e-file"]);
    luks_classes(s, "right-key-51c7")?;
    shown?;
    file_pod_ready()?;
    let first = s.in_pod("p-e-file", "head -1 /data/m")?;
    ensure!(
        first == marker,
        "after the wrong key, /data/m reads {first:?}"
    );
    s.delete(&["pod", "p-e-file"])?;
    s.delete(&["pvc", "e-file"])?;
    luks_classes_gone(s)
}

/// A pod stuck in ContainerCreating, looked at as docs/kubernetes.md ("Troubleshooting") says:
/// a PV naming a volume this node's ublkd does not have (as one deleted by hand would), so the
/// pod's volume can never be staged. `kubectl describe pod` shows the mount error and the node
/// plugin's log the reason, with the volume's name.
fn stuck(s: &Sc) -> Result<()> {
    s.apply(&fill(
        "apiVersion: v1
kind: PersistentVolume
metadata: {name: stuck-pv}
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: stuck}
  csi: {driver: ublkd.io, volumeHandle: stuck-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [@NODE@]}]}]
",
        &[("NODE", NODE)],
    ))?;
    s.claim("stuck", "ublkd-ram", "64Mi", "volumeName: stuck-pv")?;
    s.start_pod("p-stuck", "stuck", Mode::Filesystem)?;
    let describe = || s.q(&["describe", "pod", "p-stuck"]).unwrap_or_default();
    s.wait(300, "a FailedMount event on p-stuck", || {
        describe().contains("FailedMount")
    })
    .inspect_err(|_| s.tail(20, &["describe", "pod", "p-stuck"]))?;
    s.tail(8, &["describe", "pod", "p-stuck"]);
    let reason = s.jp(
        &["pod", "p-stuck"],
        "{.status.containerStatuses[0].state.waiting.reason}",
    )?;
    ensure!(
        reason == "ContainerCreating",
        "p-stuck is waiting in '{reason}', not ContainerCreating"
    );
    let failed = describe();
    ensure!(
        failed
            .lines()
            .any(|l| l.contains("FailedMount") && l.contains("stuck-vol")),
        "the mount error does not name the volume"
    );
    let logs = s.k(&CSI_NODE_LOGS)?;
    let why: Vec<&str> = logs.lines().filter(|l| l.contains("stuck-vol")).collect();
    s.say(why[why.len().saturating_sub(3)..].join("\n"));
    let refused = |l: &&str| {
        l.find("call refused")
            .is_some_and(|at| l[at..].contains("stuck-vol"))
    };
    ensure!(
        why.iter().any(refused),
        "the node plugin's log does not say why stuck-vol cannot be staged"
    );
    s.k(&["delete", "pod", "p-stuck", "--wait=true", "--timeout=120s"])?;
    s.delete(&["pvc", "stuck"])?;
    s.delete(&["pv", "stuck-pv"])
}

/// The other node of node-loss: a Node object without a kubelet.
const LOST: &str = "ublkd-vm-lost";

/// Node loss (docs/kubernetes.md, "Retire a node"): a StatefulSet's pod on node B, B deleted,
/// and the pod comes up on this node with a new volume. Node B is a Node object without a
/// kubelet (two kubelets on one guest would need two containerds, mount namespaces and cgroup
/// roots). Its volume is a real ublkd volume on this node standing in for B's, named by a
/// PersistentVolume whose topology is B, as the provisioner writes them (its finalizer too).
/// Deleted, B is not lost yet (NotReady for less than the chart's 5 minutes): the controller
/// keeps everything and says why in an Event. Marked lost (the annotation ublkd.io/node-lost),
/// it must set the PV to Retain, delete the claim and the PV and leave the volume: afterwards
/// `kubectl ublkd orphans` lists it.
fn node_loss(s: &Sc) -> Result<()> {
    s.apply(&fill(
        "apiVersion: v1
kind: Node
metadata:
  name: @LOST@
  labels: {kubernetes.io/hostname: @LOST@, kubernetes.io/os: linux, ublkd.io/node: @LOST@}
",
        &[("LOST", LOST)],
    ))?;
    // room for pods, as a kubelet would report it (the scheduler fits none on a Node without)
    let room = json!({"cpu": "2", "memory": "2Gi", "pods": "10"});
    let status = json!({"status": {"capacity": room, "allocatable": room}}).to_string();
    s.k(&[
        "patch",
        "node",
        LOST,
        "--subresource=status",
        "--type=merge",
        "-p",
        &status,
    ])?;
    s.wait(120, "the controller's finalizer on the lost node", || {
        s.finalized(LOST)
    })?;
    s.ublkctl(&[
        "create-volume",
        "lost-vol",
        "--size",
        "64MiB",
        "--backend",
        "ram",
    ])?;
    s.apply(&fill(
        "apiVersion: v1
kind: PersistentVolume
metadata:
  name: lost-pv
  annotations: {pv.kubernetes.io/provisioned-by: ublkd.io}
  finalizers: [kubernetes.io/pv-protection, external-provisioner.volume.kubernetes.io/finalizer]
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  # Delete, as the provisioner makes them: the controller sets it to Retain before it deletes
  # the claim, so that no provisioner deletes the volume (it stands in for B's on this node);
  # a PV that was Retain already it would leave alone.
  persistentVolumeReclaimPolicy: Delete
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: data-lost-0}
  csi: {driver: ublkd.io, volumeHandle: lost-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [@LOST@]}]}]
",
        &[("LOST", LOST)],
    ))?;
    s.apply(
        r#"apiVersion: apps/v1
kind: StatefulSet
metadata: {name: lost}
spec:
  serviceName: lost
  replicas: 1
  selector: {matchLabels: {app: lost}}
  template:
    metadata: {labels: {app: lost}}
    spec:
      terminationGracePeriodSeconds: 1
      # node B has no kubelet: the node lifecycle controller taints it unreachable
      tolerations: [{operator: Exists}]
      containers:
        - name: app
          image: ublkd.test/busybox:test
          command: ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]
          volumeMounts: [{name: data, mountPath: /data}]
  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
        accessModes: [ReadWriteOnce]
        storageClassName: ublkd-ram
        resources: {requests: {storage: 64Mi}}
"#,
    )?;
    let on_node = |n: &str| {
        s.jp(&["pod", "lost-0"], "{.spec.nodeName}")
            .is_ok_and(|x| x == n)
    };
    s.wait(300, "lost-0 scheduled to the lost node", || on_node(LOST))
        .inspect_err(|_| s.tail(20, &["describe", "pod", "lost-0"]))?;
    let bound = s.jp(&["pvc", "data-lost-0"], "{.spec.volumeName}")?;
    ensure!(
        bound == "lost-pv",
        "data-lost-0 is not bound to lost-pv ({bound})"
    );
    // B's kubelet "stops" now: Ready Unknown from this moment (the node lifecycle controller
    // keeps the time of a condition already Unknown), and B has no Lease.
    let t = local("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"])?
        .trim()
        .to_owned();
    let cond = json!({"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
        "message": "the test's lost node", "lastHeartbeatTime": t, "lastTransitionTime": t});
    let patch = json!({"status": {"conditions": [cond]}}).to_string();
    s.k(&["patch", "node", LOST, "--subresource=status", "-p", &patch])?;
    s.say("lost-0 on the lost node with lost-pv; deleting the node");
    s.k(&["delete", "node", LOST, "--wait=false"])?;
    let controller_log = || {
        s.tail(
            30,
            &["-n", "ublkd-system", "logs", "deploy/ublkd-csi-controller"],
        )
    };
    // NotReady for seconds, not the 5 minutes of nodeLoss.lostAfter: kept, and said so
    s.wait(120, "a NodeNotReadyTooShort Event", || {
        s.node_event(LOST, "NodeNotReadyTooShort")
    })
    .inspect_err(|_| {
        s.node_events(LOST);
        controller_log();
    })?;
    s.node_events(LOST);
    ensure!(
        s.finalized(LOST),
        "the controller let the lost node go before it was lost"
    );
    let bound = s.jp(&["pvc", "data-lost-0"], "{.spec.volumeName}")?;
    ensure!(
        bound == "lost-pv",
        "data-lost-0 was released before its node was lost"
    );
    let policy = s.jp(&["pv", "lost-pv"], "{.spec.persistentVolumeReclaimPolicy}")?;
    ensure!(
        policy == "Delete",
        "lost-pv was touched before its node was lost"
    );
    // the operator says the machine is gone
    s.k(&["annotate", "node", LOST, "ublkd.io/node-lost=true"])?;
    s.wait(300, "the lost node released", || !s.exists(&["node", LOST]))
        .inspect_err(|_| {
            s.node_events(LOST);
            controller_log();
        })?;
    s.tail(
        20,
        &["-n", "ublkd-system", "logs", "deploy/ublkd-csi-controller"],
    );
    s.node_events(LOST);
    ensure!(
        s.node_event(LOST, "NodeReleased"),
        "no NodeReleased Event on the lost node"
    );
    // The pod of a node that has gone is the pod GC's to delete, about a minute later (51 s in
    // CI, 2026-12-06); the operator who said the machine is gone deletes it at once, as
    // docs/kubernetes.md says. The claim goes with it, and the StatefulSet makes both again:
    // scheduled here, provisioned here.
    s.k(&["delete", "pod", "lost-0", "--force", "--grace-period=0"])?;
    let moved = || {
        on_node(NODE)
            && s.q(&[
                "wait",
                "--for=condition=Ready",
                "pod/lost-0",
                "--timeout=5s",
            ])
            .is_ok()
    };
    s.wait(600, "lost-0 up on this node", moved)
        .inspect_err(|_| {
            s.tail(20, &["describe", "pod", "lost-0"]);
            s.tail(15, &["describe", "pvc", "data-lost-0"]);
            controller_log();
        })?;
    s.wait(120, "lost-pv went with its node", || {
        !s.exists(&["pv", "lost-pv"])
    })?;
    let new = s.volume_of("data-lost-0")?;
    s.say(format!("lost-0 Ready on {NODE} with volume {new}"));
    ensure!(
        !new.is_empty() && new != "lost-vol",
        "lost-0 came back on the old volume ({new})"
    );
    s.in_pod("lost-0", "echo moved >/data/f && sync")?;
    // the lost node's volume is never deleted from the cluster: an orphan to decide on
    let info = s.ublkctl(&["get-volume", "lost-vol"])?;
    ensure!(
        field(&info, "state") == Some("ready"),
        "lost-vol was deleted or is not ready"
    );
    let out = s.k(&["ublkd", "orphans"])?;
    s.say(&out);
    ensure!(
        has_line(&out, &format!("{NODE} volume without PV lost-vol")),
        "kubectl ublkd orphans does not list lost-vol"
    );
    // and the node's own report: the driver tells ublkd (every 15 s here, after two lists in a
    // row), ublkd shows it in `ublkctl orphans` and its metric
    let reported = || {
        s.ublkctl(&["orphans"])
            .is_ok_and(|o| o.lines().any(|l| l.trim() == "lost-vol"))
    };
    s.wait(300, "ublkctl orphans lists lost-vol", reported)?;
    let sel = UBLKD_PODS;
    let ip = s.jp(&sel, "{.items[0].status.podIP}")?;
    let metrics = local("curl", &["-fsS", &format!("http://{ip}:9580/metrics")])?;
    let n = metrics
        .lines()
        .find_map(|l| l.strip_prefix("ublkd_volumes_without_pv "))
        .map(str::trim);
    s.say(format!("ublkd_volumes_without_pv {n:?}"));
    ensure!(
        n.and_then(|n| n.parse::<f64>().ok()).unwrap_or(0.0) >= 1.0,
        "ublkd_volumes_without_pv is {n:?}, not 1 or more"
    );
    s.delete(&["statefulset", "lost"])?;
    s.delete(&["pvc", "data-lost-0"])?;
    s.ublkctl(&["delete-volume", "lost-vol"]).map(drop)
}

/// A deleted Node is not a lost one (docs/kubernetes.md, "Retire a node"): the Node object of
/// this, the running node, deleted with one claim in use by a pod and one bound but unused. The
/// controller's finalizer holds the Node (Terminating) and its kubelet keeps renewing its
/// Lease, so nothing may be released: after looks enough for a provisioner to have deleted a
/// released volume, both claims (the same uids), both PVs (still Delete) and both ublkd
/// volumes are there, the pod still reads its data, and an Event on the Node says why. Then
/// the Node is given back as the document says (the finalizer off, the kubelet restarted,
/// which registers it again) and, a minute after, nothing is released either.
fn node_alive(s: &Sc) -> Result<()> {
    // Two looks of the controller and a margin (`nodeLoss.recheck`, tests/k8s/values.yaml).
    const LOOKS: Duration = Duration::from_secs(12);
    // file volumes: should the pod garbage collector restart ublkd while the Node is away, they
    // are its registry's, taken back at start
    s.pvc("a-used", "ublkd-file", "64Mi", Mode::Filesystem)?;
    s.pvc("a-idle", "ublkd-file", "64Mi", Mode::Filesystem)?;
    s.pod("p-alive", "a-used", Mode::Filesystem)?;
    s.in_pod("p-alive", "echo alive >/data/f && sync")?;
    // bound by a pod of its own (WaitForFirstConsumer), then unused
    s.pod("p-alive-idle", "a-idle", Mode::Filesystem)?;
    s.delete(&["pod", "p-alive-idle"])?;
    let mut claims = Vec::new();
    for c in ["a-used", "a-idle"] {
        let uid = s.jp(&["pvc", c], "{.metadata.uid}")?;
        let pv = s.jp(&["pvc", c], "{.spec.volumeName}")?;
        let vol = s.volume_of(c)?;
        s.say(format!("{c}: {uid} {pv} {vol}"));
        ensure!(!vol.is_empty(), "{c} bound to a volume");
        claims.push((c, uid, pv, vol));
    }
    ensure!(
        s.finalized(NODE),
        "no finalizer ublkd.io/node on the node before its deletion"
    );
    let node_uid = s.jp(&["node", NODE], "{.metadata.uid}")?;
    // nothing released: the claims, their PVs as the provisioner made them, the volumes
    let intact = || -> Result<()> {
        let vols = s.ublkctl(&["list-volumes"])?;
        for (c, uid, pv, vol) in &claims {
            let now = s.jp(&["pvc", c], "{.metadata.uid} {.status.phase}")?;
            ensure!(
                now == format!("{uid} Bound"),
                "{c} was deleted or unbound ({now})"
            );
            let got = s.jp(
                &["pv", pv],
                "{.spec.persistentVolumeReclaimPolicy} {.metadata.deletionTimestamp}",
            )?;
            ensure!(
                got.trim_end() == "Delete",
                "{pv} was deleted or changed ('{got}')"
            );
            ensure!(
                vols.contains(vol.as_str()),
                "ublkd's volume {vol} disappeared:\n{vols}"
            );
        }
        if s.node_event(NODE, "NodeReleased") {
            s.node_events(NODE);
            bail!("the controller released the running node");
        }
        Ok(())
    };
    s.k(&["delete", "node", NODE, "--wait=false"])?;
    let deleting = s.jp(&["node", NODE], "{.metadata.deletionTimestamp}")?;
    ensure!(
        !deleting.is_empty(),
        "the node went at once: its finalizer did not hold it"
    );
    s.wait(120, "a NodeLeaseRenewed Event", || {
        s.node_event(NODE, "NodeLeaseRenewed")
    })
    .inspect_err(|_| {
        s.node_events(NODE);
        s.tail(
            30,
            &["-n", "ublkd-system", "logs", "deploy/ublkd-csi-controller"],
        );
    })?;
    s.node_events(NODE);
    // The controller looks every 5 s here (tests/k8s/values.yaml): two more looks. In issue 38
    // the node's provisioner deleted the volumes of the released PVs within seconds.
    std::thread::sleep(LOOKS);
    intact()?;
    let got = s.in_pod("p-alive", "cat /data/f")?;
    ensure!(
        got == "alive",
        "p-alive lost its data while its Node was Terminating ({got})"
    );
    let sel =
        format!("involvedObject.kind=Node,involvedObject.name={NODE},reason=NodeLeaseRenewed");
    let counts = s.jp(
        &["events", "-A", "--field-selector", &sel],
        r"{range .items[*]}{.count}{'\n'}{end}",
    )?;
    let n: u64 = counts
        .lines()
        .map(|c| c.trim().parse::<u64>().unwrap_or(0).max(1))
        .sum();
    s.say(format!(
        "NodeLeaseRenewed posted {n} time(s) over {} s of looks",
        LOOKS.as_secs()
    ));
    ensure!(n <= 1, "the same decision was posted {n} times, not once");
    s.say("nothing released while the node was Terminating; giving it back");
    let off =
        json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "-p", &off])?;
    // gone, or registered again already by a kubelet that does so on its own
    let replaced = || {
        s.jp(&["node", NODE], "{.metadata.uid}")
            .map_or(true, |u| u != node_uid)
    };
    s.wait(120, "the node went once its finalizer was off", replaced)?;
    // the kubelet registers the Node at start
    restart_kubelet(s)?;
    s.wait(600, "the kubelet registered the node again", || {
        s.node_ready()
    })?;
    s.wait(300, "the driver registered on the new node", || {
        s.registered()
    })?;
    s.wait(300, "the controller's finalizer on the new node", || {
        s.finalized(NODE)
    })?;
    s.wait(600, "the driver's pods Ready again", || s.all_ready())
        .inspect_err(|_| s.show(&["-n", "ublkd-system", "get", "pods", "-o", "wide"]))?;
    s.say("the node registered again; one more look");
    std::thread::sleep(LOOKS / 2);
    intact()?;
    s.node_events(NODE);
    s.tail(
        10,
        &["-n", "ublkd-system", "logs", "deploy/ublkd-csi-controller"],
    );
    s.k(&[
        "delete",
        "pod",
        "p-alive",
        "--wait=true",
        "--ignore-not-found",
    ])?;
    s.delete(&["pvc", "a-used", "a-idle"])
}

/// Uninstall as docs/kubernetes.md ("Uninstall") says, last: every claim deleted first (with
/// whatever pods a failed scenario left), then helm uninstall; the driver's objects, pods and
/// devices are gone, the namespace is left.
fn uninstall(s: &Sc) -> Result<()> {
    // what a failed scenario left behind goes first, as a user would delete their workloads
    for kind in ["pod", "pvc"] {
        s.k(&[
            "delete",
            kind,
            "--all",
            "--namespace",
            "default",
            "--wait=true",
            "--timeout=300s",
        ])?;
    }
    let left = s.k(&["get", "pvc", "-A", "--no-headers"])?;
    ensure!(
        left.trim().is_empty(),
        "claims left before the uninstall:\n{left}"
    );
    // classes a failed scenario made itself (the chart's carry managed-by=Helm)
    s.k(&[
        "delete",
        "storageclass",
        "-l",
        "app.kubernetes.io/managed-by!=Helm",
        "--ignore-not-found",
    ])?;
    s.helm(&[
        "uninstall",
        "ublkd",
        "--namespace",
        "ublkd-system",
        "--wait",
        "--timeout",
        "600s",
    ])?;
    // the pre-delete hook took the controller's finalizer off the node
    ensure!(
        !s.finalized(NODE),
        "the finalizer ublkd.io/node outlived the uninstall"
    );
    // the kubectl users' step for the same (docs/kubernetes.md, "Uninstall"), on a finalizer
    // put back by hand
    let on = json!({"metadata": {"finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "--type=merge", "-p", &on])?;
    let off =
        json!({"metadata": {"$deleteFromPrimitiveList/finalizers": ["ublkd.io/node"]}}).to_string();
    s.k(&["patch", "node", NODE, "-p", &off])?;
    ensure!(
        !s.finalized(NODE),
        "the documented patch left the finalizer on the node"
    );
    let driver = s.k(&[
        "get",
        "csidriver",
        "ublkd.io",
        "--ignore-not-found",
        "-o",
        "name",
    ])?;
    ensure!(
        driver.trim().is_empty(),
        "the CSIDriver outlived the uninstall"
    );
    let classes = s.k(&["get", "storageclass", "-o", "name"])?;
    ensure!(
        !classes.contains("ublkd"),
        "a StorageClass outlived the uninstall"
    );
    let no_pods = || {
        s.q(&["-n", "ublkd-system", "get", "pods", "--no-headers"])
            .is_ok_and(|p| p.trim().is_empty())
    };
    s.wait(300, "ublkd's pods went", no_pods)
        .inspect_err(|_| s.show(&["-n", "ublkd-system", "get", "pods"]))?;
    let devices: Vec<String> = fs::read_dir("/dev")?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("ublkb"))
        .collect();
    ensure!(
        devices.is_empty(),
        "ublk devices outlived the uninstall: {devices:?}"
    );
    s.k(&[
        "delete",
        "namespace",
        "ublkd-system",
        "--wait=true",
        "--timeout=300s",
    ])
    .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every scenario once, and a name the host can be asked for.
    #[test]
    fn every_scenario_is_named_once() {
        let mut names: Vec<&str> = names().collect();
        assert_eq!(names.first(), Some(&"driver"));
        assert_eq!(names.last(), Some(&"uninstall"));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a scenario named twice");
        assert!(names.iter().all(|n| !n.is_empty() && !n.contains(' ')));
    }
}
