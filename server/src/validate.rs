//! What clients send, checked and read once into the domain's types: volume ids, specs (their
//! API enums and limits decoded here; `convert` is the way out), and backing-file paths.

use crate::backend::BackendRecord;
use crate::config::Settings;
use crate::error::{truncate, VolumeError};
use crate::record::{AdjustedSetting, Adjustment, ClaimRecord, SourceRecord, VolumeRecord};
use crate::snapshot::SnapshotId;
use crate::volume_id::VolumeId;
use ublkd_dataplane::{IoPath, QosLimits, Toggle};
use ublkd_proto::v1;

/// A volume id is a DNS label (`VolumeId::parse`).
pub fn volume_id(id: &str) -> Result<VolumeId, VolumeError> {
    Ok(VolumeId::parse(id)?)
}

/// Turns a CreateVolume spec into the record to store, applying defaults and limits.
pub fn spec(
    id: VolumeId,
    spec: Option<&v1::VolumeSpec>,
    s: &Settings,
) -> Result<VolumeRecord, VolumeError> {
    let invalid = |m: String| Err(VolumeError::ValidateRequest(m));
    let Some(spec) = spec else {
        return invalid("spec is required".into());
    };
    let block_size = spec.block_size.unwrap_or(s.defaults.block_size);
    if block_size != 512 && block_size != 4096 {
        return invalid(format!("block_size {block_size} must be 512 or 4096"));
    }
    size(spec.size_bytes, block_size, s)?;
    let mut adjustments = Vec::new();
    // Above the node's limit: lowered to it when the client asks to fit (and said), else
    // refused.
    let mut fit = |setting: AdjustedSetting, asked: u32, max: u32| {
        if spec.fit_to_node && asked > max {
            adjustments.push(Adjustment {
                setting,
                requested: asked,
                applied: max,
            });
            max
        } else {
            asked
        }
    };
    let max_queues = if s.limits.max_queues == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get()) as u32
    } else {
        u32::from(s.limits.max_queues)
    };
    let queues = fit(
        AdjustedSetting::Queues,
        spec.queues.unwrap_or(u32::from(s.defaults.queues)),
        max_queues,
    );
    let max_depth = u32::from(s.limits.max_queue_depth.min(4096));
    let depth = fit(
        AdjustedSetting::QueueDepth,
        spec.queue_depth
            .unwrap_or(u32::from(s.defaults.queue_depth)),
        max_depth,
    );
    if queues == 0 || queues > max_queues {
        return invalid(format!("queues {queues} must be from 1 to {max_queues}"));
    }
    if depth == 0 || depth > max_depth {
        return invalid(format!("queue_depth {depth} must be from 1 to {max_depth}"));
    }
    let Some(io_path) = io_path(spec.io_path) else {
        return invalid(format!("unknown io_path {}", spec.io_path));
    };
    let backend = BackendRecord::from_request(spec.backend.as_ref(), s)?;
    let toggle = |v: i32, what: &str| {
        toggle(v).ok_or_else(|| VolumeError::ValidateRequest(format!("unknown {what} setting {v}")))
    };
    let zero_copy = toggle(spec.zero_copy, "zero_copy")?;
    let poll = toggle(spec.poll, "poll")?;
    let qos = qos(spec.qos.as_ref())?;
    let source = source(spec.source.as_ref(), &backend)?;
    if source.as_ref() == Some(&SourceRecord::Volume(id.clone())) {
        return invalid(format!(
            "volume {id} cannot be cloned from itself: name another volume or a snapshot"
        ));
    }
    let claim = claim(spec.claim.as_ref())?;
    Ok(VolumeRecord {
        id,
        size_bytes: spec.size_bytes,
        block_size,
        backend,
        queues: queues as u16,
        queue_depth: depth as u16,
        io_path,
        created_unix_ms: 0,
        dev_id: None,
        deleting: false,
        delete_backing: false,
        zero_copy,
        poll,
        qos,
        source,
        claim,
        adjustments,
        erase_pending: None,
    })
}

/// The Kubernetes claim of a spec: absent when every field is empty; each field empty or a
/// Kubernetes object name (lower-case letters, digits, '-' and '.', at most 253 characters).
pub fn claim(c: Option<&v1::Claim>) -> Result<Option<ClaimRecord>, VolumeError> {
    let Some(c) = c else { return Ok(None) };
    if c.namespace.is_empty() && c.name.is_empty() && c.persistent_volume.is_empty() {
        return Ok(None);
    }
    for (what, v) in [
        ("namespace", &c.namespace),
        ("name", &c.name),
        ("persistent_volume", &c.persistent_volume),
    ] {
        let ok = v.len() <= 253
            && v.bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !ok {
            return Err(VolumeError::ValidateRequest(format!(
                "claim {what} {:?} is not a Kubernetes object name",
                truncate(v)
            )));
        }
    }
    Ok(Some(ClaimRecord {
        namespace: c.namespace.clone(),
        name: c.name.clone(),
        persistent_volume: c.persistent_volume.clone(),
    }))
}

/// Whether the request leaves an NVMe window's offset to ublkd.
pub fn places_window(spec: Option<&v1::VolumeSpec>) -> bool {
    matches!(
        spec.and_then(|s| s.backend.as_ref()),
        Some(v1::volume_spec::Backend::Nvme(n)) if n.offset_bytes.is_none()
    )
}

/// A clone's source (CreateVolume): only file volumes are made by reflink.
fn source(
    src: Option<&v1::volume_spec::Source>,
    backend: &BackendRecord,
) -> Result<Option<SourceRecord>, VolumeError> {
    use v1::volume_spec::Source;
    let Some(src) = src else {
        return Ok(None);
    };
    if !matches!(backend, BackendRecord::File { .. }) {
        return Err(VolumeError::ValidateRequest(
            "a volume made from a snapshot or volume needs a file backend: its backing file is \
             a reflink of the source's"
                .into(),
        ));
    }
    Ok(Some(match src {
        Source::FromSnapshot(id) => {
            SourceRecord::Snapshot(SnapshotId::parse(id).map_err(VolumeError::ValidateRequest)?)
        }
        Source::FromVolume(id) => SourceRecord::Volume(volume_id(id)?),
    }))
}

/// A snapshot id from the API.
pub fn snapshot_id(id: &str) -> Result<SnapshotId, VolumeError> {
    SnapshotId::parse(id).map_err(VolumeError::ValidateRequest)
}

/// Most burst a volume may ask for.
const MAX_BURST_MS: u32 = 60_000;

/// I/O limits from the API (unset: unlimited).
pub fn qos(q: Option<&v1::QosLimits>) -> Result<QosLimits, VolumeError> {
    let Some(q) = q else {
        return Ok(QosLimits::default());
    };
    if q.burst_ms > MAX_BURST_MS {
        return Err(VolumeError::ValidateRequest(format!(
            "qos burst_ms {} must be at most {MAX_BURST_MS}",
            q.burst_ms
        )));
    }
    Ok(qos_limits(q))
}

/// API I/O limits as the dataplane's.
fn qos_limits(q: &v1::QosLimits) -> QosLimits {
    QosLimits {
        read_iops: q.read_iops,
        write_iops: q.write_iops,
        read_bytes_per_sec: q.read_bytes_per_second,
        write_bytes_per_sec: q.write_bytes_per_second,
        burst_ms: q.burst_ms,
    }
}

/// An API I/O path; None for a number the API does not define.
pub fn io_path(v: i32) -> Option<IoPath> {
    Some(match v1::IoPath::try_from(v).ok()? {
        v1::IoPath::Auto => IoPath::Auto,
        v1::IoPath::Batch => IoPath::Batch,
        v1::IoPath::PerIo => IoPath::PerIo,
    })
}

/// An API toggle; None for a number the API does not define.
pub fn toggle(v: i32) -> Option<Toggle> {
    Some(match v1::Toggle::try_from(v).ok()? {
        v1::Toggle::Auto => Toggle::Auto,
        v1::Toggle::On => Toggle::On,
        v1::Toggle::Off => Toggle::Off,
    })
}

/// `auto`, `on` or `off`.
pub fn toggle_name(s: &str) -> Option<Toggle> {
    [Toggle::Auto, Toggle::On, Toggle::Off]
        .into_iter()
        .find(|t| t.name() == s)
}

/// A volume size: positive, a multiple of the block size, within the configured maximum.
pub fn size(bytes: u64, block_size: u32, s: &Settings) -> Result<(), VolumeError> {
    if bytes == 0 {
        return Err(VolumeError::ValidateRequest(
            "size_bytes must be greater than 0".into(),
        ));
    }
    if bytes % u64::from(block_size) != 0 {
        return Err(VolumeError::ValidateRequest(format!(
            "size_bytes {bytes} is not a multiple of the block size {block_size}"
        )));
    }
    if bytes > s.limits.max_volume_size_bytes {
        return Err(VolumeError::ValidateRequest(format!(
            "size_bytes {bytes} exceeds the limit of {} bytes",
            s.limits.max_volume_size_bytes
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::MAX_PATH_BYTES;
    use std::path::Path;

    fn vid(s: &str) -> VolumeId {
        VolumeId::parse(s).unwrap()
    }

    #[test]
    fn api_enums_round_trip_and_unknown_numbers_are_none() {
        for p in [IoPath::Auto, IoPath::Batch, IoPath::PerIo] {
            assert_eq!(io_path(crate::convert::io_path_to_proto(p) as i32), Some(p));
            // The dataplane's name (logs, metric labels, records) is the API notation's.
            let api = ublkd_proto::notation::parse_io_path(p.name()).unwrap();
            assert_eq!(io_path(api as i32), Some(p));
        }
        for t in [Toggle::Auto, Toggle::On, Toggle::Off] {
            assert_eq!(toggle(crate::convert::toggle_to_proto(t) as i32), Some(t));
            assert_eq!(toggle_name(t.name()), Some(t));
        }
        assert_eq!(io_path(99), None);
        assert_eq!(toggle(-1), None);
        assert_eq!(toggle_name("yes"), None);
    }

    #[test]
    fn ids_follow_dns_label_rules() {
        for ok in ["a", "vol-1", "0abc", &"x".repeat(63)] {
            assert!(volume_id(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "-a",
            "a-",
            "A",
            "a_b",
            "a.b",
            "é",
            &"x".repeat(64),
            "a b",
        ] {
            assert!(volume_id(bad).is_err(), "{bad}");
        }
    }

    fn settings(root: &Path) -> Settings {
        Settings {
            allowed_roots: vec![root.to_path_buf()],
            ..Settings::default()
        }
    }

    fn file_spec(path: &str, create: bool) -> v1::VolumeSpec {
        v1::VolumeSpec {
            size_bytes: 1 << 20,
            backend: Some(v1::volume_spec::Backend::File(v1::FileBackend {
                path: path.into(),
                create,
            })),
            ..Default::default()
        }
    }

    /// A clone of a volume from itself would wait for its own operation lock forever (issue 22,
    /// item 7): it is refused before anything is taken.
    #[test]
    fn a_volume_cannot_be_cloned_from_itself() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let path = dir.path().join("c.img");
        let mut spec = file_spec(&path.to_string_lossy(), true);
        spec.source = Some(v1::volume_spec::Source::FromVolume("c".into()));
        match super::spec(vid("c"), Some(&spec), &s) {
            Err(VolumeError::ValidateRequest(m)) => assert!(m.contains("itself"), "{m}"),
            other => panic!("a clone from itself must be INVALID_ARGUMENT, got {other:?}"),
        }
        // From another volume it is fine.
        spec.source = Some(v1::volume_spec::Source::FromVolume("d".into()));
        assert!(super::spec(vid("c"), Some(&spec), &s).is_ok());
    }

    #[test]
    fn spec_defaults_and_limits() {
        let dir = tempfile::tempdir().unwrap();
        let s = settings(dir.path());
        let mut spec = v1::VolumeSpec {
            size_bytes: 1 << 30,
            backend: Some(v1::volume_spec::Backend::Ram(v1::RamBackend {})),
            ..Default::default()
        };
        let r = super::spec(vid("v"), Some(&spec), &s).unwrap();
        assert_eq!((r.block_size, r.queues, r.queue_depth), (4096, 1, 128));
        assert_eq!(r.io_path, ublkd_dataplane::IoPath::Auto);
        spec.queues = Some(0);
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        spec.queues = Some(1);
        spec.queue_depth = Some(5000);
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        spec.queue_depth = None;
        spec.size_bytes = 4097;
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        spec.size_bytes = 128 << 40;
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        spec.size_bytes = 4096;
        spec.backend = None;
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        assert!(super::spec(vid("v"), None, &s).is_err());
    }

    /// A client that asks to fit (the CSI driver) gets the node's limits instead of a refusal,
    /// each lowered setting recorded with what it asked; one that does not is refused as before.
    #[test]
    fn settings_above_the_node_are_lowered_when_asked_to_fit_and_said() {
        let dir = tempfile::tempdir().unwrap();
        let mut s = settings(dir.path());
        s.limits.max_queues = 4;
        let mut spec = v1::VolumeSpec {
            size_bytes: 1 << 20,
            backend: Some(v1::volume_spec::Backend::Ram(v1::RamBackend {})),
            queues: Some(64),
            queue_depth: Some(8192),
            ..Default::default()
        };
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
        spec.fit_to_node = true;
        let r = super::spec(vid("v"), Some(&spec), &s).unwrap();
        assert_eq!((r.queues, r.queue_depth), (4, 4096));
        assert_eq!(
            r.adjustments,
            [
                Adjustment {
                    setting: AdjustedSetting::Queues,
                    requested: 64,
                    applied: 4
                },
                Adjustment {
                    setting: AdjustedSetting::QueueDepth,
                    requested: 8192,
                    applied: 4096
                }
            ]
        );
        // Within the limits, nothing to say; zero is still refused.
        spec.queues = Some(2);
        spec.queue_depth = Some(64);
        let r = super::spec(vid("v"), Some(&spec), &s).unwrap();
        assert!(r.adjustments.is_empty());
        spec.queues = Some(0);
        assert!(super::spec(vid("v"), Some(&spec), &s).is_err());
    }

    /// The part of the VM suite's bad-request matrix that validation decides, on the host: each
    /// request, the code its error maps to, and a word the message must carry.
    #[test]
    fn bad_requests_get_precise_codes() {
        use tonic::Code;
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        std::fs::write(dir.path().join("outside.img"), b"").unwrap();
        std::os::unix::fs::symlink(dir.path().join("outside.img"), root.join("escape.img"))
            .unwrap();
        let mut s = settings(&root);
        s.limits.max_volume_size_bytes = 1 << 30;
        s.limits.max_queues = 8;
        s.limits.max_queue_depth = 1024;
        let r = root.display().to_string();
        let ok = || v1::VolumeSpec {
            size_bytes: 64 << 20,
            backend: Some(v1::volume_spec::Backend::Ram(v1::RamBackend {})),
            ..Default::default()
        };
        let with = |f: &dyn Fn(&mut v1::VolumeSpec)| {
            let mut spec = ok();
            f(&mut spec);
            Some(spec)
        };
        let file = |p: &str, create| Some(file_spec(p, create));
        let nvme = |d: &str, offset_bytes: u64, length_bytes| {
            with(&|s| {
                s.backend = Some(v1::volume_spec::Backend::Nvme(v1::NvmeBackend {
                    device: d.into(),
                    offset_bytes: Some(offset_bytes),
                    length_bytes,
                    keep_data: false,
                    identity: String::new(),
                }))
            })
        };
        let long = format!("/{}", "a".repeat(MAX_PATH_BYTES + 10));
        let table: Vec<(&str, &str, Option<v1::VolumeSpec>, Code, &str)> = vec![
            (
                "empty id",
                "",
                Some(ok()),
                Code::InvalidArgument,
                "volume id",
            ),
            (
                "upper-case id",
                "Vol",
                Some(ok()),
                Code::InvalidArgument,
                "volume id",
            ),
            (
                "id with underscore",
                "a_b",
                Some(ok()),
                Code::InvalidArgument,
                "volume id",
            ),
            (
                "no spec",
                "x",
                None,
                Code::InvalidArgument,
                "spec is required",
            ),
            (
                "size 0",
                "x",
                with(&|s| s.size_bytes = 0),
                Code::InvalidArgument,
                "greater than 0",
            ),
            (
                "size unaligned",
                "x",
                with(&|s| s.size_bytes = 4097),
                Code::InvalidArgument,
                "multiple",
            ),
            (
                "size over the limit",
                "x",
                with(&|s| s.size_bytes = 2 << 30),
                Code::InvalidArgument,
                "limit",
            ),
            (
                "block size 1024",
                "x",
                with(&|s| s.block_size = Some(1024)),
                Code::InvalidArgument,
                "512 or 4096",
            ),
            (
                "no backend",
                "x",
                with(&|s| s.backend = None),
                Code::InvalidArgument,
                "backend is required",
            ),
            (
                "queues 0",
                "x",
                with(&|s| s.queues = Some(0)),
                Code::InvalidArgument,
                "queues",
            ),
            (
                "queues over the limit",
                "x",
                with(&|s| s.queues = Some(9)),
                Code::InvalidArgument,
                "queues",
            ),
            (
                "depth 0",
                "x",
                with(&|s| s.queue_depth = Some(0)),
                Code::InvalidArgument,
                "queue_depth",
            ),
            (
                "depth over the limit",
                "x",
                with(&|s| s.queue_depth = Some(2048)),
                Code::InvalidArgument,
                "queue_depth",
            ),
            (
                "unknown io path",
                "x",
                with(&|s| s.io_path = 7),
                Code::InvalidArgument,
                "io_path",
            ),
            (
                "unknown zero copy",
                "x",
                with(&|s| s.zero_copy = 9),
                Code::InvalidArgument,
                "zero_copy",
            ),
            (
                "unknown poll",
                "x",
                with(&|s| s.poll = -1),
                Code::InvalidArgument,
                "poll",
            ),
            (
                "nvme device outside /dev",
                "x",
                nvme("ng0n1", 0, 0),
                Code::InvalidArgument,
                "/dev",
            ),
            (
                "nvme window overflowing",
                "x",
                nvme("/dev/ng0n1", u64::MAX, 1),
                Code::InvalidArgument,
                "overflows",
            ),
            (
                "relative path",
                "x",
                file("rel.img", true),
                Code::InvalidArgument,
                "absolute",
            ),
            (
                "path outside the roots",
                "x",
                file("/etc/passwd", false),
                Code::PermissionDenied,
                "outside",
            ),
            (
                "path with ..",
                "x",
                file(&format!("{r}/../outside.img"), false),
                Code::InvalidArgument,
                "..",
            ),
            (
                "symlink escaping the roots",
                "x",
                file(&format!("{r}/escape.img"), false),
                Code::PermissionDenied,
                "outside",
            ),
            (
                "missing file without create",
                "x",
                file(&format!("{r}/nope.img"), false),
                Code::NotFound,
                "create",
            ),
            (
                "missing directory",
                "x",
                file(&format!("{r}/no/dir.img"), true),
                Code::NotFound,
                "directory",
            ),
            (
                "path longer than PATH_MAX",
                "x",
                file(&long, true),
                Code::InvalidArgument,
                "longer than",
            ),
        ];
        for (what, id, spec, code, word) in table {
            let got = volume_id(id).and_then(|id| super::spec(id, spec.as_ref(), &s));
            let err = got.expect_err(what);
            assert_eq!(err.code(), code, "{what}: {err}");
            let status = tonic::Status::from(err);
            assert!(
                status.message().contains(word),
                "{what}: {}",
                status.message()
            );
            assert!(status.message().len() <= 1024, "{what}: message bounded");
        }
        // And the good one passes.
        assert!(super::spec(vid("x"), Some(&ok()), &s).is_ok());
    }

    #[test]
    fn backing_paths_stay_inside_the_roots() {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().join("root");
        std::fs::create_dir(&root).unwrap();
        let s = settings(&root);
        std::fs::write(root.join("ok.img"), b"").unwrap();
        std::fs::write(dir.path().join("secret"), b"").unwrap();
        std::os::unix::fs::symlink(dir.path().join("secret"), root.join("escape")).unwrap();
        let p = |path: &Path, create| file_spec(path.to_str().unwrap(), create);
        let check = |spec: v1::VolumeSpec| super::spec(vid("v"), Some(&spec), &s);
        assert!(check(p(&root.join("ok.img"), false)).is_ok());
        assert!(check(p(&root.join("new.img"), true)).is_ok());
        // The snapshots' directory is no place for a volume (issue 22, item 14).
        let snaps = root.join(crate::snapshot::SNAPSHOT_DIR);
        std::fs::create_dir(&snaps).unwrap();
        std::fs::write(snaps.join("s.img"), b"").unwrap();
        for (path, create) in [(snaps.join("s.img"), false), (snaps.join("n.img"), true)] {
            match check(p(&path, create)) {
                Err(VolumeError::ValidateRequest(m)) => assert!(m.contains("snapshots"), "{m}"),
                other => panic!("{}: {other:?}", path.display()),
            }
        }
        assert!(matches!(
            check(p(&root.join("new.img"), false)),
            Err(VolumeError::BackingPathMissing(_))
        ));
        assert!(matches!(
            check(p(&dir.path().join("secret"), false)),
            Err(VolumeError::BackingPathOutsideRoots(_))
        ));
        assert!(matches!(
            check(p(&root.join("escape"), false)),
            Err(VolumeError::BackingPathOutsideRoots(_))
        ));
        assert!(matches!(
            check(p(&root.join("../secret"), false)),
            Err(VolumeError::ValidateRequest(_))
        ));
        assert!(matches!(
            check(file_spec("relative.img", true)),
            Err(VolumeError::ValidateRequest(_))
        ));
    }
}
