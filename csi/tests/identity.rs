//! The Identity service over a real unix socket, with no ublkd behind it.

#![allow(clippy::unwrap_used)]

use std::time::Duration;
use tokio_stream::wrappers::UnixListenerStream;
use ublkd_csi::identity::IdentityService;
use ublkd_csi::spec::identity_client::IdentityClient;
use ublkd_csi::spec::identity_server::IdentityServer;
use ublkd_csi::spec::{GetPluginInfoRequest, ProbeRequest};

#[tokio::test]
async fn names_itself_and_stays_live_while_ublkd_is_away() {
    let dir = tempfile::tempdir().unwrap();
    let csi = dir.path().join("csi.sock");
    let listener = tokio::net::UnixListener::bind(&csi).unwrap();
    let service = IdentityService {
        capabilities: Vec::new(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(IdentityServer::new(service))
            .serve_with_incoming(UnixListenerStream::new(listener)),
    );
    let channel = ublkd_client::connect(&ublkd_client::Connection {
        target: ublkd_client::Target::Unix(csi.clone()),
        tls: Default::default(),
        timeout: Duration::from_secs(5),
    })
    .await
    .unwrap();
    let mut client = IdentityClient::new(channel);
    let info = client
        .get_plugin_info(GetPluginInfoRequest {})
        .await
        .unwrap()
        .into_inner();
    assert_eq!(info.name, "ublkd.io");
    assert_eq!(info.vendor_version, env!("CARGO_PKG_VERSION"));
    // The livenessprobe sidecar turns a failed Probe into a container restart, which cannot
    // bring a ublkd back: while ublkd is away (restarting, rolled), the driver stays live.
    let probe = client.probe(ProbeRequest {}).await.unwrap().into_inner();
    assert_eq!(probe.ready, Some(true));
}
