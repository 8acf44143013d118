//! Whether a deleted Node is lost, decided from the API's objects and the time alone (no calls).
//!
//! A deleted Node object says nothing about the machine: a mistaken `kubectl delete node`, a
//! re-registration, a cloud controller deleting a stopped instance all delete it while the
//! kubelet, ublkd and the volumes may be running. So a deleted Node is lost only when
//!
//! - an operator says so: the annotation [`LOST_ANNOTATION`]`: "true"` on the Node; or
//! - its kubelet has gone silent: its Lease (`kube-node-lease/<node>`) has expired
//!   (renewTime + leaseDurationSeconds before now, or no Lease at all) **and** the Node has
//!   been NotReady (its Ready condition not True, since the condition's lastTransitionTime)
//!   for at least the configured time (`ublkd-csi node-loss watch --lost-after`).
//!
//! Anything else keeps the node's volumes, claims and PersistentVolumes as they are; the
//! controller looks again later.

use k8s_openapi::api::coordination::v1::Lease;
use k8s_openapi::api::core::v1::Node;
use k8s_openapi::jiff::Timestamp;
use std::time::Duration;

/// The annotation by which an operator marks a deleted Node lost: its volumes are released
/// at once, whatever its Lease and conditions say. Only the value `"true"` counts.
pub const LOST_ANNOTATION: &str = "ublkd.io/node-lost";
/// The namespace of the kubelets' Leases, each named after its node.
pub const LEASE_NAMESPACE: &str = "kube-node-lease";
/// A Lease's duration when it names none (the kubelet's default, `nodeLeaseDurationSeconds`).
const DEFAULT_LEASE_SECONDS: i64 = 40;

/// What the controller found, and so what it does with a deleted Node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Lost: an operator annotated the Node.
    MarkedLost,
    /// Lost: the kubelet's Lease expired (`lease`) and the Node has been NotReady for
    /// `not_ready_s` seconds, no less than the bound.
    Silent { lease: LeaseState, not_ready_s: u64 },
    /// Alive: the kubelet renewed its Lease `renewed_ago_s` seconds ago.
    LeaseRenewed { renewed_ago_s: u64 },
    /// Not yet known: the Lease expired but the Node is still Ready (the node lifecycle
    /// controller has not marked it yet).
    StillReady { lease: LeaseState },
    /// Not yet known: the Lease expired and the Node has no Ready condition (or no time on it).
    NoReadyCondition { lease: LeaseState },
    /// Not yet known: the Lease expired, but the Node has been NotReady only `not_ready_s` of
    /// the `needed_s` seconds.
    NotReadyTooShort {
        lease: LeaseState,
        not_ready_s: u64,
        needed_s: u64,
    },
}

/// The kubelet's Lease, when it no longer says the node is alive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// No Lease of the node's name (never made, or already collected with the Node).
    Missing,
    /// A Lease never renewed.
    NeverRenewed,
    /// Expired `ago_s` seconds ago.
    Expired { ago_s: u64 },
}

impl std::fmt::Display for LeaseState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            LeaseState::Missing => write!(f, "it has no Lease"),
            LeaseState::NeverRenewed => write!(f, "its Lease was never renewed"),
            LeaseState::Expired { ago_s } => write!(f, "its Lease expired {ago_s} s ago"),
        }
    }
}

/// When this controller saw each node's Lease renewed, by its own clock (review L1, issue 55):
/// a Lease's renewTime is the kubelet's clock, and a kubelet 60 s behind would always look
/// expired, one ahead alive for as long. As Kubernetes' node lifecycle controller does, a
/// renewal counts from the moment the controller first saw that renewTime.
#[derive(Debug, Default)]
pub struct LeaseObserver {
    /// Per node: the renewTime last seen, and when (the controller's clock) it was first seen.
    seen: std::collections::HashMap<String, (Timestamp, Timestamp)>,
}

impl LeaseObserver {
    /// `lease` as this controller's clock saw it at `now`: its renewTime replaced by the time
    /// the controller first saw that renewTime (now, when it changed since the last look).
    pub fn observe(&mut self, node: &str, lease: Option<Lease>, now: Timestamp) -> Option<Lease> {
        let mut lease = lease?;
        let Some(renewed) = lease
            .spec
            .as_ref()
            .and_then(|s| s.renew_time.as_ref())
            .map(|t| t.0)
        else {
            self.seen.remove(node);
            return Some(lease);
        };
        let seen = match self.seen.get(node) {
            Some((last, at)) if *last == renewed => *at,
            _ => now,
        };
        self.seen.insert(node.to_owned(), (renewed, seen));
        if let Some(spec) = lease.spec.as_mut() {
            spec.renew_time = Some(k8s_openapi::apimachinery::pkg::apis::meta::v1::MicroTime(
                seen,
            ));
        }
        Some(lease)
    }
}

/// Whole seconds from `then` to `now`, 0 when `then` is later (another clock's time).
fn seconds_since(now: Timestamp, then: Timestamp) -> u64 {
    u64::try_from(now.duration_since(then).as_secs()).unwrap_or(0)
}

/// The state of `lease` at `now`: `Err(seconds since the last renewal)` while it holds.
fn lease_state(lease: Option<&Lease>, now: Timestamp) -> Result<LeaseState, u64> {
    let Some(spec) = lease.and_then(|l| l.spec.as_ref()) else {
        return Ok(match lease {
            None => LeaseState::Missing,
            Some(_) => LeaseState::NeverRenewed,
        });
    };
    let Some(renewed) = spec.renew_time.as_ref().map(|t| t.0) else {
        return Ok(LeaseState::NeverRenewed);
    };
    let held = spec
        .lease_duration_seconds
        .map_or(DEFAULT_LEASE_SECONDS, i64::from);
    let ago = now.duration_since(renewed).as_secs();
    if ago < held {
        return Err(u64::try_from(ago).unwrap_or(0));
    }
    Ok(LeaseState::Expired {
        ago_s: u64::try_from(ago - held).unwrap_or(0),
    })
}

/// Decides whether deleted Node `node`, whose kubelet's Lease is `lease` (`None`: there is
/// none), is lost at `now`, a node being lost once NotReady for `lost_after`.
pub fn judge(node: &Node, lease: Option<&Lease>, now: Timestamp, lost_after: Duration) -> Verdict {
    let marked = node
        .metadata
        .annotations
        .as_ref()
        .and_then(|a| a.get(LOST_ANNOTATION))
        .is_some_and(|v| v == "true");
    if marked {
        return Verdict::MarkedLost;
    }
    let lease = match lease_state(lease, now) {
        Err(renewed_ago_s) => return Verdict::LeaseRenewed { renewed_ago_s },
        Ok(state) => state,
    };
    let ready = node
        .status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .and_then(|cs| cs.iter().find(|c| c.type_ == "Ready"));
    let Some((status, since)) =
        ready.and_then(|c| Some((c.status.as_str(), c.last_transition_time.as_ref()?.0)))
    else {
        return Verdict::NoReadyCondition { lease };
    };
    if status == "True" {
        return Verdict::StillReady { lease };
    }
    let not_ready_s = seconds_since(now, since);
    let needed_s = lost_after.as_secs();
    if not_ready_s < needed_s {
        return Verdict::NotReadyTooShort {
            lease,
            not_ready_s,
            needed_s,
        };
    }
    Verdict::Silent { lease, not_ready_s }
}

impl Verdict {
    /// Whether the node's volumes are to be released.
    pub fn is_lost(&self) -> bool {
        matches!(self, Verdict::MarkedLost | Verdict::Silent { .. })
    }

    /// The Event's reason: one per kind of verdict, so that the controller posts again only
    /// when it changes (the numbers in [`Verdict::why`] change on every look).
    pub fn reason(&self) -> &'static str {
        match self {
            Verdict::MarkedLost => "NodeMarkedLost",
            Verdict::Silent { .. } => "NodeLost",
            Verdict::LeaseRenewed { .. } => "NodeLeaseRenewed",
            Verdict::StillReady { .. } => "NodeStillReady",
            Verdict::NoReadyCondition { .. } => "NodeNoReadyCondition",
            Verdict::NotReadyTooShort { .. } => "NodeNotReadyTooShort",
        }
    }

    /// Why, in words, for the Event and the log.
    pub fn why(&self) -> String {
        match self {
            Verdict::MarkedLost => format!("annotated {LOST_ANNOTATION}=true"),
            Verdict::Silent { lease, not_ready_s } => {
                format!("{lease} and it has been NotReady for {not_ready_s} s")
            }
            Verdict::LeaseRenewed { renewed_ago_s } => {
                format!("its kubelet renewed its Lease {renewed_ago_s} s ago: it is alive")
            }
            Verdict::StillReady { lease } => format!("{lease} but it is still Ready"),
            Verdict::NoReadyCondition { lease } => {
                format!("{lease} but it has no Ready condition yet")
            }
            Verdict::NotReadyTooShort {
                lease,
                not_ready_s,
                needed_s,
            } => {
                format!("{lease} but it has been NotReady for only {not_ready_s} s of {needed_s} s")
            }
        }
    }
}

/// A `--lost-after` that cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum LostAfterError {
    #[error("{0:?} is not a duration: write seconds, or a number with s, m or h (300s, 5m)")]
    Parse(String),
}

/// `300`, `300s`, `5m`, `1h`: the time a deleted Node must be NotReady before it is lost.
pub fn parse_lost_after(text: &str) -> Result<Duration, LostAfterError> {
    let t = text.trim();
    let (number, unit) = match t.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => t.split_at(i),
        None => (t, "s"),
    };
    let scale = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        _ => return Err(LostAfterError::Parse(text.to_owned())),
    };
    number
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(scale))
        .map(Duration::from_secs)
        .ok_or_else(|| LostAfterError::Parse(text.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const NOW: &str = "2025-06-01T12:00:00Z";
    const BOUND: Duration = Duration::from_secs(300);

    fn now() -> Timestamp {
        NOW.parse().expect("a timestamp")
    }

    /// `NOW` less `s` seconds, as the API writes times.
    fn ago(s: i64) -> String {
        (now() - k8s_openapi::jiff::SignedDuration::from_secs(s)).to_string()
    }

    fn lease(renewed_ago: i64) -> Lease {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "namespace": LEASE_NAMESPACE},
            "spec": {"holderIdentity": "n1", "leaseDurationSeconds": 40,
                     "renewTime": ago(renewed_ago)}
        }))
        .expect("a Lease")
    }

    /// A deleted Node whose Ready condition is `ready` since `since_ago` seconds.
    fn node(ready: &str, since_ago: i64, annotations: serde_json::Value) -> Node {
        serde_json::from_value(json!({
            "metadata": {"name": "n1", "deletionTimestamp": ago(600), "annotations": annotations},
            "status": {"conditions": [
                {"type": "MemoryPressure", "status": "False", "lastTransitionTime": ago(9000)},
                {"type": "Ready", "status": ready, "lastTransitionTime": ago(since_ago)}
            ]}
        }))
        .expect("a Node")
    }

    /// A kubelet whose clock is 60 s behind renews every 10 s: judged by its renewTime the
    /// Lease looks expired; judged by when the controller saw it renewed, the node is alive.
    /// A Lease the controller sees unchanged for longer than its duration is expired.
    #[test]
    fn a_lease_counts_from_when_the_controller_saw_it_renewed() {
        let n = node("Unknown", 3600, json!({}));
        let skewed = lease(70);
        assert!(
            matches!(
                judge(&n, Some(&skewed), now(), BOUND),
                Verdict::Silent { .. }
            ),
            "by the kubelet's clock the Lease looks expired"
        );
        let mut seen = LeaseObserver::default();
        let observed = seen.observe("n1", Some(skewed.clone()), now());
        let v = judge(&n, observed.as_ref(), now(), BOUND);
        assert_eq!(v, Verdict::LeaseRenewed { renewed_ago_s: 0 });
        // Renewed again 10 s later, still 60 s behind.
        let later = now() + k8s_openapi::jiff::SignedDuration::from_secs(10);
        let renewed = lease(60);
        let observed = seen.observe("n1", Some(renewed.clone()), later);
        assert!(!judge(&n, observed.as_ref(), later, BOUND).is_lost());
        // Not renewed again: 50 s after the controller saw it, past its 40 s, it is expired.
        let silent = later + k8s_openapi::jiff::SignedDuration::from_secs(50);
        let observed = seen.observe("n1", Some(renewed), silent);
        let v = judge(&n, observed.as_ref(), silent, BOUND);
        assert!(v.is_lost(), "{v:?}");
    }

    #[test]
    fn a_renewed_lease_keeps_the_node_whatever_its_conditions() {
        let n = node("Unknown", 3600, json!({}));
        let v = judge(&n, Some(&lease(10)), now(), BOUND);
        assert_eq!(v, Verdict::LeaseRenewed { renewed_ago_s: 10 });
        assert!(!v.is_lost());
        assert!(v.why().contains("alive"), "{}", v.why());
    }

    #[test]
    fn an_expired_lease_with_a_short_not_ready_keeps_the_node() {
        let n = node("Unknown", 120, json!({}));
        let v = judge(&n, Some(&lease(100)), now(), BOUND);
        assert_eq!(
            v,
            Verdict::NotReadyTooShort {
                lease: LeaseState::Expired { ago_s: 60 },
                not_ready_s: 120,
                needed_s: 300
            }
        );
        assert!(!v.is_lost());
        assert_eq!(v.reason(), "NodeNotReadyTooShort");
        assert!(v.why().contains("for only 120 s of 300 s"), "{}", v.why());
    }

    #[test]
    fn an_expired_lease_on_a_ready_node_keeps_it() {
        let n = node("True", 3600, json!({}));
        let v = judge(&n, Some(&lease(100)), now(), BOUND);
        assert!(matches!(v, Verdict::StillReady { .. }), "{v:?}");
        assert!(!v.is_lost());
    }

    #[test]
    fn an_expired_lease_and_a_long_not_ready_release_the_node() {
        let n = node("False", 301, json!({}));
        let v = judge(&n, Some(&lease(400)), now(), BOUND);
        assert_eq!(
            v,
            Verdict::Silent {
                lease: LeaseState::Expired { ago_s: 360 },
                not_ready_s: 301
            }
        );
        assert!(v.is_lost());
        // no Lease at all says the same as an expired one
        let v = judge(&n, None, now(), BOUND);
        assert!(v.is_lost(), "{v:?}");
        assert!(v.why().starts_with("it has no Lease"), "{}", v.why());
    }

    #[test]
    fn the_lost_annotation_releases_the_node_at_once() {
        let n = node("True", 3600, json!({LOST_ANNOTATION: "true"}));
        let v = judge(&n, Some(&lease(1)), now(), BOUND);
        assert_eq!(v, Verdict::MarkedLost);
        assert!(v.is_lost());
        // any other value is no mark
        let n = node("True", 3600, json!({LOST_ANNOTATION: "yes"}));
        assert!(!judge(&n, Some(&lease(1)), now(), BOUND).is_lost());
    }

    #[test]
    fn a_node_without_a_ready_condition_is_kept() {
        let mut n = node("False", 3600, json!({}));
        if let Some(s) = n.status.as_mut() {
            s.conditions = None;
        }
        let v = judge(&n, None, now(), BOUND);
        assert_eq!(
            v,
            Verdict::NoReadyCondition {
                lease: LeaseState::Missing
            }
        );
        assert!(!v.is_lost());
    }

    #[test]
    fn a_lease_from_a_clock_ahead_still_holds() {
        let n = node("Unknown", 3600, json!({}));
        let v = judge(&n, Some(&lease(-30)), now(), BOUND);
        assert_eq!(v, Verdict::LeaseRenewed { renewed_ago_s: 0 });
    }

    #[test]
    fn lost_after_reads_seconds_minutes_and_hours() {
        let ok = |s: &str| parse_lost_after(s).expect(s);
        assert_eq!(ok("300"), Duration::from_secs(300));
        assert_eq!(ok("300s"), Duration::from_secs(300));
        assert_eq!(ok("5m"), Duration::from_secs(300));
        assert_eq!(ok("1h"), Duration::from_secs(3600));
        for bad in ["", "m", "5 m", "5d", "-5m", "1.5h"] {
            assert!(parse_lost_after(bad).is_err(), "{bad:?} was read");
        }
    }
}
