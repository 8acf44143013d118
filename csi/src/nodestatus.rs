//! Each node's state where `kubectl get` reads it, so that day-2 work needs no exec into
//! ublkd's pods (root on the node) and no remote-access certificate.
//!
//! The node plugin (`--report-status-every`) writes one cluster-scoped `UblkdNode` object
//! (`ublkd.io/v1alpha1`, named after the node) by server-side apply: ublkd's version and ublk
//! features; per StorageClass of the driver, its pool's total and free bytes (and whether a
//! file root clones by reflink); every volume with its state, device, limits, I/O counters and
//! the PV and claim it was made for; the ublk devices no volume owns; and the node's preflight
//! checks. The chart's
//! read-only `ublkd-viewer` ClusterRole reads it; `kubectl ublkd` is built on it. A round that
//! cannot read ublkd still writes what it knows, with `error` saying why, so a stale or partial
//! report is never mistaken for a healthy one (`reportedAt` dates every write).
//!
//! It looks every `--report-status-every` and writes only when the report changed, its I/O
//! counters and pool bytes aside, or when its last write is a minute old ([`REFRESH`]): an idle
//! node writes once a minute, and `reportedAt` stays younger than `kubectl ublkd check`'s two
//! minutes. The StorageClasses are read from the plugin's watch (`watch`), not listed.

use crate::params::Params;
use crate::ublkd::{Ublkd, UblkdError};
use crate::{Node, DRIVER_NAME};
use k8s_openapi::api::storage::v1::StorageClass;
use kube::api::{Api, ApiResource, DynamicObject, GroupVersionKind, Patch, PatchParams};
use kube::runtime::reflector::Store;
use kube::Client;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};
use std::time::Duration;
use ublkd_client::v1;
use ublkd_proto::BackendKind;

pub const GROUP: &str = "ublkd.io";
pub const VERSION: &str = "v1alpha1";
pub const KIND: &str = "UblkdNode";
pub const PLURAL: &str = "ublkdnodes";
/// The field manager of the node plugin's server-side apply.
const MANAGER: &str = "ublkd-csi";
/// The longest a written report goes unwritten: the I/O counters and pool bytes are at most
/// this old, and so is `reportedAt`.
pub const REFRESH: Duration = Duration::from_secs(60);

/// The API resource of `UblkdNode`, for a dynamic client.
pub fn resource() -> ApiResource {
    ApiResource::from_gvk_with_plural(&GroupVersionKind::gvk(GROUP, VERSION, KIND), PLURAL)
}

#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    #[error("writing UblkdNode {node}: {source}")]
    Apply {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("listing {what}: {source}")]
    List {
        what: &'static str,
        #[source]
        source: kube::Error,
    },
    #[error("asking ublkd: {0}")]
    Ublkd(#[from] UblkdError),
    #[error("encoding the status: {0}")]
    Encode(#[from] serde_json::Error),
}

/// A `UblkdNode`'s `status`: what its node plugin saw at `reported_at`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct NodeStatus {
    /// RFC 3339, UTC.
    pub reported_at: String,
    pub ublkd_version: String,
    pub kernel_release: String,
    pub ublk_features: Vec<String>,
    pub pools: Vec<PoolStatus>,
    pub volumes: Vec<VolumeStatus>,
    pub orphan_devices: Vec<OrphanDevice>,
    pub checks: Vec<Check>,
    /// What this round could not read (empty when the report is whole).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

/// A backend kind in the report: the API's name for it (`BackendKind::name`), so that a kind
/// is named the same in the API, the StorageClass, the metrics and here, from one list.
mod kind_name {
    use serde::{Deserialize, Deserializer, Serializer};
    use ublkd_proto::BackendKind;

    pub fn serialize<S: Serializer>(kind: &BackendKind, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(kind.name())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<BackendKind, D::Error> {
        let name = String::deserialize(d)?;
        BackendKind::named(&name).ok_or_else(|| {
            serde::de::Error::custom(format!(
                "backend {name:?} is none of {}",
                BackendKind::all_names()
            ))
        })
    }
}

impl NodeStatus {
    /// Whether it says anything `before` did not, beside its date, I/O counters and pool bytes
    /// (those wait for [`REFRESH`]).
    pub fn differs_from(&self, before: &NodeStatus) -> bool {
        fn settled(s: &NodeStatus) -> NodeStatus {
            let mut s = s.clone();
            s.reported_at.clear();
            for p in &mut s.pools {
                (p.total_bytes, p.available_bytes) = (0, 0);
            }
            for v in &mut s.volumes {
                v.io = v.io.map(|_| IoCounters::default());
            }
            s
        }
        settled(self) != settled(before)
    }
}

/// The pool a StorageClass of the driver takes its bytes from, on this node.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct PoolStatus {
    pub storage_class: String,
    #[serde(with = "kind_name")]
    pub backend: BackendKind,
    /// The file root or the namespace's char device; empty for RAM.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub place: String,
    pub total_bytes: u64,
    pub available_bytes: u64,
    /// File pools: whether the root clones files by reflink (snapshots and clones need it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reflink: Option<bool>,
    /// Why the pool could not be measured (a bad class, a missing namespace, ublkd down).
    #[serde(skip_serializing_if = "String::is_empty")]
    pub error: String,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct VolumeStatus {
    pub id: String,
    /// ublkd's state word: ready, failed, recovering…
    pub state: String,
    #[serde(with = "kind_name")]
    pub backend: BackendKind,
    pub size_bytes: u64,
    #[serde(skip_serializing_if = "String::is_empty")]
    pub device: String,
    /// Why the volume failed, if it did.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub message: String,
    pub limits: Limits,
    /// The PersistentVolume naming it, and that PV's claim as `namespace/name`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pv: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub claim: Option<String>,
    /// Its I/O counters since ublkd started serving it (absent when ublkd did not answer).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub io: Option<IoCounters>,
}

/// A volume's limits; 0 is unlimited.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct Limits {
    pub read_iops: u64,
    pub write_iops: u64,
    pub read_bytes_per_second: u64,
    pub write_bytes_per_second: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct IoCounters {
    pub reads: u64,
    pub read_bytes: u64,
    pub writes: u64,
    pub write_bytes: u64,
    pub errors: u64,
}

/// A ublk device in the kernel that no volume of ublkd owns.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
pub struct OrphanDevice {
    pub dev_id: u32,
    pub state: String,
}

/// The node's preflight checks, each with what it found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum CheckName {
    /// `ublk_drv` loaded, with user recovery: ublkd's dataplane runs.
    UblkDriver,
    /// Every file class's root clones by reflink.
    ReflinkRoots,
    /// Every NVMe class's namespace is on the node as a generic char device.
    NvmeNamespaces,
    /// The kubelet's directory exists and is mounted with shared propagation into the plugin.
    KubeletDir,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Check {
    pub name: CheckName,
    pub ok: bool,
    pub detail: String,
}

impl Check {
    fn new(name: CheckName, problems: Vec<String>, fine: &str) -> Check {
        Check {
            name,
            ok: problems.is_empty(),
            detail: if problems.is_empty() {
                fine.to_owned()
            } else {
                problems.join("; ")
            },
        }
    }
}

/// `VOLUME_STATE_READY` -> `ready`.
impl VolumeStatus {
    /// Still being made: it has no PersistentVolume yet by rule, whatever the reports say.
    pub fn is_creating(&self) -> bool {
        self.state == state_word(v1::VolumeState::Creating as i32)
    }
}

fn state_word(state: i32) -> String {
    v1::VolumeState::try_from(state).map_or_else(
        |_| state.to_string(),
        |s| {
            s.as_str_name()
                .trim_start_matches("VOLUME_STATE_")
                .to_ascii_lowercase()
        },
    )
}

/// A volume's backend kind (null for a spec without one).
fn backend_of(spec: Option<&v1::VolumeSpec>) -> BackendKind {
    spec.and_then(|s| s.backend.as_ref())
        .map_or(BackendKind::Null, BackendKind::of)
}

/// The volume as the report carries it; its PV and claim are those its create was made for
/// (the provisioner's metadata, kept by ublkd), so no node lists the cluster's PVs.
pub fn volume_status(v: &v1::Volume, io: Option<IoCounters>) -> VolumeStatus {
    let q = v.spec.as_ref().and_then(|s| s.qos).unwrap_or_default();
    let claim = v.spec.as_ref().and_then(|s| s.claim.as_ref());
    let nonempty = |s: &str| (!s.is_empty()).then(|| s.to_owned());
    VolumeStatus {
        id: v.id.clone(),
        state: state_word(v.state),
        backend: backend_of(v.spec.as_ref()),
        size_bytes: v.spec.as_ref().map_or(0, |s| s.size_bytes),
        device: v.device_path.clone(),
        message: v.message.clone(),
        limits: Limits {
            read_iops: q.read_iops,
            write_iops: q.write_iops,
            read_bytes_per_second: q.read_bytes_per_second,
            write_bytes_per_second: q.write_bytes_per_second,
        },
        pv: claim.and_then(|c| nonempty(&c.persistent_volume)),
        claim: claim.and_then(|c| nonempty(&c.name).map(|n| format!("{}/{n}", c.namespace))),
        io,
    }
}

/// The counters of `GetVolumeStats`, summed per direction.
pub fn io_counters(s: &v1::VolumeStats) -> IoCounters {
    let op = |name: &str| s.ops.iter().find(|o| o.op == name);
    IoCounters {
        reads: op("read").map_or(0, |o| o.count),
        read_bytes: op("read").map_or(0, |o| o.bytes),
        writes: op("write").map_or(0, |o| o.count),
        write_bytes: op("write").map_or(0, |o| o.bytes),
        errors: s.errors,
    }
}

/// Whether the mount holding `dir` propagates mounts to and from the host (its mountinfo line
/// carries `shared:N`): the kubelet's mounts of a volume reach the plugin's, and the plugin's
/// reach pods, only then. `mountinfo` is `/proc/self/mountinfo`'s text.
pub fn propagation(mountinfo: &str, dir: &Path) -> Result<(), String> {
    let holder = mountinfo
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            let point = Path::new(f.get(4)?);
            let sep = f.iter().position(|x| *x == "-")?;
            dir.starts_with(point)
                .then(|| (point.to_path_buf(), f[6..sep].join(" ")))
        })
        .max_by_key(|(p, _)| p.as_os_str().len());
    match holder {
        None => Err(format!("no mount holds {}", dir.display())),
        Some((_, opt)) if opt.split(' ').any(|o| o.starts_with("shared:")) => Ok(()),
        Some((point, opt)) => Err(format!(
            "{} is mounted at {} without shared propagation ({}); the plugin's mounts never reach pods",
            dir.display(),
            point.display(),
            if opt.is_empty() { "private" } else { opt.as_str() }
        )),
    }
}

/// The node's checks, from what this round read.
pub fn checks(
    info: Result<&v1::NodeInfo, &str>,
    pools: &[PoolStatus],
    kubelet: Result<(), String>,
) -> Vec<Check> {
    let driver = match info {
        Ok(i) if i.dataplane_error.is_empty() => Vec::new(),
        Ok(i) => vec![i.dataplane_error.clone()],
        Err(e) => vec![format!("ublkd did not answer: {e}")],
    };
    let reflink = pools
        .iter()
        .filter(|p| p.backend == BackendKind::File && p.reflink != Some(true))
        .map(|p| {
            format!(
                "{} ({}): {}",
                p.storage_class,
                p.place,
                if p.error.is_empty() {
                    "no reflink: snapshots and clones of its volumes are refused"
                } else {
                    &p.error
                }
            )
        })
        .collect();
    let nvme = pools
        .iter()
        .filter(|p| p.backend == BackendKind::Nvme && !p.error.is_empty())
        .map(|p| format!("{} ({}): {}", p.storage_class, p.place, p.error))
        .collect();
    vec![
        Check::new(CheckName::UblkDriver, driver, "ublk_drv with user recovery"),
        Check::new(
            CheckName::ReflinkRoots,
            reflink,
            "every file root clones by reflink",
        ),
        Check::new(
            CheckName::NvmeNamespaces,
            nvme,
            "every NVMe class's namespace is here",
        ),
        Check::new(
            CheckName::KubeletDir,
            kubelet.err().into_iter().collect(),
            "shared propagation",
        ),
    ]
}

/// The pool of one StorageClass of the driver.
async fn pool(ublkd: &Ublkd, class: &StorageClass) -> PoolStatus {
    let mut p = PoolStatus {
        storage_class: class.metadata.name.clone().unwrap_or_default(),
        ..Default::default()
    };
    let params: HashMap<String, String> = class
        .parameters
        .clone()
        .unwrap_or_default()
        .into_iter()
        .collect();
    let params = match Params::parse(&params) {
        Ok(params) => params,
        Err(e) => {
            p.error = e.to_string();
            return p;
        }
    };
    (p.backend, p.place) = (params.backend.kind(), params.backend.place().to_owned());
    match ublkd.capacity(params.capacity_backend()).await {
        Ok(c) => {
            p.total_bytes = c.total_bytes;
            p.available_bytes = c.available_bytes;
            p.reflink = (p.backend == BackendKind::File).then_some(c.reflink);
        }
        Err(e) => p.error = e.to_string(),
    }
    p
}

/// Everything the plugin writes to ublkd.io's API about this node, and the rights it needs.
struct Reporter {
    ublkd: Ublkd,
    node: Node,
    kubelet_dir: PathBuf,
    client: Client,
    classes: Store<StorageClass>,
}

impl Reporter {
    /// One round: what ublkd and the API say now; what could not be read is in `error`.
    async fn gather(&self) -> NodeStatus {
        let mut errors = Vec::new();
        let info = self.ublkd.node_info().await.map_err(|e| e.to_string());
        if let Err(e) = &info {
            errors.push(format!("ublkd's node info: {e}"));
        }
        let mut classes = self.classes.state();
        classes.retain(|c| c.provisioner == DRIVER_NAME);
        classes.sort_by(|a, b| a.metadata.name.cmp(&b.metadata.name));
        let mut pools = Vec::new();
        for c in &classes {
            pools.push(pool(&self.ublkd, c).await);
        }
        let mut volumes = Vec::new();
        match self.ublkd.list().await {
            Ok(list) => {
                for v in &list {
                    let io = match self.ublkd.stats(&v.id).await {
                        Ok(s) => Some(io_counters(&s)),
                        Err(e) => {
                            errors.push(format!("stats of {}: {e}", v.id));
                            None
                        }
                    };
                    volumes.push(volume_status(v, io));
                }
            }
            Err(e) => errors.push(format!("ublkd's volumes: {e}")),
        }
        let kubelet = std::fs::read_to_string("/proc/self/mountinfo")
            .map_err(|e| format!("reading /proc/self/mountinfo: {e}"))
            .and_then(|m| propagation(&m, &self.kubelet_dir));
        let info = info.as_ref().map_err(String::as_str);
        NodeStatus {
            reported_at: k8s_openapi::jiff::Timestamp::now().to_string(),
            ublkd_version: info.map(|i| i.version.clone()).unwrap_or_default(),
            kernel_release: info.map(|i| i.kernel_release.clone()).unwrap_or_default(),
            ublk_features: info
                .map(|i| i.ublk_feature_names.clone())
                .unwrap_or_default(),
            orphan_devices: info
                .map(|i| {
                    i.orphans
                        .iter()
                        .map(|o| OrphanDevice {
                            dev_id: o.dev_id,
                            state: o.state.clone(),
                        })
                        .collect()
                })
                .unwrap_or_default(),
            checks: checks(info, &pools, kubelet),
            pools,
            volumes,
            error: errors.join("; "),
        }
    }

    /// Writes `status` as this node's `UblkdNode`.
    async fn apply(&self, status: &NodeStatus) -> Result<(), StatusError> {
        let api: Api<DynamicObject> = Api::all_with(self.client.clone(), &resource());
        let labels: BTreeMap<&str, &str> = [("app.kubernetes.io/name", "ublkd")].into();
        let object = serde_json::json!({
            "apiVersion": format!("{GROUP}/{VERSION}"),
            "kind": KIND,
            "metadata": {"name": self.node.0, "labels": labels},
            "status": serde_json::to_value(status)?,
        });
        api.patch(
            &self.node.0,
            &PatchParams::apply(MANAGER).force(),
            &Patch::Apply(&object),
        )
        .await
        .map_err(|source| StatusError::Apply {
            node: self.node.0.clone(),
            source,
        })?;
        Ok(())
    }
}

/// Looks every `every` until the process ends and writes this node's `UblkdNode` when the
/// report changed or [`REFRESH`] passed since the last write (once `classes` holds its first
/// list); a write that fails is logged and tried again at the next look.
pub async fn run(
    ublkd: Ublkd,
    node: Node,
    kubelet_dir: PathBuf,
    every: Duration,
    client: Client,
    classes: crate::watch::Kept<StorageClass>,
) {
    let Some(classes) = classes.listed().await else {
        return;
    };
    let reporter = Reporter {
        ublkd,
        node,
        kubelet_dir,
        client,
        classes,
    };
    let mut written: Option<(NodeStatus, tokio::time::Instant)> = None;
    loop {
        let status = reporter.gather().await;
        let due = match &written {
            None => true,
            Some((last, at)) => status.differs_from(last) || at.elapsed() >= REFRESH,
        };
        if due {
            if !status.error.is_empty() {
                tracing::warn!(error = %status.error, "the node's status is partial");
            }
            match reporter.apply(&status).await {
                Ok(()) => written = Some((status, tokio::time::Instant::now())),
                Err(e) => {
                    tracing::error!(error = %e, "the node's status was not written; `kubectl ublkd` reads an old one until the next round")
                }
            }
        }
        tokio::time::sleep(every).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// What changes with every I/O waits for the refresh; what an operator acts on is written
    /// at once.
    #[test]
    fn only_what_is_not_a_counter_makes_a_new_write() {
        let volume = VolumeStatus {
            id: "v1".into(),
            state: "ready".into(),
            io: Some(IoCounters::default()),
            ..Default::default()
        };
        let pool = PoolStatus {
            storage_class: "ublkd-file".into(),
            total_bytes: 100,
            available_bytes: 50,
            ..Default::default()
        };
        let before = NodeStatus {
            reported_at: "2026-12-07T10:00:00Z".into(),
            pools: vec![pool],
            volumes: vec![volume],
            ..Default::default()
        };
        let mut busy = before.clone();
        busy.reported_at = "2026-12-07T10:00:30Z".into();
        busy.pools[0].available_bytes = 40;
        busy.volumes[0].io = Some(IoCounters {
            writes: 9,
            write_bytes: 9 << 12,
            ..Default::default()
        });
        assert!(!busy.differs_from(&before));
        let mut failed = busy.clone();
        failed.volumes[0].state = "failed".into();
        assert!(failed.differs_from(&before));
        let mut unread = busy.clone();
        unread.volumes[0].io = None;
        assert!(
            unread.differs_from(&before),
            "counters that could not be read"
        );
        let mut gone = busy;
        gone.volumes.clear();
        assert!(gone.differs_from(&before));
    }

    /// A status as b69c0a8's node plugin wrote it, every field set once.
    const WRITTEN_BY_B69C0A8: &str =
        include_str!("../../tests/fixtures/ublkdnode-b69c0a8/status.json");

    /// A status an earlier version wrote reads with today's types and is written back unchanged:
    /// no field renamed, dropped or retyped (`default` would read a renamed one as empty).
    #[test]
    fn a_status_written_by_b69c0a8_reads_and_writes_back_unchanged() {
        let written: serde_json::Value = serde_json::from_str(WRITTEN_BY_B69C0A8).unwrap();
        let read: NodeStatus = serde_json::from_value(written.clone()).unwrap();
        assert_eq!(serde_json::to_value(&read).unwrap(), written);
    }

    /// The keys under `{key}: ... properties:` in the chart's CRD (YAML read by indentation:
    /// a key per line, in the block form the template uses).
    fn schema_properties(crd: &str, key: &str) -> BTreeSet<String> {
        let indent = |l: &str| l.len() - l.trim_start().len();
        let mut lines = crd.lines().skip_while(|l| l.trim() != format!("{key}:"));
        let at = lines.next().map(indent).unwrap();
        let mut lines = lines.skip_while(|l| l.trim() != "properties:");
        let props = lines.next().map(indent).unwrap();
        assert!(props > at, "{key}'s properties");
        let mut lines = lines.peekable();
        let first = lines.peek().map(|l| indent(l)).unwrap();
        lines
            .take_while(|l| indent(l) >= first)
            .filter(|l| indent(l) == first)
            .map(|l| l.trim().split(':').next().unwrap().to_owned())
            .collect()
    }

    fn keys(v: &serde_json::Value) -> BTreeSet<String> {
        v.as_object().unwrap().keys().cloned().collect()
    }

    /// The chart's CRD names every field the status writes: the API server drops a field its
    /// schema does not name, without a word, and `kubectl ublkd` would read it as empty.
    #[test]
    fn the_charts_crd_names_every_field_the_status_writes() {
        let crd = include_str!("../../deploy/helm/ublkd/templates/ublkdnode-crd.yaml");
        let status = NodeStatus {
            error: "every field written".into(),
            checks: vec![Check::new(CheckName::UblkDriver, vec![], "loaded")],
            ..Default::default()
        };
        let status = serde_json::to_value(&status).unwrap();
        assert_eq!(schema_properties(crd, "status"), keys(&status));
        assert_eq!(schema_properties(crd, "checks"), keys(&status["checks"][0]));
        let old: serde_json::Value = serde_json::from_str(WRITTEN_BY_B69C0A8).unwrap();
        assert!(
            keys(&old).is_subset(&keys(&status)),
            "a field b69c0a8 wrote is gone"
        );
    }

    /// The report names each kind as the API does.
    #[test]
    fn the_reports_kinds_are_the_apis() {
        for kind in BackendKind::ALL {
            let pool = PoolStatus {
                backend: kind,
                ..Default::default()
            };
            let written = serde_json::to_value(&pool).unwrap();
            assert_eq!(written["backend"], kind.name());
            let read: PoolStatus = serde_json::from_value(written).unwrap();
            assert_eq!(read.backend, kind);
        }
        let unknown = serde_json::json!({"backend": "tape"});
        assert!(serde_json::from_value::<PoolStatus>(unknown).is_err());
    }

    #[test]
    fn propagation_is_read_from_the_mount_that_holds_the_directory() {
        let shared = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                      90 22 0:5 / /var/lib/kubelet rw shared:40 - tmpfs tmpfs rw\n";
        assert_eq!(propagation(shared, Path::new("/var/lib/kubelet")), Ok(()));
        let private = "22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw\n\
                       90 22 0:5 / /var/lib/kubelet rw - tmpfs tmpfs rw\n";
        let e = propagation(private, Path::new("/var/lib/kubelet/pods")).unwrap_err();
        assert!(e.contains("without shared propagation (private)"), "{e}");
        let slave = "22 1 8:1 / / rw master:3 - ext4 /dev/sda1 rw\n";
        let e = propagation(slave, Path::new("/var/lib/kubelet")).unwrap_err();
        assert!(e.contains("master:3"), "{e}");
        assert!(propagation("", Path::new("/x")).is_err());
    }

    #[test]
    fn checks_name_what_is_wrong() {
        let info = v1::NodeInfo {
            dataplane_error: "ublk_drv is not loaded".into(),
            ..Default::default()
        };
        let pools = vec![
            PoolStatus {
                storage_class: "f".into(),
                backend: BackendKind::File,
                place: "/srv".into(),
                reflink: Some(false),
                ..Default::default()
            },
            PoolStatus {
                storage_class: "n".into(),
                backend: BackendKind::Nvme,
                place: "/dev/ng9n1".into(),
                error: "no such device".into(),
                ..Default::default()
            },
            PoolStatus {
                storage_class: "r".into(),
                backend: BackendKind::Ram,
                ..Default::default()
            },
        ];
        let c = checks(Ok(&info), &pools, Ok(()));
        let failing: Vec<CheckName> = c.iter().filter(|c| !c.ok).map(|c| c.name).collect();
        assert_eq!(
            failing,
            [
                CheckName::UblkDriver,
                CheckName::ReflinkRoots,
                CheckName::NvmeNamespaces
            ]
        );
        assert!(c[1].detail.contains("f (/srv): no reflink"));
        assert!(c[2].detail.contains("/dev/ng9n1"));
        let fine = checks(Ok(&v1::NodeInfo::default()), &pools[2..], Ok(()));
        assert!(fine.iter().all(|c| c.ok), "{fine:?}");
        let down = checks(Err("connection refused"), &[], Err("x".into()));
        assert!(!down[0].ok && down[0].detail.contains("connection refused"));
        assert!(!down[3].ok);
    }

    #[test]
    fn volumes_carry_the_pv_and_claim_they_were_made_for() {
        let mut v = v1::Volume {
            id: "v1".into(),
            state: v1::VolumeState::Ready.into(),
            spec: Some(v1::VolumeSpec {
                claim: Some(v1::Claim {
                    namespace: "ns".into(),
                    name: "data".into(),
                    persistent_volume: "pvc-1".into(),
                }),
                ..Default::default()
            }),
            ..Default::default()
        };
        let s = volume_status(&v, None);
        assert_eq!(s.state, "ready");
        assert_eq!(s.pv.as_deref(), Some("pvc-1"));
        assert_eq!(s.claim.as_deref(), Some("ns/data"));
        v.spec = None;
        let s = volume_status(&v, None);
        assert_eq!((s.pv, s.claim), (None, None), "made outside Kubernetes");
    }

    #[test]
    fn the_status_reads_back_as_written() {
        let s = NodeStatus {
            reported_at: "2026-12-05T20:00:00Z".into(),
            checks: checks(Ok(&v1::NodeInfo::default()), &[], Ok(())),
            ..Default::default()
        };
        let v = serde_json::to_value(&s).expect("json");
        assert_eq!(v["checks"][0]["name"], "ublk-driver");
        assert_eq!(serde_json::from_value::<NodeStatus>(v).expect("back"), s);
    }
}
