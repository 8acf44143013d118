//! The one notation for a volume's backend and I/O path, wherever a person writes or reads one:
//! `ublkctl --backend`, `--io-path` and `capacity`, `ublkd run --backend` and `--io-path`, the
//! StorageClass's `ioPath`, and what `ublkctl` prints (a listed backend can be pasted back).
//!
//! Backends: `null`, `ram`, `file:/PATH`, `file+create:/PATH`, `nvme:/dev/ngXnY`,
//! `nvme:/dev/ngXnY@OFFSET` (to the end), `nvme:/dev/ngXnY@OFFSET+LEN` or
//! `nvme:/dev/ngXnY@auto+LEN` (placed by ublkd). I/O paths: `auto`, `batch`, `per-io`
//! (`per_io` is read too, as the StorageClass parameter was first documented).

use crate::backend::BackendKind;
use crate::units::{compact_size, parse_size};
use crate::v1::get_capacity_request::Backend as CapacityBackend;
use crate::v1::volume_spec::Backend;
use crate::v1::{
    FileBackend, FileCapacity, IoPath, NullBackend, NvmeBackend, NvmeCapacity, RamBackend,
};

/// What a bad `--backend` is told.
pub const BACKEND_HINT: &str =
    "expected file:/PATH, file+create:/PATH, ram, null or nvme:/dev/ngXnY[@OFFSET|auto+LEN] \
     (or nvme:eui.HEX, nguid.HEX, nsid.N.NQN: the namespace by its identity)";
/// What a bad capacity question is told.
pub const CAPACITY_HINT: &str = "expected ram, file:/DIR or nvme:/dev/ngXnY (or nvme:eui.HEX, ...)";
/// How a namespace's identity begins (`nguid.`, `eui.`, `nsid.`), as ublkd writes it.
const IDENTITY_PREFIXES: [&str; 3] = ["nguid.", "eui.", "nsid."];
/// What a bad I/O path is told.
pub const IO_PATH_HINT: &str = "expected auto, batch or per-io";
/// What a bad size is told.
pub const SIZE_HINT: &str =
    "expected a size such as 4096, 512Ki, 10Gi (binary, also 10GiB) or 10G (decimal, as \
     in Kubernetes)";

/// A notation's kind word and what follows its first `:` (`nvme:/dev/ng0n1@auto+1Gi`), with
/// `+create` taken off the word.
fn split_kind(s: &str) -> (Option<BackendKind>, bool, Option<&str>) {
    let (word, arg) = match s.trim().split_once(':') {
        Some((word, arg)) => (word, Some(arg)),
        None => (s.trim(), None),
    };
    let (word, create) = match word.strip_suffix("+create") {
        Some(word) => (word, true),
        None => (word, false),
    };
    (BackendKind::named(word), create, arg)
}

/// Reads a backend in the notation above.
pub fn parse_backend(s: &str) -> Result<Backend, String> {
    let hint = || BACKEND_HINT.to_owned();
    let (Some(kind), create, arg) = split_kind(s) else {
        return Err(hint());
    };
    match (kind, arg) {
        (BackendKind::Null, None) if !create => Ok(Backend::Null(NullBackend {})),
        (BackendKind::Ram, None) if !create => Ok(Backend::Ram(RamBackend {})),
        (BackendKind::File, Some(path)) => Ok(Backend::File(FileBackend {
            path: absolute("file", path)?,
            create,
        })),
        (BackendKind::Nvme, Some(rest)) if !create => parse_nvme(rest).map(Backend::Nvme),
        (BackendKind::Null | BackendKind::Ram | BackendKind::File | BackendKind::Nvme, _) => {
            Err(hint())
        }
    }
}

/// An NVMe namespace (by path or identity), as it follows `nvme:`, with its window if any.
fn parse_nvme(rest: &str) -> Result<NvmeBackend, String> {
    let (device, window) = match rest.rsplit_once('@') {
        Some((device, window)) => (device, Some(window)),
        None => (rest, None),
    };
    // A namespace named by its identity (as `/dev/disk/by-id` does): ublkd finds its char
    // device, whatever name this boot gave it.
    let (device, identity) = if is_identity(device) {
        (String::new(), device.to_owned())
    } else {
        (absolute("nvme", device)?, String::new())
    };
    let (offset_bytes, length_bytes) = match window {
        None => (Some(0), 0),
        Some(window) => {
            let (offset, length) = window.split_once('+').unwrap_or((window, "0"));
            // `auto`: ublkd places the window in the first free extent that fits.
            let offset = match offset {
                "auto" => None,
                o => Some(
                    parse_size(o)
                        .ok_or_else(|| format!("nvme window offset {o:?}: {SIZE_HINT} or auto"))?,
                ),
            };
            let length = parse_size(length)
                .ok_or_else(|| format!("nvme window length {length:?}: {SIZE_HINT}"))?;
            (offset, length)
        }
    };
    Ok(NvmeBackend {
        device,
        offset_bytes,
        length_bytes,
        keep_data: false,
        identity,
    })
}

/// Whether `device` names a namespace by its identity (`nguid.`, `eui.`, `nsid.`): the one
/// test, for the notation and the StorageClass's `namespace` alike.
pub fn is_identity(device: &str) -> bool {
    IDENTITY_PREFIXES.iter().any(|p| device.starts_with(p))
}

/// A backend in the notation above (`-` for none), so that it parses back to itself.
pub fn backend_text(backend: Option<&Backend>) -> String {
    match backend {
        None => "-".into(),
        Some(Backend::Null(_)) => "null".into(),
        Some(Backend::Ram(_)) => "ram".into(),
        Some(Backend::File(f)) if f.create => format!("file+create:{}", f.path),
        Some(Backend::File(f)) => format!("file:{}", f.path),
        Some(Backend::Nvme(n)) => {
            let offset = n.offset_bytes.map_or_else(|| "auto".into(), compact_size);
            let device = if n.device.is_empty() {
                &n.identity
            } else {
                &n.device
            };
            match (n.offset_bytes, n.length_bytes) {
                (Some(0), 0) => format!("nvme:{device}"),
                (_, 0) => format!("nvme:{device}@{offset}"),
                (_, len) => format!("nvme:{device}@{offset}+{}", compact_size(len)),
            }
        }
    }
}

/// Reads what a capacity question names: `ram`, `file:/DIR` or `nvme:/dev/ngXnY` (or the
/// namespace's identity).
pub fn parse_capacity_backend(s: &str) -> Result<CapacityBackend, String> {
    let hint = || CAPACITY_HINT.to_owned();
    let (Some(kind), false, arg) = split_kind(s) else {
        return Err(hint());
    };
    match (kind, arg) {
        (BackendKind::Ram, None) => Ok(CapacityBackend::Ram(RamBackend {})),
        (BackendKind::File, Some(root)) => Ok(CapacityBackend::File(FileCapacity {
            root: absolute("file", root)?,
        })),
        (BackendKind::Nvme, Some(device)) => Ok(CapacityBackend::Nvme(NvmeCapacity {
            device: if is_identity(device) {
                device.to_owned()
            } else {
                absolute("nvme", device)?
            },
        })),
        (BackendKind::Null, _) => Err(format!("null has no pool: {}", hint())),
        (BackendKind::Ram | BackendKind::File | BackendKind::Nvme, _) => Err(hint()),
    }
}

/// Reads an I/O path: `auto`, `batch`, `per-io` (or `per_io`).
pub fn parse_io_path(s: &str) -> Result<IoPath, String> {
    match s.trim() {
        "auto" => Ok(IoPath::Auto),
        "batch" => Ok(IoPath::Batch),
        "per-io" | "per_io" => Ok(IoPath::PerIo),
        other => Err(format!("unknown I/O path {other:?}: {IO_PATH_HINT}")),
    }
}

/// An I/O path as it is written: `auto`, `batch`, `per-io`.
pub fn io_path_text(p: IoPath) -> &'static str {
    match p {
        IoPath::Auto => "auto",
        IoPath::Batch => "batch",
        IoPath::PerIo => "per-io",
    }
}

/// The daemon may run on another host, so a relative path has nothing to be relative to.
fn absolute(kind: &str, path: &str) -> Result<String, String> {
    if path.starts_with('/') {
        Ok(path.to_owned())
    } else if path.is_empty() {
        Err(format!(
            "the {kind} backend needs a path, e.g. {kind}:/ABSOLUTE/PATH"
        ))
    } else {
        Err(format!("the {kind} backend path {path:?} is not absolute"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;

    #[test]
    fn backends_parse() {
        assert_eq!(parse_backend("null"), Ok(Backend::Null(NullBackend {})));
        assert_eq!(parse_backend(" ram "), Ok(Backend::Ram(RamBackend {})));
        assert_eq!(
            parse_backend("file:/srv/a.img"),
            Ok(Backend::File(FileBackend {
                path: "/srv/a.img".into(),
                create: false
            }))
        );
        assert_eq!(
            parse_backend("file+create:/srv/a.img"),
            Ok(Backend::File(FileBackend {
                path: "/srv/a.img".into(),
                create: true
            }))
        );
    }

    #[test]
    fn nvme_backend_takes_an_optional_window() {
        let nvme = |device: &str, offset_bytes: Option<u64>, length_bytes| {
            Ok(Backend::Nvme(NvmeBackend {
                device: device.into(),
                offset_bytes,
                length_bytes,
                keep_data: false,
                identity: String::new(),
            }))
        };
        assert_eq!(
            parse_backend("nvme:/dev/ng0n1"),
            nvme("/dev/ng0n1", Some(0), 0)
        );
        assert_eq!(
            parse_backend("nvme:/dev/ng0n1@1GiB+10GiB"),
            nvme("/dev/ng0n1", Some(1 << 30), 10 << 30)
        );
        assert_eq!(
            parse_backend("nvme:/dev/ng1n2@4096"),
            nvme("/dev/ng1n2", Some(4096), 0)
        );
        // ublkd places it.
        assert_eq!(
            parse_backend("nvme:/dev/ng0n1@auto+1GiB"),
            nvme("/dev/ng0n1", None, 1 << 30)
        );
    }

    /// The hints name every kind (every kind with a pool, for capacity), so that a new kind
    /// is not left out of what a person is told.
    #[test]
    fn the_hints_name_every_kind() {
        for kind in BackendKind::ALL {
            assert!(
                BACKEND_HINT.contains(kind.name()),
                "{kind} in {BACKEND_HINT}"
            );
            let named = CAPACITY_HINT.contains(kind.name());
            assert_eq!(named, kind.has_pool(), "{kind} in {CAPACITY_HINT}");
        }
    }

    #[test]
    fn bad_backends_say_what_is_expected() {
        assert_eq!(parse_backend("disk:/x"), Err(BACKEND_HINT.to_owned()));
        assert!(parse_backend("file:relative.img")
            .unwrap_err()
            .contains("not absolute"));
        assert!(parse_backend("file+create:")
            .unwrap_err()
            .contains("needs a path"));
        // A namespace by its identity: no path; ublkd finds it.
        match parse_backend("nvme:eui.0011223344556677@auto+1GiB") {
            Ok(Backend::Nvme(n)) => {
                assert_eq!(
                    (n.device.as_str(), n.identity.as_str()),
                    ("", "eui.0011223344556677")
                );
                assert_eq!((n.offset_bytes, n.length_bytes), (None, 1 << 30));
                let text = backend_text(Some(&Backend::Nvme(n)));
                assert_eq!(text, "nvme:eui.0011223344556677@auto+1GiB");
            }
            other => panic!("{other:?}"),
        }
        assert!(parse_backend("nvme:/dev/ng0n1@1GiB+lots")
            .unwrap_err()
            .contains("nvme window length \"lots\""));
        assert!(parse_backend("nvme:/dev/ng0n1@x+1G")
            .unwrap_err()
            .contains("nvme window offset \"x\""));
    }

    #[test]
    fn backend_text_round_trips_through_the_parser() {
        for s in [
            "null",
            "ram",
            "file:/a",
            "file+create:/b c",
            "nvme:/dev/ng0n1",
            "nvme:/dev/ng0n1@1GiB",
            "nvme:/dev/ng0n1@0B+10GiB",
            "nvme:/dev/ng0n1@4097+1536",
            "nvme:/dev/ng0n1@auto+1GiB",
        ] {
            let backend = parse_backend(s).unwrap();
            assert_eq!(backend_text(Some(&backend)), s);
        }
        assert_eq!(backend_text(None), "-");
    }

    #[test]
    fn capacity_backends_parse() {
        assert_eq!(
            parse_capacity_backend("ram"),
            Ok(CapacityBackend::Ram(RamBackend {}))
        );
        assert_eq!(
            parse_capacity_backend("file:/srv"),
            Ok(CapacityBackend::File(FileCapacity {
                root: "/srv".into()
            }))
        );
        assert!(parse_capacity_backend("nvme:ng0n1").is_err());
        assert!(parse_capacity_backend("null").is_err());
    }

    #[test]
    fn io_paths_have_one_spelling_and_one_alias() {
        for p in [IoPath::Auto, IoPath::Batch, IoPath::PerIo] {
            assert_eq!(parse_io_path(io_path_text(p)), Ok(p));
        }
        assert_eq!(io_path_text(IoPath::PerIo), "per-io");
        assert_eq!(parse_io_path("per_io"), Ok(IoPath::PerIo));
        assert!(parse_io_path("perio").unwrap_err().contains(IO_PATH_HINT));
    }
}
