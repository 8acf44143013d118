//! `kubectl ublkd`: a kubectl plugin (kubectl runs `kubectl-ublkd` from PATH) that goes from
//! Kubernetes objects to each node's ublkd, through the API server with the user's own
//! kubeconfig and RBAC: ublkctl runs in the node's ublkd pod (exec), so no remote-access
//! certificate is needed.
//!
//! - `pvc NAME`: the claim's PV, node and ublkd volume; the volume as ublkd has it (state,
//!   device, QoS) and its I/O counters.
//! - `nodes`: each node's ublkd pod, its volume and orphan-device counts, and the capacity the
//!   scheduler sees per class (CSIStorageCapacity).
//! - `orphans`: per node, ublkd volumes that no PersistentVolume names any more, and ublk
//!   devices that no volume owns. Nothing is deleted.
//!
//! `cluster` reads the API, `exec` runs ublkctl in a pod, `report` formats.

#![forbid(unsafe_code)]

mod cluster;
mod exec;
mod report;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use cluster::Cluster;
use report::NodeRow;
use serde_json::Value;
use std::collections::BTreeMap;
use std::process::ExitCode;

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
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// A claim's node, ublkd volume (state, device, QoS) and its I/O counters.
    Pvc {
        /// The PersistentVolumeClaim.
        name: String,
        /// Its namespace (default: the kubeconfig's).
        #[arg(short, long)]
        namespace: Option<String>,
    },
    /// Every node with ublkd: volumes, orphan devices and capacity per class.
    Nodes,
    /// Volumes no PersistentVolume names, and devices no volume owns, per node.
    Orphans {
        /// Seconds between the two looks: a volume counts as without PV only when both found
        /// it so (a claim being provisioned has its volume a moment before its PV), the rule
        /// ublkd's own report follows.
        #[arg(long, default_value_t = 5)]
        settle: u64,
    },
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kubectl ublkd: {e:#}");
            ExitCode::FAILURE
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let cluster = Cluster::connect(&cli.ublkd_namespace).await?;
    match cli.command {
        Command::Pvc { name, namespace } => pvc(&cluster, namespace.as_deref(), &name).await,
        Command::Nodes => nodes(&cluster).await,
        Command::Orphans { settle } => orphans(&cluster, settle).await,
    }
}

async fn ublkctl(cluster: &Cluster, pod: &str, args: &[&str]) -> Result<String> {
    exec::ublkctl(cluster.client(), cluster.ublkd_namespace(), pod, args).await
}

async fn ublkctl_json(cluster: &Cluster, pod: &str, args: &[&str]) -> Result<Value> {
    let mut all = vec!["-o", "json"];
    all.extend_from_slice(args);
    let text = ublkctl(cluster, pod, &all).await?;
    serde_json::from_str(&text).with_context(|| format!("reading ublkctl {}", args.join(" ")))
}

async fn pvc(cluster: &Cluster, namespace: Option<&str>, name: &str) -> Result<()> {
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
    let pod = cluster.ublkd_pod(&node).await?;
    println!("claim:        {ns}/{name}");
    println!("pv:           {pv_name}");
    println!("node:         {node}");
    println!("ublkd pod:    {}/{pod}", cluster.ublkd_namespace());
    println!("volume:       {}", at.volume);
    println!();
    print!(
        "{}",
        ublkctl(cluster, &pod, &["get-volume", &at.volume]).await?
    );
    println!();
    print!("{}", ublkctl(cluster, &pod, &["stats", &at.volume]).await?);
    Ok(())
}

async fn nodes(cluster: &Cluster) -> Result<()> {
    let pods = cluster.ublkd_pods().await?;
    if pods.is_empty() {
        bail!("no ublkd pods in {}", cluster.ublkd_namespace());
    }
    let capacity = report::capacity_by_node(&cluster.capacities().await?);
    let mut rows = Vec::new();
    for (node, pod) in pods {
        let info = ublkctl_json(cluster, &pod, &["node-info"])
            .await
            .map_err(|e| format!("{e:#}"));
        rows.push(NodeRow {
            capacity: capacity.get(&node).cloned().unwrap_or_default(),
            node,
            pod,
            info,
        });
    }
    print!("{}", report::nodes_table(&rows));
    Ok(())
}

/// Each node's volumes that no PersistentVolume names, looked at once.
async fn unnamed(
    cluster: &Cluster,
    pods: &[(String, String)],
    failed: &mut Vec<String>,
) -> Result<BTreeMap<String, Vec<String>>> {
    let pvs = cluster.locations().await?;
    let mut out = BTreeMap::new();
    for (node, pod) in pods {
        match ublkctl_json(cluster, pod, &["list-volumes"]).await {
            Ok(list) => {
                let ids = report::volume_ids(&list);
                out.insert(node.clone(), report::volumes_without_pv(node, &ids, &pvs));
            }
            Err(e) => failed.push(format!("{node}: {e:#}")),
        }
    }
    Ok(out)
}

async fn orphans(cluster: &Cluster, settle: u64) -> Result<()> {
    let pods: Vec<(String, String)> = cluster.ublkd_pods().await?.into_iter().collect();
    let mut rows = Vec::new();
    let mut failed = Vec::new();
    let first = unnamed(cluster, &pods, &mut failed).await?;
    tokio::time::sleep(std::time::Duration::from_secs(settle)).await;
    let second = unnamed(cluster, &pods, &mut failed).await?;
    for (node, volumes) in report::in_both(&first, &second) {
        for v in volumes {
            rows.push(vec![node.clone(), "volume without PV".into(), v]);
        }
    }
    for (node, pod) in pods {
        // `ublkctl -o json orphans` answers {"orphans": [...]}.
        match ublkctl_json(cluster, &pod, &["orphans"])
            .await
            .map(|v| v["orphans"].clone())
        {
            Ok(Value::Array(devices)) => {
                for d in devices {
                    rows.push(vec![
                        node.clone(),
                        "device without volume".into(),
                        format!("/dev/ublkb{}", d["dev_id"]),
                    ]);
                }
            }
            Ok(other) => failed.push(format!("{node}: unexpected orphans output {other}")),
            Err(e) => failed.push(format!("{node}: {e:#}")),
        }
    }
    if rows.is_empty() {
        println!("no orphans");
    } else {
        print!("{}", report::table(&["NODE", "KIND", "NAME"], &rows));
    }
    if !failed.is_empty() {
        bail!("some nodes could not be read:\n{}", failed.join("\n"));
    }
    Ok(())
}
