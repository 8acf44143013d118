//! The test cluster's container images, built offline: no registry is reachable, so every
//! image a pod names is packed here as an OCI archive and imported into containerd in the
//! guest (`ctr -n k8s.io images import`) under the name the test overlay gives it.
//! A Go binary is static, so its image is one layer holding the binary (and an empty /tmp), with
//! the binary as the entrypoint. ublkd's own image is `cargo xtask image`'s.

use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};

/// Every image timestamp: these are test images, rebuilt each run, and a fixed time keeps
/// their digests stable from run to run.
const EPOCH: u64 = 0;

/// Packs `binary` as `/<entry>` into an image called `ublkd.test/<name>:<tag>`, archived under
/// `out`: the name containerd must know it by, and the archive's path.
pub fn binary_image(
    name: &str,
    tag: &str,
    binary: &Path,
    entry: &str,
    out: &Path,
) -> Result<(String, PathBuf)> {
    let reference = format!("ublkd.test/{name}:{tag}");
    let slug = format!("ublkd_test_{}", name.replace(['/', '.'], "_"));
    let work = out.join(format!("{slug}.work"));
    crate::dist::empty_dir(&work)?;
    let root = work.join("root");
    fs::create_dir_all(root.join("tmp"))?;
    let dest = root.join(entry.trim_start_matches('/'));
    if let Some(d) = dest.parent() {
        fs::create_dir_all(d)?;
    }
    fs::copy(binary, &dest).with_context(|| format!("copying {}", binary.display()))?;
    crate::dist::set_mode(&dest, 0o755)?;
    crate::dist::set_mode(&root.join("tmp"), 0o1777)?;
    let layer = work.join("layer.tar");
    crate::dist::reproducible_tar(&root, &layer, EPOCH)?;
    let layout = work.join("oci");
    let config = [
        format!("--config.entrypoint={entry}"),
        "--config.workingdir=/".into(),
    ];
    let layers = [(layer.as_path(), entry)];
    crate::oci::umoci_layout(&layout, tag, "1970-01-01T00:00:00Z", &layers, &config)?;
    let archive = out.join(format!("{slug}.tar"));
    crate::dist::reproducible_tar(&layout, &archive, EPOCH)?;
    fs::remove_dir_all(&work)?;
    Ok((reference, archive))
}
