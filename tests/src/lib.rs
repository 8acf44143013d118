//! Helpers shared by ublkd's integration tests.
//!
//! What it is: small utilities for tests that run inside the test VM (reading sysfs, running
//! guest tools such as fio and mkfs, finding the project's binaries). What it is not: a fake
//! kernel. Tests that need `ublk_drv` are built only with the `vm` feature and run against the
//! real driver inside QEMU (`cargo xtask vm-test`).
#![forbid(unsafe_code)]

use anyhow::{bail, Context, Result};
use std::path::Path;
use std::process::Command;

/// True inside the harness's guest (set by its /init).
pub fn in_vm() -> bool {
    std::env::var_os("UBLKD_VM").is_some()
}

/// Reads a sysfs (or any small text) file, trimmed.
pub fn read_trimmed(path: impl AsRef<Path>) -> Result<String> {
    let path = path.as_ref();
    Ok(std::fs::read_to_string(path)
        .with_context(|| format!("reading {}", path.display()))?
        .trim()
        .to_owned())
}

/// Runs a command, failing with its stderr when it exits non-zero; returns stdout.
pub fn run(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}):\n{}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs fio with `args` plus JSON output and returns the parsed report.
pub fn fio_json(args: &[&str]) -> Result<serde_json::Value> {
    let out = run(Command::new("fio").args(args).arg("--output-format=json"))?;
    let (report, rest) = split_fio_json(&out)?;
    anyhow::ensure!(
        !rest.contains("verify") && !rest.contains("error"),
        "fio printed after its report: {rest}"
    );
    Ok(report)
}

/// fio's JSON report from its output, and what it printed after it: fio may print notes before
/// the document and, when interrupted, lines after it.
pub fn split_fio_json(out: &str) -> Result<(serde_json::Value, String)> {
    let start = out.find('{').context("fio printed no JSON")?;
    let mut stream = serde_json::Deserializer::from_str(&out[start..]).into_iter();
    let report = stream
        .next()
        .context("fio printed no JSON")?
        .context("parsing fio's JSON")?;
    let rest = out[start + stream.byte_offset()..].trim().to_owned();
    Ok((report, rest))
}

/// Total bytes read plus written over all jobs of a fio JSON report.
pub fn fio_total_bytes(report: &serde_json::Value) -> u64 {
    report["jobs"]
        .as_array()
        .map(|jobs| {
            jobs.iter()
                .map(|j| {
                    j["read"]["io_bytes"].as_u64().unwrap_or(0)
                        + j["write"]["io_bytes"].as_u64().unwrap_or(0)
                })
                .sum()
        })
        .unwrap_or(0)
}

/// Total error count over all jobs of a fio JSON report.
pub fn fio_errors(report: &serde_json::Value) -> u64 {
    report["jobs"]
        .as_array()
        .map(|jobs| jobs.iter().map(|j| j["error"].as_u64().unwrap_or(0)).sum())
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fio_report_totals_add_up_over_jobs() {
        let report = serde_json::json!({
            "jobs": [
                {"error": 0, "read": {"io_bytes": 4096}, "write": {"io_bytes": 8192}},
                {"error": 5, "read": {"io_bytes": 1}, "write": {"io_bytes": 0}},
            ]
        });
        assert_eq!(fio_total_bytes(&report), 4096 + 8192 + 1);
        assert_eq!(fio_errors(&report), 5);
    }
}

/// Bytes in a MiB, for sizes in tests.
pub const MIB: u64 = 1 << 20;

/// Requests of the `ublkd.v1` API, as the daemon tests build them.
pub mod api {
    use std::path::Path;
    use ublkd_proto::v1::{self, volume_spec::Backend};

    /// A volume of `size` bytes on `backend`, queues of 32 tags, the rest the server's defaults.
    pub fn volume(size: u64, backend: Backend) -> v1::VolumeSpec {
        v1::VolumeSpec {
            size_bytes: size,
            backend: Some(backend),
            queue_depth: Some(32),
            ..Default::default()
        }
    }

    pub fn create(id: &str, spec: v1::VolumeSpec) -> v1::CreateVolumeRequest {
        v1::CreateVolumeRequest {
            id: id.into(),
            spec: Some(spec),
        }
    }

    pub fn file(path: &Path, create: bool) -> Backend {
        Backend::File(v1::FileBackend {
            path: path.display().to_string(),
            create,
        })
    }

    pub fn nvme(device: &str, offset_bytes: u64, length_bytes: u64) -> Backend {
        Backend::Nvme(v1::NvmeBackend {
            device: device.into(),
            offset_bytes: Some(offset_bytes),
            length_bytes,
            keep_data: false,
            identity: String::new(),
        })
    }

    pub fn ram() -> Backend {
        Backend::Ram(v1::RamBackend {})
    }
}

/// Helpers for tests that drive the dataplane in the guest.
pub mod guest {
    use anyhow::{bail, Context, Result};
    use std::path::{Path, PathBuf};
    use std::process::Command;
    use std::time::{Duration, Instant};
    use ublkd_dataplane::{BackendSpec, Config, DeviceSpec, Handle, IoPath};

    /// Both I/O paths, for tests that must pass on each.
    pub const PATHS: [IoPath; 2] = [IoPath::Batch, IoPath::PerIo];

    /// A dataplane with two workers (CPUs 0 and 1), as the test VM has.
    pub fn dataplane() -> Result<Handle> {
        Ok(Handle::start(Config {
            cpus: vec![0, 1],
            ..Config::default()
        })?)
    }

    pub fn spec(backend: BackendSpec, size: u64, path: IoPath) -> DeviceSpec {
        DeviceSpec {
            size_bytes: size,
            queues: 2,
            queue_depth: 32,
            io_path: path,
            backend,
            ..DeviceSpec::default()
        }
    }

    /// A scratch directory for backing files (tmpfs in the guest).
    pub fn scratch(name: &str) -> Result<PathBuf> {
        let dir = std::env::temp_dir().join(format!("ublkd-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir)?;
        Ok(dir)
    }

    /// A sparse backing file of `size` bytes.
    pub fn backing_file(dir: &Path, name: &str, size: u64) -> Result<PathBuf> {
        let path = dir.join(name);
        std::fs::File::create(&path)?.set_len(size)?;
        Ok(path)
    }

    /// Runs fio on `dev` with `args`, failing on any error; returns the JSON report.
    pub fn fio(dev: &Path, args: &[&str]) -> Result<serde_json::Value> {
        let filename = format!("--filename={}", dev.display());
        let mut all = vec![
            "--name=t",
            filename.as_str(),
            "--ioengine=io_uring",
            "--direct=1",
        ];
        all.extend_from_slice(args);
        let report = crate::fio_json(&all)?;
        let errors = crate::fio_errors(&report);
        if errors != 0 {
            bail!("fio reported {errors} errors: {report}");
        }
        Ok(report)
    }

    /// Tasks in uninterruptible sleep (state D), as "pid comm" strings.
    pub fn d_state_tasks() -> Vec<String> {
        let mut out = Vec::new();
        let Ok(dir) = std::fs::read_dir("/proc") else {
            return out;
        };
        for e in dir.flatten() {
            let Ok(stat) = std::fs::read_to_string(e.path().join("stat")) else {
                continue;
            };
            // pid (comm) state ...
            if let Some(rest) = stat.rsplit_once(')').map(|(_, r)| r.trim_start()) {
                if rest.starts_with('D') {
                    out.push(stat.split(')').next().unwrap_or("").to_owned() + ")");
                }
            }
        }
        out
    }

    /// Threads of this process.
    pub fn thread_count() -> Result<usize> {
        Ok(std::fs::read_dir("/proc/self/task")?.count())
    }

    /// Names of this process's threads.
    pub fn thread_names() -> Vec<String> {
        std::fs::read_dir("/proc/self/task")
            .map(|d| {
                d.flatten()
                    .filter_map(|e| std::fs::read_to_string(e.path().join("comm")).ok())
                    .map(|s| s.trim().to_owned())
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Most threads the dataplane may add beyond its `workers` when they serve `queues` queues
    /// in all: the control thread and each worker's io-wq helpers, whose limit follows the
    /// queues it serves (no worker serves more than all of them).
    pub fn thread_allowance(workers: usize, queues: usize) -> usize {
        let [bounded, unbounded] = ublkd_dataplane::iowq_limits(queues);
        1 + workers * (bounded + unbounded) as usize
    }

    /// Open file descriptors of this process.
    pub fn fd_count() -> Result<usize> {
        Ok(std::fs::read_dir("/proc/self/fd")?.count())
    }

    /// ublk character devices present now.
    pub fn ublk_char_devices() -> Result<Vec<String>> {
        let mut v: Vec<String> = std::fs::read_dir("/dev")?
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("ublkc"))
            .collect();
        v.sort();
        Ok(v)
    }

    /// Waits until `path` no longer exists.
    pub fn wait_gone(path: &Path, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        while path.exists() {
            if Instant::now() > deadline {
                bail!("{} still exists after {within:?}", path.display());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(())
    }

    /// Runs a command, failing with its output when it exits non-zero.
    pub fn sh(cmd: &str) -> Result<String> {
        crate::run(Command::new("sh").arg("-c").arg(cmd)).with_context(|| cmd.to_owned())
    }
}

pub mod metrics_doc;
pub mod pki;

/// A real `ublkd` process in the guest, and gRPC clients for it.
pub mod daemon {
    use anyhow::{bail, Context, Result};
    use std::path::{Path, PathBuf};
    use std::process::{Child, Command, ExitStatus, Stdio};
    use std::time::{Duration, Instant};
    use tonic::transport::{Channel, Endpoint};
    use ublkd_proto::v1::{
        node_service_client::NodeServiceClient, volume_service_client::VolumeServiceClient,
    };

    /// Path of a workspace binary (set by the VM harness, else next to the test binary).
    pub fn bin(name: &str) -> PathBuf {
        let var = format!("{}_BIN", name.to_ascii_uppercase().replace('-', "_"));
        if let Some(p) = std::env::var_os(var) {
            return PathBuf::from(p);
        }
        let exe = std::env::current_exe().unwrap_or_default();
        exe.parent()
            .and_then(Path::parent)
            .map(|d| d.join(name))
            .unwrap_or_else(|| PathBuf::from(name))
    }

    /// What ublkd logs when a stop waited its whole listener grace for clients' connections.
    const GRACE_WAITED: &str = "clients still had connections open after the grace";

    /// A running ublkd with its own socket, state directory and allowed root.
    #[derive(Debug)]
    pub struct Daemon {
        pub dir: PathBuf,
        pub socket: PathBuf,
        pub state: PathBuf,
        pub root: PathBuf,
        pub metrics: String,
        pub config: PathBuf,
        /// Extra environment for the next start (e.g. a fault point).
        pub env: Vec<(String, String)>,
        /// A cgroup v2 directory the next start runs ublkd in (e.g. one with memory.max).
        pub cgroup: Option<PathBuf>,
        child: Option<Child>,
    }

    impl Daemon {
        /// Prepares directories and a config file (`extra` is appended to it) under `dir`.
        pub fn new(dir: &Path, metrics_port: u16, extra: &str) -> Result<Self> {
            let root = dir.join("roots");
            std::fs::create_dir_all(&root)?;
            let socket = dir.join("ublkd.sock");
            let state = dir.join("state");
            let metrics = format!("127.0.0.1:{metrics_port}");
            let config = dir.join("ublkd.toml");
            std::fs::write(
                &config,
                format!(
                    "state_dir = {state:?}\nallowed_roots = [{root:?}]\nram_dir = {ram:?}\n\
                     # Tests clean up after themselves; those about keeping devices set\n\
                     # UBLKD_ON_EXIT=keep.\non_exit = \"delete\"\n\n[grpc]\nlisten = [\"unix://{sock}\"]\n\n\
                     [metrics]\nlisten = {metrics:?}\n\n[dataplane]\ncpus = [0, 1]\n\n{extra}\n",
                    sock = socket.display(),
                    ram = dir.join("ram"),
                ),
            )?;
            Ok(Self {
                dir: dir.to_owned(),
                socket,
                state,
                root,
                metrics,
                config,
                env: Vec::new(),
                cgroup: None,
                child: None,
            })
        }

        /// Starts ublkd and waits until it answers health checks.
        pub async fn start(&mut self) -> Result<()> {
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(self.dir.join("ublkd.log"))?;
            // In a cgroup: a shell joins it, then becomes ublkd (which reads its limit at start).
            let mut command = match &self.cgroup {
                Some(cg) => {
                    let mut c = Command::new("sh");
                    let join = r#"echo $$ > "$0/cgroup.procs" && exec "$@""#;
                    c.arg("-c").arg(join).arg(cg).arg(bin("ublkd"));
                    c
                }
                None => Command::new(bin("ublkd")),
            };
            let child = command
                .arg("--config")
                .arg(&self.config)
                .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .context("starting ublkd")?;
            self.child = Some(child);
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Ok(ch) = self.channel().await {
                    let mut h = tonic_health::pb::health_client::HealthClient::new(ch);
                    let req = tonic_health::pb::HealthCheckRequest {
                        service: String::new(),
                    };
                    if let Ok(r) = h.check(req).await {
                        if r.into_inner().status == 1 {
                            return Ok(());
                        }
                    }
                }
                if let Some(c) = self.child.as_mut() {
                    if let Some(st) = c.try_wait()? {
                        bail!("ublkd exited at start ({st}):\n{}", self.log());
                    }
                }
                if Instant::now() > deadline {
                    bail!("ublkd did not become ready:\n{}", self.log());
                }
                tokio::time::sleep(Duration::from_millis(25)).await;
            }
        }

        /// Waits until every volume is READY (after a start, volumes come back in the
        /// background); fails if one is FAILED.
        pub async fn wait_all_ready(&self) -> Result<Vec<ublkd_proto::v1::Volume>> {
            use ublkd_proto::v1::{ListVolumesRequest, VolumeState};
            let deadline = Instant::now() + Duration::from_secs(60);
            let mut c = self.volumes().await?;
            loop {
                let vols = c
                    .list_volumes(ListVolumesRequest {})
                    .await?
                    .into_inner()
                    .volumes;
                if let Some(f) = vols.iter().find(|v| v.state == VolumeState::Failed as i32) {
                    bail!("volume {} failed: {}\n{}", f.id, f.message, self.log());
                }
                if vols.iter().all(|v| v.state == VolumeState::Ready as i32) {
                    return Ok(vols);
                }
                if Instant::now() > deadline {
                    bail!("volumes not ready: {vols:?}\n{}", self.log());
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }

        /// Whether the daemon process has exited (e.g. at a fault point).
        pub fn exited(&mut self) -> Result<Option<ExitStatus>> {
            match self.child.as_mut() {
                Some(c) => {
                    let st = c.try_wait()?;
                    if st.is_some() {
                        self.child = None;
                    }
                    Ok(st)
                }
                None => Ok(None),
            }
        }

        pub fn log(&self) -> String {
            std::fs::read_to_string(self.dir.join("ublkd.log")).unwrap_or_default()
        }

        pub fn pid(&self) -> Option<u32> {
            self.child.as_ref().map(Child::id)
        }

        /// Sends `signal` and waits for the process to exit.
        pub fn stop_with(&mut self, signal: i32) -> Result<ExitStatus> {
            let mut child = self.child.take().context("ublkd not running")?;
            let graces = |log: String| log.matches(GRACE_WAITED).count();
            let graces_before = graces(self.log());
            Command::new("kill")
                .arg(format!("-{signal}"))
                .arg(child.id().to_string())
                .status()
                .context("running kill")?;
            let deadline = Instant::now() + Duration::from_secs(60);
            loop {
                if let Some(st) = child.try_wait()? {
                    if graces(self.log()) > graces_before {
                        // Seconds of the suite's time, shown where they go: a client of the
                        // test that nothing polled while it stopped ublkd.
                        eprintln!("note: ublkd waited out its listener grace for a connection this test left unpolled");
                    }
                    return Ok(st);
                }
                if Instant::now() > deadline {
                    let _ = child.kill();
                    bail!("ublkd did not exit after signal {signal}:\n{}", self.log());
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }

        /// A gRPC channel over the unix socket.
        pub async fn channel(&self) -> Result<Channel> {
            let path = self.socket.clone();
            let ch = Endpoint::try_from("http://[::]:50051")?
                .connect_with_connector(tower::service_fn(move |_| {
                    let path = path.clone();
                    async move {
                        Ok::<_, std::io::Error>(hyper_util::rt::TokioIo::new(
                            tokio::net::UnixStream::connect(path).await?,
                        ))
                    }
                }))
                .await?;
            Ok(ch)
        }

        pub async fn volumes(&self) -> Result<VolumeServiceClient<Channel>> {
            Ok(VolumeServiceClient::new(self.channel().await?))
        }

        pub async fn node(&self) -> Result<NodeServiceClient<Channel>> {
            Ok(NodeServiceClient::new(self.channel().await?))
        }

        /// Runs ublkctl against this daemon; returns (exit code, stdout, stderr).
        pub fn ublkctl(&self, args: &[&str]) -> Result<(i32, String, String)> {
            let out = Command::new(bin("ublkctl"))
                .arg("--endpoint")
                .arg(format!("unix://{}", self.socket.display()))
                .args(args)
                .output()
                .context("running ublkctl")?;
            Ok((
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            ))
        }

        /// Like `ublkctl`, failing unless it exits 0; returns stdout.
        pub fn ublkctl_ok(&self, args: &[&str]) -> Result<String> {
            let (code, out, err) = self.ublkctl(args)?;
            if code != 0 {
                bail!("ublkctl {args:?} exited {code}: {err}{out}");
            }
            Ok(out)
        }

        /// Fetches /metrics.
        /// The kernel's ublk devices that no volume of this ublkd owns (NodeInfo.orphans).
        pub async fn orphans(&self) -> Result<Vec<ublkd_proto::v1::OrphanDevice>> {
            Ok(self
                .node()
                .await?
                .get_node_info(ublkd_proto::v1::GetNodeInfoRequest {})
                .await?
                .into_inner()
                .orphans)
        }

        pub fn scrape(&self) -> Result<String> {
            use std::io::{Read, Write};
            let mut s = std::net::TcpStream::connect(&self.metrics)?;
            write!(s, "GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")?;
            let mut body = String::new();
            s.read_to_string(&mut body)?;
            Ok(body)
        }
    }

    impl Drop for Daemon {
        fn drop(&mut self) {
            if self.child.is_some() {
                let _ = self.stop_with(libc::SIGTERM);
            }
        }
    }

    /// The value of the sample `name{labels}` in a Prometheus text exposition.
    pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
        text.lines().find_map(|l| {
            if l.starts_with('#') {
                return None;
            }
            let (series, value) = l.rsplit_once(' ')?;
            let (n, rest) = series.split_once('{').unwrap_or((series, "}"));
            if n != name {
                return None;
            }
            let all = labels
                .iter()
                .all(|(k, v)| rest.contains(&format!("{k}=\"{v}\"")));
            all.then(|| value.parse().ok())?
        })
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn finds_samples_by_name_and_labels() {
            let text = "# HELP x y\nublkd_volume_io_ops_total{volume=\"a\",op=\"read\"} 12\n\
                        ublkd_volume_io_ops_total{volume=\"b\",op=\"read\"} 3\nublkd_volumes 2\n";
            assert_eq!(
                sample(
                    text,
                    "ublkd_volume_io_ops_total",
                    &[("volume", "b"), ("op", "read")]
                ),
                Some(3.0)
            );
            assert_eq!(sample(text, "ublkd_volumes", &[]), Some(2.0));
            assert_eq!(
                sample(text, "ublkd_volume_io_ops_total", &[("volume", "c")]),
                None
            );
        }
    }
}
