//! The Kubernetes tier's scenarios, run by the node (`node`) once the driver is installed. PLAN
//! below is the table of contents: each scenario is a function in the file of its theme
//! (`scenarios/NAME.rs`), read top to bottom, every call it makes in its own log
//! (`logs/scenario-NAME.log` in the run directory). Helpers more than one theme uses are here.

use crate::kube::{at_once, last_lines, localw, Node, Sc};
use anyhow::{bail, ensure, Context, Result};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::time::Instant;

mod admission;
mod api_load;
mod budget;
mod drain;
mod driver;
mod encrypted;
mod faults;
mod filesystem;
mod modify;
mod monitoring;
mod node_loss;
mod placement;
mod plugin;
mod power;
mod restarts;
mod snapshots;
mod uninstall;
mod warnings;

type Scenario = (&'static str, fn(&Sc) -> Result<()>);

/// The scenarios, in the order they run; those in one group run at once (they share no
/// object, no pool that one of them fills and no component that one of them restarts).
pub const PLAN: &[&[Scenario]] = &[
    &[("driver", driver::driver)],
    // Alone, while the node is otherwise quiet: it counts what the node asks of the API server.
    &[("api-load", api_load::api_load)],
    &[
        ("file-ext4", filesystem::file_ext4),
        ("admission", admission::admission),
    ],
    &[("ram", filesystem::ram)],
    &[("nvme-xfs", filesystem::nvme_xfs)],
    // Light pairs only. All five of the lines above and this one at once saturated the guest's
    // two CPUs for 680 s in one boot, long enough for the node plugin's liveness probe to time
    // out (10 s), a warning the warnings scenario then rightly refused.
    &[
        ("block", filesystem::block),
        ("pending", filesystem::pending),
    ],
    // monitoring fills the file pool; plugin's volumes are RAM, its orphans its own.
    &[
        ("monitoring", monitoring::monitoring),
        ("plugin", plugin::plugin),
    ],
    &[("snapshots", snapshots::snapshots)],
    &[("warnings", warnings::warnings)],
    // After warnings: a wrong key is a Warning on purpose. modify's claim, class and fio are
    // its own.
    &[
        ("modify", modify::modify),
        ("encrypted", encrypted::encrypted),
    ],
    // After warnings: a node NotReady makes Warnings on purpose. Alone: beside modify and
    // encrypted (LUKS formats, CPU-bound) the three took 482 s, more than one after the other
    // (2026-12-07).
    &[("node-paused", power::node_paused)],
    // After warnings: a claim no node can hold is a FailedScheduling Warning on purpose. Alone:
    // it fills the first node's file pool.
    &[("placement", placement::placement)],
    // The second node's guest powered off and on (its Node deleted).
    &[("node-dies", power::node_dies)],
    &[("ublkd-restart", restarts::ublkd_restart)],
    &[("kubelet-restart", restarts::kubelet_restart)],
    &[("drain", drain::drain)],
    &[("stuck", faults::stuck)],
    // After warnings: FailedScheduling and ExpandRefused are Warnings on purpose. Alone: it
    // fills the node, so no other claim may be scheduled meanwhile.
    &[("budget", budget::budget)],
    // After warnings: both make Warning Events on purpose. Alone: one kills ublkd, the other
    // takes its driver away.
    &[("volume-fault", faults::volume_fault)],
    &[("ublk-missing", faults::ublk_missing)],
    &[("node-loss", node_loss::node_loss)],
    // deletes and re-registers this node: after every scenario that needs it untouched
    &[("node-alive", node_loss::node_alive)],
    &[("uninstall", uninstall::uninstall)],
];

/// The scenarios that need a second node: on one (`UBLKD_K8S_NODES=1`, the default of
/// `cargo xtask test` while two do not fit CI's time), each is reported `SCENARIO NAME
/// two-nodes`, run neither passed nor failed, and the host's summary names them.
pub const TWO_NODES: &[&str] = &["placement", "node-paused", "node-dies"];

/// Every scenario's name, in order.
pub fn names() -> impl Iterator<Item = &'static str> {
    PLAN.iter().flat_map(|g| g.iter().map(|(n, _)| *n))
}

/// Runs the scenarios the input names (all when none), group by group; how many failed.
pub fn run(node: &Node) -> usize {
    let wanted =
        |n: &str| node.input.scenarios.is_empty() || node.input.scenarios.iter().any(|s| s == n);
    let mut failed = 0;
    let one_node = node.input.nodes.len() < 2;
    for group in PLAN {
        let (chosen, left): (Vec<&Scenario>, Vec<&Scenario>) = group
            .iter()
            .filter(|(n, _)| wanted(n))
            .partition(|(n, _)| !(one_node && TWO_NODES.contains(n)));
        for (name, _) in left {
            println!("SCENARIO {name} two-nodes 0.0");
        }
        let done = at_once(&chosen, |sc| run_one(node, sc));
        failed += done
            .into_iter()
            .map(|r| r.map_or(1, usize::from))
            .sum::<usize>();
    }
    failed
}

/// One scenario: its log, its verdict and time on the console (one write, so that scenarios
/// run together do not interleave their reports); 1 when it failed.
fn run_one(node: &Node, (name, f): &Scenario) -> bool {
    let path = node.logs.join(format!("scenario-{name}.log"));
    let log = match File::create(&path) {
        Ok(f) => f,
        Err(e) => {
            println!(
                "SCENARIO {name} FAILED 0.0\n  cannot create {}: {e}",
                path.display()
            );
            return true;
        }
    };
    let sc = Sc::new(node, log);
    let started = Instant::now();
    let c0 = cpu_ticks();
    node.say(format!("scenario {name}"));
    let result = f(&sc);
    let took = started.elapsed().as_secs_f64();
    // How busy the guest's CPUs were meanwhile: near 100 % says the scenario waited on the
    // emulated CPUs, well under says it waited on Kubernetes's own loops.
    let busy = match (c0, cpu_ticks()) {
        (Some((b0, t0)), Some((b1, t1))) if t1 > t0 => 100 * (b1 - b0) / (t1 - t0),
        _ => 0,
    };
    let mut report = match &result {
        Ok(()) => format!("SCENARIO {name} ok {took:.1}\n"),
        Err(e) => {
            sc.say(format!("check failed: {e:#}"));
            let text = fs::read_to_string(&path).unwrap_or_default();
            // "> " marks the lines the host's summary repeats under the verdict.
            let tail: String = last_lines(&text, 40)
                .lines()
                .map(|l| format!("> {l}\n"))
                .collect();
            format!("SCENARIO {name} FAILED {took:.1}\n{tail}")
        }
    };
    report.push_str(&format!(
        "k8s [{:.1}] scenario {name} ended: the guest's CPUs {busy} % busy while it ran",
        node.now()
    ));
    println!("{report}");
    result.is_err()
}

/// The guest's busy and total CPU time so far, in ticks (/proc/stat's first line).
fn cpu_ticks() -> Option<(u64, u64)> {
    let stat = fs::read_to_string("/proc/stat").ok()?;
    let f: Vec<u64> = stat
        .lines()
        .next()?
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    let busy = f.first()? + f.get(1)? + f.get(2)? + f.get(5)? + f.get(6)?;
    Some((busy, busy + f.get(3)? + f.get(4)?))
}

/// The file classes' root on the node, the pool of file volumes.
const VOLUMES: &str = "/var/lib/ublkd/volumes";

/// The one backing file of the file volume `vol` under [`VOLUMES`].
fn backing_file(vol: &str) -> Result<PathBuf> {
    let files = files_named(Path::new(VOLUMES), vol);
    let [file] = files.as_slice() else {
        bail!("not one backing file of {vol}: {files:?}");
    };
    Ok(file.clone())
}

/// Waits until the scheduler refuses `pod` for want of storage (its FailedScheduling Event
/// says `why`, in lower case), and checks that `claim` is left Pending.
fn unschedulable(s: &Sc, pod: &str, claim: &str, why: &str) -> Result<()> {
    let sel = format!("involvedObject.name={pod},reason=FailedScheduling");
    let said = || s.events(&sel).is_ok_and(|m| m.to_lowercase().contains(why));
    s.wait(300, &format!("{pod}'s FailedScheduling says {why}"), said)
        .inspect_err(|_| s.tail(10, &format!("describe pod {pod}")))?;
    s.say(s.events(&format!("involvedObject.name={pod}"))?);
    ensure!(
        s.phase(&format!("pvc {claim}"))? == "Pending",
        "{claim} left Pending"
    );
    Ok(())
}

/// SIGKILL to the node's ublkd process.
fn kill_ublkd(s: &Sc) -> Result<()> {
    let pids = localw("pidof ublkd").context("no ublkd process on the node")?;
    let pid = pids.split_whitespace().next().context("no ublkd pid")?;
    localw(&format!("kill -9 {pid}"))?;
    s.say(format!("SIGKILL to ublkd (pid {pid})"));
    Ok(())
}

/// The line of `df` for /data in a pod. `-P`: one line per file system (busybox wraps a long
/// device name, such as an encrypted volume's mapping).
const DF: &str = "df -kP /data | tail -1";

/// The size of the file system in a line of `DF`, in KiB.
fn kib(line: &str) -> Result<u64> {
    let kib = line
        .split_whitespace()
        .nth(1)
        .context("df printed no size")?;
    kib.parse().with_context(|| format!("df's size {kib:?}"))
}

/// Waits until df in `pod` shows 32 MiB more than `before` KiB (`claim` grown online).
fn df_grew(s: &Sc, claim: &str, pod: &str, before: u64) -> Result<()> {
    let mut after = 0;
    let grown = || {
        after = s.in_pod(pod, DF).and_then(|l| kib(&l)).unwrap_or(0);
        after > before + 32768
    };
    s.wait(420, "df grew", grown)
        .inspect_err(|_| s.tail(15, &format!("describe pvc {claim}")))?;
    s.say(format!("df: {before} KiB, then {after} KiB"));
    Ok(())
}

/// Files under `dir` whose name contains `part`.
fn files_named(dir: &Path, part: &str) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in fs::read_dir(dir).into_iter().flatten().flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_named(&p, part));
        } else if e.file_name().to_string_lossy().contains(part) {
            found.push(p);
        }
    }
    found
}

/// Whether `marker` occurs in the `len` bytes of `path` from `offset`, read 4 MiB at a time; a
/// read that fails is an error, not "not found".
fn holds(path: &Path, offset: u64, len: u64, marker: &[u8]) -> Result<bool> {
    use std::io::{BufRead, Read, Seek, SeekFrom};
    let (first, tail) = marker.split_first().context("an empty marker")?;
    let mut f = File::open(path).with_context(|| format!("opening {}", path.display()))?;
    f.seek(SeekFrom::Start(offset))?;
    let mut f = f.take(len);
    // Each chunk starts with the last tail.len() bytes of the one before, so that a match
    // across two reads is found.
    let mut buf = vec![0u8; tail.len() + (4 << 20)];
    let mut kept = 0;
    loop {
        let n = f.read(&mut buf[kept..])?;
        if n == 0 {
            return Ok(false);
        }
        let (chunk, mut rest) = (&buf[..kept + n], &buf[..kept + n]);
        // Each place of the marker's first byte (std's memchr, through `skip_until`: in this
        // debug build a `windows()` scan took 60 times as long), then whether the rest follows
        // it (`skip_until` stops at the end too, with no such byte).
        while rest.skip_until(*first)? > 0 {
            if chunk[..chunk.len() - rest.len()].ends_with(&[*first]) && rest.starts_with(tail) {
                return Ok(true);
            }
        }
        let end = kept + n;
        kept = end.min(tail.len());
        buf.copy_within(end - kept..end, 0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every scenario once, and a name the host can be asked for.
    #[test]
    fn every_scenario_is_named_once() {
        let mut names: Vec<&str> = names().collect();
        assert_eq!(names.first(), Some(&"driver"));
        assert_eq!(names.last(), Some(&"uninstall"));
        let n = names.len();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), n, "a scenario named twice");
        assert!(names.iter().all(|n| !n.is_empty() && !n.contains(' ')));
    }

    /// Quantities as capacities are written, in bytes and in MiB.
    #[test]
    fn quantities_read_in_bytes() {
        let q = ["1048576", "64Mi", "2Gi", "4Ki", "1Ti"].map(|q| crate::kube::bytes(q).ok());
        assert_eq!(q, [1 << 20, 64 << 20, 2 << 30, 4 << 10, 1 << 40].map(Some));
        assert_eq!(crate::kube::mib("300Mi").ok(), Some(300));
        assert!(crate::kube::bytes("1.5Gi").is_err() && crate::kube::bytes("64M").is_err());
    }

    /// A marker across two reads is found, one cut short is not, and a read that fails fails.
    #[test]
    fn holds_finds_the_marker_whole_and_fails_on_a_read_error() -> Result<()> {
        let path = std::env::temp_dir().join(format!("holds-{}", std::process::id()));
        let at = (4 << 20) + 2;
        let mut data = vec![b'u'; at + 16];
        data[at..at + 6].copy_from_slice(b"uxyzzy");
        fs::write(&path, &data)?;
        let found = [0, 1, 3].map(|cut| holds(&path, 0, (at + 6 - cut) as u64, b"uxyzzy").ok());
        fs::remove_file(&path)?;
        assert_eq!(found, [Some(true), Some(false), Some(false)]);
        assert!(holds(Path::new("/"), 0, 10, b"u").is_err());
        Ok(())
    }
}
