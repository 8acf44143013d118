//! Names: the ublkd ids the driver gives CSI's volume and snapshot names, and the words its
//! messages use for ublkd's volume states.

use ublkd_client::v1;

/// A ublkd id for a CSI name: the name itself when it is a DNS label, else `prefix` and a
/// stable digest of it, so a retried call finds what its first try made.
fn id_for(name: &str, prefix: &str) -> String {
    if crate::ublkd::is_volume_id(name) {
        return name.to_owned();
    }
    // FNV-1a, 64 bits: stable across releases and platforms, which a std hasher is not.
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{prefix}{hash:016x}")
}

/// The ublkd volume id for a CSI volume name: the name itself when it is a DNS label (the
/// provisioner's `pvc-<uid>` always is), else `csi-` and a stable digest of it.
pub fn volume_id_for(name: &str) -> String {
    id_for(name, "csi-")
}

/// The ublkd snapshot id for a CSI snapshot name, as [`volume_id_for`] makes
/// volume ids: the name itself when it is a DNS label (the snapshotter's `snapshot-<uid>`
/// always is), else `snap-` and a stable digest of it, so a retried CreateSnapshot finds the
/// snapshot its first try took.
pub fn snapshot_id_for(name: &str) -> String {
    id_for(name, "snap-")
}

/// A ublkd volume state as a word for messages.
pub fn state_name(s: v1::VolumeState) -> &'static str {
    match s {
        v1::VolumeState::Creating => "creating",
        v1::VolumeState::Ready => "ready",
        v1::VolumeState::Recovering => "recovering",
        v1::VolumeState::Failed => "failed",
        v1::VolumeState::Deleting => "deleting",
        v1::VolumeState::Unspecified => "unknown",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_stable_volume_ids() {
        assert_eq!(volume_id_for("pvc-0a1b"), "pvc-0a1b");
        let odd = volume_id_for("Sanity Volume 1");
        assert!(odd.starts_with("csi-") && odd.len() == 20, "{odd}");
        assert_eq!(odd, volume_id_for("Sanity Volume 1"), "stable");
        assert_ne!(odd, volume_id_for("Sanity Volume 2"));
    }

    #[test]
    fn snapshot_names_map_to_stable_ids_apart_from_volume_ids() {
        assert_eq!(snapshot_id_for("snapshot-0a1b"), "snapshot-0a1b");
        let odd = snapshot_id_for("CreateSnapshot-snapshot-1");
        assert!(odd.starts_with("snap-") && odd.len() == 21, "{odd}");
        assert!(crate::ublkd::is_volume_id(&odd), "{odd}");
        assert_eq!(odd, snapshot_id_for("CreateSnapshot-snapshot-1"), "stable");
        assert_ne!(odd, snapshot_id_for("CreateSnapshot-snapshot-2"));
        let long = "s".repeat(128);
        assert!(crate::ublkd::is_volume_id(&snapshot_id_for(&long)));
        assert_eq!(
            &snapshot_id_for("Sanity 1")[5..],
            &volume_id_for("Sanity 1")[4..],
            "the same digest as volume ids, another prefix"
        );
    }
}
