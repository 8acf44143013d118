//! A volume as the manager knows it: its record, its lifecycle state and the device serving
//! it. Plain data, shared by the manager (`volumes`), the API conversions and the metrics.

use crate::record::VolumeRecord;
use crate::volume_id::VolumeId;
use std::path::{Path, PathBuf};
use ublkd_dataplane::DeviceInfo;

/// The lifecycle state of a volume.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    Creating,
    Ready,
    Recovering,
    Failed,
    Deleting,
}

impl State {
    pub const ALL: [State; 5] = [
        State::Creating,
        State::Ready,
        State::Recovering,
        State::Failed,
        State::Deleting,
    ];

    pub fn name(self) -> &'static str {
        match self {
            State::Creating => "creating",
            State::Ready => "ready",
            State::Recovering => "recovering",
            State::Failed => "failed",
            State::Deleting => "deleting",
        }
    }
}

/// A volume as the manager knows it.
#[derive(Debug, Clone)]
pub struct Volume {
    pub record: VolumeRecord,
    pub state: State,
    pub device: Option<DeviceInfo>,
    pub message: String,
}

impl Volume {
    /// A volume being made: its id, device id and backing file are taken.
    pub fn creating(record: VolumeRecord) -> Self {
        Self {
            record,
            state: State::Creating,
            device: None,
            message: String::new(),
        }
    }

    /// A volume whose device serves I/O.
    pub fn ready(record: VolumeRecord, device: DeviceInfo) -> Self {
        Self {
            record,
            state: State::Ready,
            device: Some(device),
            message: String::new(),
        }
    }
}

/// Where a RAM volume's pages are kept between restarts.
pub fn ram_file(ram_dir: &Path, id: &VolumeId) -> PathBuf {
    ram_dir.join(format!("{id}.ram"))
}
