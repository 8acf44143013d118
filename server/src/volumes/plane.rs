//! The dataplane this manager drives, or why there is none (no ublk driver, or one without user
//! recovery: every volume call then fails with the reason, and the daemon still answers).

use crate::devices::Devices;
use crate::error::VolumeError;
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use ublkd_dataplane::{DataplaneError, DevId, Features};

#[derive(Debug)]
pub(super) struct Plane {
    handle: Option<Arc<dyn Devices>>,
    no_ublk: String,
}

impl Plane {
    pub(super) fn new(handle: Result<Arc<dyn Devices>, DataplaneError>) -> Self {
        match handle {
            Ok(h) => Plane {
                handle: Some(h),
                no_ublk: String::new(),
            },
            Err(e) => Plane {
                handle: None,
                no_ublk: crate::error::chain(&e),
            },
        }
    }

    /// The dataplane, or the error that says why this node has none.
    pub(super) fn handle(&self) -> Result<Arc<dyn Devices>, VolumeError> {
        self.handle
            .clone()
            .ok_or_else(|| VolumeError::OpenDataplane(self.no_ublk.clone()))
    }

    /// The dataplane if there is one (for questions that answer empty without it).
    pub(super) fn running(&self) -> Option<Arc<dyn Devices>> {
        self.handle.clone()
    }

    pub(super) fn features(&self) -> Option<Features> {
        self.handle.as_ref().map(|h| h.features())
    }

    /// Why this node serves no volumes; None while it serves.
    pub(super) fn error(&self) -> Option<&str> {
        self.handle.is_none().then_some(self.no_ublk.as_str())
    }

    /// The lowest ublk device id that neither the kernel nor any volume of `map` uses.
    pub(super) fn free_dev_id(
        &self,
        map: &BTreeMap<VolumeId, Volume>,
    ) -> Result<DevId, VolumeError> {
        let used: BTreeSet<DevId> = self
            .handle()?
            .kernel_device_ids()
            .into_iter()
            .chain(map.values().filter_map(|v| v.record.dev_id))
            .collect();
        (0..u32::from(u16::MAX))
            .map(DevId)
            .find(|id| !used.contains(id))
            .ok_or(VolumeError::AllocateDevId)
    }
}
