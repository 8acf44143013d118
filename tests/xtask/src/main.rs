//! `cargo xtask`: ublkd's task runner.
//!
//! What it is: the VM harness (fetch a Debian kernel that has `ublk_drv` and `nvme`, build an
//! initramfs, boot QEMU with an emulated NVMe controller, run commands and test binaries inside)
//! and the project's top-level commands: `test`, `vm-test`, `vm-run`, `demo`, `bench`.
//! What it is not: shipped code. Nothing here is linked into ublkd.
#![forbid(unsafe_code)]

mod apt;
mod bench;
mod compare;
mod cpio;
mod deb;
mod deploy;
mod dist;
mod gotools;
mod image;
#[cfg(test)]
mod imports;
mod k8s;
mod oci;
mod suite;
mod vm;

use anyhow::{bail, Context, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

const USAGE: &str = "\
usage: cargo xtask <command>

commands:
  test               host tests (cargo test --workspace), the whole VM suite, then the
                     Kubernetes tier (every k8s-test scenario)
  vm-test [FILTER]   the VM suite alone; FILTER selects tests whose name contains it,
                     or a whole test file (e.g. daemon, dataplane, kernel, nvme, recovery);
                     several, comma-separated, select the tests any of them selects
  vm-run [--timeout SECS] [--multipath] [--writable-root] -- CMD...
                     boot the VM, run CMD inside (host root read-only, chroot), return its exit code
  k8s-test [SCENARIO...]
                     a one-node Kubernetes 1.35 cluster in the VM (built from its Go modules),
                     deploy/kubernetes applied as a user would, then the scenarios (all by default)
  demo               boot the VM, start ublkd, drive it with ublkctl: volumes, ext4, fio,
                     resize, stats, metrics
  image [--check]    build the container image (OCI layout, no daemon, no base pulled):
                     target/image/ublkd-oci.tar; --check builds it twice and compares digests
  deb                build the Debian package of ublkd and ublkctl: target/deb/ublkd.deb
  compare [--runtime S] REV[+FLAG...] REV[+FLAG...]...
                     ublkd at several commits (or `work`, the working tree) against each other
                     in one boot: fio 4 KiB QD32 and QD1 on a null volume, builds interleaved;
                     FLAGs go to that build's `ublkd run` (work+--placement=same-cpu);
                     target/compare/results.json
  prepare            fetch the kernel and build the initramfs (what the others do first)
  manifests          render deploy/kubernetes and every overlay under deploy/overlays with
                     kubectl kustomize and check them (a part of test's host tests)
  bench [--baseline REV] [--only SUBSTR]
                     in one boot: ublkd vs kublk, loop and null_blk under fio; control-plane
                     latency and RSS; recovery time and I/O stall; writes target/bench/results.json (UBLKD_BENCH_RUNTIME: seconds per job, default 5;
                     UBLKD_BENCH_UBLKD: a ublkd binary to measure instead of a release build);
                     --baseline REV also runs every ublkd case with REV's ublkd (built and cached
                     as compare does), interleaved A B B A, and reports new/baseline per case;
                     --only SUBSTR runs only the fio cases whose name contains SUBSTR (and
                     skips the control-plane, CSI, QoS, snapshot and recovery sections)

environment:
  UBLKD_VM_CACHE     cache directory (default ~/.cache/ublkd-vm)
  UBLKD_VM_REFRESH=1 look for a newer kernel now instead of using the one resolved this week
  UBLKD_VM_KVER      pin the guest kernel version (e.g. 7.3.4+deb13-amd64)
  UBLKD_VM_ACCEL     kvm or tcg (default: kvm when a probe boot works, else tcg)
  UBLKD_VM_CPU       QEMU's -cpu model under TCG (default: max)
  UBLKD_VM_VERBOSE=1 echo the guest console while it runs
";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match run(&args) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(args: &[String]) -> Result<ExitCode> {
    let ws = workspace_root()?;
    match args.first().map(String::as_str) {
        Some("test") => {
            host_tests(&ws)?;
            let outcome = suite::run(&ws, None)?;
            let tier = k8s::run_tier(&ws, &[])?;
            // Both summaries last, the VM suite's failures with their reasons: all a CI log's
            // tail keeps.
            println!("\nVM suite:\n{}", outcome.summary());
            println!("{}", tier.summary);
            let ok = outcome.ok() && tier.ok();
            Ok(if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            })
        }
        Some("vm-test") => {
            let filter = args.get(1).map(String::as_str);
            let outcome = suite::run(&ws, filter)?;
            Ok(outcome.exit_code())
        }
        Some("vm-run") => vm_run(&ws, &args[1..]),
        Some("k8s-test") => k8s::run(&ws, &args[1..]),
        Some("demo") => demo(&ws),
        Some("bench") => bench::run(&ws, &args[1..]),
        Some("compare") => compare::run(&ws, &args[1..]),
        Some("deb") => {
            deb::run(&ws)?;
            Ok(ExitCode::SUCCESS)
        }
        Some("image") => {
            oci::run(&ws, &args[1..])?;
            Ok(ExitCode::SUCCESS)
        }
        Some("manifests") => {
            deploy::manifest_checks(&ws)?;
            eprintln!("xtask: manifests: all render and pass their checks");
            Ok(ExitCode::SUCCESS)
        }
        Some("prepare") => {
            let kernel = image::prepare(&ws)?;
            println!("kernel {} ready: {}", kernel.kver, kernel.vmlinuz.display());
            println!("initramfs: {}", kernel.initramfs.display());
            Ok(ExitCode::SUCCESS)
        }
        Some("-h") | Some("--help") | Some("help") => {
            print!("{USAGE}");
            Ok(ExitCode::SUCCESS)
        }
        _ => {
            eprint!("{USAGE}");
            Ok(ExitCode::from(2))
        }
    }
}

/// The workspace root: two levels above this crate's manifest.
fn workspace_root() -> Result<PathBuf> {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = manifest
        .ancestors()
        .nth(2)
        .context("xtask manifest is not two levels below the workspace")?;
    Ok(root.to_path_buf())
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

fn host_tests(ws: &Path) -> Result<()> {
    eprintln!("xtask: host tests: cargo test --workspace");
    let status = cargo()
        .current_dir(ws)
        .args(["test", "--workspace"])
        .status()
        .context("running cargo test")?;
    if !status.success() {
        bail!("host tests failed ({status})");
    }
    alert_rule_tests(ws)?;
    deploy::manifest_checks(ws)?;
    shell_script_checks(ws)
}

/// The Prometheus alert rules shipped in deploy/prometheus: checked and unit-tested with
/// promtool (Debian's `prometheus` package, installed when missing; never skipped).
fn alert_rule_tests(ws: &Path) -> Result<()> {
    if apt::which("promtool").is_none() {
        apt::install_packages(&["prometheus"])?;
    }
    let promtool =
        apt::which("promtool").context("promtool not found after installing prometheus")?;
    let dir = ws.join("deploy/prometheus");
    eprintln!("xtask: alert rules: promtool check rules, promtool test rules");
    for args in [
        ["check", "rules", "ublkd-rules.yaml"],
        ["test", "rules", "ublkd-rules.test.yaml"],
    ] {
        let status = Command::new(&promtool)
            .args(args)
            .current_dir(&dir)
            .status()
            .context("running promtool")?;
        if !status.success() {
            bail!("promtool {} failed ({status})", args.join(" "));
        }
    }
    Ok(())
}

/// Every shell script in the repository, checked with shellcheck (Debian's `shellcheck` package,
/// installed when missing; never skipped). Each names its dialect, which shellcheck requires: a
/// `#!` line (`.ci/run`), or a `# shellcheck shell=` directive where a shell reads the file
/// (the guest's /init under busybox sh, the demo under `bash -s`, the bench under /bin/sh).
fn shell_script_checks(ws: &Path) -> Result<()> {
    let scripts = shell_scripts(ws)?;
    if scripts.is_empty() {
        bail!("no shell scripts found to check in {}", ws.display());
    }
    if apt::which("shellcheck").is_none() {
        apt::install_packages(&["shellcheck"])?;
    }
    let shellcheck =
        apt::which("shellcheck").context("shellcheck not found after installing shellcheck")?;
    let names: Vec<String> = scripts.iter().map(|p| p.display().to_string()).collect();
    eprintln!("xtask: shell scripts: shellcheck {}", names.join(" "));
    let status = Command::new(&shellcheck)
        .args(&scripts)
        .current_dir(ws)
        .status()
        .context("running shellcheck")?;
    if !status.success() {
        bail!(
            "shellcheck found problems in {} ({status}): fix them, or disable a check on its line \
             with `# shellcheck disable=SCxxxx` and a comment saying why",
            names.join(" ")
        );
    }
    Ok(())
}

/// The repository's shell scripts, relative to `ws` and sorted: the files git lists (tracked, or
/// new and not ignored, so never `target/`) that end in `.sh` or start with a `#!` line naming a
/// shell (`.ci/run`).
fn shell_scripts(ws: &Path) -> Result<Vec<PathBuf>> {
    use std::io::Read;
    use std::os::unix::ffi::OsStrExt;

    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ])
        .current_dir(ws)
        .output()
        .context("running git ls-files (the shell script check lists the repository's files)")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed in {} ({}): {}",
            ws.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let mut scripts = Vec::new();
    for name in out.stdout.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        let rel = PathBuf::from(std::ffi::OsStr::from_bytes(name));
        let path = ws.join(&rel);
        // Listed but not a file here: deleted in the work tree, or a submodule.
        if !path.is_file() {
            continue;
        }
        let script = if rel.extension().is_some_and(|e| e == "sh") {
            true
        } else {
            let mut head = Vec::new();
            std::fs::File::open(&path)
                .and_then(|f| f.take(256).read_to_end(&mut head))
                .with_context(|| format!("reading {}", path.display()))?;
            shebang_names_shell(&head)
        };
        if script {
            scripts.push(rel);
        }
    }
    scripts.sort();
    scripts.dedup();
    Ok(scripts)
}

/// Whether a file that starts with `head` is a script for a shell shellcheck knows:
/// `#!/bin/sh`, `#!/usr/bin/env bash`, `#!/bin/busybox sh` and the like.
fn shebang_names_shell(head: &[u8]) -> bool {
    let Some(rest) = head.strip_prefix(b"#!") else {
        return false;
    };
    let line = rest.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut words = line
        .split_whitespace()
        .map(|w| w.rsplit_once('/').map_or(w, |(_, base)| base));
    let mut program = words.next();
    // `env` and `busybox` run the program a later word names (after env's options and settings).
    while matches!(program, Some("env" | "busybox")) {
        program = words.find(|w| !w.starts_with('-') && !w.contains('='));
    }
    matches!(program, Some("sh" | "ash" | "dash" | "bash" | "ksh"))
}

fn vm_run(ws: &Path, args: &[String]) -> Result<ExitCode> {
    let mut timeout = 600u64;
    let mut multipath = false;
    let mut writable_root = false;
    let mut rest = args;
    while let Some(first) = rest.first() {
        match first.as_str() {
            "--timeout" => {
                let v = rest.get(1).context("--timeout needs a number of seconds")?;
                timeout = v.parse().with_context(|| format!("bad --timeout {v:?}"))?;
                rest = &rest[2..];
            }
            "--multipath" => {
                multipath = true;
                rest = &rest[1..];
            }
            "--writable-root" => {
                writable_root = true;
                rest = &rest[1..];
            }
            "--" => {
                rest = &rest[1..];
                break;
            }
            _ => break,
        }
    }
    if rest.is_empty() {
        bail!("vm-run needs a command: cargo xtask vm-run -- CMD...");
    }
    let script = rest
        .iter()
        .map(|a| vm::shell_quote(a))
        .collect::<Vec<_>>()
        .join(" ");
    let kernel = image::prepare(ws)?;
    let run = vm::Vm::new(ws, &kernel)?
        .timeout_secs(timeout)
        .multipath(multipath)
        .writable_root(writable_root)
        .echo(true)
        .run(&script)?;
    match &run.exit {
        vm::Exit::Code(c) => Ok(ExitCode::from(
            u8::try_from((*c).clamp(0, 255)).unwrap_or(1),
        )),
        other => {
            eprintln!(
                "xtask: guest {other}; console tail:\n{}",
                run.console_tail(40)
            );
            Ok(ExitCode::FAILURE)
        }
    }
}

fn demo(ws: &Path) -> Result<ExitCode> {
    suite::build_node_binaries(ws, &[])?;
    let bin = |name: &str| vm::shell_quote(&ws.join("target/debug").join(name).to_string_lossy());
    let kernel = image::prepare(ws)?;
    // /dev/tcp in the script needs bash; the guest runs the host's shells.
    let script = format!(
        "export UBLKD={} UBLKCTL={} UBLKD_CSI={}\nexec bash -s <<'DEMO'\n{}DEMO\n",
        bin("ublkd"),
        bin("ublkctl"),
        bin("ublkd-csi"),
        include_str!("demo.sh")
    );
    let run = vm::Vm::new(ws, &kernel)?
        .timeout_secs(600)
        .echo(true)
        .run(&script)?;
    match run.exit {
        vm::Exit::Code(0) => Ok(ExitCode::SUCCESS),
        other => {
            eprintln!("xtask: demo failed: guest {other}");
            Ok(ExitCode::FAILURE)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shebangs_that_name_a_shell() {
        for head in [
            "#!/bin/sh\n",
            "#!/bin/bash -e\necho",
            "#! /usr/bin/env bash\n",
            "#!/usr/bin/env -S LC_ALL=C dash -e\n",
            "#!/bin/busybox sh\n",
            "#!/bin/ksh",
        ] {
            assert!(shebang_names_shell(head.as_bytes()), "{head:?}");
        }
        for head in [
            "",
            "# shellcheck shell=sh\n",
            "#!/usr/bin/env python3\n",
            "#!/usr/bin/zsh\n",
            "#!/usr/bin/env\n",
            "echo #!/bin/sh\n",
            "#![allow(dead_code)]\n",
        ] {
            assert!(!shebang_names_shell(head.as_bytes()), "{head:?}");
        }
    }

    /// The listing `shell_script_checks` hands to shellcheck, on this repository.
    #[test]
    fn the_repository_shell_scripts_are_found() {
        let ws = workspace_root().unwrap();
        let scripts = shell_scripts(&ws).unwrap();
        for expected in [
            ".ci/run",
            "tests/xtask/src/demo.sh",
            "tests/xtask/src/init.sh",
        ] {
            assert!(
                scripts.iter().any(|p| p == Path::new(expected)),
                "{expected} not in {scripts:?}"
            );
        }
        for p in &scripts {
            assert!(ws.join(p).is_file(), "{}", p.display());
            assert!(!p.starts_with("target"), "{}", p.display());
            assert!(p.extension().is_none_or(|e| e == "sh"), "{}", p.display());
        }
    }
}
