//! The CSI Node service: stage (make and mount the file system), publish (bind it into the
//! pod), unpublish, unstage, expand, stats. The device is looked up in ublkd every time, never
//! cached: after a ublkd restart it is the same device, and ublkd is the one that knows.
//! Unpublish and unstage never delete anything: a pod restart must find its data.

use crate::caps::{self, Access};
use crate::crypt;
use crate::error::CsiError;
use crate::mount;
use crate::naming;
use crate::params::{Encryption, FsType};
use crate::size;
use crate::spec::volume_capability::access_mode::Mode;
use crate::spec::{self, node_server::Node as NodeApi};
use crate::ublkd::Ublkd;
use crate::{Node, TOPOLOGY_KEY};
use std::collections::{HashMap, HashSet};
use std::path::{Component, Path, PathBuf};
use std::sync::{Arc, Mutex, PoisonError};
use tonic::{Request, Response, Status};
use ublkd_client::v1;

/// The StorageClass parameters that name the Secrets an encrypted volume's key comes from.
const STAGE_SECRET: &str = "csi.storage.k8s.io/node-stage-secret-name";
const EXPAND_SECRET: &str = "csi.storage.k8s.io/node-expand-secret-name";

#[derive(Debug, Clone)]
pub struct NodeService {
    pub ublkd: Ublkd,
    pub node: Node,
    /// Staging and target paths must lie under it (the kubelet's directory).
    pub kubelet_dir: PathBuf,
    /// Volumes with an operation in progress: a second one at the same time is ABORTED.
    pub busy: Arc<Mutex<HashSet<String>>>,
    /// Where a grow ublkd refused goes to be a Warning on the claim (None without fault events:
    /// the refusal is then in the log and the kubelet's conditions only).
    pub refusals: Option<crate::faults::Refusals>,
}

/// Marks a volume busy for as long as it lives.
#[derive(Debug)]
pub struct Busy {
    set: Arc<Mutex<HashSet<String>>>,
    id: String,
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.id);
    }
}

impl NodeService {
    fn begin(&self, id: &str) -> Result<Busy, CsiError> {
        let mut set = self.busy.lock().unwrap_or_else(PoisonError::into_inner);
        if !set.insert(id.to_owned()) {
            return Err(CsiError::OperationPending(id.to_owned()));
        }
        Ok(Busy {
            set: Arc::clone(&self.busy),
            id: id.to_owned(),
        })
    }

    /// `raw`, which must be an absolute path under the kubelet directory with no `..`.
    fn path(&self, raw: &str, field: &'static str) -> Result<PathBuf, CsiError> {
        if raw.is_empty() {
            return Err(CsiError::MissingField(field));
        }
        let p = PathBuf::from(raw);
        let clean = p.is_absolute() && !p.components().any(|c| c == Component::ParentDir);
        // Strictly below it: the kubelet directory itself is never a volume's path.
        if !clean || !p.starts_with(&self.kubelet_dir) || p == self.kubelet_dir {
            return Err(CsiError::PathOutsideKubelet {
                path: p,
                kubelet: self.kubelet_dir.clone(),
            });
        }
        Ok(p)
    }

    /// Volume `id`'s block device, if the volume serves I/O now.
    async fn device(&self, id: &str) -> Result<(v1::Volume, PathBuf), CsiError> {
        let v = self
            .ublkd
            .get(id)
            .await?
            .ok_or_else(|| CsiError::VolumeNotFound(id.to_owned()))?;
        match v.state() {
            v1::VolumeState::Ready => {
                let dev = PathBuf::from(&v.device_path);
                Ok((v, dev))
            }
            v1::VolumeState::Failed => Err(CsiError::VolumeFailed {
                id: id.to_owned(),
                message: v.message,
            }),
            v1::VolumeState::Deleting => Err(CsiError::VolumeNotFound(id.to_owned())),
            other => Err(CsiError::VolumeNotReady {
                id: id.to_owned(),
                state: naming::state_name(other),
            }),
        }
    }

    async fn stage(&self, req: spec::NodeStageVolumeRequest) -> Result<(), CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        let staging = self.path(&req.staging_target_path, "staging_target_path")?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or(CsiError::MissingField("volume_capability"))?;
        let (access, read_only) = caps::check(cap, default_fs(&req.volume_context))?;
        let encryption = Encryption::of_context(&req.volume_context)?;
        // The key first: a missing one fails before the device is touched.
        let key = match encryption {
            Encryption::Luks2 => Some(crypt::Key::from_secrets(&req.secrets, STAGE_SECRET)?),
            Encryption::None => None,
        };
        let _busy = self.begin(&req.volume_id)?;
        let (_, ublk) = self.device(&req.volume_id).await?;
        // An encrypted volume's file system lives on its mapping. `unwritten`: the LUKS2
        // header says nothing was ever written through it, so its (decrypted) bytes are noise
        // that need no blank check.
        let (dev, unwritten) = match &key {
            Some(key) => {
                let opened = crypt::open(&req.volume_id, &ublk, key)?;
                (opened.path, opened.unwritten)
            }
            None => (ublk.clone(), false),
        };
        let Access::Mount { fs, flags } = access else {
            // Block access: the device (or its mapping) is published straight from /dev, and
            // the pod may write through it from now on.
            if unwritten {
                crypt::mark_written(&ublk)?;
            }
            return Ok(());
        };
        let want = mount::dev_number(&dev)?;
        if let Some(m) = mount::mounted_at(&staging)? {
            if m.holds(&dev, &want) {
                return Ok(());
            }
            return Err(CsiError::PathTaken {
                path: staging,
                device: m.source,
            });
        }
        std::fs::create_dir_all(&staging).map_err(|source| CsiError::Io {
            step: "creating",
            path: staging.clone(),
            source,
        })?;
        // A device that cannot be read right now is refused (UNAVAILABLE, the kubelet
        // retries).
        mount::read_head(&dev)?;
        match mount::signature(&dev)? {
            None => {
                // blkid's "nothing" may be "could not read" (it probes the device's end too):
                // only a device whose two ends read back as zeroes is formatted (or a mapping
                // nothing was written through).
                if !unwritten {
                    mount::check_blank(&dev, mount::read_ends(&dev)?)?;
                }
                tracing::info!(volume = %req.volume_id, fs = fs.name(), device = %dev.display(), "making a file system");
                mount::mkfs(fs, &dev)?;
            }
            Some(t) if t == fs.name() => {}
            Some(other) => {
                return Err(CsiError::ForeignFileSystem {
                    device: dev,
                    found: other,
                    wanted: fs.name(),
                })
            }
        }
        if unwritten {
            // Only once the file system is there: a crash before this makes it again.
            crypt::mark_written(&ublk)?;
        }
        let mut flags = flags;
        if read_only {
            flags.push("ro".into());
        }
        mount::mount(&dev, &staging, fs, &flags)?;
        tracing::info!(volume = %req.volume_id, staging = %staging.display(), "volume staged");
        Ok(())
    }

    async fn unstage(&self, req: spec::NodeUnstageVolumeRequest) -> Result<(), CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        let staging = self.path(&req.staging_target_path, "staging_target_path")?;
        let _busy = self.begin(&req.volume_id)?;
        mount::unmount_all(&staging)?;
        crypt::close(&req.volume_id)?;
        tracing::info!(volume = %req.volume_id, staging = %staging.display(), "volume unstaged");
        Ok(())
    }

    async fn publish(&self, req: spec::NodePublishVolumeRequest) -> Result<(), CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        let target = self.path(&req.target_path, "target_path")?;
        let cap = req
            .volume_capability
            .as_ref()
            .ok_or(CsiError::MissingField("volume_capability"))?;
        let (access, mode_ro) = caps::check(cap, default_fs(&req.volume_context))?;
        let read_only = req.readonly || mode_ro;
        let encrypted = Encryption::of_context(&req.volume_context)? != Encryption::None;
        let _busy = self.begin(&req.volume_id)?;
        let (_, dev) = self.device(&req.volume_id).await?;
        // An encrypted volume is published from its mapping, which only stage opens: never
        // its device, which holds ciphertext.
        let dev = match (encrypted, crypt::is_open(&req.volume_id)) {
            (true, true) => crypt::mapping_path(&req.volume_id),
            (true, false) => {
                return Err(CsiError::VolumeFailed {
                    id: req.volume_id.clone(),
                    message: "its encrypted mapping is not open (not staged)".into(),
                })
            }
            (false, _) => dev,
        };
        let want = mount::dev_number(&dev)?;
        if let Some(m) = mount::mounted_at(&target)? {
            if m.holds(&dev, &want) {
                return Ok(());
            }
            return Err(CsiError::PathTaken {
                path: target,
                device: m.source,
            });
        }
        let single_writer = cap
            .access_mode
            .as_ref()
            .is_some_and(|m| m.mode() == Mode::SingleNodeSingleWriter);
        if single_writer {
            // Published anywhere else under the kubelet directory (its staging mount aside)?
            let staging = PathBuf::from(&req.staging_target_path);
            if let Some(other) = mount::mounts()?.into_iter().find(|m| {
                m.holds(&dev, &want)
                    && m.target != staging
                    && m.target.starts_with(&self.kubelet_dir)
            }) {
                return Err(CsiError::PublishedElsewhere {
                    id: req.volume_id.clone(),
                    path: other.target,
                });
            }
        }
        let io = |step, path: &Path| {
            let path = path.to_owned();
            move |source| CsiError::Io { step, path, source }
        };
        let source = match access {
            Access::Block => {
                if let Some(parent) = target.parent() {
                    std::fs::create_dir_all(parent).map_err(io("creating", parent))?;
                }
                // A device node binds onto a file; an empty directory made for it goes.
                if target.is_dir() {
                    std::fs::remove_dir(&target).map_err(io("replacing", &target))?;
                }
                std::fs::OpenOptions::new()
                    .create(true)
                    .truncate(false)
                    .write(true)
                    .open(&target)
                    .map_err(io("creating", &target))?;
                dev
            }
            Access::Mount { .. } => {
                let staging = self.path(&req.staging_target_path, "staging_target_path")?;
                match mount::mounted_at(&staging)? {
                    Some(m) if m.holds(&dev, &want) => {}
                    _ => {
                        return Err(CsiError::VolumeFailed {
                            id: req.volume_id.clone(),
                            message: format!("not staged at {}", staging.display()),
                        })
                    }
                }
                std::fs::create_dir_all(&target).map_err(io("creating", &target))?;
                staging
            }
        };
        mount::bind(&source, &target, read_only)?;
        tracing::info!(volume = %req.volume_id, target = %target.display(), read_only, "volume published");
        Ok(())
    }

    async fn unpublish(&self, req: spec::NodeUnpublishVolumeRequest) -> Result<(), CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        let target = self.path(&req.target_path, "target_path")?;
        let _busy = self.begin(&req.volume_id)?;
        mount::unmount_all(&target)?;
        let removed = if target.is_dir() {
            std::fs::remove_dir(&target)
        } else {
            std::fs::remove_file(&target)
        };
        match removed {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                return Err(CsiError::Io {
                    step: "removing",
                    path: target,
                    source,
                })
            }
        }
        tracing::info!(volume = %req.volume_id, target = %target.display(), "volume unpublished");
        Ok(())
    }

    async fn stats(
        &self,
        req: spec::NodeGetVolumeStatsRequest,
    ) -> Result<spec::NodeGetVolumeStatsResponse, CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        if req.volume_path.is_empty() {
            return Err(CsiError::MissingField("volume_path"));
        }
        let path = PathBuf::from(&req.volume_path);
        if !path.exists() {
            return Err(CsiError::PathMissing(path));
        }
        // As for expand: confined once it is known to exist.
        let path = self.path(&req.volume_path, "volume_path")?;
        let v = self
            .ublkd
            .get(&req.volume_id)
            .await?
            .ok_or_else(|| CsiError::VolumeNotFound(req.volume_id.clone()))?;
        // The volume must be what is at that path (while it has a device to compare).
        if v.state() == v1::VolumeState::Ready {
            let dev = crypt::served(&req.volume_id, PathBuf::from(&v.device_path));
            let num = mount::dev_number(&dev)?;
            if !mount::mounted_at(&path)?.is_some_and(|m| m.holds(&dev, &num)) {
                return Err(CsiError::VolumeNotAtPath {
                    id: req.volume_id.clone(),
                    path,
                });
            }
        }
        let condition = spec::VolumeCondition {
            abnormal: v.state() != v1::VolumeState::Ready,
            message: match v.state() {
                v1::VolumeState::Ready => "ready".into(),
                v1::VolumeState::Failed => format!("failed: {}", v.message),
                other => naming::state_name(other).into(),
            },
        };
        use spec::volume_usage::Unit;
        let usage = if path.is_dir() {
            let (bytes, inodes) = mount::fs_usage(&path)?;
            vec![usage(Unit::Bytes, bytes), usage(Unit::Inodes, inodes)]
        } else {
            let size = mount::device_size(&path)?;
            vec![spec::VolumeUsage {
                total: i64::try_from(size).unwrap_or(i64::MAX),
                unit: Unit::Bytes as i32,
                ..Default::default()
            }]
        };
        Ok(spec::NodeGetVolumeStatsResponse {
            usage,
            volume_condition: Some(condition),
        })
    }

    async fn expand(
        &self,
        req: spec::NodeExpandVolumeRequest,
    ) -> Result<spec::NodeExpandVolumeResponse, CsiError> {
        if req.volume_id.is_empty() {
            return Err(CsiError::MissingField("volume_id"));
        }
        if req.volume_path.is_empty() {
            return Err(CsiError::MissingField("volume_path"));
        }
        let path = PathBuf::from(&req.volume_path);
        let _busy = self.begin(&req.volume_id)?;
        let (v, dev) = self.device(&req.volume_id).await?;
        // The key first: a missing one fails before the device grows.
        let key = if crypt::is_open(&req.volume_id) {
            Some(crypt::Key::from_secrets(&req.secrets, EXPAND_SECRET)?)
        } else {
            None
        };
        if !path.exists() {
            return Err(CsiError::PathMissing(path));
        }
        // An existing path must lie under the kubelet directory (a missing one is NOT_FOUND
        // first, as the spec and csi-sanity expect).
        let path = self.path(&req.volume_path, "volume_path")?;
        let spec = v.spec.clone().unwrap_or_default();
        let block = u64::from(spec.block_size.unwrap_or(4096));
        // Without a range, or with one that asks nothing (`{0, 0}`), the volume keeps its size
        // (the file system grows to the device), never the size a new volume would get.
        let size = match req.capacity_range.as_ref() {
            Some(r) if r.required_bytes > 0 || r.limit_bytes > 0 => size::size_for(Some(r), block)?,
            _ => spec.size_bytes,
        };
        let size = if size > spec.size_bytes {
            if let Err(e) = self.ublkd.resize(&req.volume_id, size).await {
                if let (crate::ublkd::UblkdError::Call(status), Some(refusals)) =
                    (&e, &self.refusals)
                {
                    refusals.tell(crate::faults::Refusal {
                        volume: v.clone(),
                        note: format!(
                            "node {} did not grow the volume to {size} bytes: {}",
                            self.node.0,
                            status.message()
                        ),
                    });
                }
                return Err(e.into());
            }
            size
        } else {
            spec.size_bytes
        };
        // The mapping grows with its device, then the file system with the mapping.
        let dev = match &key {
            Some(key) => {
                crypt::grow(&req.volume_id, key)?;
                crypt::mapping_path(&req.volume_id)
            }
            None => dev,
        };
        let block_access = req.volume_capability.as_ref().is_some_and(|c| {
            matches!(
                c.access_type,
                Some(spec::volume_capability::AccessType::Block(_))
            )
        });
        // A file system mounted there grows with the device; a device node bound onto a file
        // (block access, whether or not the request says so) has nothing more to grow.
        if !block_access && path.is_dir() {
            if let Some(m) = mount::mounted_at(&path)? {
                mount::grow(&m.fs_type, &dev, &path)?;
            }
        }
        tracing::info!(volume = %req.volume_id, size, "volume expanded");
        Ok(spec::NodeExpandVolumeResponse {
            capacity_bytes: i64::try_from(size).unwrap_or(i64::MAX),
        })
    }
}

fn usage(unit: spec::volume_usage::Unit, [total, available, used]: [u64; 3]) -> spec::VolumeUsage {
    let i = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    spec::VolumeUsage {
        available: i(available),
        total: i(total),
        used: i(used),
        unit: unit as i32,
    }
}

/// The file system CreateVolume recorded in the volume context, else ext4.
fn default_fs(context: &HashMap<String, String>) -> FsType {
    context
        .get("fsType")
        .and_then(|f| FsType::parse(f).ok())
        .unwrap_or(FsType::Ext4)
}

fn node_capability(t: spec::node_service_capability::rpc::Type) -> spec::NodeServiceCapability {
    spec::NodeServiceCapability {
        r#type: Some(spec::node_service_capability::Type::Rpc(
            spec::node_service_capability::Rpc { r#type: t as i32 },
        )),
    }
}

/// What the node plugin offers; the --resizer-only instance answers the same (the resizer asks
/// it whether volumes grow on the node).
pub fn capabilities() -> spec::NodeGetCapabilitiesResponse {
    use spec::node_service_capability::rpc::Type;
    spec::NodeGetCapabilitiesResponse {
        capabilities: [
            Type::StageUnstageVolume,
            Type::ExpandVolume,
            Type::GetVolumeStats,
            Type::VolumeCondition,
            Type::SingleNodeMultiWriter,
        ]
        .into_iter()
        .map(node_capability)
        .collect(),
    }
}

#[tonic::async_trait]
impl NodeApi for NodeService {
    async fn node_stage_volume(
        &self,
        req: Request<spec::NodeStageVolumeRequest>,
    ) -> Result<Response<spec::NodeStageVolumeResponse>, Status> {
        self.stage(req.into_inner()).await?;
        Ok(Response::new(spec::NodeStageVolumeResponse {}))
    }

    async fn node_unstage_volume(
        &self,
        req: Request<spec::NodeUnstageVolumeRequest>,
    ) -> Result<Response<spec::NodeUnstageVolumeResponse>, Status> {
        self.unstage(req.into_inner()).await?;
        Ok(Response::new(spec::NodeUnstageVolumeResponse {}))
    }

    async fn node_publish_volume(
        &self,
        req: Request<spec::NodePublishVolumeRequest>,
    ) -> Result<Response<spec::NodePublishVolumeResponse>, Status> {
        self.publish(req.into_inner()).await?;
        Ok(Response::new(spec::NodePublishVolumeResponse {}))
    }

    async fn node_unpublish_volume(
        &self,
        req: Request<spec::NodeUnpublishVolumeRequest>,
    ) -> Result<Response<spec::NodeUnpublishVolumeResponse>, Status> {
        self.unpublish(req.into_inner()).await?;
        Ok(Response::new(spec::NodeUnpublishVolumeResponse {}))
    }

    async fn node_get_volume_stats(
        &self,
        req: Request<spec::NodeGetVolumeStatsRequest>,
    ) -> Result<Response<spec::NodeGetVolumeStatsResponse>, Status> {
        Ok(Response::new(self.stats(req.into_inner()).await?))
    }

    async fn node_expand_volume(
        &self,
        req: Request<spec::NodeExpandVolumeRequest>,
    ) -> Result<Response<spec::NodeExpandVolumeResponse>, Status> {
        Ok(Response::new(self.expand(req.into_inner()).await?))
    }

    async fn node_get_capabilities(
        &self,
        _req: Request<spec::NodeGetCapabilitiesRequest>,
    ) -> Result<Response<spec::NodeGetCapabilitiesResponse>, Status> {
        Ok(Response::new(capabilities()))
    }

    /// The node's id (its name), its topology, and how many volumes it takes in all.
    async fn node_get_info(
        &self,
        _req: Request<spec::NodeGetInfoRequest>,
    ) -> Result<Response<spec::NodeGetInfoResponse>, Status> {
        let info = self.ublkd.node_info().await.map_err(CsiError::from)?;
        let cap = self
            .ublkd
            .capacity(v1::get_capacity_request::Backend::Ram(v1::RamBackend {}))
            .await
            .map_err(CsiError::from)?;
        Ok(Response::new(spec::NodeGetInfoResponse {
            node_id: self.node.0.clone(),
            max_volumes_per_node: i64::from(info.volumes) + i64::from(cap.volumes_left),
            accessible_topology: Some(spec::Topology {
                segments: HashMap::from([(TOPOLOGY_KEY.to_owned(), self.node.0.clone())]),
            }),
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn service() -> NodeService {
        NodeService {
            ublkd: Ublkd::new(
                ublkd_client::Target::Unix("/nonexistent/ublkd.sock".into()),
                Duration::from_secs(1),
            ),
            node: Node("n1".into()),
            kubelet_dir: "/var/lib/kubelet".into(),
            busy: Arc::default(),
            refusals: None,
        }
    }

    #[test]
    fn paths_must_lie_under_the_kubelet_directory() {
        let s = service();
        assert!(s
            .path("/var/lib/kubelet/pods/p/volumes/v", "target_path")
            .is_ok());
        for bad in [
            "/etc/passwd",
            "relative",
            "/var/lib/kubelet/../../etc",
            "/var/lib/kubeletx",
        ] {
            let e = s.path(bad, "target_path").expect_err(bad);
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad}");
        }
        assert_eq!(
            s.path("", "target_path").unwrap_err().code(),
            tonic::Code::InvalidArgument
        );
    }

    #[test]
    fn a_second_operation_on_a_volume_is_aborted_until_the_first_ends() {
        let s = service();
        let first = s.begin("v").unwrap();
        assert_eq!(s.begin("v").unwrap_err().code(), tonic::Code::Aborted);
        assert!(s.begin("w").is_ok(), "other volumes are not held up");
        drop(first);
        assert!(s.begin("v").is_ok());
    }
}
