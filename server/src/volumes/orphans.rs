//! ublk devices in the kernel that no registered volume owns: listing, adopting, deleting.

use super::{blocking, now_ms, Volumes};
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::volume::Volume;
use std::time::Instant;
use ublkd_dataplane::{DevId, DeviceInfo, KernelDevice};

impl Volumes {
    /// ublk devices in the kernel that no registered volume owns.
    pub async fn orphans(&self) -> Vec<KernelDevice> {
        let Some(handle) = self.handle.clone() else {
            return Vec::new();
        };
        let map = self.inner.lock().await;
        let known: std::collections::BTreeSet<DevId> =
            map.values().filter_map(|v| v.record.dev_id).collect();
        drop(map);
        blocking(move || handle.kernel_devices())
            .await
            .unwrap_or_default()
            .into_iter()
            .filter(|d| !d.owned && !known.contains(&d.dev_id))
            .collect()
    }

    /// Takes over orphan device `dev_id` as volume `record` (whose spec was checked).
    pub async fn adopt(
        &self,
        dev_id: DevId,
        mut record: VolumeRecord,
    ) -> Result<Volume, VolumeError> {
        let _op = self.op_lock(&record.id).await;
        let orphan = self
            .orphans()
            .await
            .into_iter()
            .find(|d| d.dev_id == dev_id)
            .ok_or(VolumeError::LookupOrphan(dev_id))?;
        if record.size_bytes == 0 {
            record.size_bytes = orphan.size_bytes;
        }
        record.dev_id = Some(dev_id);
        record.created_unix_ms = now_ms();
        {
            let mut map = self.inner.lock().await;
            if map.contains_key(&record.id) {
                return Err(VolumeError::AdoptConflict(record.id));
            }
            map.insert(record.id.clone(), Volume::creating(record.clone()));
        }
        let adopted = self.take_over(&record).await;
        self.settle(record, adopted).await
    }

    async fn take_over(&self, record: &VolumeRecord) -> Result<DeviceInfo, VolumeError> {
        self.prepare_backing_file(record)?;
        let handle = self.handle()?;
        let spec = crate::convert::device_spec(record, &self.settings.ram_dir);
        let started = Instant::now();
        let info = blocking(move || handle.recover_device(spec)).await?;
        self.recoveries.record(started.elapsed());
        self.registry.put(record)?;
        Ok(info)
    }

    /// Deletes orphan device `dev_id`.
    pub async fn delete_orphan(&self, dev_id: DevId) -> Result<(), VolumeError> {
        if !self.orphans().await.iter().any(|d| d.dev_id == dev_id) {
            return Err(VolumeError::LookupOrphan(dev_id));
        }
        let handle = self.handle()?;
        blocking(move || handle.delete_foreign_device(dev_id)).await
    }
}
