//! The CSI driver against the real kernel: `ublkd-csi` in front of a ublkd, driven by the
//! Kubernetes conformance suite (csi-sanity, installed by the harness with `go install`) for every backend and
//! access type, and by the kubelet's own sequence of calls with data checked through mounts.
//! The suite's snapshot and clone tests run on the file backend over an XFS with reflink (a
//! loop device the test makes, unless the guest already mounted one at the root); its
//! ModifyVolume tests run on every backend.
#![cfg(feature = "vm")]

use anyhow::{bail, ensure, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tonic::transport::{Channel, Endpoint};
use ublkd_tests::daemon::{bin, Daemon};
use ublkd_tests::{guest, MIB};

/// The emulated controller's namespace (see nvme.rs).
const NG: &str = "/dev/ng0n1";

/// A ublkd and a ublkd-csi in front of it, with a kubelet directory of their own.
struct Pair {
    daemon: Daemon,
    csi: Child,
    socket: PathBuf,
    kubelet: PathBuf,
}

impl Pair {
    async fn start(name: &str, metrics_port: u16, node: &str) -> Result<Pair> {
        Self::start_with(name, metrics_port, node, "").await
    }

    /// With `extra` appended to ublkd's config.
    async fn start_with(name: &str, metrics_port: u16, node: &str, extra: &str) -> Result<Pair> {
        Self::start_env(name, metrics_port, node, extra, &[]).await
    }

    /// With `extra` appended to ublkd's config and `env` in ublkd's environment (test hooks).
    async fn start_env(
        name: &str,
        metrics_port: u16,
        node: &str,
        extra: &str,
        env: &[(&str, &str)],
    ) -> Result<Pair> {
        let dir = guest::scratch(name)?;
        let mut daemon = Daemon::new(&dir, metrics_port, extra)?;
        daemon.env = env
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        daemon.start().await?;
        let kubelet = dir.join("kubelet");
        std::fs::create_dir_all(&kubelet)?;
        let socket = dir.join("csi.sock");
        let log = std::fs::File::create(dir.join("csi.log"))?;
        let csi = Command::new(bin("ublkd-csi"))
            .args(["--csi-endpoint", &format!("unix://{}", socket.display())])
            .args(["--ublkd", &format!("unix://{}", daemon.socket.display())])
            .args(["--node-id", node])
            .args(["--kubelet-dir", &kubelet.to_string_lossy()])
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting ublkd-csi")?;
        let deadline = Instant::now() + Duration::from_secs(30);
        while !socket.exists() {
            ensure!(Instant::now() < deadline, "ublkd-csi did not listen");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Ok(Pair {
            daemon,
            csi,
            socket,
            kubelet,
        })
    }

    fn log(&self) -> String {
        std::fs::read_to_string(self.daemon.dir.join("csi.log")).unwrap_or_default()
    }

    async fn channel(&self) -> Result<Channel> {
        let path = self.socket.clone();
        Ok(Endpoint::from_static("http://localhost")
            .connect_with_connector(tower::service_fn(move |_| {
                let path = path.clone();
                async move {
                    let s = tokio::net::UnixStream::connect(path).await?;
                    Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(s))
                }
            }))
            .await?)
    }
}

impl Drop for Pair {
    fn drop(&mut self) {
        let _ = self.csi.kill();
        let _ = self.csi.wait();
    }
}

/// The conformance suite the harness installed (`UBLKD_CSI_SANITY`, set by `cargo xtask
/// vm-test`), or a clear failure when it is not there.
fn csi_sanity() -> Result<PathBuf> {
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
const MUTABLE_PARAMS: &str = "readIops: \"2000\"\nwriteBandwidth: \"200Mi\"\nqosBurst: \"200ms\"\n";

/// Skipped tests allowed in every run: what the driver does not offer by design, each gated
/// by a capability it does not advertise: attaching (volumes are local: ControllerPublish and
/// the lifecycle built on it), controller-side expansion (volumes grow on their node), group
/// snapshots and GetSnapshot (alpha); plus the one test the suite itself marks pending (XIt).
const SKIPS_BY_DESIGN: &[&str] = &[
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
const NO_SNAPSHOTS_SKIP: &str = "(?i)snapshot|source volume";
const NO_SNAPSHOTS_WORDS: &[&str] = &["snapshot", "source volume"];

/// One csi-sanity run: `params` as the StorageClass, `access` mount or block, `fs` for mount;
/// `snapshots` when the class's volumes can be snapshotted and cloned (a file backend on a file
/// system that can reflink), else those tests are skipped. xfs refuses file systems under
/// 300 MB; other volumes stay small.
async fn sanity(
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
fn skipped_tests(xml: &str) -> Vec<String> {
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

fn file_params(root: &Path, fs: &str) -> Vec<(&'static str, String)> {
    vec![
        ("backend", "file".into()),
        ("root", root.display().to_string()),
        ("fsType", fs.into()),
    ]
}

/// A file system that can reflink at `root`, for as long as it lives: what the guest mounted
/// there if it is XFS or btrfs, else an XFS made with reflink=1 on a loop device over a sparse
/// file in `dir` (tmpfs; mounted with discard, so deleted volumes give their pages back).
struct ReflinkRoot {
    root: PathBuf,
    loop_dev: Option<String>,
}

/// The loop file system's size: the suite's largest moment is five 320 MiB volumes and their
/// snapshots, or one of 1 GiB, all sparse.
const REFLINK_FS_BYTES: u64 = 4096 * MIB;

impl ReflinkRoot {
    fn at(dir: &Path, root: &Path) -> Result<ReflinkRoot> {
        std::fs::create_dir_all(root)?;
        let fs = guest::sh(&format!("stat -f -c %T {}", root.display()))?;
        if matches!(fs.trim(), "xfs" | "btrfs") {
            println!("{}: {} already, used as it is", root.display(), fs.trim());
            return Ok(ReflinkRoot {
                root: root.to_owned(),
                loop_dev: None,
            });
        }
        let img = guest::backing_file(dir, "reflink.fsimg", REFLINK_FS_BYTES)?;
        guest::sh("modprobe loop 2>/dev/null || true")?;
        let dev = guest::sh(&format!("losetup --find --show {}", img.display()))?
            .trim()
            .to_owned();
        guest::sh(&format!("mkfs.xfs -q -f -m reflink=1 {dev}"))?;
        guest::sh(&format!("mount -o discard {dev} {}", root.display()))?;
        Ok(ReflinkRoot {
            root: root.to_owned(),
            loop_dev: Some(dev),
        })
    }
}

impl Drop for ReflinkRoot {
    fn drop(&mut self) {
        if let Some(dev) = &self.loop_dev {
            let _ = guest::sh(&format!(
                "umount {} && losetup -d {dev}",
                self.root.display()
            ));
        }
    }
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

mod kubelet {
    //! CSI requests as the kubelet and the external-provisioner send them.
    use super::*;
    use ublkd_csi::spec::{
        self,
        controller_client::ControllerClient,
        node_client::NodeClient,
        volume_capability::{access_mode::Mode, AccessMode, AccessType, BlockVolume, MountVolume},
        VolumeCapability,
    };

    pub fn mount_cap(fs: &str) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode {
                mode: Mode::SingleNodeWriter as i32,
            }),
            access_type: Some(AccessType::Mount(MountVolume {
                fs_type: fs.into(),
                ..Default::default()
            })),
        }
    }

    pub fn block_cap(mode: Mode) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: Some(AccessType::Block(BlockVolume {})),
        }
    }

    pub fn create(
        name: &str,
        size: u64,
        params: &[(&str, String)],
        cap: VolumeCapability,
    ) -> spec::CreateVolumeRequest {
        spec::CreateVolumeRequest {
            name: name.into(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: size as i64,
                limit_bytes: 0,
            }),
            volume_capabilities: vec![cap],
            parameters: params
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.clone()))
                .collect(),
            ..Default::default()
        }
    }

    pub async fn clients(pair: &Pair) -> Result<(ControllerClient<Channel>, NodeClient<Channel>)> {
        let ch = pair.channel().await?;
        Ok((ControllerClient::new(ch.clone()), NodeClient::new(ch)))
    }

    pub fn stage(id: &str, staging: &Path, cap: VolumeCapability) -> spec::NodeStageVolumeRequest {
        spec::NodeStageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap),
            ..Default::default()
        }
    }

    pub fn publish(
        id: &str,
        staging: &Path,
        target: &Path,
        cap: VolumeCapability,
    ) -> spec::NodePublishVolumeRequest {
        spec::NodePublishVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
            target_path: target.display().to_string(),
            volume_capability: Some(cap),
            ..Default::default()
        }
    }

    pub fn unpublish(id: &str, target: &Path) -> spec::NodeUnpublishVolumeRequest {
        spec::NodeUnpublishVolumeRequest {
            volume_id: id.into(),
            target_path: target.display().to_string(),
        }
    }

    pub fn unstage(id: &str, staging: &Path) -> spec::NodeUnstageVolumeRequest {
        spec::NodeUnstageVolumeRequest {
            volume_id: id.into(),
            staging_target_path: staging.display().to_string(),
        }
    }

    pub fn is_mountpoint(p: &Path) -> bool {
        let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let p = p.display().to_string();
        text.lines()
            .any(|l| l.split(' ').nth(4) == Some(p.as_str()))
    }

    /// Bytes of the file system at `p` (`stat -f`).
    pub fn fs_bytes(p: &Path) -> Result<u64> {
        let out = guest::sh(&format!("stat -f -c '%S %b' {}", p.display()))?;
        let n: Vec<u64> = out
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        ensure!(n.len() == 2, "stat -f: {out}");
        Ok(n[0] * n[1])
    }
}

/// The kubelet's path: provision, stage, publish twice, write, unpublish and unstage, stage
/// and publish again and find the data; ublkd is killed with -9 and restarted while the volume
/// is published and under writes (they pause, none fails); online expansion grows the file
/// system `df` sees; DeleteVolume removes the device and the backing file.
#[tokio::test]
async fn the_kubelets_path_keeps_data_across_restages_and_a_ublkd_crash() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let mut pair = Pair::start("csi-kubelet", 9564, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-kubelet", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id.clone();
    ensure!(
        id == "pvc-kubelet" && vol.capacity_bytes == (64 * MIB) as i64,
        "{vol:?}"
    );
    ensure!(
        vol.accessible_topology[0]
            .segments
            .get("ublkd.io/node")
            .map(String::as_str)
            == Some("node-a"),
        "topology: {vol:?}"
    );
    // Idempotent on name; a different size is ALREADY_EXISTS.
    let again = ctl
        .create_volume(create("pvc-kubelet", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner();
    ensure!(again.volume.map(|v| v.volume_id) == Some(id.clone()));
    let e = ctl
        .create_volume(create("pvc-kubelet", 256 * MIB, &params, cap.clone()))
        .await
        .expect_err("a different size");
    ensure!(e.code() == tonic::Code::AlreadyExists, "{e:?}");

    let staging = pair
        .kubelet
        .join("plugins/ublkd.io/globalmount/pvc-kubelet");
    let t1 = pair.kubelet.join("pods/a/volumes/pvc-kubelet");
    let t2 = pair.kubelet.join("pods/b/volumes/pvc-kubelet");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage is idempotent")?;
    for t in [&t1, &t2] {
        node.node_publish_volume(publish(&id, &staging, t, cap.clone()))
            .await?;
    }
    guest::sh(&format!("echo through-a > {}/data && sync", t1.display()))?;
    ensure!(
        guest::sh(&format!("cat {}/data", t2.display()))?.trim() == "through-a",
        "both targets show the same file system"
    );

    // kill -9 under writes: they pause while ublkd is gone and resume on the new one.
    let writer = Command::new("sh")
        .arg("-c")
        .arg(format!(
            "for i in $(seq 1 40); do dd if=/dev/urandom of={}/w bs=64k count=4 conv=fsync \
             status=none || exit 1; sleep 0.1; done",
            t1.display()
        ))
        .spawn()?;
    tokio::time::sleep(Duration::from_millis(800)).await;
    pair.daemon.stop_with(9)?;
    pair.daemon.start().await?;
    let status = tokio::task::spawn_blocking(move || {
        let mut w = writer;
        w.wait()
    })
    .await??;
    ensure!(status.success(), "writes failed across the ublkd restart");

    for t in [&t1, &t2] {
        node.node_unpublish_volume(unpublish(&id, t)).await?;
        ensure!(!t.exists(), "{} removed", t.display());
    }
    node.node_unpublish_volume(unpublish(&id, &t1))
        .await
        .context("unpublish is idempotent")?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ensure!(!is_mountpoint(&staging), "unstaged");
    // Data survives: stage and publish again.
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish(&id, &staging, &t1, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/data", t1.display()))?.trim() == "through-a",
        "the data is there after unstage and restage"
    );

    // Online expansion: ublkd grows the device, the driver the file system.
    let before = fs_bytes(&t1)?;
    let grown = node
        .node_expand_volume(spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: (128 * MIB) as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        })
        .await?
        .into_inner();
    let after = fs_bytes(&t1)?;
    println!(
        "expand: {before} -> {after} bytes (capacity {})",
        grown.capacity_bytes
    );
    ensure!(grown.capacity_bytes == (128 * MIB) as i64);
    ensure!(after > before + 48 * MIB, "df grew: {before} -> {after}");
    // A range that asks nothing keeps the size; it is not a new volume's default size.
    let kept = node
        .node_expand_volume(spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: 0,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        })
        .await?
        .into_inner();
    ensure!(
        kept.capacity_bytes == (128 * MIB) as i64,
        "an empty range kept the size: {}",
        kept.capacity_bytes
    );
    let stats = node
        .node_get_volume_stats(spec::NodeGetVolumeStatsRequest {
            volume_id: id.clone(),
            volume_path: t1.display().to_string(),
            staging_target_path: String::new(),
        })
        .await?
        .into_inner();
    ensure!(
        stats.volume_condition.as_ref().is_some_and(|c| !c.abnormal),
        "{stats:?}"
    );
    ensure!(stats.usage.len() == 2, "bytes and inodes: {stats:?}");

    // Deleting a volume something still has mounted is refused: here, and in a mount
    // namespace ublkd cannot see (as the driver's pod is to ublkd's).
    let e = ctl
        .delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: Default::default(),
        })
        .await
        .expect_err("deleting a staged volume");
    ensure!(e.code() == tonic::Code::FailedPrecondition, "{e:?}");
    node.node_unpublish_volume(unpublish(&id, &t1)).await?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    let dev_now = pair.daemon.ublkctl_ok(&["get-volume", &id, "-o", "json"])?;
    let dev_now = serde_json::from_str::<serde_json::Value>(&dev_now)?["device_path"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let elsewhere = pair.kubelet.join("other-namespace");
    std::fs::create_dir_all(&elsewhere)?;
    let mut holder = Command::new("unshare")
        .args(["-m", "--propagation", "private", "sh", "-c"])
        .arg(format!(
            "mount {dev_now} {} && echo mounted && sleep 4",
            elsewhere.display()
        ))
        .stdout(Stdio::piped())
        .spawn()?;
    let mut line = String::new();
    {
        use std::io::BufRead;
        let out = holder.stdout.take().context("unshare stdout")?;
        std::io::BufReader::new(out).read_line(&mut line)?;
    }
    ensure!(
        line.trim() == "mounted",
        "the other namespace mounted it: {line:?}"
    );
    ensure!(!is_mountpoint(&elsewhere), "not visible in this namespace");
    let e = ctl
        .delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: Default::default(),
        })
        .await
        .expect_err("deleting a volume mounted in another namespace");
    ensure!(e.code() == tonic::Code::FailedPrecondition, "{e:?}");
    holder.wait()?;
    let device = pair.daemon.ublkctl_ok(&["get-volume", &id, "-o", "json"])?;
    let dev_path = serde_json::from_str::<serde_json::Value>(&device)?["device_path"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    ctl.delete_volume(spec::DeleteVolumeRequest {
        volume_id: id.clone(),
        secrets: Default::default(),
    })
    .await?;
    ensure!(!Path::new(&dev_path).exists(), "{dev_path} removed");
    let backing = pair.daemon.root.join(format!("{id}.img"));
    ensure!(!backing.exists(), "{} removed", backing.display());
    ctl.delete_volume(spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await
    .context("delete is idempotent")?;
    Ok(())
}

/// Two nodes in one guest, each a ublkd and a ublkd-csi of its own: each provisions only its
/// own volumes, topology is honoured, capacity is per node, and a full node says
/// RESOURCE_EXHAUSTED (so the scheduler tries another).
#[tokio::test]
async fn two_nodes_provision_only_their_own_volumes() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let a = Pair::start("csi-node-a", 9565, "node-a").await?;
    // Node b takes one volume in all.
    let b = Pair::start_with("csi-node-b", 9566, "node-b", "[limits]\nmax_volumes = 1\n").await?;
    let (mut ca, _) = clients(&a).await?;
    let (mut cb, mut nb) = clients(&b).await?;
    let topo = |node: &str| spec::Topology {
        segments: [("ublkd.io/node".to_owned(), node.to_owned())].into(),
    };
    let params = vec![("backend", "ram".to_owned())];
    let with_topology = |name: &str, node: &str| {
        let mut r = create(name, 16 * MIB, &params, mount_cap("ext4"));
        r.accessibility_requirements = Some(spec::TopologyRequirement {
            requisite: vec![topo(node)],
            preferred: vec![topo(node)],
        });
        r
    };
    let e = ca
        .create_volume(with_topology("pvc-for-b", "node-b"))
        .await
        .expect_err("node a refuses a volume meant for node b");
    ensure!(e.code() == tonic::Code::ResourceExhausted, "{e:?}");
    ca.create_volume(with_topology("pvc-a1", "node-a")).await?;
    cb.create_volume(with_topology("pvc-b1", "node-b")).await?;
    let ids =
        |p: &Pair| -> Result<String> { p.daemon.ublkctl_ok(&["list-volumes", "--no-headers"]) };
    let (la, lb) = (ids(&a)?, ids(&b)?);
    ensure!(
        la.contains("pvc-a1") && !la.contains("pvc-b1"),
        "node a: {la}"
    );
    ensure!(
        lb.contains("pvc-b1") && !lb.contains("pvc-a1"),
        "node b: {lb}"
    );

    let cap_of = |p: &'static str| spec::GetCapacityRequest {
        parameters: [("backend".to_owned(), p.to_owned())].into(),
        ..Default::default()
    };
    let cap_a = ca.get_capacity(cap_of("ram")).await?.into_inner();
    let cap_b = cb.get_capacity(cap_of("ram")).await?.into_inner();
    println!("capacity: node a {cap_a:?}, node b {cap_b:?}");
    ensure!(cap_a.available_capacity > 0, "node a has room");
    ensure!(cap_b.available_capacity == 0, "node b is full: {cap_b:?}");
    // Capacity asked for another node's topology is none.
    let mut other = cap_of("ram");
    other.accessible_topology = Some(topo("node-b"));
    ensure!(
        ca.get_capacity(other)
            .await?
            .into_inner()
            .available_capacity
            == 0
    );
    let e = cb
        .create_volume(with_topology("pvc-b2", "node-b"))
        .await
        .expect_err("node b is full");
    ensure!(e.code() == tonic::Code::ResourceExhausted, "{e:?}");

    let info = nb
        .node_get_info(spec::NodeGetInfoRequest {})
        .await?
        .into_inner();
    ensure!(
        info.node_id == "node-b" && info.max_volumes_per_node == 1,
        "{info:?}"
    );
    ensure!(info.accessible_topology == Some(topo("node-b")), "{info:?}");
    for (c, id) in [(&mut ca, "pvc-a1"), (&mut cb, "pvc-b1")] {
        c.delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: Default::default(),
        })
        .await?;
    }
    Ok(())
}

/// A device that fails its reads is never formatted (issue 22, item 1): an ext4 volume with
/// files is unstaged, its backing file's reads fail (hook; writes still go through), and the
/// next stage is refused as UNAVAILABLE with nothing written; once reads work again, stage
/// mounts the same file system (same UUID) with the files intact.
#[tokio::test]
async fn stage_never_formats_a_device_it_could_not_read() -> Result<()> {
    use kubelet::*;
    let dir = guest::scratch("csi-stage-eio-faults")?;
    let faults = dir.join("faults");
    let pair = Pair::start_env(
        "csi-stage-eio",
        9570,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS_FILE", &faults.to_string_lossy())],
    )
    .await?;
    let arm = |spec: &str| -> Result<()> {
        std::fs::write(&faults, spec)?;
        let pid = pair.daemon.pid().context("ublkd is not running")?;
        guest::sh(&format!("kill -USR2 {pid}"))?;
        Ok(())
    };
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-eio", 64 * MIB, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id;
    let staging = pair.kubelet.join("plugins/ublkd.io/globalmount/pvc-eio");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!(
        "echo tenant-data > {s}/keep && dd if=/dev/urandom of={s}/blob bs=64k count=16          status=none && sync",
        s = staging.display()
    ))?;
    let sum = guest::sh(&format!("md5sum < {}/blob", staging.display()))?;
    let dev = guest::sh(&format!("findmnt -n -o SOURCE {}", staging.display()))?;
    let dev = dev.trim().to_owned();
    let uuid = || guest::sh(&format!("blkid -p -o value -s UUID {dev}"));
    let before = uuid()?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;

    arm("file_read_eio=100000000")?;
    // The fault is armed once a direct read of the device fails.
    let deadline = Instant::now() + Duration::from_secs(10);
    while guest::sh(&format!(
        "dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none"
    ))
    .is_ok()
    {
        ensure!(
            Instant::now() < deadline,
            "the read fault never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let e = node
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .expect_err("a device that cannot be read is not staged");
    println!("stage while reads fail: {e:?}");
    ensure!(e.code() == tonic::Code::Unavailable, "{e:?}");
    ensure!(!is_mountpoint(&staging), "nothing mounted");
    arm("file_read_eio=0")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while guest::sh(&format!(
        "dd if={dev} of=/dev/null bs=4k count=1 iflag=direct status=none"
    ))
    .is_err()
    {
        ensure!(Instant::now() < deadline, "the read fault never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    ensure!(
        uuid()? == before,
        "the file system was replaced while reads failed: UUID {before} became {}",
        uuid()?
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage once reads work again")?;
    ensure!(
        guest::sh(&format!("cat {}/keep", staging.display()))?.trim() == "tenant-data",
        "the tenant's file is intact"
    );
    ensure!(guest::sh(&format!("md5sum < {}/blob", staging.display()))? == sum);
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ctl.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}

/// A live file system whose end cannot be read is never formatted (issue 38, defect 3): blkid
/// probes the device's end too, and a read error there makes it answer as it does for a blank
/// device ("nothing found", exit 2), while the head reads fine. An ext4 volume with a file is
/// unstaged, reads of its last MiB fail (hook; the rest of it reads), and the next stage is
/// refused with nothing written; once reads work again, the file system (same UUID) and its
/// file are intact.
#[tokio::test]
async fn stage_never_formats_a_device_whose_end_cannot_be_read() -> Result<()> {
    use kubelet::*;
    const SIZE: u64 = 64 * MIB;
    let dir = guest::scratch("csi-stage-end-eio-faults")?;
    let faults = dir.join("faults");
    let pair = Pair::start_env(
        "csi-stage-end-eio",
        9573,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS_FILE", &faults.to_string_lossy())],
    )
    .await?;
    let arm = |spec: &str| -> Result<()> {
        std::fs::write(&faults, spec)?;
        let pid = pair.daemon.pid().context("ublkd is not running")?;
        guest::sh(&format!("kill -USR2 {pid}"))?;
        Ok(())
    };
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = ctl
        .create_volume(create("pvc-end-eio", SIZE, &params, cap.clone()))
        .await?
        .into_inner()
        .volume
        .context("no volume")?;
    let id = vol.volume_id;
    let staging = pair
        .kubelet
        .join("plugins/ublkd.io/globalmount/pvc-end-eio");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!(
        "echo tenant-data > {}/keep && sync",
        staging.display()
    ))?;
    let dev = guest::sh(&format!("findmnt -n -o SOURCE {}", staging.display()))?;
    let dev = dev.trim().to_owned();
    let uuid = || -> Result<String> {
        Ok(guest::sh(&format!("blkid -p -o value -s UUID {dev}"))?
            .trim()
            .to_owned())
    };
    let before = uuid()?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;

    // Reads of the last MiB fail, and only those.
    arm(&format!("file_read_eio=100000000:{}+{MIB}", SIZE - MIB))?;
    let read_at = |block: u64| {
        guest::sh(&format!(
            "dd if={dev} of=/dev/null bs=4k skip={block} count=1 iflag=direct status=none"
        ))
    };
    let last = SIZE / 4096 - 1;
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_at(last).is_ok() {
        ensure!(
            Instant::now() < deadline,
            "the read fault never took effect"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    read_at(0).context("the head still reads")?;
    read_at(last - 256).context("the MiB before the last still reads")?;
    // Nothing of the device stays cached from before: blkid reads it now.
    guest::sh(&format!("blockdev --flushbufs {dev}"))?;
    println!(
        "blkid while the end fails: {}",
        guest::sh(&format!("blkid -p {dev}; echo exit $?"))?.trim()
    );
    let staged = node
        .node_stage_volume(stage(&id, &staging, cap.clone()))
        .await;
    arm("file_read_eio=0")?;
    let deadline = Instant::now() + Duration::from_secs(10);
    while read_at(last).is_err() {
        ensure!(Instant::now() < deadline, "the read fault never cleared");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let after = uuid()?;
    match staged {
        Ok(_) => bail!(
            "stage succeeded while the end of the device failed to read: the file system was \
             {}, UUID {before} became {after}",
            if after == before { "kept" } else { "formatted" }
        ),
        Err(e) => {
            println!("stage while the end fails: {e:?}");
            ensure!(
                matches!(
                    e.code(),
                    tonic::Code::Unavailable | tonic::Code::FailedPrecondition
                ),
                "{e:?}"
            );
            ensure!(e.message().contains("last MiB"), "{e:?}");
        }
    }
    ensure!(!is_mountpoint(&staging), "nothing mounted");
    ensure!(
        after == before,
        "the file system was replaced while its end failed to read: UUID {before} became {after}"
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await
        .context("stage once reads work again")?;
    ensure!(
        guest::sh(&format!("cat {}/keep", staging.display()))?.trim() == "tenant-data",
        "the tenant's file is intact"
    );
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    ctl.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}

/// Two CreateVolume calls in parallel on one NVMe namespace both succeed with disjoint windows
/// (issue 22, item 4): ublkd places each window under its own lock, where the driver used to
/// pick the same free extent for both.
#[tokio::test]
async fn parallel_nvme_creates_get_disjoint_windows() -> Result<()> {
    use kubelet::*;
    use ublkd_proto::v1;
    let pair = Pair::start("csi-nvme-parallel", 9571, "node-a").await?;
    let params = vec![
        ("backend", "nvme".to_owned()),
        ("namespace", NG.to_owned()),
        ("fsType", "ext4".to_owned()),
    ];
    for round in 0..3 {
        let (mut c1, _) = clients(&pair).await?;
        let (mut c2, _) = clients(&pair).await?;
        let (n1, n2) = (format!("pvc-par-{round}-a"), format!("pvc-par-{round}-b"));
        let (r1, r2) = tokio::join!(
            c1.create_volume(create(&n1, 32 * MIB, &params, mount_cap("ext4"))),
            c2.create_volume(create(&n2, 32 * MIB, &params, mount_cap("ext4")))
        );
        let (r1, r2) = (r1.context("first create")?, r2.context("second create")?);
        let mut windows = Vec::new();
        for r in [r1, r2] {
            let id = r.into_inner().volume.context("no volume")?.volume_id;
            let v = pair
                .daemon
                .volumes()
                .await?
                .get_volume(v1::GetVolumeRequest { id: id.clone() })
                .await?
                .into_inner();
            match v.spec.and_then(|s| s.backend) {
                Some(v1::volume_spec::Backend::Nvme(n)) => {
                    windows.push((id, n.offset_bytes.unwrap_or(0), n.length_bytes))
                }
                other => anyhow::bail!("{id}: {other:?}"),
            }
        }
        println!("round {round}: {windows:?}");
        let (a, b) = (&windows[0], &windows[1]);
        ensure!(
            a.1 + a.2 <= b.1 || b.1 + b.2 <= a.1,
            "windows overlap: {windows:?}"
        );
    }
    let (mut c, _) = clients(&pair).await?;
    for round in 0..3 {
        for s in ["a", "b"] {
            c.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
                volume_id: format!("pvc-par-{round}-{s}"),
                secrets: Default::default(),
            })
            .await?;
        }
    }
    Ok(())
}

/// A CSI call three times in parallel, then three times in sequence, as the sidecars and the
/// kubelet retry on every timeout: each result is the one a single call gives, or ABORTED
/// (operation pending) while a parallel twin runs; at least one parallel call succeeds. Returns
/// the result.
async fn thrice<T, F, Fut>(what: &str, call: F) -> Result<T>
where
    T: PartialEq + std::fmt::Debug,
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let (a, b, c) = tokio::join!(call(), call(), call());
    let mut oks = Vec::new();
    for r in [a, b, c] {
        match r {
            Ok(r) => oks.push(r.into_inner()),
            Err(e) if e.code() == tonic::Code::Aborted => {}
            Err(e) => bail!("{what} in parallel: {e:?}"),
        }
    }
    ensure!(!oks.is_empty(), "{what}: every parallel call was ABORTED");
    let first = oks.remove(0);
    for o in &oks {
        ensure!(
            *o == first,
            "{what}: parallel results differ: {first:?} / {o:?}"
        );
    }
    for i in 0..3 {
        let again = call()
            .await
            .map_err(|e| anyhow::anyhow!("{what}, call {} in sequence: {e:?}", i + 1))?
            .into_inner();
        ensure!(
            again == first,
            "{what}: a retry answered {again:?}, not {first:?}"
        );
    }
    Ok(first)
}

/// Every Controller and Node call of a volume's life, each repeated three times in parallel
/// and three times in sequence, gives what one call gives (issue 22): idempotency is what keeps
/// data safe when the provisioner and the kubelet retry. The data written stays through it all.
#[tokio::test]
async fn every_call_retried_thrice_in_parallel_and_in_sequence_is_one_call() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec;
    let pair = Pair::start("csi-retries", 9572, "node-a").await?;
    let (ctl, node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let cap = mount_cap("ext4");
    let vol = thrice("CreateVolume", || {
        let mut c = ctl.clone();
        let r = create("pvc-retry", 64 * MIB, &params, cap.clone());
        async move { c.create_volume(r).await }
    })
    .await?
    .volume
    .context("no volume")?;
    let id = vol.volume_id.clone();
    thrice("ValidateVolumeCapabilities", || {
        let mut c = ctl.clone();
        let r = spec::ValidateVolumeCapabilitiesRequest {
            volume_id: id.clone(),
            volume_capabilities: vec![cap.clone()],
            ..Default::default()
        };
        async move { c.validate_volume_capabilities(r).await }
    })
    .await?;
    let staging = pair.kubelet.join("plugins/ublkd.io/globalmount/pvc-retry");
    let target = pair.kubelet.join("pods/r/volumes/pvc-retry");
    std::fs::create_dir_all(&staging)?;
    thrice("NodeStageVolume", || {
        let mut n = node.clone();
        let r = stage(&id, &staging, cap.clone());
        async move { n.node_stage_volume(r).await }
    })
    .await?;
    thrice("NodePublishVolume", || {
        let mut n = node.clone();
        let r = publish(&id, &staging, &target, cap.clone());
        async move { n.node_publish_volume(r).await }
    })
    .await?;
    guest::sh(&format!("echo kept > {}/f && sync", target.display()))?;
    let grown = thrice("NodeExpandVolume", || {
        let mut n = node.clone();
        let r = spec::NodeExpandVolumeRequest {
            volume_id: id.clone(),
            volume_path: target.display().to_string(),
            capacity_range: Some(spec::CapacityRange {
                required_bytes: (96 * MIB) as i64,
                limit_bytes: 0,
            }),
            staging_target_path: staging.display().to_string(),
            volume_capability: Some(cap.clone()),
            secrets: Default::default(),
        };
        async move { n.node_expand_volume(r).await }
    })
    .await?;
    ensure!(grown.capacity_bytes == (96 * MIB) as i64, "{grown:?}");
    thrice("NodeUnpublishVolume", || {
        let mut n = node.clone();
        let r = unpublish(&id, &target);
        async move { n.node_unpublish_volume(r).await }
    })
    .await?;
    thrice("NodeUnstageVolume", || {
        let mut n = node.clone();
        let r = unstage(&id, &staging);
        async move { n.node_unstage_volume(r).await }
    })
    .await?;
    // Staged again, the data is there: no retry formatted or lost anything.
    let (_, mut n) = clients(&pair).await?;
    n.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/f", staging.display()))?.trim() == "kept",
        "the data survived every retry"
    );
    n.node_unstage_volume(unstage(&id, &staging)).await?;
    thrice("DeleteVolume", || {
        let mut c = ctl.clone();
        let r = spec::DeleteVolumeRequest {
            volume_id: id.clone(),
            secrets: Default::default(),
        };
        async move { c.delete_volume(r).await }
    })
    .await?;
    ensure!(
        !pair
            .daemon
            .ublkctl_ok(&["list-volumes", "--no-headers"])?
            .contains("pvc-retry"),
        "the volume is gone"
    );
    Ok(())
}

/// The external-provisioner retries CreateVolume after its timeout. A retry while the first
/// create is still running must not answer OK (the first may yet fail, and the PV would name a
/// volume that never existed): it answers ABORTED until the volume is READY, and once a call
/// answered OK the volume is there (issue 22, item 2). The create is made slow by a hook.
#[tokio::test]
async fn a_retried_create_answers_ok_only_once_the_volume_is_ready() -> Result<()> {
    use kubelet::*;
    use ublkd_proto::v1;
    let pair = Pair::start_env(
        "csi-create-retry",
        9569,
        "node-a",
        "",
        &[("UBLKD_TEST_FAULTS", "delay_at=create:after_record:4000")],
    )
    .await?;
    let (mut c, _) = clients(&pair).await?;
    let params = vec![("backend", "ram".to_owned())];
    let req = || {
        let mut r = tonic::Request::new(create("pvc-slow", 16 * MIB, &params, mount_cap("ext4")));
        r.set_timeout(Duration::from_secs(1));
        r
    };
    let state = |id: &str| {
        let id = id.to_owned();
        let pair = &pair;
        async move {
            let r = pair
                .daemon
                .volumes()
                .await?
                .get_volume(v1::GetVolumeRequest { id })
                .await;
            Ok::<_, anyhow::Error>(r.map(|v| v.into_inner().state()))
        }
    };
    let own_deadline = |e: &tonic::Status| {
        e.code() == tonic::Code::Cancelled
            && std::iter::successors(std::error::Error::source(e), |s| s.source())
                .any(|s| s.is::<tonic::TimeoutExpired>())
    };
    let first = c.create_volume(req()).await;
    ensure!(
        first.is_err(),
        "the slow create answered within 1 s: {first:?}"
    );
    let started = Instant::now();
    let mut codes = Vec::new();
    loop {
        ensure!(
            started.elapsed() < Duration::from_secs(30),
            "no retry answered OK in 30 s: {codes:?}"
        );
        match c.create_volume(req()).await {
            Ok(v) => {
                let id = v.into_inner().volume.context("no volume")?.volume_id;
                let s = state(&id).await?;
                ensure!(
                    matches!(s, Ok(v1::VolumeState::Ready)),
                    "CreateVolume answered OK for {id} while ublkd has it {s:?} (retries: {codes:?})"
                );
                break;
            }
            Err(e) => {
                // A retry may run out of its own 1 s too (a slow machine, or the retry that
                // made the volume because the first was dropped before ublkd saw it): tonic
                // reports the client's own deadline as CANCELLED with `TimeoutExpired` as the
                // source; the server's as DEADLINE_EXCEEDED. Neither is an answer about the
                // volume, so either may come any number of times.
                ensure!(
                    matches!(
                        e.code(),
                        tonic::Code::Aborted | tonic::Code::DeadlineExceeded
                    ) || own_deadline(&e),
                    "a retry while creating: {e:?}"
                );
                codes.push(e.code());
            }
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    println!("retries before OK: {codes:?}");
    ensure!(
        codes.contains(&tonic::Code::Aborted),
        "no retry saw the volume CREATING: the hook did not slow the create ({codes:?})"
    );
    // Once OK, the volume stays there.
    ensure!(matches!(
        state("pvc-slow").await?,
        Ok(v1::VolumeState::Ready)
    ));
    c.delete_volume(ublkd_csi::spec::DeleteVolumeRequest {
        volume_id: "pvc-slow".into(),
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}

/// Bad requests get the code the spec gives them, and nothing is created or mounted.
#[tokio::test]
async fn bad_csi_requests_are_refused_and_change_nothing() -> Result<()> {
    use kubelet::*;
    use spec::volume_capability::access_mode::Mode;
    use tonic::Code;
    use ublkd_csi::spec;
    let pair = Pair::start("csi-bad", 9567, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&pair.daemon.root, "ext4");
    let mounts_before = std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .count();
    let mut cases: Vec<(&str, Code, Result<(), tonic::Status>)> = Vec::new();
    let mut add = |what, code, r: Result<(), tonic::Status>| cases.push((what, code, r));

    let mut r = create("", 16 * MIB, &params, mount_cap("ext4"));
    add(
        "no name",
        Code::InvalidArgument,
        ctl.create_volume(r.clone()).await.map(drop),
    );
    r.name = "pvc-bad".into();
    r.volume_capabilities.clear();
    add(
        "no capabilities",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let mut unknown = params.clone();
    unknown.push(("fstype", "ext4".into()));
    let r = create("pvc-bad", 16 * MIB, &unknown, mount_cap("ext4"));
    add(
        "unknown parameter",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let r = create("pvc-bad", 16 * MIB, &[], mount_cap("ext4"));
    add(
        "no backend",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    for mode in [
        Mode::MultiNodeMultiWriter,
        Mode::MultiNodeReaderOnly,
        Mode::MultiNodeSingleWriter,
    ] {
        let r = create("pvc-bad", 16 * MIB, &params, block_cap(mode));
        add(
            "multi-node mode",
            Code::InvalidArgument,
            ctl.create_volume(r).await.map(drop),
        );
    }
    let r = create("pvc-bad", 16 * MIB, &params, mount_cap("btrfs"));
    add(
        "unknown file system",
        Code::InvalidArgument,
        ctl.create_volume(r).await.map(drop),
    );
    let mut r = create("pvc-bad", 16 * MIB, &params, mount_cap("ext4"));
    r.capacity_range = Some(spec::CapacityRange {
        required_bytes: 5000,
        limit_bytes: 4097,
    });
    add(
        "limit below the size",
        Code::OutOfRange,
        ctl.create_volume(r).await.map(drop),
    );
    add(
        "delete without id",
        Code::InvalidArgument,
        ctl.delete_volume(spec::DeleteVolumeRequest::default())
            .await
            .map(drop),
    );

    // A real volume for the node-side cases.
    let id = ctl
        .create_volume(create("pvc-good", 16 * MIB, &params, mount_cap("ext4")))
        .await?
        .into_inner()
        .volume
        .context("volume")?
        .volume_id;
    let staging = pair.kubelet.join("staging/pvc-good");
    let target = pair.kubelet.join("pods/x/pvc-good");
    std::fs::create_dir_all(&staging)?;
    let cap = mount_cap("ext4");
    let mut s = stage(&id, &staging, cap.clone());
    s.volume_id.clear();
    add(
        "stage without id",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let mut s = stage(&id, &staging, cap.clone());
    s.staging_target_path.clear();
    add(
        "stage without path",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let mut s = stage(&id, &staging, cap.clone());
    s.volume_capability = None;
    add(
        "stage without capability",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let s = stage(&id, Path::new("/tmp/outside-kubelet"), cap.clone());
    add(
        "staging outside kubelet dir",
        Code::InvalidArgument,
        node.node_stage_volume(s).await.map(drop),
    );
    let s = stage("pvc-missing", &staging, cap.clone());
    add(
        "stage of a missing volume",
        Code::NotFound,
        node.node_stage_volume(s).await.map(drop),
    );
    let p = publish(&id, &staging, Path::new("/etc/ublkd-csi-test"), cap.clone());
    add(
        "target outside kubelet dir",
        Code::InvalidArgument,
        node.node_publish_volume(p).await.map(drop),
    );
    // A volume holding ext4 is never formatted as xfs: staging it so is refused, and the
    // file system and its data stay.
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    guest::sh(&format!("echo kept > {}/kept", staging.display()))?;
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    let s = stage(&id, &staging, mount_cap("xfs"));
    add(
        "staging ext4 as xfs",
        Code::FailedPrecondition,
        node.node_stage_volume(s).await.map(drop),
    );
    node.node_stage_volume(stage(&id, &staging, cap.clone()))
        .await?;
    ensure!(
        guest::sh(&format!("cat {}/kept", staging.display()))?.trim() == "kept",
        "the data is still there"
    );
    node.node_unstage_volume(unstage(&id, &staging)).await?;
    // Another file system already mounted at the staging path.
    guest::sh(&format!("mount -t tmpfs other {}", staging.display()))?;
    let s = stage(&id, &staging, cap.clone());
    add(
        "staging path taken",
        Code::AlreadyExists,
        node.node_stage_volume(s).await.map(drop),
    );
    guest::sh(&format!("umount {}", staging.display()))?;
    let mounts_after = std::fs::read_to_string("/proc/self/mountinfo")?
        .lines()
        .count();

    let mut wrong = Vec::new();
    for (what, code, r) in &cases {
        match r {
            Err(s) if s.code() == *code => println!("ok      {what}: {}", s.message()),
            other => wrong.push(format!("{what}: wanted {code:?}, got {other:?}")),
        }
    }
    ensure!(wrong.is_empty(), "{wrong:#?}");
    ensure!(cases.len() >= 18, "{} cases", cases.len());
    ensure!(
        mounts_before == mounts_after,
        "mounts changed: {mounts_before} -> {mounts_after}"
    );
    ensure!(!target.exists(), "nothing published");
    let list = pair.daemon.ublkctl_ok(&["list-volumes", "--no-headers"])?;
    ensure!(
        list.lines().count() == 1 && list.contains("pvc-good"),
        "only the good volume exists: {list}"
    );
    ctl.delete_volume(spec::DeleteVolumeRequest {
        volume_id: id,
        secrets: Default::default(),
    })
    .await?;
    Ok(())
}

/// Snapshots and clones through the driver, with the data checked through mounts: a snapshot
/// holds what was written before it and not after, a restore and a clone hold what their
/// source held, and each reports its content source. A VolumeAttributesClass at creation and
/// ControllerModifyVolume later set the volume's limits in ublkd, merged key by key.
#[tokio::test]
async fn snapshots_restore_their_data_and_classes_change_limits_live() -> Result<()> {
    use kubelet::*;
    use ublkd_csi::spec::{self, volume_content_source as vcs};
    let name = "csi-snap";
    let dir = guest::scratch(name)?;
    let root = ReflinkRoot::at(&dir, &dir.join("roots"))?;
    let pair = Pair::start(name, 9568, "node-a").await?;
    let (mut ctl, mut node) = clients(&pair).await?;
    let params = file_params(&root.root, "ext4");
    let cap = mount_cap("ext4");

    let mut req = create("pvc-src", 64 * MIB, &params, cap.clone());
    req.parameters.insert("readIops".into(), "4000".into());
    req.mutable_parameters = [("writeBandwidth".to_owned(), "100Mi".to_owned())].into();
    ctl.create_volume(req).await?;
    let mut ublkd = pair.daemon.volumes().await?;
    let limits = |v: ublkd_proto::v1::Volume| v.spec.and_then(|s| s.qos).unwrap_or_default();
    let get = |id: &str| ublkd_proto::v1::GetVolumeRequest { id: id.into() };
    let q = limits(ublkd.get_volume(get("pvc-src")).await?.into_inner());
    ensure!(
        q.read_iops == 4000 && q.write_bytes_per_second == 100 << 20,
        "limits at creation: {q:?}"
    );

    // Data before the snapshot, more after it.
    let staging = pair.kubelet.join("staging/pvc-src");
    let target = pair.kubelet.join("pods/src/pvc-src");
    std::fs::create_dir_all(&staging)?;
    node.node_stage_volume(stage("pvc-src", &staging, cap.clone()))
        .await?;
    node.node_publish_volume(publish("pvc-src", &staging, &target, cap.clone()))
        .await?;
    guest::sh(&format!("echo before > {}/data && sync", target.display()))?;
    let snap = ctl
        .create_snapshot(spec::CreateSnapshotRequest {
            source_volume_id: "pvc-src".into(),
            name: "snapshot-1".into(),
            ..Default::default()
        })
        .await?
        .into_inner()
        .snapshot
        .context("no snapshot")?;
    ensure!(
        snap.ready_to_use && snap.snapshot_id == "snapshot-1",
        "{snap:?}"
    );
    guest::sh(&format!("echo after > {}/data && sync", target.display()))?;

    // ControllerModifyVolume: live, merged over what the volume has.
    ctl.controller_modify_volume(spec::ControllerModifyVolumeRequest {
        volume_id: "pvc-src".into(),
        mutable_parameters: [
            ("readIops".to_owned(), "unlimited".to_owned()),
            ("writeIops".to_owned(), "300".to_owned()),
        ]
        .into(),
        secrets: Default::default(),
    })
    .await?;
    let q = limits(ublkd.get_volume(get("pvc-src")).await?.into_inner());
    ensure!(
        q.read_iops == 0 && q.write_iops == 300 && q.write_bytes_per_second == 100 << 20,
        "limits after modify: {q:?}"
    );
    guest::sh(&format!(
        "echo limited > {}/data2 && sync",
        target.display()
    ))
    .context("I/O under the new limits")?;

    // A restore holds the snapshot's data; a clone the volume's now.
    let from = |t: vcs::Type| spec::VolumeContentSource { r#type: Some(t) };
    let sources = [
        (
            "pvc-restored",
            from(vcs::Type::Snapshot(vcs::SnapshotSource {
                snapshot_id: snap.snapshot_id.clone(),
            })),
            "before",
        ),
        (
            "pvc-clone",
            from(vcs::Type::Volume(vcs::VolumeSource {
                volume_id: "pvc-src".into(),
            })),
            "after",
        ),
    ];
    for (id, source, want) in sources {
        let mut r = create(id, 64 * MIB, &params, cap.clone());
        r.volume_content_source = Some(source.clone());
        let v = ctl
            .create_volume(r)
            .await?
            .into_inner()
            .volume
            .context("no volume")?;
        ensure!(v.content_source == Some(source), "{id}: {v:?}");
        let st = pair.kubelet.join(format!("staging/{id}"));
        let t = pair.kubelet.join(format!("pods/{id}/{id}"));
        std::fs::create_dir_all(&st)?;
        node.node_stage_volume(stage(id, &st, cap.clone())).await?;
        node.node_publish_volume(publish(id, &st, &t, cap.clone()))
            .await?;
        let got = guest::sh(&format!("cat {}/data", t.display()))?;
        ensure!(got.trim() == want, "{id} holds {got:?}, not {want:?}");
        node.node_unpublish_volume(unpublish(id, &t)).await?;
        node.node_unstage_volume(unstage(id, &st)).await?;
    }

    // A RAM volume cannot be snapshotted: INVALID_ARGUMENT, nothing taken.
    ctl.create_volume(create(
        "pvc-ram",
        16 * MIB,
        &[("backend", "ram".to_owned())],
        cap.clone(),
    ))
    .await?;
    let e = ctl
        .create_snapshot(spec::CreateSnapshotRequest {
            source_volume_id: "pvc-ram".into(),
            name: "snapshot-ram".into(),
            ..Default::default()
        })
        .await
        .expect_err("a RAM volume has no file to reflink");
    ensure!(e.code() == tonic::Code::InvalidArgument, "{e:?}");

    node.node_unpublish_volume(unpublish("pvc-src", &target))
        .await?;
    node.node_unstage_volume(unstage("pvc-src", &staging))
        .await?;
    ctl.delete_snapshot(spec::DeleteSnapshotRequest {
        snapshot_id: snap.snapshot_id,
        secrets: Default::default(),
    })
    .await?;
    for id in ["pvc-restored", "pvc-clone", "pvc-src", "pvc-ram"] {
        ctl.delete_volume(spec::DeleteVolumeRequest {
            volume_id: id.into(),
            secrets: Default::default(),
        })
        .await?;
    }
    let left = guest::sh(&format!(
        "find {} -name '*.img' | wc -l",
        root.root.display()
    ))?;
    ensure!(left.trim() == "0", "backing files and copies left: {left}");
    drop(pair);
    Ok(())
}
