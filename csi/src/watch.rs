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
    pub volumes: Store<PersistentVolume>,
    pub classes: Store<StorageClass>,
}

/// Starts the two watches; each runs until the process ends, a broken one retried with the
/// watcher's backoff (and logged).
pub fn start(client: &Client) -> Watched {
    Watched {
        volumes: keep(Api::all(client.clone()), "PersistentVolumes"),
        classes: keep(Api::all(client.clone()), "StorageClasses"),
    }
}

/// A store of every `K`, kept by a watch on its own task. Managed fields are dropped: nothing
/// reads them, and they are most of an object's metadata.
fn keep<K>(api: Api<K>, what: &'static str) -> Store<K>
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
    store
}

/// Waits until `store` holds its first full list; false when its watch ended before that.
pub async fn ready<K>(store: &Store<K>, what: &str) -> bool
where
    K: kube::runtime::reflector::Lookup + Clone + 'static,
    K::DynamicType: Eq + std::hash::Hash + Clone,
{
    loop {
        let first = tokio::time::timeout(Duration::from_secs(60), store.wait_until_ready());
        match first.await {
            Ok(Ok(())) => {
                tracing::info!("{what} listed: the loops that read them start");
                return true;
            }
            Ok(Err(e)) => {
                tracing::error!(error = %e, "the watch of {what} never listed them");
                return false;
            }
            Err(_) => {
                tracing::warn!(
                    "no first list of {what} after a minute: the loops that read them wait"
                )
            }
        }
    }
}
