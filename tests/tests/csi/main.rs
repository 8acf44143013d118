//! The CSI driver against the real kernel: `ublkd-csi` in front of a ublkd, driven by the
//! Kubernetes conformance suite (csi-sanity, installed by the harness with `go install`) for every backend and
//! access type, and by the kubelet's own sequence of calls with data checked through mounts.
//! The suite's snapshot and clone tests run on the file backend over an XFS with reflink (a
//! loop device the test makes, unless the guest already mounted one at the root); its
//! ModifyVolume tests run on every backend.
#![cfg(feature = "vm")]

mod kubelet;
mod kubelet_path;
mod nodes;
mod refusals;
mod retries;
mod sanity;
mod snapshots;
mod stage;

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
