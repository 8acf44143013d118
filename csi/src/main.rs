//! `ublkd-csi`: serves CSI on a unix socket (the kubelet's plugin directory) for this node, and
//! reaches the node's ublkd on its own socket.

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::time::Duration;
use ublkd_client::Target;
use ublkd_csi::identity::IdentityService;
use ublkd_csi::spec::identity_server::IdentityServer;
use ublkd_csi::ublkd::{Ublkd, DEFAULT_ENDPOINT};

#[derive(Debug, Parser)]
#[command(
    name = "ublkd-csi",
    version,
    about = "Kubernetes CSI driver for ublkd volumes"
)]
struct Args {
    /// The CSI socket to serve (`unix:///csi/csi.sock` as the sidecars expect).
    #[arg(long, env = "CSI_ENDPOINT", default_value = "unix:///csi/csi.sock")]
    csi_endpoint: String,
    /// The node's ublkd.
    #[arg(long, env = "UBLKD_ENDPOINT", default_value = DEFAULT_ENDPOINT)]
    ublkd: Target,
    /// This node's name (the topology value), from the downward API.
    #[arg(long, env = "NODE_NAME")]
    node_id: String,
    /// Seconds one call to ublkd may take.
    #[arg(long, default_value_t = 30)]
    ublkd_timeout: u64,
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

#[tokio::main]
async fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let args = Args::parse();
    let path = socket_path(&args.csi_endpoint)?;
    // A socket left by a previous run (the kubelet's directory outlives the pod).
    match std::fs::remove_file(&path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("removing stale {}", path.display())),
    }
    let listener = tokio::net::UnixListener::bind(&path)
        .with_context(|| format!("binding {}", path.display()))?;
    let ublkd = Ublkd::new(args.ublkd, Duration::from_secs(args.ublkd_timeout));
    tracing::info!(socket = %path.display(), ublkd = %ublkd.endpoint(), node = %args.node_id, "serving CSI");
    let identity = IdentityService {
        ublkd,
        capabilities: Vec::new(),
    };
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    tonic::transport::Server::builder()
        .add_service(IdentityServer::new(identity))
        .serve_with_incoming_shutdown(incoming, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await
        .context("serving CSI")?;
    let _ = std::fs::remove_file(&path);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

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
