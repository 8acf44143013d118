//! Faults told to the people who use a volume, as Kubernetes Events (`--fault-events-every`).
//! The node plugin looks at its ublkd every few seconds and posts a Warning on a volume's
//! claim, and on the pods of this node that use the claim, when the volume turns FAILED, stays
//! RECOVERING past a bound, or counts new I/O or ublk protocol errors; and a Normal one when it
//! is READY again with no new error. A ublkd without a dataplane (no usable `ublk_drv`) is a
//! Warning on the Node, and serving again a Normal one. `judge` and `judge_node` (pure) say
//! what to post: each Warning once per episode, never on every look. A ublkd out of reach is
//! judged nothing; a failed post is logged and tried again on the next look. A grow that
//! ublkd refused (NodeExpandVolume: past the node's memory or free space) reaches the loop as a
//! [`Refusal`] and is a Warning on the claim and its pods at once, where the claim's owner
//! looks (the kubelet itself marks only the claim's conditions and the pod).

use crate::ublkd::{Ublkd, UblkdError};
use crate::{Node, DRIVER_NAME};
use k8s_openapi::api::core::v1::{
    Node as KubeNode, ObjectReference, PersistentVolume, PersistentVolumeClaim, Pod,
};
use kube::api::{Api, ListParams};
use kube::runtime::events::{Event, EventType, Recorder, Reporter};
use kube::{Client, Resource, ResourceExt};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};
use ublkd_client::v1;

/// The Events' reporting controller.
const REPORTER: &str = "ublkd.io/csi-node";
/// An Event's note is at most 1 kB.
const NOTE_BYTES: usize = 1000;

#[derive(Debug, thiserror::Error)]
pub enum FaultsError {
    #[error("connecting to the API server: {0}")]
    Connect(#[source] kube::Error),
    #[error("reading {kind} {name}: {source}")]
    Read {
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
    #[error("listing the pods of node {node}: {source}")]
    ListPods {
        node: String,
        #[source]
        source: kube::Error,
    },
    #[error("posting {reason} on {kind} {name}: {source}")]
    Post {
        reason: &'static str,
        kind: &'static str,
        name: String,
        #[source]
        source: kube::Error,
    },
}

/// Why an Event is posted: its `reason`, as `kubectl describe` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Reason {
    /// The volume is FAILED (its note: ublkd's message).
    VolumeFailed,
    /// The volume has been RECOVERING longer than the bound.
    VolumeRecoveringTooLong,
    /// The volume's I/O error count grew since the last look.
    VolumeIOErrors,
    /// The volume's ublk protocol error count grew since the last look.
    VolumeProtocolErrors,
    /// Normal: READY with no new error, after a Warning.
    VolumeRecovered,
    /// The node's ublkd runs without a dataplane (its note: why).
    UblkUnavailable,
    /// Normal: the dataplane runs again, after UblkUnavailable.
    UblkAvailable,
    /// ublkd refused to grow the volume (its note: ublkd's message).
    ExpandRefused,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::VolumeFailed => "VolumeFailed",
            Reason::VolumeRecoveringTooLong => "VolumeRecoveringTooLong",
            Reason::VolumeIOErrors => "VolumeIOErrors",
            Reason::VolumeProtocolErrors => "VolumeProtocolErrors",
            Reason::VolumeRecovered => "VolumeRecovered",
            Reason::UblkUnavailable => "UblkUnavailable",
            Reason::UblkAvailable => "UblkAvailable",
            Reason::ExpandRefused => "ExpandRefused",
        }
    }

    pub fn is_warning(self) -> bool {
        !matches!(self, Reason::VolumeRecovered | Reason::UblkAvailable)
    }
}

/// A grow of `volume` that ublkd refused, with ublkd's reason.
#[derive(Debug, Clone)]
pub struct Refusal {
    pub volume: v1::Volume,
    pub note: String,
}

/// Where the node service hands the refusals it meets to the fault-events loop.
#[derive(Debug, Clone)]
pub struct Refusals(tokio::sync::mpsc::Sender<Refusal>);

impl Refusals {
    /// A sender for the node service, and the receiver [`run`] posts from.
    pub fn channel() -> (Refusals, tokio::sync::mpsc::Receiver<Refusal>) {
        let (tx, rx) = tokio::sync::mpsc::channel(64);
        (Refusals(tx), rx)
    }

    /// Hands `refusal` to the loop without waiting: a full queue, or a loop that has ended, is
    /// logged (the refusal is then in this log and the kubelet's only).
    pub fn tell(&self, refusal: Refusal) {
        if let Err(e) = self.0.try_send(refusal) {
            let (why, r) = match e {
                tokio::sync::mpsc::error::TrySendError::Full(r) => ("the queue is full", r),
                tokio::sync::mpsc::error::TrySendError::Closed(r) => ("the loop has ended", r),
            };
            tracing::warn!(volume = %r.volume.id, note = %r.note, why, "an ExpandRefused event is not posted");
        }
    }
}

/// One Event to post.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verdict {
    pub reason: Reason,
    pub note: String,
}

/// A volume's error counters at one look.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Counts {
    pub io_errors: u64,
    pub protocol_errors: u64,
    pub last_protocol_errno: u32,
}

/// What one look saw of a volume.
#[derive(Debug, Clone, PartialEq)]
pub struct Look {
    pub id: String,
    pub state: v1::VolumeState,
    /// ublkd's word on it (why it is FAILED).
    pub message: String,
    /// None without counters (not READY, or the call failed).
    pub counts: Option<Counts>,
}

impl Look {
    pub fn of(v: &v1::Volume, stats: Option<&v1::VolumeStats>) -> Look {
        Look {
            id: v.id.clone(),
            state: v.state(),
            message: v.message.clone(),
            counts: stats.map(|s| Counts {
                io_errors: s.errors,
                protocol_errors: s.protocol_errors,
                last_protocol_errno: s.last_protocol_errno,
            }),
        }
    }
}

/// What is remembered of a volume from one look to the next.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Track {
    /// When this stretch of RECOVERING was first seen.
    recovering_since: Option<Instant>,
    /// The counters of the last look (the baseline growth is measured from).
    counts: Option<Counts>,
    /// The Warnings posted since the volume was last well, each once.
    warned: Vec<Reason>,
}

/// Judges one look at a volume against the one before (`prev`; None: the first, whose
/// counters are only a baseline). A Warning fires once until the volume is READY with no new
/// error, which fires VolumeRecovered.
pub fn judge(
    prev: Option<&Track>,
    look: &Look,
    now: Instant,
    recovering_bound: Duration,
) -> (Track, Vec<Verdict>) {
    let mut warned = prev.map(|p| p.warned.clone()).unwrap_or_default();
    let was_warned = !warned.is_empty();
    let mut out = Vec::new();
    let mut warn = |reason: Reason, note: String| {
        if !warned.contains(&reason) {
            warned.push(reason);
            out.push(Verdict { reason, note });
        }
    };
    let id = &look.id;
    let mut recovering_since = None;
    match look.state {
        v1::VolumeState::Failed => warn(
            Reason::VolumeFailed,
            format!("ublkd volume {id} is FAILED: {}", look.message),
        ),
        v1::VolumeState::Recovering => {
            let since = prev.and_then(|p| p.recovering_since).unwrap_or(now);
            recovering_since = Some(since);
            let took = now.saturating_duration_since(since);
            if took >= recovering_bound {
                warn(
                    Reason::VolumeRecoveringTooLong,
                    format!(
                        "ublkd volume {id} has been RECOVERING for {} s (more than {} s): {}",
                        took.as_secs(),
                        recovering_bound.as_secs(),
                        look.message
                    ),
                );
            }
        }
        _ => {}
    }
    // Counters that went down belong to a new device (ublkd restarted): a new baseline.
    let grown = match (prev.and_then(|p| p.counts), look.counts) {
        (Some(before), Some(now)) => (
            now.io_errors.saturating_sub(before.io_errors),
            now.protocol_errors.saturating_sub(before.protocol_errors),
        ),
        _ => (0, 0),
    };
    if let (n @ 1.., Some(c)) = (grown.0, look.counts) {
        warn(
            Reason::VolumeIOErrors,
            format!(
                "ublkd volume {id}: {n} failed I/O requests since the last look, {} in all",
                c.io_errors
            ),
        );
    }
    if let (n @ 1.., Some(c)) = (grown.1, look.counts) {
        warn(
            Reason::VolumeProtocolErrors,
            format!(
                "ublkd volume {id}: {n} ublk protocol errors since the last look (each stops a \
                 queue), {} in all, the last errno {}",
                c.protocol_errors, c.last_protocol_errno
            ),
        );
    }
    if look.state == v1::VolumeState::Ready && grown == (0, 0) && was_warned {
        warned.clear();
        out.push(Verdict {
            reason: Reason::VolumeRecovered,
            note: format!("ublkd volume {id} is READY again, with no new error"),
        });
    }
    let track = Track {
        recovering_since,
        counts: look.counts,
        warned,
    };
    (track, out)
}

/// What is remembered of the node from one look to the next.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct NodeTrack {
    told_unavailable: bool,
}

/// Judges NodeInfo's `dataplane_error` (empty: the dataplane runs): UblkUnavailable once,
/// UblkAvailable only after it.
pub fn judge_node(prev: NodeTrack, dataplane_error: &str) -> (NodeTrack, Option<Verdict>) {
    match (dataplane_error.is_empty(), prev.told_unavailable) {
        (false, false) => (
            NodeTrack {
                told_unavailable: true,
            },
            Some(Verdict {
                reason: Reason::UblkUnavailable,
                note: format!(
                    "ublkd serves no volume and the node offers no capacity: {dataplane_error}"
                ),
            }),
        ),
        (true, true) => (
            NodeTrack {
                told_unavailable: false,
            },
            Some(Verdict {
                reason: Reason::UblkAvailable,
                note: "ublkd's dataplane runs again: volumes are served".to_owned(),
            }),
        ),
        _ => (prev, None),
    }
}

/// The claim a PersistentVolume of this driver for volume `id` is bound to: namespace, name.
pub fn claim_ref_of(pv: &PersistentVolume, id: &str) -> Option<(String, String)> {
    let spec = pv.spec.as_ref()?;
    let csi = spec.csi.as_ref()?;
    if csi.driver != DRIVER_NAME || csi.volume_handle != id {
        return None;
    }
    let claim = spec.claim_ref.as_ref()?;
    Some((claim.namespace.clone()?, claim.name.clone()?))
}

/// The pods among `pods` that use claim `namespace/name`.
pub fn pods_using<'a>(pods: &'a [Pod], namespace: &str, name: &str) -> Vec<&'a Pod> {
    pods.iter()
        .filter(|p| p.metadata.namespace.as_deref() == Some(namespace))
        .filter(|p| {
            p.spec
                .iter()
                .flat_map(|s| s.volumes.iter().flatten())
                .any(|v| {
                    v.persistent_volume_claim
                        .as_ref()
                        .is_some_and(|c| c.claim_name == name)
                })
        })
        .collect()
}

/// `note` within an Event's bound, cut at a character.
fn cut(note: &str) -> String {
    let mut end = note.len().min(NOTE_BYTES);
    while !note.is_char_boundary(end) {
        end -= 1;
    }
    note[..end].to_owned()
}

fn log(verdict: &Verdict, what: &'static str, name: &str) {
    let reason = verdict.reason.name();
    if verdict.reason.is_warning() {
        tracing::warn!(%what, %name, reason, note = %verdict.note, "fault event");
    } else {
        tracing::info!(%what, %name, reason, note = %verdict.note, "fault event");
    }
}

/// One look at ublkd: why it has no dataplane (empty: it has), each volume with its counters
/// when it is READY.
struct Seen {
    dataplane_error: String,
    volumes: Vec<(v1::Volume, Option<v1::VolumeStats>)>,
}

async fn look(ublkd: &Ublkd) -> Result<Seen, UblkdError> {
    let info = ublkd.node_info().await?;
    let mut volumes = Vec::new();
    for v in ublkd.list().await? {
        let stats = if v.state() == v1::VolumeState::Ready {
            // A volume that left READY since the list has no counters: judged on its state
            // alone, and its next counters are a new baseline.
            ublkd.stats(&v.id).await.ok()
        } else {
            None
        };
        volumes.push((v, stats));
    }
    Ok(Seen {
        dataplane_error: info.dataplane_error,
        volumes,
    })
}

/// Posts Events for this node and its volumes.
struct Poster {
    client: Client,
    recorder: Recorder,
    node: Node,
}

impl Poster {
    async fn post(&self, verdict: &Verdict, on: &ObjectReference) -> Result<(), kube::Error> {
        let event = Event {
            type_: if verdict.reason.is_warning() {
                EventType::Warning
            } else {
                EventType::Normal
            },
            reason: verdict.reason.name().to_owned(),
            note: Some(cut(&verdict.note)),
            action: "CheckHealth".to_owned(),
            secondary: None,
        };
        self.recorder.publish(&event, on).await
    }

    async fn on_node(&self, verdict: &Verdict) -> Result<(), FaultsError> {
        let nodes: Api<KubeNode> = Api::all(self.client.clone());
        let name = &self.node.0;
        let node = nodes.get(name).await.map_err(|source| FaultsError::Read {
            kind: "Node",
            name: name.clone(),
            source,
        })?;
        self.post(verdict, &node.object_ref(&()))
            .await
            .map_err(|source| FaultsError::Post {
                reason: verdict.reason.name(),
                kind: "Node",
                name: name.clone(),
                source,
            })
    }

    /// The claim volume `v` was made for, from its record (the provisioner's
    /// --extra-create-metadata), else from the PersistentVolume named as the volume; None when
    /// there is none, or the claim of that name is bound to another volume.
    async fn claim_of(&self, v: &v1::Volume) -> Result<Option<PersistentVolumeClaim>, FaultsError> {
        let meta = v
            .spec
            .as_ref()
            .and_then(|s| s.claim.clone())
            .unwrap_or_default();
        let pv_name = if meta.persistent_volume.is_empty() {
            v.id.clone()
        } else {
            meta.persistent_volume
        };
        let (namespace, name) = if !meta.namespace.is_empty() && !meta.name.is_empty() {
            (meta.namespace, meta.name)
        } else {
            let pvs: Api<PersistentVolume> = Api::all(self.client.clone());
            let pv = pvs
                .get_opt(&pv_name)
                .await
                .map_err(|source| FaultsError::Read {
                    kind: "PersistentVolume",
                    name: pv_name.clone(),
                    source,
                })?;
            match pv.and_then(|pv| claim_ref_of(&pv, &v.id)) {
                Some(claim) => claim,
                None => return Ok(None),
            }
        };
        let claims: Api<PersistentVolumeClaim> = Api::namespaced(self.client.clone(), &namespace);
        let claim = claims
            .get_opt(&name)
            .await
            .map_err(|source| FaultsError::Read {
                kind: "PersistentVolumeClaim",
                name: format!("{namespace}/{name}"),
                source,
            })?;
        Ok(claim.filter(|c| {
            c.spec
                .as_ref()
                .and_then(|s| s.volume_name.as_deref())
                .is_none_or(|bound| bound == pv_name)
        }))
    }

    async fn pods(&self) -> Result<Vec<Pod>, FaultsError> {
        let pods: Api<Pod> = Api::all(self.client.clone());
        let on_node = ListParams::default().fields(&format!("spec.nodeName={}", self.node.0));
        pods.list(&on_node)
            .await
            .map(|l| l.items)
            .map_err(|source| FaultsError::ListPods {
                node: self.node.0.clone(),
                source,
            })
    }

    /// Posts `verdicts` on volume `v`'s claim, then on the pods of this node that use it (the
    /// pods listed once a round, in `pods`). Only the claim's post is tried again on failure:
    /// a pod's failed post is logged.
    async fn on_volume(
        &self,
        v: &v1::Volume,
        verdicts: &[Verdict],
        pods: &mut Option<Vec<Pod>>,
    ) -> Result<(), FaultsError> {
        let Some(claim) = self.claim_of(v).await? else {
            tracing::info!(volume = %v.id, "no claim is bound to this volume: its fault events are in this log only");
            return Ok(());
        };
        let (namespace, name) = (claim.namespace().unwrap_or_default(), claim.name_any());
        if pods.is_none() {
            *pods = Some(self.pods().await?);
        }
        let users = pods_using(pods.as_deref().unwrap_or_default(), &namespace, &name);
        for verdict in verdicts {
            self.post(verdict, &claim.object_ref(&()))
                .await
                .map_err(|source| FaultsError::Post {
                    reason: verdict.reason.name(),
                    kind: "PersistentVolumeClaim",
                    name: format!("{namespace}/{name}"),
                    source,
                })?;
            for pod in &users {
                if let Err(e) = self.post(verdict, &pod.object_ref(&())).await {
                    tracing::warn!(volume = %v.id, pod = %pod.name_any(), reason = verdict.reason.name(), error = %e, "posting a fault event on a pod failed");
                }
            }
        }
        Ok(())
    }
}

/// What is remembered between looks.
#[derive(Default)]
struct Book {
    node: NodeTrack,
    volumes: BTreeMap<String, Track>,
}

/// Judges one look and posts what it says. A subject whose post failed keeps its old track,
/// so that the next look judges (and posts) again.
async fn round(poster: &Poster, book: &mut Book, seen: Seen, now: Instant, bound: Duration) {
    let (track, verdict) = judge_node(book.node, &seen.dataplane_error);
    match verdict {
        None => book.node = track,
        Some(verdict) => {
            log(&verdict, "node", &poster.node.0);
            match poster.on_node(&verdict).await {
                Ok(()) => book.node = track,
                Err(e) => {
                    tracing::warn!(error = %e, "posting a fault event failed; trying again on the next look")
                }
            }
        }
    }
    let mut pods = None;
    let mut next = BTreeMap::new();
    for (v, stats) in &seen.volumes {
        let prev = book.volumes.get(&v.id);
        let (track, verdicts) = judge(prev, &Look::of(v, stats.as_ref()), now, bound);
        if verdicts.is_empty() {
            next.insert(v.id.clone(), track);
            continue;
        }
        for verdict in &verdicts {
            log(verdict, "volume", &v.id);
        }
        match poster.on_volume(v, &verdicts, &mut pods).await {
            Ok(()) => {
                next.insert(v.id.clone(), track);
            }
            Err(e) => {
                tracing::warn!(volume = %v.id, error = %e, "posting a fault event failed; trying again on the next look");
                if let Some(prev) = prev {
                    next.insert(v.id.clone(), prev.clone());
                }
            }
        }
    }
    // Volumes gone from ublkd are forgotten.
    book.volumes = next;
}

/// Posts ExpandRefused for `refusal` on its volume's claim and pods; a failed post is logged
/// (the kubelet retries the grow, and its next refusal is posted again).
async fn refused(poster: &Poster, refusal: Refusal) {
    let verdict = Verdict {
        reason: Reason::ExpandRefused,
        note: refusal.note,
    };
    log(&verdict, "volume", &refusal.volume.id);
    if let Err(e) = poster
        .on_volume(&refusal.volume, &[verdict], &mut None)
        .await
    {
        tracing::warn!(volume = %refusal.volume.id, error = %e, "posting an ExpandRefused event failed");
    }
}

/// Looks every `every` until the process ends; a volume RECOVERING longer than
/// `recovering_bound` is a Warning. Between looks, each refusal `refusals` brings is posted.
pub async fn run(
    ublkd: Ublkd,
    node: Node,
    every: Duration,
    recovering_bound: Duration,
    mut refusals: tokio::sync::mpsc::Receiver<Refusal>,
) -> Result<(), FaultsError> {
    let client = Client::try_default().await.map_err(FaultsError::Connect)?;
    let reporter = Reporter {
        controller: REPORTER.to_owned(),
        instance: Some(node.0.clone()),
    };
    let poster = Poster {
        recorder: Recorder::new(client.clone(), reporter),
        client,
        node,
    };
    let mut book = Book::default();
    let mut answered = true;
    loop {
        match look(&ublkd).await {
            Ok(seen) => {
                if !answered {
                    tracing::info!("ublkd answers again: fault events resume");
                }
                answered = true;
                round(&poster, &mut book, seen, Instant::now(), recovering_bound).await;
            }
            Err(e) => {
                if answered {
                    tracing::warn!(error = %e, "ublkd does not answer: no fault is judged until it does");
                }
                answered = false;
            }
        }
        let next_look = tokio::time::sleep(every);
        tokio::pin!(next_look);
        loop {
            tokio::select! {
                () = &mut next_look => break,
                Some(refusal) = refusals.recv() => refused(&poster, refusal).await,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use v1::VolumeState::{Creating, Failed, Ready, Recovering};

    const BOUND: Duration = Duration::from_secs(60);

    fn look(state: v1::VolumeState, counts: Option<(u64, u64)>) -> Look {
        Look {
            id: "pvc-1".into(),
            state,
            message: "opening the backend failed".into(),
            counts: counts.map(|(io, proto)| Counts {
                io_errors: io,
                protocol_errors: proto,
                last_protocol_errno: if proto > 0 { 5 } else { 0 },
            }),
        }
    }

    /// Judges `looks` in turn, each at its second: the reasons each fired.
    fn history(looks: &[(u64, Look)]) -> Vec<Vec<Reason>> {
        let t0 = Instant::now();
        let mut track: Option<Track> = None;
        looks
            .iter()
            .map(|(secs, l)| {
                let (t, v) = judge(track.as_ref(), l, t0 + Duration::from_secs(*secs), BOUND);
                track = Some(t);
                v.into_iter().map(|v| v.reason).collect()
            })
            .collect()
    }

    #[test]
    fn the_first_look_is_a_baseline_and_growth_fires_once() {
        use Reason::{VolumeIOErrors, VolumeProtocolErrors, VolumeRecovered};
        let h = history(&[
            (0, look(Ready, Some((7, 2)))),
            (10, look(Ready, Some((7, 2)))),
            (20, look(Ready, Some((9, 2)))),
            (30, look(Ready, Some((12, 3)))),
            (40, look(Ready, Some((12, 3)))),
            (50, look(Ready, Some((12, 3)))),
            (60, look(Ready, Some((13, 3)))),
        ]);
        assert_eq!(
            h,
            [
                vec![],
                vec![],
                vec![VolumeIOErrors],
                // still growing: the IOErrors already said, the protocol errors are new
                vec![VolumeProtocolErrors],
                vec![VolumeRecovered],
                vec![],
                // a new episode
                vec![VolumeIOErrors],
            ]
        );
    }

    #[test]
    fn failed_fires_once_however_it_flaps_and_ready_fires_recovered() {
        use Reason::{VolumeFailed, VolumeRecovered};
        let h = history(&[
            (0, look(Ready, Some((0, 0)))),
            (10, look(Failed, None)),
            (20, look(Recovering, None)),
            (30, look(Failed, None)),
            (40, look(Ready, Some((0, 0)))),
            (50, look(Ready, Some((0, 0)))),
        ]);
        assert_eq!(
            h,
            [
                vec![],
                vec![VolumeFailed],
                vec![],
                vec![],
                vec![VolumeRecovered],
                vec![]
            ]
        );
        let t0 = Instant::now();
        let (_, v) = judge(None, &look(Failed, None), t0, BOUND);
        assert_eq!(v[0].reason, VolumeFailed, "a FAILED volume is told at once");
        assert_eq!(
            v[0].note,
            "ublkd volume pvc-1 is FAILED: opening the backend failed"
        );
        assert!(VolumeFailed.is_warning() && !VolumeRecovered.is_warning());
    }

    #[test]
    fn recovering_past_the_bound_fires_once() {
        use Reason::{VolumeRecovered, VolumeRecoveringTooLong};
        let h = history(&[
            (0, look(Recovering, None)),
            (30, look(Recovering, None)),
            (61, look(Recovering, None)),
            (71, look(Recovering, None)),
            (80, look(Ready, Some((0, 0)))),
            // a new stretch counts from its own start
            (90, look(Recovering, None)),
            (140, look(Recovering, None)),
            (151, look(Recovering, None)),
        ]);
        assert_eq!(
            h,
            [
                vec![],
                vec![],
                vec![VolumeRecoveringTooLong],
                vec![],
                vec![VolumeRecovered],
                vec![],
                vec![],
                vec![VolumeRecoveringTooLong],
            ]
        );
    }

    #[test]
    fn counters_that_go_down_are_a_new_baseline_and_ready_with_new_errors_is_not_recovered() {
        use Reason::{VolumeFailed, VolumeIOErrors, VolumeRecovered};
        let h = history(&[
            (0, look(Ready, Some((50, 0)))),
            (10, look(Creating, None)),
            // a new device: fewer errors than before is no growth
            (20, look(Ready, Some((3, 0)))),
            (30, look(Failed, None)),
            (40, look(Ready, Some((3, 0)))),
            (50, look(Ready, Some((4, 0)))),
            (60, look(Ready, Some((4, 0)))),
        ]);
        assert_eq!(
            h,
            [
                vec![],
                vec![],
                vec![],
                vec![VolumeFailed],
                // the first counters after FAILED are a baseline: READY, nothing new
                vec![VolumeRecovered],
                vec![VolumeIOErrors],
                vec![VolumeRecovered],
            ]
        );
        // READY while its errors still grow is no recovery
        let h = history(&[
            (0, look(Ready, Some((0, 0)))),
            (10, look(Ready, Some((2, 0)))),
            (20, look(Ready, Some((5, 0)))),
            (30, look(Ready, Some((5, 0)))),
        ]);
        assert_eq!(
            h,
            [vec![], vec![VolumeIOErrors], vec![], vec![VolumeRecovered]]
        );
    }

    #[test]
    fn protocol_errors_say_the_errno() {
        let t0 = Instant::now();
        let (t, _) = judge(None, &look(Ready, Some((0, 0))), t0, BOUND);
        let (_, v) = judge(Some(&t), &look(Ready, Some((0, 2))), t0, BOUND);
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].reason, Reason::VolumeProtocolErrors);
        assert!(
            v[0].note.contains("2 ublk protocol errors"),
            "{}",
            v[0].note
        );
        assert!(v[0].note.ends_with("the last errno 5"), "{}", v[0].note);
    }

    #[test]
    fn the_node_is_told_when_ublk_goes_and_comes_back() {
        let mut track = NodeTrack::default();
        let mut said = Vec::new();
        for error in ["", "cannot open /dev/ublk-control", "still", "", ""] {
            let (t, v) = judge_node(track, error);
            track = t;
            said.push(v.map(|v| (v.reason, v.note)));
        }
        assert_eq!(
            said,
            [
                None,
                Some((
                    Reason::UblkUnavailable,
                    "ublkd serves no volume and the node offers no capacity: cannot open \
                     /dev/ublk-control"
                        .to_owned()
                )),
                None,
                Some((
                    Reason::UblkAvailable,
                    "ublkd's dataplane runs again: volumes are served".to_owned()
                )),
                None,
            ]
        );
        assert!(Reason::UblkUnavailable.is_warning() && !Reason::UblkAvailable.is_warning());
    }

    #[test]
    fn a_volume_finds_its_claim_and_its_pods() {
        let pv: PersistentVolume = serde_json::from_value(json!({
            "metadata": {"name": "pvc-1"},
            "spec": {"csi": {"driver": DRIVER_NAME, "volumeHandle": "pvc-1"},
                     "claimRef": {"namespace": "app", "name": "data"}}
        }))
        .expect("a PersistentVolume");
        assert_eq!(
            claim_ref_of(&pv, "pvc-1"),
            Some(("app".to_owned(), "data".to_owned()))
        );
        assert_eq!(claim_ref_of(&pv, "pvc-2"), None, "another volume's PV");
        let pod = |ns: &str, name: &str, claim: &str| -> Pod {
            serde_json::from_value(json!({
                "metadata": {"namespace": ns, "name": name},
                "spec": {"containers": [], "volumes": [
                    {"name": "tmp", "emptyDir": {}},
                    {"name": "v", "persistentVolumeClaim": {"claimName": claim}}
                ]}
            }))
            .expect("a Pod")
        };
        let pods = [
            pod("app", "a", "data"),
            pod("app", "b", "other"),
            pod("elsewhere", "c", "data"),
        ];
        let names: Vec<String> = pods_using(&pods, "app", "data")
            .iter()
            .map(|p| p.name_any())
            .collect();
        assert_eq!(names, ["a"]);
    }

    #[tokio::test]
    async fn a_refusal_reaches_the_loop_and_a_full_queue_drops_it_without_waiting() {
        let (tx, mut rx) = Refusals::channel();
        let refusal = |id: &str| Refusal {
            volume: v1::Volume {
                id: id.into(),
                ..Default::default()
            },
            note: format!("{id}: memory limit"),
        };
        tx.tell(refusal("pvc-1"));
        let got = rx.recv().await.expect("told");
        assert_eq!(
            (got.volume.id.as_str(), got.note.as_str()),
            ("pvc-1", "pvc-1: memory limit")
        );
        for i in 0..100 {
            tx.tell(refusal(&format!("pvc-{i}")));
        }
        let mut n = 0;
        while rx.try_recv().is_ok() {
            n += 1;
        }
        assert_eq!(
            n, 64,
            "the queue holds 64; the rest are logged, never awaited"
        );
        drop(rx);
        tx.tell(refusal("pvc-late"));
        assert_eq!(Reason::ExpandRefused.name(), "ExpandRefused");
        assert!(Reason::ExpandRefused.is_warning());
    }

    #[test]
    fn notes_are_cut_at_a_character() {
        let long = "é".repeat(NOTE_BYTES);
        let c = cut(&long);
        assert!(c.len() <= NOTE_BYTES && c.chars().all(|ch| ch == 'é'));
        assert_eq!(cut("short"), "short");
    }
}
