//! `cargo xtask k8s-test [SCENARIO...]`: a real Kubernetes in the VM, and the driver installed
//! into it as a user would.
//!
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
//! The control plane (etcd, API server, controller manager, scheduler, CoreDNS: `control`)
//! runs on the host, natively, in a network namespace of the tier's own, with QEMU in it too.
//! The guest (`tests/k8s/node`, the `k8s-node` program of the tests crate, with the scenarios)
//! is the cluster's one node, with a writable root (a tmpfs overlay over the host root): containerd, the kubelet, kube-proxy and the driver's pods on the real kernel
//! driver. It installs the chart `deploy/helm/ublkd` with `helm install` and
//! `tests/k8s/values.yaml` (image names and two intervals changed; the chart's defaults render
//! deploy/kubernetes/ublkd.yaml, `cargo xtask manifests`) and runs the scenarios; the
//! snapshot, modify and restart scenarios change the install with `helm upgrade`. kubectl and
//! helm run on the host for the guest (`control`). Under emulation on a 2-core host, a control plane in
//! the guest kept its vCPUs so busy that the API server missed its clients' timeouts and the
//! node never became Ready (CI, stop 29).

use crate::apt::{self, PrivateApt};
use crate::{image, oci, vm};
use anyhow::{bail, Context, Result};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Instant;

pub mod build;
mod control;
mod images;

/// The node's address, where the API server reaches the kubelet: the control plane's
/// namespace holds it on its loopback and QEMU forwards the kubelet's port into the guest.
const KUBELET_FORWARD: &str = "tcp:10.10.0.1:10250-:10250";

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
    if root.exists() {
        fs::remove_dir_all(&root)?;
    }
    fs::create_dir_all(&root)?;
    for d in &debs {
        apt::run_ok(
            std::process::Command::new("dpkg-deb")
                .arg("-x")
                .arg(dl.join(d))
                .arg(&root),
        )?;
    }
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

/// The images the node imports (the sidecars', the stand-ins', the sandbox's and the test pods'),
/// and ublkd's, built by `cargo xtask image`, which the node pushes to its registry instead.
fn all_images(ws: &Path, out: &Path) -> Result<(Vec<images::Image>, oci::Built)> {
    if out.exists() {
        fs::remove_dir_all(out)?;
    }
    fs::create_dir_all(out)?;
    let mut list = Vec::new();
    let built = oci::build(ws, &ws.join("target/image"))?;
    for b in build::SIDECARS {
        let bin = build::ensure(b)?;
        for p in b.packages {
            let cmd = p.rsplit('/').next().context("package path")?;
            list.push(images::binary_image(
                &format!("ublkd.test/{cmd}:{}", b.version),
                &bin.join(cmd),
                &format!("/{cmd}"),
                out,
            )?);
        }
    }
    let standins = build::standins(ws, &out.join("standins"))?;
    for (name, bin, entry) in [
        ("pause", "pause", "/pause"),
        (
            "registrar-standin",
            "registrar",
            "/csi-node-driver-registrar",
        ),
        ("livenessprobe-standin", "livenessprobe", "/livenessprobe"),
    ] {
        list.push(images::binary_image(
            &format!("ublkd.test/{name}:test"),
            &standins.join(bin),
            entry,
            out,
        )?);
    }
    // The test pods' shell and tools: the host's static busybox, run as /bin/sh.
    let busybox = apt::which("busybox").context("busybox not found")?;
    list.push(images::binary_image(
        "ublkd.test/busybox:test",
        &busybox,
        "/bin/sh",
        out,
    )?);
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

    pub fn exit_code(&self) -> ExitCode {
        if self.ok() {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        }
    }
}

/// `cargo xtask k8s-test`: the tier, its summary printed last.
pub fn run(ws: &Path, args: &[String]) -> Result<ExitCode> {
    let tier = run_tier(ws, args)?;
    println!("{}", tier.summary);
    Ok(tier.exit_code())
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

/// Everything the tier needs on the host, built or cached.
struct Prepared {
    kernel: image::Kernel,
    kube: PathBuf,
    helm: PathBuf,
    debs: PathBuf,
    ublkd_image: oci::Built,
    registry: PathBuf,
    prometheus: PathBuf,
    plugins: PathBuf,
    xtask: PathBuf,
    coredns: PathBuf,
    images: Vec<(String, PathBuf)>,
    modules: PathBuf,
    kube_secs: f64,
    image_secs: f64,
}

/// The node program (tests/k8s/node), built with the VM tests' features, and its scenarios'
/// names in their order.
fn node_program(ws: &Path) -> Result<(PathBuf, Vec<String>)> {
    let args = [
        "build",
        "--package",
        "ublkd-tests",
        "--features",
        "vm",
        "--bin",
        "k8s-node",
    ];
    apt::run_ok(crate::cargo().current_dir(ws).args(args))?;
    let bin = ws.join("target/debug/k8s-node");
    let out = std::process::Command::new(&bin)
        .arg("--list")
        .output()
        .with_context(|| format!("running {} --list", bin.display()))?;
    let names = String::from_utf8_lossy(&out.stdout);
    Ok((bin, names.lines().map(str::to_owned).collect()))
}

fn check_scenarios(args: &[String], all: &[String]) -> Result<()> {
    for a in args {
        if !all.contains(a) {
            bail!("unknown scenario {a:?}; the scenarios: {}", all.join(", "));
        }
    }
    Ok(())
}

fn prepare_all(ws: &Path) -> Result<Prepared> {
    let missing: Vec<&str> = HOST_TOOLS
        .iter()
        .filter(|(c, _)| apt::which(c).is_none())
        .map(|(_, p)| *p)
        .collect();
    apt::install_packages(&missing)?;
    let kernel = image::prepare(ws)?;
    let t = Instant::now();
    let kube = build::ensure(&build::KUBERNETES)?;
    let helm = crate::gotools::ensure(crate::deploy::helm::HELM)?;
    let kube_secs = t.elapsed().as_secs_f64();
    let debs = debian_packages()?;
    let out = ws.join("target/k8s");
    let t = Instant::now();
    let (imgs, ublkd_image) = all_images(ws, &out.join("images"))?;
    let registry = crate::gotools::ensure(REGISTRY)?;
    let prometheus = build::ensure(&PROMETHEUS)?.join("prometheus");
    // `kubectl ublkd`, alone in a directory on the host kubectl's PATH (`control`).
    let release = crate::dist::release_build(ws)?;
    let plugins = out.join("plugins");
    fs::create_dir_all(&plugins)?;
    fs::copy(release.join("kubectl-ublkd"), plugins.join("kubectl-ublkd"))
        .context("copying kubectl-ublkd")?;
    let xtask = std::env::current_exe().context("finding this xtask binary")?;
    let image_secs = t.elapsed().as_secs_f64();
    let coredns = build::coredns(ws, &out.join("coredns"))?;
    let images = imgs.into_iter().map(|i| (i.reference, i.archive)).collect();
    let modules = kernel
        .cache
        .join("kernel")
        .join(&kernel.kver)
        .join("root/usr/lib/modules")
        .join(&kernel.kver);
    if !modules.is_dir() {
        bail!(
            "the guest kernel's modules are not at {}",
            modules.display()
        );
    }
    Ok(Prepared {
        kernel,
        kube,
        helm,
        debs,
        ublkd_image,
        registry,
        prometheus,
        plugins,
        xtask,
        coredns,
        images,
        modules,
        kube_secs,
        image_secs,
    })
}

/// `cargo xtask k8s-test --prepare`: everything built and cached, nothing booted.
pub fn prepare(ws: &Path, args: &[String]) -> Result<()> {
    check_scenarios(args, &node_program(ws)?.1)?;
    let p = prepare_all(ws)?;
    eprintln!(
        "xtask: k8s-test: prepared (Kubernetes binaries {:.0} s, {} images {:.0} s): {}",
        p.kube_secs,
        p.images.len(),
        p.image_secs,
        p.kube.display()
    );
    Ok(())
}

pub fn run_tier(ws: &Path, args: &[String]) -> Result<Tier> {
    let started = Instant::now();
    let (node, all) = node_program(ws)?;
    check_scenarios(args, &all)?;
    let p = prepare_all(ws)?;
    // The snapshot add-ons a cluster admin installs once (deploy/csi/README.md, "Snapshots"):
    // the CRDs and the snapshot-controller's manifests, from the modules of their release.
    let snapshotter = build::SIDECARS
        .iter()
        .find(|b| b.name == "external-snapshotter")
        .context("no external-snapshotter build")?;
    let snap_dir = build::module_dir(snapshotter.module, snapshotter.version)?;
    let crd_dir = build::module_dir(build::SNAPSHOT_CLIENT.0, build::SNAPSHOT_CLIENT.1)?;
    // What the node reads (tests/k8s/node, `kube::Input`: it refuses a field it does not know).
    let input = |pki: PathBuf| {
        serde_json::json!({
            "bin": p.kube,
            "debs": p.debs,
            "images": p.images,
            "chart": ws.join(crate::deploy::helm::CHART),
            "values": ws.join("tests/k8s/values.yaml"),
            "modules": p.modules,
            "scenarios": args,
            "snapshot_crds": crd_dir.join("config/crd"),
            "snapshot_controller": snap_dir.join("deploy/kubernetes/snapshot-controller"),
            "snapshotter_version": snapshotter.version,
            "registry": p.registry,
            "xtask": p.xtask,
            "ublkd_archive": p.ublkd_image.archive,
            "ublkd_manifest": p.ublkd_image.manifest,
            "prometheus": p.prometheus,
            "pki": pki,
        })
    };
    eprintln!(
        "xtask: k8s-test: Kubernetes binaries {:.0} s, images {:.0} s; booting the cluster",
        p.kube_secs, p.image_secs
    );
    let t = Instant::now();
    let boot = || -> Result<vm::RunResult> {
        let vm = vm::Vm::new(ws, &p.kernel)?;
        let control = control::ControlPlane::start(
            vm.run_dir(),
            control::Tools {
                bin: p.kube.clone(),
                helm: p.helm.clone(),
                plugins: p.plugins.clone(),
                debs: p.debs.clone(),
                coredns: p.coredns.clone(),
            },
        )?;
        let path = vm.run_dir().join("k8s-input.json");
        fs::write(
            &path,
            serde_json::to_string_pretty(&input(control.pki.clone()))?,
        )?;
        let script = format!(
            "exec {} {}\n",
            vm::shell_quote(&node.to_string_lossy()),
            vm::shell_quote(&path.to_string_lossy())
        );
        let run = vm
            .network(vm::Network {
                netns: control.netns.clone(),
                forwards: vec![KUBELET_FORWARD.to_owned()],
            })
            .writable_root(true)
            // Both vCPUs on host threads of their own: with one TCG thread for both, the
            // kubelet and containerd alone kept it busy and a pod took minutes to start, while
            // the host's other core idled. The guest loads every module before anything runs
            // in parallel (node.rs), which is when multi-threaded TCG once oopsed it.
            .tcg_single_thread(false)
            .memory_mib(6144)
            .timeout_secs(2400)
            .echo(true)
            .run(&script);
        drop(control);
        run
    };
    let mut run = boot()?;
    if run.exit == vm::Exit::Panic && !run.console.iter().any(|l| l.contains("SCENARIO ")) {
        // The emulator, not the cluster: multi-threaded TCG has oopsed the guest kernel while
        // it patched its own text. Said, and tried once more.
        eprintln!(
            "xtask: k8s-test: the guest kernel panicked before any scenario ran; booting once more\n{}",
            run.console_tail(12)
        );
        run = boot()?;
    }
    let vm_secs = t.elapsed().as_secs_f64();
    let mut passed = 0;
    let mut failed = 0;
    let mut summary = format!(
        "\nKubernetes tier ({vm_secs:.0} s in the VM, {:.0} s in all):\n",
        started.elapsed().as_secs_f64()
    );
    let mut took: Vec<(f64, String)> = Vec::new();
    for line in &run.console {
        // The cluster's bring-up: the guest's uptime when the first scenario started.
        if took.is_empty() && !summary.contains("cluster up") {
            if let Some(up) = line
                .split("k8s [")
                .nth(1)
                .filter(|r| r.contains("] scenario "))
                .and_then(|r| r.split(']').next())
            {
                summary.push_str(&format!(
                    "  cluster up after {up} s of the guest's uptime\n"
                ));
            }
        }
        if let Some(rest) = line.split("SCENARIO ").nth(1) {
            let f: Vec<&str> = rest.split_whitespace().collect();
            if let [name, result, secs] = f.as_slice() {
                took.push((secs.parse().unwrap_or(0.0), (*name).to_owned()));
                summary.push_str(&format!("  {result:<7} {name} ({secs} s)\n"));
                if *result == "ok" {
                    passed += 1;
                } else {
                    failed += 1;
                    summary.push_str(&failure_lines(&run.console, name));
                }
            }
        }
    }
    let expected = if args.is_empty() {
        all.len()
    } else {
        args.len()
    };
    if passed + failed < expected {
        summary.push_str(&format!(
            "  {} scenario(s) never ran (the cluster did not come up: {}); logs in {}\n{}\n",
            expected - passed - failed,
            run.exit,
            run.run_dir.join("logs").display(),
            run.console_tail(15)
        ));
        failed = expected - passed;
    }
    if failed == 0 && run.exit != vm::Exit::Code(0) {
        summary.push_str(&format!("  the guest {}\n", run.exit));
        failed = 1;
    }
    took.sort_by(|a, b| b.0.total_cmp(&a.0));
    summary.push_str("  slowest five:\n");
    for (secs, name) in took.iter().take(5) {
        summary.push_str(&format!("    {secs:7.1} s  {name}\n"));
    }
    summary.push_str(&format!("{passed} passed, {failed} failed"));
    Ok(Tier {
        passed,
        failed,
        summary,
    })
}
