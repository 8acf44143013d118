//! Prometheus scraping ublkd as the chart's ServiceMonitor does, and the pool alert firing and clearing.

use super::{files_named, VOLUMES};
use crate::kube::{fill, local, localw, words, Daemon, Sc, NODE};
use anyhow::{bail, ensure, Context, Result};
use serde_json::Value;
use std::fs;
use std::path::Path;

/// Prometheus (built from its module: Debian's has no Kubernetes discovery) on the node,
/// scraping the way the chart's ServiceMonitor does (tests/k8s/node/prometheus.yml). Its rules
/// are the chart's files/ublkd-rules.yaml with one change: UblkdPoolAlmostFull's `for: 10m`
/// cut to 10s (still pending first, for two of its 5 s evaluations). The file pool is then
/// filled with files beside the volumes' (fallocate, to 5 % free as ublkd reports it): the
/// alert fires for that pool, and clears once they are gone.
pub fn monitoring(s: &Sc) -> Result<()> {
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
    let rules = rules[..at].to_owned() + &rule.replacen("for: 10m", "for: 10s", 1) + &rules[end..];
    fs::write(w.join("rules.yaml"), rules)?;
    let conf = include_str!("../prometheus.yml");
    let pki = i.pki.to_string_lossy();
    fs::write(
        w.join("prometheus.yml"),
        fill(
            conf,
            &[("DIR", &w.to_string_lossy()), ("PKI", &pki), ("NODE", NODE)],
        ),
    )?;
    let args = format!(
        "--config.file={d}/prometheus.yml --storage.tsdb.path={d}/data \
         --web.listen-address=127.0.0.1:9090",
        d = w.display()
    );
    let log = s.node.logs.join("prometheus.log");
    let _prom = Daemon::start(&i.prometheus, &words(&args), &[], &log)?;
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
        let t = localw("curl -fsS http://127.0.0.1:9090/api/v1/targets");
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
    let scraped = |seen: Vec<(String, String)>| {
        let on_node = |c: &str| seen.contains(&(c.to_owned(), NODE.to_owned()));
        on_node("csi-provisioner") && on_node("csi-resizer")
    };
    let both = || sidecars().is_ok_and(scraped);
    s.wait(120, "the provisioner's and resizer's metrics scraped", both)
        .inspect_err(|_| s.say(format!("sidecar series: {:?}", sidecars())))?;
    // The dashboard as Grafana's sidecar finds it (by its label), and its variables' queries
    // against these series: the node variable lists this node by name.
    let cms = s.kw("-n ublkd-system get cm -l grafana_dashboard=1 -o json")?;
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
    let pool = VOLUMES;
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
                localw(&format!("df -B1 --output=avail {pool}"))?
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
                let all = localw("curl -fsS http://127.0.0.1:9090/api/v1/alerts")?;
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
