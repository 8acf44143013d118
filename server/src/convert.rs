//! The one place where the API's, the registry's and the dataplane's forms of a volume meet.
//! The registry stores the dataplane's own spec enums (`IoPath`, `Toggle`), so only the API's
//! numbered enums need converting, both ways, here.

use crate::record::{AdjustedSetting, SourceRecord, VolumeRecord};
use crate::snapshot::SnapshotRecord;
use crate::volume::{ram_file, State, Volume};
use crate::volume_id::VolumeId;
use std::path::Path;
use ublkd_dataplane::{DeviceSpec, Features, IoPath, KernelDevice, QosLimits, Toggle};
use ublkd_proto::v1;

/// The dataplane spec that serves `r` (RAM volumes keep their memory in `ram_dir`).
pub fn device_spec(r: &VolumeRecord, ram_dir: &Path) -> DeviceSpec {
    DeviceSpec {
        size_bytes: r.size_bytes,
        block_size: r.block_size,
        queues: r.queues,
        queue_depth: r.queue_depth,
        io_path: r.io_path,
        backend: r.backend.spec(ram_file(ram_dir, &r.id)),
        dev_id: r.dev_id,
        zero_copy: r.zero_copy,
        poll: r.poll,
        qos: r.qos,
        // Not recorded: every volume takes the dataplane's largest request (the copy buffers
        // `capacity::memory_bytes` admits are counted from the same constant).
        max_io_bytes: ublkd_dataplane::DEFAULT_MAX_IO_BYTES,
        // The manager erases a new window itself (`volumes::erase`), recorded as it goes;
        // the dataplane never erases for a device made from a record.
        erase: false,
    }
}

/// The API form of a snapshot.
pub fn snapshot_proto(s: &SnapshotRecord) -> v1::Snapshot {
    v1::Snapshot {
        id: s.id.to_string(),
        source_volume_id: s.source.to_string(),
        size_bytes: s.size_bytes,
        created: Some(timestamp(s.created_unix_ms)),
        path: s.path.display().to_string(),
        ready: true,
    }
}

fn timestamp(unix_ms: i64) -> prost_types::Timestamp {
    prost_types::Timestamp {
        seconds: unix_ms.div_euclid(1000),
        nanos: (unix_ms.rem_euclid(1000) * 1_000_000) as i32,
    }
}

pub fn qos_to_proto(q: &QosLimits) -> v1::QosLimits {
    v1::QosLimits {
        read_iops: q.read_iops,
        write_iops: q.write_iops,
        read_bytes_per_second: q.read_bytes_per_sec,
        write_bytes_per_second: q.write_bytes_per_sec,
        burst_ms: q.burst_ms,
    }
}

pub fn io_path_to_proto(p: IoPath) -> v1::IoPath {
    match p {
        IoPath::Auto => v1::IoPath::Auto,
        IoPath::Batch => v1::IoPath::Batch,
        IoPath::PerIo => v1::IoPath::PerIo,
    }
}

pub fn toggle_to_proto(t: Toggle) -> v1::Toggle {
    match t {
        Toggle::Auto => v1::Toggle::Auto,
        Toggle::On => v1::Toggle::On,
        Toggle::Off => v1::Toggle::Off,
    }
}

fn state_proto(s: State) -> v1::VolumeState {
    match s {
        State::Creating => v1::VolumeState::Creating,
        State::Ready => v1::VolumeState::Ready,
        State::Recovering => v1::VolumeState::Recovering,
        State::Failed => v1::VolumeState::Failed,
        State::Deleting => v1::VolumeState::Deleting,
    }
}

/// The API form of a volume.
pub fn volume_proto(v: &Volume) -> v1::Volume {
    let r = &v.record;
    let backend = r.backend.proto();
    v1::Volume {
        id: r.id.to_string(),
        spec: Some(v1::VolumeSpec {
            size_bytes: r.size_bytes,
            block_size: Some(r.block_size),
            backend: Some(backend),
            queues: Some(u32::from(r.queues)),
            queue_depth: Some(u32::from(r.queue_depth)),
            io_path: io_path_to_proto(r.io_path) as i32,
            zero_copy: toggle_to_proto(r.zero_copy) as i32,
            poll: toggle_to_proto(r.poll) as i32,
            qos: (!r.qos.is_unlimited() || r.qos.burst_ms != 0).then(|| qos_to_proto(&r.qos)),
            source: r.source.as_ref().map(|s| match s {
                SourceRecord::Snapshot(id) => {
                    v1::volume_spec::Source::FromSnapshot(id.as_str().to_owned())
                }
                SourceRecord::Volume(id) => v1::volume_spec::Source::FromVolume(id.to_string()),
            }),
            claim: r.claim.as_ref().map(|c| v1::Claim {
                namespace: c.namespace.clone(),
                name: c.name.clone(),
                persistent_volume: c.persistent_volume.clone(),
            }),
            // A request flag, not kept: what it lowered is in `adjustments`.
            fit_to_node: false,
        }),
        state: state_proto(v.state) as i32,
        device_path: v
            .device
            .as_ref()
            .map(|d| d.block_device.display().to_string())
            .unwrap_or_default(),
        dev_id: v.device.as_ref().map_or(0, |d| d.dev_id.0),
        created: Some(timestamp(r.created_unix_ms)),
        io_path_in_use: v
            .device
            .as_ref()
            .map_or(v1::IoPath::Auto, |d| io_path_to_proto(d.io_path))
            as i32,
        message: v.message.clone(),
        zero_copy_in_use: v.device.as_ref().is_some_and(|d| d.zero_copy_in_use()),
        polled: v.device.as_ref().is_some_and(|d| d.polled),
        poll_reason: v.device.as_ref().map_or(v1::PollReason::Unspecified, |d| {
            poll_reason_to_proto(d.poll_reason)
        }) as i32,
        placement: v
            .device
            .as_ref()
            .map_or(v1::QueuePlacement::Unspecified, |d| {
                placement_to_proto(d.placement)
            }) as i32,
        placement_reason: v
            .device
            .as_ref()
            .map_or(v1::PlacementReason::Unspecified, |d| {
                placement_reason_to_proto(d.placement_reason)
            }) as i32,
        queue_cpus: v.device.as_ref().map_or_else(Vec::new, |d| {
            d.queue_cpus
                .iter()
                .map(|&c| u32::try_from(c).unwrap_or(u32::MAX))
                .collect()
        }),
        adjustments: r
            .adjustments
            .iter()
            .map(|a| v1::Adjustment {
                setting: match a.setting {
                    AdjustedSetting::Queues => v1::Setting::Queues,
                    AdjustedSetting::QueueDepth => v1::Setting::QueueDepth,
                } as i32,
                requested: a.requested,
                applied: a.applied,
            })
            .collect(),
    }
}

pub fn placement_to_proto(p: ublkd_dataplane::QueuePlacement) -> v1::QueuePlacement {
    use ublkd_dataplane::QueuePlacement as P;
    match p {
        P::SameCpu => v1::QueuePlacement::SameCpu,
        P::OtherCpu => v1::QueuePlacement::OtherCpu,
        P::Spread => v1::QueuePlacement::Spread,
    }
}

pub fn placement_reason_to_proto(r: ublkd_dataplane::PlacementReason) -> v1::PlacementReason {
    use ublkd_dataplane::PlacementReason as R;
    match r {
        R::Asked => v1::PlacementReason::Asked,
        R::SharedCpus => v1::PlacementReason::SharedCpus,
        R::DedicatedCpus => v1::PlacementReason::DedicatedCpus,
        R::NoWorkerFits => v1::PlacementReason::NoWorkerFits,
    }
}

pub fn poll_reason_to_proto(r: ublkd_dataplane::PollReason) -> v1::PollReason {
    use ublkd_dataplane::PollReason as R;
    match r {
        R::Asked => v1::PollReason::Asked,
        R::Declined => v1::PollReason::Declined,
        R::NotOffered => v1::PollReason::NotOffered,
        R::SharedCpus => v1::PollReason::SharedCpus,
        R::DedicatedCpus => v1::PollReason::DedicatedCpus,
        R::ZeroCopyKept => v1::PollReason::ZeroCopyKept,
    }
}

/// What GetNodeInfo reports, as the manager knows it.
pub struct NodeFacts {
    /// The kernel's ublk features; none when the dataplane could not start.
    pub features: Option<Features>,
    pub worker_cpus: Vec<usize>,
    pub volumes: usize,
    pub orphans: Vec<KernelDevice>,
    pub without_pv: Vec<VolumeId>,
    /// Why the dataplane could not start; None while it runs.
    pub dataplane_error: Option<String>,
}

/// The API's NodeInfo of `f`, with this build's version and the running kernel's release.
pub fn node_info(f: NodeFacts) -> v1::NodeInfo {
    v1::NodeInfo {
        version: env!("CARGO_PKG_VERSION").into(),
        // No release file (not Linux's procfs) reports as unknown: nothing else depends on it.
        kernel_release: std::fs::read_to_string("/proc/sys/kernel/osrelease")
            .unwrap_or_default()
            .trim()
            .into(),
        ublk_features: f.features.map_or(0, |f| f.0),
        ublk_feature_names: f
            .features
            .map(|f| f.names().into_iter().map(str::to_owned).collect())
            .unwrap_or_default(),
        worker_cpus: f.worker_cpus.iter().map(|&c| c as u32).collect(),
        // Every kind, where the kernel lets ublkd serve at all.
        backends: if f.features.is_some() {
            ublkd_proto::BackendKind::ALL
                .iter()
                .map(|k| k.name().into())
                .collect()
        } else {
            Vec::new()
        },
        volumes: u32::try_from(f.volumes).unwrap_or(u32::MAX),
        orphans: f
            .orphans
            .into_iter()
            .map(|d| v1::OrphanDevice {
                dev_id: d.dev_id.0,
                state: d.state.name().into(),
                server_pid: d.pid,
                size_bytes: d.size_bytes,
                queues: u32::from(d.queues),
                queue_depth: u32::from(d.queue_depth),
            })
            .collect(),
        volumes_without_pv: f.without_pv.iter().map(ToString::to_string).collect(),
        dataplane_error: f.dataplane_error.unwrap_or_default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::volume_id::VolumeId;

    /// request -> record -> DeviceSpec -> the kernel's device -> takeover, over every field:
    /// each field of the record is named here (a new one does not compile until it is) with
    /// where it goes, what reaches the kernel is what was asked, and the record's spec takes
    /// over the device it made.
    #[test]
    fn every_field_of_a_request_reaches_the_kernel_and_comes_back() {
        use v1::volume_spec::Backend as B;
        let root = tempfile::tempdir().unwrap();
        let request = v1::VolumeSpec {
            size_bytes: 64 << 20,
            block_size: Some(512),
            backend: Some(B::File(v1::FileBackend {
                path: root.path().join("v.img").display().to_string(),
                create: true,
            })),
            queues: Some(2),
            queue_depth: Some(32),
            io_path: v1::IoPath::Batch as i32,
            zero_copy: v1::Toggle::On as i32,
            poll: v1::Toggle::Off as i32,
            qos: Some(v1::QosLimits {
                read_iops: 1000,
                write_iops: 0,
                read_bytes_per_second: 0,
                write_bytes_per_second: 1 << 20,
                burst_ms: 0,
            }),
            // Not the kernel's: a clone's first contents (the manager's), the claim (the API
            // and the metrics), whether to lower settings to the node (validate's).
            source: None,
            claim: None,
            fit_to_node: false,
        };
        // The node's configuration, not the request: its defaults are what a node runs with.
        let settings = crate::config::Settings {
            allowed_roots: vec![root.path().to_owned()],
            ..crate::config::Settings::default()
        };
        let record =
            crate::validate::spec(VolumeId::parse("v").unwrap(), Some(&request), &settings)
                .unwrap();
        let spec = device_spec(&record, Path::new("/dev/shm/ublkd"));
        let VolumeRecord {
            id: _,              // the registry's file name; the API's id
            size_bytes,         // the kernel's capacity
            block_size,         // the kernel's logical block
            backend, // the dataplane's backend (each_kind_is_served_and_reported_as_itself)
            queues,  // the kernel's queues
            queue_depth, // and their depth
            io_path, // BATCH_IO or not
            created_unix_ms: _, // the API only
            dev_id,  // the kernel's device id
            deleting: _, // the manager's (a delete in progress)
            delete_backing: _, // the manager's
            zero_copy, // AUTO_BUF_REG
            poll,    // the dataplane's polling (no kernel flag)
            qos,     // the workers' buckets
            source: _, // the manager's (a clone's first contents)
            claim: _, // the API and the metrics
            adjustments: _, // the API (what fit_to_node lowered)
            erase_pending: _, // the manager's (an erase to finish)
        } = &record;
        assert_eq!(
            (
                spec.size_bytes,
                spec.block_size,
                spec.queues,
                spec.queue_depth
            ),
            (*size_bytes, *block_size, *queues, *queue_depth)
        );
        assert_eq!(
            (spec.io_path, spec.zero_copy, spec.poll),
            (*io_path, *zero_copy, *poll)
        );
        assert_eq!((spec.qos, spec.dev_id), (*qos, *dev_id));
        assert_eq!(spec.backend.kind(), backend.kind().name());
        assert_eq!(
            (
                *size_bytes,
                *block_size,
                *queues,
                *queue_depth,
                *io_path,
                *zero_copy,
                *poll
            ),
            (64 << 20, 512, 2, 32, IoPath::Batch, Toggle::On, Toggle::Off),
            "the request's every choice reached the record"
        );
        assert_eq!((qos.read_iops, qos.write_bytes_per_sec), (1000, 1 << 20));
        let shape = spec.made_shape(IoPath::Batch, true);
        assert_eq!(shape.dev_sectors * 512, 64 << 20);
        assert_eq!(
            (shape.queues, shape.queue_depth, shape.logical_bs_shift),
            (2, 32, 9)
        );
        assert_eq!(
            spec.takeover_mismatch(&shape),
            None,
            "the record takes its device over"
        );
        let api = volume_proto(&crate::volume::Volume::creating(record.clone()));
        let back = api.spec.unwrap_or_default();
        assert_eq!(
            (
                back.size_bytes,
                back.block_size,
                back.queues,
                back.queue_depth
            ),
            (
                request.size_bytes,
                request.block_size,
                request.queues,
                request.queue_depth
            )
        );
        assert_eq!(
            (back.io_path, back.zero_copy, back.poll),
            (request.io_path, request.zero_copy, request.poll)
        );
        assert_eq!(back.backend, request.backend);
        assert_eq!(
            back.qos.map(|q| (q.read_iops, q.write_bytes_per_second)),
            Some((1000, 1 << 20))
        );
    }
}
