//! `cargo xtask image`: ublkd's container image, an OCI image layout in a tarball, built without
//! a container daemon and without pulling a base image.
//! Two layers:
//! 1. **base**: a root file system of Debian packages (`PACKAGES`), extracted by `mmdebstrap`
//!    from the machine's own apt mirror: only the programs ublkd, ublkd-csi and the DaemonSet
//!    exec and the libraries they load; what none of them runs is pruned (`PRUNE`).
//! 2. **ublkd**: release builds of `ublkd`, `ublkctl` and `ublkd-csi` in `/usr/local/bin`.
//!
//! Each layer is a tar written the same way every time (`dist::reproducible_tar`; times clamped
//! to the newest package file's in the base, so it changes only with the packages, and to the
//! commit's in the binaries' layer), added verbatim with `umoci raw add-layer`, which compresses it. So
//! the same commit and the same Debian archive give the same layer digests; `--check` builds
//! twice from nothing and compares them. Labels follow the OCI annotation conventions.
//! Output, under `target/image/`: `oci/` (the layout), `ublkd-oci.tar` (the same, archived, for
//! `skopeo copy oci-archive:…`, `podman load`, `ctr import`) and `image.json` (digests, sizes).

use crate::apt;
use crate::dist::{self, Release};
use anyhow::{ensure, Context, Result};
use serde_json::Value;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// Debian packages of the base layer (their dependencies come with them).
const PACKAGES: &[&str] = &[
    "libc6",
    "libgcc-s1",
    "dash",
    "kmod",
    "mount",
    "util-linux",
    "e2fsprogs",
    "xfsprogs",
    // cryptsetup: encrypted volumes (`encryption: luks2`, ublkd_csi::crypt)
    "cryptsetup-bin",
];

/// Paths removed from the base layer: nothing ublkd's programs run reads them. A name ending in
/// `*` removes every entry of its directory whose name starts with the rest: Python and ICU
/// serve only `xfs_scrub` and `xfs_scrub_all`, removed with them.
const PRUNE: &[&str] = &[
    "usr/share/doc",
    "usr/share/man",
    "usr/share/info",
    "usr/share/locale",
    "usr/share/lintian",
    "usr/share/bash-completion",
    "usr/share/gdb",
    "usr/share/python3",
    "usr/share/perl5",
    "usr/share/debconf",
    "usr/share/zsh",
    "usr/lib/x86_64-linux-gnu/gconv",
    "usr/lib/x86_64-linux-gnu/perl-base",
    "usr/lib/python3",
    "usr/lib/python3.11",
    "var/cache",
    "var/log",
    "var/lib/apt",
    "var/lib/dpkg",
    "usr/bin/python3*",
    "usr/lib/x86_64-linux-gnu/libpython3*",
    "usr/lib/x86_64-linux-gnu/libicu*",
    "usr/sbin/xfs_scrub*",
    "sbin/xfs_scrub*",
];

/// The binaries of the image (of `dist::RELEASE_PACKAGES`: ublkd-server's `ublkd`, ublkctl,
/// ublkd-csi).
const BINARIES: &[&str] = &["ublkd", "ublkctl", "ublkd-csi"];

/// What one build produced (and `image.json` holds).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Built {
    pub version: String,
    pub revision: String,
    pub archive: PathBuf,
    /// Compressed layer digests, base first.
    pub layers: Vec<String>,
    pub manifest: String,
    /// Bytes of the compressed layers and of the files they hold.
    pub compressed_bytes: u64,
    pub uncompressed_bytes: u64,
}

/// `cargo xtask image [--check]`: with `check`, a second build from nothing must give the same
/// layers.
pub fn run(ws: &Path, check: bool, push: Option<&Push>) -> Result<()> {
    let built = build(ws, &ws.join("target/image"))?;
    report(&built);
    if let Some(p) = push {
        push_archive(&built.archive, &built.manifest, p)?;
    }
    if check {
        let again = build(ws, &ws.join("target/image-check"))?;
        ensure!(
            again.layers == built.layers,
            "the image is not reproducible: two builds of the same commit gave layers {:?} and {:?}",
            built.layers,
            again.layers
        );
        eprintln!(
            "xtask: image reproducible: a second build from nothing gave the same {} layer digests",
            built.layers.len()
        );
        fs::remove_dir_all(ws.join("target/image-check"))?;
    }
    Ok(())
}

/// Where `cargo xtask image --push` sends the image (and `push-archive`'s arguments).
#[derive(Debug, Clone, PartialEq, Eq, clap::Args)]
pub struct Push {
    /// A registry reference, `HOST[:PORT]/NAME:TAG`.
    pub reference: String,
    /// Plain HTTP, or TLS without verifying the registry's certificate (a registry on
    /// loopback, a test registry).
    #[arg(long)]
    pub insecure: bool,
}

/// The arguments of `skopeo copy` that push `archive` to `p`.
pub fn push_args(archive: &Path, p: &Push) -> Vec<String> {
    vec![
        "copy".into(),
        format!("--dest-tls-verify={}", !p.insecure),
        format!("oci-archive:{}", archive.display()),
        format!("docker://{}", p.reference),
    ]
}

/// Pushes the OCI archive with skopeo (Debian's, installed when missing), then reads the pushed
/// manifest back and checks its digest is `manifest`, the archive's.
pub fn push_archive(archive: &Path, manifest: &str, p: &Push) -> Result<()> {
    let skopeo = apt::require("skopeo", "skopeo")?;
    eprintln!("xtask: image: skopeo copy to {}", p.reference);
    apt::run_ok(Command::new(&skopeo).args(push_args(archive, p)))
        .with_context(|| format!("skopeo copy to {}", p.reference))?;
    let tls = format!("--tls-verify={}", !p.insecure);
    let docker = format!("docker://{}", p.reference);
    let out = apt::output_ok(Command::new(&skopeo).args(["inspect", &tls, &docker]))?;
    let pushed: Value = serde_json::from_str(&out)?;
    let digest = pushed["Digest"].as_str().unwrap_or("no digest");
    ensure!(
        digest == manifest,
        "{} serves manifest {digest}, the image built is {manifest}",
        p.reference,
    );
    println!("pushed: {} ({digest})", p.reference);
    Ok(())
}

fn report(b: &Built) {
    const MIB: f64 = 1024.0 * 1024.0;
    println!("image: {}", b.archive.display());
    println!("manifest: {}", b.manifest);
    for (name, digest) in ["base", "ublkd"].iter().zip(&b.layers) {
        println!("layer {name}: {digest}");
    }
    println!(
        "size: {:.1} MiB compressed, {:.1} MiB unpacked",
        b.compressed_bytes as f64 / MIB,
        b.uncompressed_bytes as f64 / MIB
    );
}

/// Builds the image into `out` from nothing.
pub fn build(ws: &Path, out: &Path) -> Result<Built> {
    apt::require("mmdebstrap", "mmdebstrap")?;
    let release = Release::of(ws)?;
    let bins = dist::release_build(ws)?;
    dist::empty_dir(out)?;
    let work = out.join("work");
    fs::create_dir_all(&work)?;

    let base = work.join("base");
    debian_root(&base, release.epoch)?;
    let app = work.join("app");
    for bin in BINARIES {
        dist::install_stripped(&bins.join(bin), &app.join("usr/local/bin").join(bin))?;
    }
    let base_tar = work.join("base.tar");
    let app_tar = work.join("app.tar");
    // The base's times are its packages' (the newest file under /usr, all of which come from
    // them), not the commit's: the base layer stays the same from commit to commit, and nodes
    // pull only the binaries' layer.
    let base_epoch = dist::newest_file_time(&base.join("usr"))?.min(release.epoch);
    dist::reproducible_tar(&base, &base_tar, base_epoch)?;
    dist::reproducible_tar(&app, &app_tar, release.epoch)?;
    let uncompressed_bytes = fs::metadata(&base_tar)?.len() + fs::metadata(&app_tar)?.len();

    let layout = out.join("oci");
    assemble(&layout, &release, &base_tar, &app_tar)?;
    let archive = out.join("ublkd-oci.tar");
    dist::reproducible_tar(&layout, &archive, release.epoch)?;
    fs::remove_dir_all(&work)?;

    let (manifest, layers, compressed_bytes) = describe(&layout)?;
    let built = Built {
        version: release.version,
        revision: release.revision,
        archive,
        layers,
        manifest,
        compressed_bytes,
        uncompressed_bytes,
    };
    let json = serde_json::to_string_pretty(&built)?;
    fs::write(out.join("image.json"), json)?;
    Ok(built)
}

/// The base root file system: the packages extracted (no maintainer scripts run: nothing in the
/// image is configured at build time), then pruned.
fn debian_root(dir: &Path, epoch: u64) -> Result<()> {
    let suite = dist::debian_suite()?;
    let mirror = apt::debian_mirror()?;
    let n = PACKAGES.len();
    eprintln!("xtask: image base: mmdebstrap {suite} ({n} packages)");
    apt::run_ok(
        Command::new("mmdebstrap")
            .args(["--quiet", "--variant=extract", "--mode=root"])
            .arg(format!("--include={}", PACKAGES.join(",")))
            .arg(&suite)
            .arg(dir)
            .arg(&mirror)
            .env("SOURCE_DATE_EPOCH", epoch.to_string()),
    )
    .context("mmdebstrap could not build the image's base")?;
    for p in PRUNE {
        let (sub, name) = p.rsplit_once('/').unwrap_or(("", p));
        for e in fs::read_dir(dir.join(sub)).into_iter().flatten() {
            let (path, found) = e.map(|e| (e.path(), e.file_name()))?;
            let found = found.to_string_lossy();
            let hit = name
                .strip_suffix('*')
                .map_or(found == *name, |p| found.starts_with(p));
            if hit && path.is_dir() {
                fs::remove_dir_all(&path)?;
            } else if hit {
                fs::remove_file(&path)?;
            }
        }
    }
    // Where ublkd's state and the host's mounts go; present so a read-only root still has them.
    for d in ["var/lib/ublkd", "run", "tmp", "etc/ublkd"] {
        fs::create_dir_all(dir.join(d))?;
    }
    dist::set_mode(&dir.join("tmp"), 0o1777)?;
    for must in [
        "bin/sh",
        "sbin/modprobe",
        "bin/mount",
        "sbin/mkfs.xfs",
        "sbin/mkfs.ext4",
    ] {
        ensure!(
            dir.join(must).symlink_metadata().is_ok(),
            "the image's base lacks /{must} after mmdebstrap"
        );
    }
    Ok(())
}

/// The image layout: the two layers, then the configuration and labels, every timestamp the
/// commit's.
fn assemble(layout: &Path, r: &Release, base: &Path, app: &Path) -> Result<()> {
    let created = r.created()?;
    let mmdebstrap = format!(
        "mmdebstrap --variant=extract --include={}",
        PACKAGES.join(",")
    );
    let layers = [
        (base, mmdebstrap.as_str()),
        (app, "cargo build --release: ublkd ublkctl ublkd-csi"),
    ];
    let labels = [
        ("title", "ublkd".to_owned()),
        (
            "description",
            "ublkd: block volumes over ublk, with ublkctl and the ublkd-csi CSI driver".into(),
        ),
        ("version", r.version.clone()),
        ("revision", r.revision.clone()),
        ("source", r.source.clone()),
        ("licenses", "Apache-2.0".into()),
        ("created", created.clone()),
    ];
    let mut config = vec![
        "--config.entrypoint=/usr/local/bin/ublkd".to_owned(),
        "--config.env=PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin".into(),
    ];
    for (k, v) in &labels {
        let label = format!("org.opencontainers.image.{k}={v}");
        config.push(format!("--config.label={label}"));
        config.push(format!("--manifest.annotation={label}"));
    }
    umoci_layout(layout, &r.version, &created, &layers, &config)
}

/// An OCI image layout made with umoci at `layout`, its image tagged `tag`: `layers`
/// (uncompressed tars, base first, each with the history line that says how it was made) added
/// verbatim, then `config` (umoci config's flags), every timestamp `created`.
pub fn umoci_layout(
    layout: &Path,
    tag: &str,
    created: &str,
    layers: &[(&Path, &str)],
    config: &[String],
) -> Result<()> {
    apt::require("umoci", "umoci")?;
    let image = format!("{}:{tag}", layout.display());
    let umoci = || Command::new("umoci");
    let dir = layout.to_string_lossy();
    apt::run_ok(umoci().args(["init", "--layout", &dir]))?;
    apt::run_ok(umoci().args(["new", "--image", &image]))?;
    for (tar, by) in layers {
        apt::run_ok(
            umoci()
                .args(["raw", "add-layer", "--image", &image])
                .args(["--history.created", created, "--history.created_by", by])
                .arg(tar),
        )?;
    }
    apt::run_ok(
        umoci()
            .args(["config", "--image", &image, "--no-history"])
            .args(["--created", created])
            .args(["--architecture", "amd64", "--os", "linux"])
            .args(config),
    )?;
    apt::run_ok(umoci().args(["gc", "--layout", &dir]))?;
    // umoci writes blobs readable by their owner only; an image is public.
    for e in fs::read_dir(layout.join("blobs/sha256"))? {
        dist::set_mode(&e?.path(), 0o644)?;
    }
    Ok(())
}

/// The manifest digest, the layer digests and their compressed size, read from the layout.
fn describe(layout: &Path) -> Result<(String, Vec<String>, u64)> {
    let index: Value = serde_json::from_slice(&fs::read(layout.join("index.json"))?)?;
    let manifest = index["manifests"][0]["digest"]
        .as_str()
        .context("index.json names no manifest")?
        .to_owned();
    let m: Value = serde_json::from_slice(&fs::read(blob(layout, &manifest)?)?)?;
    let (mut layers, mut size) = (Vec::new(), 0);
    let listed = m["layers"]
        .as_array()
        .context("the manifest has no layers")?;
    for l in listed {
        let digest = l["digest"].as_str().context("a layer without digest")?;
        layers.push(digest.to_owned());
        size += l["size"].as_u64().context("a layer without size")?;
    }
    // The digest umoci wrote must be the file's: check one, as a reader would.
    let first = layers.first().context("no layers")?;
    let file = blob(layout, first)?;
    ensure!(
        format!("sha256:{}", dist::sha256(&file)?) == *first,
        "{} does not hash to its name",
        file.display()
    );
    Ok((manifest, layers, size))
}

fn blob(layout: &Path, digest: &str) -> Result<PathBuf> {
    let (alg, hex) = digest
        .split_once(':')
        .with_context(|| format!("{digest} is not ALG:HEX"))?;
    Ok(layout.join("blobs").join(alg).join(hex))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_push_copies_the_archive_to_the_reference_verifying_tls_unless_told() {
        let reference = "reg.test:5000/ublkd:0.1.0".into();
        let mut p = Push {
            reference,
            insecure: false,
        };
        let archive = Path::new("/w/target/image/ublkd-oci.tar");
        let copy = [
            "copy",
            "--dest-tls-verify=true",
            "oci-archive:/w/target/image/ublkd-oci.tar",
            "docker://reg.test:5000/ublkd:0.1.0",
        ];
        assert_eq!(push_args(archive, &p), copy);
        p.insecure = true;
        assert_eq!(push_args(archive, &p)[1], "--dest-tls-verify=false");
    }
}
