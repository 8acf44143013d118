//! The test cluster's container images, built offline: no registry is reachable, so every
//! image a pod names is packed here as an OCI archive and imported into containerd in the
//! guest (`ctr -n k8s.io images import`) under the name the test overlay gives it.
//!
//! A Go binary is static, so its image is one layer holding the binary (and an empty /tmp), with
//! the binary as the entrypoint. ublkd's own image is `cargo xtask image`'s.

use crate::apt;
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// One image: where the archive is, and the name containerd must know it by.
#[derive(Debug, Clone)]
pub struct Image {
    pub reference: String,
    pub archive: PathBuf,
}

/// Every image timestamp: these are test images, rebuilt each run, and a fixed time keeps
/// their digests stable from run to run.
const EPOCH: u64 = 0;

/// Packs `binary` as `/<entry>` into an image called `reference` (`name:tag`), archived under
/// `out`.
pub fn binary_image(reference: &str, binary: &Path, entry: &str, out: &Path) -> Result<Image> {
    if apt::which("umoci").is_none() {
        apt::install_packages(&["umoci"])?;
    }
    let (name, tag) = reference
        .rsplit_once(':')
        .with_context(|| format!("image reference {reference} has no tag"))?;
    let slug = name.replace(['/', '.'], "_");
    let work = out.join(format!("{slug}.work"));
    if work.exists() {
        fs::remove_dir_all(&work)?;
    }
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
    let image = format!("{}:{tag}", layout.display());
    let umoci = |args: &[&str]| apt::run_ok(Command::new("umoci").args(args));
    umoci(&["init", "--layout", &layout.to_string_lossy()])?;
    umoci(&["new", "--image", &image])?;
    umoci(&[
        "raw",
        "add-layer",
        "--image",
        &image,
        "--history.created",
        "1970-01-01T00:00:00Z",
        &layer.to_string_lossy(),
    ])?;
    umoci(&[
        "config",
        "--image",
        &image,
        "--no-history",
        "--created",
        "1970-01-01T00:00:00Z",
        "--architecture",
        "amd64",
        "--os",
        "linux",
        "--config.entrypoint",
        entry,
        "--config.workingdir",
        "/",
    ])?;
    umoci(&["gc", "--layout", &layout.to_string_lossy()])?;
    for e in fs::read_dir(layout.join("blobs/sha256"))? {
        crate::dist::set_mode(&e?.path(), 0o644)?;
    }
    let archive = out.join(format!("{slug}.tar"));
    crate::dist::reproducible_tar(&layout, &archive, EPOCH)?;
    fs::remove_dir_all(&work)?;
    Ok(Image {
        reference: reference.to_owned(),
        archive,
    })
}
