//! Daemon configuration: defaults < TOML file < `UBLKD_…` environment (`__` nests) < flags.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Where the config file is read from when `--config` is not given (optional there).
pub const DEFAULT_CONFIG_PATH: &str = "/etc/ublkd/ublkd.toml";

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Settings {
    pub grpc: GrpcSettings,
    pub metrics: MetricsSettings,
    /// Registry of volume specs lives under here.
    pub state_dir: PathBuf,
    /// Backing files must resolve (after symlinks) under one of these.
    pub allowed_roots: Vec<PathBuf>,
    pub dataplane: DataplaneSettings,
    pub defaults: VolumeDefaults,
    pub limits: Limits,
    pub log: LogSettings,
    /// What a clean exit does with the kernel devices: `keep` them (quiesced) for the next
    /// ublkd to take over without the applications noticing, or `delete` them (a restart creates
    /// them again from the registry).
    pub on_exit: OnExit,
    /// Where RAM volumes keep their memory: files on tmpfs survive a daemon crash or upgrade
    /// (not a reboot).
    pub ram_dir: PathBuf,
    /// The memory limit of ublkd's cgroup, read at start (`capacity::cgroup_memory_limit`),
    /// not configured: volumes are admitted within it. None: unlimited.
    #[serde(skip)]
    pub memory_limit: Option<u64>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct GrpcSettings {
    /// `unix:///path.sock` or `host:port` (TCP).
    pub listen: Vec<String>,
    /// Serve TCP on a non-loopback address without TLS (refused unless set).
    pub allow_insecure_tcp: bool,
    pub tls: Option<TlsSettings>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TlsSettings {
    pub cert: PathBuf,
    pub key: PathBuf,
    /// Require client certificates signed by this CA (mutual TLS).
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsSettings {
    /// The node's name in `ublkd_node_info{node}` (a DaemonSet sets `UBLKD_METRICS__NODE` from
    /// `spec.nodeName`); empty: the host name.
    pub node: String,
    /// `host:port` for `/metrics`; empty disables it.
    pub listen: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataplaneSettings {
    /// CPUs to run workers on; empty means all CPUs the daemon may use.
    pub cpus: Vec<usize>,
    /// Bound on each ublk control command, in seconds.
    pub control_timeout_secs: u64,
    /// The workers' CPUs run nothing else (e.g. exclusive CPUs from the Kubernetes static CPU
    /// manager): `poll = auto` then polls NVMe volumes. CPUs the kernel isolates count as
    /// dedicated without it.
    pub dedicated_cpus: bool,
    /// Which worker serves each queue of a volume: `auto` (on another CPU than the ones that
    /// submit to the queue where the workers share CPUs with applications; spread over the
    /// workers on dedicated CPUs), `same-cpu`, `other-cpu` or `spread`.
    pub queue_placement: QueuePlacementSetting,
    /// How long, in microseconds, an idle worker looks for work in user space before it sleeps
    /// in the kernel (at most 100000; 0 sleeps at once). Spinning saves the wake-ups of a
    /// sleeping worker and takes its CPU; unset, workers spin 1000 on dedicated CPUs and not at
    /// all on shared ones.
    pub idle_spin_us: Option<u64>,
}

/// `dataplane.queue_placement` and `ublkd run --placement`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum QueuePlacementSetting {
    #[default]
    Auto,
    SameCpu,
    OtherCpu,
    Spread,
}

impl QueuePlacementSetting {
    pub fn policy(self) -> ublkd_dataplane::PlacementPolicy {
        use ublkd_dataplane::PlacementPolicy as P;
        match self {
            QueuePlacementSetting::Auto => P::Auto,
            QueuePlacementSetting::SameCpu => P::SameCpu,
            QueuePlacementSetting::OtherCpu => P::OtherCpu,
            QueuePlacementSetting::Spread => P::Spread,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VolumeDefaults {
    pub queues: u16,
    pub queue_depth: u16,
    pub block_size: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Limits {
    pub max_volumes: usize,
    pub max_volume_size_bytes: u64,
    pub max_queue_depth: u16,
    /// 0: as many as the kernel allows (one per CPU).
    pub max_queues: u16,
    /// Whether a create may ask to serve an NVMe window's earlier blocks as they are
    /// (`keep_data`): whoever may create volumes can then read what the window's last tenant
    /// left there. Off: every new window and every growth is erased first.
    pub allow_keep_data: bool,
    /// NVMe namespaces (char device paths, or identities such as `eui.…`) that ublkd may take
    /// although the host seems to use them: holders, partitions, a mount, an exclusive opener,
    /// a partition table or file system at the start. Any other such namespace is refused
    /// until a volume claims a window on it (its first window is what the check protects).
    pub allow_used_namespaces: Vec<String>,
}

impl Limits {
    /// Whether the configuration lets ublkd take the namespace at `device` (of `identity`)
    /// whatever the host seems to do with it.
    pub fn allows_used_namespace(
        &self,
        device: &Path,
        identity: Option<&ublkd_dataplane::NamespaceIdentity>,
    ) -> bool {
        self.allow_used_namespaces
            .iter()
            .any(|n| Path::new(n) == device || identity.is_some_and(|id| id.to_string() == *n))
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LogSettings {
    pub format: LogFormat,
    /// A tracing filter, e.g. `info` or `ublkd=debug`.
    pub level: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LogFormat {
    Text,
    Json,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnExit {
    Delete,
    Keep,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            grpc: GrpcSettings::default(),
            metrics: MetricsSettings::default(),
            state_dir: PathBuf::from("/var/lib/ublkd"),
            allowed_roots: vec![PathBuf::from("/var/lib/ublkd/volumes")],
            dataplane: DataplaneSettings::default(),
            defaults: VolumeDefaults::default(),
            limits: Limits::default(),
            log: LogSettings::default(),
            on_exit: OnExit::Keep,
            ram_dir: PathBuf::from("/dev/shm/ublkd"),
            memory_limit: None,
        }
    }
}

impl Default for GrpcSettings {
    fn default() -> Self {
        Self {
            listen: vec!["unix:///run/ublkd/ublkd.sock".into()],
            allow_insecure_tcp: false,
            tls: None,
        }
    }
}

impl Default for MetricsSettings {
    fn default() -> Self {
        Self {
            listen: "127.0.0.1:9580".into(),
            node: String::new(),
        }
    }
}

impl Default for DataplaneSettings {
    fn default() -> Self {
        Self {
            cpus: Vec::new(),
            control_timeout_secs: 10,
            dedicated_cpus: false,
            queue_placement: QueuePlacementSetting::Auto,
            idle_spin_us: None,
        }
    }
}

impl Default for VolumeDefaults {
    fn default() -> Self {
        Self {
            queues: 1,
            queue_depth: 128,
            block_size: 4096,
        }
    }
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            max_volumes: 1024,
            max_volume_size_bytes: 64 << 40,
            max_queue_depth: 4096,
            max_queues: 0,
            allow_keep_data: false,
            allow_used_namespaces: Vec::new(),
        }
    }
}

impl Default for LogSettings {
    fn default() -> Self {
        Self {
            format: LogFormat::Text,
            level: "info".into(),
        }
    }
}

/// Errors loading the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("invalid configuration")]
    Load(#[from] config::ConfigError),
    #[error("{0}")]
    Invalid(String),
}

/// Builds the settings: defaults, then `file` (required when given explicitly, else the default
/// path if it exists), then the environment (`UBLKD_STATE_DIR`, `UBLKD_GRPC__LISTEN=a,b`, ...),
/// then `overrides` (from flags, as dotted keys).
pub fn load(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
    overrides: &[(&str, config::Value)],
) -> Result<Settings, ConfigError> {
    let defaults = config::Config::try_from(&Settings::default())?;
    let mut b = config::Config::builder().add_source(defaults);
    match file {
        Some(path) => b = b.add_source(config::File::from(path).required(true)),
        None => {
            b = b.add_source(config::File::from(Path::new(DEFAULT_CONFIG_PATH)).required(false))
        }
    }
    // Only variables naming a configuration key: others that share the prefix (test hooks,
    // tooling) are not configuration.
    const TOP_KEYS: [&str; 10] = [
        "grpc",
        "metrics",
        "state_dir",
        "allowed_roots",
        "dataplane",
        "defaults",
        "limits",
        "log",
        "on_exit",
        "ram_dir",
    ];
    let env: std::collections::HashMap<String, String> = env
        .into_iter()
        .filter(|(k, _)| {
            k.strip_prefix("UBLKD_").is_some_and(|rest| {
                let first = rest.split("__").next().unwrap_or("").to_ascii_lowercase();
                TOP_KEYS.contains(&first.as_str())
            })
        })
        .collect();
    b = b.add_source(
        config::Environment::with_prefix("UBLKD")
            .prefix_separator("_")
            .separator("__")
            .list_separator(",")
            .with_list_parse_key("grpc.listen")
            .with_list_parse_key("allowed_roots")
            .with_list_parse_key("limits.allow_used_namespaces")
            .with_list_parse_key("dataplane.cpus")
            .try_parsing(true)
            .source(Some(env)),
    );
    for (key, value) in overrides {
        b = b.set_override(*key, value.clone())?;
    }
    let settings: Settings = b.build()?.try_deserialize()?;
    settings.check()?;
    Ok(settings)
}

impl GrpcSettings {
    /// Whether gRPC may be served on TCP address `sa` with these settings. Whoever reaches a
    /// gRPC listener manages every volume, so each needs the client authenticated: mutual TLS
    /// (`tls.client_ca`). TLS without it authenticates only the server; plaintext TCP, even on
    /// loopback, bypasses the unix socket's group check (any local user connects). Either is
    /// served only when `allow_insecure_tcp` says so explicitly.
    pub fn check_tcp(&self, sa: std::net::SocketAddr) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        match &self.tls {
            Some(t) if t.client_ca.is_some() => Ok(()),
            _ if self.allow_insecure_tcp => Ok(()),
            Some(_) => bad(format!(
                "refusing to serve gRPC on {sa} with TLS but no client authentication: anyone \
                 who reaches it could manage every volume; set grpc.tls.client_ca (mutual TLS), \
                 or grpc.allow_insecure_tcp = true to accept that"
            )),
            None if sa.ip().is_loopback() => bad(format!(
                "refusing to serve plaintext gRPC on {sa}: any local user could connect, \
                 bypassing the unix socket's group; configure grpc.tls with client_ca, or set \
                 grpc.allow_insecure_tcp = true to accept that"
            )),
            None => bad(format!(
                "refusing to serve gRPC on {sa} without TLS: configure grpc.tls with \
                 client_ca, or set grpc.allow_insecure_tcp = true"
            )),
        }
    }
}

impl Settings {
    fn check(&self) -> Result<(), ConfigError> {
        let bad = |m: String| Err(ConfigError::Invalid(m));
        if self.grpc.listen.is_empty() {
            return bad("grpc.listen is empty: ublkd would be unreachable".into());
        }
        if self.allowed_roots.iter().any(|r| !r.is_absolute()) {
            return bad("allowed_roots must be absolute paths".into());
        }
        if !self.ram_dir.is_absolute() {
            return bad(format!(
                "ram_dir {} is not absolute",
                self.ram_dir.display()
            ));
        }
        if !self.state_dir.is_absolute() {
            return bad(format!(
                "state_dir {} is not absolute",
                self.state_dir.display()
            ));
        }
        // A root holding ublkd's own state or RAM files would let a create name a registry
        // record or another volume's memory as its backing file (review L10, issue 55).
        let real = |p: &Path| std::fs::canonicalize(p).unwrap_or_else(|_| p.to_owned());
        for root in &self.allowed_roots {
            for (what, dir) in [("state_dir", &self.state_dir), ("ram_dir", &self.ram_dir)] {
                if dir.starts_with(root) || real(dir).starts_with(real(root)) {
                    return bad(format!(
                        "allowed_roots entry {} holds {what} {}: a volume could name ublkd's \
                         own files as its backing file",
                        root.display(),
                        dir.display()
                    ));
                }
            }
        }
        if ![512, 4096].contains(&self.defaults.block_size) {
            return bad("defaults.block_size must be 512 or 4096".into());
        }
        if self.defaults.queues == 0 || self.defaults.queue_depth == 0 {
            return bad("defaults.queues and defaults.queue_depth must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An allowed root may not hold the state or RAM directory (review L10, issue 55).
    #[test]
    fn a_root_holding_the_state_or_ram_directory_is_refused() {
        let with = |roots: &[&str]| Settings {
            allowed_roots: roots.iter().map(PathBuf::from).collect(),
            ..Settings::default()
        };
        assert!(with(&["/var/lib/ublkd/volumes"]).check().is_ok());
        for roots in [
            &["/var/lib"][..],
            &["/srv", "/var/lib/ublkd"],
            &["/dev/shm"],
            &["/"],
        ] {
            let e = with(roots).check().expect_err(&format!("{roots:?}"));
            assert!(e.to_string().contains("holds"), "{roots:?}: {e}");
        }
    }

    fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    /// Network listeners need mutual TLS; TLS without a client CA, and plaintext TCP even on
    /// loopback, only when the config says so (issue 22, item 12).
    #[test]
    fn tcp_listeners_need_client_authentication_unless_told_otherwise() {
        let tls = |ca: bool| TlsSettings {
            cert: "/c.pem".into(),
            key: "/k.pem".into(),
            client_ca: ca.then(|| "/ca.pem".into()),
        };
        let grpc = |t: Option<TlsSettings>, insecure: bool| GrpcSettings {
            tls: t,
            allow_insecure_tcp: insecure,
            ..GrpcSettings::default()
        };
        let net: std::net::SocketAddr = "0.0.0.0:7443".parse().unwrap();
        let lo: std::net::SocketAddr = "127.0.0.1:7443".parse().unwrap();
        let lo6: std::net::SocketAddr = "[::1]:7443".parse().unwrap();
        for sa in [net, lo, lo6] {
            assert!(
                grpc(Some(tls(true)), false).check_tcp(sa).is_ok(),
                "{sa} mTLS"
            );
            assert!(
                grpc(Some(tls(false)), true).check_tcp(sa).is_ok(),
                "{sa} told"
            );
            assert!(grpc(None, true).check_tcp(sa).is_ok(), "{sa} told");
        }
        let refused = |g: GrpcSettings, sa| match g.check_tcp(sa) {
            Err(ConfigError::Invalid(m)) => m,
            other => panic!("{sa}: {other:?}"),
        };
        assert!(refused(grpc(Some(tls(false)), false), net).contains("client_ca"));
        assert!(refused(grpc(None, false), net).contains("without TLS"));
        assert!(refused(grpc(None, false), lo).contains("plaintext"));
        assert!(refused(grpc(None, false), lo6).contains("plaintext"));
    }

    #[test]
    fn defaults_apply_without_file_env_or_flags() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("empty.toml");
        std::fs::write(&f, "").unwrap();
        let s = load(Some(&f), env(&[]), &[]).unwrap();
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn file_then_env_then_flags_each_override_the_last() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("ublkd.toml");
        std::fs::write(
            &f,
            r#"
state_dir = "/srv/ublkd"
allowed_roots = ["/srv/a", "/srv/b"]
[grpc]
listen = ["unix:///tmp/x.sock"]
[defaults]
queue_depth = 64
queues = 2
[limits]
max_volumes = 7
[dataplane]
queue_placement = "same-cpu"
"#,
        )
        .unwrap();
        let s = load(
            Some(&f),
            env(&[
                ("UBLKD_DEFAULTS__QUEUE_DEPTH", "32"),
                ("UBLKD_GRPC__LISTEN", "unix:///a.sock,127.0.0.1:7000"),
                ("UBLKD_LOG__FORMAT", "json"),
                ("UBLKD_TEST_FAULTS", "abort_at=create:after_record"),
                ("UBLKD_VM_RUN", "/x"),
                ("HOME", "/root"),
            ]),
            &[("limits.max_volumes", 9.into())],
        )
        .unwrap();
        assert_eq!(s.state_dir, PathBuf::from("/srv/ublkd"), "from the file");
        assert_eq!(s.allowed_roots.len(), 2);
        assert_eq!(s.defaults.queues, 2, "file value kept");
        assert_eq!(s.defaults.queue_depth, 32, "env beats file");
        assert_eq!(s.grpc.listen, vec!["unix:///a.sock", "127.0.0.1:7000"]);
        assert_eq!(s.log.format, LogFormat::Json);
        assert_eq!(s.limits.max_volumes, 9, "flag beats file");
        assert_eq!(
            s.dataplane.queue_placement,
            QueuePlacementSetting::SameCpu,
            "kebab-case names"
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("bad.toml");
        std::fs::write(&f, "no_such_key = 1\n").unwrap();
        assert!(load(Some(&f), env(&[]), &[]).is_err());
        std::fs::write(&f, "state_dir = \"relative\"\n").unwrap();
        assert!(load(Some(&f), env(&[]), &[]).is_err());
        assert!(load(Some(&dir.path().join("missing.toml")), env(&[]), &[]).is_err());
    }
}
