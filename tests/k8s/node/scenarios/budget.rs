//! The node filled to ublkd's memory budget (issue 55): what the scheduler is told follows the
//! same arithmetic as what ublkd admits, so a claim past the budget waits Pending with the
//! scheduler's reason instead of a create that fails in a loop, and a grow past it is an
//! ExpandRefused Event on the claim.

use super::unschedulable;
use crate::kube::{local, Mode, Sc, NODE};
use anyhow::{ensure, Context, Result};
use serde_json::Value;

/// ublkd's `max_volumes` in the chart: the count the node's volume limit was before it followed
/// the memory budget.
const MAX_VOLUMES: u64 = 1024;

/// The host's /dev/shm (where the RAM volumes' files live), made larger than ublkd's memory
/// limit for the scenario, so that the RAM pool is bounded by the budget, not by the tmpfs.
const SHM: &str = "/dev/shm";

/// `ublkctl capacity ram` as JSON: (available bytes, volumes left).
fn ram_capacity(s: &Sc) -> Result<(u64, u64)> {
    let out = s.ublkctl("-o json capacity ram")?;
    let v: Value = serde_json::from_str(&out).with_context(|| format!("capacity: {out}"))?;
    let n = |k: &str| v[k].as_u64().with_context(|| format!("no {k} in {out}"));
    Ok((n("available_bytes")?, n("volumes_left")?))
}

/// The node's volume limit as the kubelet registered it (CSINode allocatable count).
fn volume_limit(s: &Sc) -> Result<u64> {
    let count = s.jp(
        &["csinode", NODE],
        "{.spec.drivers[?(@.name==\"ublkd.io\")].allocatable.count}",
    )?;
    count
        .trim()
        .parse()
        .with_context(|| format!("allocatable count {count:?}"))
}

pub fn budget(s: &Sc) -> Result<()> {
    // Alone (`k8s-test budget`), nothing before it waited for the driver's registration.
    s.wait(300, "the driver registered on the node", || s.registered())?;
    let limit = volume_limit(s)?;
    s.say(format!("the node's CSI volume limit: {limit}"));
    ensure!(
        limit > 0 && limit < MAX_VOLUMES,
        "the node's volume limit {limit} is not bounded by ublkd's memory (max_volumes {MAX_VOLUMES})"
    );
    let blocks = local("stat", &["-f", "-c", "%b %S", SHM])?;
    let shm_bytes: u64 = blocks
        .split_whitespace()
        .map(|n| n.parse::<u64>().unwrap_or(0))
        .product();
    ensure!(shm_bytes > 0, "the size of {SHM}: {blocks:?}");
    local("mount", &["-o", "remount,size=16G", SHM])?;
    let result = filled(s, limit);
    let restored = local("mount", &["-o", &format!("remount,size={shm_bytes}"), SHM]);
    result.and(restored.map(drop))
}

fn filled(s: &Sc, limit: u64) -> Result<()> {
    let (left, count) = ram_capacity(s)?;
    s.say(format!(
        "RAM pool before: {left} bytes within ublkd's memory, {count} volumes left"
    ));
    ensure!(count > 1, "the node admits {count} volumes before the fill");
    // The limit was volumes + volumes_left when the driver registered. Each volume holds at
    // least one volume's buffers, so the limit is at most volumes + volumes_left now: equal on a
    // node that has not changed since, below when an earlier scenario's volume stood then.
    let listed = s.ublkctl("-o json list-volumes")?;
    let listed: Value = serde_json::from_str(&listed).with_context(|| format!("list: {listed}"))?;
    let volumes = listed["volumes"].as_array().map_or(0, Vec::len) as u64;
    ensure!(
        limit <= volumes + count,
        "the node's volume limit {limit} is above its {volumes} volumes and {count} more"
    );
    // One volume's copy buffers, from above (volumes_left is left / each, rounded down): a
    // claim of left - each_hi admits (its own buffers fit) and leaves less than one volume's.
    let each_hi = left / count;
    let size = (left - each_hi) >> 20 << 20;
    // The scheduler weighs the claim against the class's published capacity: wait until the
    // provisioner has read the pool bounded by memory rather than by the smaller tmpfs.
    s.wait(
        120,
        "the RAM class's published capacity holds the fill",
        || s.published(NODE, "ublkd-ram").is_some_and(|c| c >= size),
    )?;
    s.pvc(
        "b-fill",
        "ublkd-ram",
        &format!("{}Mi", size >> 20),
        Mode::Filesystem,
    )?;
    s.pod("p-fill", "b-fill", Mode::Filesystem)?;
    s.wait(60, "ublkd admits no more volumes", || {
        ram_capacity(s).is_ok_and(|(_, n)| n == 0)
    })?;
    s.wait(120, "the file class's published capacity reads 0", || {
        s.published(NODE, "ublkd-file") == Some(0)
    })?;
    // A small claim of another class: the scheduler sends it nowhere.
    s.pvc("b-next", "ublkd-file", "16Mi", Mode::Filesystem)?;
    s.start_pod("p-next", "b-next", Mode::Filesystem)?;
    unschedulable(s, "p-next", "b-next", "did not have enough free storage")?;
    let tried = s.events("involvedObject.name=b-next,reason=ProvisioningFailed")?;
    ensure!(
        tried.trim().is_empty(),
        "the provisioner was asked for b-next, and failed: {tried}"
    );
    // The filled claim grown by 1 GiB: ublkd refuses it, and the claim says so. The resizer
    // grows the PV alone (the driver has no ControllerExpandVolume); ublkd, asked by the
    // kubelet after that (NodeExpandVolume), is what refuses.
    s.grow("b-fill", "p-fill", (size >> 20) + 1024)?;
    s.wait(300, "an ExpandRefused Warning on b-fill", || {
        s.events("involvedObject.kind=PersistentVolumeClaim,involvedObject.name=b-fill,reason=ExpandRefused")
            .is_ok_and(|m| m.contains("memory"))
    })
    .inspect_err(|_| s.tail(15, "describe pvc b-fill"))?;
    s.say(s.events("involvedObject.name=b-fill,reason=ExpandRefused")?);
    s.delete("pod p-next p-fill")?;
    s.delete("pvc b-next b-fill")?;
    s.wait(60, "ublkd admits volumes again", || {
        ram_capacity(s).is_ok_and(|(_, n)| n > 1)
    })?;
    // The scenarios after this one schedule claims on the published capacity.
    s.wait(120, "the file class's published capacity is back", || {
        s.published(NODE, "ublkd-file").is_some_and(|c| c > 0)
    })
}
