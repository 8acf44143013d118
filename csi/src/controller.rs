//! The CSI Controller service, run on every node (external-provisioner and csi-snapshotter
//! `--node-deployment`): it creates and deletes this node's volumes and snapshots in this
//! node's ublkd, clones and restores them there, and tells the scheduler what this node can
//! still provide. The central instance beside the csi-resizer changes volumes' I/O limits on
//! whichever node holds them (`modify`).

use crate::caps;
use crate::error::CsiError;
use crate::modify::{self, Route};
use crate::naming::volume_id_for;
use crate::page::page;
use crate::params::{Backend, Encryption, Params, ENCRYPTION};
use crate::qos::{self, QosChange};
use crate::size::{at_least, size_for, Floor};
use crate::snapshot::{self, content_source, source_of};
use crate::spec::{self, controller_server::Controller};
use crate::ublkd::Ublkd;
use crate::{Node, TOPOLOGY_KEY};
use std::collections::HashMap;
use tonic::{Request, Response, Status};
use ublkd_client::v1::{self, volume_spec::Source};

/// Whether a retried CreateVolume may answer with the volume a first try made: only once it
/// is READY. A CREATING volume's first create may still fail, and an OK now would leave a PV
/// naming a volume that never existed: ABORTED (operation pending) makes the provisioner try
/// again. DELETING is pending too; FAILED and RECOVERING say what the volume is.
fn answerable(existing: &v1::Volume) -> Result<(), CsiError> {
    match existing.state() {
        v1::VolumeState::Ready => Ok(()),
        v1::VolumeState::Creating | v1::VolumeState::Deleting => {
            Err(CsiError::OperationPending(existing.id.clone()))
        }
        v1::VolumeState::Failed => Err(CsiError::VolumeFailed {
            id: existing.id.clone(),
            message: existing.message.clone(),
        }),
        other @ (v1::VolumeState::Recovering | v1::VolumeState::Unspecified) => {
            Err(CsiError::VolumeNotReady {
                id: existing.id.clone(),
                state: crate::naming::state_name(other),
            })
        }
    }
}

#[derive(Debug, Clone)]
pub struct ControllerService {
    pub ublkd: Ublkd,
    pub node: Node,
    /// Where ControllerModifyVolume finds a volume's ublkd.
    pub route: Route,
}

impl ControllerService {
    fn topology(&self) -> spec::Topology {
        spec::Topology {
            segments: HashMap::from([(TOPOLOGY_KEY.to_owned(), self.node.0.clone())]),
        }
    }

    fn is_this_node(&self, t: &spec::Topology) -> bool {
        t.segments.get(TOPOLOGY_KEY) == Some(&self.node.0)
    }

    async fn create(&self, req: spec::CreateVolumeRequest) -> Result<spec::Volume, CsiError> {
        if req.name.is_empty() {
            return Err(CsiError::MissingField("name"));
        }
        let params = Params::parse(&req.parameters)?;
        // A VolumeAttributesClass's limits win over the StorageClass's.
        let limits = QosChange::from_mutable(&req.mutable_parameters)?.apply(&params.qos);
        caps::check_all(&req.volume_capabilities, params.fs_type)?;
        let source = source_of(req.volume_content_source.as_ref())?;
        if source.is_some() && !matches!(params.backend, Backend::File { .. }) {
            return Err(CsiError::SourceUnsupported(
                "a restore or a clone needs a StorageClass with backend: file (a reflink of the \
                 source's backing file)"
                    .into(),
            ));
        }
        if let Some(reqs) = &req.accessibility_requirements {
            if !reqs.requisite.is_empty() && !reqs.requisite.iter().any(|t| self.is_this_node(t)) {
                return Err(CsiError::TopologyExcludesNode {
                    node: self.node.0.clone(),
                });
            }
        }
        let block = u64::from(params.block_size);
        let floor = caps::size_floor(&req.volume_capabilities, params.fs_type);
        let mut size = at_least(
            size_for(req.capacity_range.as_ref(), block)?,
            floor,
            Floor::FileSystem,
            block,
            req.capacity_range.as_ref(),
        )?;
        let id = volume_id_for(&req.name);
        if let Some(existing) = self.ublkd.get(&id).await? {
            answerable(&existing)?;
            let have = existing.spec.as_ref().map_or(0, |s| s.size_bytes);
            let limit = req.capacity_range.as_ref().map_or(0, |r| r.limit_bytes);
            let required = req.capacity_range.as_ref().map_or(0, |r| r.required_bytes);
            if have < required.max(0) as u64 || (limit > 0 && have > limit as u64) {
                return Err(CsiError::VolumeMismatch {
                    name: req.name,
                    existing: have,
                });
            }
            if existing.spec.as_ref().and_then(|s| s.source.as_ref()) != source.as_ref() {
                return Err(CsiError::SourceMismatch { name: req.name });
            }
            return Ok(self.volume(&existing.id, have, &params, source.as_ref()));
        }
        if let Some(src) = &source {
            let from = snapshot::source_size(&self.ublkd, src).await?;
            size = at_least(
                size,
                from,
                Floor::Source,
                block,
                req.capacity_range.as_ref(),
            )?;
        }
        // A first look, for a clear RESOURCE_EXHAUSTED; ublkd checks again (and places an NVMe
        // window) under its own lock.
        let cap = self.ublkd.capacity(params.capacity_backend()).await?;
        if !params.backend.fits(&cap, size) || cap.volumes_left == 0 {
            return Err(CsiError::NoRoom {
                node: self.node.0.clone(),
                size,
                available: cap.maximum_volume_bytes,
            });
        }
        let mut spec = params.spec(&id, size);
        spec.qos = qos::spec_limits(limits);
        spec.source = source.clone();
        let made = match self.ublkd.create(&id, spec).await {
            Ok(made) => made,
            Err(e) if source.is_some() => return Err(CsiError::from_copy(e)),
            Err(e) => return Err(e.into()),
        };
        // A window reuses namespace blocks an earlier volume wrote: ublkd erases them before
        // the device appears (a retry of this call included), so no stale file system or data
        // is ever staged as this volume's.
        tracing::info!(volume = %made.id, name = %req.name, size, source = ?source, "volume created");
        Ok(self.volume(&made.id, size, &params, source.as_ref()))
    }

    fn volume(
        &self,
        id: &str,
        size: u64,
        params: &Params,
        source: Option<&Source>,
    ) -> spec::Volume {
        spec::Volume {
            capacity_bytes: size as i64,
            volume_id: id.to_owned(),
            volume_context: volume_context(params),
            content_source: source.map(content_source),
            accessible_topology: vec![self.topology()],
        }
    }

    async fn list(
        &self,
        req: spec::ListVolumesRequest,
    ) -> Result<spec::ListVolumesResponse, CsiError> {
        let mut vols = self.ublkd.list().await?;
        vols.sort_by(|a, b| a.id.cmp(&b.id));
        let (vols, next_token) = page(
            &vols,
            |v| v.id.as_str(),
            &req.starting_token,
            req.max_entries,
        )?;
        let entries = vols
            .iter()
            .map(|v| spec::list_volumes_response::Entry {
                volume: Some(spec::Volume {
                    capacity_bytes: v.spec.as_ref().map_or(0, |s| s.size_bytes) as i64,
                    volume_id: v.id.clone(),
                    volume_context: HashMap::new(),
                    content_source: v
                        .spec
                        .as_ref()
                        .and_then(|s| s.source.as_ref())
                        .map(content_source),
                    accessible_topology: vec![self.topology()],
                }),
                status: None,
            })
            .collect();
        Ok(spec::ListVolumesResponse {
            entries,
            next_token,
        })
    }

    async fn capacity(
        &self,
        req: spec::GetCapacityRequest,
    ) -> Result<spec::GetCapacityResponse, CsiError> {
        // No StorageClass parameters: no backend to measure, so nothing is promised.
        if req.parameters.is_empty() {
            return Ok(spec::GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: None,
                minimum_volume_size: None,
            });
        }
        let params = Params::parse(&req.parameters)?;
        if !req.volume_capabilities.is_empty() {
            caps::check_all(&req.volume_capabilities, params.fs_type)?;
        }
        if req
            .accessible_topology
            .as_ref()
            .is_some_and(|t| !self.is_this_node(t))
        {
            return Ok(spec::GetCapacityResponse {
                available_capacity: 0,
                maximum_volume_size: Some(0),
                minimum_volume_size: None,
            });
        }
        let cap = self.ublkd.capacity(params.capacity_backend()).await?;
        let (available, largest) = if cap.volumes_left == 0 {
            (0, 0)
        } else {
            (cap.available_bytes, cap.maximum_volume_bytes)
        };
        Ok(spec::GetCapacityResponse {
            available_capacity: i64::try_from(available).unwrap_or(i64::MAX),
            maximum_volume_size: Some(i64::try_from(largest).unwrap_or(i64::MAX)),
            minimum_volume_size: Some(i64::from(params.block_size)),
        })
    }
}

/// What the node needs of a StorageClass's parameters: the file system to make, and the
/// encryption to open it under.
fn volume_context(params: &Params) -> HashMap<String, String> {
    let mut context = HashMap::from([("fsType".to_owned(), params.fs_type.name().to_owned())]);
    if params.encryption != Encryption::None {
        context.insert(ENCRYPTION.to_owned(), params.encryption.name().to_owned());
    }
    context
}

fn capability(
    rpc: spec::controller_service_capability::rpc::Type,
) -> spec::ControllerServiceCapability {
    spec::ControllerServiceCapability {
        r#type: Some(spec::controller_service_capability::Type::Rpc(
            spec::controller_service_capability::Rpc { r#type: rpc as i32 },
        )),
    }
}

fn unimplemented<T>(what: &'static str) -> Result<Response<T>, Status> {
    Err(CsiError::Unimplemented(what).into())
}

/// How long DeleteVolume waits for a volume its node still holds. Nothing orders the kubelet's
/// unstage before the volume's delete: the PVC goes once its pod is gone, the kubelet unmounts
/// the staged device after that (seconds later on a busy node), and without an attach step
/// (attachRequired: false) the PV can be deleted in between. ublkd refuses to delete a held
/// device (FAILED_PRECONDITION); answering that at once put a VolumeFailedDelete warning on a
/// PV whose pod was deleted the ordinary way (the tier's warnings scenario, CI of stop 63).
/// Below the provisioner's 60 s --timeout; a volume held longer is refused, and retried.
const LET_GO_WAIT: std::time::Duration = std::time::Duration::from_secs(20);
/// How often the delete is tried again meanwhile.
const LET_GO_POLL: std::time::Duration = std::time::Duration::from_millis(500);

impl ControllerService {
    /// Deletes volume `id` (with its backing file when `made_here`), waiting up to
    /// `LET_GO_WAIT` while its device is held.
    async fn delete_when_let_go(&self, id: &str, made_here: bool) -> Result<(), CsiError> {
        let deadline = tokio::time::Instant::now() + LET_GO_WAIT;
        let mut said = false;
        loop {
            match self.ublkd.delete(id, made_here).await {
                Ok(()) => return Ok(()),
                Err(crate::ublkd::UblkdError::Call(s))
                    if s.code() == tonic::Code::FailedPrecondition
                        && tokio::time::Instant::now() + LET_GO_POLL < deadline =>
                {
                    if !said {
                        tracing::info!(
                            volume = %id,
                            reason = %s.message(),
                            "the volume is still held on its node (the kubelet unstages after \
                             the pod is gone): waiting up to {} s for it to be let go",
                            LET_GO_WAIT.as_secs()
                        );
                        said = true;
                    }
                    tokio::time::sleep(LET_GO_POLL).await;
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

#[tonic::async_trait]
impl Controller for ControllerService {
    async fn create_volume(
        &self,
        req: Request<spec::CreateVolumeRequest>,
    ) -> Result<Response<spec::CreateVolumeResponse>, Status> {
        let volume = self.create(req.into_inner()).await?;
        Ok(Response::new(spec::CreateVolumeResponse {
            volume: Some(volume),
        }))
    }

    /// Removes the volume, its device and (file) its backing file; an absent volume is done.
    async fn delete_volume(
        &self,
        req: Request<spec::DeleteVolumeRequest>,
    ) -> Result<Response<spec::DeleteVolumeResponse>, Status> {
        let req = req.into_inner();
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id").into());
        }
        // Only a backing file this driver had ublkd make goes with the volume; a static volume's
        // file (made by an operator, create unset) is theirs and stays.
        let made_here = crate::ublkd::is_volume_id(&req.volume_id)
            && self
                .ublkd
                .get(&req.volume_id)
                .await
                .map_err(CsiError::from)?
                .and_then(|v| v.spec?.backend)
                .is_some_and(|b| matches!(b, v1::volume_spec::Backend::File(f) if f.create));
        self.delete_when_let_go(&req.volume_id, made_here).await?;
        tracing::info!(volume = %req.volume_id, "volume deleted");
        Ok(Response::new(spec::DeleteVolumeResponse {}))
    }

    async fn controller_publish_volume(
        &self,
        _req: Request<spec::ControllerPublishVolumeRequest>,
    ) -> Result<Response<spec::ControllerPublishVolumeResponse>, Status> {
        unimplemented("ControllerPublishVolume: volumes are local, nothing to attach")
    }

    async fn controller_unpublish_volume(
        &self,
        _req: Request<spec::ControllerUnpublishVolumeRequest>,
    ) -> Result<Response<spec::ControllerUnpublishVolumeResponse>, Status> {
        unimplemented("ControllerUnpublishVolume: volumes are local, nothing to detach")
    }

    async fn validate_volume_capabilities(
        &self,
        req: Request<spec::ValidateVolumeCapabilitiesRequest>,
    ) -> Result<Response<spec::ValidateVolumeCapabilitiesResponse>, Status> {
        let req = req.into_inner();
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id").into());
        }
        if req.volume_capabilities.is_empty() {
            return Err(CsiError::MissingField("volume_capabilities").into());
        }
        if self
            .ublkd
            .get(&req.volume_id)
            .await
            .map_err(CsiError::from)?
            .is_none()
        {
            return Err(CsiError::VolumeNotFound(req.volume_id).into());
        }
        let default_fs = crate::params::FsType::Ext4;
        let checked = caps::check_all(&req.volume_capabilities, default_fs)
            .and_then(|()| QosChange::from_mutable(&req.mutable_parameters).map(drop));
        let reply = match checked {
            Ok(()) => spec::ValidateVolumeCapabilitiesResponse {
                confirmed: Some(spec::validate_volume_capabilities_response::Confirmed {
                    volume_context: req.volume_context,
                    volume_capabilities: req.volume_capabilities,
                    parameters: req.parameters,
                    mutable_parameters: req.mutable_parameters,
                }),
                message: String::new(),
            },
            Err(e) => spec::ValidateVolumeCapabilitiesResponse {
                confirmed: None,
                message: e.to_string(),
            },
        };
        Ok(Response::new(reply))
    }

    async fn list_volumes(
        &self,
        req: Request<spec::ListVolumesRequest>,
    ) -> Result<Response<spec::ListVolumesResponse>, Status> {
        Ok(Response::new(self.list(req.into_inner()).await?))
    }

    async fn get_capacity(
        &self,
        req: Request<spec::GetCapacityRequest>,
    ) -> Result<Response<spec::GetCapacityResponse>, Status> {
        Ok(Response::new(self.capacity(req.into_inner()).await?))
    }

    async fn controller_get_capabilities(
        &self,
        _req: Request<spec::ControllerGetCapabilitiesRequest>,
    ) -> Result<Response<spec::ControllerGetCapabilitiesResponse>, Status> {
        use spec::controller_service_capability::rpc::Type;
        Ok(Response::new(spec::ControllerGetCapabilitiesResponse {
            capabilities: [
                Type::CreateDeleteVolume,
                Type::GetCapacity,
                Type::ListVolumes,
                Type::SingleNodeMultiWriter,
                Type::CreateDeleteSnapshot,
                Type::ListSnapshots,
                Type::CloneVolume,
                Type::ModifyVolume,
            ]
            .into_iter()
            .map(capability)
            .collect(),
        }))
    }

    /// A reflink copy of a file volume, taken with its queues drained (`snapshot`).
    async fn create_snapshot(
        &self,
        req: Request<spec::CreateSnapshotRequest>,
    ) -> Result<Response<spec::CreateSnapshotResponse>, Status> {
        let snapshot = snapshot::create(&self.ublkd, req.into_inner()).await?;
        Ok(Response::new(spec::CreateSnapshotResponse {
            snapshot: Some(snapshot),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<spec::DeleteSnapshotRequest>,
    ) -> Result<Response<spec::DeleteSnapshotResponse>, Status> {
        snapshot::delete(&self.ublkd, &req.into_inner().snapshot_id).await?;
        Ok(Response::new(spec::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<spec::ListSnapshotsRequest>,
    ) -> Result<Response<spec::ListSnapshotsResponse>, Status> {
        Ok(Response::new(
            snapshot::list(&self.ublkd, req.into_inner()).await?,
        ))
    }

    async fn get_snapshot(
        &self,
        _req: Request<spec::GetSnapshotRequest>,
    ) -> Result<Response<spec::GetSnapshotResponse>, Status> {
        unimplemented("GetSnapshot (alpha): use ListSnapshots with a snapshot_id")
    }

    async fn controller_expand_volume(
        &self,
        _req: Request<spec::ControllerExpandVolumeRequest>,
    ) -> Result<Response<spec::ControllerExpandVolumeResponse>, Status> {
        unimplemented("volumes grow on their node (NodeExpandVolume)")
    }

    async fn controller_get_volume(
        &self,
        _req: Request<spec::ControllerGetVolumeRequest>,
    ) -> Result<Response<spec::ControllerGetVolumeResponse>, Status> {
        unimplemented("ControllerGetVolume")
    }

    /// A VolumeAttributesClass's I/O limits, live, on whichever node holds the volume
    /// (`modify`).
    async fn controller_modify_volume(
        &self,
        req: Request<spec::ControllerModifyVolumeRequest>,
    ) -> Result<Response<spec::ControllerModifyVolumeResponse>, Status> {
        modify::modify(&self.ublkd, &self.route, req.into_inner()).await?;
        Ok(Response::new(spec::ControllerModifyVolumeResponse {}))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A retry of CreateVolume answers OK only for a READY volume (issue 22, item 2).
    #[test]
    fn a_retried_create_answers_ok_only_for_a_ready_volume() {
        let vol = |state: v1::VolumeState| v1::Volume {
            id: "pvc-1".into(),
            state: state as i32,
            ..Default::default()
        };
        assert!(answerable(&vol(v1::VolumeState::Ready)).is_ok());
        for (state, code) in [
            (v1::VolumeState::Creating, tonic::Code::Aborted),
            (v1::VolumeState::Deleting, tonic::Code::Aborted),
            (v1::VolumeState::Failed, tonic::Code::FailedPrecondition),
            (v1::VolumeState::Recovering, tonic::Code::Unavailable),
        ] {
            let e = answerable(&vol(state)).expect_err("not READY: not OK");
            assert_eq!(e.code(), code, "{state:?}");
        }
    }
}
