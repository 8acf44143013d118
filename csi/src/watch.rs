//! What the node plugin reads from the API server, watched once instead of listed by each loop:
//! the PersistentVolumes (`pvreport`, `pvlimits`) and the StorageClasses (`nodestatus`), each
//! kept in a store that the loops read at no cost to the API server. One list at start (from
//! its cache, as informers do), then one long watch each, resumed where it stopped; every node
//! polling every few seconds grew the API server's load with nodes × volumes.

use k8s_openapi::api::core::v1::PersistentVolume;
use k8s_openapi::api::storage::v1::StorageClass;
use kube::runtime::reflector::{self, Store};
use kube::runtime::{watcher, WatchStreamExt};
use kube::{Api, Client, Resource};
use std::fmt::Debug;
use std::time::Duration;
use tokio_stream::StreamExt;

/// The stores the node plugin's loops read.
#[derive(Clone, Debug)]
pub struct Watched {
    pub volumes: Kept<PersistentVolume>,
    pub classes: Kept<StorageClass>,
}

/// Starts the two watches; each runs until the process ends, a broken one retried with the
/// watcher's backoff (and logged).
pub fn start(client: &Client) -> Watched {
    Watched {
        volumes: keep(Api::all(client.clone()), "PersistentVolumes"),
        classes: keep(Api::all(client.clone()), "StorageClasses"),
    }
}

/// A store kept by a watch, and whether it holds its first full list yet. One task waits for
/// the store's own readiness and tells every loop: kube's wakes only the last task that asked
/// (a second loop waiting on it waited forever, and pvreport never reported).
#[derive(Clone)]
pub struct Kept<K: 'static + Clone + kube::runtime::reflector::Lookup>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    pub store: Store<K>,
    listed: tokio::sync::watch::Receiver<bool>,
}

impl<K: 'static + Clone + kube::runtime::reflector::Lookup> Debug for Kept<K>
where
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let objects = self.store.state().len();
        let listed = *self.listed.borrow();
        write!(f, "Kept {{ objects: {objects}, listed: {listed} }}")
    }
}

impl<K> Kept<K>
where
    K: 'static + Clone + Send + Sync + kube::runtime::reflector::Lookup,
    K::DynamicType: Eq + std::hash::Hash + Clone + Send + Sync,
{
    /// `store`, with the one task that waits for its first list.
    pub fn of(store: Store<K>, what: &'static str) -> Self {
        let (tx, listed) = tokio::sync::watch::channel(false);
        let first = store.clone();
        tokio::spawn(async move {
            loop {
                let list = tokio::time::timeout(Duration::from_secs(60), first.wait_until_ready());
                match list.await {
                    Ok(Ok(())) => {
                        tracing::info!("{what} listed: the loops that read them start");
                        // No loop waits any more when every receiver is gone: nothing to tell.
                        let _ = tx.send(true);
                        return;
                    }
                    Ok(Err(e)) => {
                        tracing::error!(error = %e, "the watch of {what} never listed them");
                        return;
                    }
                    Err(_) => {
                        tracing::warn!(
                            "no first list of {what} after a minute: the loops that read them wait"
                        )
                    }
                }
            }
        });
        Kept { store, listed }
    }

    /// The store, once it holds its first full list; None when its watch ended before.
    pub async fn listed(self) -> Option<Store<K>> {
        let mut listed = self.listed;
        let seen = listed.wait_for(|l| *l).await.is_ok();
        seen.then_some(self.store)
    }
}

/// A store of every `K`, kept by a watch on its own task. Managed fields are dropped: nothing
/// reads them, and they are most of an object's metadata.
fn keep<K>(api: Api<K>, what: &'static str) -> Kept<K>
where
    K: Resource<DynamicType = ()> + Clone + Debug + Send + Sync + 'static,
    K: serde::de::DeserializeOwned,
{
    let (store, writer) = reflector::store();
    let events = watcher(api, watcher::Config::default().any_semantic())
        .default_backoff()
        .map(|e| e.map(|e| e.modify(|o| o.meta_mut().managed_fields = None)));
    let mut stream = Box::pin(reflector::reflector(writer, events));
    tokio::spawn(async move {
        while let Some(event) = stream.next().await {
            if let Err(e) = event {
                tracing::warn!(error = %e, "watching {what} failed; resuming with backoff (the loops read the last known state)");
            }
        }
        tracing::error!("the watch of {what} ended: the loops that read them see no changes");
    });
    Kept::of(store, what)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two loops wait for the same store's first list (pvreport and pvlimits both read the
    /// PersistentVolumes): both go on once it is there.
    #[tokio::test]
    async fn every_waiter_sees_the_first_list() {
        let (store, mut writer) = reflector::store::<PersistentVolume>();
        let kept = Kept::of(store, "PersistentVolumes");
        let waiter =
            |k: Kept<PersistentVolume>| tokio::spawn(async move { k.listed().await.is_some() });
        let (a, b) = (waiter(kept.clone()), waiter(kept.clone()));
        tokio::time::sleep(Duration::from_millis(50)).await;
        writer.apply_watcher_event(&watcher::Event::Init);
        writer.apply_watcher_event(&watcher::Event::InitDone);
        for w in [a, b] {
            let seen = tokio::time::timeout(Duration::from_secs(5), w).await;
            assert!(
                matches!(seen, Ok(Ok(true))),
                "a waiter never saw the list: {seen:?}"
            );
        }
    }
}
