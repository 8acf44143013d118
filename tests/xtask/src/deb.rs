//! `cargo xtask deb`: the Debian package of ublkd and ublkctl (release builds, debug info
//! stripped), built with `dpkg-deb` from the files the repository already ships (`FILES`: the
//! systemd unit verbatim, its Debian drop-in, `ublkd.toml` as a conffile, the maintainer
//! scripts), so the package cannot drift from them.
//! The same commit gives the same `.deb` (`SOURCE_DATE_EPOCH`, owners root). Output:
//! `target/deb/ublkd_<version>_<arch>.deb`, and `target/deb/ublkd.deb` naming the latest.
//! `scratch_root` makes what the VM test installs the package into: a minimal Debian root
//! (essential packages and `passwd`, which the postinst's `groupadd` needs) as a tarball.

use crate::apt;
use crate::dist::{self, Release};
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// The package's files from the repository (from, to in the package): the maintainer scripts
/// run (mode 755), the rest is read (644).
const FILES: &[(&str, &str)] = &[
    (
        "deploy/systemd/ublkd.service",
        "usr/lib/systemd/system/ublkd.service",
    ),
    (
        "deploy/debian/ublkd.service.d-debian.conf",
        "usr/lib/systemd/system/ublkd.service.d/debian.conf",
    ),
    ("deploy/systemd/ublkd.toml", "etc/ublkd/ublkd.toml"),
    ("deploy/debian/postinst", "DEBIAN/postinst"),
    ("deploy/debian/prerm", "DEBIAN/prerm"),
    ("deploy/debian/postrm", "DEBIAN/postrm"),
];

/// `cargo xtask deb`: builds the package and prints its path.
pub fn run(ws: &Path) -> Result<()> {
    let deb = build(ws)?;
    println!("package: {}", deb.display());
    let mib = fs::metadata(&deb)?.len() as f64 / (1024.0 * 1024.0);
    println!("size: {mib:.1} MiB");
    Ok(())
}

pub fn build(ws: &Path) -> Result<PathBuf> {
    let release = Release::of(ws)?;
    let bins = dist::release_build(ws)?;
    let arch = apt::output_ok(Command::new("dpkg").arg("--print-architecture"))?
        .trim()
        .to_owned();
    let out = ws.join("target/deb");
    let tree = out.join("tree");
    dist::empty_dir(&tree)?;
    for bin in ["ublkd", "ublkctl"] {
        dist::install_stripped(&bins.join(bin), &tree.join("usr/bin").join(bin))?;
    }
    for (from, to) in FILES {
        let dest = tree.join(to);
        fs::create_dir_all(dest.parent().context("no parent")?)?;
        fs::copy(ws.join(from), &dest).with_context(|| format!("copying {from}"))?;
        let script = to.starts_with("DEBIAN/");
        dist::set_mode(&dest, if script { 0o755 } else { 0o644 })?;
    }
    let doc = tree.join("usr/share/doc/ublkd");
    fs::create_dir_all(&doc)?;
    fs::write(doc.join("copyright"), copyright(&release))?;
    fs::write(tree.join("DEBIAN/conffiles"), "/etc/ublkd/ublkd.toml\n")?;
    let fields = control(&release, &arch, du_kib(&tree)?);
    fs::write(tree.join("DEBIAN/control"), fields)?;

    let deb = out.join(format!("ublkd_{}_{arch}.deb", release.version));
    apt::run_ok(
        Command::new("dpkg-deb")
            .args(["--root-owner-group", "-Zxz", "--build"])
            .arg(&tree)
            .arg(&deb)
            .env("SOURCE_DATE_EPOCH", release.epoch.to_string()),
    )
    .context("dpkg-deb could not build the package")?;
    fs::remove_dir_all(&tree)?;
    let latest = out.join("ublkd.deb");
    let _ = fs::remove_file(&latest);
    fs::hard_link(&deb, &latest)?;
    Ok(deb)
}

fn control(r: &Release, arch: &str, installed_kib: u64) -> String {
    format!(
        "Package: ublkd\n\
         Version: {version}\n\
         Architecture: {arch}\n\
         Maintainer: ublkd developers <ublkd@example.invalid>\n\
         Installed-Size: {installed_kib}\n\
         Depends: libc6 (>= 2.36), libgcc-s1, passwd\n\
         Recommends: kmod\n\
         Section: admin\n\
         Priority: optional\n\
         Homepage: {source}\n\
         Description: block volumes from userspace over the kernel's ublk driver\n \
         ublkd turns local capacity (files, RAM, NVMe namespaces) into block devices\n \
         /dev/ublkbN, managed over gRPC; ublkctl is its command-line client.\n \
         .\n \
         Built from commit {revision}. Needs a kernel with ublk_drv (see ublkd probe).\n",
        version = r.version,
        source = r.source,
        revision = r.revision,
    )
}

/// The machine-readable copyright file; the license text is Debian's own copy.
fn copyright(r: &Release) -> String {
    format!(
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\
         Upstream-Name: ublkd\n\
         Source: {}\n\
         \n\
         Files: *\n\
         Copyright: the ublkd developers\n\
         License: Apache-2.0\n \
         On Debian systems, the full text of the Apache License 2.0 is in\n \
         /usr/share/common-licenses/Apache-2.0.\n",
        r.source
    )
}

fn du_kib(dir: &Path) -> Result<u64> {
    let mut du = Command::new("du");
    let out = apt::output_ok(du.args(["-sk", "--exclude=DEBIAN"]).arg(dir))?;
    let kib = out.split_whitespace().next().and_then(|n| n.parse().ok());
    kib.context("du printed no size")
}

/// How long a scratch root is reused before it is made again from the archive.
const SCRATCH_MAX_AGE: Duration = Duration::from_secs(7 * 24 * 3600);

/// A minimal Debian root for the package test, as `target/deb/scratch-root.tar`; reused for a week.
pub fn scratch_root(ws: &Path) -> Result<PathBuf> {
    let tar = ws.join("target/deb/scratch-root.tar");
    if apt::modified_within(&tar, SCRATCH_MAX_AGE) {
        return Ok(tar);
    }
    apt::require("mmdebstrap", "mmdebstrap")?;
    fs::create_dir_all(tar.parent().context("no parent")?)?;
    let partial = tar.with_extension("partial.tar");
    eprintln!("xtask: scratch root for the package test: mmdebstrap --variant=essential");
    apt::run_ok(
        Command::new("mmdebstrap")
            .args(["--quiet", "--variant=essential", "--mode=root"])
            .arg("--include=passwd")
            .arg(dist::debian_suite()?)
            .arg(&partial)
            .arg(apt::debian_mirror()?),
    )?;
    fs::rename(&partial, &tar)?;
    Ok(tar)
}
