//! The command line: clap definitions, the value parsers behind them, and the conversion of a
//! parsed command into its `ublkd.v1` request. No I/O happens here, so all of it is unit-tested.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand, ValueEnum};
use clap_complete::Shell;
use ublkd_proto::notation::{parse_backend, parse_capacity_backend, parse_io_path, SIZE_HINT};
use ublkd_proto::units::parse_size;
pub use ublkd_proto::v1::get_capacity_request::Backend as CapacityBackend;
use ublkd_proto::v1::{
    volume_spec::Backend, AdoptDeviceRequest, CreateVolumeRequest, DeleteOrphanRequest, IoPath,
    ResizeVolumeRequest, Toggle, VolumeSpec,
};

use crate::error::Error;
use crate::profiles::{Profile, Profiles};
use crate::qos::{QosArgs, SetQos};
use crate::snapshot::{SnapshotCall, SourceArgs};
use ublkd_client::{Connection, Target, TlsFiles};

/// Where ublkd listens unless `--endpoint` or `UBLKCTL_ENDPOINT` says otherwise.
pub const DEFAULT_ENDPOINT: &str = "unix:///run/ublkd/ublkd.sock";

/// Where `--help` lists the options every command takes.
const GLOBAL: &str = "Global options";

const DEV_ID_HINT: &str = "expected a ublk device id, the N of /dev/ublkbN";

/// `--version`: the crate's version and the API it speaks.
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (API ublkd.v1)");

/// Exit codes, shown under `--help`.
const AFTER_HELP: &str = "Exit status: 0 success, 1 ublkd answered with an error, 2 usage error, \
                          3 ublkd cannot be reached (or TLS refused a certificate), 4 \
                          (node-info --ready) ublkd serves no volume.";

/// Manage the volumes of one ublkd node over its gRPC API.
#[derive(Debug, Parser)]
#[command(name = "ublkctl", version = VERSION, after_help = AFTER_HELP)]
pub struct Cli {
    /// Where ublkd listens: unix:///PATH, http://HOST:PORT or https://HOST:PORT
    /// [default: the --node profile's, else unix:///run/ublkd/ublkd.sock]
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        env = "UBLKCTL_ENDPOINT",
        value_parser = parse_target,
    )]
    pub endpoint: Option<Target>,

    /// A node named in ~/.config/ublkctl/config.toml (or UBLKCTL_CONFIG): its endpoint and
    /// TLS files, each overridden by its own flag
    #[arg(long, global = true, help_heading = GLOBAL, value_name = "NAME", env = "UBLKCTL_NODE")]
    pub node: Option<String>,

    /// CA certificate (PEM) that signed ublkd's certificate; https:// only
    #[arg(long, global = true, help_heading = GLOBAL, value_name = "FILE", env = "UBLKCTL_CA")]
    pub ca: Option<PathBuf>,

    /// Client certificate (PEM) for mutual TLS; needs --key
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        value_name = "FILE",
        env = "UBLKCTL_CERT",
        requires = "key"
    )]
    pub cert: Option<PathBuf>,

    /// Client private key (PEM) for mutual TLS; needs --cert
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        value_name = "FILE",
        env = "UBLKCTL_KEY",
        requires = "cert"
    )]
    pub key: Option<PathBuf>,

    /// Name to verify ublkd's certificate against, when it differs from the endpoint's host
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        value_name = "NAME",
        env = "UBLKCTL_TLS_DOMAIN"
    )]
    pub tls_domain: Option<String>,

    /// Seconds to wait for the connection and for each reply (the gRPC deadline)
    #[arg(
        long,
        global = true,
        help_heading = GLOBAL,
        value_name = "SECS",
        default_value_t = 30,
        value_parser = clap::value_parser!(u64).range(1..),
    )]
    pub timeout: u64,

    /// Output format of get-volume, list-volumes, create-volume, resize-volume, set-qos,
    /// node-info, orphans, adopt-device, stats, create-snapshot, list-snapshots
    #[arg(short, long, global = true, help_heading = GLOBAL, value_enum, default_value_t = Format::Text)]
    pub output: Format,

    /// Print tables (list-volumes, list-snapshots, orphans) without their header line
    #[arg(long, global = true, help_heading = GLOBAL)]
    pub no_headers: bool,

    #[command(subcommand)]
    pub command: Command,
}

/// How results are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Tables and aligned fields, sizes in binary units
    Text,
    /// JSON with the API's field names; sizes in bytes
    Json,
    /// The JSON form as YAML
    Yaml,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    #[command(flatten)]
    Call(Call),
    /// Print a shell completion script to stdout
    Completions {
        /// The shell to complete for
        shell: Shell,
    },
}

/// The commands that make one call to the daemon.
#[derive(Debug, Subcommand)]
pub enum Call {
    /// Create a volume and print its block device path (-o json: the whole volume)
    CreateVolume(Box<CreateVolume>),
    /// Delete a volume; its block device goes away, a backing file stays unless asked
    DeleteVolume {
        /// Volume id
        name: String,
        /// Succeed when no such volume exists
        #[arg(long)]
        allow_missing: bool,
        /// Remove a file volume's backing file too
        #[arg(long)]
        delete_backing: bool,
        /// Delete the device although a process holds it open (not a mount or an exclusive
        /// opener: those always refuse)
        #[arg(long)]
        force: bool,
    },
    /// Show one volume
    GetVolume {
        /// Volume id
        name: String,
    },
    /// List the node's volumes
    ListVolumes,
    /// Grow a volume (shrinking is refused) and show it
    ResizeVolume {
        /// Volume id
        name: String,
        /// New size: 20Gi or 20GiB (binary), 20G (decimal); rounded up to 4 KiB
        #[arg(long, value_parser = parse_volume_size)]
        size: u64,
    },
    /// Change a volume's I/O limits and show it; limits not named stay as they are
    ///
    /// A limit given as 0 or unlimited is removed; --clear removes them all first.
    SetQos(SetQos),
    #[command(flatten)]
    Snapshot(SnapshotCall),
    /// Show what the node offers: kernel, ublk features, workers, backends, orphan devices
    NodeInfo {
        /// Exit 4, saying why, when ublkd serves no volume (no usable ublk driver): the
        /// readiness probe of ublkd's pod
        #[arg(long)]
        ready: bool,
    },
    /// Show what the node can still provide for a backend: ram, file:/DIR or nvme:/dev/ngXnY
    Capacity {
        /// ram, file:/DIR (a directory under an allowed root) or nvme:/dev/ngXnY
        #[arg(value_parser = parse_capacity_backend)]
        backend: CapacityBackend,
    },
    /// Show the I/O counters of one volume
    Stats {
        /// Volume id
        name: String,
    },
    /// List orphan ublk devices: in the kernel, but owned by no volume of this node
    Orphans,
    /// Take over an orphan ublk device as a volume; print its block device path (-o json: the volume)
    ///
    /// The device stays, with its mounts and open files; the new volume serves its I/O from
    /// BACKEND. What is left out (size, queues, depth) is the device's.
    AdoptDevice(Box<AdoptDevice>),
    /// Delete an orphan ublk device; refused for devices of volumes
    DeleteOrphan {
        /// The orphan's ublk device id N (/dev/ublkbN)
        #[arg(value_name = "DEV_ID", value_parser = parse_dev_id)]
        dev_id: u32,
    },
}

/// Arguments of `create-volume`.
#[derive(Debug, Args)]
pub struct CreateVolume {
    /// Volume id: 1-63 of [a-z0-9-], starting and ending with a letter or digit
    pub name: String,

    /// Size: 10Gi or 10GiB (binary), 10G (decimal, as in Kubernetes); rounded up to 4 KiB
    #[arg(long, value_parser = parse_volume_size)]
    pub size: u64,

    #[command(flatten)]
    pub spec: SpecArgs,

    #[command(flatten)]
    pub source: SourceArgs,
}

/// Arguments of `adopt-device`. The server takes unset queues and depth from the device, not from
/// its defaults.
#[derive(Debug, Args)]
#[command(
    mut_arg("queues", |a| a.help("Hardware queues; must match the device's [default: the device's]")),
    mut_arg("depth", |a| a.help("Depth of each queue; must match the device's [default: the device's]")),
)]
pub struct AdoptDevice {
    /// The orphan's ublk device id N (/dev/ublkbN)
    #[arg(value_name = "DEV_ID", value_parser = parse_dev_id)]
    pub dev_id: u32,

    /// The new volume's id: 1-63 of [a-z0-9-], starting and ending with a letter or digit
    pub name: String,

    /// Size: 10Gi or 10GiB, 10G (decimal); rounded up to 4 KiB [default: the device's]
    #[arg(long, value_parser = parse_volume_size)]
    pub size: Option<u64>,

    #[command(flatten)]
    pub spec: SpecArgs,
}

/// The volume spec options `create-volume` and `adopt-device` share: all but the size, whose
/// rules differ (required, or optional with the device's as default).
#[derive(Debug, Args)]
pub struct SpecArgs {
    /// file:/PATH, file+create:/PATH (create or extend the file), ram, null,
    /// or nvme:/dev/ngXnY[@OFFSET+LEN] (a window of an NVMe namespace; @auto+LEN: ublkd
    /// places it in the first free extent)
    #[arg(long, value_parser = parse_backend)]
    pub backend: Backend,

    /// Hardware queues [default: the server's]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub queues: Option<u32>,

    /// Depth of each queue [default: the server's]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    pub depth: Option<u32>,

    /// Logical block size, 512 or 4096 [default: the server's, 4096]
    #[arg(long, value_name = "BYTES", value_parser = parse_block_size)]
    pub block_size: Option<u32>,

    /// I/O path: auto takes BATCH_IO when the kernel offers it
    #[arg(long, value_parser = parse_io_path, default_value = "auto")]
    pub io_path: IoPath,

    /// Zero copy (UBLK_F_AUTO_BUF_REG): auto turns it on when the kernel and backend allow
    #[arg(long, value_enum, default_value_t = ToggleArg::Auto)]
    pub zero_copy: ToggleArg,

    /// Poll for NVMe completions: auto turns it on when the controller has poll queues
    #[arg(long, value_enum, default_value_t = ToggleArg::Auto)]
    pub poll: ToggleArg,

    #[command(flatten)]
    pub qos: QosArgs,
}

/// `--zero-copy` and `--poll`, the command-line spelling of [`Toggle`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ToggleArg {
    Auto,
    On,
    Off,
}

impl From<ToggleArg> for Toggle {
    fn from(arg: ToggleArg) -> Self {
        match arg {
            ToggleArg::Auto => Toggle::Auto,
            ToggleArg::On => Toggle::On,
            ToggleArg::Off => Toggle::Off,
        }
    }
}

impl SpecArgs {
    /// The spec of `size_bytes` with these options; absent options stay unset, the API's
    /// "server default".
    pub fn to_spec(&self, size_bytes: u64) -> VolumeSpec {
        VolumeSpec {
            size_bytes,
            block_size: self.block_size,
            backend: Some(self.backend.clone()),
            queues: self.queues,
            queue_depth: self.depth,
            io_path: self.io_path.into(),
            zero_copy: Toggle::from(self.zero_copy).into(),
            poll: Toggle::from(self.poll).into(),
            qos: self.qos.to_limits(),
            source: None,
            // Made by hand: no claim, and a setting the node cannot take is refused, not
            // lowered.
            claim: None,
            fit_to_node: false,
        }
    }
}

impl CreateVolume {
    /// The request this command sends.
    pub fn to_request(&self) -> CreateVolumeRequest {
        let mut spec = self.spec.to_spec(self.size);
        spec.source = self.source.to_source();
        CreateVolumeRequest {
            id: self.name.clone(),
            spec: Some(spec),
        }
    }
}

impl AdoptDevice {
    /// The request this command sends; without `--size` the size is 0, which the server reads
    /// as "the device's".
    pub fn to_request(&self) -> AdoptDeviceRequest {
        AdoptDeviceRequest {
            dev_id: self.dev_id,
            id: self.name.clone(),
            spec: Some(self.spec.to_spec(self.size.unwrap_or(0))),
        }
    }
}

/// The request of `delete-orphan DEV_ID`.
pub fn delete_orphan_request(dev_id: u32) -> DeleteOrphanRequest {
    DeleteOrphanRequest { dev_id }
}

/// The request of `resize-volume NAME --size SIZE`.
pub fn resize_request(name: &str, size: u64) -> ResizeVolumeRequest {
    ResizeVolumeRequest {
        id: name.to_owned(),
        size_bytes: size,
    }
}

impl Cli {
    /// The connection settings, checked for combinations clap cannot see.
    pub fn connection(&self) -> Result<Connection, Error> {
        self.connection_with(|k| std::env::var(k).ok())
    }

    /// The connection settings, reading the profile file's location from `env`.
    pub fn connection_with(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Connection, Error> {
        let file = crate::profiles::path(env);
        let profiles = match &file {
            Some(f) if self.node.is_some() || self.endpoint.is_none() => Profiles::load(f)?,
            _ => Profiles::default(),
        };
        let profile = match &file {
            Some(f) => profiles.pick(self.node.as_deref(), self.endpoint.is_some(), f)?,
            None if self.node.is_some() => {
                return Err(Error::Usage(
                    "--node needs a profile file: set UBLKCTL_CONFIG, or HOME for \
                     ~/.config/ublkctl/config.toml"
                        .into(),
                ))
            }
            None => None,
        };
        let endpoint = match (&self.endpoint, profile) {
            (Some(e), _) => e.clone(),
            (None, Some(p)) => parse_target(&p.endpoint).map_err(|e| {
                Error::Usage(format!(
                    "node {:?}: endpoint {:?}: {e}",
                    self.node, p.endpoint
                ))
            })?,
            (None, None) => parse_target(DEFAULT_ENDPOINT).map_err(Error::Usage)?,
        };
        let from = |flag: &Option<PathBuf>, p: fn(&Profile) -> &Option<PathBuf>| {
            flag.clone()
                .or_else(|| profile.and_then(|pr| p(pr).clone()))
        };
        let tls = TlsFiles {
            ca: from(&self.ca, |p| &p.ca),
            cert: from(&self.cert, |p| &p.cert),
            key: from(&self.key, |p| &p.key),
            domain: self
                .tls_domain
                .clone()
                .or_else(|| profile.and_then(|p| p.tls_domain.clone())),
        };
        let is_https = matches!(endpoint, Target::Tcp { tls: true, .. });
        if !is_https && !tls.is_empty() {
            return Err(Error::Usage(format!(
                "--ca, --cert, --key and --tls-domain apply to https:// endpoints, not {endpoint}"
            )));
        }
        if is_https && tls.ca.is_none() {
            return Err(Error::Usage(
                "an https:// endpoint needs --ca FILE, the CA that signed ublkd's certificate"
                    .into(),
            ));
        }
        Ok(Connection {
            target: endpoint,
            tls,
            timeout: Duration::from_secs(self.timeout),
        })
    }
}

/// Reads `unix:///PATH` (or a bare absolute path), `http://HOST:PORT` or `https://HOST:PORT`.
pub fn parse_target(s: &str) -> Result<Target, String> {
    s.parse()
}

/// Reads a human size (`10Gi`, `10GiB`, `10G`, `512Ki`, `4096`).
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).ok_or_else(|| SIZE_HINT.to_owned())
}

/// Volume sizes are rounded up to this (a whole number of blocks of either block size), as
/// Kubernetes gives a claim at least what it asked for: `10G` is 10,000,003,072 bytes.
pub const SIZE_GRANULE: u64 = 4096;

/// A volume size: a human size above zero, rounded up to [`SIZE_GRANULE`].
pub fn parse_volume_size(s: &str) -> Result<u64, String> {
    match parse_size_arg(s)? {
        0 => Err("a volume needs a size above zero".into()),
        n => n
            .checked_next_multiple_of(SIZE_GRANULE)
            .ok_or_else(|| SIZE_HINT.to_owned()),
    }
}

/// A ublk device id: the N of `/dev/ublkbN`, a plain decimal number.
pub fn parse_dev_id(s: &str) -> Result<u32, String> {
    let s = s.trim();
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
        return Err(DEV_ID_HINT.to_owned());
    }
    s.parse()
        .map_err(|_| format!("{DEV_ID_HINT}; {s} is too large"))
}

/// `--block-size`: 512 or 4096, in any spelling `parse_size` reads, and `4K`/`4k`, which can
/// only mean 4096 here (4000 is no block size).
pub fn parse_block_size(s: &str) -> Result<u32, String> {
    if matches!(s.trim(), "4K" | "4k" | "4KB" | "4kB") {
        return Ok(4096);
    }
    match parse_size(s) {
        Some(512) => Ok(512),
        Some(4096) => Ok(4096),
        _ => Err("the block size is 512 or 4096".into()),
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use clap::CommandFactory;
    use ublkd_proto::notation::BACKEND_HINT;
    use ublkd_proto::v1::{FileBackend, NvmeBackend, RamBackend};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("ublkctl").chain(args.iter().copied()))
    }

    fn create_request(args: &[&str]) -> CreateVolumeRequest {
        let mut all = vec!["create-volume"];
        all.extend_from_slice(args);
        match parse(&all).unwrap().command {
            Command::Call(Call::CreateVolume(c)) => c.to_request(),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn command_definition_is_consistent() {
        Cli::command().debug_assert();
        assert!(VERSION.ends_with(&format!("(API {})", ublkd_proto::API_PACKAGE)));
    }

    #[test]
    fn create_volume_fills_the_spec() {
        let req = create_request(&[
            "vol-1",
            "--size",
            "10GiB",
            "--backend",
            "file+create:/var/lib/ublkd/vol-1.img",
            "--queues",
            "4",
            "--depth",
            "128",
            "--block-size",
            "512",
            "--io-path",
            "per-io",
        ]);
        assert_eq!(req.id, "vol-1");
        let spec = req.spec.unwrap();
        assert_eq!(spec.size_bytes, 10 << 30);
        assert_eq!(spec.block_size, Some(512));
        assert_eq!(spec.queues, Some(4));
        assert_eq!(spec.queue_depth, Some(128));
        assert_eq!(spec.io_path(), IoPath::PerIo);
        assert_eq!(
            spec.backend,
            Some(Backend::File(FileBackend {
                path: "/var/lib/ublkd/vol-1.img".into(),
                create: true,
            }))
        );
    }

    #[test]
    fn create_volume_leaves_defaults_to_the_server() {
        let spec = create_request(&["v", "--size", "1G", "--backend", "ram"])
            .spec
            .unwrap();
        assert_eq!(
            (spec.block_size, spec.queues, spec.queue_depth),
            (None, None, None)
        );
        assert_eq!(spec.io_path(), IoPath::Auto);
        assert_eq!(spec.backend, Some(Backend::Ram(RamBackend {})));
    }

    fn adopt_request(args: &[&str]) -> Result<AdoptDeviceRequest, clap::Error> {
        let mut all = vec!["adopt-device"];
        all.extend_from_slice(args);
        match parse(&all)?.command {
            Command::Call(Call::AdoptDevice(a)) => Ok(a.to_request()),
            other => panic!("parsed as {other:?}"),
        }
    }

    #[test]
    fn create_volume_needs_a_size_and_a_backend() {
        let err = parse(&["create-volume", "v", "--backend", "ram"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(err.to_string().contains("--size"), "{err}");
        let err = parse(&["create-volume", "v", "--size", "1G"]).unwrap_err();
        assert!(err.to_string().contains("--backend"), "{err}");
    }

    #[test]
    fn adopt_device_fills_the_spec_like_create_volume() {
        let req = adopt_request(&[
            "3",
            "vol-1",
            "--backend",
            "nvme:/dev/ng0n1@1GiB+10GiB",
            "--size",
            "10GiB",
            "--queues",
            "4",
            "--depth",
            "128",
            "--block-size",
            "512",
            "--io-path",
            "batch",
        ])
        .unwrap();
        assert_eq!((req.dev_id, req.id.as_str()), (3, "vol-1"));
        let spec = req.spec.unwrap();
        assert_eq!(spec.size_bytes, 10 << 30);
        assert_eq!(spec.block_size, Some(512));
        assert_eq!((spec.queues, spec.queue_depth), (Some(4), Some(128)));
        assert_eq!(spec.io_path(), IoPath::Batch);
        assert_eq!(
            spec.backend,
            Some(Backend::Nvme(NvmeBackend {
                device: "/dev/ng0n1".into(),
                offset_bytes: Some(1 << 30),
                length_bytes: 10 << 30,
                keep_data: false,
                identity: String::new(),
            }))
        );
    }

    #[test]
    fn adopt_device_leaves_the_size_to_the_device() {
        let spec = adopt_request(&["12", "v", "--backend", "file:/srv/v.img"])
            .unwrap()
            .spec
            .unwrap();
        assert_eq!(spec.size_bytes, 0, "0: the device's size");
        assert_eq!(
            (spec.block_size, spec.queues, spec.queue_depth),
            (None, None, None)
        );
        assert_eq!(spec.io_path(), IoPath::Auto);
    }

    #[test]
    fn adopt_device_checks_its_arguments() {
        let err = adopt_request(&["3", "v"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::MissingRequiredArgument);
        assert!(err.to_string().contains("--backend"), "{err}");

        let err = adopt_request(&["3", "v", "--backend", "disk"]).unwrap_err();
        assert!(err.to_string().contains(BACKEND_HINT), "{err}");

        let err = adopt_request(&["3", "v", "--backend", "ram", "--size", "0"]).unwrap_err();
        assert!(err.to_string().contains("above zero"), "{err}");

        let err = adopt_request(&["ublkb3", "v", "--backend", "ram"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains(DEV_ID_HINT), "{err}");
    }

    #[test]
    fn delete_orphan_takes_a_dev_id() {
        let cli = parse(&["delete-orphan", "7"]).unwrap();
        let Command::Call(Call::DeleteOrphan { dev_id }) = cli.command else {
            panic!("parsed as {:?}", cli.command)
        };
        assert_eq!(delete_orphan_request(dev_id).dev_id, 7);
        assert!(parse(&["delete-orphan"]).is_err());
        assert!(parse(&["delete-orphan", "-1"]).is_err());
    }

    #[test]
    fn dev_ids_parse() {
        assert_eq!(parse_dev_id("0"), Ok(0));
        assert_eq!(parse_dev_id(" 42 "), Ok(42));
        assert_eq!(parse_dev_id(""), Err(DEV_ID_HINT.to_owned()));
        assert_eq!(parse_dev_id("+1"), Err(DEV_ID_HINT.to_owned()));
        assert_eq!(parse_dev_id("/dev/ublkb1"), Err(DEV_ID_HINT.to_owned()));
        assert!(parse_dev_id("4294967296")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn orphans_takes_no_arguments() {
        let cli = parse(&["orphans", "-o", "json"]).unwrap();
        assert!(matches!(cli.command, Command::Call(Call::Orphans)));
        assert_eq!(cli.output, Format::Json);
        assert!(parse(&["orphans", "3"]).is_err());
    }

    #[test]
    fn bad_sizes_are_usage_errors_that_say_why() {
        let err = parse(&["create-volume", "v", "--size", "10XB", "--backend", "ram"]).unwrap_err();
        assert_eq!(err.kind(), clap::error::ErrorKind::ValueValidation);
        assert_eq!(err.exit_code(), 2);
        let text = err.to_string();
        assert!(text.contains("10XB") && text.contains(SIZE_HINT), "{text}");

        let err = parse(&["resize-volume", "v", "--size", "0"]).unwrap_err();
        assert!(err.to_string().contains("above zero"), "{err}");

        let err = parse(&[
            "create-volume",
            "v",
            "--size",
            "1G",
            "--backend",
            "ram",
            "--block-size",
            "1024",
        ])
        .unwrap_err();
        assert!(err.to_string().contains("512 or 4096"), "{err}");
    }

    #[test]
    fn block_size_accepts_binary_units() {
        assert_eq!(parse_block_size("4K"), Ok(4096));
        assert_eq!(parse_block_size("4Ki"), Ok(4096));
        assert_eq!(parse_block_size("512"), Ok(512));
        assert!(parse_block_size("4000").is_err());
    }

    #[test]
    fn volume_sizes_read_as_kubernetes_quantities_rounded_up_to_blocks() {
        let size = |s: &str| {
            create_request(&["v", "--size", s, "--backend", "ram"])
                .spec
                .unwrap()
                .size_bytes
        };
        assert_eq!(size("10Gi"), 10 << 30);
        assert_eq!(size("10GiB"), 10 << 30);
        assert_eq!(size("10G"), 10_000_003_072, "10^10 rounded up to 4 KiB");
        assert_eq!(size("4096"), 4096);
        assert_eq!(size("1"), 4096);
        let err = parse(&["create-volume", "v", "--size", "10m", "--backend", "ram"]).unwrap_err();
        assert!(err.to_string().contains(SIZE_HINT), "{err}");
    }

    #[test]
    fn resize_carries_the_new_size() {
        let cli = parse(&["resize-volume", "v", "--size", "20GiB"]).unwrap();
        let Command::Call(Call::ResizeVolume { name, size }) = cli.command else {
            panic!("parsed as {:?}", cli.command)
        };
        assert_eq!(resize_request(&name, size).size_bytes, 20 << 30);
    }

    #[test]
    fn endpoints_parse() {
        assert_eq!(
            parse_target(DEFAULT_ENDPOINT),
            Ok(Target::Unix("/run/ublkd/ublkd.sock".into()))
        );
        assert_eq!(
            parse_target("/tmp/u.sock"),
            Ok(Target::Unix("/tmp/u.sock".into()))
        );
        assert_eq!(
            parse_target("https://node-1:7443"),
            Ok(Target::Tcp {
                uri: "https://node-1:7443".into(),
                tls: true
            })
        );
        assert_eq!(
            parse_target("http://[::1]:50051"),
            Ok(Target::Tcp {
                uri: "http://[::1]:50051".into(),
                tls: false
            })
        );
        assert!(parse_target("unix://relative.sock").is_err());
        assert!(parse_target("ftp://x").is_err());
        assert!(parse_target("http://").is_err());
    }

    #[test]
    fn global_options_go_before_or_after_the_command() {
        let cli = parse(&["list-volumes", "-o", "json", "--timeout", "5"]).unwrap();
        assert_eq!((cli.output, cli.timeout), (Format::Json, 5));
        let cli = parse(&["--endpoint", "http://h:1", "node-info"]).unwrap();
        assert_eq!(
            cli.endpoint.map(|e| e.to_string()).as_deref(),
            Some("http://h:1")
        );
    }

    #[test]
    fn nodes_come_from_profiles_and_flags_override_them() {
        let dir = std::env::temp_dir().join(format!("ublkctl-profiles-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("config.toml");
        std::fs::write(
            &file,
            "default = \"local\"\n[nodes.n1]\nendpoint = \"https://n1:7443\"\nca = \"/c/ca.pem\"\n\
             cert = \"/c/me.pem\"\nkey = \"/c/me.key\"\n[nodes.local]\nendpoint = \"unix:///l.sock\"\n",
        )
        .unwrap();
        let f = file.display().to_string();
        let env = |k: &str| (k == "UBLKCTL_CONFIG").then(|| f.clone());
        let conn = parse(&["--node", "n1", "list-volumes"])
            .unwrap()
            .connection_with(env)
            .unwrap();
        assert_eq!(conn.target.to_string(), "https://n1:7443");
        assert_eq!(
            conn.tls.ca.as_deref(),
            Some(std::path::Path::new("/c/ca.pem"))
        );
        assert_eq!(
            conn.tls.key.as_deref(),
            Some(std::path::Path::new("/c/me.key"))
        );
        let conn = parse(&["--node", "n1", "--ca", "/other.pem", "list-volumes"])
            .unwrap()
            .connection_with(env)
            .unwrap();
        assert_eq!(
            conn.tls.ca.as_deref(),
            Some(std::path::Path::new("/other.pem")),
            "the flag wins"
        );
        let conn = parse(&["list-volumes"])
            .unwrap()
            .connection_with(env)
            .unwrap();
        assert_eq!(
            conn.target.to_string(),
            "unix:///l.sock",
            "the default node"
        );
        let conn = parse(&["--endpoint", "unix:///e.sock", "list-volumes"])
            .unwrap()
            .connection_with(env)
            .unwrap();
        assert_eq!(
            conn.target.to_string(),
            "unix:///e.sock",
            "--endpoint over the default"
        );
        let err = parse(&["--node", "n9", "list-volumes"])
            .unwrap()
            .connection_with(env)
            .unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("no node \"n9\""), "{err}");
        // No profile file at all: the built-in default, and --node is a usage error.
        let none = |_: &str| None;
        let conn = parse(&["list-volumes"])
            .unwrap()
            .connection_with(none)
            .unwrap();
        assert_eq!(conn.target.to_string(), DEFAULT_ENDPOINT);
        assert!(parse(&["--node", "n1", "list-volumes"])
            .unwrap()
            .connection_with(none)
            .is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn tls_options_need_https_and_https_needs_a_ca() {
        let err = parse(&["--ca", "/ca.pem", "list-volumes"])
            .unwrap()
            .connection()
            .unwrap_err();
        assert_eq!(err.exit_code(), 2);
        assert!(err.to_string().contains("https://"), "{err}");

        let err = parse(&["--endpoint", "https://h:1", "list-volumes"])
            .unwrap()
            .connection()
            .unwrap_err();
        assert!(err.to_string().contains("--ca"), "{err}");

        let conn = parse(&[
            "--endpoint",
            "https://h:1",
            "--ca",
            "/ca.pem",
            "--timeout",
            "3",
            "node-info",
        ])
        .unwrap()
        .connection()
        .unwrap();
        assert_eq!(conn.timeout, Duration::from_secs(3));

        assert!(
            parse(&["--cert", "/c.pem", "node-info"]).is_err(),
            "--cert needs --key"
        );
    }
}
