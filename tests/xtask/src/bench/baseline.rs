//! `cargo xtask bench --baseline REV`: the baseline's ublkd, built in release mode once per
//! commit and cached: a detached worktree under `target/baseline/src/<sha>`, one shared target
//! directory (`target/baseline/target`, so dependencies build once), the binary kept at
//! `target/baseline/bin/<sha>/ublkd`. `work` is the working tree, rebuilt.

use crate::apt;
use anyhow::{Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The label and binary of `rev`, built once per commit (`work`: the working tree, rebuilt).
pub fn build(ws: &Path, rev: &str) -> Result<(String, PathBuf)> {
    let root = ws.join("target/baseline");
    let release = |dir: &Path| crate::cargo_in(dir, "build --release --package ublkd-server");
    if rev == "work" {
        apt::run_ok(&mut release(ws)).context("building the working tree's ublkd")?;
        let bin = crate::dist::target_dir(ws).join("release/ublkd");
        return Ok(("work".into(), bin));
    }
    let git = |args: &[&str]| {
        let mut c = Command::new("git");
        c.current_dir(ws).args(args);
        c
    };
    let commit = format!("{rev}^{{commit}}");
    let sha = apt::output_ok(&mut git(&["rev-parse", "--short=9", &commit]))
        .with_context(|| format!("{rev} is not a commit"))?;
    let sha = sha.trim().to_owned();
    let bin = root.join("bin").join(&sha).join("ublkd");
    if bin.is_file() {
        return Ok((sha, bin));
    }
    let src = root.join("src").join(&sha);
    if !src.join("Cargo.toml").is_file() {
        fs::create_dir_all(root.join("src"))?;
        let mut add = git(&["worktree", "add", "--force", "--detach"]);
        apt::run_ok(add.arg(&src).arg(&sha))?;
    }
    eprintln!("xtask: bench: building the baseline ublkd at {sha} (release)");
    let target = root.join("target");
    apt::run_ok(release(&src).env("CARGO_TARGET_DIR", &target))
        .with_context(|| format!("building ublkd at {sha}"))?;
    fs::create_dir_all(bin.parent().context("no bin dir")?)?;
    fs::copy(target.join("release/ublkd"), &bin)
        .with_context(|| format!("keeping the binary of {sha}"))?;
    Ok((sha, bin))
}
