//! The shipped dashboard and alert rules against a real Prometheus (Debian's `prometheus`, from
//! the host root the guest runs on): it scrapes a ublkd serving fio, loads the rules (a rule
//! that does not parse stops it), and every dashboard query and every rule expression is then
//! evaluated through its HTTP API. `promtool check metrics` reads a scrape too.
#![cfg(feature = "vm")]

use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use ublkd_tests::daemon::Daemon;
use ublkd_tests::guest;

const METRICS_PORT: u16 = 19590;
const PROM_PORT: u16 = 19090;

fn workspace() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_default()
}

/// A Prometheus process, killed on drop.
struct Prometheus(Child);

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn start_prometheus(dir: &Path) -> Result<Prometheus> {
    let bin = ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
        .into_iter()
        .map(PathBuf::from)
        .find(|p| p.exists())
        .context("no prometheus binary: the harness installs Debian's prometheus package")?;
    let rules = workspace().join("deploy/helm/ublkd/files/ublkd-rules.yaml");
    let config = dir.join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n\
             rule_files:\n  - {rules:?}\n\
             scrape_configs:\n  - job_name: ublkd\n    static_configs:\n      \
             - targets: ['127.0.0.1:{METRICS_PORT}']\n"
        ),
    )?;
    let child = Command::new(bin)
        .arg(format!("--config.file={}", config.display()))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("tsdb").display()
        ))
        .arg(format!("--web.listen-address=127.0.0.1:{PROM_PORT}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("prometheus.log"))?)
        .spawn()
        .context("starting prometheus")?;
    Ok(Prometheus(child))
}

/// Evaluates `expr` now through the HTTP API; returns the result vector (status checked).
fn query(expr: &str) -> Result<Vec<serde_json::Value>> {
    let out = ublkd_tests::run(Command::new("curl").args([
        "-sS",
        "--max-time",
        "10",
        &format!("http://127.0.0.1:{PROM_PORT}/api/v1/query"),
        "--data-urlencode",
        &format!("query={expr}"),
    ]))?;
    let v: serde_json::Value =
        serde_json::from_str(&out).with_context(|| format!("not JSON: {out}"))?;
    if v["status"] != "success" {
        bail!("query {expr:?} failed: {out}");
    }
    Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
}

/// The dashboard's PromQL, with its Grafana variables given values that select everything.
fn dashboard_queries() -> Result<Vec<(String, String)>> {
    let path = workspace().join("deploy/helm/ublkd/files/ublkd-dashboard.json");
    let d: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(path)?)?;
    let mut out = Vec::new();
    for p in d["panels"].as_array().context("panels")? {
        for t in p["targets"].as_array().into_iter().flatten() {
            if let Some(e) = t["expr"].as_str() {
                let e = e
                    .replace("$__rate_interval", "10s")
                    .replace("$instance", ".*")
                    .replace("$volume", ".*")
                    .replace("$node", ".*")
                    .replace("$namespace", ".*")
                    .replace("$claim", ".*");
                out.push((p["title"].as_str().unwrap_or("?").to_owned(), e));
            }
        }
    }
    for v in d["templating"]["list"].as_array().context("templating")? {
        if let Some(q) = v["query"]["query"].as_str() {
            // label_values(METRIC, label): the series the variable lists.
            if let Some(inner) = q
                .strip_prefix("label_values(")
                .and_then(|r| r.rsplit_once(','))
            {
                let metric = ["$instance", "$node", "$namespace", "$claim"]
                    .iter()
                    .fold(inner.0.to_owned(), |m, v| m.replace(v, ".*"));
                out.push((format!("variable {}", v["name"]), metric));
            }
        }
    }
    Ok(out)
}

/// Every rule Prometheus loaded from the shipped rules file: name and expression.
fn loaded_rules() -> Result<Vec<(String, String)>> {
    let out = ublkd_tests::run(Command::new("curl").args([
        "-sS",
        "--max-time",
        "10",
        &format!("http://127.0.0.1:{PROM_PORT}/api/v1/rules"),
    ]))?;
    let v: serde_json::Value = serde_json::from_str(&out)?;
    let mut rules = Vec::new();
    for g in v["data"]["groups"].as_array().context("rule groups")? {
        for r in g["rules"].as_array().context("rules")? {
            rules.push((
                r["name"].as_str().unwrap_or("?").to_owned(),
                r["query"].as_str().context("query")?.to_owned(),
            ));
        }
    }
    Ok(rules)
}

/// The metric names an expression reads.
fn metric_names(expr: &str) -> Vec<String> {
    let mut names = Vec::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        let word = &expr[start..i];
        let metric = word.starts_with("ublkd_") || word.starts_with("process_") || word == "up";
        // Any word with a metric's prefix (or `up`) is a metric name: no label name, label
        // value or function in these expressions has one.
        if metric && !names.iter().any(|n| n == word) {
            names.push(word.to_owned());
        }
        i = i.max(start + 1);
    }
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_and_alert_rules_work_against_a_real_prometheus() -> Result<()> {
    let dir = guest::scratch("observability")?;
    let mut d = Daemon::new(&dir, METRICS_PORT, "")?;
    d.start().await?;
    let root = d.root.clone();
    let dev_ram = d.ublkctl_ok(&[
        "create-volume",
        "obs-ram",
        "--size",
        "64Mi",
        "--backend",
        "ram",
    ])?;
    let backing = root.join("obs.img");
    let dev_file = d.ublkctl_ok(&[
        "create-volume",
        "obs-file",
        "--size",
        "64Mi",
        "--backend",
        &format!("file+create:{}", backing.display()),
    ])?;
    // One refused call, so the gRPC error panels have a series.
    let (code, _, _) = d.ublkctl(&["get-volume", "no-such-volume"])?;
    ensure!(code == 1, "get-volume of a missing volume exits 1");

    // The exposition itself passes promtool's lint.
    let scrape = d.scrape()?;
    let body = scrape
        .split_once("\r\n\r\n")
        .map(|(_, b)| b)
        .context("HTTP response")?;
    let scraped = dir.join("metrics.txt");
    std::fs::write(&scraped, body)?;
    let lint = guest::sh(&format!(
        "promtool check metrics < {} 2>&1; echo rc=$?",
        scraped.display()
    ))?;
    ensure!(
        lint.trim_end().ends_with("rc=0"),
        "promtool check metrics: {lint}"
    );
    // docs/metrics.md names each family exposed, with its type and every label (issue 56).
    let doc = std::fs::read_to_string(workspace().join("docs/metrics.md"))?;
    let documented = ublkd_tests::metrics_doc::documented(&doc);
    let exposed = ublkd_tests::metrics_doc::scraped(body);
    let wrong = ublkd_tests::metrics_doc::disagreements(&documented, &exposed);
    ensure!(
        wrong.is_empty(),
        "docs/metrics.md disagrees with the scrape:\n{}",
        wrong.join("\n")
    );
    ensure!(
        exposed.keys().filter(|n| n.starts_with("ublkd_")).count() >= 25,
        "too few families in the scrape to judge the document: {:?}",
        exposed.keys().collect::<Vec<_>>()
    );

    let _prom = start_prometheus(&dir)?;
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match query("up{job=\"ublkd\"} == 1") {
            Ok(r) if !r.is_empty() => break,
            _ if Instant::now() > deadline => bail!(
                "prometheus never scraped ublkd: {}",
                std::fs::read_to_string(dir.join("prometheus.log")).unwrap_or_default()
            ),
            _ => std::thread::sleep(Duration::from_millis(250)),
        }
    }
    // fio on both volumes for a while, so rates and histograms have data.
    let fio = |dev: &str| {
        format!(
            "fio --name=o --filename={dev} --ioengine=io_uring --direct=1 --rw=randrw \
             --bs=4k --iodepth=8 --runtime=5 --time_based --fsync=64 --output=/dev/null"
        )
    };
    guest::sh(&format!(
        "({}) & ({}) & wait",
        fio(dev_ram.trim()),
        fio(dev_file.trim())
    ))?;

    let mut empty = Vec::new();
    for (panel, expr) in dashboard_queries()? {
        let r = query(&expr).with_context(|| format!("panel {panel:?}"))?;
        if r.is_empty() {
            empty.push(format!("{panel}: {expr}"));
        }
    }
    ensure!(
        empty.is_empty(),
        "dashboard queries that return nothing:\n{}",
        empty.join("\n")
    );

    let rules = loaded_rules()?;
    let shipped =
        std::fs::read_to_string(workspace().join("deploy/helm/ublkd/files/ublkd-rules.yaml"))?
            .matches("- alert:")
            .count();
    ensure!(
        rules.len() == shipped && shipped >= 8,
        "prometheus loaded {} of the {shipped} shipped alerts: {rules:?}",
        rules.len()
    );
    for (alert, expr) in &rules {
        // It parses and evaluates (healthy, most rules select nothing: that is the point) ...
        query(expr).with_context(|| format!("alert {alert}"))?;
        // ... and every series it reads exists.
        for name in metric_names(expr) {
            let r = query(&format!("group({name})"))?;
            ensure!(
                !r.is_empty(),
                "alert {alert} reads {name}, which has no series"
            );
        }
    }
    // Healthy node: none of them fires.
    let firing = query("ALERTS{alertstate=\"firing\"}")?;
    ensure!(
        firing.is_empty(),
        "alerts firing on a healthy node: {firing:?}"
    );
    // The latency rule's quantile, by hand, is a real number of seconds.
    let p99 = query(
        "histogram_quantile(0.99, sum by (volume, le) \
         (rate(ublkd_volume_io_duration_seconds_bucket[10s])))",
    )?;
    ensure!(p99.len() == 2, "a p99 per volume: {p99:?}");
    // A pool filled: a sparse file volume promised nearly all the root's free bytes. Its
    // capacity series say so at once, and the pool alert's expression holds (pending: its
    // `for` is 10 minutes); the volume deleted, it clears.
    let pool = root.display().to_string();
    let free_now = || -> Result<f64> {
        let text = d.scrape()?;
        ublkd_tests::daemon::sample(
            &text,
            "ublkd_capacity_free_bytes",
            &[("backend", "file"), ("pool", &pool)],
        )
        .with_context(|| format!("no ublkd_capacity_free_bytes of {pool} in the scrape"))
    };
    let free = free_now()?;
    let size = ((free * 0.95) as u64) & !((1 << 20) - 1);
    d.ublkctl_ok(&[
        "create-volume",
        "obs-fill",
        "--size",
        &size.to_string(),
        "--backend",
        &format!("file+create:{}", root.join("fill.img").display()),
    ])?;
    let left = free_now()?;
    ensure!(
        left < free * 0.1,
        "a {size}-byte volume on a pool with {free} free bytes left {left} free"
    );
    let pending = |want: bool| -> Result<()> {
        let q = format!("ALERTS{{alertname=\"UblkdPoolAlmostFull\",pool=\"{pool}\"}}");
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let r = query(&q)?;
            if r.is_empty() != want {
                return Ok(());
            }
            ensure!(
                Instant::now() < deadline,
                "UblkdPoolAlmostFull on {pool} {} within 30 s: {r:?}",
                if want { "never pending" } else { "still there" }
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };
    pending(true)?;
    d.ublkctl_ok(&["delete-volume", "obs-fill", "--delete-backing"])?;
    ensure!(
        free_now()? > free * 0.9,
        "the pool's free bytes did not come back after the delete"
    );
    pending(false)?;
    for id in ["obs-ram", "obs-file"] {
        d.ublkctl_ok(&["delete-volume", id])?;
    }
    Ok(())
}

#[test]
fn metric_names_are_found_in_expressions() {
    assert_eq!(
        metric_names(
            "histogram_quantile(0.99, sum by (le) (rate(ublkd_x_bucket{a=\"b\"}[5m]))) > up"
        ),
        ["ublkd_x_bucket", "up"]
    );
}
