//! CSI requests as the kubelet and the external-provisioner send them.
use super::{ensure, guest, Channel, Pair, Path, Result};
use ublkd_csi::spec::{
    self,
    controller_client::ControllerClient,
    node_client::NodeClient,
    volume_capability::{access_mode::Mode, AccessMode, AccessType, BlockVolume, MountVolume},
    VolumeCapability,
};

pub fn mount_cap(fs: &str) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode {
            mode: Mode::SingleNodeWriter as i32,
        }),
        access_type: Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            ..Default::default()
        })),
    }
}

pub fn block_cap(mode: Mode) -> VolumeCapability {
    VolumeCapability {
        access_mode: Some(AccessMode { mode: mode as i32 }),
        access_type: Some(AccessType::Block(BlockVolume {})),
    }
}

pub fn create(
    name: &str,
    size: u64,
    params: &[(&str, String)],
    cap: VolumeCapability,
) -> spec::CreateVolumeRequest {
    spec::CreateVolumeRequest {
        name: name.into(),
        capacity_range: Some(spec::CapacityRange {
            required_bytes: size as i64,
            limit_bytes: 0,
        }),
        volume_capabilities: vec![cap],
        parameters: params
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.clone()))
            .collect(),
        ..Default::default()
    }
}

pub async fn clients(pair: &Pair) -> Result<(ControllerClient<Channel>, NodeClient<Channel>)> {
    let ch = pair.channel().await?;
    Ok((ControllerClient::new(ch.clone()), NodeClient::new(ch)))
}

pub fn stage(id: &str, staging: &Path, cap: VolumeCapability) -> spec::NodeStageVolumeRequest {
    spec::NodeStageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn publish(
    id: &str,
    staging: &Path,
    target: &Path,
    cap: VolumeCapability,
) -> spec::NodePublishVolumeRequest {
    spec::NodePublishVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
        target_path: target.display().to_string(),
        volume_capability: Some(cap),
        ..Default::default()
    }
}

pub fn unpublish(id: &str, target: &Path) -> spec::NodeUnpublishVolumeRequest {
    spec::NodeUnpublishVolumeRequest {
        volume_id: id.into(),
        target_path: target.display().to_string(),
    }
}

pub fn unstage(id: &str, staging: &Path) -> spec::NodeUnstageVolumeRequest {
    spec::NodeUnstageVolumeRequest {
        volume_id: id.into(),
        staging_target_path: staging.display().to_string(),
    }
}

pub fn is_mountpoint(p: &Path) -> bool {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let p = p.display().to_string();
    text.lines()
        .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
}

/// Bytes of the file system at `p` (`stat -f`).
pub fn fs_bytes(p: &Path) -> Result<u64> {
    let out = guest::sh(&format!("stat -f -c '%S %b' {}", p.display()))?;
    let n: Vec<u64> = out
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect();
    ensure!(n.len() == 2, "stat -f: {out}");
    Ok(n[0] * n[1])
}
