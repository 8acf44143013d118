//! The volume records on disk: each write on the blocking pool (a write and two fsyncs must not
//! hold one of the runtime's threads), and a refused change taken back.

use super::pool::blocking;
use super::table::Table;
use crate::error::VolumeError;
use crate::record::VolumeRecord;
use crate::registry::Registry;
use crate::volume_id::VolumeId;
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Debug)]
pub(super) struct Store {
    registry: Registry<VolumeRecord>,
    /// Refused changes whose record could not be put back (`ublkd_volume_rollback_failures_total`).
    pub(super) rollback_failures: AtomicU64,
}

impl Store {
    pub(super) fn new(registry: Registry<VolumeRecord>) -> Self {
        Store {
            registry,
            rollback_failures: AtomicU64::new(0),
        }
    }

    /// The registry itself, to load it.
    pub(super) fn registry(&self) -> &Registry<VolumeRecord> {
        &self.registry
    }

    /// Writes `record` to the registry on the blocking pool.
    pub(super) async fn put(&self, record: &VolumeRecord) -> Result<(), VolumeError> {
        let (registry, record) = (self.registry.clone(), record.clone());
        blocking(move || registry.put(&record)).await
    }

    /// Removes volume `id`'s record on the blocking pool (an unlink and an fsync).
    pub(super) async fn remove(&self, id: &VolumeId) -> Result<(), VolumeError> {
        let (registry, id) = (self.registry.clone(), id.clone());
        blocking(move || registry.remove(id.as_str())).await
    }

    /// Puts `old` back, in the registry and in `table`, after a change (`refused`) that was
    /// recorded and then refused. Should the registry write fail too, the next start would apply
    /// the refused change: the volume says so in its message, with a log line and a count.
    pub(super) async fn roll_back(
        &self,
        table: &Table,
        old: &VolumeRecord,
        refused: &VolumeRecord,
    ) {
        let put = self.put(old).await;
        let mut map = table.lock().await;
        let Some(v) = map.get_mut(&old.id) else {
            return;
        };
        v.record = old.clone();
        if let Err(e) = put {
            // The disk still has the refused record, whose window the next start serves: the
            // map keeps claiming it, or a create could place another volume there meanwhile.
            v.record.backend = refused.backend.clone();
            let why = crate::error::chain(&e);
            self.rollback_failures.fetch_add(1, Ordering::Relaxed);
            tracing::error!(volume = %old.id, error = %why, "a refused change could not be taken back from the registry: the next start applies it");
            v.message = format!(
                "a refused change is still recorded ({why}): the next start applies it unless \
                 the change is made again"
            );
        }
    }
}
