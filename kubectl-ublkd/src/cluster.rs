//! What the API server knows about ublkd's volumes: where a claim's volume lives (its PV's
//! volume handle and the node of its topology), which PVs name ublkd volumes on a node, each
//! node's `UblkdNode` status (written by its node plugin), the ublkd pods, the capacity the
//! scheduler sees per class and node, and what `check` and `dump` look at. Reads only: every
//! call is allowed by the chart's read-only ClusterRole `ublkd-viewer`.

use anyhow::{Context, Result};
use k8s_openapi::api::apps::v1::Deployment;
use k8s_openapi::api::core::v1::{Event, PersistentVolume, PersistentVolumeClaim, Pod};
use k8s_openapi::api::storage::v1::{CSIDriver, CSIStorageCapacity};
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, ListParams, LogParams};
use kube::config::{KubeConfigOptions, Kubeconfig};
use kube::{Client, Config};
use serde::de::DeserializeOwned;
use std::collections::BTreeMap;
use std::path::PathBuf;
use ublkd_csi::nodestatus::{self, NodeStatus};

/// The CSI driver's name.
pub const DRIVER: &str = "ublkd.io";
/// The topology key the driver reports for each node.
pub const TOPOLOGY_KEY: &str = "ublkd.io/node";
/// The label of the ublkd DaemonSet's pods.
pub const UBLKD_POD_LABEL: &str = "app.kubernetes.io/name=ublkd";

/// A PersistentVolume of the driver: the ublkd volume it names and the node that holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    pub pv: String,
    /// The PV's `spec.csi.volumeHandle`: ublkd's volume id on the node.
    pub volume: String,
    /// The node of its topology (`ublkd.io/node` in its node affinity), when it has one.
    pub node: Option<String>,
}

/// Where `pv`'s ublkd volume is, or None when the PV is not the driver's.
pub fn location(pv: &PersistentVolume) -> Option<Location> {
    let spec = pv.spec.as_ref()?;
    let csi = spec.csi.as_ref()?;
    if csi.driver != DRIVER {
        return None;
    }
    let node = spec
        .node_affinity
        .as_ref()
        .and_then(|a| a.required.as_ref())
        .and_then(|r| {
            r.node_selector_terms.iter().find_map(|t| {
                t.match_expressions.as_ref()?.iter().find_map(|e| {
                    (e.key == TOPOLOGY_KEY && e.operator == "In")
                        .then(|| e.values.as_ref()?.first().cloned())
                        .flatten()
                })
            })
        });
    Some(Location {
        pv: pv.metadata.name.clone().unwrap_or_default(),
        volume: csi.volume_handle.clone(),
        node,
    })
}

/// The node a capacity object is for (its `ublkd.io/node` label), and the bytes it reports.
pub fn capacity_of(c: &CSIStorageCapacity) -> Option<(String, String, String)> {
    let node = c
        .node_topology
        .as_ref()?
        .match_labels
        .as_ref()?
        .get(TOPOLOGY_KEY)?
        .clone();
    let bytes = c.capacity.as_ref().map(|q| q.0.clone())?;
    Some((node, c.storage_class_name.clone(), bytes))
}

/// The API, with the user's own kubeconfig and rights.
#[derive(Clone)]
pub struct Cluster {
    client: Client,
    /// The namespace ublkd's pods run in.
    ublkd_namespace: String,
}

impl std::fmt::Debug for Cluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cluster")
            .field("ublkd_namespace", &self.ublkd_namespace)
            .finish_non_exhaustive()
    }
}

/// A node's report: its `UblkdNode` name and status.
#[derive(Debug, Clone, PartialEq)]
pub struct Report {
    pub node: String,
    pub status: NodeStatus,
}

/// The seconds since an RFC 3339 time, or None when it does not read as one.
pub fn age_seconds(at: &str) -> Option<i64> {
    let at: k8s_openapi::jiff::Timestamp = at.parse().ok()?;
    Some(k8s_openapi::jiff::Timestamp::now().as_second() - at.as_second())
}

/// Where to find the cluster: kubectl's own flags.
#[derive(Debug, Clone, Default)]
pub struct Target {
    pub kubeconfig: Option<PathBuf>,
    pub context: Option<String>,
}

impl Cluster {
    pub async fn connect(target: &Target, ublkd_namespace: &str) -> Result<Self> {
        let config = if target.kubeconfig.is_none() && target.context.is_none() {
            Config::infer()
                .await
                .context("reading the kubeconfig (KUBECONFIG, ~/.kube/config or in-cluster)")?
        } else {
            let kubeconfig = match &target.kubeconfig {
                Some(path) => Kubeconfig::read_from(path)
                    .with_context(|| format!("reading the kubeconfig {}", path.display()))?,
                None => Kubeconfig::read().context("reading the kubeconfig")?,
            };
            let options = KubeConfigOptions {
                context: target.context.clone(),
                ..Default::default()
            };
            Config::from_custom_kubeconfig(kubeconfig, &options)
                .await
                .context("loading the kubeconfig's context")?
        };
        let client = Client::try_from(config).context("making the API client")?;
        Ok(Self {
            client,
            ublkd_namespace: ublkd_namespace.to_owned(),
        })
    }

    /// Every node's report, by node name.
    pub async fn reports(&self) -> Result<Vec<Report>> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &nodestatus::resource());
        let list = api.list(&ListParams::default()).await.with_context(|| {
            format!(
                "listing {}.{} (is the chart installed, and are you bound to ublkd-viewer?)",
                nodestatus::PLURAL,
                nodestatus::GROUP
            )
        })?;
        list.items
            .into_iter()
            .map(|o| {
                let node = o.metadata.name.clone().unwrap_or_default();
                let status = serde_json::from_value(o.data["status"].clone())
                    .with_context(|| format!("reading UblkdNode {node}'s status"))?;
                Ok(Report { node, status })
            })
            .collect()
    }

    /// The `UblkdNode` of `node`.
    pub async fn report(&self, node: &str) -> Result<Report> {
        self.reports()
            .await?
            .into_iter()
            .find(|r| r.node == node)
            .with_context(|| {
                format!(
                    "no UblkdNode {node}: its node plugin has not reported (is it running with --report-status-every?)"
                )
            })
    }

    /// Whether the CSIDriver object of the driver exists.
    pub async fn csi_driver(&self) -> Result<bool> {
        let api: Api<CSIDriver> = Api::all(self.client.clone());
        Ok(api
            .get_opt(DRIVER)
            .await
            .context("reading the CSIDriver")?
            .is_some())
    }

    /// Whether a VolumeSnapshotClass of the driver exists (false when the CRD is absent).
    pub async fn snapshot_class(&self) -> Result<bool> {
        let gvk = GroupVersionKind::gvk("snapshot.storage.k8s.io", "v1", "VolumeSnapshotClass");
        let api: Api<DynamicObject> =
            Api::all_with(self.client.clone(), &ApiResource::from_gvk(&gvk));
        match api.list(&ListParams::default()).await {
            Ok(l) => Ok(l.items.iter().any(|c| c.data["driver"] == DRIVER)),
            Err(kube::Error::Api(e)) if e.code == 404 => Ok(false),
            Err(e) => Err(e).context("listing VolumeSnapshotClasses"),
        }
    }

    /// Every object of kind `K`, in every namespace (`what` names them in an error).
    async fn list_all<K>(&self, what: &str) -> Result<Vec<K>>
    where
        K: kube::Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug,
    {
        let api: Api<K> = Api::all(self.client.clone());
        let list = api.list(&ListParams::default()).await;
        Ok(list.with_context(|| format!("listing {what}"))?.items)
    }

    /// Every Deployment, in every namespace.
    pub async fn deployments(&self) -> Result<Vec<Deployment>> {
        self.list_all("Deployments").await
    }

    /// Every Event, in every namespace.
    pub async fn events(&self) -> Result<Vec<Event>> {
        self.list_all("Events").await
    }

    /// Every pod of ublkd's namespace.
    pub async fn pods(&self) -> Result<Vec<Pod>> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.ublkd_namespace);
        Ok(api
            .list(&ListParams::default())
            .await
            .with_context(|| format!("listing the pods in {}", self.ublkd_namespace))?
            .items)
    }

    /// The log of one container of a pod in ublkd's namespace.
    pub async fn log(&self, pod: &str, container: &str) -> Result<String> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.ublkd_namespace);
        let params = LogParams {
            container: Some(container.to_owned()),
            ..Default::default()
        };
        api.logs(pod, &params)
            .await
            .with_context(|| format!("reading the log of {pod}/{container}"))
    }

    pub fn ublkd_namespace(&self) -> &str {
        &self.ublkd_namespace
    }

    /// The claim `name` in `namespace` (the kubeconfig's namespace when None).
    pub async fn claim(
        &self,
        namespace: Option<&str>,
        name: &str,
    ) -> Result<PersistentVolumeClaim> {
        let api: Api<PersistentVolumeClaim> = match namespace {
            Some(ns) => Api::namespaced(self.client.clone(), ns),
            None => Api::default_namespaced(self.client.clone()),
        };
        api.get(name)
            .await
            .with_context(|| format!("reading the claim {name}"))
    }

    pub async fn volume(&self, pv: &str) -> Result<PersistentVolume> {
        let api: Api<PersistentVolume> = Api::all(self.client.clone());
        api.get(pv)
            .await
            .with_context(|| format!("reading the PersistentVolume {pv}"))
    }

    /// Every PV of the driver.
    pub async fn driver_volumes(&self) -> Result<Vec<PersistentVolume>> {
        let list: Vec<PersistentVolume> = self.list_all("PersistentVolumes").await?;
        Ok(list
            .into_iter()
            .filter(|pv| location(pv).is_some())
            .collect())
    }

    /// Every PV of the driver, where its volume is.
    pub async fn locations(&self) -> Result<Vec<Location>> {
        Ok(self
            .driver_volumes()
            .await?
            .iter()
            .filter_map(location)
            .collect())
    }

    /// The ublkd pods, with their nodes, by node name.
    pub async fn ublkd_pods(&self) -> Result<BTreeMap<String, String>> {
        let api: Api<Pod> = Api::namespaced(self.client.clone(), &self.ublkd_namespace);
        let list = api
            .list(&ListParams::default().labels(UBLKD_POD_LABEL))
            .await
            .with_context(|| format!("listing the ublkd pods in {}", self.ublkd_namespace))?;
        Ok(list
            .items
            .into_iter()
            .filter_map(|p| {
                let node = p.spec.as_ref()?.node_name.clone()?;
                Some((node, p.metadata.name?))
            })
            .collect())
    }

    /// The capacity objects of the driver: (node, class, bytes).
    pub async fn capacities(&self) -> Result<Vec<(String, String, String)>> {
        let list: Vec<CSIStorageCapacity> = self.list_all("CSIStorageCapacity objects").await?;
        Ok(list.iter().filter_map(capacity_of).collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::{
        CSIPersistentVolumeSource, NodeSelector, NodeSelectorRequirement, NodeSelectorTerm,
        PersistentVolumeSpec, VolumeNodeAffinity,
    };
    use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{LabelSelector, ObjectMeta};

    fn pv(driver: &str, handle: &str, key: &str, node: &str) -> PersistentVolume {
        PersistentVolume {
            metadata: ObjectMeta {
                name: Some("pvc-1".into()),
                ..Default::default()
            },
            spec: Some(PersistentVolumeSpec {
                csi: Some(CSIPersistentVolumeSource {
                    driver: driver.into(),
                    volume_handle: handle.into(),
                    ..Default::default()
                }),
                node_affinity: Some(VolumeNodeAffinity {
                    required: Some(NodeSelector {
                        node_selector_terms: vec![NodeSelectorTerm {
                            match_expressions: Some(vec![NodeSelectorRequirement {
                                key: key.into(),
                                operator: "In".into(),
                                values: Some(vec![node.into()]),
                            }]),
                            ..Default::default()
                        }],
                    }),
                }),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn a_pv_of_the_driver_names_its_volume_and_node() {
        let l = location(&pv(DRIVER, "vol-a", TOPOLOGY_KEY, "node-b")).unwrap();
        assert_eq!(l.pv, "pvc-1");
        assert_eq!(l.volume, "vol-a");
        assert_eq!(l.node.as_deref(), Some("node-b"));
    }

    #[test]
    fn other_drivers_and_other_keys_are_not_ours() {
        assert_eq!(location(&pv("other.io", "v", TOPOLOGY_KEY, "n")), None);
        let l = location(&pv(DRIVER, "v", "kubernetes.io/hostname", "n")).unwrap();
        assert_eq!(l.node, None, "only ublkd.io/node places a volume");
        assert_eq!(location(&PersistentVolume::default()), None);
    }

    #[test]
    fn capacity_objects_are_read_by_their_node_label() {
        let c = CSIStorageCapacity {
            storage_class_name: "ublkd-ram".into(),
            capacity: Some(Quantity("1Gi".into())),
            node_topology: Some(LabelSelector {
                match_labels: Some([(TOPOLOGY_KEY.to_owned(), "n1".to_owned())].into()),
                ..Default::default()
            }),
            ..Default::default()
        };
        assert_eq!(
            capacity_of(&c),
            Some(("n1".into(), "ublkd-ram".into(), "1Gi".into()))
        );
        let none = CSIStorageCapacity {
            node_topology: None,
            ..c
        };
        assert_eq!(capacity_of(&none), None);
    }
}
