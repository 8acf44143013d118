//! Node loss: `ublkd-csi node-loss watch`, one central instance (the `ublkd-csi-controller`
//! Deployment). A ublkd volume lives on one node; when that Node object is deleted (the
//! machine is gone, or an admin retires it), the claims bound to its volumes would wait for it
//! forever and their pods with them. TopoLVM's node finalizer is the model:
//!
//! - every Node the driver registered on (the kubelet labels it with the topology key) gets the
//!   finalizer `ublkd.io/node`, so its deletion waits for this controller;
//! - on deletion, the claims bound to the node's PersistentVolumes, and the claims the
//!   scheduler had sent there and that wait for a volume, are deleted (each by its uid: a new
//!   claim of the same name is never touched); the PersistentVolumes are deleted, with the
//!   provisioner's finalizer removed (the node's provisioner went with the node); then the
//!   finalizer. A StatefulSet makes its claim again and its pod is scheduled elsewhere.
//! - The ublkd volumes stay on the lost machine, never deleted from here: if it comes back,
//!   `kubectl ublkd orphans` lists them as volumes without a PV.
//!
//! `ublkd-csi node-loss uninstall` (the chart's pre-delete hook) stops the controller and takes
//! the finalizer off every Node, so that no Node waits for a controller that is gone.

pub mod plan;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::finalizer::{finalizer, Event};
use kube::runtime::watcher;
use kube::{Client, ResourceExt};
use std::sync::Arc;
use std::time::Duration;
use tokio_stream::StreamExt;

/// The finalizer this controller puts on Nodes.
pub const FINALIZER: &str = "ublkd.io/node";

#[derive(Debug, thiserror::Error)]
pub enum NodeLossError {
    #[error("connecting to the API server: {0}")]
    Connect(#[source] kube::Error),
    #[error("listing {kind}: {source}")]
    List {
        kind: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("deleting claim {namespace}/{name}: {source}")]
    DeleteClaim {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("deleting PersistentVolume {name}: {source}")]
    DeleteVolume {
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("removing the finalizer {finalizer} from {kind} {name}: {source}")]
    RemoveFinalizer {
        finalizer: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    /// The finalizer's own bookkeeping (adding or removing it) or the release under it.
    #[error("node {node}: {message}")]
    Finalize { node: String, message: String },
    #[error("deleting Deployment {namespace}/{name}: {source}")]
    DeleteDeployment {
        namespace: String,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("the pods of Deployment {0} were still running after {1:?}")]
    ControllerStayed(String, Duration),
}

fn is_gone(e: &kube::Error) -> bool {
    // 404: deleted already; 409: the uid precondition failed, so the name is another object's.
    matches!(e, kube::Error::Api(s) if s.is_not_found() || s.is_conflict())
}

/// The merge patch that takes `finalizer` out of an object's finalizers and leaves the rest.
fn without_finalizer(finalizer: &str) -> Patch<serde_json::Value> {
    Patch::Strategic(serde_json::json!({
        "metadata": { "$deleteFromPrimitiveList/finalizers": [finalizer] }
    }))
}

/// Every `kind` object `api` lists with `params`.
async fn list<K>(
    api: &Api<K>,
    params: &ListParams,
    kind: &'static str,
) -> Result<Vec<K>, NodeLossError>
where
    K: Clone + k8s_openapi::serde::de::DeserializeOwned + std::fmt::Debug,
{
    api.list(params)
        .await
        .map(|l| l.items)
        .map_err(|source| NodeLossError::List { kind, source })
}

/// Releases what lost node `node` holds in the API (see the module's comment); returns what
/// it released.
pub async fn release_node(client: &Client, node: &str) -> Result<plan::Release, NodeLossError> {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let all = ListParams::default();
    let release = plan::release(
        node,
        &list(&pvs, &all, "PersistentVolumes").await?,
        &list(&claims, &all, "PersistentVolumeClaims").await?,
    );
    for c in &release.claims {
        let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &c.namespace);
        let dp = DeleteParams {
            preconditions: Some(Preconditions {
                uid: Some(c.uid.clone()),
                resource_version: None,
            }),
            ..Default::default()
        };
        match api.delete(&c.name, &dp).await {
            Ok(_) => {
                tracing::warn!(%node, claim = %c.name, namespace = %c.namespace, "claim of a lost node deleted: its workload gets a new volume elsewhere")
            }
            Err(e) if is_gone(&e) => {}
            Err(source) => {
                return Err(NodeLossError::DeleteClaim {
                    namespace: c.namespace.clone(),
                    name: c.name.clone(),
                    source,
                })
            }
        }
    }
    for v in &release.volumes {
        match pvs.delete(&v.name, &DeleteParams::default()).await {
            Ok(_) => {}
            Err(e) if is_gone(&e) => continue,
            Err(source) => {
                return Err(NodeLossError::DeleteVolume {
                    name: v.name.clone(),
                    source,
                })
            }
        }
        if v.strip_provisioner_finalizer {
            let patch = without_finalizer(plan::PROVISIONER_FINALIZER);
            match pvs.patch(&v.name, &PatchParams::default(), &patch).await {
                Ok(_) => {}
                Err(e) if is_gone(&e) => {}
                Err(source) => {
                    return Err(NodeLossError::RemoveFinalizer {
                        finalizer: plan::PROVISIONER_FINALIZER,
                        kind: "PersistentVolume",
                        name: v.name.clone(),
                        source,
                    })
                }
            }
        }
        tracing::warn!(%node, pv = %v.name, volume = %v.handle, "PersistentVolume of a lost node deleted; its ublkd volume stays on that machine (`kubectl ublkd orphans` if it comes back)");
    }
    Ok(release)
}

struct Context {
    client: Client,
}

async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Action, NodeLossError> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let name = node.name_any();
    finalizer(&nodes, FINALIZER, node, |event| async {
        match event {
            Event::Apply(_) => Ok::<_, NodeLossError>(Action::await_change()),
            Event::Cleanup(n) => {
                let name = n.name_any();
                tracing::warn!(node = %name, "node deleted: releasing its volumes' claims");
                let r = release_node(&ctx.client, &name).await?;
                tracing::warn!(node = %name, claims = r.claims.len(), volumes = r.volumes.len(), "node released");
                Ok(Action::await_change())
            }
        }
    })
    .await
    .map_err(|e| NodeLossError::Finalize {
        node: name,
        message: e.to_string(),
    })
}

fn retry(node: Arc<Node>, e: &NodeLossError, _: Arc<Context>) -> Action {
    tracing::error!(node = %node.name_any(), error = %e, "node-loss reconcile failed; retrying in 10 s");
    Action::requeue(Duration::from_secs(10))
}

async fn client() -> Result<Client, NodeLossError> {
    Client::try_default().await.map_err(NodeLossError::Connect)
}

/// Runs the controller until SIGTERM or SIGINT: finalizes every Node labelled with the topology
/// key, and releases a deleted one's claims and volumes.
pub async fn watch() -> Result<(), NodeLossError> {
    let client = client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    tracing::info!(
        finalizer = FINALIZER,
        label = crate::TOPOLOGY_KEY,
        "watching Nodes"
    );
    let ctx = Arc::new(Context { client });
    let stream = Controller::new(
        nodes,
        watcher::Config::default().labels(crate::TOPOLOGY_KEY),
    )
    .shutdown_on_signal()
    .run(reconcile, retry, ctx);
    tokio::pin!(stream);
    while let Some(r) = stream.next().await {
        match r {
            Ok((node, _)) => tracing::debug!(node = %node.name, "reconciled"),
            // each failed reconcile was logged by `retry`; this is the watch itself
            Err(e) => tracing::warn!(error = %e, "node-loss controller"),
        }
    }
    tracing::info!("node-loss controller stopped");
    Ok(())
}

/// The chart's pre-delete step: deletes the controller's Deployment `deployment` in
/// `namespace`, waits for its pods to be gone (else one could put a finalizer back), and
/// removes the finalizer from every Node.
pub async fn uninstall(namespace: &str, deployment: &str) -> Result<usize, NodeLossError> {
    let client = client().await?;
    let deployments: Api<Deployment> = Api::namespaced(client.clone(), namespace);
    match deployments
        .delete(deployment, &DeleteParams::default())
        .await
    {
        Ok(_) => {}
        Err(e) if is_gone(&e) => {}
        Err(source) => {
            return Err(NodeLossError::DeleteDeployment {
                namespace: namespace.to_owned(),
                name: deployment.to_owned(),
                source,
            })
        }
    }
    let pods: Api<Pod> = Api::namespaced(client.clone(), namespace);
    let label = ListParams::default().labels(&format!("app.kubernetes.io/name={deployment}"));
    let limit = Duration::from_secs(300);
    let start = std::time::Instant::now();
    loop {
        if list(&pods, &label, "Pods").await?.is_empty() {
            break;
        }
        if start.elapsed() > limit {
            return Err(NodeLossError::ControllerStayed(
                deployment.to_owned(),
                limit,
            ));
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }
    let nodes: Api<Node> = Api::all(client);
    let all = list(&nodes, &ListParams::default(), "Nodes").await?;
    let mut removed = 0;
    for n in all
        .iter()
        .filter(|n| n.finalizers().iter().any(|f| f == FINALIZER))
    {
        let name = n.name_any();
        match nodes
            .patch(
                &name,
                &PatchParams::default(),
                &without_finalizer(FINALIZER),
            )
            .await
        {
            Ok(_) => removed += 1,
            Err(e) if is_gone(&e) => {}
            Err(source) => {
                return Err(NodeLossError::RemoveFinalizer {
                    finalizer: FINALIZER,
                    kind: "Node",
                    name,
                    source,
                })
            }
        }
    }
    tracing::info!(removed, "finalizer {FINALIZER} removed from the nodes");
    Ok(removed)
}
