//! The load the node puts on the API server: every request of ublkd's namespace's service
//! accounts, as the API server's audit log records them (the control plane's policy), counted
//! over half a minute with nothing happening and half a minute with 50 volumes doing I/O, as
//! rates per minute (the node plugin's slowest period, its report's refresh, is a minute: a
//! window of half that holds one refresh at most, so its rate bound is as strict).

use crate::kube::{Sc, NODE};
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::io::{Seek, SeekFrom, Write};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// How long each window lasts.
const WINDOW: Duration = Duration::from_secs(30);
/// How many volumes do I/O in the second window.
const VOLUMES: usize = 50;
/// Where they live: the file class's root, so that rewriting the same blocks changes no pool.
const ROOT: &str = "/var/lib/ublkd/volumes";
/// The node plugin's service account, which its sidecars share.
const PLUGIN: &str = "system:serviceaccount:ublkd-system:ublkd-csi-node";

/// The audit log's lines so far.
fn audit(s: &Sc) -> Result<Vec<String>> {
    let a = s.node.host.call("audit", &[], None)?;
    ensure!(a.rc == 0, "reading the audit log: {}", a.err);
    Ok(a.out.lines().map(str::to_owned).collect())
}

/// Counts of one window's requests, by agent: (node, user agent, verb) -> requests; and the
/// writes of this node's UblkdNode by its node plugin.
struct Window {
    by: BTreeMap<(String, String, String), u64>,
    report_writes: u64,
    secs: f64,
}

fn count(lines: &[String], secs: f64) -> Window {
    let mut m = Window {
        by: BTreeMap::new(),
        report_writes: 0,
        secs,
    };
    for line in lines {
        let Ok(e) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let user = &e["user"];
        let account = user["username"].as_str().unwrap_or_default();
        let node = user["extra"]["authentication.kubernetes.io/node-name"][0]
            .as_str()
            .unwrap_or("-");
        let agent = e["userAgent"].as_str().unwrap_or_default();
        let agent = agent
            .split('/')
            .next()
            .filter(|a| !a.is_empty())
            .unwrap_or("-");
        let who = if account == PLUGIN {
            agent.to_owned()
        } else {
            account.rsplit(':').next().unwrap_or(account).to_owned()
        };
        let verb = e["verb"].as_str().unwrap_or_default().to_owned();
        let write = matches!(
            verb.as_str(),
            "create" | "update" | "patch" | "delete" | "deletecollection"
        );
        if write && e["objectRef"]["resource"] == "ublkdnodes" && node == NODE {
            m.report_writes += 1;
        }
        *m.by.entry((node.to_owned(), who, verb)).or_default() += 1;
    }
    m
}

impl Window {
    /// `n` requests in this window, per minute.
    fn per_min(&self, n: u64) -> f64 {
        n as f64 * 60.0 / self.secs
    }

    /// One line per node and agent: requests and writes per minute, by verb.
    fn table(&self, what: &str) -> String {
        let per_min = |n: u64| self.per_min(n);
        let mut out = format!("{what} ({:.0} s):\n", self.secs);
        let mut rows: BTreeMap<(&str, &str), Vec<String>> = BTreeMap::new();
        for ((node, who, verb), n) in &self.by {
            rows.entry((node, who))
                .or_default()
                .push(format!("{verb} {:.1}", per_min(*n)));
        }
        for ((node, who), verbs) in rows {
            out += &format!("  node {node} {who}: {} per minute\n", verbs.join(", "));
        }
        let writes: u64 = self
            .by
            .iter()
            .filter(|((_, _, v), _)| matches!(v.as_str(), "create" | "update" | "patch" | "delete"))
            .map(|(_, n)| n)
            .sum();
        let all: u64 = self.by.values().sum();
        out += &format!(
            "  all: {:.1} requests, {:.1} writes per minute; UblkdNode writes {:.1} per minute",
            per_min(all),
            per_min(writes),
            per_min(self.report_writes)
        );
        out
    }
}

/// The requests of a window (from the line after `since`): the lines the log gained meanwhile.
fn window(s: &Sc, what: &str) -> Result<Window> {
    let since = audit(s)?.len();
    let t0 = Instant::now();
    std::thread::sleep(WINDOW);
    let lines = audit(s)?;
    let m = count(&lines[since.min(lines.len())..], t0.elapsed().as_secs_f64());
    s.say(m.table(what));
    Ok(m)
}

/// Idle, then with `VOLUMES` volumes written in turn the whole window: the node plugin writes
/// its UblkdNode at most twice a minute either way (its counters wait for the refresh).
pub fn api_load(s: &Sc) -> Result<()> {
    let idle = window(s, "API requests of ublkd's namespace, idle")?;
    ensure!(
        idle.per_min(idle.report_writes) <= 2.0,
        "the node plugin wrote its UblkdNode {} times in {:.0} idle seconds",
        idle.report_writes,
        idle.secs
    );
    let names: Vec<String> = (0..VOLUMES).map(|i| format!("load-{i}")).collect();
    // One exec for all: each is a round trip through the API server and the kubelet.
    let each = |line: &dyn Fn(&str) -> String| -> Result<String> {
        let script: Vec<String> = names.iter().map(|n| line(n)).collect();
        let script = script.join(" && ");
        let pod = s.ublkd_pod()?;
        s.k(&[
            "-n",
            "ublkd-system",
            "exec",
            &pod,
            "-c",
            "ublkd",
            "--",
            "sh",
            "-c",
            &script,
        ])
    };
    each(&|n| {
        format!("/usr/local/bin/ublkctl create-volume {n} --size 4MiB --backend file+create:{ROOT}/{n}.img")
    })?;
    let listed: Value = serde_json::from_str(&s.ublkctl("-o json list-volumes")?)?;
    let devices: Vec<String> = listed["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|v| v["id"].as_str().is_some_and(|id| id.starts_with("load-")))
        .filter_map(|v| v["device_path"].as_str().map(str::to_owned))
        .collect();
    ensure!(
        devices.len() == VOLUMES,
        "{} of {VOLUMES} load volumes have a device on {NODE}",
        devices.len()
    );
    let stop = AtomicBool::new(false);
    let (load, writes) = std::thread::scope(|scope| {
        let writer = scope.spawn(|| -> Result<u64> {
            let block = vec![0x5a_u8; 64 << 10];
            let mut n = 0;
            while !stop.load(Ordering::Relaxed) {
                for d in &devices {
                    let mut f = std::fs::OpenOptions::new()
                        .write(true)
                        .open(d)
                        .with_context(|| format!("opening {d}"))?;
                    f.seek(SeekFrom::Start(0))?;
                    f.write_all(&block)?;
                    f.sync_data()?;
                    n += 1;
                }
            }
            Ok(n)
        });
        let load = window(s, &format!("the same, {VOLUMES} volumes written in turn"));
        stop.store(true, Ordering::Relaxed);
        let writes = writer
            .join()
            .map_err(|_| anyhow::anyhow!("the writer panicked"));
        (load, writes)
    });
    let (load, writes) = (load?, writes??);
    s.say(format!(
        "{writes} writes of 64 KiB to the {VOLUMES} volumes"
    ));
    each(&|n| format!("/usr/local/bin/ublkctl delete-volume {n} --delete-backing"))?;
    ensure!(writes > 0, "no write reached the load volumes");
    ensure!(
        load.per_min(load.report_writes) <= 2.0,
        "the node plugin wrote its UblkdNode {} times in {:.0} seconds of I/O",
        load.report_writes,
        load.secs
    );
    Ok(())
}
