//! Volume capabilities: which access modes and access types a ublkd volume can serve. A ublkd
//! volume is a block device on one node, so only single-node modes are offered; MULTI_NODE_*
//! is refused.

use crate::error::CsiError;
use crate::params::FsType;
use crate::spec::volume_capability::{access_mode::Mode, AccessType};
use crate::spec::VolumeCapability;

/// How a capability asks for the volume.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Access {
    /// A file system of this type, mounted with these flags.
    Mount { fs: FsType, flags: Vec<String> },
    /// The raw block device.
    Block,
}

/// Checks one capability; returns how it asks for the volume and whether it is read-only by
/// its mode. `default_fs` applies when the capability names no file system.
pub fn check(cap: &VolumeCapability, default_fs: FsType) -> Result<(Access, bool), CsiError> {
    let mode = cap
        .access_mode
        .as_ref()
        .ok_or(CsiError::MissingField("volume_capability.access_mode"))?
        .mode();
    let read_only = match mode {
        Mode::SingleNodeWriter | Mode::SingleNodeSingleWriter | Mode::SingleNodeMultiWriter => {
            false
        }
        Mode::SingleNodeReaderOnly => true,
        Mode::Unknown => return Err(CsiError::MissingField("volume_capability.access_mode")),
        other => {
            return Err(CsiError::UnsupportedCapability(format!(
                "access mode {} (a ublkd volume lives on one node)",
                other.as_str_name()
            )))
        }
    };
    let access = match &cap.access_type {
        None => return Err(CsiError::MissingField("volume_capability.access_type")),
        Some(AccessType::Block(_)) => Access::Block,
        Some(AccessType::Mount(m)) => Access::Mount {
            fs: if m.fs_type.is_empty() {
                default_fs
            } else {
                FsType::parse(&m.fs_type)?
            },
            flags: m.mount_flags.clone(),
        },
    };
    Ok((access, read_only))
}

/// Checks every capability of a request; at least one is required.
pub fn check_all(caps: &[VolumeCapability], default_fs: FsType) -> Result<(), CsiError> {
    if caps.is_empty() {
        return Err(CsiError::MissingField("volume_capabilities"));
    }
    caps.iter().try_for_each(|c| check(c, default_fs).map(drop))
}

/// The smallest volume every capability can be served on: the largest floor of a file system
/// they ask for (a block capability has none). Checked capabilities only.
pub fn size_floor(caps: &[VolumeCapability], default_fs: FsType) -> u64 {
    caps.iter()
        .filter_map(|c| match check(c, default_fs) {
            Ok((Access::Mount { fs, .. }, _)) => Some(fs.min_bytes()),
            _ => None,
        })
        .max()
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::volume_capability::{AccessMode, BlockVolume, MountVolume};

    fn cap(mode: Mode, access: Option<AccessType>) -> VolumeCapability {
        VolumeCapability {
            access_mode: Some(AccessMode { mode: mode as i32 }),
            access_type: access,
        }
    }

    fn mount(fs: &str) -> Option<AccessType> {
        Some(AccessType::Mount(MountVolume {
            fs_type: fs.into(),
            mount_flags: vec!["noatime".into()],
            volume_mount_group: String::new(),
        }))
    }

    #[test]
    fn single_node_modes_and_known_file_systems_only() {
        let (a, ro) = check(&cap(Mode::SingleNodeWriter, mount("")), FsType::Xfs).unwrap();
        assert_eq!(
            a,
            Access::Mount {
                fs: FsType::Xfs,
                flags: vec!["noatime".into()]
            }
        );
        assert!(!ro);
        let block = Some(AccessType::Block(BlockVolume {}));
        let (a, ro) = check(
            &cap(Mode::SingleNodeReaderOnly, block.clone()),
            FsType::Ext4,
        )
        .unwrap();
        assert_eq!(a, Access::Block);
        assert!(ro);
        for bad in [
            cap(Mode::MultiNodeMultiWriter, block.clone()),
            cap(Mode::MultiNodeReaderOnly, mount("ext4")),
            cap(Mode::Unknown, block.clone()),
            cap(Mode::SingleNodeWriter, None),
            cap(Mode::SingleNodeWriter, mount("btrfs")),
            VolumeCapability {
                access_mode: None,
                access_type: block.clone(),
            },
        ] {
            let e = check(&bad, FsType::Ext4).expect_err("refused");
            assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e}");
        }
        assert!(check_all(&[], FsType::Ext4).is_err());
    }

    #[test]
    fn an_xfs_capability_sets_the_smallest_volume() {
        let w = Mode::SingleNodeWriter;
        let block = Some(AccessType::Block(BlockVolume {}));
        assert_eq!(size_floor(&[cap(w, block.clone())], FsType::Xfs), 0);
        assert_eq!(size_floor(&[cap(w, mount("ext4"))], FsType::Xfs), 0);
        assert_eq!(size_floor(&[cap(w, mount(""))], FsType::Xfs), 300 << 20);
        let both = [cap(w, mount("ext4")), cap(w, mount("xfs"))];
        assert_eq!(size_floor(&both, FsType::Ext4), 300 << 20);
    }
}
