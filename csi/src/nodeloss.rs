//! Node loss: `ublkd-csi node-loss watch`, one central instance (the `ublkd-csi-controller`
//! Deployment). A ublkd volume lives on one node; when that node is lost, the claims bound to
//! its volumes would wait for it forever and their pods with them. TopoLVM's node finalizer is
//! the model:
//!
//! - every Node the driver registered on (the kubelet labels it with the topology key) gets the
//!   finalizer `ublkd.io/node`, so its deletion waits for this controller. Every Node is
//!   watched: one that lost the label but keeps the finalizer is still handled.
//! - A deleted Node is not a lost one (a mistaken `kubectl delete node`, a cloud controller
//!   deleting a stopped instance): while the finalizer holds it, the Node stays with its
//!   deletionTimestamp and its kubelet, if alive, keeps renewing its Lease. It is released
//!   only when `verdict` says it is lost (Lease expired and NotReady for `--lost-after`, or the
//!   annotation `ublkd.io/node-lost: "true"`); until then nothing is touched and the controller
//!   looks again every `--recheck` (30 s by default).
//! - A release (`plan`) sets the node's PersistentVolumes to Retain and strips the
//!   provisioner's finalizer before any claim is touched (else the node's own provisioner
//!   deletes the volumes of the Released PVs), deletes the claims bound to them (each by its
//!   uid), sends the claims waiting for a volume there back to the scheduler, deletes the PVs,
//!   then the finalizer. A StatefulSet makes its claim again and its pod is scheduled elsewhere.
//! - The ublkd volumes stay on the lost machine, never deleted from here: if it comes back,
//!   `kubectl ublkd orphans` lists them as volumes without a PV.
//! - What it decided is an Event on the Node (`kubectl describe node`), posted when the
//!   decision changes, not on every look.
//!
//! `ublkd-csi node-loss uninstall` (the chart's pre-delete hook) stops the controller and takes
//! the finalizer off every Node, so that no Node waits for a controller that is gone.

pub mod plan;
pub mod verdict;

use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::{Node, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::jiff::Timestamp;
use kube::api::{Api, DeleteParams, ListParams, Patch, PatchParams, Preconditions};
use kube::runtime::controller::{Action, Controller};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::runtime::watcher;
use kube::{Client, Resource, ResourceExt};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_stream::StreamExt;

/// The finalizer this controller puts on Nodes.
pub const FINALIZER: &str = "ublkd.io/node";
/// The Events' reporting controller.
const REPORTER: &str = "ublkd.io/node-loss";

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
    #[error("reading the Lease of node {node}: {source}")]
    ReadLease {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("setting PersistentVolume {name} to Retain: {source}")]
    RetainVolume {
        name: String,
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
    #[error("taking the selected node off claim {namespace}/{name}: {source}")]
    UnselectClaim {
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
    #[error("adding the finalizer {FINALIZER} to node {node}: {source}")]
    AddFinalizer {
        node: String,
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

/// Deletes claim `c` by its uid; one already gone (or replaced) is no error.
async fn delete_claim(client: &Client, node: &str, c: &plan::Claim) -> Result<(), NodeLossError> {
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
            tracing::warn!(%node, claim = %c.name, namespace = %c.namespace, "claim of a lost node deleted: its workload gets a new volume elsewhere");
            Ok(())
        }
        Err(e) if is_gone(&e) => Ok(()),
        Err(source) => Err(NodeLossError::DeleteClaim {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            source,
        }),
    }
}

/// Takes the scheduler's choice of node off claim `c` (its uid in the patch: a precondition).
async fn unselect_claim(client: &Client, node: &str, c: &plan::Claim) -> Result<(), NodeLossError> {
    let api: Api<PersistentVolumeClaim> = Api::namespaced(client.clone(), &c.namespace);
    let patch = Patch::Merge(serde_json::json!({
        "metadata": { "uid": c.uid, "annotations": { plan::SELECTED_NODE: null } }
    }));
    match api.patch(&c.name, &PatchParams::default(), &patch).await {
        Ok(_) => {
            tracing::warn!(%node, claim = %c.name, namespace = %c.namespace, "claim waiting for a volume on a lost node sent back to the scheduler");
            Ok(())
        }
        Err(e) if is_gone(&e) => Ok(()),
        Err(source) => Err(NodeLossError::UnselectClaim {
            namespace: c.namespace.clone(),
            name: c.name.clone(),
            source,
        }),
    }
}

/// Releases what lost node `node` holds in the API, in `plan`'s order (see the module's
/// comment); returns what it released.
pub async fn release_node(client: &Client, node: &str) -> Result<plan::Release, NodeLossError> {
    let pvs: Api<PersistentVolume> = Api::all(client.clone());
    let claims: Api<PersistentVolumeClaim> = Api::all(client.clone());
    let all = ListParams::default();
    let release = plan::release(
        node,
        &list(&pvs, &all, "PersistentVolumes").await?,
        &list(&claims, &all, "PersistentVolumeClaims").await?,
    );
    for pv in &release.kept {
        tracing::warn!(%node, %pv, "PersistentVolume of a lost node left alone: its reclaim policy was Retain already (delete its claim by hand to move its workload)");
    }
    for step in release.steps() {
        match step {
            plan::Step::Retain(v) => {
                let patch = Patch::Strategic(serde_json::json!({
                    "metadata": {
                        "annotations": { plan::RELEASED_FROM: node },
                        "$deleteFromPrimitiveList/finalizers": [plan::PROVISIONER_FINALIZER],
                    },
                    "spec": { "persistentVolumeReclaimPolicy": "Retain" }
                }));
                match pvs.patch(&v.name, &PatchParams::default(), &patch).await {
                    Ok(_) => {}
                    Err(e) if is_gone(&e) => {}
                    Err(source) => {
                        return Err(NodeLossError::RetainVolume {
                            name: v.name.clone(),
                            source,
                        })
                    }
                }
            }
            plan::Step::DeleteClaim(c) => delete_claim(client, node, c).await?,
            plan::Step::Unselect(c) => unselect_claim(client, node, c).await?,
            plan::Step::DeleteVolume(v) => {
                match pvs.delete(&v.name, &DeleteParams::default()).await {
                    Ok(_) => {
                        tracing::warn!(%node, pv = %v.name, volume = %v.handle, "PersistentVolume of a lost node deleted; its ublkd volume stays on that machine (`kubectl ublkd orphans` if it comes back)")
                    }
                    Err(e) if is_gone(&e) => {}
                    Err(source) => {
                        return Err(NodeLossError::DeleteVolume {
                            name: v.name.clone(),
                            source,
                        })
                    }
                }
            }
        }
    }
    Ok(release)
}

struct Context {
    client: Client,
    lost_after: Duration,
    /// How often a deleted Node that is not (yet) lost is looked at again.
    recheck: Duration,
    recorder: Recorder,
    /// The reason of the last Event posted for each Node (by uid), so that a look that decides
    /// the same posts nothing.
    posted: Mutex<HashMap<String, &'static str>>,
    /// When each node's Lease was seen renewed, by this controller's clock.
    leases: Mutex<verdict::LeaseObserver>,
}

impl Context {
    /// Logs `note` and, unless the last Event for `node` had the same `reason`, posts it as an
    /// Event on `node`. A failed post is logged and tried again on the next look.
    async fn tell(&self, node: &Node, type_: EventType, reason: &'static str, note: String) {
        let name = node.name_any();
        let uid = node.uid().unwrap_or_default();
        let last = self.posted().get(&uid).copied();
        if last == Some(reason) {
            tracing::debug!(node = %name, reason, %note, "node-loss: unchanged");
            return;
        }
        match type_ {
            EventType::Warning => tracing::warn!(node = %name, reason, %note, "node-loss"),
            EventType::Normal => tracing::info!(node = %name, reason, %note, "node-loss"),
        }
        let event = Event {
            type_,
            reason: reason.to_owned(),
            note: Some(note),
            action: "NodeLoss".to_owned(),
            secondary: None,
        };
        match self.recorder.publish(&event, &node.object_ref(&())).await {
            Ok(()) => {
                self.posted().insert(uid, reason);
            }
            Err(e) => {
                tracing::warn!(node = %name, reason, error = %e, "posting the node-loss Event failed; trying again on the next look")
            }
        }
    }

    /// The reasons posted. A panic while the lock was held loses nothing worth refusing: the
    /// worst is one Event posted twice.
    fn posted(&self) -> std::sync::MutexGuard<'_, HashMap<String, &'static str>> {
        self.posted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn forget(&self, node: &Node) {
        self.posted().remove(&node.uid().unwrap_or_default());
    }
}

/// Whether `node` carries the controller's finalizer.
fn finalized(node: &Node) -> bool {
    node.finalizers().iter().any(|f| f == FINALIZER)
}

async fn reconcile(node: Arc<Node>, ctx: Arc<Context>) -> Result<Action, NodeLossError> {
    let nodes: Api<Node> = Api::all(ctx.client.clone());
    let name = node.name_any();
    let deleted = node.metadata.deletion_timestamp.is_some();
    let labelled = node.labels().contains_key(crate::TOPOLOGY_KEY);
    match (deleted, finalized(&node)) {
        (false, false) if labelled => {
            // Strategic merge: the finalizers are a set, ours is added to the others.
            let patch = Patch::Strategic(serde_json::json!({
                "metadata": { "finalizers": [FINALIZER] }
            }));
            nodes
                .patch(&name, &PatchParams::default(), &patch)
                .await
                .map_err(|source| NodeLossError::AddFinalizer {
                    node: name.clone(),
                    source,
                })?;
            tracing::info!(node = %name, "finalizer {FINALIZER} added");
            Ok(Action::await_change())
        }
        // Not the driver's, or finalized and not deleted: nothing to do until it changes.
        (false, _) => Ok(Action::await_change()),
        // Deleted without the finalizer (never the driver's, or taken off by hand): let it go.
        (true, false) => {
            ctx.forget(&node);
            Ok(Action::await_change())
        }
        (true, true) => cleanup(&nodes, &node, &ctx).await,
    }
}

/// A deleted Node with the finalizer: released if it is lost, else kept and looked at again.
async fn cleanup(nodes: &Api<Node>, node: &Node, ctx: &Context) -> Result<Action, NodeLossError> {
    let name = node.name_any();
    let leases: Api<Lease> = Api::namespaced(ctx.client.clone(), verdict::LEASE_NAMESPACE);
    let lease = leases
        .get_opt(&name)
        .await
        .map_err(|source| NodeLossError::ReadLease {
            node: name.clone(),
            source,
        })?;
    let now = Timestamp::now();
    let lease = ctx
        .leases
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
        .observe(&name, lease, now);
    let v = verdict::judge(node, lease.as_ref(), now, ctx.lost_after);
    if !v.is_lost() {
        let note = format!(
            "Node deleted, volumes kept: {}. Nothing is released until its Lease expires and it \
             is NotReady for {} s, or it is annotated {}=true.",
            v.why(),
            ctx.lost_after.as_secs(),
            verdict::LOST_ANNOTATION
        );
        ctx.tell(node, EventType::Normal, v.reason(), note).await;
        return Ok(Action::requeue(ctx.recheck));
    }
    tracing::warn!(node = %name, reason = v.reason(), why = %v.why(), "node lost: releasing its volumes");
    let released = match release_node(&ctx.client, &name).await {
        Ok(r) => r,
        Err(e) => {
            ctx.tell(
                node,
                EventType::Warning,
                "NodeReleaseFailed",
                format!("releasing the lost node's volumes failed, trying again: {e}"),
            )
            .await;
            return Err(e);
        }
    };
    ctx.tell(
        node,
        EventType::Warning,
        "NodeReleased",
        format!("Node lost ({}). {}", v.why(), released.summary()),
    )
    .await;
    match nodes
        .patch(
            &name,
            &PatchParams::default(),
            &without_finalizer(FINALIZER),
        )
        .await
    {
        Ok(_) => {}
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
    ctx.forget(node);
    tracing::warn!(node = %name, claims = released.claims.len(), volumes = released.volumes.len(), unselected = released.unselect.len(), kept = released.kept.len(), "node released");
    Ok(Action::await_change())
}

fn retry(node: Arc<Node>, e: &NodeLossError, _: Arc<Context>) -> Action {
    tracing::error!(node = %node.name_any(), error = %e, "node-loss reconcile failed; retrying in 10 s");
    Action::requeue(Duration::from_secs(10))
}

async fn client() -> Result<Client, NodeLossError> {
    Client::try_default().await.map_err(NodeLossError::Connect)
}

/// Runs the controller until SIGTERM or SIGINT: finalizes every Node labelled with the topology
/// key, and releases a deleted one's claims and volumes once it is lost, a Node being lost
/// when NotReady for `lost_after` with its Lease expired (or annotated lost); a deleted Node not
/// lost yet is looked at again every `recheck`.
pub async fn watch(lost_after: Duration, recheck: Duration) -> Result<(), NodeLossError> {
    let client = client().await?;
    let nodes: Api<Node> = Api::all(client.clone());
    tracing::info!(
        finalizer = FINALIZER,
        label = crate::TOPOLOGY_KEY,
        lost_after_s = lost_after.as_secs(),
        recheck_s = recheck.as_secs(),
        "watching Nodes"
    );
    let ctx = Arc::new(Context {
        recorder: Recorder::new(client.clone(), Reporter::from(REPORTER)),
        client,
        lost_after,
        recheck,
        posted: Mutex::default(),
        leases: Mutex::default(),
    });
    // Every Node, not only the labelled ones: a Node that lost the label keeps the finalizer
    // and must still be released (`reconcile` sorts them).
    let stream = Controller::new(nodes, watcher::Config::default())
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
