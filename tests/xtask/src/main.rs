//! `cargo xtask`: ublkd's task runner.
//! What it is: the VM harness (fetch a Debian kernel that has `ublk_drv` and `nvme`, build an
//! initramfs, boot QEMU with an emulated NVMe controller, run commands and test binaries inside)
//! and the project's top-level commands: `test`, `vm-test`, `vm-run`, `demo`, `bench`.
//! What it is not: shipped code. Nothing here is linked into ublkd.
#![forbid(unsafe_code)]

mod apt;
mod bench;
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
use clap::{Parser, Subcommand};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::Instant;

/// What `--help` adds below the commands: the environment every VM command reads.
const ENVIRONMENT: &str = "\
environment:
  UBLKD_VM_CACHE     cache directory (default ~/.cache/ublkd-vm)
  UBLKD_VM_REFRESH=1 look for a newer kernel now instead of using the one resolved this week
  UBLKD_VM_KVER      pin the guest kernel version (e.g. 7.3.4+deb13-amd64)
  UBLKD_VM_ACCEL     kvm or tcg (default: kvm when a probe boot works, else tcg)
  UBLKD_VM_CPU       QEMU's -cpu model under TCG (default: max)
  UBLKD_VM_VERBOSE=1 echo the guest console while it runs
  UBLKD_K8S_NODES    the Kubernetes tier's nodes, each its own VM: 1 (default) or 2";

/// ublkd's task runner: the VM harness, the test suites, the demo, the bench, packaging.
#[derive(Debug, Parser)]
#[command(name = "cargo xtask", bin_name = "cargo xtask", after_help = ENVIRONMENT)]
struct Cli {
    #[command(subcommand)]
    command: Task,
}

#[derive(Debug, Subcommand)]
enum Task {
    /// Host tests (cargo test --workspace), the whole VM suite, then the Kubernetes tier (every
    /// k8s-test scenario).
    Test,
    /// The volume manager's seeded simulation over more seeds than `cargo test` runs (release
    /// build); a failure prints its seed and shortened history (replay: UBLKD_SIM_SEED=N).
    Sim {
        /// How many histories (seeds 0..N).
        #[arg(long, default_value_t = 100_000)]
        seeds: u64,
    },
    /// The VM suite alone.
    VmTest {
        /// Selects tests whose name contains it, or a whole test file (e.g. daemon, dataplane,
        /// kernel, nvme, recovery); several, comma-separated, select the tests any of them
        /// selects.
        filter: Option<String>,
    },
    /// Boot the VM, run CMD inside (host root read-only, chroot), return its exit code.
    VmRun(VmRunArgs),
    /// A Kubernetes 1.35 cluster (built from its Go modules), each node its own VM (one, or two
    /// with UBLKD_K8S_NODES=2), the chart installed with helm as a user would, then the
    /// scenarios (all by default).
    K8sTest {
        /// Scenarios to run, by name.
        scenarios: Vec<String>,
        /// Build and cache everything the tier needs (Kubernetes, the sidecars, helm, the
        /// registry, the images, the plugin), then stop before booting.
        #[arg(long)]
        prepare: bool,
    },
    /// Boot the VM, start ublkd, drive it with ublkctl: volumes, ext4, fio, resize, stats, metrics.
    Demo,
    /// Build the container image (OCI layout, no daemon, no base pulled):
    /// target/image/ublkd-oci.tar.
    Image {
        /// Build it twice and compare the layers' digests.
        #[arg(long)]
        check: bool,
        /// Then push it to this registry reference (HOST[:PORT]/NAME:TAG) with skopeo.
        #[arg(long, value_name = "REF")]
        push: Option<String>,
        /// With --push: the registry speaks plain HTTP or has a certificate not to verify.
        #[arg(long, requires = "push")]
        insecure: bool,
    },
    /// Build the Debian package of ublkd and ublkctl: target/deb/ublkd.deb.
    Deb,
    /// Fetch the kernel and build the initramfs (what the others do first).
    Prepare,
    /// Render the Helm chart deploy/helm/ublkd's defaults into deploy/kubernetes/ublkd.yaml and
    /// check every render of it (the host tests check the same without writing).
    Manifests,
    /// In one boot: ublkd vs kublk, loop, dm-linear, raw NVMe and null_blk under fio; control-plane
    /// latency and RSS; recovery time and I/O stall; writes target/bench/results.json
    /// (UBLKD_BENCH_RUNTIME: seconds per job, default 5; UBLKD_BENCH_UBLKD: a ublkd binary, kept
    /// outside /tmp, to measure instead of a release build).
    Bench(bench::Args),
    /// `image --push` of an archive already built (the Kubernetes tier's node pushes the image
    /// the host built to its own registry with this, the same code as `image --push`).
    #[command(hide = true)]
    PushArchive {
        /// The OCI archive `image` wrote.
        archive: PathBuf,
        #[command(flatten)]
        push: oci::Push,
        /// The archive's manifest digest, which the registry must then serve.
        #[arg(long)]
        manifest: String,
    },
    /// The bench's guest side, run by `bench` inside the VM on the input it wrote.
    #[command(hide = true)]
    BenchGuest {
        /// The input `bench` wrote into the run directory.
        input: PathBuf,
    },
}

/// `cargo xtask vm-run`'s arguments.
#[derive(Debug, clap::Args)]
struct VmRunArgs {
    /// Seconds before the guest is killed.
    #[arg(long, default_value_t = 600)]
    timeout: u64,
    /// A second NVMe subsystem with two controllers, the topology of native multipath.
    #[arg(long)]
    multipath: bool,
    /// The host root writable in the guest.
    #[arg(long)]
    writable_root: bool,
    /// The command and its arguments (after `--` when they start with a dash).
    #[arg(required = true, trailing_var_arg = true, allow_hyphen_values = true)]
    cmd: Vec<String>,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli.command) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("xtask: error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn run(command: Task) -> Result<ExitCode> {
    let ws = workspace_root()?;
    match command {
        Task::Test => return test(&ws),
        Task::VmTest { filter } => return Ok(exit_code(suite::run(&ws, filter.as_deref())?.ok())),
        Task::VmRun(a) => {
            let script: Vec<String> = a.cmd.iter().map(|w| vm::shell_quote(w)).collect();
            return boot_and_run(&ws, &script.join(" "), |vm| {
                vm.timeout = a.timeout;
                vm.multipath = a.multipath;
                vm.writable_root = a.writable_root;
            });
        }
        Task::K8sTest { scenarios, prepare } if prepare => k8s::prepare(&ws, &scenarios)?,
        Task::K8sTest { scenarios, .. } => return k8s::run(&ws, &scenarios),
        Task::Demo => return demo(&ws),
        Task::Bench(args) => return bench::run(&ws, &args),
        Task::BenchGuest { input } => bench::guest::main(&input)?,
        Task::Deb => deb::run(&ws)?,
        Task::Image {
            check,
            push,
            insecure,
        } => {
            let push = push.map(|reference| oci::Push {
                reference,
                insecure,
            });
            oci::run(&ws, check, push.as_ref())?;
        }
        Task::PushArchive {
            archive,
            push,
            manifest,
        } => oci::push_archive(&archive, &manifest, &push)?,
        Task::Sim { seeds } => {
            eprintln!("xtask: sim: {seeds} seeded histories of the volume manager");
            // The release build: optimised, its overflow checks on (Cargo.toml).
            let test = "test --release -p ublkd-server simulated_histories -- --nocapture";
            apt::run_ok(cargo_in(&ws, test).env("UBLKD_SIM_SEEDS", seeds.to_string()))?;
        }
        Task::Manifests => {
            deploy::manifest_checks(&ws, true)?;
            eprintln!("xtask: manifests: written, and every render passes its checks");
        }
        Task::Prepare => {
            let kernel = image::prepare(&ws)?;
            println!("kernel {} ready: {}", kernel.kver, kernel.vmlinuz.display());
            println!("initramfs: {}", kernel.initramfs.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `cargo xtask test`: the host tests, the VM suite, then the Kubernetes tier.
fn test(ws: &Path) -> Result<ExitCode> {
    let t = Instant::now();
    host_tests(ws)?;
    let host = t.elapsed();
    let outcome = suite::run(ws, None)?;
    let vm = t.elapsed() - host;
    let tier = k8s::run_tier(ws, &[])?;
    let cluster = t.elapsed() - host - vm;
    // Both summaries last, the VM suite's failures with their reasons: all a CI log's tail
    // keeps; then where the time went, builds included, for CI's time budget.
    println!("\nVM suite:\n{}", outcome.summary());
    println!("{}", tier.summary);
    println!(
        "time: host tests {:.0} s, VM suite {:.0} s, Kubernetes tier {:.0} s \
         (each with its builds); {:.0} s in all",
        host.as_secs_f64(),
        vm.as_secs_f64(),
        cluster.as_secs_f64(),
        t.elapsed().as_secs_f64()
    );
    Ok(exit_code(outcome.ok() && tier.ok()))
}

/// The process's exit status for a run that passed or failed.
fn exit_code(ok: bool) -> ExitCode {
    ExitCode::from(u8::from(!ok))
}

/// The five slowest of `took` (seconds, what), slowest first, a line each after `indent`.
fn slowest_five(mut took: Vec<(f64, String)>, indent: &str) -> String {
    took.sort_by(|a, b| b.0.total_cmp(&a.0));
    let five = took.iter().take(5);
    five.map(|(secs, what)| format!("{indent}{secs:7.1} s  {what}\n"))
        .collect()
}

/// The workspace root: two levels above this crate's manifest.
fn workspace_root() -> Result<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).ancestors().nth(2);
    let root = root.context("xtask manifest is not two levels below the workspace")?;
    Ok(root.to_path_buf())
}

fn cargo() -> Command {
    Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()))
}

/// `cargo` in `dir` with the arguments of `line` (words).
fn cargo_in(dir: &Path, line: &str) -> Command {
    let mut c = cargo();
    c.current_dir(dir).args(line.split_whitespace());
    c
}

fn host_tests(ws: &Path) -> Result<()> {
    eprintln!("xtask: host tests: cargo test --workspace");
    // One stream (cargo's "Running BINARY" is on stderr, the binary's result on stdout), in the
    // order written.
    let mut child = Command::new("sh")
        .current_dir(ws)
        .args(["-c", "exec \"$0\" test --workspace 2>&1"])
        .arg(cargo().get_program())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    // Echoed as it comes; each test binary's time kept for the slowest five.
    let mut took = Vec::new();
    let mut current = String::new();
    let out = child.stdout.take().context("cargo test's output")?;
    for line in std::io::BufRead::lines(std::io::BufReader::new(out)) {
        let line = line.context("reading cargo test's output")?;
        println!("{line}");
        let l = line.trim();
        if l.starts_with("Running ") || l.starts_with("Doc-tests ") {
            current = l.to_owned();
        }
        let finished = line.split("finished in ").nth(1);
        if let Some(secs) = finished.and_then(|r| r.trim_end_matches('s').parse::<f64>().ok()) {
            took.push((secs, current.clone()));
        }
    }
    let status = child.wait().context("waiting for cargo test")?;
    print!(
        "host tests: the slowest five test binaries:\n{}",
        slowest_five(took, "  ")
    );
    if !status.success() {
        bail!("host tests failed ({status})");
    }
    // The test hooks' own language (arming, ranges, entries that read as nothing), which the
    // shipped build leaves out.
    eprintln!("xtask: host tests: the test hooks");
    let hooks = "test -p ublkd-dataplane --lib hooks --features test-hooks";
    apt::run_ok(&mut cargo_in(ws, hooks))?;
    alert_rule_tests(ws)?;
    deploy::manifest_checks(ws, false)?;
    shell_script_checks(ws)
}

/// The Prometheus alert rules the chart ships (deploy/helm/ublkd/files), with their tests in
/// deploy/prometheus: checked and unit-tested with promtool.
fn alert_rule_tests(ws: &Path) -> Result<()> {
    let promtool = apt::require("promtool", "prometheus")?;
    eprintln!("xtask: alert rules: promtool check rules, promtool test rules");
    for args in [
        ["check", "rules", "../helm/ublkd/files/ublkd-rules.yaml"],
        ["test", "rules", "ublkd-rules.test.yaml"],
    ] {
        apt::run_ok(
            Command::new(&promtool)
                .args(args)
                .current_dir(ws.join("deploy/prometheus")),
        )?;
    }
    Ok(())
}

/// Every shell script in the repository, checked with shellcheck. Each names its dialect, which
/// shellcheck requires: a `#!` line (`.ci/run`), or a `# shellcheck shell=` directive where a
/// shell reads the file (the guest's /init under busybox sh, the demo under `bash -s`).
fn shell_script_checks(ws: &Path) -> Result<()> {
    let scripts = shell_scripts(ws)?;
    if scripts.is_empty() {
        bail!("no shell scripts found to check in {}", ws.display());
    }
    let shellcheck = apt::require("shellcheck", "shellcheck")?;
    let names: Vec<String> = scripts.iter().map(|p| p.display().to_string()).collect();
    eprintln!("xtask: shell scripts: shellcheck {}", names.join(" "));
    apt::run_ok(Command::new(&shellcheck).args(&scripts).current_dir(ws)).context(
        "shellcheck found problems: fix them, or disable a check on its line with \
         `# shellcheck disable=SCxxxx` and a comment saying why",
    )
}

/// The repository's shell scripts, relative to `ws` and sorted: the files git lists (tracked, or
/// new and not ignored, so never `target/`) that end in `.sh` or start with a `#!` line naming a
/// shell (`.ci/run`, the Debian maintainer scripts).
fn shell_scripts(ws: &Path) -> Result<Vec<PathBuf>> {
    let listed = apt::output_ok(
        Command::new("git")
            .args(["ls-files", "-z", "--cached", "--others"])
            .arg("--exclude-standard")
            .current_dir(ws),
    )?;
    let mut scripts = Vec::new();
    for rel in listed.split_terminator('\0').map(PathBuf::from) {
        // Listed but not a file here (deleted in the work tree, a submodule): nothing to check.
        let Ok(text) = std::fs::read(ws.join(&rel)) else {
            continue;
        };
        if rel.extension().is_some_and(|e| e == "sh") || shebang_names_shell(&text) {
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
    String::from_utf8_lossy(line)
        .split_whitespace()
        .map(|w| w.rsplit_once('/').map_or(w, |(_, base)| base))
        .any(|w| matches!(w, "sh" | "ash" | "dash" | "bash" | "ksh"))
}

/// Boots the VM (set up by `setup`), runs `script` with the console echoed, and returns the
/// guest command's exit status; a guest that ends without one fails, with its console's tail.
fn boot_and_run(ws: &Path, script: &str, setup: impl FnOnce(&mut vm::Vm)) -> Result<ExitCode> {
    let mut guest = vm::Vm::new(ws, &image::prepare(ws)?)?;
    guest.echo = true;
    setup(&mut guest);
    let run = guest.run(script)?;
    if run.exit != vm::Exit::Code(0) {
        let tail = run.console_tail(40);
        eprintln!("xtask: guest {}; console tail:\n{tail}", run.exit);
    }
    Ok(match run.exit {
        vm::Exit::Code(c) => ExitCode::from(u8::try_from(c.clamp(0, 255)).unwrap_or(1)),
        _ => ExitCode::FAILURE,
    })
}

fn demo(ws: &Path) -> Result<ExitCode> {
    let bins = suite::build_node_binaries(ws, "")?;
    let bin = |name: &str| vm::quoted(&bins.join(name));
    let [ublkd, ublkctl, csi] = ["ublkd", "ublkctl", "ublkd-csi"].map(bin);
    // /dev/tcp in the script needs bash; the guest runs the host's shells.
    let script = format!(
        "export UBLKD={ublkd} UBLKCTL={ublkctl} UBLKD_CSI={csi}\nexec bash -s <<'DEMO'\n{}DEMO\n",
        include_str!("demo.sh")
    );
    boot_and_run(ws, &script, |vm| vm.timeout = 600)
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
            "#!/usr/bin/python3\nimport sh\n",
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
            "deploy/debian/postinst",
            "tests/xtask/src/demo.sh",
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

    fn parse(args: &[&str]) -> Result<Task, clap::Error> {
        Cli::try_parse_from(std::iter::once("xtask").chain(args.iter().copied())).map(|c| c.command)
    }

    #[test]
    fn the_command_line_is_read_as_documented() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let refused = |args: &[&str]| parse(args).is_err();
        // vm-run: its options, then the command, with or without `--`, dashes and all.
        let dashes = parse(&["vm-run", "--timeout", "30", "--", "ls", "-l"]);
        assert!(matches!(
            dashes,
            Ok(Task::VmRun(a)) if (a.timeout, a.multipath) == (30, false) && a.cmd == ["ls", "-l"]
        ));
        assert!(matches!(
            parse(&["vm-run", "--multipath", "sh", "-c", "true"]),
            Ok(Task::VmRun(a)) if (a.timeout, a.multipath, a.cmd.len()) == (600, true, 3)
        ));
        assert!(refused(&["vm-run"]), "vm-run needs a command");
        assert!(refused(&["vm-run", "--timeout", "soon", "ls"]));
        assert!(matches!(
            parse(&["vm-test", "qos,nvme"]),
            Ok(Task::VmTest { filter: Some(f) }) if f == "qos,nvme"
        ));
        assert!(matches!(
            parse(&["k8s-test", "driver", "warnings"]),
            Ok(Task::K8sTest { scenarios, prepare: false }) if scenarios == ["driver", "warnings"]
        ));
        let check = parse(&["image", "--check"]);
        assert!(matches!(
            check,
            Ok(Task::Image {
                check: true,
                push: None,
                insecure: false
            })
        ));
        let to = "localhost:5000/ublkd:t";
        assert!(matches!(
            parse(&["image", "--push", to, "--insecure"]),
            Ok(Task::Image { check: false, push: Some(r), insecure: true }) if r == to
        ));
        assert!(refused(&["image", "--push"]), "--push needs a reference");
        assert!(
            refused(&["image", "--insecure"]),
            "--insecure only with --push"
        );
        assert!(
            refused(&["compare", "fdc00eb", "work"]),
            "folded into bench --baseline"
        );
        let baseline = parse(&["bench", "--baseline", "e3edd49", "--only", "null"]);
        assert!(matches!(baseline, Ok(Task::Bench(_))));
        assert!(refused(&["bench", "--fast"]));
        // As the Kubernetes tier's node runs it (tests/k8s/node).
        let push = parse(&["push-archive", "a", "r/u:t", "--manifest=m", "--insecure"]);
        assert!(matches!(
            push,
            Ok(Task::PushArchive { push: oci::Push { reference, insecure: true }, manifest, .. })
                if reference == "r/u:t" && manifest == "m"
        ));
        assert!(refused(&["no-such-task"]));
    }
}
