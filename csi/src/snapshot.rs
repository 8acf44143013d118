//! Snapshots and clones of file volumes, ublkd's reflink copies, as CSI asks for them:
//! CreateSnapshot, DeleteSnapshot and ListSnapshots in this node's ublkd, and the content source
//! of a CreateVolume (a snapshot to restore, a volume to clone).
//!
//! Like volumes, they never leave their node: a snapshot lives beside its volume's backing file,
//! and a restore or a clone is made on that node, on the same file system (a reflink never
//! crosses one). Each node's csi-snapshotter (`--node-deployment`) asks its own node's driver
//! for the snapshots of that node's volumes. RAM and NVMe volumes have no file to reflink: a
//! snapshot or a clone of one is INVALID_ARGUMENT.

use crate::error::CsiError;
use crate::naming::{snapshot_id_for, state_name};
use crate::page::page;
use crate::spec;
use crate::ublkd::Ublkd;
use ublkd_client::v1::{self, volume_spec::Source};

/// The CSI form of a ublkd snapshot. ublkd answers once the reflink is complete, so it is
/// ready to use as soon as it exists.
pub fn to_csi(s: &v1::Snapshot) -> spec::Snapshot {
    spec::Snapshot {
        size_bytes: i64::try_from(s.size_bytes).unwrap_or(i64::MAX),
        snapshot_id: s.id.clone(),
        source_volume_id: s.source_volume_id.clone(),
        creation_time: s.created,
        ready_to_use: s.ready,
        group_snapshot_id: String::new(),
    }
}

/// What ublkd is asked to copy for a CreateVolume's content source.
pub fn source_of(src: Option<&spec::VolumeContentSource>) -> Result<Option<Source>, CsiError> {
    use spec::volume_content_source::Type;
    let Some(src) = src else {
        return Ok(None);
    };
    match &src.r#type {
        None => Err(CsiError::MissingField("volume_content_source.type")),
        Some(Type::Snapshot(s)) if s.snapshot_id.is_empty() => Err(CsiError::MissingField(
            "volume_content_source.snapshot.snapshot_id",
        )),
        Some(Type::Volume(v)) if v.volume_id.is_empty() => Err(CsiError::MissingField(
            "volume_content_source.volume.volume_id",
        )),
        Some(Type::Snapshot(s)) => Ok(Some(Source::FromSnapshot(s.snapshot_id.clone()))),
        Some(Type::Volume(v)) => Ok(Some(Source::FromVolume(v.volume_id.clone()))),
    }
}

/// The content source a volume made from `source` reports (CreateVolume echoes it).
pub fn content_source(source: &Source) -> spec::VolumeContentSource {
    use spec::volume_content_source::{SnapshotSource, Type, VolumeSource};
    spec::VolumeContentSource {
        r#type: Some(match source {
            Source::FromSnapshot(id) => Type::Snapshot(SnapshotSource {
                snapshot_id: id.clone(),
            }),
            Source::FromVolume(id) => Type::Volume(VolumeSource {
                volume_id: id.clone(),
            }),
        }),
    }
}

/// Whether volume `v` can be copied now: a file volume (the others have no file to reflink)
/// that serves I/O (ublkd drains it for the instant of the copy).
fn check_copyable(v: &v1::Volume) -> Result<(), CsiError> {
    use ublkd_proto::BackendKind;
    let kind = v.spec.as_ref().and_then(|s| s.backend.as_ref());
    let kind = kind.map_or("backend-less", |b| BackendKind::of(b).name());
    if kind != BackendKind::File.name() {
        return Err(CsiError::SourceUnsupported(format!(
            "volume {:?} is a {kind} volume: snapshots and clones are of file volumes only \
             (StorageClass backend: file, on a file system that can reflink)",
            v.id
        )));
    }
    match v.state() {
        v1::VolumeState::Ready => Ok(()),
        v1::VolumeState::Failed => Err(CsiError::VolumeFailed {
            id: v.id.clone(),
            message: v.message.clone(),
        }),
        other => Err(CsiError::VolumeNotReady {
            id: v.id.clone(),
            state: state_name(other),
        }),
    }
}

/// The size of a content source on this node, once it is known to be there and copyable.
pub async fn source_size(ublkd: &Ublkd, source: &Source) -> Result<u64, CsiError> {
    match source {
        Source::FromSnapshot(id) => Ok(ublkd
            .snapshot(id)
            .await?
            .ok_or_else(|| CsiError::SourceNotFound {
                what: "snapshot",
                id: id.clone(),
            })?
            .size_bytes),
        Source::FromVolume(id) => {
            let v = ublkd
                .get(id)
                .await?
                .ok_or_else(|| CsiError::SourceNotFound {
                    what: "volume",
                    id: id.clone(),
                })?;
            check_copyable(&v)?;
            Ok(v.spec.map_or(0, |s| s.size_bytes))
        }
    }
}

/// CreateSnapshot: a reflink copy of a READY file volume; a retry finds its first try's.
pub async fn create(
    ublkd: &Ublkd,
    req: spec::CreateSnapshotRequest,
) -> Result<spec::Snapshot, CsiError> {
    if req.name.is_empty() {
        return Err(CsiError::MissingField("name"));
    }
    if req.source_volume_id.is_empty() {
        return Err(CsiError::MissingField("source_volume_id"));
    }
    if let Some(k) = req
        .parameters
        .keys()
        .find(|k| !crate::qos::is_sidecar_key(k))
    {
        return Err(CsiError::BadParameter(format!(
            "unknown VolumeSnapshotClass parameter {k:?}: snapshots take none"
        )));
    }
    let id = snapshot_id_for(&req.name);
    // A retry finds the snapshot its first try took, even if the volume is gone since.
    if let Some(s) = ublkd.snapshot(&id).await? {
        if s.source_volume_id != req.source_volume_id {
            return Err(CsiError::SnapshotMismatch {
                name: req.name,
                source_volume: s.source_volume_id,
            });
        }
        return Ok(to_csi(&s));
    }
    let v = ublkd
        .get(&req.source_volume_id)
        .await?
        .ok_or_else(|| CsiError::SourceNotFound {
            what: "volume",
            id: req.source_volume_id.clone(),
        })?;
    check_copyable(&v)?;
    let s = ublkd
        .create_snapshot(&id, &v.id)
        .await
        .map_err(CsiError::from_copy)?;
    tracing::info!(snapshot = %s.id, volume = %v.id, name = %req.name, "snapshot created");
    Ok(to_csi(&s))
}

/// Deletes a snapshot's copy; an absent one is done. Volumes restored from it keep their
/// data (a reflink shares blocks, it does not depend on the copy).
pub async fn delete(ublkd: &Ublkd, id: &str) -> Result<(), CsiError> {
    if id.is_empty() {
        return Err(CsiError::MissingField("snapshot_id"));
    }
    ublkd.delete_snapshot(id).await?;
    tracing::info!(snapshot = %id, "snapshot deleted");
    Ok(())
}

/// ListSnapshots, by id or by source volume, a page at a time.
pub async fn list(
    ublkd: &Ublkd,
    req: spec::ListSnapshotsRequest,
) -> Result<spec::ListSnapshotsResponse, CsiError> {
    // An id ublkd could never have made matches nothing; ublkd would refuse it.
    let matches_nothing = |id: &str| !id.is_empty() && !crate::ublkd::is_volume_id(id);
    let mut snaps = if matches_nothing(&req.snapshot_id) || matches_nothing(&req.source_volume_id) {
        Vec::new()
    } else {
        ublkd
            .list_snapshots(&req.snapshot_id, &req.source_volume_id)
            .await?
    };
    snaps.sort_by(|a, b| a.id.cmp(&b.id));
    let (entries, next_token) = page(
        &snaps,
        |s| s.id.as_str(),
        &req.starting_token,
        req.max_entries,
    )?;
    Ok(spec::ListSnapshotsResponse {
        entries: entries
            .iter()
            .map(|s| spec::list_snapshots_response::Entry {
                snapshot: Some(to_csi(s)),
            })
            .collect(),
        next_token,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use spec::volume_content_source::{SnapshotSource, Type, VolumeSource};

    #[test]
    fn content_sources_map_to_ublkd_sources_and_back() {
        let snap = spec::VolumeContentSource {
            r#type: Some(Type::Snapshot(SnapshotSource {
                snapshot_id: "snapshot-1".into(),
            })),
        };
        let vol = spec::VolumeContentSource {
            r#type: Some(Type::Volume(VolumeSource {
                volume_id: "pvc-1".into(),
            })),
        };
        assert_eq!(source_of(None).unwrap(), None);
        assert_eq!(
            source_of(Some(&snap)).unwrap(),
            Some(Source::FromSnapshot("snapshot-1".into()))
        );
        assert_eq!(
            source_of(Some(&vol)).unwrap(),
            Some(Source::FromVolume("pvc-1".into()))
        );
        for src in [&snap, &vol] {
            let s = source_of(Some(src)).unwrap().unwrap();
            assert_eq!(&content_source(&s), src, "echoed as asked");
        }
        for bad in [
            spec::VolumeContentSource { r#type: None },
            spec::VolumeContentSource {
                r#type: Some(Type::Snapshot(SnapshotSource::default())),
            },
            spec::VolumeContentSource {
                r#type: Some(Type::Volume(VolumeSource::default())),
            },
        ] {
            let e = source_of(Some(&bad)).expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        }
    }

    #[test]
    fn only_ready_file_volumes_are_copied() {
        use v1::volume_spec::Backend;
        let vol = |backend: Backend, state: v1::VolumeState| v1::Volume {
            id: "pvc-1".into(),
            spec: Some(v1::VolumeSpec {
                backend: Some(backend),
                ..Default::default()
            }),
            state: state as i32,
            ..Default::default()
        };
        let file = || Backend::File(v1::FileBackend::default());
        assert!(check_copyable(&vol(file(), v1::VolumeState::Ready)).is_ok());
        let code = |v: v1::Volume| check_copyable(&v).unwrap_err().code();
        assert_eq!(
            code(vol(Backend::Ram(v1::RamBackend {}), v1::VolumeState::Ready)),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(vol(
                Backend::Nvme(v1::NvmeBackend::default()),
                v1::VolumeState::Ready
            )),
            tonic::Code::InvalidArgument
        );
        assert_eq!(
            code(vol(file(), v1::VolumeState::Recovering)),
            tonic::Code::Unavailable,
            "retried"
        );
        assert_eq!(
            code(vol(file(), v1::VolumeState::Failed)),
            tonic::Code::FailedPrecondition
        );
    }

    #[test]
    fn snapshots_are_ready_once_ublkd_returns_them() {
        let s = to_csi(&v1::Snapshot {
            id: "snapshot-1".into(),
            source_volume_id: "pvc-1".into(),
            size_bytes: 1 << 30,
            created: Some(prost_types::Timestamp {
                seconds: 5,
                nanos: 0,
            }),
            path: "/srv/.ublkd-snapshots/snapshot-1.img".into(),
            ready: true,
        });
        assert!(s.ready_to_use);
        assert_eq!(
            (s.snapshot_id.as_str(), s.source_volume_id.as_str()),
            ("snapshot-1", "pvc-1")
        );
        assert_eq!(s.size_bytes, 1 << 30);
        assert_eq!(s.creation_time.map(|t| t.seconds), Some(5));
    }
}
