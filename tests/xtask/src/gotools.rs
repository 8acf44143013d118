//! Go tools the tests drive, built from their modules with `go install`, pinned to a release and
//! cached by version like the guest kernel.
//! Cache layout (under `UBLKD_VM_CACHE`):
//! - `go/<binary>@<version>/<binary>`  one statically linked binary per tool and version
//!
//! The module proxy is whatever this machine's Go environment names (`go env GOPROXY`); nothing
//! here names a host. The guest sees the cache through the read-only host root, so a binary
//! installed here runs inside the VM unchanged.

use crate::apt;
use anyhow::{ensure, Context, Result};
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

/// The `go` command: on PATH, or where the Go distribution installs itself.
pub fn go() -> Result<PathBuf> {
    let default = PathBuf::from("/usr/local/go/bin/go");
    apt::which("go")
        .or_else(|| default.is_file().then_some(default))
        .context("the go command is not installed (not on PATH, not /usr/local/go/bin/go)")
}

/// The tool's binary, installed first when this version is not cached yet.
pub fn ensure(tool: GoTool) -> Result<PathBuf> {
    let name = format!("{}@{}", tool.binary, tool.version);
    let dir = crate::image::cache_dir().join("go").join(&name);
    let bin = dir.join(tool.binary);
    if bin.is_file() {
        return Ok(bin);
    }
    let staging = dir.with_extension("partial");
    crate::dist::empty_dir(&staging)?;
    let at = format!("{}@{}", tool.package, tool.version);
    let cached = dir.display();
    eprintln!("xtask: installing {at} with go install (cached in {cached})");
    let started = std::time::Instant::now();
    apt::run_ok(
        Command::new(go()?)
            .args(["install", &at])
            .env("GOBIN", &staging)
            // Static, so the guest runs it whatever its libc.
            .env("CGO_ENABLED", "0"),
    )
    .context("the module proxy this machine's Go names (go env GOPROXY) must serve it")?;
    let built = staging.join(tool.binary);
    ensure!(built.is_file(), "go install left no {}", built.display());
    let _ = fs::remove_dir_all(&dir); // a stale build, if any: the rename says what went wrong
    fs::rename(&staging, &dir).with_context(|| format!("moving {} into place", dir.display()))?;
    let secs = started.elapsed().as_secs_f64();
    eprintln!("xtask: {name} installed in {secs:.1} s");
    Ok(bin)
}
