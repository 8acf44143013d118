//! The peers' binaries: `kublk`, the kernel's ublk selftest server, built from Debian's
//! `linux-source-<x.y>` of the guest kernel and cached per kernel version: its null and loop
//! targets. (The loop driver, dm-linear, null_blk and raw NVMe need nothing built.)

use crate::apt::{self, PrivateApt};
use crate::image::{self, Kernel};
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The kublk binary for the guest kernel, built once per kernel version from Debian's sources.
pub fn ensure_kublk(kernel: &Kernel) -> Result<PathBuf> {
    let dir = image::cache_dir().join("kublk").join(&kernel.kver);
    let bin = dir.join("kublk");
    if bin.is_file() {
        return Ok(bin);
    }
    let (series, upstream) = kernel_series(&kernel.kver)?;
    apt::require("gcc", "gcc")?;
    if !Path::new("/usr/lib/x86_64-linux-gnu/libc.a").exists() {
        apt::install_packages(&["libc6-dev"])?;
    }

    let apt = PrivateApt::new(&image::cache_dir().join("apt"))?;
    let source = format!("linux-source-{series}");
    let mut versions = find_versions(&apt, &source, &upstream)?;
    if versions.0.is_none() || versions.1.is_none() {
        apt.update()?;
        versions = find_versions(&apt, &source, &upstream)?;
    }
    let (source_version, headers_version) = versions;
    let missing = |what: &str| format!("no {what} of version {upstream} in the suites");
    let source_version = source_version.with_context(|| missing(&source))?;
    let headers_version = headers_version.with_context(|| missing("linux-libc-dev"))?;
    eprintln!("xtask: building kublk from {source} {source_version}");

    let work = dir.join("build.tmp");
    let _ = fs::remove_dir_all(&work);
    let (debs, root, src) = (work.join("debs"), work.join("root"), work.join("src"));
    fs::create_dir_all(&root)?;
    fs::create_dir_all(&src)?;
    let source_deb = format!("{source}={source_version}");
    let headers_deb = format!("linux-libc-dev={headers_version}");
    apt.download(&[source_deb, headers_deb, "liburing-dev".into()], &debs)?;
    apt::extract_debs(&debs, &root)?;
    fs::remove_dir_all(&debs)?;

    // Only the selftest and the shared selftest headers out of the 170 MB tarball.
    let usr_src = root.join("usr/src");
    let tarball = fs::read_dir(&usr_src)
        .with_context(|| format!("reading {}", usr_src.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.to_string_lossy().ends_with(".tar.xz"))
        .with_context(|| format!("no source tarball in {}", usr_src.display()))?;
    let name = tarball.file_name().unwrap_or_default().to_string_lossy();
    let top = name.trim_end_matches(".tar.xz");
    let selftests = format!("{top}/tools/testing/selftests");
    apt::run_ok(
        Command::new("tar")
            .arg("-xJf")
            .arg(&tarball)
            .arg("-C")
            .arg(&src)
            .args(["--wildcards", "--no-wildcards-match-slash"])
            .arg(format!("{selftests}/ublk"))
            .arg(format!("{selftests}/*.h")),
    )?;
    fs::remove_file(&tarball)?;

    let ublk_dir = src.join(&selftests).join("ublk");
    let mut sources = Vec::new();
    for entry in
        fs::read_dir(&ublk_dir).with_context(|| format!("reading {}", ublk_dir.display()))?
    {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "c") {
            let text = fs::read_to_string(&path)?;
            // Standalone helpers (metadata_size.c) have their own main; kublk.c is the server.
            if path.file_name().is_some_and(|n| n == "kublk.c") || !text.contains("int main(") {
                sources.push(path);
            }
        }
    }
    sources.sort();
    if !sources.iter().any(|p| p.ends_with("kublk.c")) {
        bail!("no kublk.c in {}", ublk_dir.display());
    }
    let out = work.join("kublk");
    let usr = root.join("usr");
    apt::run_ok(
        Command::new("gcc")
            .args(["-static", "-O3", "-D_GNU_SOURCE", "-Wall"])
            .arg("-isystem")
            .arg(usr.join("include"))
            .arg("-isystem")
            .arg(usr.join("include/x86_64-linux-gnu"))
            .arg("-I")
            .arg(src.join(&selftests))
            .args(&sources)
            .arg("-L")
            .arg(usr.join("lib/x86_64-linux-gnu"))
            .args(["-l:liburing.a", "-lpthread", "-lm", "-o"])
            .arg(&out),
    )?;
    fs::rename(&out, &bin).with_context(|| format!("installing {}", bin.display()))?;
    let versions = format!("{source} {source_version}\nlinux-libc-dev {headers_version}\n");
    fs::write(dir.join("versions"), versions)?;
    fs::remove_dir_all(&work)?;
    Ok(bin)
}

/// The versions of the kernel source and uapi headers packages matching `upstream`: the
/// headers of the very same version as the source when offered, else the newest of that release.
fn find_versions(
    apt: &PrivateApt,
    source: &str,
    upstream: &str,
) -> Result<(Option<String>, Option<String>)> {
    let source_version = pick_version(&apt.versions(source)?, upstream);
    let headers = apt.versions("linux-libc-dev")?;
    let headers_version = source_version
        .as_ref()
        .filter(|v| headers.contains(v))
        .cloned()
        .or_else(|| pick_version(&headers, upstream));
    Ok((source_version, headers_version))
}

/// The first (newest) version in `versions` of upstream release `upstream` (`7.3.4-1~bpo13+1`
/// for `7.3.4`).
fn pick_version(versions: &[String], upstream: &str) -> Option<String> {
    let of_release = |v: &&String| {
        v.strip_prefix(upstream)
            .is_some_and(|r| r.starts_with(['-', '+']))
    };
    versions.iter().find(of_release).cloned()
}

/// `7.3.4+deb13-amd64` → (`7.3`, `7.3.4`).
fn kernel_series(kver: &str) -> Result<(String, String)> {
    let upstream = kver.split(['+', '-']).next().unwrap_or_default();
    let parts: Vec<&str> = upstream.split('.').collect();
    if parts.len() < 2 || parts.iter().any(|p| p.parse::<u64>().is_err()) {
        bail!("odd kernel version {kver:?}");
    }
    Ok((parts[..2].join("."), upstream.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_release_maps_to_its_source_package() {
        let series = kernel_series("7.3.4+deb13-amd64").unwrap();
        assert_eq!((series.0.as_str(), series.1.as_str()), ("7.3", "7.3.4"));
        assert!(kernel_series("amd64").is_err());
        let versions = ["7.3.40-1", "7.3.4-2~bpo13+1", "7.3.4-1~bpo13+1"].map(String::from);
        assert_eq!(
            pick_version(&versions, "7.3.4").as_deref(),
            Some("7.3.4-2~bpo13+1")
        );
        assert_eq!(pick_version(&versions, "7.3.5"), None);
    }
}
