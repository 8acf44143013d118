//! The volumes this process knows, and each volume's operation lock. The map's lock is held
//! only to read or record, never across a registry write or a control command; an operation
//! lock orders the changes of one volume (different volumes change in parallel).

use crate::error::VolumeError;
use crate::volume::{State, Volume};
use crate::volume_id::VolumeId;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, PoisonError, Weak};
use tokio::sync::{Mutex, MutexGuard, OwnedMutexGuard};

#[derive(Debug, Default)]
pub(super) struct Table {
    map: Mutex<BTreeMap<VolumeId, Volume>>,
    /// Each volume's operation lock, while anyone holds or waits for it.
    ops: std::sync::Mutex<HashMap<VolumeId, Weak<Mutex<()>>>>,
}

impl Table {
    /// The map, to read or record (never held across a registry write or a control command).
    pub(super) async fn lock(&self) -> MutexGuard<'_, BTreeMap<VolumeId, Volume>> {
        self.map.lock().await
    }

    /// Waits for volume `id`'s operation lock; changes of `id` run one at a time while it is
    /// held. Locks nobody holds any more are dropped from the table on the way.
    pub(super) async fn op_lock(&self, id: &VolumeId) -> OwnedMutexGuard<()> {
        crate::seam::schedule_point().await;
        let lock = {
            let mut ops = self.ops.lock().unwrap_or_else(PoisonError::into_inner);
            ops.retain(|_, w| w.strong_count() > 0);
            match ops.get(id).and_then(Weak::upgrade) {
                Some(l) => l,
                None => {
                    let l = Arc::new(Mutex::new(()));
                    ops.insert(id.clone(), Arc::downgrade(&l));
                    l
                }
            }
        };
        lock.lock_owned().await
    }

    /// The operation locks of `id` and of `other` (when given and not `id`), taken in id
    /// order: whoever takes two takes them in the same order, so no two changes wait for each
    /// other.
    pub(super) async fn op_locks(
        &self,
        id: &VolumeId,
        other: Option<&VolumeId>,
    ) -> Vec<OwnedMutexGuard<()>> {
        let mut ids: Vec<&VolumeId> = std::iter::once(id).chain(other).collect();
        ids.sort();
        ids.dedup();
        let mut held = Vec::with_capacity(ids.len());
        for id in ids {
            held.push(self.op_lock(id).await);
        }
        held
    }

    pub(super) async fn get(&self, id: &VolumeId) -> Result<Volume, VolumeError> {
        self.map
            .lock()
            .await
            .get(id)
            .cloned()
            .ok_or_else(|| VolumeError::LookupVolume(id.clone()))
    }

    pub(super) async fn list(&self) -> Vec<Volume> {
        self.map.lock().await.values().cloned().collect()
    }

    /// Sets a volume's message (its state unchanged) if it still exists.
    pub(super) async fn set_message(&self, id: &VolumeId, message: &str) {
        if let Some(v) = self.map.lock().await.get_mut(id) {
            v.message = message.to_owned();
        }
    }

    /// Sets a volume's state (and message) if it still exists.
    pub(super) async fn set_state(&self, id: &VolumeId, state: State, message: &str) {
        if let Some(v) = self.map.lock().await.get_mut(id) {
            v.state = state;
            v.message = message.to_owned();
        }
    }

    /// How many operation locks are held or waited for (a test's look inside).
    #[cfg(test)]
    pub(super) fn op_locks_held(&self) -> usize {
        self.ops
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }
}
