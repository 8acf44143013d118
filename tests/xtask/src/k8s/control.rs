//! The Kubernetes tier's control plane, on the host, inside the tier's own network namespace:
//! one CA and the certificates and kubeconfigs of every component, then etcd, kube-apiserver,
//! kube-controller-manager, kube-scheduler and the cluster's DNS; and the node's kubectl and
//! helm requests, answered here.
//! Why here and not in the guest: under emulation on a 2-core host the control plane kept the
//! guest's vCPUs so busy that the API server missed its clients' 10 s timeouts and the node
//! never became Ready (CI, stop 29). A cluster's control plane is other machines than its nodes
//! anyway; here it is the host, natively, and the guests are its nodes. The first guest's kubectl
//! runs here too: under emulation each kubectl process cost the guest seconds of CPU.
//! The network (the namespace has only its loopback): each guest reaches this side at 10.0.2.2
//! (QEMU's user network: the API server on :6443, the DNS on :53), and this side reaches each
//! node's kubelet at the node's address (`NODES`), :10250, which the namespace holds on its
//! loopback and that node's QEMU forwards into its guest.
use crate::apt;
use anyhow::{bail, ensure, Context, Result};
use std::fs::{self, File};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The cluster's nodes, each its own guest: its name, and its address, where the API server
/// reaches its kubelet (the namespace holds it on its loopback and that guest's QEMU forwards
/// it). The first runs the registry, the install and the scenarios; the others join.
pub const NODES: &[(&str, &str)] = &[("ublkd-vm", "10.10.0.1"), ("ublkd-vm-b", "10.10.0.2")];
/// In a node's run directory: its guest was powered off by a scenario (`power NODE off`), so
/// its end is no failure, and its guest waits to be booted again.
pub const POWERED_OFF: &str = "powered-off";
/// In a node's run directory: boot the powered-off guest again (`power NODE on`).
pub const POWER_ON: &str = "power-on";
const HOST_IP: &str = "10.0.2.2";
/// The API server's audit: every request of ublkd's namespace's service accounts (the node
/// plugin, its sidecars, the controllers), one JSON line each, without bodies.
const AUDIT_POLICY: &str = "apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
  - level: Metadata
    userGroups: [\"system:serviceaccounts:ublkd-system\"]
  - level: None
";

/// What the control plane runs, built or unpacked by the tier.
#[derive(Debug, Clone)]
pub struct Tools {
    /// The Kubernetes binaries.
    pub bin: PathBuf,
    pub helm: PathBuf,
    /// A directory with kubectl-ublkd, on the node's kubectl's PATH.
    pub plugins: PathBuf,
    /// The Debian packages extracted (etcd).
    pub debs: PathBuf,
    pub coredns: PathBuf,
    /// OPA, and the directory of the admission policies it evaluates (`tests/k8s/policy`).
    pub opa: PathBuf,
    pub policies: PathBuf,
}

/// The control plane of one boot: running until this is dropped, when its components are
/// stopped and the namespace removed.
pub struct ControlPlane {
    pub netns: String,
    pub pki: PathBuf,
    up: Arc<Components>,
}

impl ControlPlane {
    /// The control plane, its certificates and logs in `run_dir` (the first node's), answering
    /// the requests of each node whose run directory is in `nodes`.
    pub fn start(run_dir: &Path, nodes: &[PathBuf], t: Tools) -> Result<Self> {
        let (pki, logs) = (run_dir.join("pki"), run_dir.join("logs"));
        fs::create_dir_all(&pki)?;
        fs::create_dir_all(&logs)?;
        make_pki(&pki, &t.bin).context("making the cluster's certificates")?;
        let suffix = run_dir
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.rsplit('-').next());
        let netns = format!("ublkd-k8s-{}-{}", std::process::id(), suffix.unwrap_or("0"));
        apt::run_ok(Command::new("ip").args(["netns", "add", &netns]))
            .context("making the control plane's network namespace")?;
        let up = Arc::new(Components {
            netns: netns.clone(),
            pki: pki.clone(),
            logs,
            nodes: nodes.to_vec(),
            tools: t,
            children: Mutex::default(),
            stop: AtomicBool::default(),
        });
        for node in nodes {
            let (serve, requests) = (up.clone(), node.join("kubectl"));
            std::thread::spawn(move || serve.serve_requests(&requests));
        }
        if let Err(e) = up.network() {
            // best effort: the error returned says what failed; a namespace left is removed by hand
            let _ = apt::run_ok(Command::new("ip").args(["netns", "del", &netns]));
            return Err(e.context("the nodes' addresses in the control plane's namespace"));
        }
        let run = up.clone();
        std::thread::spawn(move || {
            if let Err(e) = run.run() {
                eprintln!("xtask: k8s-test: the control plane: {e:#}");
            }
        });
        Ok(Self { netns, pki, up })
    }
}

impl Drop for ControlPlane {
    fn drop(&mut self) {
        self.up.stop.store(true, Ordering::Relaxed);
        let mut children = self.up.children.lock().unwrap_or_else(|e| e.into_inner());
        // TERM first, so that each flushes its log; then KILL whatever is left.
        for c in children.iter() {
            // One already gone is what this wants.
            let _ = Command::new("kill")
                .args(["-TERM", &c.id().to_string()])
                .status();
        }
        std::thread::sleep(Duration::from_secs(3));
        for c in children.iter_mut() {
            // KILL after the TERM: one that has exited on the TERM is what this wants.
            let _ = c.kill();
            if let Err(e) = c.wait() {
                eprintln!("xtask: k8s-test: waiting for a control-plane component: {e}");
            }
        }
        if let Err(e) = apt::run_ok(Command::new("ip").args(["netns", "del", &self.netns])) {
            eprintln!(
                "xtask: k8s-test: could not remove the network namespace {}: {e:#}",
                self.netns
            );
        }
    }
}

/// The running side of the control plane, shared by its threads.
struct Components {
    netns: String,
    pki: PathBuf,
    logs: PathBuf,
    /// Each node's run directory, in the order of `NODES`.
    nodes: Vec<PathBuf>,
    tools: Tools,
    children: Mutex<Vec<Child>>,
    stop: AtomicBool,
}

impl Components {
    /// `prog args...` in the namespace.
    fn command(&self, prog: &Path, args: &[&str]) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.netns]).arg(prog).args(args);
        c
    }

    /// A component started in the namespace, its output in `logs/NAME.log`.
    fn spawn(&self, name: &str, prog: &Path, args: &[&str]) -> Result<()> {
        let log = File::create(self.logs.join(format!("{name}.log")))?;
        let child = self
            .command(prog, args)
            .stdin(Stdio::null())
            .stdout(log.try_clone()?)
            .stderr(log)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.children
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(child);
        Ok(())
    }

    /// The namespace's loopback with every node's address, before any node's QEMU starts: a
    /// QEMU started first could not bind its forward and the guest was booted again.
    fn network(&self) -> Result<()> {
        // `ip ARGS` in the namespace (no argument here has a space).
        let ip = |args: &str| apt::run_ok(self.command(Path::new("ip"), &[]).args(args.split(' ')));
        ip("link set lo up")?;
        for (_, node_ip) in NODES {
            ip(&format!("addr add {node_ip}/32 dev lo"))?;
            // Connections to a node leave from the loopback's 127.0.0.1, which QEMU shows the
            // guest as its host, 10.0.2.2. From the node's own address (the default source for
            // a local destination) the guest would answer itself, and the API server's TLS
            // handshake with the kubelet timed out (every exec and logs request).
            ip(&format!(
                "route replace local {node_ip} dev lo proto kernel scope host src 127.0.0.1 table local"
            ))?;
        }
        Ok(())
    }

    fn run(&self) -> Result<()> {
        let (b, p) = (&self.tools.bin, self.pki.display());
        let etcd_dir = self.pki.with_file_name("etcd");
        self.spawn(
            "etcd",
            &self.tools.debs.join("usr/bin/etcd"),
            &[
                &format!("--data-dir={}", etcd_dir.display()),
                "--unsafe-no-fsync",
                "--listen-client-urls=http://127.0.0.1:2379",
                "--advertise-client-urls=http://127.0.0.1:2379",
                "--listen-peer-urls=http://127.0.0.1:2380",
            ],
        )?;
        // The node is reached at its InternalIP (its host name resolves only in the guest).
        let f = |flag: &str, file: &str| format!("--{flag}={p}/{file}");
        fs::write(self.pki.join("audit.yaml"), AUDIT_POLICY)?;
        let audit_log = format!("--audit-log-path={}", self.logs.join("audit.log").display());
        self.spawn(
            "kube-apiserver",
            &b.join("kube-apiserver"),
            &[
                "--etcd-servers=http://127.0.0.1:2379",
                &format!("--advertise-address={HOST_IP}"),
                "--secure-port=6443",
                &f("tls-cert-file", "apiserver.crt"),
                &f("tls-private-key-file", "apiserver.key"),
                &f("client-ca-file", "ca.crt"),
                &f("service-account-key-file", "sa.pub"),
                &f("service-account-signing-key-file", "sa.key"),
                "--service-account-issuer=https://kubernetes.default.svc",
                "--service-cluster-ip-range=10.96.0.0/16",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",
                "--allow-privileged=true",
                &f("kubelet-client-certificate", "apiserver-kubelet-client.crt"),
                &f("kubelet-client-key", "apiserver-kubelet-client.key"),
                "--kubelet-preferred-address-types=InternalIP",
                "--runtime-config=storage.k8s.io/v1beta1=true",
                &f("audit-policy-file", "audit.yaml"),
                &audit_log,
            ],
        )?;
        let admin = format!("--kubeconfig={p}/admin-host.conf");
        let started = Instant::now();
        while !self
            .command(&b.join("kubectl"), &[&admin, "get", "--raw", "/readyz"])
            .output()
            .is_ok_and(|o| o.status.success())
        {
            if started.elapsed() > Duration::from_secs(300) || self.stop.load(Ordering::Relaxed) {
                bail!("the API server was not ready in 300 s");
            }
            std::thread::sleep(Duration::from_secs(1));
        }
        // One of each: no leader election. node-ipam is off: the pod subnet is the CNI's.
        self.spawn(
            "kube-controller-manager",
            &b.join("kube-controller-manager"),
            &[
                &f("kubeconfig", "controller-manager.conf"),
                "--leader-elect=false",
                "--use-service-account-credentials",
                &f("service-account-private-key-file", "sa.key"),
                &f("root-ca-file", "ca.crt"),
                &f("cluster-signing-cert-file", "ca.crt"),
                &f("cluster-signing-key-file", "ca.key"),
                "--controllers=*,-nodeipam",
            ],
        )?;
        self.spawn(
            "kube-scheduler",
            &b.join("kube-scheduler"),
            &[&f("kubeconfig", "scheduler.conf"), "--leader-elect=false"],
        )?;
        // The cluster's DNS (the kubelet's clusterDNS is this side's address): Service and pod
        // names from the API, nothing forwarded.
        let corefile = self.pki.join("Corefile");
        fs::write(&corefile, format!(
            "cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {{\n    bind 127.0.0.1\n    errors\n    cache 30\n    \
             kubernetes cluster.local in-addr.arpa ip6.arpa {{\n        kubeconfig {p}/admin-host.conf test\n        \
             pods insecure\n    }}\n}}\n"
        ))?;
        self.spawn(
            "coredns",
            &self.tools.coredns,
            &["-conf", &corefile.to_string_lossy()],
        )
    }

    /// The node's kubectl and helm requests: NAME.args (the tool, then its arguments,
    /// NUL-separated) and NAME.stdin, where it has one; the answer NAME.out, NAME.err and,
    /// last, NAME.rc. Each request runs on a thread of its own: a `kubectl wait` holds up no
    /// other. Both tools use the admin's kubeconfig.
    fn serve_requests(self: &Arc<Self>, q: &Path) {
        if let Err(e) = fs::create_dir_all(q) {
            eprintln!("xtask: k8s-test: cannot make {}: {e}", q.display());
            return;
        }
        while !self.stop.load(Ordering::Relaxed) {
            for e in fs::read_dir(q).into_iter().flatten().flatten() {
                let path = e.path();
                if path.extension().is_none_or(|x| x != "args") {
                    continue;
                }
                let run = path.with_extension("run");
                if fs::rename(&path, &run).is_err() {
                    continue;
                }
                let me = self.clone();
                std::thread::spawn(move || me.answer(&run));
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    fn answer(&self, run: &Path) {
        let t0 = Instant::now();
        let with = |ext: &str| run.with_extension(ext);
        let req = fs::read(run).unwrap_or_default();
        let words: Vec<String> = req
            .split(|&b| b == 0)
            .filter(|w| !w.is_empty())
            .map(|w| String::from_utf8_lossy(w).into_owned())
            .collect();
        let rc = match self.tool(&words, &with("stdin"), &with("out"), &with("err")) {
            Ok(rc) => rc,
            Err(e) => {
                // The error goes to the node as the tool's own would.
                let _ = fs::write(with("err"), format!("control plane: {e:#}\n"));
                125
            }
        };
        // The answer is whole once .rc is there: written aside, then renamed.
        if fs::write(with("rc.tmp"), format!("{rc}\n"))
            .and_then(|()| fs::rename(with("rc.tmp"), with("rc")))
            .is_err()
        {
            eprintln!("xtask: k8s-test: cannot answer {}", run.display());
        }
        // How long each request took here, against the node's view in its scenario log.
        let what: String = words.join(" ").chars().take(120).collect();
        let line = format!("{} ms: {what}\n", t0.elapsed().as_millis());
        let log = self.logs.join("requests.log");
        if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(log) {
            // A record for the reader; the answer is already given.
            let _ = std::io::Write::write_all(&mut f, line.as_bytes());
        }
    }

    /// `power NODE off|on`: kills the QEMU of NODE's guest, or asks its thread to boot it again.
    fn power(&self, args: &[String]) -> Result<String> {
        let [node, what] = args else {
            bail!("usage: power NODE off|on");
        };
        let i = NODES
            .iter()
            .position(|(n, _)| n == node)
            .with_context(|| format!("no node {node}"))?;
        let dir = self
            .nodes
            .get(i)
            .with_context(|| format!("node {node} is not booted"))?;
        match what.as_str() {
            "off" => {
                // QEMU's own argument names its node's run directory (its 9p share).
                let share = format!("local,path={},mount_tag=xfer,", dir.display());
                let qemu = fs::read_dir("/proc")?.flatten().find_map(|e| {
                    let pid: u32 = e.file_name().to_str()?.parse().ok()?;
                    let cmdline = fs::read(e.path().join("cmdline")).ok()?;
                    let mut args = cmdline.split(|&b| b == 0);
                    let is_qemu = args.next()?.ends_with(b"qemu-system-x86_64");
                    let ours = args.any(|a| a.starts_with(share.as_bytes()));
                    (is_qemu && ours).then_some(pid)
                });
                let pid = qemu.with_context(|| format!("no QEMU runs node {node}"))?;
                fs::write(dir.join(POWERED_OFF), "powered off by a scenario\n")?;
                apt::run_ok(Command::new("kill").args(["-KILL", &pid.to_string()]))?;
                Ok(format!("node {node} powered off (QEMU {pid} killed)"))
            }
            "on" => {
                ensure!(
                    dir.join(POWERED_OFF).exists(),
                    "node {node} was not powered off"
                );
                fs::write(dir.join(POWER_ON), "boot it again\n")?;
                Ok(format!("node {node} powering on"))
            }
            _ => bail!("power {node} {what}: off or on"),
        }
    }

    fn tool(&self, words: &[String], stdin: &Path, out: &Path, err: &Path) -> Result<i32> {
        let (tool, args) = words.split_first().context("an empty request")?;
        let admin = self.pki.join("admin-host.conf");
        let kubeconfig = format!("--kubeconfig={}", admin.display());
        let mut c = match tool.as_str() {
            // KUBECONFIG rather than --kubeconfig: kubectl looks for a plugin (kubectl ublkd)
            // only when no flag comes before its name.
            "kubectl" => {
                let mut c = self.command(&self.tools.bin.join("kubectl"), &[]);
                let path = std::env::var("PATH").unwrap_or_default();
                let path = format!("{}:{path}", self.tools.plugins.display());
                // in the run's logs: a file a request names relatively (a scenario's own
                // kubeconfig) is made and read there
                c.env("KUBECONFIG", &admin)
                    .env("PATH", path)
                    .current_dir(&self.logs);
                c
            }
            "helm" => self.command(&self.tools.helm, &[&kubeconfig]),
            // a node's guest powered off at once (its QEMU killed: no shutdown, its disks as
            // they were), or booted again (the node-death scenario)
            "power" => {
                let said = self.power(args)?;
                fs::write(out, format!("{said}\n"))?;
                return Ok(0);
            }
            // the API server's audit log so far (the api-load scenario counts its lines)
            "audit" => {
                let mut c = Command::new("cat");
                c.arg(self.logs.join("audit.log"));
                c
            }
            "opa" => {
                let mut c = Command::new(&self.tools.opa);
                c.arg("eval").arg("--data").arg(&self.tools.policies);
                c
            }
            other => bail!("no tool {other}"),
        };
        let input = if stdin.exists() {
            Stdio::from(File::open(stdin)?)
        } else {
            Stdio::null()
        };
        let status = c
            .args(args)
            .stdin(input)
            .stdout(File::create(out)?)
            .stderr(File::create(err)?)
            .status()?;
        Ok(status.code().unwrap_or(125))
    }
}

/// `openssl ARGS` in the pki directory `p`, its files named relative to it (no argument here
/// has a space).
fn openssl(p: &Path, args: &str) -> Result<()> {
    apt::run_ok(Command::new("openssl").current_dir(p).args(args.split(' ')))
}

/// EC P-256 keys: the guest's TLS handshakes are emulated, and EC is far cheaper there than RSA.
fn key(p: &Path, name: &str) -> Result<()> {
    openssl(
        p,
        &format!("ecparam -name prime256v1 -genkey -noout -out {name}.key"),
    )
}

/// A certificate of the CA for `subject`, with its alternative names.
fn cert(p: &Path, name: &str, subject: &str, alt: Option<&str>) -> Result<()> {
    key(p, name)?;
    openssl(
        p,
        &format!("req -new -key {name}.key -subj {subject} -out {name}.csr"),
    )?;
    let ext = "basicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\n\
               extendedKeyUsage=serverAuth,clientAuth\n";
    let alt = alt.map_or(String::new(), |a| format!("subjectAltName={a}\n"));
    fs::write(p.join(format!("{name}.ext")), format!("{ext}{alt}"))?;
    openssl(
        p,
        &format!(
            "x509 -req -in {name}.csr -CA ca.crt -CAkey ca.key -CAcreateserial -days 7 -sha256 \
             -extfile {name}.ext -out {name}.crt"
        ),
    )
}

/// A kubeconfig for `user`'s certificate against the API server at `server`, in `file`.conf.
fn kubeconfig(p: &Path, bin: &Path, user: &str, server: &str, file: &str) -> Result<()> {
    let conf = format!("--kubeconfig={}/{file}.conf", p.display());
    let kubectl = |args: &[&str]| {
        apt::run_ok(
            Command::new(bin.join("kubectl"))
                .args(["config", &conf])
                .args(args),
        )
    };
    let server = format!("--server=https://{server}:6443");
    let ca = format!("--certificate-authority={}/ca.crt", p.display());
    kubectl(&["set-cluster", "test", &server, &ca, "--embed-certs"])?;
    let crt = format!("--client-certificate={}/{user}.crt", p.display());
    let key = format!("--client-key={}/{user}.key", p.display());
    kubectl(&["set-credentials", user, &crt, &key, "--embed-certs"])?;
    let user = format!("--user={user}");
    kubectl(&["set-context", "test", "--cluster=test", &user])?;
    kubectl(&["use-context", "test"])
}

/// One CA, every component's certificate and kubeconfig, and the service accounts' key.
fn make_pki(p: &Path, bin: &Path) -> Result<()> {
    key(p, "ca")?;
    openssl(
        p,
        "req -x509 -new -key ca.key -sha256 -days 7 -subj /CN=ublkd-test-ca -out ca.crt",
    )?;
    let node_ips: Vec<String> = NODES.iter().map(|(_, ip)| format!(",IP:{ip}")).collect();
    let apiserver = format!(
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,\
         DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:10.96.0.1,\
         IP:{HOST_IP}{}",
        node_ips.concat()
    );
    // Each node's kubelet: its client certificate (NodeRestriction holds it to its own Node)
    // and its serving one (EC: it would make itself an RSA one).
    for (node, node_ip) in NODES {
        let kubelet = format!("/O=system:nodes/CN=system:node:{node}");
        cert(p, &format!("kubelet-{node}"), &kubelet, None)?;
        let serving = format!("DNS:{node},IP:{node_ip}");
        let serving_name = format!("kubelet-serving-{node}");
        cert(p, &serving_name, &format!("/CN={node}"), Some(&serving))?;
        kubeconfig(
            p,
            bin,
            &format!("kubelet-{node}"),
            HOST_IP,
            &format!("kubelet-{node}"),
        )?;
    }
    let grpc = "DNS:ublkd-grpc.ublkd-system.svc,DNS:ublkd-grpc.ublkd-system.svc.cluster.local";
    for (name, subject, alt) in [
        ("apiserver", "/CN=kube-apiserver", Some(apiserver.as_str())),
        ("admin", "/O=system:masters/CN=kubernetes-admin", None),
        (
            "controller-manager",
            "/CN=system:kube-controller-manager",
            None,
        ),
        ("scheduler", "/CN=system:kube-scheduler", None),
        ("kube-proxy", "/CN=system:kube-proxy", None),
        (
            "apiserver-kubelet-client",
            "/O=system:masters/CN=kube-apiserver-kubelet-client",
            None,
        ),
        // the modify scenario's remote access (deploy/csi/README.md): ublkd's server
        // certificate for its Service's name, and the resizer's client certificate
        ("ublkd-grpc", "/CN=ublkd-grpc.ublkd-system.svc", Some(grpc)),
        (
            "ublkd-csi-resizer",
            "/CN=ublkd-csi-resizer",
            Some("URI:urn:ublkd:role:modify"),
        ),
    ] {
        cert(p, name, subject, alt)?;
    }
    key(p, "sa")?;
    openssl(p, "ec -in sa.key -pubout -out sa.pub")?;
    // this side's components on the loopback; the node's through QEMU's address for the host
    for c in ["controller-manager", "scheduler"] {
        kubeconfig(p, bin, c, "127.0.0.1", c)?;
    }
    kubeconfig(p, bin, "admin", "127.0.0.1", "admin-host")?;
    for c in ["admin", "kube-proxy"] {
        kubeconfig(p, bin, c, HOST_IP, c)?;
    }
    Ok(())
}
