//! The VM test suite: the `ublkd-tests` crate built with its `vm` feature, each test run on its
//! own inside one guest boot, each bounded by a timeout, and a closing line
//! `N passed, N failed` counting them.

use crate::image;
use crate::vm::{self, quoted, Exit, Vm};
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A hang's guard per test in the guest, not a measure (480: the image test took 248 s one day).
const PER_TEST_SECS: u64 = 480;
/// Where the guest keeps the binaries its tests run (in /run, the guest's tmpfs).
const BIN_DIR: &str = "/run/ublkd-bin";

#[derive(Debug, Default)]
pub struct Outcome {
    pub passed: Vec<String>,
    /// Each failed test's name and the lines of its output that say why, printed again after
    /// the closing count so that a log's tail (all CI keeps) shows the cause.
    pub failed: Vec<(String, String)>,
}

impl Outcome {
    pub fn ok(&self) -> bool {
        self.failed.is_empty() && !self.passed.is_empty()
    }

    /// Why each failed test failed, then the count: what the log's tail must hold.
    pub fn summary(&self) -> String {
        let why: String = self
            .failed
            .iter()
            .map(|(name, why)| format!("\n--- why {name} failed ---\n{why}\n"))
            .collect();
        let (passed, failed) = (self.passed.len(), self.failed.len());
        format!("{why}{passed} passed, {failed} failed")
    }
}

#[derive(Debug)]
struct TestCase {
    binary: PathBuf,
    name: String,
    /// The test file (binary stem) it belongs to.
    file: String,
}

/// The test file whose tests need the multipath topology, in a boot of their own.
const MULTIPATH_FILE: &str = "multipath";

/// The test file that installs what users install: the image and the Debian package.
const INSTALL_FILE: &str = "install";

/// The test file that drives the CSI driver with the conformance suite.
const CSI_FILE: &str = "csi";

/// Builds the VM test binaries and returns their paths.
pub fn build_test_binaries(ws: &Path) -> Result<Vec<PathBuf>> {
    eprintln!("xtask: building VM tests (cargo test -p ublkd-tests --features vm --no-run)");
    let build = "test -p ublkd-tests --features vm --test * --no-run \
                 --message-format=json-render-diagnostics";
    let out = crate::cargo_in(ws, build)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo")?;
    if !out.status.success() {
        bail!("building the VM tests failed");
    }
    let mut bins = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        let test = msg["reason"] == "compiler-artifact" && msg["profile"]["test"] == true;
        let exe = msg["executable"].as_str().filter(|_| test);
        bins.extend(exe.map(PathBuf::from));
    }
    Ok(bins)
}

/// The packages of what runs on a node: ublkd, ublkctl, ublkd-csi.
const NODE_PACKAGES: [&str; 3] = ["ublkd-server", "ublkctl", "ublkd-csi"];

/// Builds what runs on a node (ublkd, ublkctl, ublkd-csi) with `extra` cargo arguments
/// (words), and returns where they are, target/debug.
pub fn build_node_binaries(ws: &Path, extra: &str) -> Result<PathBuf> {
    eprintln!("xtask: building ublkd, ublkctl and ublkd-csi");
    let build = format!("build -p {} {extra}", NODE_PACKAGES.join(" -p "));
    crate::apt::run_ok(&mut crate::cargo_in(ws, &build))?;
    Ok(crate::dist::target_dir(ws).join("debug"))
}

pub fn run(ws: &Path, filter: Option<&str>) -> Result<Outcome> {
    let kernel = image::prepare(ws)?;
    // The binaries the VM tests drive, ublkd with its test hooks.
    let bins = build_node_binaries(ws, "--features ublkd-server/test-hooks")?;
    let mut cases = Vec::new();
    for binary in build_test_binaries(ws)? {
        // A filter matches a test's name, or the whole test file (binary `daemon-<hash>`).
        let file = binary
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.rsplit_once('-'))
            .map_or("", |(stem, _)| stem)
            .to_owned();
        let mut list = Command::new(&binary);
        let list = crate::apt::output_ok(list.args(["--list", "--format", "terse"]))?;
        for name in list.lines().filter_map(|l| l.strip_suffix(": test")) {
            // Several filters, comma-separated: a test that matches any of them.
            let matches = |f: &str| {
                f.split(',')
                    .any(|f| !f.is_empty() && (name.contains(f) || file == f))
            };
            if filter.is_none_or(matches) {
                cases.push(TestCase {
                    binary: binary.clone(),
                    name: name.to_owned(),
                    file: file.clone(),
                });
            }
        }
    }
    if cases.is_empty() {
        let filter = filter.unwrap_or("");
        bail!("no VM test matches {filter:?}: nothing would run");
    }
    // The image test first in its boot (its unpack took 2-3 s a layer there, 3-98 s later in a
    // long boot), the Debian test last: the test after it was slow every time (the image's
    // unpack 47.5 s; the dashboard test 106.5 s against 36.3 s), likely from the page-cache
    // drop its 146 MiB of /tmp triggers, which makes the next test read its tools again over 9p.
    let install = |c: &TestCase, name: &str| c.file == INSTALL_FILE && c.name.contains(name);
    cases.sort_by_key(|c| match (install(c, "image"), install(c, "debian")) {
        (true, _) => 0,
        (_, true) => 2,
        _ => 1,
    });
    if cases.iter().any(|c| c.file == INSTALL_FILE) {
        // What the install tests use, built on the host before the boot: the image (twice, to
        // check it is reproducible), the package, and a Debian root to install the package into.
        crate::oci::run(ws, true, None)?;
        crate::deb::build(ws)?;
        crate::deb::scratch_root(ws)?;
    }
    // The exports of the guest's script: the binaries the tests drive, and the conformance
    // suite's whenever a csi test runs (a test that needs it fails when it is absent).
    let [ublkd, ublkctl, csi] = ["ublkd", "ublkctl", "ublkd-csi"].map(|b| quoted(&bins.join(b)));
    let mut exports = format!("export UBLKD_BIN={ublkd} UBLKCTL_BIN={ublkctl} UBLKD_CSI_BIN={csi}");
    if cases.iter().any(|c| c.file == CSI_FILE) {
        let csi_sanity = crate::gotools::ensure(crate::gotools::CSI_SANITY)?;
        exports.push_str(&format!(" UBLKD_CSI_SANITY={}", quoted(&csi_sanity)));
    }
    let mut outcome = Outcome::default();
    let (multipath, plain): (Vec<TestCase>, Vec<TestCase>) =
        cases.into_iter().partition(|c| c.file == MULTIPATH_FILE);
    for (boot, multipath) in [(plain, false), (multipath, true)] {
        if !boot.is_empty() {
            run_boot(ws, &kernel, &boot, multipath, &exports, &mut outcome)?;
        }
    }
    println!("{}", outcome.summary());
    Ok(outcome)
}

/// Lines of one test's console section worth repeating: every line that names an error or a
/// failed check, and its last lines; bounded so that one verbose test cannot bury the others.
fn failure_excerpt(console: &[String], name: &str) -> String {
    // what marks a line worth repeating, `|` between them
    const MARKS: &str = "Error|error:|ERROR|WARN|panicked|[FAIL]|FAIL!|TIMEOUT|Expected|rpc error";
    const TAIL: usize = 25;
    const MAX_MARKED: usize = 40;
    let start = console
        .iter()
        .position(|l| l.ends_with(&format!("=== RUN  {name}")));
    let Some(start) = start else {
        return "(its output is not in the console log: the guest stopped before it ran)".into();
    };
    let end = console[start..]
        .iter()
        .position(|l| l.contains(&format!("=== END  {name} ")))
        .map_or(console.len(), |e| start + e + 1);
    let section = &console[start..end];
    let tail_from = section.len().saturating_sub(TAIL);
    let mut out: Vec<&str> = section[..tail_from]
        .iter()
        .filter(|l| MARKS.split('|').any(|m| l.contains(m)))
        .take(MAX_MARKED)
        .map(String::as_str)
        .collect();
    if !out.is_empty() {
        out.push("  ...");
    }
    out.extend(section[tail_from..].iter().map(String::as_str));
    out.join("\n")
}

/// Boots a guest for the tests in `cases` that have not run, and again after a guest that dies
/// among them (a kernel panic, QEMU gone): the test it died in fails with the guest's last
/// words, and the tests after it run in a fresh boot instead of all failing unread (stop 51's CI
/// lost 35 results to one death it never showed). At most `MAX_BOOTS` boots.
fn run_boot(
    ws: &Path,
    kernel: &image::Kernel,
    cases: &[TestCase],
    multipath: bool,
    exports: &str,
    outcome: &mut Outcome,
) -> Result<()> {
    const MAX_BOOTS: usize = 3;
    let mut left: Vec<&TestCase> = cases.iter().collect();
    for boot in 1..=MAX_BOOTS {
        let last = boot == MAX_BOOTS;
        let ran = boot_once(ws, kernel, &left, multipath, exports, last, outcome)?;
        left.retain(|c| !ran.contains(&c.name));
        if left.is_empty() {
            break;
        }
        let n = left.len();
        println!("  {n} test(s) never ran; booting the guest again for them");
    }
    Ok(())
}

/// Runs `cases` in one boot of the guest, adding their results to `outcome`; the names of those
/// that ran (passed, failed, or were running when the guest died). A test that never started is
/// left out of both, for another boot, unless this is the `last`: then it fails.
fn boot_once(
    ws: &Path,
    kernel: &image::Kernel,
    cases: &[&TestCase],
    multipath: bool,
    exports: &str,
    last: bool,
    outcome: &mut Outcome,
) -> Result<Vec<String>> {
    let (n, kver) = (cases.len(), &kernel.kver);
    let topology = match multipath {
        true => " with the multipath NVMe subsystem and the swap drives",
        false => "",
    };
    eprintln!("xtask: running {n} VM test(s) in one boot of {kver}{topology}");

    // A panic's backtrace, but not an error's: a test's `Error:` line is then among the last
    // lines of its output, where CI's excerpt reads it, not 40 frames above them.
    // Between tests: the scratch removed; when it held 64 MiB or more, the page cache dropped
    // too (else /tmp took 22-135 s for 64 MiB, 0.4 s after a drop: the image test timed out
    // after the Debian one), not always (the next test would read its binaries again, 7-11 s).
    let mut script = format!(
        "cd {ws}\n{exports} RUST_BACKTRACE=1 RUST_LIB_BACKTRACE=0\n\
         echo \"ublkd-vm: guest kernel $(uname -r)\"\n\
         run_test() {{\n  echo \"=== RUN  $2\"\n  t0=$(date +%s%N)\n  timeout -k 10 {PER_TEST_SECS} \"$1\" --exact \"$2\" --nocapture --test-threads=1\n  rc=$?\n  \
         ms=$(( ($(date +%s%N) - t0) / 1000000 ))\n  \
         [ $rc -eq 124 ] && echo \"=== TIMEOUT $2 after {PER_TEST_SECS} s\"\n  \
         echo \"$rc $ms $2\" >> \"$UBLKD_VM_RUN/results\"\n  \
         left=$(du -sm \"${{TMPDIR:-/tmp}}\" 2>/dev/null | cut -f1)\n  \
         find \"${{TMPDIR:-/tmp}}\" -mindepth 1 -maxdepth 1 -exec rm -rf --one-file-system {{}} + 2>/dev/null\n  \
         [ \"${{left:-0}}\" -ge 64 ] && echo 1 > /proc/sys/vm/drop_caches\n  \
         echo \"=== END  $2 rc=$rc (left ${{left:-?}} MiB in ${{TMPDIR:-/tmp}}, removed)\"\n}}\n",
        ws = quoted(ws),
    );
    // The binaries the tests run, copied into the tmpfs the page-cache drops leave alone: read
    // again over 9p, they cost the test after each drop 7-11 s (12 drops in a whole suite).
    // ublkd's three once per boot; a test binary before its first test, removed after its last.
    script.push_str(&format!(
        "mkdir -p {BIN_DIR} || exit 1\n\
         for v in UBLKD_BIN UBLKCTL_BIN UBLKD_CSI_BIN; do eval \"p=\\$$v\"; \
         cp \"$p\" {BIN_DIR}/ || exit 1; export \"$v={BIN_DIR}/${{p##*/}}\"; done\n"
    ));
    let mut copied: Option<&Path> = None;
    for c in cases {
        let name = c.binary.file_name().and_then(|n| n.to_str()).unwrap_or("t");
        let local = format!("{BIN_DIR}/{}", vm::shell_quote(name));
        if copied != Some(c.binary.as_path()) {
            if let Some(done) = copied.and_then(Path::file_name).and_then(|n| n.to_str()) {
                script.push_str(&format!("rm -f {BIN_DIR}/{}\n", vm::shell_quote(done)));
            }
            script.push_str(&format!("cp {} {BIN_DIR}/ || exit 1\n", quoted(&c.binary)));
            copied = Some(c.binary.as_path());
        }
        script.push_str(&format!("run_test {local} {}\n", vm::shell_quote(&c.name)));
    }
    script.push_str("exit 0\n");

    let timeout = 120 + (PER_TEST_SECS + 15) * cases.len() as u64;
    let mut vm = Vm::new(ws, kernel)?;
    (vm.timeout, vm.multipath, vm.echo) = (timeout, multipath, true);
    let run = vm.run(&script)?;

    let results = fs::read_to_string(run.run_dir.join("results")).unwrap_or_default();
    // The whole log, not the bounded tail kept in memory: a failure early in a long boot.
    let console: Vec<String> = fs::read_to_string(run.run_dir.join("console.log"))
        .map(|s| s.lines().map(str::to_owned).collect())
        .unwrap_or_else(|_| run.console.clone());
    let secs = run.wall.as_secs_f64();
    println!("\nVM suite ({}, {secs:.1} s):", kernel.kver);
    let died = run.exit != Exit::Code(0);
    let (mut took, mut ran) = (Vec::new(), Vec::new());
    let failed_before = outcome.failed.len();
    for c in cases {
        // Each line of `results`: `RC MS NAME`.
        let result = results.lines().find_map(|l| {
            let (rc, rest) = l.split_once(' ')?;
            let (ms, name) = rest.split_once(' ')?;
            (name == c.name).then(|| (rc.parse::<i32>().unwrap_or(-1), ms.parse().unwrap_or(0)))
        });
        let started = console
            .iter()
            .any(|l| l.ends_with(&format!("=== RUN  {}", c.name)));
        if result.is_none() && !started && died && !last {
            continue;
        }
        ran.push(c.name.clone());
        if let Some((_, ms)) = result {
            took.push((ms as f64 / 1000.0, c.name.clone()));
        }
        if let Some((0, ms)) = result {
            println!("  ok      {} ({:.1} s)", c.name, ms as f64 / 1000.0);
            outcome.passed.push(c.name.clone());
        } else if result.is_none() && started && died {
            println!("  FAILED  {} (the guest {} while it ran)", c.name, run.exit);
            let why = format!(
                "the guest {} while this test ran; the console's last lines:\n{}",
                run.exit,
                run.console_tail(40)
            );
            outcome.failed.push((c.name.clone(), why));
        } else {
            println!("  FAILED  {}", c.name);
            let why = failure_excerpt(&console, &c.name);
            outcome.failed.push((c.name.clone(), why));
        }
    }
    print!("  slowest five:\n{}", crate::slowest_five(took, "    "));
    if died {
        let tail = run.console_tail(40);
        println!("guest {}; console tail:\n{tail}", run.exit);
    }
    if outcome.failed.len() == failed_before && !died {
        // A run's files are kept only to read a failure; one left behind costs disk, no verdict.
        let _ = fs::remove_dir_all(&run.run_dir);
    } else {
        println!("logs kept in {}", run.run_dir.display());
    }
    Ok(ran)
}

#[cfg(test)]
mod tests {
    use super::failure_excerpt;

    fn lines(s: &str) -> Vec<String> {
        s.lines().map(str::to_owned).collect()
    }

    #[test]
    fn a_failures_excerpt_holds_its_error_and_not_its_neighbours_output() {
        let mut console = lines("=== RUN  a\nok\n=== END  a rc=0\n=== RUN  b\n");
        console.push("Error: csi-sanity failed for csi-ram-mount-xfs".into());
        console.extend((0..40).map(|i| format!("line {i}")));
        console.extend(lines("=== END  b rc=1\n=== RUN  c\nlater\n"));
        let why = failure_excerpt(&console, "b");
        assert!(why.starts_with("Error: csi-sanity failed"), "{why}");
        assert!(
            why.contains("line 39") && why.ends_with("=== END  b rc=1"),
            "{why}"
        );
        assert!(!why.contains("line 5\n"), "the middle is left out: {why}");
        assert!(!why.contains("later") && !why.contains("ok\n"), "{why}");
        let missing = failure_excerpt(&console, "z");
        assert!(missing.contains("not in the console log"), "{missing}");
    }
}
