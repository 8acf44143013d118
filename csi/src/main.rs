//! `ublkd-csi`: serves CSI on a unix socket (the kubelet's plugin directory) for this node, and
//! reaches the node's ublkd on its own socket; the central instance beside the csi-resizer
//! reaches every node's ublkd remotely for ControllerModifyVolume.
#![forbid(unsafe_code)]

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use ublkd_client::{Target, TlsFiles};
use ublkd_csi::controller::ControllerService;
use ublkd_csi::identity::IdentityService;
use ublkd_csi::modify::{Remote, Route};
use ublkd_csi::node::NodeService;
use ublkd_csi::spec::controller_server::ControllerServer;
use ublkd_csi::spec::identity_server::IdentityServer;
use ublkd_csi::spec::node_server::NodeServer;
use ublkd_csi::spec::{plugin_capability, PluginCapability};
use ublkd_csi::ublkd::{Ublkd, DEFAULT_ENDPOINT};
use ublkd_csi::Node;

#[derive(Debug, Parser)]
#[command(
    name = "ublkd-csi",
    version,
    about = "Kubernetes CSI driver for ublkd volumes",
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    command: Option<Sub>,
    /// The CSI socket to serve (`unix:///csi/csi.sock` as the sidecars expect).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    csi_endpoint: String,
    /// The node's ublkd.
    #[arg(long, env = "UBLKD_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    ublkd: Target,
    /// This node's name (the topology value), from the downward API.
    #[arg(long, env = "NODE_NAME")]
    node_id: Option<String>,
    /// Serve only what the central csi-resizer asks (Identity, Controller capabilities, and
    /// ControllerModifyVolume: recorded on the volume's PersistentVolume for its node, or
    /// through --remote-ublkd); no local ublkd is needed. Volumes grow
    /// on their node (NodeExpandVolume).
    #[arg(long)]
    resizer_only: bool,
    /// Every node's ublkd, for ControllerModifyVolume: https://NAME:PORT where NAME resolves to
    /// each node's ublkd (the remote-access component's headless Service,
    /// https://ublkd-grpc.ublkd-system.svc:7443). Each address is dialled with mutual TLS and
    /// its certificate checked against NAME. Without it, the --resizer-only instance records
    /// the limits on the volume's PersistentVolume (--apply-limits-every on the nodes); a
    /// node's instance changes its own volumes.
    #[arg(
        long,
        env = "UBLKD_REMOTE",
        requires_all = ["remote_tls_ca", "remote_tls_cert", "remote_tls_key"]
    )]
    remote_ublkd: Option<String>,
    /// The CA that signed the nodes' ublkd server certificate.
    #[arg(long, env = "UBLKD_REMOTE_TLS_CA")]
    remote_tls_ca: Option<PathBuf>,
    /// This driver's client certificate (clientAuth), from the CA ublkd admits
    /// (grpc.tls.client_ca)...
    #[arg(long, env = "UBLKD_REMOTE_TLS_CERT")]
    remote_tls_cert: Option<PathBuf>,
    /// ...and its key.
    #[arg(long, env = "UBLKD_REMOTE_TLS_KEY")]
    remote_tls_key: Option<PathBuf>,
    /// Seconds one call to ublkd may take.
    #[arg(long, default_value_t = 30)]
    ublkd_timeout: u64,
    /// Seconds between two reports to ublkd of the node's volumes that no PersistentVolume
    /// names (ublkd_csi::pvreport; needs the API server: in a pod, its service account); 0:
    /// none.
    #[arg(long, default_value_t = 0)]
    report_without_pv_every: u64,
    /// Seconds between two looks at ublkd for the Events of its faults (ublkd_csi::faults: on
    /// a volume's claim and its pods, and on the Node; needs the API server: in a pod, its
    /// service account; the chart's csiNode.faultEventsEvery, 10); 0: none.
    #[arg(long, default_value_t = 0)]
    fault_events_every: u64,
    /// Seconds between two looks for the limits the central driver recorded on this node's
    /// PersistentVolumes (ublkd_csi::pvlimits: a VolumeAttributesClass changed; needs the API
    /// server); 0: none.
    #[arg(long, default_value_t = 0)]
    apply_limits_every: u64,
    /// Seconds between two writes of this node's `UblkdNode` object (ublkd_csi::nodestatus:
    /// pools, volumes, orphans, checks, for `kubectl get` and `kubectl ublkd`; needs the API
    /// server); 0: none.
    #[arg(long, default_value_t = 0)]
    report_status_every: u64,
    /// Seconds a volume may stay RECOVERING before a VolumeRecoveringTooLong Event.
    #[arg(long, default_value_t = 60)]
    recovering_too_long: u64,
    /// Staging and target paths must lie under this directory.
    #[arg(long, env = "KUBELET_DIR", default_value = "/var/lib/kubelet")]
    kubelet_dir: PathBuf,
}

/// What the plugin serves, as Identity advertises it.
fn plugin_capabilities() -> Vec<PluginCapability> {
    use plugin_capability::service::Type as S;
    use plugin_capability::volume_expansion::Type as E;
    let service = |t: S| PluginCapability {
        r#type: Some(plugin_capability::Type::Service(
            plugin_capability::Service { r#type: t as i32 },
        )),
    };
    vec![
        service(S::ControllerService),
        service(S::VolumeAccessibilityConstraints),
        PluginCapability {
            r#type: Some(plugin_capability::Type::VolumeExpansion(
                plugin_capability::VolumeExpansion {
                    r#type: E::Online as i32,
                },
            )),
        },
    ]
}

#[derive(Debug, clap::Subcommand)]
enum Sub {
    /// Make the driver's CSI calls from a shell, as the provisioner and the kubelet would
    Ctl(ublkd_csi::ctl::Ctl),
    /// The central node-loss controller and its uninstall step (ublkd_csi::nodeloss)
    #[command(subcommand)]
    NodeLoss(NodeLoss),
}

/// A `--lost-after`: a duration, at least a second (0 would release a deleted node's volumes the
/// moment its Lease expired, with no time NotReady at all).
fn parse_lost_after(text: &str) -> Result<Duration, String> {
    match ublkd_csi::nodeloss::verdict::parse_lost_after(text) {
        Ok(d) if d >= Duration::from_secs(1) => Ok(d),
        Ok(_) => Err("at least 1s (0 would release a node the moment its Lease expired)".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// A `--recheck`: a duration as `--lost-after` reads it, at least a second (0 would look again
/// at once, forever).
fn parse_recheck(text: &str) -> Result<Duration, String> {
    match ublkd_csi::nodeloss::verdict::parse_lost_after(text) {
        Ok(d) if d >= Duration::from_secs(1) => Ok(d),
        Ok(_) => Err("at least 1s".to_owned()),
        Err(e) => Err(e.to_string()),
    }
}

#[derive(Debug, clap::Subcommand)]
enum NodeLoss {
    /// Put the finalizer ublkd.io/node on every Node of the driver and, when one is deleted
    /// and lost, release its claims and PersistentVolumes so that their workloads move
    /// elsewhere
    Watch {
        /// How long a deleted Node must have been NotReady, its Lease expired, before it is
        /// lost (300, 300s, 5m, 1h). A Node annotated ublkd.io/node-lost=true is lost at once.
        #[arg(long, default_value = "5m", value_parser = parse_lost_after)]
        lost_after: Duration,
        /// How often a deleted Node that is not lost yet is looked at again (30, 30s, 1m).
        #[arg(long, default_value = "30s", value_parser = parse_recheck)]
        recheck: Duration,
    },
    /// Stop the controller (delete its Deployment) and take the finalizer off every Node:
    /// the chart's pre-delete hook
    Uninstall {
        /// The controller's namespace.
        #[arg(long, env = "POD_NAMESPACE")]
        namespace: String,
        /// The controller's Deployment (and the app.kubernetes.io/name of its pods).
        #[arg(long, default_value = "ublkd-csi-controller")]
        deployment: String,
    },
}

/// The socket path of a `unix://` endpoint (the only kind CSI uses).
fn socket_path(endpoint: &str) -> Result<PathBuf> {
    let path = endpoint
        .strip_prefix("unix://")
        .or_else(|| endpoint.strip_prefix("unix:"))
        .filter(|p| p.starts_with('/'))
        .with_context(|| format!("CSI endpoint {endpoint:?} must be unix:///ABSOLUTE/PATH"))?;
    Ok(PathBuf::from(path))
}

/// Resolves on the first SIGTERM or SIGINT, naming it (both registered before it is polled).
fn termination() -> std::io::Result<impl std::future::Future<Output = &'static str>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate())?;
    let mut int = signal(SignalKind::interrupt())?;
    Ok(async move {
        tokio::select! {
            _ = term.recv() => "SIGTERM",
            _ = int.recv() => "SIGINT",
        }
    })
}

#[tokio::main]
async fn main() -> Result<()> {
    // Logs on stderr (stdout is `ctl`'s answer), colored only for a person at a terminal.
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    match args.command {
        Some(Sub::Ctl(ctl)) => {
            let out = ublkd_csi::ctl::run(ctl).await?;
            if !out.is_empty() {
                println!("{out}");
            }
            return Ok(());
        }
        Some(Sub::NodeLoss(NodeLoss::Watch {
            lost_after,
            recheck,
        })) => return Ok(ublkd_csi::nodeloss::watch(lost_after, recheck).await?),
        Some(Sub::NodeLoss(NodeLoss::Uninstall {
            namespace,
            deployment,
        })) => {
            let n = ublkd_csi::nodeloss::uninstall(&namespace, &deployment).await?;
            println!(
                "finalizer {} removed from {n} nodes",
                ublkd_csi::nodeloss::FINALIZER
            );
            return Ok(());
        }
        None => {}
    }
    if args.node_id.is_none() && !args.resizer_only {
        anyhow::bail!("--node-id (or NODE_NAME) is required to serve a node");
    }
    let path = socket_path(&args.csi_endpoint)?;
    // A socket left by a previous run (the kubelet's directory outlives the pod).
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing stale {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(&path)
        .with_context(|| format!("binding {}", path.display()))?;
    let timeout = Duration::from_secs(args.ublkd_timeout);
    let ublkd = Ublkd::new(args.ublkd, timeout);
    let route = match args.remote_ublkd {
        Some(uri) => {
            let tls = TlsFiles {
                ca: args.remote_tls_ca,
                cert: args.remote_tls_cert,
                key: args.remote_tls_key,
                domain: None,
            };
            Route::Remote(Remote::new(&uri, tls, timeout).map_err(anyhow::Error::msg)?)
        }
        None if args.resizer_only => Route::Record(
            kube::Client::try_default()
                .await
                .context("connecting to the API server (ControllerModifyVolume records limits on PersistentVolumes)")?,
        ),
        None => Route::Local,
    };
    let modify = match &route {
        Route::Local => "this node's ublkd".to_owned(),
        Route::Remote(r) => format!("every node's ublkd at {}", r.endpoint()),
        Route::Record(_) => "recorded on the PersistentVolume for its node".to_owned(),
    };
    tracing::info!(socket = %path.display(), ublkd = %ublkd.endpoint(), node = ?args.node_id, resizer_only = args.resizer_only, modify_volume = %modify, "serving CSI");
    let node = Node(args.node_id.unwrap_or_default());
    let identity = IdentityService {
        capabilities: plugin_capabilities(),
    };
    let controller = ControllerService {
        ublkd: ublkd.clone(),
        node: node.clone(),
        route,
    };
    // The loops that read the API server share one client and one watch of what they read.
    let api_loops = [
        args.report_without_pv_every,
        args.apply_limits_every,
        args.report_status_every,
    ];
    let api = if api_loops.iter().any(|&every| every > 0) && !args.resizer_only {
        match kube::Client::try_default().await {
            Ok(client) => {
                let watched = ublkd_csi::watch::start(&client);
                Some((client, watched))
            }
            Err(e) => {
                tracing::error!(error = %e, "no API server: no reports of volumes without a PersistentVolume, no limits from VolumeAttributesClasses, no UblkdNode status");
                None
            }
        }
    } else {
        None
    };
    if let Some((client, watched)) = &api {
        let secs = Duration::from_secs;
        if args.report_without_pv_every > 0 {
            let every = secs(args.report_without_pv_every);
            let pvs = watched.volumes.clone();
            tokio::spawn(ublkd_csi::pvreport::run(
                ublkd.clone(),
                node.clone(),
                every,
                pvs,
            ));
        }
        if args.apply_limits_every > 0 {
            let every = secs(args.apply_limits_every);
            let (client, pvs) = (client.clone(), watched.volumes.clone());
            let run = ublkd_csi::pvlimits::run(ublkd.clone(), node.clone(), every, client, pvs);
            tokio::spawn(run);
        }
        if args.report_status_every > 0 {
            let every = secs(args.report_status_every);
            let (dir, client) = (args.kubelet_dir.clone(), client.clone());
            let classes = watched.classes.clone();
            let run = ublkd_csi::nodestatus::run(
                ublkd.clone(),
                node.clone(),
                dir,
                every,
                client,
                classes,
            );
            tokio::spawn(run);
        }
    }
    let mut refusals = None;
    if args.fault_events_every > 0 && !args.resizer_only {
        let every = Duration::from_secs(args.fault_events_every);
        let bound = Duration::from_secs(args.recovering_too_long);
        let (ublkd, node) = (ublkd.clone(), node.clone());
        let (tx, rx) = ublkd_csi::faults::Refusals::channel();
        refusals = Some(tx);
        tokio::spawn(async move {
            if let Err(e) = ublkd_csi::faults::run(ublkd, node, every, bound, rx).await {
                tracing::error!(error = %e, "no fault events: faults are in the logs and metrics only");
            }
        });
    }
    let node = NodeService {
        ublkd,
        node,
        kubelet_dir: args.kubelet_dir,
        busy: Default::default(),
        refusals,
    };
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let mut builder = tonic::transport::Server::builder();
    let router = builder
        .add_service(IdentityServer::new(identity))
        .add_service(ControllerServer::new(controller));
    let router = if args.resizer_only {
        router.add_service(NodeServer::new(ublkd_csi::resizer::ResizerNode))
    } else {
        router.add_service(NodeServer::new(node))
    };
    // Kubernetes stops a container with SIGTERM. The driver runs as its container's PID 1,
    // which the kernel spares every signal it has no handler for: with SIGINT's alone, each
    // controller and node pod sat out its whole grace period (30 s) and was SIGKILLed, cut
    // calls and all, on every drain, roll and uninstall.
    let stop = termination().context("registering SIGTERM and SIGINT")?;
    router
        .serve_with_incoming_shutdown(incoming, async {
            let signal = stop.await;
            tracing::info!(%signal, "stopping: no new calls, those in flight finish");
        })
        .await
        .context("serving CSI")?;
    match std::fs::remove_file(&path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            // The next start removes a stale socket before it binds: nothing is lost.
            tracing::warn!(socket = %path.display(), error = %e, "the CSI socket could not be removed at exit");
        }
        _ => {}
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `--lost-after 0` would release a deleted node's volumes the moment its Lease expired
    /// (review L1, issue 55): refused, as the chart's schema refuses it.
    #[test]
    fn lost_after_is_at_least_a_second() {
        for zero in ["0", "0s", "0m", "00h"] {
            assert!(parse_lost_after(zero).is_err(), "{zero}");
        }
        assert_eq!(parse_lost_after("5m"), Ok(Duration::from_secs(300)));
        assert_eq!(parse_lost_after("1"), Ok(Duration::from_secs(1)));
    }

    #[test]
    fn csi_endpoints_are_unix_sockets() {
        assert_eq!(
            socket_path("unix:///csi/csi.sock").ok(),
            Some(PathBuf::from("/csi/csi.sock"))
        );
        assert_eq!(
            socket_path("unix:/csi/csi.sock").ok(),
            Some(PathBuf::from("/csi/csi.sock"))
        );
        assert!(socket_path("tcp://0.0.0.0:1").is_err());
        assert!(socket_path("unix://relative").is_err());
    }
}
