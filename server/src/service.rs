//! The gRPC services: thin handlers that check and convert a request, hand it to the volume
//! manager, and turn the result into a response (an error becomes a status in `error.rs`).

use crate::config::Settings;
use crate::convert;
use crate::error::VolumeError;
use crate::validate;
use crate::volumes::Volumes;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};
use ublkd_dataplane::{DevId, OpKind};
use ublkd_proto::v1::{
    self, node_service_server::NodeService, volume_service_server::VolumeService,
};

#[derive(Debug, Clone)]
pub struct Api {
    pub volumes: Arc<Volumes>,
    pub settings: Arc<Settings>,
}

/// Requests the client gives less time than this are refused before any work starts: a change
/// that cannot finish within its deadline would otherwise complete unseen.
const MIN_DEADLINE: Duration = Duration::from_millis(5);

/// The time the client allows, from the `grpc-timeout` header (`<digits><H|M|S|m|u|n>`).
fn client_timeout<T>(req: &Request<T>) -> Option<Duration> {
    let v = req.metadata().get("grpc-timeout")?.to_str().ok()?;
    let (digits, unit) = v.split_at(v.len().checked_sub(1)?);
    let n: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(n.saturating_mul(3600)),
        "M" => Duration::from_secs(n.saturating_mul(60)),
        "S" => Duration::from_secs(n),
        "m" => Duration::from_millis(n),
        "u" => Duration::from_micros(n),
        "n" => Duration::from_nanos(n),
        _ => return None,
    })
}

fn check_deadline<T>(req: &Request<T>) -> Result<(), VolumeError> {
    match client_timeout(req) {
        Some(t) if t < MIN_DEADLINE => Err(VolumeError::CheckDeadline(t)),
        _ => Ok(()),
    }
}

/// Runs a state change to completion on its own task, so a client that gives up midway (or a
/// deadline that expires) never leaves a half-made change behind.
async fn to_completion<T: Send + 'static>(
    f: impl Future<Output = Result<T, VolumeError>> + Send + 'static,
) -> Result<T, VolumeError> {
    tokio::spawn(f)
        .await
        .map_err(|e| VolumeError::JoinVolumeTask(e.to_string()))?
}

impl Api {
    /// Runs one RPC, turns its error into a status (the one place: `error.rs`) and logs a
    /// refusal (`rpc_meter` counts every RPC, these and those refused before a handler).
    async fn metered<T>(
        &self,
        method: &'static str,
        f: impl Future<Output = Result<T, VolumeError>>,
    ) -> Result<Response<T>, Status> {
        let result = f.await.map_err(Status::from);
        if let Err(s) = &result {
            tracing::info!(method, code = ?s.code(), message = s.message(), "request refused");
        }
        result.map(Response::new)
    }
}

#[tonic::async_trait]
impl VolumeService for Api {
    async fn create_volume(
        &self,
        req: Request<v1::CreateVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        self.metered("CreateVolume", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let record = validate::spec(id, req.spec.as_ref(), &self.settings)?;
            let place = validate::places_window(req.spec.as_ref());
            let volumes = Arc::clone(&self.volumes);
            let vol = to_completion(async move { volumes.create(record, place).await }).await?;
            tracing::info!(volume = %vol.record.id, device = ?vol.device.as_ref().map(|d| &d.block_device), "volume created");
            for a in &vol.record.adjustments {
                tracing::warn!(volume = %vol.record.id, setting = ?a.setting, requested = a.requested, applied = a.applied, "setting lowered to this node's limit");
            }
            Ok(convert::volume_proto(&vol))
        })
        .await
    }

    async fn delete_volume(
        &self,
        req: Request<v1::DeleteVolumeRequest>,
    ) -> Result<Response<v1::DeleteVolumeResponse>, Status> {
        self.metered("DeleteVolume", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let volumes = Arc::clone(&self.volumes);
            let (del, allow_missing, backing) = (id.clone(), req.allow_missing, req.delete_backing);
            let force = req.force;
            let deleted =
                to_completion(
                    async move { volumes.delete(&del, allow_missing, backing, force).await },
                )
                .await?;
            if deleted {
                tracing::info!(volume = %id, "volume deleted");
            } else {
                tracing::info!(volume = %id, "delete of an absent volume allowed");
            }
            Ok(v1::DeleteVolumeResponse {})
        })
        .await
    }

    async fn get_volume(
        &self,
        req: Request<v1::GetVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        self.metered("GetVolume", async {
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            Ok(convert::volume_proto(&self.volumes.get(&id).await?))
        })
        .await
    }

    async fn list_volumes(
        &self,
        _req: Request<v1::ListVolumesRequest>,
    ) -> Result<Response<v1::ListVolumesResponse>, Status> {
        self.metered("ListVolumes", async {
            let volumes = self
                .volumes
                .list()
                .await
                .iter()
                .map(convert::volume_proto)
                .collect();
            Ok(v1::ListVolumesResponse { volumes })
        })
        .await
    }

    async fn resize_volume(
        &self,
        req: Request<v1::ResizeVolumeRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        self.metered("ResizeVolume", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let volumes = Arc::clone(&self.volumes);
            let size = req.size_bytes;
            let vol = to_completion(async move { volumes.resize(&id, size).await }).await?;
            tracing::info!(volume = %vol.record.id, size, "volume resized");
            Ok(convert::volume_proto(&vol))
        })
        .await
    }

    async fn set_volume_qos(
        &self,
        req: Request<v1::SetVolumeQosRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        self.metered("SetVolumeQos", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let qos = validate::qos(req.qos.as_ref())?;
            let volumes = Arc::clone(&self.volumes);
            let vol = to_completion(async move { volumes.set_qos(&id, qos).await }).await?;
            tracing::info!(volume = %vol.record.id, ?qos, "volume limits set");
            Ok(convert::volume_proto(&vol))
        })
        .await
    }

    async fn create_snapshot(
        &self,
        req: Request<v1::CreateSnapshotRequest>,
    ) -> Result<Response<v1::Snapshot>, Status> {
        self.metered("CreateSnapshot", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::snapshot_id(&req.id)?;
            let source = validate::volume_id(&req.source_volume_id)?;
            let volumes = Arc::clone(&self.volumes);
            let snap =
                to_completion(async move { volumes.create_snapshot(id, source).await }).await?;
            tracing::info!(snapshot = %snap.id, volume = %snap.source, "snapshot created");
            Ok(convert::snapshot_proto(&snap))
        })
        .await
    }

    async fn delete_snapshot(
        &self,
        req: Request<v1::DeleteSnapshotRequest>,
    ) -> Result<Response<v1::DeleteSnapshotResponse>, Status> {
        self.metered("DeleteSnapshot", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::snapshot_id(&req.id)?;
            let volumes = Arc::clone(&self.volumes);
            let allow = req.allow_missing;
            let deleted =
                to_completion(async move { volumes.delete_snapshot(&id, allow).await }).await?;
            if deleted {
                tracing::info!(snapshot = %req.id, "snapshot deleted");
            }
            Ok(v1::DeleteSnapshotResponse {})
        })
        .await
    }

    async fn list_snapshots(
        &self,
        req: Request<v1::ListSnapshotsRequest>,
    ) -> Result<Response<v1::ListSnapshotsResponse>, Status> {
        self.metered("ListSnapshots", async {
            let req = req.into_inner();
            let some = |s: &str| (!s.is_empty()).then(|| s.to_owned());
            let (id, source) = (some(&req.id), some(&req.source_volume_id));
            let snapshots = self
                .volumes
                .list_snapshots(id.as_deref(), source.as_deref())
                .await
                .iter()
                .map(convert::snapshot_proto)
                .collect();
            Ok(v1::ListSnapshotsResponse { snapshots })
        })
        .await
    }

    async fn get_volume_stats(
        &self,
        req: Request<v1::GetVolumeStatsRequest>,
    ) -> Result<Response<v1::VolumeStats>, Status> {
        self.metered("GetVolumeStats", async {
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let s = self.volumes.stats(&id).await?;
            let completed: u64 = s.total.latency_buckets.iter().sum();
            Ok(v1::VolumeStats {
                id: req.id,
                ops: OpKind::ALL
                    .iter()
                    .map(|&op| {
                        let lat = s.total.latency_of(op);
                        v1::OpStats {
                            op: op.name().into(),
                            count: s.total.ops_of(op),
                            bytes: s.total.bytes_of(op),
                            latency_p50_seconds: lat.quantile(0.5).unwrap_or(0.0),
                            latency_p99_seconds: lat.quantile(0.99).unwrap_or(0.0),
                        }
                    })
                    .collect(),
                errors: s.total.errors,
                inflight: s.total.inflight,
                memory_bytes: s.memory_bytes,
                latency_mean_seconds: if completed == 0 {
                    0.0
                } else {
                    s.total.latency_sum_ns as f64 / 1e9 / completed as f64
                },
                throttled_requests: s.total.throttled,
                throttled_seconds: s.total.throttled_ns as f64 / 1e9,
                protocol_errors: s.total.protocol_errors,
                last_protocol_errno: u32::try_from(s.total.last_protocol_errno).unwrap_or(u32::MAX),
            })
        })
        .await
    }
}

#[tonic::async_trait]
impl NodeService for Api {
    async fn get_node_info(
        &self,
        _req: Request<v1::GetNodeInfoRequest>,
    ) -> Result<Response<v1::NodeInfo>, Status> {
        self.metered("GetNodeInfo", async {
            let v = &self.volumes;
            Ok(convert::node_info(convert::NodeFacts {
                features: v.features(),
                worker_cpus: v.workers().await.iter().map(|w| w.cpu).collect(),
                volumes: v.list().await.len(),
                orphans: v.orphans().await,
                without_pv: v.without_pv().await,
                dataplane_error: v.dataplane_error().map(str::to_owned),
            }))
        })
        .await
    }

    async fn adopt_device(
        &self,
        req: Request<v1::AdoptDeviceRequest>,
    ) -> Result<Response<v1::Volume>, Status> {
        self.metered("AdoptDevice", async {
            check_deadline(&req)?;
            let req = req.into_inner();
            let id = validate::volume_id(&req.id)?;
            let Some(mut spec) = req.spec else {
                return Err(VolumeError::ValidateRequest(
                    "spec with a backend is required".into(),
                ));
            };
            let dev_id = DevId(req.dev_id);
            let orphan = self
                .volumes
                .orphans()
                .await
                .into_iter()
                .find(|d| d.dev_id == dev_id)
                .ok_or(VolumeError::LookupOrphan(dev_id))?;
            // What the caller leaves out is the device's own.
            if spec.size_bytes == 0 {
                spec.size_bytes = orphan.size_bytes;
            }
            spec.queues = spec.queues.or(Some(u32::from(orphan.queues)));
            spec.queue_depth = spec.queue_depth.or(Some(u32::from(orphan.queue_depth)));
            let record = validate::spec(id, Some(&spec), &self.settings)?;
            let volumes = Arc::clone(&self.volumes);
            let vol = to_completion(async move { volumes.adopt(dev_id, record).await }).await?;
            tracing::info!(volume = %vol.record.id, %dev_id, "orphan device adopted");
            Ok(convert::volume_proto(&vol))
        })
        .await
    }

    async fn get_capacity(
        &self,
        req: Request<v1::GetCapacityRequest>,
    ) -> Result<Response<v1::Capacity>, Status> {
        self.metered("GetCapacity", async {
            let req = req.into_inner();
            let volumes = self.volumes.list().await;
            let settings = Arc::clone(&self.settings);
            let serving = self.volumes.dataplane_error().is_none();
            // statfs, FIEMAP and Identify block: never on the runtime's two threads.
            tokio::task::spawn_blocking(move || {
                crate::capacity::capacity(&req, &volumes, &settings, serving)
            })
            .await
            .map_err(|e| VolumeError::JoinVolumeTask(e.to_string()))?
        })
        .await
    }

    async fn delete_orphan(
        &self,
        req: Request<v1::DeleteOrphanRequest>,
    ) -> Result<Response<v1::DeleteOrphanResponse>, Status> {
        self.metered("DeleteOrphan", async {
            check_deadline(&req)?;
            let dev_id = DevId(req.into_inner().dev_id);
            let volumes = Arc::clone(&self.volumes);
            to_completion(async move { volumes.delete_orphan(dev_id).await }).await?;
            tracing::info!(%dev_id, "orphan device deleted");
            Ok(v1::DeleteOrphanResponse {})
        })
        .await
    }

    async fn report_volumes_without_pv(
        &self,
        req: Request<v1::ReportVolumesWithoutPvRequest>,
    ) -> Result<Response<v1::ReportVolumesWithoutPvResponse>, Status> {
        self.metered("ReportVolumesWithoutPv", async {
            check_deadline(&req)?;
            let ids = req
                .into_inner()
                .volume_ids
                .iter()
                .map(|id| validate::volume_id(id))
                .collect::<Result<Vec<_>, _>>()?;
            for id in self.volumes.report_without_pv(ids).await {
                tracing::warn!(volume = %id, "no PersistentVolume names this volume any more (its node was deleted from the cluster, or it was made by hand); it stays until deleted: ublkctl orphans");
            }
            Ok(v1::ReportVolumesWithoutPvResponse {})
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_grpc_timeouts_and_refuses_tiny_ones() {
        let mut r = Request::new(());
        assert_eq!(client_timeout(&r), None);
        assert!(check_deadline(&r).is_ok());
        for (v, d) in [
            ("1n", Duration::from_nanos(1)),
            ("250m", Duration::from_millis(250)),
            ("3S", Duration::from_secs(3)),
            ("2M", Duration::from_secs(120)),
        ] {
            r.metadata_mut().insert("grpc-timeout", v.parse().unwrap());
            assert_eq!(client_timeout(&r), Some(d), "{v}");
        }
        r.metadata_mut()
            .insert("grpc-timeout", "1n".parse().unwrap());
        assert_eq!(
            check_deadline(&r).unwrap_err().code(),
            tonic::Code::DeadlineExceeded
        );
    }
}
