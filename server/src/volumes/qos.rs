//! Changing a volume's I/O limits: recorded first, then handed to its device if one serves it.

use super::plane::Plane;
use super::pool::blocking;
use super::store::Store;
use super::table::Table;
use crate::error::VolumeError;
use crate::volume::Volume;
use crate::volume_id::VolumeId;
use ublkd_dataplane::QosLimits;

/// Replaces a volume's I/O limits: recorded first (a restart applies them), then handed to
/// the dataplane if the volume is being served. A volume not being served (FAILED, or
/// waiting for recovery) keeps them for when it is.
pub(super) async fn set_qos(
    table: &Table,
    store: &Store,
    plane: &Plane,
    id: &VolumeId,
    qos: QosLimits,
) -> Result<Volume, VolumeError> {
    let _op = table.op_lock(id).await;
    let vol = table.get(id).await?;
    if vol.record.qos == qos {
        return Ok(vol);
    }
    let mut record = vol.record.clone();
    record.qos = qos;
    store.put(&record).await?;
    let updated = match vol.device.as_ref() {
        Some(info) => {
            let handle = plane.handle()?;
            let dev_id = info.dev_id;
            match blocking(move || handle.set_qos(dev_id, qos)).await {
                Ok(updated) => Some(updated),
                Err(e) => {
                    store.roll_back(table, &vol.record, &record).await;
                    return Err(e);
                }
            }
        }
        None => None,
    };
    let mut map = table.lock().await;
    let v = map
        .get_mut(id)
        .ok_or_else(|| VolumeError::LookupVolume(id.clone()))?;
    v.record = record;
    if updated.is_some() {
        v.device = updated;
    }
    Ok(v.clone())
}
