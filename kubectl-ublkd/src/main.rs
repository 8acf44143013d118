//! `kubectl ublkd`: a kubectl plugin (kubectl runs `kubectl-ublkd` from PATH) that goes from
//! Kubernetes objects to each node's ublkd volumes, with the user's own kubeconfig and RBAC.
//! It reads what each node's plugin writes, the node's `UblkdNode` status object, and never
//! execs into a pod: the chart's read-only ClusterRole `ublkd-viewer` is all it needs.
//!
//! - `pvc NAME`: the claim's PV, node and ublkd volume (state, device, limits, I/O counters).
//! - `nodes`: each node's report: its age, ublkd's version, volume and orphan-device counts,
//!   failing checks, and the capacity the scheduler sees per class (CSIStorageCapacity).
//! - `orphans`: per node, ublkd volumes that no PersistentVolume names any more, and ublk
//!   devices that no volume owns. Nothing is deleted.
//! - `check`: the preflight of every node (ublk_drv with user recovery, reflink roots, NVMe
//!   namespaces, the kubelet directory's propagation) and of the cluster (the CSIDriver, every
//!   ublkd pod's node reporting, the snapshot controller's flag); non-zero naming what is wrong.
//! - `dump DIR`: a support bundle: every pod's logs, each node's report, the orphans, the
//!   driver's PVs, the events.
//!
//! `cluster` reads the API, `check` and `report` decide and format, `output` prints.

#![forbid(unsafe_code)]

mod check;
mod cluster;
mod dump;
mod output;
mod report;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
use cluster::{Cluster, Target};
use output::Output;
use serde_json::json;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

/// Seconds after which a node's report counts as its node plugin not reporting: the plugin
/// rewrites it at least once a minute (`check`'s default, and what `orphans` allows).
const STALE_AFTER: i64 = 120;

#[derive(Debug, Parser)]
#[command(
    name = "kubectl ublkd",
    version,
    about = "ublkd volumes, as Kubernetes names them"
)]
struct Cli {
    /// The namespace ublkd's pods run in.
    #[arg(
        long,
        global = true,
        default_value = "ublkd-system",
        env = "UBLKD_NAMESPACE"
    )]
    ublkd_namespace: String,
    /// The kubeconfig to use (default: KUBECONFIG, then ~/.kube/config).
    #[arg(long, global = true)]
    kubeconfig: Option<PathBuf>,
    /// The kubeconfig context to use (default: its current one).
    #[arg(long, global = true)]
    context: Option<String>,
    /// text for people; json or yaml for programs.
    #[arg(short, long, global = true, value_enum, default_value_t = Output::Text)]
    output: Output,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A claim's node, ublkd volume (state, device, limits) and its I/O counters.
    Pvc {
        /// The PersistentVolumeClaim.
        name: String,
        /// Its namespace (default: the kubeconfig's).
        #[arg(short, long)]
        namespace: Option<String>,
    },
    /// Every node with ublkd: its report, volumes, orphan devices and capacity per class.
    Nodes,
    /// Volumes no PersistentVolume names, and devices no volume owns, per node.
    Orphans {
        /// Seconds between the two looks: a volume counts as without PV only when both found
        /// it so (a claim being provisioned has its volume a moment before its PV). Each look
        /// reads the PVs and every node's report, which its plugin rewrites as soon as its
        /// volumes change; a node whose report is older than `STALE_AFTER` is unreadable.
        #[arg(long, default_value_t = 5)]
        settle: u64,
    },
    /// Preflight: every node's checks and the cluster's; exits 1 naming what is wrong.
    Check {
        /// A node report older than this many seconds counts as a node plugin not reporting.
        #[arg(long, default_value_t = STALE_AFTER)]
        stale_after: i64,
    },
    /// A support bundle in DIR: logs, node reports, orphans, PVs, events.
    Dump {
        /// The directory to write (made if missing).
        dir: PathBuf,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(code) => code,
        Err(e) => {
            eprintln!("kubectl ublkd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<ExitCode> {
    let target = Target {
        kubeconfig: cli.kubeconfig,
        context: cli.context,
    };
    let cluster = Cluster::connect(&target, &cli.ublkd_namespace).await?;
    let out = cli.output;
    match cli.command {
        Command::Pvc { name, namespace } => pvc(&cluster, out, namespace.as_deref(), &name).await,
        Command::Nodes => nodes(&cluster, out).await,
        Command::Orphans { settle } => orphans(&cluster, out, settle).await,
        Command::Check { stale_after } => {
            let found = check::gather(&cluster, stale_after).await?;
            print!("{}", out.render(&json!(found), || check::text(&found)));
            Ok(if found.iter().all(|c| c.ok) {
                ExitCode::SUCCESS
            } else {
                eprintln!("kubectl ublkd: {}", check::failing(&found));
                ExitCode::FAILURE
            })
        }
        Command::Dump { dir } => {
            let written = dump::write(&cluster, &dir).await?;
            for f in &written {
                println!("{f}");
            }
            println!("wrote {} files to {}", written.len(), dir.display());
            Ok(ExitCode::SUCCESS)
        }
    }
}

async fn pvc(
    cluster: &Cluster,
    out: Output,
    namespace: Option<&str>,
    name: &str,
) -> Result<ExitCode> {
    let claim = cluster.claim(namespace, name).await?;
    let ns = claim.metadata.namespace.clone().unwrap_or_default();
    let Some(pv_name) = claim.spec.as_ref().and_then(|s| s.volume_name.clone()) else {
        bail!(
            "the claim {ns}/{name} is not bound yet (phase {})",
            claim
                .status
                .and_then(|s| s.phase)
                .unwrap_or_else(|| "unknown".into())
        );
    };
    let pv = cluster.volume(&pv_name).await?;
    let Some(at) = cluster::location(&pv) else {
        bail!(
            "the PersistentVolume {pv_name} is not the {} driver's",
            cluster::DRIVER
        );
    };
    let Some(node) = at.node.clone() else {
        bail!(
            "the PersistentVolume {pv_name} has no {} in its node affinity",
            cluster::TOPOLOGY_KEY
        );
    };
    let report = cluster.report(&node).await?;
    let Some(volume) = report.status.volumes.iter().find(|v| v.id == at.volume) else {
        bail!(
            "node {node}'s report of {} has no volume {}{}",
            report.status.reported_at,
            at.volume,
            report::partial(&report.status)
        );
    };
    let value = json!({
        "claim": format!("{ns}/{name}"),
        "pv": pv_name,
        "node": node,
        "reportedAt": report.status.reported_at,
        "volume": volume,
    });
    let text = || report::pvc_text(&format!("{ns}/{name}"), &pv_name, &report, volume);
    print!("{}", out.render(&value, text));
    Ok(ExitCode::SUCCESS)
}

async fn nodes(cluster: &Cluster, out: Output) -> Result<ExitCode> {
    let reports = cluster.reports().await?;
    let mut pods: BTreeMap<String, String> = cluster.ublkd_pods().await?;
    if reports.is_empty() && pods.is_empty() {
        bail!(
            "no UblkdNode reports and no ublkd pods in {}",
            cluster.ublkd_namespace()
        );
    }
    let capacity = report::capacity_by_node(&cluster.capacities().await?);
    let mut rows: Vec<report::NodeRow> = reports
        .into_iter()
        .map(|r| report::NodeRow {
            capacity: capacity.get(&r.node).cloned().unwrap_or_default(),
            pod: pods.remove(&r.node),
            node: r.node,
            status: Some(r.status),
        })
        .collect();
    // ublkd pods whose node has no report: their node plugin is not reporting
    rows.extend(pods.into_iter().map(|(node, pod)| report::NodeRow {
        capacity: capacity.get(&node).cloned().unwrap_or_default(),
        node,
        pod: Some(pod),
        status: None,
    }));
    let value = json!(rows.iter().map(report::node_json).collect::<Vec<_>>());
    print!("{}", out.render(&value, || report::nodes_table(&rows)));
    Ok(ExitCode::SUCCESS)
}

/// Each node's volumes that no PersistentVolume names, in one look; and the reports' times.
async fn unnamed(
    cluster: &Cluster,
) -> Result<(BTreeMap<String, Vec<String>>, BTreeMap<String, String>)> {
    let pvs = cluster.locations().await?;
    let mut out = BTreeMap::new();
    let mut times = BTreeMap::new();
    for r in cluster.reports().await? {
        let ids = report::settled_ids(&r.status.volumes);
        out.insert(
            r.node.clone(),
            report::volumes_without_pv(&r.node, &ids, &pvs),
        );
        times.insert(r.node, r.status.reported_at);
    }
    Ok((out, times))
}

async fn orphans(cluster: &Cluster, out: Output, settle: u64) -> Result<ExitCode> {
    let (first, _) = unnamed(cluster).await?;
    tokio::time::sleep(Duration::from_secs(settle)).await;
    let (second, after) = unnamed(cluster).await?;
    // A node plugin rewrites its report when its volumes change and at least once a minute
    // (ublkd-csi's nodestatus::REFRESH): one older than STALE_AFTER is not being written.
    let stale: Vec<String> = after
        .iter()
        .filter(|(_, t)| cluster::age_seconds(t).is_none_or(|a| a > STALE_AFTER))
        .map(|(n, t)| format!("{n}: no report since {t}"))
        .collect();
    let mut rows = Vec::new();
    for (node, volumes) in report::in_both(&first, &second) {
        if stale.iter().any(|s| s.starts_with(&format!("{node}:"))) {
            continue;
        }
        for v in volumes {
            rows.push(report::Orphan {
                node: node.clone(),
                kind: report::OrphanKind::VolumeWithoutPv,
                name: v,
            });
        }
    }
    for r in cluster.reports().await? {
        for d in &r.status.orphan_devices {
            rows.push(report::Orphan {
                node: r.node.clone(),
                kind: report::OrphanKind::DeviceWithoutVolume,
                name: format!("/dev/ublkb{}", d.dev_id),
            });
        }
    }
    let value = json!({"orphans": rows, "unreadable": stale});
    print!("{}", out.render(&value, || report::orphans_text(&rows)));
    if !stale.is_empty() {
        bail!(
            "some nodes did not report within {STALE_AFTER} s:\n{}",
            stale.join("\n")
        );
    }
    Ok(ExitCode::SUCCESS)
}
