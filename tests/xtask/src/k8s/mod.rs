//! `cargo xtask k8s-test [SCENARIO...]`: a real Kubernetes in the VM, and the driver installed
//! into it as a user would.
//! Everything comes from the registries the machine has, built or unpacked here and cached by
//! version (the guest sees the cache through the host root):
//! - Kubernetes (API server, controller manager, scheduler, kubelet, kube-proxy, kubectl) and
//!   the kubernetes-csi sidecars, from their Go modules (`build`); the cluster's DNS server,
//!   CoreDNS, from its module with a trimmed plugin list (`tests/k8s/coredns`);
//! - etcd, containerd 1.7 and the CNI plugins, from Debian trixie's packages (runc and iptables
//!   from the host's own suite: trixie's runc needs a newer glibc than the host root has);
//! - every image, packed offline (`images`), ublkd's own from `cargo xtask image`: that one
//!   is not imported but pushed, inside the guest, to the node's own distribution registry
//!   (built from its module) on its loopback, and pulled from there through the chart's
//!   `image.*` values.
//!
//! The control plane and the node's kubectl and helm run on the host, natively, in a network
//! namespace of the tier's own, with QEMU in it too (`control` says why). Each node is a guest
//! of its own (`control::NODES`, the first `UBLKD_K8S_NODES` of them: its own kernel, ublk
//! driver, NVMe controller, containerd, kubelet and ublkd), running `tests/k8s/node`, the `k8s-node` program of the tests crate, with
//! a writable root (a tmpfs overlay over the host root). The first installs the chart with
//! `tests/k8s/values.yaml` and runs the scenarios (tests/README.md, "3. Kubernetes"); the
//! others join the cluster and wait until it is done.

use crate::apt::{self, PrivateApt};
use crate::{image, oci, vm};
use anyhow::{bail, ensure, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};
use std::time::{Duration, Instant};

pub mod build;
mod control;
mod images;

/// What a node's QEMU forwards into its guest from the node's address (`control::NODES`): the
/// kubelet, for the API server; and the first node's registry, for the host's helm (the
/// packaged chart) and the other nodes' containerd (ublkd's image).
fn forwards(first: bool, ip: &str) -> Vec<String> {
    let mut f = vec![format!("tcp:{ip}:10250-:10250")];
    if first {
        f.push(format!("tcp:{ip}:5000-:5000"));
    }
    f
}

/// How many of `control::NODES` the cluster has: `UBLKD_K8S_NODES`, 1 unless set (the second
/// node boots, joins and runs every scenario, but is not the default: on two cores the whole
/// run took 64 minutes with it, four scenarios short, tests/README.md).
fn node_count() -> usize {
    let asked = std::env::var("UBLKD_K8S_NODES").ok();
    let n = asked.and_then(|v| v.parse().ok()).unwrap_or(1);
    n.clamp(1, control::NODES.len())
}

/// The memory and vCPUs of the first node, which runs the scenarios' pods, Prometheus and the
/// registry, and of each node that joins it, which runs only the DaemonSets' pods.
const FIRST: (u32, u32) = (6144, 2);
const JOINED: (u32, u32) = (3072, 1);

/// Debian packages unpacked for the guest, each from the suite named (containerd 1.7 is
/// trixie's; sid has 2.x, which Kubernetes 1.35 would take too, but the brief pins 1.x).
const DEBS: &[&str] = &[
    "etcd-server/trixie",
    "containerd/trixie",
    "containernetworking-plugins/trixie",
];

/// Host commands the guest runs from the host root, with their packages.
const HOST_TOOLS: &[(&str, &str)] = &[
    ("runc", "runc"),
    ("skopeo", "skopeo"),
    ("iptables", "iptables"),
    ("umoci", "umoci"),
    ("openssl", "openssl"),
    ("ip", "iproute2"),
];

/// The trixie packages, extracted into one tree (cached: the set of .deb file names is the key).
fn debian_packages() -> Result<PathBuf> {
    let cache = image::cache_dir();
    let apt = PrivateApt::new(&cache.join("apt"))?;
    let dl = cache.join("k8s/debs");
    let names: Vec<String> = DEBS.iter().map(|s| s.to_string()).collect();
    if apt.download(&names, &dl).is_err() {
        apt.update()?;
        apt.download(&names, &dl)?;
    }
    let mut debs: Vec<String> = fs::read_dir(&dl)?
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".deb"))
        .collect();
    debs.sort();
    let root = cache.join("k8s/root");
    let stamp = root.join(".debs");
    let want = debs.join("\n");
    if fs::read_to_string(&stamp).ok().as_deref() == Some(want.as_str()) {
        return Ok(root);
    }
    crate::dist::empty_dir(&root)?;
    apt::extract_debs(&dl, &root)?;
    fs::write(&stamp, want)?;
    Ok(root)
}

/// The distribution registry, built from its module: the node's own registry on its loopback,
/// which the ublkd image is pushed to and the cluster pulls it from.
const REGISTRY: crate::gotools::GoTool = crate::gotools::GoTool {
    package: "github.com/distribution/distribution/v3/cmd/registry",
    version: "v3.1.2",
    binary: "registry",
};

/// Prometheus, built from its module (a wrapper module: its go.mod has replace directives, which
/// `go install` refuses): Debian's package is built without the Kubernetes service discovery that
/// a ServiceMonitor's scrape rules are written in. v0.315.1 is Prometheus 3.15.1.
const PROMETHEUS: build::GoBuild = build::GoBuild {
    name: "prometheus",
    module: "github.com/prometheus/prometheus",
    version: "v0.315.1",
    packages: &["github.com/prometheus/prometheus/cmd/prometheus"],
};

/// OPA, the policy engine the admission scenario checks the chart's render with
/// (tests/k8s/policy): built from its module, as Gatekeeper embeds it.
const OPA: build::GoBuild = build::GoBuild {
    name: "opa",
    module: "github.com/open-policy-agent/opa",
    version: "v1.22.4",
    packages: &["github.com/open-policy-agent/opa"],
};

/// The images the node imports (the sidecars', the stand-ins', the sandbox's and the test pods'),
/// and ublkd's, built by `cargo xtask image`, which the node pushes to its registry instead.
fn all_images(ws: &Path, out: &Path) -> Result<(Vec<(String, PathBuf)>, oci::Built)> {
    crate::dist::empty_dir(out)?;
    let mut list = Vec::new();
    let built = oci::build(ws, &ws.join("target/image"))?;
    for b in build::SIDECARS {
        let bin = build::ensure(b)?;
        for p in b.packages {
            let cmd = p.rsplit('/').next().context("package path")?;
            let (binary, entry) = (bin.join(cmd), format!("/{cmd}"));
            list.push(images::binary_image(cmd, b.version, &binary, &entry, out)?);
        }
    }
    let standins = build::local(ws, "standins", "./cmd/...", &out.join("standins"))?;
    for (name, bin, entry) in [
        ("pause", "pause", "/pause"),
        (
            "registrar-standin",
            "registrar",
            "/csi-node-driver-registrar",
        ),
        ("livenessprobe-standin", "livenessprobe", "/livenessprobe"),
    ] {
        let binary = standins.join(bin);
        list.push(images::binary_image(name, "test", &binary, entry, out)?);
    }
    // The test pods' shell and tools: the host's static busybox, run as /bin/sh.
    let busybox = apt::which("busybox").context("busybox not found")?;
    let sh = images::binary_image("busybox", "test", &busybox, "/bin/sh", out)?;
    list.push(sh);
    Ok((list, built))
}

/// What the tier found: counts, and a summary to print last (each scenario with its time, and
/// what each failed one printed), so that a log's tail shows it.
#[derive(Debug)]
pub struct Tier {
    pub passed: usize,
    pub failed: usize,
    pub summary: String,
}

impl Tier {
    pub fn ok(&self) -> bool {
        self.failed == 0 && self.passed > 0
    }
}

/// `cargo xtask k8s-test`: the tier, its summary printed last.
pub fn run(ws: &Path, args: &[String]) -> Result<ExitCode> {
    let tier = run_tier(ws, args)?;
    println!("{}", tier.summary);
    Ok(crate::exit_code(tier.ok()))
}

/// The lines a failed scenario printed after its FAILED line: the tail of its log, each line
/// marked "> ".
fn failure_lines(console: &[String], name: &str) -> String {
    let mark = format!("SCENARIO {name} FAILED");
    let Some(at) = console.iter().position(|l| l.contains(&mark)) else {
        return String::new();
    };
    console[at + 1..]
        .iter()
        .map_while(|l| l.trim_start().strip_prefix("> "))
        .map(|l| format!("    {l}\n"))
        .collect()
}

/// Everything the tier needs on the host, built or cached: the guest kernel, the control
/// plane's tools, and what the node reads, but for the scenarios and the pki of each run.
struct Prepared {
    kernel: image::Kernel,
    tools: control::Tools,
    input: serde_json::Value,
    /// Seconds the Kubernetes binaries, then the images took (built, or found in the cache).
    kube_secs: f64,
    image_secs: f64,
}

/// The node program (tests/k8s/node), built with the VM tests' features, and its scenarios'
/// names in their order; `args` must name some of them.
fn node_program(ws: &Path, args: &[String]) -> Result<(PathBuf, Vec<String>)> {
    let node = "build -p ublkd-tests --features vm --bin k8s-node";
    apt::run_ok(&mut crate::cargo_in(ws, node))?;
    let bin = crate::dist::target_dir(ws).join("debug/k8s-node");
    let names = apt::output_ok(Command::new(&bin).arg("--list"))?;
    let all: Vec<String> = names.lines().map(str::to_owned).collect();
    if let Some(a) = args.iter().find(|a| !all.contains(a)) {
        bail!("unknown scenario {a:?}; the scenarios: {}", all.join(", "));
    }
    Ok((bin, all))
}

fn prepare_all(ws: &Path) -> Result<Prepared> {
    apt::ensure_tools(HOST_TOOLS)?;
    let kernel = image::prepare(ws)?;
    let t = Instant::now();
    let kube = build::ensure(&build::KUBERNETES)?;
    let helm = crate::gotools::ensure(crate::deploy::helm::HELM)?;
    let kube_secs = t.elapsed().as_secs_f64();
    let debs = debian_packages()?;
    let out = ws.join("target/k8s");
    let t = Instant::now();
    let (images, ublkd_image) = all_images(ws, &out.join("images"))?;
    let registry = crate::gotools::ensure(REGISTRY)?;
    let prometheus = build::ensure(&PROMETHEUS)?.join("prometheus");
    let opa = build::ensure(&OPA)?.join("opa");
    // `kubectl ublkd`, alone in a directory on the host kubectl's PATH (`control`).
    let release = crate::dist::release_build(ws)?;
    let plugins = out.join("plugins");
    fs::create_dir_all(&plugins)?;
    fs::copy(release.join("kubectl-ublkd"), plugins.join("kubectl-ublkd"))
        .context("copying kubectl-ublkd")?;
    let image_secs = t.elapsed().as_secs_f64();
    let coredns = build::local(ws, "coredns", ".", &out.join("coredns"))?.join("coredns");
    let modules = kernel.cache.join("kernel").join(&kernel.kver);
    let modules = modules.join("root/usr/lib/modules").join(&kernel.kver);
    ensure!(
        modules.is_dir(),
        "the guest kernel's modules are not at {}",
        modules.display()
    );
    // The snapshot add-ons a cluster admin installs once (deploy/csi/README.md, "Snapshots"):
    // the CRDs and the snapshot-controller's manifests, from the modules of their release.
    let snapshotter = build::SIDECARS
        .iter()
        .find(|b| b.name == "external-snapshotter")
        .context("no external-snapshotter build")?;
    let snap_dir = build::download(snapshotter.module, snapshotter.version)?.1;
    let crd_dir = build::download(build::SNAPSHOT_CLIENT.0, build::SNAPSHOT_CLIENT.1)?.1;
    // What the node reads (tests/k8s/node, `kube::Input`: it refuses a field it does not know).
    let input = serde_json::json!({
        "bin": kube,
        "debs": debs,
        "images": images,
        "chart": ws.join(crate::deploy::helm::CHART),
        "values": ws.join("tests/k8s/values.yaml"),
        "modules": modules,
        "snapshot_crds": crd_dir.join("config/crd"),
        "snapshot_controller": snap_dir.join("deploy/kubernetes/snapshot-controller"),
        "snapshotter_version": snapshotter.version,
        "registry": registry,
        "xtask": std::env::current_exe().context("finding this xtask binary")?,
        "ublkd_archive": ublkd_image.archive,
        "ublkd_manifest": ublkd_image.manifest,
        "prometheus": prometheus,
    });
    Ok(Prepared {
        kernel,
        tools: control::Tools {
            bin: kube,
            helm,
            plugins,
            debs,
            coredns,
            opa,
            policies: ws.join("tests/k8s/policy"),
        },
        input,
        kube_secs,
        image_secs,
    })
}

/// `cargo xtask k8s-test --prepare`: everything built and cached, nothing booted.
pub fn prepare(ws: &Path, args: &[String]) -> Result<()> {
    node_program(ws, args)?;
    let p = prepare_all(ws)?;
    let (kube, images, bin) = (p.kube_secs, p.image_secs, p.tools.bin.display());
    let n = p.input["images"].as_array().map_or(0, Vec::len);
    eprintln!(
        "xtask: k8s-test: prepared (Kubernetes binaries {kube:.0} s, {n} images {images:.0} s): {bin}"
    );
    Ok(())
}

/// A joined node's guest, booted again each time a scenario powers it off and on
/// (`control::POWERED_OFF`, `control::POWER_ON`), its state disk kept; each boot's console in
/// `console.N.log` but the last. Powered off at the end (a scenario that failed before it
/// powered the node on again), it ends as asked: the scenario says what failed.
fn run_joined(vm: vm::Vm, script: &str) -> Result<vm::RunResult> {
    let dir = vm.run_dir.clone();
    let mut boot = 0;
    loop {
        boot += 1;
        let mut run = vm.clone().run(script)?;
        if !dir.join(control::POWERED_OFF).exists() {
            return Ok(run);
        }
        eprintln!("xtask: k8s-test: node guest {} powered off", dir.display());
        while !dir.join(control::POWER_ON).exists() {
            if dir.join("stop").exists() {
                run.exit = vm::Exit::Code(0);
                return Ok(run);
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        for marker in [control::POWERED_OFF, control::POWER_ON] {
            fs::remove_file(dir.join(marker))?;
        }
        fs::rename(
            dir.join("console.log"),
            dir.join(format!("console.{boot}.log")),
        )?;
        eprintln!("xtask: k8s-test: node guest {} powered on", dir.display());
    }
}

pub fn run_tier(ws: &Path, args: &[String]) -> Result<Tier> {
    let started = Instant::now();
    let (node, all) = node_program(ws, args)?;
    let p = prepare_all(ws)?;
    eprintln!(
        "xtask: k8s-test: Kubernetes binaries {:.0} s, images {:.0} s; booting the cluster",
        p.kube_secs, p.image_secs
    );
    let t = Instant::now();
    // Every node booted at once, each its own guest; the first runs the scenarios and the
    // others wait, as joined nodes, until it is done (a `stop` file in their run directory).
    type Joined = Vec<(String, std::result::Result<vm::RunResult, String>)>;
    let boot = || -> Result<(vm::RunResult, Joined)> {
        let nodes = &control::NODES[..node_count()];
        let mut vms = Vec::new();
        for _ in nodes {
            vms.push(vm::Vm::new(ws, &p.kernel)?);
        }
        let dirs: Vec<PathBuf> = vms.iter().map(|v| v.run_dir.clone()).collect();
        let control = control::ControlPlane::start(&dirs[0], &dirs, p.tools.clone())?;
        let names: Vec<&str> = nodes.iter().map(|(n, _)| *n).collect();
        let mut runs = Vec::new();
        for (i, (mut vm, (name, ip))) in vms.into_iter().zip(nodes).enumerate() {
            let first = i == 0;
            let mut input = p.input.clone();
            input["scenarios"] = serde_json::json!(args);
            input["pki"] = serde_json::json!(control.pki);
            input["name"] = serde_json::json!(name);
            input["ip"] = serde_json::json!(ip);
            input["nodes"] = serde_json::json!(names);
            // The nodes' pods never share an address: one /24 each.
            input["pod_subnet"] = serde_json::json!(format!("10.88.{i}.0/24"));
            input["join"] = serde_json::json!(!first);
            let path = vm.run_dir.join("k8s-input.json");
            fs::write(&path, serde_json::to_string_pretty(&input)?)?;
            let script = format!("exec {} {}\n", vm::quoted(&node), vm::quoted(&path));
            let netns = control.netns.clone();
            vm.network = Some(vm::Network {
                netns,
                forwards: forwards(first, ip),
            });
            let (memory, cpus) = if first { FIRST } else { JOINED };
            (vm.writable_root, vm.memory_mib, vm.cpus) = (true, memory, cpus);
            // two nodes on two cores: past 2,400 s four scenarios short of the end (2026-12-07)
            let limit = if nodes.len() > 1 { 3600 } else { 2400 };
            (vm.timeout, vm.echo, vm.state_disk) = (limit, first, !first);
            let stop = vm.run_dir.join("stop");
            runs.push((
                name.to_string(),
                stop,
                std::thread::spawn(move || match first {
                    true => vm.run(&script),
                    false => run_joined(vm, &script),
                }),
            ));
        }
        let mut runs = runs.into_iter();
        let (_, _, first) = runs.next().context("no node")?;
        let first = first.join();
        // The others stop whatever became of the first.
        let mut others = Vec::new();
        for (name, stop, run) in runs {
            if let Err(e) = fs::write(&stop, "the first node is done\n") {
                eprintln!("xtask: k8s-test: cannot tell node {name} to stop: {e}");
            }
            let run = match run.join() {
                Ok(run) => run.map_err(|e| format!("{e:#}")),
                Err(_) => Err("its thread panicked".to_owned()),
            };
            others.push((name, run));
        }
        drop(control);
        let first = first.map_err(|_| anyhow::anyhow!("the first node's thread panicked"))??;
        Ok((first, others))
    };
    let (mut run, mut others) = boot()?;
    if run.exit == vm::Exit::Panic && !run.console.iter().any(|l| l.contains("SCENARIO ")) {
        // The emulator, not the cluster: multi-threaded TCG has oopsed the guest kernel while
        // it patched its own text. Said, and tried once more.
        eprintln!(
            "xtask: k8s-test: the guest kernel panicked before any scenario ran; booting once more\n{}",
            run.console_tail(12)
        );
        (run, others) = boot()?;
    }
    let vm_secs = t.elapsed().as_secs_f64();
    let (mut passed, mut failed) = (0, 0);
    let mut summary = format!(
        "\nKubernetes tier ({vm_secs:.0} s in the VM, {:.0} s in all):\n",
        started.elapsed().as_secs_f64()
    );
    // The cluster's bring-up: the guest's uptime when the first scenario started.
    let up = run.console.iter().find_map(|l| {
        let (_, rest) = l.split_once("k8s [")?;
        rest.split_once("] scenario ").map(|(up, _)| up)
    });
    if let Some(up) = up {
        summary += &format!("  cluster up after {up} s of the guest's uptime\n");
    }
    if let Some(ready) = run
        .console
        .iter()
        .find_map(|l| l.split("] nodes Ready: ").nth(1))
    {
        summary += &format!("  nodes Ready: {ready}\n");
    }
    // A joined node that did not end as asked failed the run, whatever the scenarios said.
    let mut node_failed = 0;
    for (name, other) in &others {
        match other {
            Ok(other) if other.exit == vm::Exit::Code(0) => {}
            Ok(other) => {
                summary += &format!(
                    "  node {name} {} (console: {})\n{}\n",
                    other.exit,
                    other.run_dir.join("console.log").display(),
                    other.console_tail(15)
                );
                node_failed += 1;
            }
            Err(e) => {
                summary += &format!("  node {name} did not run: {e}\n");
                node_failed += 1;
            }
        }
    }
    let mut took: Vec<(f64, String)> = Vec::new();
    let mut one_node: Vec<&str> = Vec::new();
    for line in &run.console {
        if let Some(rest) = line.split("SCENARIO ").nth(1) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let [name, result, secs] = f.as_slice() {
                if *result == "two-nodes" {
                    one_node.push(*name);
                    continue;
                }
                took.push((secs.parse().unwrap_or(0.0), (*name).to_owned()));
                summary += &format!("  {result:<7} {name} ({secs} s)\n");
                if *result == "ok" {
                    passed += 1;
                } else {
                    failed += 1;
                    summary += &failure_lines(&run.console, name);
                }
            }
        }
    }
    if !one_node.is_empty() {
        summary += &format!(
            "  not run, they need a second node (UBLKD_K8S_NODES=2): {}\n",
            one_node.join(", ")
        );
    }
    let expected = if args.is_empty() { &all } else { args }.len() - one_node.len();
    if passed + failed < expected {
        summary += &format!(
            "  {} scenario(s) never ran (the cluster did not come up: {}); logs in {}\n{}\n",
            expected - passed - failed,
            run.exit,
            run.run_dir.join("logs").display(),
            run.console_tail(15)
        );
        failed = expected - passed;
    }
    if failed == 0 && run.exit != vm::Exit::Code(0) {
        summary += &format!("  the guest {}\n", run.exit);
        failed = 1;
    }
    failed += node_failed;
    summary += &format!("  slowest five:\n{}", crate::slowest_five(took, "    "));
    summary.push_str(&format!("{passed} passed, {failed} failed"));
    Ok(Tier {
        passed,
        failed,
        summary,
    })
}
