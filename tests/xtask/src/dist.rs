//! What the image and the Debian package share: release builds of the shipped binaries, the
//! commit's identity (version, revision, date), and archives that come out the same byte for byte
//! from the same commit.

use crate::apt;
use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// The commit being packaged: what the image labels and the package's version say.
#[derive(Debug, Clone)]
pub struct Release {
    /// The workspace version (`Cargo.toml`), e.g. `0.1.0`.
    pub version: String,
    /// The full commit hash, with `-dirty` when the work tree has uncommitted changes.
    pub revision: String,
    /// The commit's time, seconds since the epoch: every timestamp in an artifact is this one
    /// (or older), so the same commit gives the same bytes (`SOURCE_DATE_EPOCH`).
    pub epoch: u64,
    /// The repository URL (`Cargo.toml`'s `repository`).
    pub source: String,
}

impl Release {
    pub fn of(ws: &Path) -> Result<Release> {
        let manifest = std::fs::read_to_string(ws.join("Cargo.toml"))?;
        let field = |key: &str| -> Result<String> {
            manifest
                .lines()
                .find_map(|l| {
                    let (k, v) = l.split_once('=')?;
                    (k.trim() == key).then(|| v.trim().trim_matches('"').to_owned())
                })
                .with_context(|| format!("no `{key}` in the workspace Cargo.toml"))
        };
        let git = |args: &[&str]| apt::output_ok(Command::new("git").args(args).current_dir(ws));
        let mut revision = git(&["rev-parse", "HEAD"])?.trim().to_owned();
        // Untracked files do not change what is built from tracked ones, but edits do.
        let edits = git(&["status", "--porcelain", "--untracked-files=no"])?;
        if !edits.trim().is_empty() {
            revision.push_str("-dirty");
        }
        let epoch = git(&["log", "-1", "--format=%ct"])?
            .trim()
            .parse()
            .context("git log printed no commit time")?;
        Ok(Release {
            version: field("version")?,
            revision,
            epoch,
            source: field("repository")?,
        })
    }

    /// The epoch as RFC 3339 (UTC), for OCI `created` fields.
    pub fn created(&self) -> Result<String> {
        let at = format!("@{}", self.epoch);
        let date =
            apt::output_ok(Command::new("date").args(["-u", "-d", &at, "+%Y-%m-%dT%H:%M:%SZ"]))?;
        Ok(date.trim().to_owned())
    }
}

/// The Debian suite of what is built from packages (the image's base, the package test's root):
/// the build machine's own, so its glibc is the one the release binaries were linked against.
pub fn debian_suite() -> Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|s| s.trim_matches('"').to_owned())
        .filter(|s| !s.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME: which Debian suite is this?")
}

/// Every package whose release binaries something ships or runs: the node's three, and the
/// kubectl plugin.
pub const RELEASE_PACKAGES: [&str; 4] = ["ublkd-server", "ublkctl", "ublkd-csi", "kubectl-ublkd"];

/// Builds all of [`RELEASE_PACKAGES`] in release mode and returns `target/release`. Always all
/// of them, whoever asks: cargo resolves features over the packages one invocation names, so
/// the image's, the package's and the plugin's builds, each naming its own, resolved three
/// ways and compiled 369 crates where one resolution compiles 283 (k8s-openapi twice among
/// them), all in one `cargo xtask test`.
pub fn release_build(ws: &Path) -> Result<PathBuf> {
    eprintln!("xtask: release build of {}", RELEASE_PACKAGES.join(", "));
    let build = format!(
        "build --release --locked -p {}",
        RELEASE_PACKAGES.join(" -p ")
    );
    apt::run_ok(&mut crate::cargo_in(ws, &build))?;
    Ok(target_dir(ws).join("release"))
}

/// Where cargo puts what it builds: CARGO_TARGET_DIR when set (relative to the workspace),
/// else `target/`. Binaries are taken from there, never from a stale `target/`.
pub fn target_dir(ws: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or(ws.join("target"), |d| ws.join(d))
}

/// Copies a binary to `dest` without its debug information (symbols stay, for backtraces).
pub fn install_stripped(bin: &Path, dest: &Path) -> Result<()> {
    if let Some(dir) = dest.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut strip = Command::new("objcopy");
    apt::run_ok(strip.arg("--strip-debug").args([bin, dest]))
        .with_context(|| format!("stripping {}", bin.display()))?;
    set_mode(dest, 0o755)
}

/// `dir`, emptied: removed with all it holds, then made again.
pub fn empty_dir(dir: &Path) -> Result<()> {
    if dir.exists() {
        std::fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))
}

pub fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {mode:o} {}", path.display()))
}

/// Writes `dir`'s contents as an uncompressed tar that depends only on the files' names,
/// contents, modes and link targets: names sorted, owners root, times clamped to `epoch`, no
/// access or change times. Entries are named without a leading `./`, as image layers are.
pub fn reproducible_tar(dir: &Path, out: &Path, epoch: u64) -> Result<()> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .map(|e| Ok(e?.file_name().to_string_lossy().into_owned()))
        .collect::<Result<_>>()?;
    names.sort();
    if names.is_empty() {
        bail!("{} is empty: nothing to archive", dir.display());
    }
    let flags = format!(
        "--sort=name --format=posix \
         --pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime \
         --mtime=@{epoch} --clamp-mtime --owner=0 --group=0 --numeric-owner -cf"
    );
    let mut tar = Command::new("tar");
    tar.arg("-C")
        .arg(dir)
        .args(flags.split_whitespace())
        .arg(out)
        .args(&names);
    apt::run_ok(&mut tar)
}

/// The newest modification time (seconds since the epoch) of the regular files under `dir`:
/// for a tree extracted from packages, a time that depends only on the packages.
pub fn newest_file_time(dir: &Path) -> Result<u64> {
    use std::os::unix::fs::MetadataExt;
    let mut newest = 0;
    let mut stack = vec![dir.to_owned()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("reading {}", d.display()))? {
            let e = e?;
            let meta = e.path().symlink_metadata()?;
            if meta.is_dir() {
                stack.push(e.path());
            } else if meta.is_file() {
                newest = newest.max(u64::try_from(meta.mtime()).unwrap_or(0));
            }
        }
    }
    Ok(newest)
}

/// sha256 of a file, as lowercase hex.
pub fn sha256(path: &Path) -> Result<String> {
    let out = apt::output_ok(Command::new("sha256sum").arg(path))?;
    let hex = out.split_whitespace().next().map(str::to_owned);
    hex.context("sha256sum printed nothing")
}
