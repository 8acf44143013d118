//! `cargo xtask bench --baseline REV`: the baseline's ublkd, built in release mode once per
//! commit and cached: a detached worktree under `target/baseline/src/<sha>`, one shared target
//! directory (`target/baseline/target`, so dependencies build once), the binary kept at
//! `target/baseline/bin/<sha>/ublkd`. `work` is the working tree, rebuilt.

use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The label and binary of `rev`, built once per commit (`work`: the working tree, rebuilt).
pub fn build(ws: &Path, rev: &str) -> Result<(String, PathBuf)> {
    let root = ws.join("target/baseline");
    if rev == "work" {
        let status = crate::cargo()
            .current_dir(ws)
            .args(["build", "--release", "--package", "ublkd-server"])
            .status()
            .context("running cargo build --release")?;
        if !status.success() {
            bail!("building the working tree's ublkd failed ({status})");
        }
        return Ok(("work".into(), ws.join("target/release/ublkd")));
    }
    let out = Command::new("git")
        .current_dir(ws)
        .args(["rev-parse", "--short=9", &format!("{rev}^{{commit}}")])
        .output()
        .context("running git rev-parse")?;
    if !out.status.success() {
        bail!(
            "{rev} is not a commit: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let sha = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let bin = root.join("bin").join(&sha).join("ublkd");
    if bin.is_file() {
        return Ok((sha, bin));
    }
    let src = root.join("src").join(&sha);
    if !src.join("Cargo.toml").is_file() {
        fs::create_dir_all(root.join("src"))?;
        let status = Command::new("git")
            .current_dir(ws)
            .args(["worktree", "add", "--force", "--detach"])
            .arg(&src)
            .arg(&sha)
            .status()
            .context("running git worktree add")?;
        if !status.success() {
            bail!("git worktree add {sha} failed ({status})");
        }
    }
    eprintln!("xtask: bench: building the baseline ublkd at {sha} (release)");
    let status = crate::cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", root.join("target"))
        .args(["build", "--release", "--package", "ublkd-server"])
        .status()
        .context("running cargo build --release")?;
    if !status.success() {
        bail!("building ublkd at {sha} failed ({status})");
    }
    fs::create_dir_all(bin.parent().context("no bin dir")?)?;
    fs::copy(root.join("target/release/ublkd"), &bin)
        .with_context(|| format!("keeping the binary of {sha}"))?;
    Ok((sha, bin))
}
