//! The node's ublkd, as the driver reaches it: one connection setting, a fresh channel per use
//! (ublkd restarts, for upgrades or after a crash, must never leave the driver holding a dead
//! channel), every call bounded by the same timeout.

use std::time::Duration;
use ublkd_client::{v1, ConnectError, Connection, Target, TlsFiles};

/// Where the node's ublkd listens, and how long a call may take.
#[derive(Debug, Clone)]
pub struct Ublkd {
    conn: Connection,
}

/// The socket the deployment mounts into the driver's pod.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/ublkd/ublkd.sock";

impl Ublkd {
    pub fn new(target: Target, timeout: Duration) -> Self {
        Self {
            conn: Connection {
                target,
                tls: TlsFiles::default(),
                timeout,
            },
        }
    }

    pub fn endpoint(&self) -> String {
        self.conn.target.to_string()
    }

    /// A node-service client on a fresh channel.
    pub async fn node(
        &self,
    ) -> Result<v1::node_service_client::NodeServiceClient<tonic::transport::Channel>, ConnectError>
    {
        let channel = ublkd_client::connect(&self.conn).await?;
        Ok(v1::node_service_client::NodeServiceClient::new(channel))
    }

    /// What ublkd says of this node; Err when it cannot be reached or refuses.
    pub async fn node_info(&self) -> Result<v1::NodeInfo, UblkdError> {
        let mut client = self.node().await?;
        let mut req = tonic::Request::new(v1::GetNodeInfoRequest {});
        req.set_timeout(self.conn.timeout);
        Ok(client.get_node_info(req).await?.into_inner())
    }
}

/// A failed call to ublkd, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum UblkdError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("ublkd refused: {}", .0.message())]
    Call(#[from] tonic::Status),
}
