//! `ublkd-csi ctl`: the driver's CSI calls from a shell, as the external-provisioner and the
//! kubelet make them. For demos, benchmarks and debugging a node without a cluster.

use crate::spec::{
    self,
    controller_client::ControllerClient,
    node_client::NodeClient,
    volume_capability::{access_mode::Mode, AccessMode, AccessType, BlockVolume, MountVolume},
    VolumeCapability,
};
use clap::{Args, Subcommand};
use std::collections::HashMap;
use tonic::transport::Channel;

#[derive(Debug, Args)]
pub struct Ctl {
    /// The driver's CSI socket.
    #[arg(long, default_value = "unix:///csi/csi.sock")]
    pub csi_endpoint: String,
    #[command(subcommand)]
    pub call: Call,
}

/// How the volume is accessed.
#[derive(Debug, Args, Clone)]
pub struct Access {
    /// File system for mount access.
    #[arg(long, default_value = "ext4")]
    fs: String,
    /// Raw block access instead of a file system.
    #[arg(long)]
    block: bool,
}

impl Access {
    fn capability(&self) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(if self.block {
                AccessType::Block(BlockVolume {})
            } else {
                AccessType::Mount(MountVolume {
                    fs_type: self.fs.clone(),
                    ..Default::default()
                })
            }),
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum Call {
    /// CreateVolume; prints the volume id
    Create {
        name: String,
        /// Bytes.
        #[arg(long)]
        size: u64,
        /// StorageClass parameters, KEY=VALUE.
        #[arg(long = "param", value_parser = key_value)]
        params: Vec<(String, String)>,
        /// VolumeAttributesClass parameters (I/O limits), KEY=VALUE.
        #[arg(long = "mutable-param", value_parser = key_value)]
        mutable_params: Vec<(String, String)>,
        /// Restore this snapshot into the new volume.
        #[arg(long, conflicts_with = "from_volume")]
        from_snapshot: Option<String>,
        /// Clone this volume into the new volume.
        #[arg(long)]
        from_volume: Option<String>,
        #[command(flatten)]
        access: Access,
    },
    /// DeleteVolume
    Delete { id: String },
    /// ControllerModifyVolume: new I/O limits, KEY=VALUE (readIops, writeBandwidth, ...)
    Modify {
        id: String,
        #[arg(long = "param", value_parser = key_value, required = true)]
        params: Vec<(String, String)>,
    },
    /// CreateSnapshot of a volume; prints the snapshot id
    Snapshot {
        name: String,
        /// The volume to take it of.
        #[arg(long)]
        source: String,
    },
    /// DeleteSnapshot
    DeleteSnapshot { id: String },
    /// NodeStageVolume
    Stage {
        id: String,
        staging: String,
        #[command(flatten)]
        access: Access,
    },
    /// NodePublishVolume
    Publish {
        id: String,
        staging: String,
        target: String,
        #[command(flatten)]
        access: Access,
        #[arg(long)]
        readonly: bool,
    },
    /// NodeUnpublishVolume
    Unpublish { id: String, target: String },
    /// NodeUnstageVolume
    Unstage { id: String, staging: String },
    /// NodeExpandVolume; prints the new capacity
    Expand {
        id: String,
        path: String,
        /// Bytes.
        #[arg(long)]
        size: u64,
    },
    /// NodeGetVolumeStats; prints usage and condition
    Stats { id: String, path: String },
    /// GetCapacity for StorageClass parameters; prints the available bytes
    Capacity {
        #[arg(long = "param", value_parser = key_value)]
        params: Vec<(String, String)>,
    },
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

fn range(size: u64) -> Option<spec::CapacityRange> {
    Some(spec::CapacityRange {
        required_bytes: i64::try_from(size).unwrap_or(i64::MAX),
        limit_bytes: 0,
    })
}

/// Runs one call and returns what to print.
pub async fn run(ctl: Ctl) -> anyhow::Result<String> {
    let target: ublkd_client::Target = ctl.csi_endpoint.parse().map_err(anyhow::Error::msg)?;
    let channel: Channel = ublkd_client::connect(&ublkd_client::Connection {
        target,
        tls: Default::default(),
        timeout: std::time::Duration::from_secs(60),
    })
    .await
    .map_err(|e| match e {
        ublkd_client::ConnectError::Unreachable { endpoint, cause } => {
            anyhow::anyhow!("cannot reach ublkd-csi at {endpoint}: {cause}")
        }
        other => other.into(),
    })?;
    let mut c = ControllerClient::new(channel.clone());
    let mut n = NodeClient::new(channel);
    Ok(match ctl.call {
        Call::Create {
            name,
            size,
            params,
            mutable_params,
            from_snapshot,
            from_volume,
            access,
        } => {
            use spec::volume_content_source::{SnapshotSource, Type, VolumeSource};
            let source = match (from_snapshot, from_volume) {
                (Some(snapshot_id), _) => Some(Type::Snapshot(SnapshotSource { snapshot_id })),
                (None, Some(volume_id)) => Some(Type::Volume(VolumeSource { volume_id })),
                (None, None) => None,
            };
            let v = c
                .create_volume(spec::CreateVolumeRequest {
                    name,
                    capacity_range: range(size),
                    volume_capabilities: vec![access.capability()],
                    parameters: params.into_iter().collect(),
                    mutable_parameters: mutable_params.into_iter().collect(),
                    volume_content_source: source
                        .map(|t| spec::VolumeContentSource { r#type: Some(t) }),
                    ..Default::default()
                })
                .await?
                .into_inner()
                .volume
                .unwrap_or_default();
            v.volume_id
        }
        Call::Delete { id } => {
            c.delete_volume(spec::DeleteVolumeRequest {
                volume_id: id,
                secrets: HashMap::new(),
            })
            .await?;
            String::new()
        }
        Call::Modify { id, params } => {
            c.controller_modify_volume(spec::ControllerModifyVolumeRequest {
                volume_id: id,
                mutable_parameters: params.into_iter().collect(),
                secrets: HashMap::new(),
            })
            .await?;
            String::new()
        }
        Call::Snapshot { name, source } => {
            c.create_snapshot(spec::CreateSnapshotRequest {
                source_volume_id: source,
                name,
                ..Default::default()
            })
            .await?
            .into_inner()
            .snapshot
            .unwrap_or_default()
            .snapshot_id
        }
        Call::DeleteSnapshot { id } => {
            c.delete_snapshot(spec::DeleteSnapshotRequest {
                snapshot_id: id,
                secrets: HashMap::new(),
            })
            .await?;
            String::new()
        }
        Call::Stage {
            id,
            staging,
            access,
        } => {
            n.node_stage_volume(spec::NodeStageVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                volume_capability: Some(access.capability()),
                ..Default::default()
            })
            .await?;
            String::new()
        }
        Call::Publish {
            id,
            staging,
            target,
            access,
            readonly,
        } => {
            n.node_publish_volume(spec::NodePublishVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
                target_path: target,
                volume_capability: Some(access.capability()),
                readonly,
                ..Default::default()
            })
            .await?;
            String::new()
        }
        Call::Unpublish { id, target } => {
            n.node_unpublish_volume(spec::NodeUnpublishVolumeRequest {
                volume_id: id,
                target_path: target,
            })
            .await?;
            String::new()
        }
        Call::Unstage { id, staging } => {
            n.node_unstage_volume(spec::NodeUnstageVolumeRequest {
                volume_id: id,
                staging_target_path: staging,
            })
            .await?;
            String::new()
        }
        Call::Expand { id, path, size } => n
            .node_expand_volume(spec::NodeExpandVolumeRequest {
                volume_id: id,
                volume_path: path,
                capacity_range: range(size),
                ..Default::default()
            })
            .await?
            .into_inner()
            .capacity_bytes
            .to_string(),
        Call::Stats { id, path } => {
            let s = n
                .node_get_volume_stats(spec::NodeGetVolumeStatsRequest {
                    volume_id: id,
                    volume_path: path,
                    staging_target_path: String::new(),
                })
                .await?
                .into_inner();
            let mut out: Vec<String> = s
                .usage
                .iter()
                .map(|u| {
                    let unit = if u.unit == spec::volume_usage::Unit::Inodes as i32 {
                        "inodes"
                    } else {
                        "bytes"
                    };
                    format!(
                        "{unit}: {} used of {} ({} available)",
                        u.used, u.total, u.available
                    )
                })
                .collect();
            if let Some(c) = s.volume_condition {
                out.push(format!(
                    "condition: {} ({})",
                    if c.abnormal { "abnormal" } else { "normal" },
                    c.message
                ));
            }
            out.join("\n")
        }
        Call::Capacity { params } => c
            .get_capacity(spec::GetCapacityRequest {
                parameters: params.into_iter().collect(),
                ..Default::default()
            })
            .await?
            .into_inner()
            .available_capacity
            .to_string(),
    })
}
