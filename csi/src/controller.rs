//! The CSI Controller service, run on every node (external-provisioner and csi-snapshotter
//! `--node-deployment`): it creates and deletes this node's volumes and snapshots in this
//! node's ublkd, clones and restores them there, and tells the scheduler what this node can
//! still provide. The central instance beside the csi-resizer changes volumes' I/O limits on
//! whichever node holds them (`modify`).

use crate::caps;
use crate::error::CsiError;
use crate::modify::Route;
use crate::page::page;
use crate::params::{Backend, Params};
use crate::qos::{self, QosChange};
use crate::snapshot::{content_source, source_of};
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
                state: crate::node::state_name(other),
            })
        }
    }
}

/// Size of a volume whose request names none.
pub const DEFAULT_SIZE: u64 = 1 << 30;

#[derive(Debug, Clone)]
pub struct ControllerService {
    pub ublkd: Ublkd,
    pub node: Node,
    /// Where ControllerModifyVolume finds a volume's ublkd.
    pub route: Route,
}

/// A ublkd id for a CSI name: the name itself when it is a DNS label, else `prefix` and a
/// stable digest of it, so a retried call finds what its first try made.
pub(crate) fn id_for(name: &str, prefix: &str) -> String {
    if crate::ublkd::is_volume_id(name) {
        return name.to_owned();
    }
    // FNV-1a, 64 bits: stable across releases and platforms, which a std hasher is not.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{prefix}{hash:016x}")
}

/// The ublkd volume id for a CSI volume name: the name itself when it is a DNS label (the
/// provisioner's `pvc-<uid>` always is), else `csi-` and a stable digest of it.
pub fn volume_id_for(name: &str) -> String {
    id_for(name, "csi-")
}

/// The size to give a volume: the request's minimum (or the default) rounded up to the block
/// size, within its limit.
pub fn size_for(range: Option<&spec::CapacityRange>, block: u64) -> Result<u64, CsiError> {
    let (required, limit) = range.map_or((0, 0), |r| (r.required_bytes, r.limit_bytes));
    if required < 0 || limit < 0 {
        return Err(CsiError::OutOfRange("capacity range is negative".into()));
    }
    let (required, limit) = (required as u64, limit as u64);
    let want = if required == 0 {
        if limit > 0 {
            DEFAULT_SIZE.min(limit)
        } else {
            DEFAULT_SIZE
        }
    } else {
        required
    };
    let size = want
        .checked_next_multiple_of(block)
        .ok_or_else(|| CsiError::OutOfRange(format!("{want} bytes")))?;
    if limit > 0 && size > limit {
        return Err(CsiError::OutOfRange(format!(
            "{required} bytes rounded up to the block size ({size}) exceed the limit of {limit}"
        )));
    }
    Ok(size)
}

/// The floors a volume's size is raised to, each saying why in a refusal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Floor {
    /// The smallest device its file system is made on: a claim of 64 MiB in an xfs class gets
    /// 300 MiB, as cloud drivers round up to their smallest disk.
    FileSystem,
    /// The size of its source (the spec: a volume is never smaller than its source).
    Source,
}

/// `size`, raised to `floor` bytes rounded up to the block, within the limit.
pub fn at_least(
    size: u64,
    floor: u64,
    why: Floor,
    block: u64,
    limit: Option<&spec::CapacityRange>,
) -> Result<u64, CsiError> {
    if size >= floor {
        return Ok(size);
    }
    let raised = floor
        .checked_next_multiple_of(block)
        .ok_or_else(|| CsiError::OutOfRange(format!("{floor} bytes")))?;
    let limit = limit.map_or(0, |r| r.limit_bytes.max(0) as u64);
    if limit > 0 && raised > limit {
        let needs = match why {
            Floor::FileSystem => format!("its file system needs at least {raised} bytes"),
            Floor::Source => format!("the source holds {floor} bytes"),
        };
        return Err(CsiError::OutOfRange(format!(
            "{needs}, more than the limit of {limit}"
        )));
    }
    Ok(raised)
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
            let from = self.source_size(src).await?;
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
        let fits = match &params.backend {
            Backend::Nvme { .. } => cap.free_extents.iter().any(|e| e.length_bytes >= size),
            _ => cap.available_bytes >= size,
        };
        if !fits || cap.volumes_left == 0 {
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
            volume_context: HashMap::from([(
                "fsType".to_owned(),
                params.fs_type.name().to_owned(),
            )]),
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
        self.ublkd
            .delete(&req.volume_id, made_here)
            .await
            .map_err(CsiError::from)?;
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
        let snapshot = self.snapshot(req.into_inner()).await?;
        Ok(Response::new(spec::CreateSnapshotResponse {
            snapshot: Some(snapshot),
        }))
    }

    async fn delete_snapshot(
        &self,
        req: Request<spec::DeleteSnapshotRequest>,
    ) -> Result<Response<spec::DeleteSnapshotResponse>, Status> {
        ControllerService::delete_snapshot(self, &req.into_inner().snapshot_id).await?;
        Ok(Response::new(spec::DeleteSnapshotResponse {}))
    }

    async fn list_snapshots(
        &self,
        req: Request<spec::ListSnapshotsRequest>,
    ) -> Result<Response<spec::ListSnapshotsResponse>, Status> {
        Ok(Response::new(
            ControllerService::list_snapshots(self, req.into_inner()).await?,
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
        self.modify(req.into_inner()).await?;
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

    #[test]
    fn names_map_to_stable_volume_ids() {
        assert_eq!(volume_id_for("pvc-0a1b"), "pvc-0a1b");
        let odd = volume_id_for("Sanity Volume 1");
        assert!(odd.starts_with("csi-") && odd.len() == 20, "{odd}");
        assert_eq!(odd, volume_id_for("Sanity Volume 1"), "stable");
        assert_ne!(odd, volume_id_for("Sanity Volume 2"));
    }

    #[test]
    fn sizes_round_up_to_the_block_and_respect_the_limit() {
        let r = |required, limit| spec::CapacityRange {
            required_bytes: required,
            limit_bytes: limit,
        };
        assert_eq!(size_for(None, 4096).unwrap(), DEFAULT_SIZE);
        assert_eq!(size_for(Some(&r(1, 0)), 4096).unwrap(), 4096);
        assert_eq!(size_for(Some(&r(4097, 8192)), 4096).unwrap(), 8192);
        assert_eq!(size_for(Some(&r(0, 8192)), 512).unwrap(), 8192);
        assert_eq!(
            size_for(Some(&r(4097, 5000)), 4096).unwrap_err().code(),
            tonic::Code::OutOfRange
        );
        assert!(size_for(Some(&r(-1, 0)), 4096).is_err());
        let xfs = 300 << 20;
        assert_eq!(
            at_least(
                64 << 20,
                xfs,
                Floor::FileSystem,
                4096,
                Some(&r(64 << 20, 0))
            )
            .unwrap(),
            xfs
        );
        assert_eq!(
            at_least(1 << 30, xfs, Floor::FileSystem, 4096, None).unwrap(),
            1 << 30
        );
        assert_eq!(
            at_least(4096, 0, Floor::FileSystem, 4096, None).unwrap(),
            4096
        );
        let e = at_least(
            64 << 20,
            xfs,
            Floor::FileSystem,
            4096,
            Some(&r(0, 128 << 20)),
        )
        .unwrap_err();
        assert_eq!(e.code(), tonic::Code::OutOfRange, "{e}");
    }

    #[test]
    fn a_volume_from_a_source_is_never_smaller_than_it() {
        let r = |limit| spec::CapacityRange {
            required_bytes: 4096,
            limit_bytes: limit,
        };
        assert_eq!(
            at_least(8192, 4096, Floor::Source, 4096, None).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 6000, Floor::Source, 4096, None).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 8192, Floor::Source, 4096, Some(&r(8192))).unwrap(),
            8192
        );
        assert_eq!(
            at_least(4096, 8193, Floor::Source, 4096, Some(&r(8192)))
                .unwrap_err()
                .code(),
            tonic::Code::OutOfRange
        );
    }
}
