//! Encrypted classes (LUKS2): data at rest unreadable, grown online, keys required.

use super::{backing_file, df_grew, holds, kib, DF};
use crate::kube::{fill, Mode, Sc};
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::fs;
use std::path::Path;

/// The Secret and the two encrypted classes (a file and an NVMe one) of `encrypted` and
/// `ublkd-restart`; `key` is the Secret's key (applied again: the same, or another).
pub(super) fn luks_classes(s: &Sc, key: &str) -> Result<()> {
    let class = |name: &str, backend: &str| {
        fill(
            r#"apiVersion: storage.k8s.io/v1
kind: StorageClass
metadata: {name: @NAME@}
provisioner: ublkd.io
volumeBindingMode: WaitForFirstConsumer
allowVolumeExpansion: true
parameters:
  @BACKEND@
  encryption: luks2
  csi.storage.k8s.io/node-stage-secret-name: e-key
  csi.storage.k8s.io/node-stage-secret-namespace: default
  csi.storage.k8s.io/node-expand-secret-name: e-key
  csi.storage.k8s.io/node-expand-secret-namespace: default
"#,
            &[("NAME", name), ("BACKEND", backend)],
        )
    };
    s.apply(&format!(
        "apiVersion: v1\nkind: Secret\nmetadata: {{name: e-key}}\nstringData: {{key: {key}}}\n"
    ))?;
    s.apply(&class(
        "ublkd-file-luks",
        "backend: file\n  root: /var/lib/ublkd/volumes",
    ))?;
    s.apply(&class(
        "ublkd-nvme-luks",
        "backend: nvme\n  namespace: /dev/ng0n1",
    ))
}

/// Takes away what `luks_classes` made: the chart's uninstall must leave no StorageClass.
pub(super) fn luks_classes_gone(s: &Sc) -> Result<()> {
    s.delete("storageclass ublkd-file-luks ublkd-nvme-luks")?;
    s.delete("secret e-key")
}

/// Whether a LUKS header starts at `offset` of `path` (its magic, `LUKS\xba\xbe`).
fn luks_at(path: &Path, offset: u64) -> Result<bool> {
    holds(path, offset, 6, b"LUKS\xba\xbe")
}

/// Encrypted volumes (`encryption: luks2`, the key in a Secret): a marker written in the pod
/// is nowhere in the file volume's backing file nor in the NVMe volume's window, which start
/// with a LUKS2 header; the file system grows online through the mapping; a wrong key fails
/// the pod's mount with an event that says so and changes nothing, and the right one opens the
/// same data again. (A SIGKILL of ublkd under an fsync writer through dm-crypt is
/// `ublkd-restart`'s.)
pub fn encrypted(s: &Sc) -> Result<()> {
    luks_classes(s, "right-key-51c7")?;
    let marker = format!("ublkd-secret-marker-{}", std::process::id());
    s.pvc("e-file", "ublkd-file-luks", "64Mi", Mode::Filesystem)?;
    s.pvc("e-nvme", "ublkd-nvme-luks", "64Mi", Mode::Block)?;
    s.start_pod("p-e-file", "e-file", Mode::Filesystem)?;
    s.pod("p-e-nvme", "e-nvme", Mode::Block)?;
    s.ready("p-e-file", "e-file")?;
    // The marker many times over, pushed to the device.
    s.in_pod(
        "p-e-file",
        &format!("for i in $(seq 256); do echo {marker}; done >/data/m && sync"),
    )?;
    s.in_pod(
        "p-e-nvme",
        &format!(
            "for i in $(seq 256); do echo {marker}; done >/tmp/m && \
             dd if=/tmp/m of=/dev/xvda bs=4096 seek=100 oflag=direct conv=fsync 2>&1"
        ),
    )?;
    let back = s.in_pod(
        "p-e-nvme",
        "dd if=/dev/xvda bs=4096 skip=100 count=1 2>/dev/null | head -1",
    )?;
    ensure!(back == marker, "the block device reads back {back:?}");
    // The file volume's backing file.
    let vol = s.volume_of("e-file")?;
    let file = &backing_file(&vol)?;
    let len = fs::metadata(file)?.len();
    ensure!(
        luks_at(file, 0)?,
        "{} starts with no LUKS header",
        file.display()
    );
    ensure!(
        !holds(file, 0, len, marker.as_bytes())?,
        "the marker is in the clear in {}",
        file.display()
    );
    s.say(format!(
        "{}: LUKS header, no marker in its {len} bytes",
        file.display()
    ));
    // The NVMe volume's window of the namespace.
    let nvol = s.volume_of("e-nvme")?;
    let info: Value = serde_json::from_str(&s.ublkctl(&format!("-o json get-volume {nvol}"))?)?;
    let window = |k: &str| {
        info["spec"]["nvme"][k]
            .as_u64()
            .with_context(|| format!("no {k}"))
    };
    let (offset, length) = (window("offset_bytes")?, window("length_bytes")?);
    let ns = Path::new("/dev/nvme0n1");
    ensure!(
        luks_at(ns, offset)?,
        "the window at {offset} has no LUKS header"
    );
    ensure!(
        !holds(ns, offset, length, marker.as_bytes())?,
        "the marker is in the clear in the window at {offset}"
    );
    s.say(format!(
        "nvme window {offset}+{length}: LUKS header, no marker"
    ));
    s.delete("pod p-e-nvme")?;
    s.delete("pvc e-nvme")?;
    // Online growth: the ublk device, then the mapping (with the node-expand Secret's key),
    // then ext4.
    let before = kib(&s.in_pod("p-e-file", DF)?)?;
    s.grow("e-file", "p-e-file", 128)?;
    df_grew(s, "e-file", "p-e-file", before)?;
    // A wrong key: the pod's mount fails, saying so, and nothing is written.
    s.delete("pod p-e-file")?;
    luks_classes(s, "wrong-key-0000")?;
    s.start_pod("p-e-file", "e-file", Mode::Filesystem)?;
    let said = || s.shows("describe pod p-e-file", "wrong key");
    let shown = s.wait(180, "the pod's events say: wrong key", said);
    s.show("describe pod p-e-file");
    luks_classes(s, "right-key-51c7")?;
    shown?;
    s.ready("p-e-file", "e-file")?;
    let first = s.in_pod("p-e-file", "head -1 /data/m")?;
    ensure!(
        first == marker,
        "after the wrong key, /data/m reads {first:?}"
    );
    s.delete("pod p-e-file")?;
    s.delete("pvc e-file")?;
    luks_classes_gone(s)
}
