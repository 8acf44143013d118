//! A ublkd as the driver reaches it (the node's own; for ControllerModifyVolume, any node's
//! over TLS): one connection setting, a fresh channel per use (ublkd restarts, for upgrades or
//! after a crash, must never leave the driver holding a dead channel), every call bounded by
//! the same timeout. The driver keeps no volume state: each answer comes from ublkd's
//! registry.

use std::time::Duration;
use tonic::transport::Channel;
use ublkd_client::{v1, ConnectError, Connection, Target, TlsFiles};
use v1::node_service_client::NodeServiceClient;
use v1::volume_service_client::VolumeServiceClient;

/// Where the node's ublkd listens, and how long a call may take.
#[derive(Debug, Clone)]
pub struct Ublkd {
    conn: Connection,
}

/// The socket the deployment mounts into the driver's pod.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/ublkd/ublkd.sock";

/// A failed call to ublkd, named for the step that failed.
#[derive(Debug, thiserror::Error)]
pub enum UblkdError {
    #[error(transparent)]
    Connect(#[from] ConnectError),
    #[error("ublkd: {}", .0.message())]
    Call(#[from] tonic::Status),
}

/// Whether `id` could name a ublkd volume (a DNS label).
pub use ublkd_proto::is_volume_id;

impl Ublkd {
    pub fn new(target: Target, timeout: Duration) -> Self {
        Self::with_tls(target, TlsFiles::default(), timeout)
    }

    /// A ublkd reached over TCP with (mutual) TLS, as the central driver reaches each node's
    /// (`modify`).
    pub fn with_tls(target: Target, tls: TlsFiles, timeout: Duration) -> Self {
        Self {
            conn: Connection {
                target,
                tls,
                timeout,
            },
        }
    }

    pub fn endpoint(&self) -> String {
        self.conn.target.to_string()
    }

    fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut req = tonic::Request::new(msg);
        req.set_timeout(self.conn.timeout);
        req
    }

    async fn node(&self) -> Result<NodeServiceClient<Channel>, UblkdError> {
        Ok(NodeServiceClient::new(
            ublkd_client::connect(&self.conn).await?,
        ))
    }

    async fn volumes(&self) -> Result<VolumeServiceClient<Channel>, UblkdError> {
        Ok(VolumeServiceClient::new(
            ublkd_client::connect(&self.conn).await?,
        ))
    }

    /// What ublkd says of this node.
    pub async fn node_info(&self) -> Result<v1::NodeInfo, UblkdError> {
        let req = self.request(v1::GetNodeInfoRequest {});
        Ok(self.node().await?.get_node_info(req).await?.into_inner())
    }

    /// Tells ublkd which of its volumes no PersistentVolume names (replacing the last report).
    pub async fn report_without_pv(&self, ids: Vec<String>) -> Result<(), UblkdError> {
        let req = self.request(v1::ReportVolumesWithoutPvRequest { volume_ids: ids });
        self.node().await?.report_volumes_without_pv(req).await?;
        Ok(())
    }

    pub async fn capacity(
        &self,
        backend: v1::get_capacity_request::Backend,
    ) -> Result<v1::Capacity, UblkdError> {
        let req = self.request(v1::GetCapacityRequest {
            backend: Some(backend),
        });
        Ok(self.node().await?.get_capacity(req).await?.into_inner())
    }

    /// Volume `id`, or None when ublkd has no such volume (an id ublkd could never have made,
    /// not being a DNS label, included).
    pub async fn get(&self, id: &str) -> Result<Option<v1::Volume>, UblkdError> {
        if !is_volume_id(id) {
            return Ok(None);
        }
        let req = self.request(v1::GetVolumeRequest { id: id.into() });
        match self.volumes().await?.get_volume(req).await {
            Ok(v) => Ok(Some(v.into_inner())),
            Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
            Err(s) => Err(s.into()),
        }
    }

    pub async fn list(&self) -> Result<Vec<v1::Volume>, UblkdError> {
        let req = self.request(v1::ListVolumesRequest {});
        Ok(self
            .volumes()
            .await?
            .list_volumes(req)
            .await?
            .into_inner()
            .volumes)
    }

    /// Volume `id`'s I/O counters (a volume with a device: READY).
    pub async fn stats(&self, id: &str) -> Result<v1::VolumeStats, UblkdError> {
        let req = self.request(v1::GetVolumeStatsRequest { id: id.into() });
        Ok(self
            .volumes()
            .await?
            .get_volume_stats(req)
            .await?
            .into_inner())
    }

    pub async fn create(&self, id: &str, spec: v1::VolumeSpec) -> Result<v1::Volume, UblkdError> {
        let req = self.request(v1::CreateVolumeRequest {
            id: id.into(),
            spec: Some(spec),
        });
        Ok(self.volumes().await?.create_volume(req).await?.into_inner())
    }

    /// Deletes volume `id` and a file volume's backing file; an absent volume is no error.
    /// Deletes volume `id` (a missing one is done), with its backing file when
    /// `delete_backing`.
    pub async fn delete(&self, id: &str, delete_backing: bool) -> Result<(), UblkdError> {
        if !is_volume_id(id) {
            return Ok(());
        }
        let req = self.request(v1::DeleteVolumeRequest {
            id: id.into(),
            allow_missing: true,
            delete_backing,
            force: false,
        });
        self.volumes().await?.delete_volume(req).await?;
        Ok(())
    }

    /// Replaces volume `id`'s limits (all of them: merging is the caller's).
    pub async fn set_qos(&self, id: &str, qos: v1::QosLimits) -> Result<v1::Volume, UblkdError> {
        let req = self.request(v1::SetVolumeQosRequest {
            id: id.into(),
            qos: Some(qos),
        });
        Ok(self
            .volumes()
            .await?
            .set_volume_qos(req)
            .await?
            .into_inner())
    }

    /// Takes snapshot `id` of volume `source` (idempotent by id).
    pub async fn create_snapshot(
        &self,
        id: &str,
        source: &str,
    ) -> Result<v1::Snapshot, UblkdError> {
        let req = self.request(v1::CreateSnapshotRequest {
            id: id.into(),
            source_volume_id: source.into(),
        });
        Ok(self
            .volumes()
            .await?
            .create_snapshot(req)
            .await?
            .into_inner())
    }

    /// Deletes snapshot `id`; an absent one (or an id ublkd could never have made) is no error.
    pub async fn delete_snapshot(&self, id: &str) -> Result<(), UblkdError> {
        if !is_volume_id(id) {
            return Ok(());
        }
        let req = self.request(v1::DeleteSnapshotRequest {
            id: id.into(),
            allow_missing: true,
        });
        self.volumes().await?.delete_snapshot(req).await?;
        Ok(())
    }

    /// The snapshots, filtered by id and by source volume (empty: any).
    pub async fn list_snapshots(
        &self,
        id: &str,
        source: &str,
    ) -> Result<Vec<v1::Snapshot>, UblkdError> {
        let req = self.request(v1::ListSnapshotsRequest {
            id: id.into(),
            source_volume_id: source.into(),
        });
        Ok(self
            .volumes()
            .await?
            .list_snapshots(req)
            .await?
            .into_inner()
            .snapshots)
    }

    /// Snapshot `id`, or None (an id ublkd could never have made included).
    pub async fn snapshot(&self, id: &str) -> Result<Option<v1::Snapshot>, UblkdError> {
        if !is_volume_id(id) {
            return Ok(None);
        }
        Ok(self
            .list_snapshots(id, "")
            .await?
            .into_iter()
            .find(|s| s.id == id))
    }

    pub async fn resize(&self, id: &str, size_bytes: u64) -> Result<v1::Volume, UblkdError> {
        let req = self.request(v1::ResizeVolumeRequest {
            id: id.into(),
            size_bytes,
        });
        Ok(self.volumes().await?.resize_volume(req).await?.into_inner())
    }
}
