//! Go tools the tests drive, built from their modules with `go install`, pinned to a release and
//! cached by version like the guest kernel.
//!
//! Cache layout (under `UBLKD_VM_CACHE`):
//! - `go/<binary>@<version>/<binary>`  one statically linked binary per tool and version
//!
//! The module proxy is whatever this machine's Go environment names (`go env GOPROXY`); nothing
//! here names a host. The guest sees the cache through the read-only host root, so a binary
//! installed here runs inside the VM unchanged.

use crate::apt;
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::PathBuf;
use std::process::Command;

/// One Go command to install: `go install <package>@<version>`, producing `<binary>`.
#[derive(Debug, Clone, Copy)]
pub struct GoTool {
    pub package: &'static str,
    pub version: &'static str,
    pub binary: &'static str,
}

/// The CSI conformance suite. v5.4.0 is the newest release the module proxy serves that builds
/// with this machine's Go.
pub const CSI_SANITY: GoTool = GoTool {
    package: "github.com/kubernetes-csi/csi-test/v5/cmd/csi-sanity",
    version: "v5.4.0",
    binary: "csi-sanity",
};

impl GoTool {
    fn cached(&self) -> PathBuf {
        crate::image::cache_dir()
            .join("go")
            .join(format!("{}@{}", self.binary, self.version))
            .join(self.binary)
    }
}

/// The `go` command: on PATH, or where the Go distribution installs itself.
pub fn go() -> Result<PathBuf> {
    if let Some(p) = apt::which("go") {
        return Ok(p);
    }
    let default = PathBuf::from("/usr/local/go/bin/go");
    if default.is_file() {
        return Ok(default);
    }
    bail!("the go command is not installed (not on PATH, not /usr/local/go/bin/go)")
}

/// The tool's binary, installed first when this version is not cached yet.
pub fn ensure(tool: GoTool) -> Result<PathBuf> {
    let bin = tool.cached();
    if bin.is_file() {
        return Ok(bin);
    }
    let dir = bin.parent().context("tool cache path has no parent")?;
    let staging = dir.with_extension("partial");
    if staging.exists() {
        fs::remove_dir_all(&staging).with_context(|| format!("removing {}", staging.display()))?;
    }
    fs::create_dir_all(&staging).with_context(|| format!("creating {}", staging.display()))?;
    eprintln!(
        "xtask: installing {}@{} with go install (cached in {})",
        tool.package,
        tool.version,
        dir.display()
    );
    let started = std::time::Instant::now();
    let status = Command::new(go()?)
        .args(["install", &format!("{}@{}", tool.package, tool.version)])
        .env("GOBIN", &staging)
        // Static, so the guest runs it whatever its libc.
        .env("CGO_ENABLED", "0")
        .status()
        .context("running go install")?;
    if !status.success() {
        bail!(
            "go install {}@{} failed ({status}); the module proxy this machine's Go names \
             (go env GOPROXY) must serve it",
            tool.package,
            tool.version
        );
    }
    let built = staging.join(tool.binary);
    if !built.is_file() {
        bail!(
            "go install left no {} in {}",
            tool.binary,
            staging.display()
        );
    }
    if dir.exists() {
        fs::remove_dir_all(dir).with_context(|| format!("removing {}", dir.display()))?;
    }
    fs::rename(&staging, dir).with_context(|| format!("moving {} into place", dir.display()))?;
    eprintln!(
        "xtask: {}@{} installed in {:.1} s",
        tool.binary,
        tool.version,
        started.elapsed().as_secs_f64()
    );
    Ok(bin)
}
