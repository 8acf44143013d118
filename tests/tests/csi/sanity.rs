//! The Kubernetes conformance suite (csi-sanity) on every backend and access type.

use super::{
    bail, ensure, file_params, guest, Command, Context, Pair, PathBuf, ReflinkRoot, Result, MIB, NG,
};

/// The conformance suite the harness installed (`UBLKD_CSI_SANITY`, set by `cargo xtask
/// vm-test`), or a clear failure when it is not there.
pub(crate) fn csi_sanity() -> Result<PathBuf> {
    let Some(p) = std::env::var_os("UBLKD_CSI_SANITY").map(PathBuf::from) else {
        bail!(
            "UBLKD_CSI_SANITY is not set: run the csi tests through `cargo xtask vm-test csi`, \
             which installs csi-sanity with go install; the conformance test cannot run without it"
        );
    };
    ensure!(
        p.is_file(),
        "csi-sanity is missing at {} (UBLKD_CSI_SANITY)",
        p.display()
    );
    Ok(p)
}

/// A VolumeAttributesClass for the suite's ModifyVolume tests (and its CreateVolume with a
/// class): I/O limits, which every backend takes.
pub(crate) const MUTABLE_PARAMS: &str =
    "readIops: \"2000\"\nwriteBandwidth: \"200Mi\"\nqosBurst: \"200ms\"\n";

/// Skipped tests allowed in every run: what the driver does not offer by design, each gated
/// by a capability it does not advertise: attaching (volumes are local: ControllerPublish and
/// the lifecycle built on it), controller-side expansion (volumes grow on their node), group
/// snapshots and GetSnapshot (alpha); plus the one test the suite itself marks pending (XIt).
pub(crate) const SKIPS_BY_DESIGN: &[&str] = &[
    "group",
    "getsnapshot",
    "controllerpublishvolume",
    "controllerunpublishvolume",
    "volume lifecycle",
    "expandvolume [controller server]",
    "pagination should detect volumes added between pages",
];

/// What a backend without files (RAM, NVMe) cannot do: snapshots, restores and clones. The
/// suite would take them of its test volumes, so they are skipped by name (ginkgo's regexp, and
/// the words that name them in the report).
pub(crate) const NO_SNAPSHOTS_SKIP: &str = "(?i)snapshot|source volume";

pub(crate) const NO_SNAPSHOTS_WORDS: &[&str] = &["snapshot", "source volume"];

/// One csi-sanity run: `params` as the StorageClass, `access` mount or block, `fs` for mount;
/// `snapshots` when the class's volumes can be snapshotted and cloned (a file backend on a file
/// system that can reflink), else those tests are skipped. xfs refuses file systems under
/// 300 MB; other volumes stay small.
pub(crate) async fn sanity(
    name: &str,
    port: u16,
    params: &[(&str, String)],
    access: &str,
    snapshots: bool,
) -> Result<()> {
    let xfs = access == "mount" && params.iter().any(|(k, v)| *k == "fsType" && v == "xfs");
    let size = if xfs { 320 * MIB } else { 64 * MIB };
    let tool = csi_sanity()?;
    let pair = Pair::start(name, port, "node-a").await?;
    let params_file = pair.daemon.dir.join("params.yaml");
    let yaml: String = params
        .iter()
        .map(|(k, v)| format!("{k}: {v:?}\n"))
        .collect();
    std::fs::write(&params_file, yaml)?;
    let mutable_file = pair.daemon.dir.join("mutable-params.yaml");
    std::fs::write(&mutable_file, MUTABLE_PARAMS)?;
    let junit = pair.daemon.dir.join("junit.xml");
    let mut cmd = Command::new(&tool);
    if !snapshots {
        cmd.arg(format!("--ginkgo.skip={NO_SNAPSHOTS_SKIP}"));
    }
    let out = cmd
        .arg(format!("--csi.endpoint=unix://{}", pair.socket.display()))
        .arg(format!(
            "--csi.stagingdir={}",
            pair.kubelet.join("staging").display()
        ))
        .arg(format!(
            "--csi.mountdir={}",
            pair.kubelet.join("mount").display()
        ))
        .arg(format!(
            "--csi.testvolumeparameters={}",
            params_file.display()
        ))
        .arg(format!(
            "--csi.testvolumemutableparameters={}",
            mutable_file.display()
        ))
        .arg(format!("--csi.testvolumesize={size}"))
        .arg(format!("--csi.testvolumeexpandsize={}", size + 64 * MIB))
        .arg(format!("--csi.testvolumeaccesstype={access}"))
        .arg(format!("--ginkgo.junit-report={}", junit.display()))
        .arg("--ginkgo.no-color")
        .output()
        .context("running csi-sanity")?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let tail: String = stdout
        .lines()
        .rev()
        .take(60)
        .collect::<Vec<_>>()
        .into_iter()
        .rev()
        .collect::<Vec<_>>()
        .join("\n");
    println!("{name}: csi-sanity\n{tail}");
    let report = std::fs::read_to_string(&junit).unwrap_or_default();
    let skipped = skipped_tests(&report);
    if !out.status.success() {
        // What the node had when it failed: a flaky failure in CI must say enough by itself.
        let tail = |s: String, n: usize| {
            let lines: Vec<&str> = s.lines().collect();
            lines[lines.len().saturating_sub(n)..].join("\n")
        };
        let memory =
            guest::sh("grep -E 'MemAvailable|Shmem:' /proc/meminfo; df -h /dev/shm /run /tmp")
                .unwrap_or_else(|e| format!("(unreadable: {e})"));
        bail!(
            "csi-sanity failed for {name}:\n{stdout}\n--- ublkd log (tail) ---\n{}\n--- ublkd-csi log (tail) ---\n{}\n--- memory ---\n{memory}",
            tail(pair.daemon.log(), 40),
            tail(pair.log(), 40)
        );
    }
    // Skipped may be only what the driver does not offer by design, and snapshots and clones
    // where the backend has no file to reflink. ModifyVolume and volume attribute classes run
    // on every backend; snapshots, restores and clones on the file backend.
    let mut allowed = SKIPS_BY_DESIGN.to_vec();
    if !snapshots {
        allowed.extend(NO_SNAPSHOTS_WORDS);
    }
    let unexpected: Vec<&String> = skipped
        .iter()
        .filter(|t| {
            let t = t.to_ascii_lowercase();
            !allowed.iter().any(|a| t.contains(a))
        })
        .collect();
    println!("{name}: {} skipped, all by design", skipped.len());
    ensure!(
        unexpected.is_empty(),
        "csi-sanity skipped tests it should have run: {unexpected:#?}"
    );
    Ok(())
}

/// Names of the skipped test cases in a JUnit report.
pub(crate) fn skipped_tests(xml: &str) -> Vec<String> {
    let mut out = Vec::new();
    for case in xml.split("<testcase ").skip(1) {
        let body = case.split("</testcase>").next().unwrap_or("");
        if body.contains("<skipped") {
            if let Some(name) = case
                .split("name=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
            {
                out.push(name.to_owned());
            }
        }
    }
    out
}

#[tokio::test]
async fn csi_sanity_file_backend_mount() -> Result<()> {
    // One run per backend, each access type and file system once across them
    // (csi_sanity_ram_backend_mount says why).
    for (access, fs) in [("mount", "ext4")] {
        let name = format!("csi-file-{access}-{fs}");
        // The allowed root is per daemon: the params name it once the daemon exists. The
        // snapshot and clone tests run here: the root must reflink.
        let dir = guest::scratch(&name)?;
        let root = ReflinkRoot::at(&dir, &dir.join("roots"))?;
        // The daemon (in `sanity`) has exited before `root` is unmounted.
        sanity(&name, 9561, &file_params(&root.root, fs), access, true).await?;
    }
    Ok(())
}

#[tokio::test]
async fn csi_sanity_ram_backend_mount() -> Result<()> {
    // Not the whole matrix on every backend: the driver's node path (mkfs, mount, the block
    // bind) is the same for every backend, and its controller path the same for every access
    // type and file system. So one run each: the file backend mounts ext4 (and runs the
    // snapshot tests: its root reflinks), RAM mounts xfs, NVMe is a raw block device. The six
    // runs before took 202 s of a 1,374 s suite (CI, 2026-12-06), nine 242 s of 1,343 s.
    for (access, fs) in [("mount", "xfs")] {
        let name = format!("csi-ram-{access}-{fs}");
        let params = vec![("backend", "ram".to_owned()), ("fsType", fs.to_owned())];
        sanity(&name, 9562, &params, access, false).await?;
    }
    Ok(())
}

#[tokio::test]
async fn csi_sanity_nvme_backend_block() -> Result<()> {
    // Block (csi_sanity_ram_backend_mount says why).
    for (access, fs) in [("block", "ext4")] {
        let name = format!("csi-nvme-{access}-{fs}");
        let params = vec![
            ("backend", "nvme".to_owned()),
            ("namespace", NG.to_owned()),
            ("fsType", fs.to_owned()),
        ];
        sanity(&name, 9563, &params, access, false).await?;
    }
    Ok(())
}
