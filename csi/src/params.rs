//! StorageClass parameters: what backend a volume gets and how its queues are shaped.
//!
//! | key | values | default |
//! |---|---|---|
//! | `backend` | `file`, `ram`, `nvme` | required |
//! | `root` | (file) a directory under one of ublkd's allowed roots | required for file |
//! | `namespace` | (nvme) the namespace's char device, `/dev/ngXnY`, or its identity (`eui.…`, `nguid.…`) | required for nvme |
//! | `queues`, `queueDepth` | numbers | ublkd's defaults |
//! | `blockSize` | `512`, `4096` | `4096` |
//! | `ioPath` | `auto`, `batch`, `per-io` (`per_io` is read too) | `auto` |
//! | `zeroCopy`, `poll` | `auto`, `on`, `off` | `auto` (poll: only on CPUs dedicated to ublkd's workers) |
//! | `fsType` | `ext4`, `xfs` | `ext4` (a capability's own fs_type wins) |
//! | `encryption` | `luks2`, `none`: LUKS2 on the node, keyed by the node-stage Secret (`crypt`) | `none` |
//! | `readIops`, `writeIops` | I/Os per second (`qos`) | unlimited |
//! | `readBandwidth`, `writeBandwidth` | bytes per second: `200Mi`, `200MiB/s` (`qos`) | unlimited |
//! | `qosBurst` | `100ms`, `2s`, at most `60s` (`qos`) | 100 ms |
//!
//! Keys under `csi.storage.k8s.io/` belong to the sidecars and are ignored; any other unknown
//! key is refused, so a typo never silently gives a default volume. The I/O limits can change
//! later through a VolumeAttributesClass (`qos`, ControllerModifyVolume).

use crate::error::CsiError;
use crate::qos::{self, QosChange};
use std::collections::HashMap;
use ublkd_client::v1;
use ublkd_proto::notation;

/// The file systems the driver makes and grows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FsType {
    Ext4,
    Xfs,
}

impl FsType {
    pub fn parse(s: &str) -> Result<Self, CsiError> {
        match s {
            "" | "ext4" => Ok(FsType::Ext4),
            "xfs" => Ok(FsType::Xfs),
            other => Err(CsiError::UnsupportedCapability(format!(
                "file system {other:?} (ext4 or xfs)"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            FsType::Ext4 => "ext4",
            FsType::Xfs => "xfs",
        }
    }

    /// The smallest device `mkfs` makes this file system on: mkfs.xfs refuses one under
    /// 300 MiB ("Filesystem must be larger than 300MB"); ext4 has no floor that matters here.
    pub fn min_bytes(self) -> u64 {
        match self {
            FsType::Ext4 => 0,
            FsType::Xfs => 300 << 20,
        }
    }
}

/// The StorageClass parameter of [`Encryption`], kept in the volume context for the node.
pub const ENCRYPTION: &str = "encryption";

/// Whether a volume's bytes are encrypted on the node.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Encryption {
    #[default]
    None,
    Luks2,
}

impl Encryption {
    pub fn parse(v: &str) -> Result<Self, CsiError> {
        match v {
            "" | "none" => Ok(Encryption::None),
            "luks2" => Ok(Encryption::Luks2),
            other => Err(CsiError::BadParameter(format!(
                "parameter {ENCRYPTION}={other:?}: expected luks2 or none"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Encryption::None => "none",
            Encryption::Luks2 => "luks2",
        }
    }

    /// What CreateVolume put in the volume context (none where it says nothing).
    pub fn of_context(context: &HashMap<String, String>) -> Result<Self, CsiError> {
        Encryption::parse(context.get(ENCRYPTION).map_or("", String::as_str))
    }
}

/// Where a volume's bytes live.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Backend {
    /// A backing file `<root>/<volume id>.img`, made by ublkd.
    File {
        root: String,
    },
    Ram,
    /// A window of the namespace, placed in its first free extent that fits.
    Nvme {
        namespace: String,
    },
}

impl Backend {
    pub fn kind(&self) -> ublkd_proto::BackendKind {
        use ublkd_proto::BackendKind as K;
        match self {
            Backend::File { .. } => K::File,
            Backend::Ram => K::Ram,
            Backend::Nvme { .. } => K::Nvme,
        }
    }

    /// Where its pool is, as the node report shows it: the root, the namespace, or nothing.
    pub fn place(&self) -> &str {
        match self {
            Backend::File { root } => root,
            Backend::Ram => "",
            Backend::Nvme { namespace } => namespace,
        }
    }

    /// Whether a volume of `size` bytes fits what GetCapacity answered: a window needs one free
    /// extent that holds it; a file or RAM volume, the bytes.
    pub fn fits(&self, cap: &v1::Capacity, size: u64) -> bool {
        match self {
            Backend::Nvme { .. } => cap.free_extents.iter().any(|e| e.length_bytes >= size),
            Backend::File { .. } | Backend::Ram => cap.available_bytes >= size,
        }
    }
}

/// A StorageClass's parameters, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Params {
    pub backend: Backend,
    pub queues: Option<u32>,
    pub queue_depth: Option<u32>,
    pub block_size: u32,
    pub io_path: v1::IoPath,
    pub zero_copy: v1::Toggle,
    pub poll: v1::Toggle,
    pub fs_type: FsType,
    /// LUKS2 on the node (`crypt`), or none.
    pub encryption: Encryption,
    /// The I/O limits a new volume starts with.
    pub qos: v1::QosLimits,
    /// The claim the provisioner made the volume for (`--extra-create-metadata`), if it said.
    pub claim: Option<v1::Claim>,
}

/// The claim in the provisioner's extra create metadata (`csi.storage.k8s.io/pvc/namespace`,
/// `.../pvc/name`, `.../pv/name`), when it sent any.
fn claim(map: &HashMap<String, String>) -> Option<v1::Claim> {
    let get = |k: &str| map.get(k).map(String::as_str);
    let c = v1::Claim {
        namespace: get("csi.storage.k8s.io/pvc/namespace")
            .unwrap_or_default()
            .to_owned(),
        name: get("csi.storage.k8s.io/pvc/name")
            .unwrap_or_default()
            .to_owned(),
        persistent_volume: get("csi.storage.k8s.io/pv/name")
            .unwrap_or_default()
            .to_owned(),
    };
    (c != v1::Claim::default()).then_some(c)
}

fn toggle(key: &str, v: &str) -> Result<v1::Toggle, CsiError> {
    match v {
        "auto" => Ok(v1::Toggle::Auto),
        "on" => Ok(v1::Toggle::On),
        "off" => Ok(v1::Toggle::Off),
        _ => Err(bad(key, v, "auto, on or off")),
    }
}

fn bad(key: &str, v: &str, want: &str) -> CsiError {
    CsiError::BadParameter(format!("parameter {key}={v:?}: expected {want}"))
}

/// A StorageClass's own keys (the I/O limits are `qos::KEYS`): deploy/csi/README.md's table
/// lists exactly these and those (a test reads it).
pub const KEYS: [&str; 11] = [
    "backend",
    "root",
    "namespace",
    "queues",
    "queueDepth",
    "blockSize",
    "ioPath",
    "zeroCopy",
    "poll",
    "fsType",
    "encryption",
];

fn number(key: &str, v: &str) -> Result<u32, CsiError> {
    v.parse::<u32>()
        .ok()
        .filter(|&n| n > 0)
        .ok_or_else(|| bad(key, v, "a positive number"))
}

impl Params {
    pub fn parse(map: &HashMap<String, String>) -> Result<Self, CsiError> {
        let get = |k: &str| map.get(k).map(String::as_str);
        for key in map.keys() {
            let known = KEYS.contains(&key.as_str()) || qos::KEYS.contains(&key.as_str());
            if !known && !qos::is_sidecar_key(key) {
                return Err(CsiError::BadParameter(format!(
                    "unknown parameter {key:?} ({}, {})",
                    KEYS.join(", "),
                    qos::KEYS.join(", ")
                )));
            }
        }
        use ublkd_proto::BackendKind as K;
        let backend = match get("backend").map(|b| (b, K::named(b))) {
            None => return Err(CsiError::MissingField("parameter backend")),
            Some((_, Some(K::File))) => Backend::File {
                root: get("root")
                    .filter(|r| r.starts_with('/'))
                    .ok_or(CsiError::MissingField(
                        "parameter root (an absolute directory) for backend file",
                    ))?
                    .to_owned(),
            },
            Some((_, Some(K::Ram))) => Backend::Ram,
            Some((_, Some(K::Nvme))) => Backend::Nvme {
                namespace: get("namespace")
                    .filter(|n| n.starts_with("/dev/") || ublkd_proto::notation::is_identity(n))
                    .ok_or(CsiError::MissingField(
                        "parameter namespace (/dev/ngXnY, or eui.HEX, nguid.HEX) for backend nvme",
                    ))?
                    .to_owned(),
            },
            // Null has no pool: a StorageClass of it would promise capacity it has not.
            Some((other, None | Some(K::Null))) => {
                return Err(bad("backend", other, &K::pool_names()))
            }
        };
        let block_size = match get("blockSize") {
            None | Some("4096") => 4096,
            Some("512") => 512,
            Some(other) => return Err(bad("blockSize", other, "512 or 4096")),
        };
        let io_path = match get("ioPath") {
            None => v1::IoPath::Auto,
            Some(p) => {
                notation::parse_io_path(p).map_err(|_| bad("ioPath", p, "auto, batch or per-io"))?
            }
        };
        Ok(Params {
            backend,
            queues: get("queues").map(|v| number("queues", v)).transpose()?,
            queue_depth: get("queueDepth")
                .map(|v| number("queueDepth", v))
                .transpose()?,
            block_size,
            io_path,
            zero_copy: get("zeroCopy")
                .map(|v| toggle("zeroCopy", v))
                .transpose()?
                .unwrap_or(v1::Toggle::Auto),
            poll: get("poll")
                .map(|v| toggle("poll", v))
                .transpose()?
                .unwrap_or(v1::Toggle::Auto),
            fs_type: FsType::parse(get("fsType").unwrap_or("ext4"))
                .map_err(|_| bad("fsType", get("fsType").unwrap_or(""), "ext4 or xfs"))?,
            encryption: Encryption::parse(get(ENCRYPTION).unwrap_or(""))?,
            qos: QosChange::from_params(map)?.apply(&v1::QosLimits::default()),
            claim: claim(map),
        })
    }

    /// What ublkd's GetCapacity is asked about for these parameters.
    pub fn capacity_backend(&self) -> v1::get_capacity_request::Backend {
        use v1::get_capacity_request::Backend as B;
        match &self.backend {
            Backend::File { root } => B::File(v1::FileCapacity { root: root.clone() }),
            Backend::Ram => B::Ram(v1::RamBackend {}),
            Backend::Nvme { namespace } => B::Nvme(v1::NvmeCapacity {
                device: namespace.clone(),
            }),
        }
    }

    /// The ublkd spec of volume `id` of `size` bytes. An NVMe window is placed by ublkd, under
    /// its own lock, so two creates in parallel never pick the same extent. Its limits are
    /// these parameters' (the caller puts a class's over them) and it has no source.
    pub fn spec(&self, id: &str, size: u64) -> v1::VolumeSpec {
        use v1::volume_spec::Backend as B;
        let backend = match &self.backend {
            Backend::File { root } => B::File(v1::FileBackend {
                path: format!("{}/{id}.img", root.trim_end_matches('/')),
                create: true,
            }),
            Backend::Ram => B::Ram(v1::RamBackend {}),
            // Named by its identity: ublkd finds the namespace's device on the node.
            Backend::Nvme { namespace } if ublkd_proto::notation::is_identity(namespace) => {
                B::Nvme(v1::NvmeBackend {
                    device: String::new(),
                    offset_bytes: None,
                    length_bytes: size,
                    keep_data: false,
                    identity: namespace.clone(),
                })
            }
            Backend::Nvme { namespace } => B::Nvme(v1::NvmeBackend {
                device: namespace.clone(),
                offset_bytes: None,
                length_bytes: size,
                keep_data: false,
                identity: String::new(),
            }),
        };
        v1::VolumeSpec {
            size_bytes: size,
            block_size: Some(self.block_size),
            queues: self.queues,
            queue_depth: self.queue_depth,
            io_path: self.io_path as i32,
            zero_copy: self.zero_copy as i32,
            poll: self.poll as i32,
            backend: Some(backend),
            qos: qos::spec_limits(self.qos),
            source: None,
            claim: self.claim.clone(),
            // One class serves nodes of every size: queues or a depth above this node's limits
            // are lowered to them (and said in the Volume), not refused on this node alone.
            fit_to_node: true,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file of the repository, read from this crate's directory.
    fn repo_file(path: &str) -> String {
        let at = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("..")
            .join(path);
        std::fs::read_to_string(&at).unwrap_or_else(|e| panic!("{}: {e}", at.display()))
    }

    /// The backticked words of the first column of the table under `heading`.
    fn table_keys(doc: &str, heading: &str) -> Vec<String> {
        let at = doc.find(heading).unwrap_or_else(|| panic!("no {heading}"));
        doc[at..]
            .lines()
            .skip_while(|l| !l.starts_with('|'))
            .take_while(|l| l.starts_with('|'))
            .skip(2)
            .flat_map(|l| {
                let first = l.split('|').nth(1).unwrap_or_default();
                first
                    .split('`')
                    .skip(1)
                    .step_by(2)
                    .map(str::to_owned)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// The parameter table of deploy/csi/README.md lists exactly the keys the parser knows,
    /// and its backend row, like the chart's schema, exactly the kinds with a pool.
    #[test]
    fn the_docs_and_the_charts_schema_agree_with_the_parser() {
        let readme = repo_file("deploy/csi/README.md");
        let mut documented = table_keys(&readme, "## StorageClass parameters");
        let mut known: Vec<String> = KEYS
            .iter()
            .chain(&qos::KEYS)
            .map(|k| k.to_string())
            .collect();
        documented.sort();
        known.sort();
        assert_eq!(documented, known, "deploy/csi/README.md's parameter table");
        let mut pools: Vec<String> = ublkd_proto::BackendKind::ALL
            .iter()
            .filter(|k| k.has_pool())
            .map(|k| k.name().to_owned())
            .collect();
        pools.sort();
        let row = readme
            .lines()
            .find(|l| l.starts_with("| `backend` |"))
            .expect("a backend row");
        let mut named: Vec<String> = row
            .split('|')
            .nth(2)
            .unwrap_or_default()
            .split('`')
            .skip(1)
            .step_by(2)
            .map(str::to_owned)
            .collect();
        named.sort();
        assert_eq!(named, pools, "the README's backend row");
        let schema: serde_json::Value =
            serde_json::from_str(&repo_file("deploy/helm/ublkd/values.schema.json")).unwrap();
        let classes = &schema["properties"]["storageClasses"]["items"]["properties"];
        let mut offered: Vec<String> = classes["backend"]["enum"]
            .as_array()
            .expect("the schema's backend enum")
            .iter()
            .map(|v| v.as_str().unwrap_or_default().to_owned())
            .collect();
        offered.sort();
        assert_eq!(offered, pools, "values.schema.json's backend enum");
        for kind in ublkd_proto::BackendKind::ALL {
            let map = HashMap::from([
                ("backend".to_owned(), kind.name().to_owned()),
                ("root".to_owned(), "/srv".to_owned()),
                ("namespace".to_owned(), "/dev/ng0n1".to_owned()),
            ]);
            let parsed = Params::parse(&map);
            assert_eq!(parsed.is_ok(), kind.has_pool(), "{kind}: {parsed:?}");
            if let Ok(p) = parsed {
                assert_eq!(p.backend.kind(), kind);
            }
        }
    }

    #[test]
    fn the_parameter_reads_luks2_or_none_and_nothing_else() {
        assert_eq!(Encryption::parse("luks2").unwrap(), Encryption::Luks2);
        assert_eq!(Encryption::parse("").unwrap(), Encryption::None);
        assert_eq!(Encryption::parse("none").unwrap(), Encryption::None);
        let e = Encryption::parse("LUKS").unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        let ctx = HashMap::from([(ENCRYPTION.to_owned(), "luks2".to_owned())]);
        assert_eq!(Encryption::of_context(&ctx).unwrap(), Encryption::Luks2);
        assert_eq!(
            Encryption::of_context(&HashMap::new()).unwrap(),
            Encryption::None
        );
    }

    fn params(kv: &[(&str, &str)]) -> Result<Params, CsiError> {
        Params::parse(
            &kv.iter()
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect(),
        )
    }

    #[test]
    fn storage_class_parameters_are_read_and_checked() {
        let p = params(&[
            ("backend", "file"),
            ("root", "/srv/ublkd"),
            ("queues", "2"),
            ("zeroCopy", "on"),
            ("fsType", "xfs"),
            ("readIops", "5000"),
            ("writeBandwidth", "200MiB/s"),
            ("csi.storage.k8s.io/pv/name", "pv-1"),
        ])
        .unwrap();
        assert_eq!(
            p.backend,
            Backend::File {
                root: "/srv/ublkd".into()
            }
        );
        assert_eq!(
            (p.queues, p.zero_copy, p.fs_type),
            (Some(2), v1::Toggle::On, FsType::Xfs)
        );
        let spec = p.spec("pvc-1", 1 << 30);
        assert!(matches!(
            spec.backend,
            Some(v1::volume_spec::Backend::File(ref f)) if f.path == "/srv/ublkd/pvc-1.img" && f.create
        ));
        assert_eq!(
            spec.qos,
            Some(v1::QosLimits {
                read_iops: 5000,
                write_bytes_per_second: 200 << 20,
                ..Default::default()
            })
        );
        // The provisioner's extra create metadata names the claim; without it, none.
        assert_eq!(
            spec.claim,
            Some(v1::Claim {
                persistent_volume: "pv-1".into(),
                ..Default::default()
            })
        );
        let full = params(&[
            ("backend", "ram"),
            ("csi.storage.k8s.io/pvc/name", "data-db-0"),
            ("csi.storage.k8s.io/pvc/namespace", "shop"),
            ("csi.storage.k8s.io/pv/name", "pvc-1234"),
        ])
        .unwrap();
        assert_eq!(
            full.spec("pvc-1234", 4096).claim,
            Some(v1::Claim {
                namespace: "shop".into(),
                name: "data-db-0".into(),
                persistent_volume: "pvc-1234".into(),
            })
        );
        let ram = params(&[("backend", "ram")]).unwrap();
        assert_eq!(ram.spec("r", 4096).claim, None);
        assert!(
            ram.spec("r", 4096).fit_to_node,
            "a class never refuses a node for its size"
        );
        assert_eq!(ram.block_size, 4096);
        // ublkctl's spelling, and the one this table first documented.
        for p in ["per-io", "per_io"] {
            let got = params(&[("backend", "ram"), ("ioPath", p)]).unwrap();
            assert_eq!(got.io_path, v1::IoPath::PerIo, "{p}");
        }
        assert_eq!(ram.spec("r", 4096).qos, None, "no limits unless asked");
        // A namespace by path, or by identity (the same drive whatever name a boot gives it).
        for (ns, device, identity) in [
            ("/dev/ng1n1", "/dev/ng1n1", ""),
            ("eui.0011223344556677", "", "eui.0011223344556677"),
        ] {
            let got = params(&[("backend", "nvme"), ("namespace", ns)]).unwrap();
            match got.spec("n", 1 << 20).backend {
                Some(v1::volume_spec::Backend::Nvme(n)) => {
                    assert_eq!((n.device.as_str(), n.identity.as_str()), (device, identity));
                }
                other => panic!("{ns}: {other:?}"),
            }
        }
        assert!(params(&[("backend", "nvme"), ("namespace", "ng1n1")]).is_err());
        for bad in [
            &[][..],
            &[("backend", "disk")],
            &[("backend", "file")],
            &[("backend", "file"), ("root", "relative")],
            &[("backend", "nvme")],
            &[("backend", "ram"), ("blockSize", "1024")],
            &[("backend", "ram"), ("queues", "0")],
            &[("backend", "ram"), ("poll", "yes")],
            &[("backend", "ram"), ("ioPath", "perio")],
            &[("backend", "ram"), ("fsType", "btrfs")],
            &[("backend", "ram"), ("queue_depth", "8")],
            &[("backend", "ram"), ("readIops", "many")],
            &[("backend", "ram"), ("readiops", "10")],
        ] {
            let e = params(bad).expect_err(&format!("{bad:?}"));
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{bad:?}: {e}");
        }
    }
}
