//! `k8s-node INPUT`, in a guest: one node of the Kubernetes tier's (`cargo xtask k8s-test`)
//! cluster, whose control plane runs on the host (`control`). On every node: containerd, the
//! kubelet and kube-proxy from the binaries the host built, and the offline images imported.
//! The first node then pushes ublkd's image to its own registry, installs deploy/helm/ublkd
//! with `helm install` and the test's values once every node is Ready, and runs the scenarios
//! (`scenarios`); a node that joins (`Input::join`) registers with a taint that keeps the
//! scenarios' pods off it (the DaemonSets tolerate it), pulls ublkd's image from the first
//! node's registry, and waits for `stop`. Each guest reaches the control plane at 10.0.2.2
//! (QEMU's user network), and the API server reaches its kubelet at the node's address, which
//! its QEMU forwards.
//!
//! Each scenario prints `SCENARIO <name> ok|FAILED <seconds>`; the exit status is the number
//! that failed, or 100 when the cluster never came up.

#![forbid(unsafe_code)]

mod kube;
mod scenarios;

use anyhow::{bail, ensure, Context, Result};
use kube::{
    append, at_once, fill, last_lines, local, localw, wait_for, words, Daemon, Input, Node, Sc,
    NODE, REGISTRY_FROM_HOST,
};
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

const HOST_IP: &str = "10.0.2.2";
/// The node's own registry, on its loopback.
const REGISTRY: &str = "127.0.0.1:5000";
/// Where the node keeps its copy of the certificates.
const PKI: &str = "/etc/kubernetes/pki";

/// The node's state: tmpfs each, since an overlay cannot be the upper layer of containerd's
/// overlays and the kubelet's and ublkd's state wants a plain file system.
const STATE_DIRS: &[&str] = &[
    "/var/lib/containerd",
    "/var/lib/kubelet",
    UBLKD_STATE,
    "/var/lib/etcd",
];
/// ublkd's state directory (the chart's `state_dir`).
const UBLKD_STATE: &str = "/var/lib/ublkd";
/// The file classes' root (tests/k8s/values.yaml).
const VOLUMES_ROOT: &str = "/var/lib/ublkd/volumes";

/// Every module the node loads, all before anything runs in parallel: a module load patches
/// kernel text (static keys), and under TCG that has oopsed a guest once (int3 in
/// kmem_cache_alloc, from ip6tables).
const MODULES: &[&str] = &[
    "virtio_net",
    "bridge",
    "veth",
    "br_netfilter",
    "dummy",
    "overlay",
    "nf_conntrack",
    "nf_nat",
    "nf_tables",
    "nft_compat",
    "nft_chain_nat",
    "xt_MASQUERADE",
    "xt_comment",
    "xt_mark",
    "xt_addrtype",
    "xt_conntrack",
    "xt_nat",
    "xt_statistic",
    "xt_multiport",
    "xt_tcpudp",
    "xt_physdev",
    "xt_limit",
    "ipt_REJECT",
    "nf_reject_ipv4",
    "iptable_nat",
    "iptable_filter",
    "iptable_mangle",
    "ip_tables",
    "ip6_tables",
    "ip6table_nat",
    "ip6table_filter",
    "ip6table_mangle",
    "ip6t_REJECT",
    "nf_reject_ipv6",
];

/// The node's program: the cluster brought up, the scenarios run; exits with their failures.
/// `k8s-node --list` prints the scenarios' names, in order, for the host.
fn main() -> Result<()> {
    let arg = std::env::args_os()
        .nth(1)
        .context("usage: k8s-node INPUT | --list")?;
    if arg == "--list" {
        scenarios::names().for_each(|n| println!("{n}"));
        return Ok(());
    }
    let input = Path::new(&arg);
    let text = fs::read_to_string(input).with_context(|| format!("reading {}", input.display()))?;
    let input: Input = serde_json::from_str(&text)?;
    let run = PathBuf::from(std::env::var_os("UBLKD_VM_RUN").context("UBLKD_VM_RUN is not set")?);
    let node = Node::new(input, &run)?;
    let joined = node.input.join;
    let daemons = match bring_up(&node) {
        Ok(d) => d,
        Err(e) => {
            node.say(format!("cluster: {e:#}"));
            keep_pod_logs(&node);
            for entry in fs::read_dir(&node.logs)?.flatten() {
                let p = entry.path();
                if p.extension().is_some_and(|x| x == "log") {
                    let text = fs::read_to_string(&p).unwrap_or_default();
                    println!("--- tail of {}\n{}", p.display(), last_lines(&text, 15));
                }
            }
            std::process::exit(100);
        }
    };
    if joined {
        node.say("joined the cluster; waiting for the first node to finish");
        while !run.join("stop").exists() {
            std::thread::sleep(Duration::from_secs(1));
        }
        keep_pod_logs(&node);
        drop(daemons);
        std::process::exit(0);
    }
    let failed = scenarios::run(&node);
    keep_pod_logs(&node);
    node.say(format!("done: {failed} failed"));
    drop(daemons);
    std::process::exit(i32::try_from(failed).unwrap_or(i32::MAX));
}

/// The pods' own logs, kept on every run (a sidecar's restart says why only there); the run
/// directory is the host's.
fn keep_pod_logs(node: &Node) {
    let to = node.logs.join("pods");
    if let Err(e) = local("cp", &["-r", "/var/log/pods", &to.to_string_lossy()]) {
        node.say(format!("the pods' logs could not be kept: {e:#}"));
    }
}

fn write(path: &str, text: &str) -> Result<()> {
    if let Some(dir) = Path::new(path).parent() {
        fs::create_dir_all(dir)?;
    }
    fs::write(path, text).with_context(|| format!("writing {path}"))
}

/// Runs `f` up to `n` times, 5 s apart: the API server of a slow emulated guest can time a
/// request out, and every apply here is idempotent.
fn tries<T>(n: u32, mut f: impl FnMut() -> Result<T>) -> Result<T> {
    let mut left = n;
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if left <= 1 => return Err(e),
            Err(_) => left -= 1,
        }
        std::thread::sleep(Duration::from_secs(5));
    }
}

/// The file classes' root on a file system that can reflink (snapshots, restores and clones
/// are reflinks of a backing file): XFS with reflink=1 on a loop device over a sparse file,
/// as an admin gives a node a disk for it.
fn volumes_disk(node: &Node) -> Result<()> {
    let disk_dir = "/var/lib/node-disk";
    fs::create_dir_all(disk_dir)?;
    fs::create_dir_all(VOLUMES_ROOT)?;
    localw(&format!("mount -t tmpfs -o mode=0755 disk {disk_dir}"))?;
    let img = format!("{disk_dir}/volumes.img");
    fs::File::create(&img)?.set_len(4 << 30)?;
    if let Err(e) = localw("modprobe loop") {
        node.say(format!("modprobe loop: {e:#}"));
    }
    let disk = localw(&format!("losetup --find --show {img}"))?
        .trim()
        .to_owned();
    localw(&format!("mkfs.xfs -q -m reflink=1 {disk}"))?;
    localw(&format!("mount -o discard {disk} {VOLUMES_ROOT}"))?;
    Ok(())
}

/// What a joined node keeps on the disk that outlives its guest (`Vm::state_disk`, /dev/vda),
/// as a real node keeps them on its own disk: ublkd's registry and its volumes' files, and
/// containerd's images and containers. A boot after a power-off finds them as they were, and
/// pulls and unpacks nothing again (node-dies: 95 s from the node Ready to ublkd restored
/// when the images were imported and ublkd's pulled anew at every boot, 2026-12-07).
const KEPT: &[&str] = &[UBLKD_STATE, "/var/lib/containerd"];

/// The state disk of a joined node: an XFS that can reflink, made on its first boot, mounted at
/// `DISK_ROOT`, and each of `KEPT` a directory of it bound in place.
fn state_disk(node: &Node) -> Result<()> {
    const DISK: &str = "/dev/vda";
    const DISK_ROOT: &str = "/var/lib/node-state";
    localw("modprobe virtio_blk")?;
    ensure!(
        wait_for(30, || Path::new(DISK).exists()),
        "no {DISK}: the joined node's state disk"
    );
    if localw(&format!("blkid -o value -s TYPE {DISK}")).is_err() {
        node.say(format!("{DISK}: a new state disk, formatted"));
        localw(&format!("mkfs.xfs -q -m reflink=1 {DISK}"))?;
    } else {
        node.say(format!("{DISK}: the state disk of an earlier boot"));
    }
    fs::create_dir_all(DISK_ROOT)?;
    localw(&format!("mount -o discard {DISK} {DISK_ROOT}"))?;
    for d in KEPT {
        let kept = format!("{DISK_ROOT}/{}", d.trim_start_matches("/var/lib/"));
        fs::create_dir_all(&kept)?;
        fs::create_dir_all(d)?;
        localw(&format!("mount --bind {kept} {d}"))?;
    }
    fs::create_dir_all(VOLUMES_ROOT)?;
    Ok(())
}

/// Everything up to the scenarios; what keeps running is returned, to live as long as they do.
fn bring_up(node: &Node) -> Result<Vec<Daemon>> {
    let i = &node.input;
    let l = |name: &str| node.logs.join(name);
    // --- the node: modules, file systems, network, cgroups ---
    let kver = localw("uname -r")?.trim().to_owned();
    let moddir = format!("/usr/lib/modules/{kver}");
    fs::create_dir_all(&moddir)?;
    local("mount", &["--bind", &i.modules.to_string_lossy(), &moddir])
        .context("binding the kernel's modules")?;
    if i.join {
        state_disk(node)?;
    }
    for d in STATE_DIRS.iter().filter(|d| !(i.join && KEPT.contains(d))) {
        fs::create_dir_all(d)?;
        localw(&format!("mount -t tmpfs -o mode=0755 state {d}"))?;
    }
    if !i.join {
        volumes_disk(node)?;
    }
    localw("mount --make-rshared /")?;
    let mut failed_modules = String::new();
    for m in MODULES {
        if let Err(e) = localw(&format!("modprobe {m}")) {
            failed_modules.push_str(&format!("{e:#}\n"));
        }
    }
    fs::write(l("modprobe.log"), failed_modules)?;
    localw("sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1")?;
    localw("ip link add node0 type dummy")?;
    // /32: another node's address is not on this link (the forward into that guest is).
    localw(&format!("ip addr add {}/32 dev node0", i.ip))?;
    localw("ip link set node0 up")?;
    // The link to the control plane: QEMU's user network, its host at HOST_IP.
    let nic = fs::read_dir("/sys/class/net")?
        .flatten()
        .find(|e| e.path().join("device").exists())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .context("no NIC for the network to the control plane")?;
    localw(&format!("ip link set {nic} up"))?;
    localw(&format!("ip addr add 10.0.2.15/24 dev {nic}"))?;
    localw(&format!("ip route add default via {HOST_IP} dev {nic}"))?;
    localw(&format!("hostname {}", i.name))?;
    fs::write("/etc/hosts", format!("127.0.0.1 localhost {}\n", i.name))?;
    if !Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        localw("mount -t cgroup2 none /sys/fs/cgroup").context("no cgroup v2")?;
    }
    // Every controller delegated to the kubelet's hierarchy.
    for c in fs::read_to_string("/sys/fs/cgroup/cgroup.controllers")?.split_whitespace() {
        // One the kernel will not delegate stays out; the kubelet says so if it needs it.
        let _ = fs::write("/sys/fs/cgroup/cgroup.subtree_control", format!("+{c}"));
    }
    // --- the certificates and kubeconfigs the host made ---
    fs::create_dir_all(PKI)?;
    for e in fs::read_dir(&i.pki)?.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if name.ends_with(".crt") || name.ends_with(".key") {
            fs::copy(e.path(), Path::new(PKI).join(&name))?;
        }
    }
    // This node's own kubelet certificates, under the names the kubelet's config gives.
    for ext in ["crt", "key"] {
        let serving = i.pki.join(format!("kubelet-serving-{}.{ext}", i.name));
        fs::copy(
            &serving,
            Path::new(PKI).join(format!("kubelet-serving.{ext}")),
        )
        .with_context(|| format!("no {}", serving.display()))?;
    }
    let kubelet_conf = format!("kubelet-{}", i.name);
    for (c, to) in [
        ("admin", "admin"),
        (kubelet_conf.as_str(), "kubelet"),
        ("kube-proxy", "kube-proxy"),
    ] {
        fs::copy(
            i.pki.join(format!("{c}.conf")),
            format!("/etc/kubernetes/{to}.conf"),
        )
        .with_context(|| format!("no kubeconfig for {c}"))?;
    }
    cpu_log(node);
    node.say("node ready, certificates in place");

    // --- containerd and the images, before the control plane ---
    // The import is the longest step of the boot under emulation (unpacking every layer), and
    // the control plane, once up, keeps both vCPUs busy: it ran 4-7x slower beside it on a slow
    // host. So containerd imports the images first, two at a time, with the vCPUs to itself.
    let cni = i.debs.join("usr/lib/cni").to_string_lossy().into_owned();
    let config = fill(include_str!("containerd.toml"), &[("CNI_BIN", &cni)]);
    let hosts = format!("/etc/containerd/certs.d/{REGISTRY}/hosts.toml");
    // The first node's registry: on the loopback there, through its address from the others.
    let registry = if i.join { REGISTRY_FROM_HOST } else { REGISTRY };
    let registry = fill(
        include_str!("registry-hosts.toml"),
        &[("REGISTRY", registry)],
    );
    let pods = fill(include_str!("pods.conflist"), &[("SUBNET", &i.pod_subnet)]);
    for (path, text) in [
        ("/etc/containerd/config.toml", config.as_str()),
        (hosts.as_str(), registry.as_str()),
        ("/etc/cni/net.d/10-pods.conflist", pods.as_str()),
    ] {
        write(path, text)?;
    }
    let bin = i.debs.join("usr/bin");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let containerd = Daemon::start(
        &bin.join("containerd"),
        &[],
        &[("PATH", &path)],
        &l("containerd.log"),
    )?;
    let mut daemons = vec![containerd];
    let ctr = bin.join("ctr").to_string_lossy().into_owned();
    let ctr = |args: &[&str]| local(&ctr, &[&["-n", "k8s.io"][..], args].concat());
    if !wait_for(60, || ctr(&["version"]).is_ok()) {
        bail!("containerd never answered");
    }
    let mut log = String::new();
    // on a joined node's kept disk after a power-off, the images of its first boot
    let present = ctr(&["images", "ls", "-q"])?;
    let missing: Vec<_> = i
        .images
        .iter()
        .filter(|(r, _)| !present.lines().any(|l| l == r))
        .cloned()
        .collect();
    for pair in missing.chunks(2) {
        for done in at_once(pair, |(r, a)| import(&ctr, r, a)) {
            log.push_str(&done.unwrap_or_else(|_| bail!("the import panicked"))?);
        }
    }
    fs::write(l("images.log"), log)?;
    let listed = ctr(&["images", "ls", "-q"])?;
    for (r, a) in &i.images {
        if !listed.lines().any(|l| l == r) {
            bail!("image {r} missing after importing {}", a.display());
        }
    }
    node.say(format!(
        "images imported: {} ({} kept from an earlier boot)",
        missing.len(),
        i.images.len() - missing.len()
    ));

    // --- the control plane, on the host ---
    // The bring-up's kubectl and helm calls, logged as a scenario's are (logs/bring-up.log).
    let s = Sc::new(node, fs::File::create(l("bring-up.log"))?);
    if !wait_for(600, || s.qw("get --raw /readyz").is_ok()) {
        bail!("the API server (on the host, {HOST_IP}) never answered");
    }
    node.say("API server ready");
    write(
        "/var/lib/kubelet/config.yaml",
        &fill(
            include_str!("kubelet.yaml"),
            &[("PKI", PKI), ("DNS", HOST_IP)],
        ),
    )?;
    kubelet_service(node);
    let proxy = format!(
        "--kubeconfig=/etc/kubernetes/kube-proxy.conf --hostname-override={} \
         --cluster-cidr=10.88.0.0/16 --proxy-mode=iptables --iptables-sync-period=5m",
        i.name
    );
    daemons.push(Daemon::start(
        &i.bin.join("kube-proxy"),
        &words(&proxy),
        &[],
        &l("kube-proxy.log"),
    )?);
    if !wait_for(600, || s.node_is_ready(&i.name)) {
        bail!("the node never became Ready");
    }
    node.say("node Ready");
    // Pods reach the API server through the kubernetes Service (kube-proxy's rules).
    let rules = || localw("iptables-save -t nat").is_ok_and(|r| r.contains("KUBE-SVC"));
    if !wait_for(120, rules) {
        bail!("kube-proxy wrote no Service rules");
    }
    if i.join {
        return Ok(daemons);
    }
    ensure!(
        i.name == NODE,
        "the first node is {}, the scenarios' {NODE}",
        i.name
    );

    // --- cluster add-ons: what deploy/csi/README.md ("Snapshots") has an admin install once ---
    tries(3, || {
        s.k(&["apply", "-k", &i.snapshot_crds.to_string_lossy()])
    })
    .context("the snapshot CRDs")?;
    s.kw("wait --for=condition=Established --timeout=60s \
         crd/volumesnapshots.snapshot.storage.k8s.io \
         crd/volumesnapshotcontents.snapshot.storage.k8s.io \
         crd/volumesnapshotclasses.snapshot.storage.k8s.io")
        .context("the snapshot CRDs never became Established")?;
    // Where the host's kubectl reads it: the run directory.
    let w = node.logs.join("../snapshot-controller");
    fs::create_dir_all(&w)?;
    for f in ["rbac", "setup"].map(|k| format!("{k}-snapshot-controller.yaml")) {
        fs::copy(i.snapshot_controller.join(&f), w.join(&f))?;
    }
    let kust = include_str!("snapshot-controller.yaml");
    fs::write(
        w.join("kustomization.yaml"),
        fill(kust, &[("VERSION", &i.snapshotter_version)]),
    )?;
    tries(3, || s.k(&["apply", "-k", &w.to_string_lossy()])).context("the snapshot-controller")?;
    node.say("snapshot CRDs and controller applied");

    // --- ublkd's image in a registry, as a user's would be ---
    // Pushed as :test and as :roll (ublkd-restart's upgrade) with `cargo xtask image --push`'s
    // code; the node never imported it: the install pulls it through the chart's image.* values.
    fs::create_dir_all("/var/lib/registry")?;
    write("/etc/registry.yml", include_str!("registry.yml"))?;
    daemons.push(Daemon::start(
        &i.registry,
        &["serve", "/etc/registry.yml"],
        &[],
        &l("registry.log"),
    )?);
    let v2 = format!("http://{REGISTRY}/v2/");
    if !wait_for(60, || localw(&format!("curl -fsS {v2}")).is_ok()) {
        bail!("the registry never answered");
    }
    for tag in ["test", "roll"] {
        let reference = format!("{REGISTRY}/ublkd:{tag}");
        let archive = i.ublkd_archive.to_string_lossy();
        let push = [
            "push-archive",
            &archive,
            &reference,
            "--manifest",
            &i.ublkd_manifest,
            "--insecure",
        ];
        local(&i.xtask.to_string_lossy(), &push)
            .with_context(|| format!("pushing ublkd's image to {REGISTRY}"))?;
    }
    if ctr(&["images", "ls", "-q"])?.contains("/ublkd:") {
        bail!("the node has a ublkd image before the install pulls one");
    }
    node.say(format!(
        "ublkd's image pushed to {REGISTRY} as :test and :roll"
    ));

    // --- install as a user would: deploy/helm/ublkd (docs/kubernetes.md, "Install the driver") ---
    let ns = "apiVersion: v1
kind: Namespace
metadata:
  name: ublkd-system
  labels:
    pod-security.kubernetes.io/enforce: privileged
";
    tries(3, || s.apply(ns))?;
    // Every node in the cluster before the install, so that the DaemonSets start everywhere.
    let all_ready = || i.nodes.iter().all(|n| s.node_is_ready(n));
    if !wait_for(900, all_ready) {
        bail!("not every node became Ready: {}", i.nodes.join(", "));
    }
    node.say(format!("nodes Ready: {}", i.nodes.len()));
    // The chart as a release ships it: packaged with ublkd's image pinned by digest, pushed to
    // a registry as an OCI artefact, installed from there (helm runs on the host, which
    // reaches the node's registry at the node's address). The directory's chart is copied into
    // the run directory, where the host's helm reads and writes.
    let pkg = node.logs.with_file_name("chart");
    fs::create_dir_all(&pkg)?;
    let (chart, to) = (i.chart.to_string_lossy(), pkg.to_string_lossy());
    local("cp", &["-r", &chart, &to])?;
    let values_path = pkg.join("ublkd/values.yaml");
    let shipped = fs::read_to_string(&values_path)?;
    let pinned = shipped
        .replacen("ghcr.io/example/ublkd", &format!("{REGISTRY}/ublkd"), 1)
        .replacen(
            "digest: \"\"",
            &format!("digest: {:?}", i.ublkd_manifest),
            1,
        );
    ensure!(
        pinned.contains(&format!("{REGISTRY}/ublkd")) && pinned.contains(&i.ublkd_manifest),
        "the chart's values.yaml no longer has the image.repository and image.digest to pin"
    );
    write(&values_path.to_string_lossy(), &pinned)?;
    let chart = pkg.join("ublkd");
    let out = s.helm(&["package", &chart.to_string_lossy(), "-d", &to])?;
    let tgz = out
        .split_whitespace()
        .find(|w| w.ends_with(".tgz"))
        .with_context(|| format!("helm package said no .tgz: {out}"))?;
    s.helmw(&format!(
        "push {tgz} oci://{REGISTRY_FROM_HOST}/charts --plain-http"
    ))?;
    node.say(format!("chart packaged and pushed: {tgz}"));
    let values = i.values.to_string_lossy();
    let out = s.helm_chart("install", &["--values", &values])?;
    fs::write(
        l("install.log"),
        out + &s.helmw("status ublkd --namespace ublkd-system")?,
    )?;
    node.say("helm install of the packaged chart done");
    if !wait_for(600, || s.all_ready()) {
        for line in [
            "-n ublkd-system get pods -o wide",
            "-n ublkd-system describe pods",
            "get events -A --field-selector type=Warning",
        ] {
            let out = s.kw(line).unwrap_or_else(|e| format!("{e:#}"));
            println!("{}", last_lines(&out, 60));
        }
        bail!("the driver's pods never became Ready");
    }
    node.say("every pod Ready");
    let pulled: Vec<String> = ctr(&["images", "ls", "-q"])?
        .lines()
        .filter(|l| l.starts_with(&format!("{REGISTRY}/ublkd@{}", i.ublkd_manifest)))
        .map(str::to_owned)
        .collect();
    if pulled.is_empty() {
        bail!("ublkd's pods are Ready but its image was not pulled from {REGISTRY} by digest");
    }
    node.say(format!(
        "pulled from the node's registry: {}",
        pulled.join(" ")
    ));
    println!("{}", s.kw("-n ublkd-system get pods -o wide")?);
    Ok(daemons)
}

/// One image archive imported under its reference; what ctr said.
fn import(
    ctr: &dyn Fn(&[&str]) -> Result<String>,
    reference: &str,
    archive: &Path,
) -> Result<String> {
    let base = reference.rsplit_once(':').map_or(reference, |(b, _)| b);
    let archive = archive.to_string_lossy();
    let out = ctr(&["images", "import", "--base-name", base, &archive])
        .with_context(|| format!("importing {archive}"))?;
    let got = out
        .lines()
        .find_map(|l| l.strip_prefix("unpacking ")?.split_whitespace().next())
        .map(str::to_owned);
    if let Some(got) = got.filter(|g| g != reference) {
        ctr(&["images", "tag", &got, reference])?;
    }
    Ok(out)
}

/// The kubelet, run as a node's systemd runs it (Restart=always, RestartSec=1): under emulation
/// its first start can find containerd too busy to answer the CRI within its timeout, and then
/// it exits; the kubelet-restart scenario kills it and this brings it back. /run/kubelet.pid is
/// the running kubelet's.
fn kubelet_service(node: &Node) {
    let kubelet = node.input.bin.join("kubelet");
    let log = node.logs.join("kubelet.log");
    let (name, ip) = (node.input.name.clone(), node.input.ip.clone());
    // A joined node keeps the scenarios' pods off it: only what tolerates every taint (the
    // driver's DaemonSets) runs there.
    let taint: &[&str] = if node.input.join {
        &["--register-with-taints=ublkd.test/joined=true:NoSchedule"]
    } else {
        &[]
    };
    std::thread::spawn(move || loop {
        let out = fs::OpenOptions::new().create(true).append(true).open(&log);
        let status = out.and_then(|out| {
            let mut child = Command::new(&kubelet)
                .args([
                    "--config=/var/lib/kubelet/config.yaml",
                    "--kubeconfig=/etc/kubernetes/kubelet.conf",
                    &format!("--hostname-override={name}"),
                    &format!("--node-ip={ip}"),
                ])
                .args(taint)
                .stdout(out.try_clone()?)
                .stderr(out)
                .spawn()?;
            fs::write("/run/kubelet.pid", child.id().to_string())?;
            child.wait()
        });
        // The note is for the reader of the log; the restart happens either way.
        append(
            &log,
            &format!("the kubelet exited ({status:?}); starting it again in 1 s\n"),
        );
        std::thread::sleep(Duration::from_secs(1));
    });
}

/// Where the node's CPU goes: every process's CPU time, every two minutes (logs/cpu.log).
fn cpu_log(node: &Node) {
    let log = node.logs.join("cpu.log");
    std::thread::spawn(move || {
        let mut n = 0u64;
        loop {
            let ps = localw("ps -eo pid,rss,time,comm --sort=-time").unwrap_or_default();
            let top: Vec<&str> = ps.lines().take(25).collect();
            append(
                &log,
                &format!("--- k8s [{} s]\n{}\n", n * 120, top.join("\n")),
            );
            n += 1;
            std::thread::sleep(Duration::from_secs(120));
        }
    });
}
