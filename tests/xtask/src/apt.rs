//! Debian packages: the host's own prerequisites (installed with apt when missing) and a private
//! apt setup that reads newer suites to find and download a guest kernel.
//! The mirror is never written down here: it is read at run time from the machine's own apt
//! sources, so the harness follows whatever mirror or proxy the machine is configured with.

use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, SystemTime};

/// Suites searched for a guest kernel, newest first in spirit; the newest version wins anyway.
const KERNEL_SUITES: &[&str] = &["trixie-backports", "trixie", "sid"];

/// Host commands the harness needs, with the Debian package that provides each.
const HOST_TOOLS: &[(&str, &str)] = &[
    ("qemu-system-x86_64", "qemu-system-x86"),
    ("busybox", "busybox-static"),
    ("depmod", "kmod"),
    ("xz", "xz-utils"),
    ("fio", "fio"),
    // the bench's encrypted file case (LUKS2, as the CSI driver opens it)
    ("cryptsetup", "cryptsetup-bin"),
    // the bench's LVM-style peer (a linear device-mapper volume on the namespace)
    ("dmsetup", "dmsetup"),
    ("mkfs.ext4", "e2fsprogs"),
    // The CSI driver's xfs volumes (mkfs, grow) in the VM tests.
    ("mkfs.xfs", "xfsprogs"),
    ("xfs_growfs", "xfsprogs"),
    ("blkdiscard", "util-linux"),
    ("timeout", "coreutils"),
    // A real Prometheus (and promtool) for the observability test and the alert-rule tests.
    ("prometheus", "prometheus"),
    ("promtool", "prometheus"),
    // The host tests check every shell script in the repository with it.
    ("shellcheck", "shellcheck"),
];

/// Installs whatever host packages are missing; does nothing (and downloads nothing) when all are
/// there.
pub fn ensure_host_tools() -> Result<()> {
    ensure_tools(HOST_TOOLS)?;
    // The initramfs needs a static busybox; a dynamic one from another package would not run.
    if !busybox_is_static() {
        install_packages(&["busybox-static"])?;
    }
    Ok(())
}

/// Installs the packages of the `(command, package)` pairs whose command is not found.
pub fn ensure_tools(tools: &[(&str, &str)]) -> Result<()> {
    let mut missing: Vec<&str> = tools
        .iter()
        .filter(|(cmd, _)| which(cmd).is_none())
        .map(|(_, pkg)| *pkg)
        .collect();
    missing.dedup();
    install_packages(&missing)
}

/// The full path of `cmd`, its Debian `package` installed first when it is not found: a tool a
/// check needs is installed, never skipped.
pub fn require(cmd: &str, package: &str) -> Result<PathBuf> {
    if which(cmd).is_none() {
        install_packages(&[package])?;
    }
    which(cmd).with_context(|| format!("{cmd} not found after installing {package}"))
}

/// Installs Debian packages on the host with apt-get, refreshing the package lists once when the
/// first attempt fails; does nothing for an empty list.
pub fn install_packages(missing: &[&str]) -> Result<()> {
    if missing.is_empty() {
        return Ok(());
    }
    eprintln!("xtask: installing host packages: {}", missing.join(" "));
    let install = |quiet_update: bool| -> Result<bool> {
        if quiet_update {
            run_ok(Command::new("apt-get").args(["update", "-qq"]))?;
        }
        let status = Command::new("apt-get")
            .args(["install", "-y", "-qq", "--no-install-recommends"])
            .args(missing)
            .env("DEBIAN_FRONTEND", "noninteractive")
            .status()
            .context("running apt-get (is this a Debian machine, and are we root?)")?;
        Ok(status.success())
    };
    if !install(false)? && !install(true)? {
        bail!("apt-get install {} failed", missing.join(" "));
    }
    Ok(())
}

fn busybox_is_static() -> bool {
    let Some(path) = which("busybox") else {
        return false;
    };
    // A static ELF has no PT_INTERP; `ldd` says "not a dynamic executable".
    Command::new("ldd").arg(&path).output().is_ok_and(|o| {
        let text = [o.stdout, o.stderr].concat();
        let text = String::from_utf8_lossy(&text);
        text.contains("not a dynamic executable") || text.contains("statically linked")
    })
}

/// Full path of `cmd` on PATH (plus the sbin directories root uses).
pub fn which(cmd: &str) -> Option<PathBuf> {
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/sbin", "/sbin", "/usr/bin", "/bin"])
        .map(|d| Path::new(d).join(cmd))
        .find(|p| p.is_file());
    found
}

/// Whether `path` exists and was modified less than `age` ago: a cached file still fresh.
pub fn modified_within(path: &Path, age: Duration) -> bool {
    fs::metadata(path)
        .and_then(|m| m.modified())
        .ok()
        .and_then(|t| SystemTime::now().duration_since(t).ok())
        .is_some_and(|a| a < age)
}

/// Extracts every `.deb` in `dir` into `root` (`dpkg-deb -x`: no maintainer script runs), in
/// name order.
pub fn extract_debs(dir: &Path, root: &Path) -> Result<()> {
    let mut debs = Vec::new();
    for entry in fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        debs.extend(Some(entry?.path()).filter(|p| p.extension().is_some_and(|e| e == "deb")));
    }
    debs.sort();
    for deb in debs {
        run_ok(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root))?;
    }
    Ok(())
}

pub fn run_ok(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

pub fn output_ok(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The Debian archive URI this machine's apt uses (not the security archive).
pub fn debian_mirror() -> Result<String> {
    let mut files = vec![PathBuf::from("/etc/apt/sources.list")];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut more: Vec<PathBuf> = dir
            .filter_map(|e| Some(e.ok()?.path()))
            .filter(|p| p.extension().is_some_and(|e| e == "sources" || e == "list"))
            .collect();
        more.sort();
        files.extend(more);
    }
    let mut candidates = Vec::new();
    for text in files.iter().filter_map(|f| fs::read_to_string(f).ok()) {
        for line in text.lines() {
            let line = line.trim();
            if let Some(rest) = line.strip_prefix("URIs:") {
                candidates.extend(rest.split_whitespace().map(str::to_owned));
            } else if let Some(rest) = line.strip_prefix("deb ") {
                // deb [options] URI suite components
                let mut words = rest.split_whitespace().peekable();
                if words.peek().is_some_and(|w| w.starts_with('[')) {
                    words.by_ref().find(|w| w.ends_with(']'));
                }
                if let Some(uri) = words.next() {
                    candidates.push(uri.to_owned());
                }
            }
        }
    }
    candidates
        .into_iter()
        .find(|u| {
            let u = u.trim_end_matches('/');
            u.ends_with("/debian") && !u.contains("security")
        })
        .context("no Debian archive found in /etc/apt/sources.list{,.d}")
}

/// A private apt configuration under `dir` that reads the kernel suites without touching the
/// machine's own apt state.
#[derive(Debug)]
pub struct PrivateApt {
    dir: PathBuf,
}

impl PrivateApt {
    pub fn new(dir: &Path) -> Result<Self> {
        for sub in ["lists/partial", "cache/archives/partial"] {
            fs::create_dir_all(dir.join(sub))?;
        }
        let status = dir.join("status");
        if !status.exists() {
            fs::write(&status, "")?;
        }
        let mirror = debian_mirror()?;
        let keyring = "/usr/share/keyrings/debian-archive-keyring.gpg";
        let sources: String = KERNEL_SUITES
            .iter()
            .map(|s| format!("deb [signed-by={keyring}] {mirror} {s} main\n"))
            .collect();
        fs::write(dir.join("sources.list"), sources)?;
        Ok(Self {
            dir: dir.to_owned(),
        })
    }

    /// `prog` (apt-get, apt-cache) reading this configuration only.
    fn command(&self, prog: &str) -> Command {
        let d = self.dir.display();
        let mut c = Command::new(prog);
        c.arg(format!("-oDir::Etc::SourceList={d}/sources.list"))
            .arg("-oDir::Etc::SourceParts=/nonexistent")
            .arg(format!("-oDir::State::Lists={d}/lists"))
            .arg(format!("-oDir::Cache={d}/cache"))
            .arg(format!("-oDir::State::status={d}/status"))
            .args(["-oDebug::NoLocking=1", "-oAPT::Architecture=amd64"])
            .arg("-oAPT::Sandbox::User=root");
        c
    }

    pub fn update(&self) -> Result<()> {
        let suites = KERNEL_SUITES.join(", ");
        eprintln!("xtask: reading kernel suites ({suites})");
        run_ok(self.command("apt-get").args(["update", "-qq"]))
    }

    /// Package names matching an apt-cache regex.
    pub fn search_names(&self, regex: &str) -> Result<Vec<String>> {
        let search = ["search", "--names-only", regex];
        let out = output_ok(self.command("apt-cache").args(search))?;
        Ok(out
            .lines()
            .filter_map(|l| l.split(" - ").next())
            .map(str::to_owned)
            .collect())
    }

    /// Every version of `name` the suites offer, in apt's order (newest first).
    pub fn versions(&self, name: &str) -> Result<Vec<String>> {
        let out = output_ok(self.command("apt-cache").args(["madison", name]))?;
        Ok(out
            .lines()
            .filter_map(|l| l.split('|').nth(1))
            .map(|v| v.trim().to_owned())
            .collect())
    }

    /// Downloads `packages` into `dest` (apt-get download; newest version of each).
    pub fn download(&self, packages: &[String], dest: &Path) -> Result<()> {
        fs::create_dir_all(dest)?;
        eprintln!("xtask: downloading {}", packages.join(" "));
        let mut c = self.command("apt-get");
        run_ok(c.current_dir(dest).args(["download", "-qq"]).args(packages))
    }
}

/// A kernel release string such as `7.3.4+deb13-amd64` as numbers (7, 3, 4).
pub fn kver_numbers(kver: &str) -> Vec<u64> {
    kver.split(['+', '-'])
        .next()
        .unwrap_or("")
        .split('.')
        .map(|p| p.parse().unwrap_or(0))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_versions_compare_numerically() {
        assert_eq!(kver_numbers("7.3.4+deb13-amd64"), vec![7, 3, 4]);
        assert!(kver_numbers("7.10.1+deb13-amd64") > kver_numbers("7.9.12+deb13-amd64"));
        assert!(kver_numbers("7.1.3+deb13-amd64") >= vec![7, 1]);
        assert!(kver_numbers("6.19.14+deb13-amd64") < vec![7, 1]);
    }
}
