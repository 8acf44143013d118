//! The node's tools: kubectl and helm, which run on the host
//! (`control`'s request server: a request file in the shared run directory, the answer read
//! back), commands on the node itself, and a scenario's log with the calls that read it.

use anyhow::{bail, ensure, Context, Result};
use serde::Deserialize;
use std::fs::{self, File};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first node's name, as a literal for `concat!`.
macro_rules! first_node {
    () => {
        "ublkd-vm"
    };
}

/// The first node's name, as its kubelet registers it: the node the scenarios run on (and
/// the one `local` commands reach).
pub const NODE: &str = first_node!();

/// The node's registry as the host's helm reaches it: the node's address, which QEMU forwards
/// (the node's containerd pulls from its loopback, 127.0.0.1:5000).
pub const REGISTRY_FROM_HOST: &str = "10.10.0.1:5000";

/// kubectl's arguments that name the first node's ublkd pod (after `get`, or as `jp`'s `what`
/// in words).
pub const UBLKD_PODS: &str = concat!(
    "-n ublkd-system pod -l app.kubernetes.io/name=ublkd --field-selector spec.nodeName=",
    first_node!()
);

/// A command line's arguments: `line` split at spaces.
pub fn words(line: &str) -> Vec<&str> {
    line.split_whitespace().collect()
}

/// What the host tells the node (`cargo xtask k8s-test` writes it into the run directory; the
/// guest's paths are the host's).
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Input {
    /// The Kubernetes binaries (kubelet, kube-proxy).
    pub bin: PathBuf,
    /// The Debian packages extracted: containerd, ctr, the CNI plugins.
    pub debs: PathBuf,
    /// The images to import: reference and archive.
    pub images: Vec<(String, PathBuf)>,
    pub chart: PathBuf,
    /// The test's values for the chart.
    pub values: PathBuf,
    /// The guest kernel's module tree.
    pub modules: PathBuf,
    /// The scenarios to run, or none for all.
    pub scenarios: Vec<String>,
    pub snapshot_crds: PathBuf,
    pub snapshot_controller: PathBuf,
    pub snapshotter_version: String,
    /// The distribution registry's binary.
    pub registry: PathBuf,
    /// `cargo xtask`, whose `push-archive` pushes ublkd's image (`image --push`'s code).
    pub xtask: PathBuf,
    pub ublkd_archive: PathBuf,
    pub ublkd_manifest: String,
    pub prometheus: PathBuf,
    /// The certificates and kubeconfigs `control` made.
    pub pki: PathBuf,
    /// This node's name and address (where the API server reaches its kubelet).
    pub name: String,
    pub ip: String,
    /// Every node of the cluster, this one first when it runs the scenarios.
    pub nodes: Vec<String>,
    /// This node's pods' addresses.
    pub pod_subnet: String,
    /// A node that joins the cluster: it brings itself up and waits until `stop` is in its run
    /// directory; the first node installs the driver and runs the scenarios.
    pub join: bool,
}

/// The node as every step sees it: what the host said, the way to its tools, where logs go,
/// and the clock of the run.
pub struct Node {
    pub input: Input,
    pub host: Host,
    pub logs: PathBuf,
    t0: Instant,
}

impl Node {
    pub fn new(input: Input, run: &Path) -> Result<Self> {
        let logs = run.join("logs");
        fs::create_dir_all(&logs)?;
        Ok(Self {
            input,
            host: Host::new(&run.join("kubectl"))?,
            logs,
            t0: Instant::now(),
        })
    }

    /// Seconds since the node's program started.
    pub fn now(&self) -> f64 {
        self.t0.elapsed().as_secs_f64()
    }

    /// A line of progress on the console.
    pub fn say(&self, what: impl AsRef<str>) {
        println!("k8s [{:.1}] {}", self.now(), what.as_ref());
    }
}

/// kubectl and helm on the host: each call a request in `dir`, answered by `control`.
pub struct Host {
    dir: PathBuf,
    next: AtomicU32,
}

/// What a tool on the host answered.
pub struct Answer {
    pub rc: i32,
    pub out: String,
    pub err: String,
}

impl Host {
    pub fn new(dir: &Path) -> Result<Self> {
        fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self {
            dir: dir.to_owned(),
            next: AtomicU32::new(0),
        })
    }

    /// `tool args...` on the host, with `stdin` as its standard input (kubectl's `-f -`).
    pub fn call(&self, tool: &str, args: &[&str], stdin: Option<&str>) -> Result<Answer> {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        let r = self.dir.join(format!("req.{}.{n}", std::process::id()));
        let with = |ext: &str| PathBuf::from(format!("{}.{ext}", r.display()));
        if let Some(text) = stdin {
            fs::write(with("stdin"), text)?;
        }
        let mut req = Vec::new();
        for a in std::iter::once(&tool).chain(args) {
            req.extend_from_slice(a.as_bytes());
            req.push(0);
        }
        fs::write(with("tmp"), req)?;
        // `control` picks up `*.args` only: the rename makes the request whole at once.
        fs::rename(with("tmp"), with("args"))?;
        // Most answers come within a second, and each poll is one stat over 9p.
        while !with("rc").exists() {
            std::thread::sleep(Duration::from_millis(20));
        }
        let read = |ext: &str| fs::read_to_string(with(ext)).unwrap_or_default();
        let answer = Answer {
            rc: read("rc").trim().parse().unwrap_or(125),
            out: read("out"),
            err: read("err"),
        };
        for ext in ["run", "out", "err", "rc", "stdin"] {
            // The request's files, answered: those that were never made are not there.
            let _ = fs::remove_file(with(ext));
        }
        Ok(answer)
    }
}

/// What the node's commands print, or why they failed.
pub fn local(prog: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(prog)
        .args(args)
        .output()
        .with_context(|| format!("running {prog}"))?;
    if !out.status.success() {
        bail!(
            "{prog} {} ({}): {}",
            args.join(" "),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `local` of the command line `line`, split at spaces (no argument holds one).
pub fn localw(line: &str) -> Result<String> {
    let w = words(line);
    let (prog, args) = w.split_first().context("an empty command line")?;
    local(prog, args)
}

/// A daemon of the node, its output in `log`, killed when this is dropped.
pub struct Daemon(Child);

impl Daemon {
    pub fn start(prog: &Path, args: &[&str], env: &[(&str, &str)], log: &Path) -> Result<Self> {
        let out = File::create(log).with_context(|| format!("creating {}", log.display()))?;
        let child = Command::new(prog)
            .args(args)
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stdout(out.try_clone()?)
            .stderr(out)
            .spawn()
            .with_context(|| format!("starting {}", prog.display()))?;
        Ok(Self(child))
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        // One that has exited already is what this wants.
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// `template` with each `@KEY@` replaced by its value.
pub fn fill(template: &str, vars: &[(&str, &str)]) -> String {
    vars.iter().fold(template.to_owned(), |t, (k, v)| {
        t.replace(&format!("@{k}@"), v)
    })
}

/// Polls `f` every second until it holds, for up to `secs` by the clock.
pub fn wait_for(secs: u64, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(secs);
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_secs(1));
    }
}

/// A Kubernetes quantity in bytes: a number of bytes, or with a binary suffix (Ki to Ti, what
/// capacities are written in).
pub fn bytes(q: &str) -> Result<u64> {
    let q = q.trim();
    let (num, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let shift = ["", "Ki", "Mi", "Gi", "Ti"].iter().position(|u| *u == unit);
    let n = num.parse::<u64>().ok().zip(shift);
    n.and_then(|(n, shift)| n.checked_mul(1 << (10 * shift)))
        .with_context(|| format!("quantity {q:?}"))
}

/// A Kubernetes quantity (see [`bytes`]) in MiB.
pub fn mib(q: &str) -> Result<u64> {
    Ok(bytes(q)? >> 20)
}

/// The value of a `key: value` line of ublkctl's or the plugin's output.
pub fn field<'a>(out: &'a str, key: &str) -> Option<&'a str> {
    out.lines()
        .find_map(|l| l.strip_prefix(key)?.strip_prefix(':'))
        .map(str::trim)
}

/// Does a line of `out`, its blanks squeezed, contain `words`?
pub fn has_line(out: &str, words: &str) -> bool {
    out.lines().any(|l| {
        l.split_whitespace()
            .collect::<Vec<_>>()
            .join(" ")
            .contains(words)
    })
}

/// Appends `text` to the log at `path`: a record for its reader, which nothing depends on, so
/// a write that fails is left alone.
pub fn append(path: &Path, text: &str) {
    if let Ok(mut f) = fs::OpenOptions::new().create(true).append(true).open(path) {
        let _ = f.write_all(text.as_bytes());
    }
}

/// `f` of each of `items` at once, each on a thread of its own; a panic is an `Err`.
pub fn at_once<I: Sync, T: Send>(
    items: &[I],
    f: impl Fn(&I) -> T + Sync,
) -> Vec<std::thread::Result<T>> {
    std::thread::scope(|s| {
        let running: Vec<_> = items.iter().map(|i| s.spawn(|| f(i))).collect();
        running.into_iter().map(|r| r.join()).collect()
    })
}

/// The last `n` lines of `text`.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// A claim's volume mode (its name is the claim's `volumeMode`), and the pod's view of it.
#[derive(Clone, Copy, PartialEq, Debug)]
pub enum Mode {
    Filesystem,
    Block,
}

/// The test pods' one container, as one line at any indentation of a pod spec: busybox
/// sleeping until TERM, with `mount` (its `volumeMounts: [...]` or `volumeDevices: [...]`).
pub fn sleeper(mount: &str) -> String {
    format!(
        r#"containers: [{{name: app, image: ublkd.test/busybox:test, command: ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"], {mount}}}]"#
    )
}

/// A claim's mount in `sleeper`, volume `volume`: at /data, or as /dev/xvda.
fn mount(mode: Mode, volume: &str) -> String {
    match mode {
        Mode::Filesystem => format!("volumeMounts: [{{name: {volume}, mountPath: /data}}]"),
        Mode::Block => format!("volumeDevices: [{{name: {volume}, devicePath: /dev/xvda}}]"),
    }
}

/// `Sc::start_pod_with`'s pod.
fn pod_yaml(name: &str, claim: &str, mode: Mode, line: &str) -> String {
    fill(
        "apiVersion: v1
kind: Pod
metadata: {name: @NAME@}
spec:
  terminationGracePeriodSeconds: 1
  @LINE@
  @SLEEPER@
  volumes: [{name: v, persistentVolumeClaim: {claimName: @CLAIM@}}]
",
        &[
            ("NAME", name),
            ("LINE", line),
            ("SLEEPER", &sleeper(&mount(mode, "v"))),
            ("CLAIM", claim),
        ],
    )
}

/// `Sc::statefulset`'s StatefulSet.
fn statefulset_yaml(name: &str, replicas: u32, class: &str, spec: &str, pod: &str) -> String {
    fill(
        "apiVersion: apps/v1
kind: StatefulSet
metadata: {name: @NAME@}
spec:
  serviceName: @NAME@
  replicas: @REPLICAS@
  @SPEC@
  selector: {matchLabels: {app: @NAME@}}
  template:
    metadata: {labels: {app: @NAME@}}
    spec:
      terminationGracePeriodSeconds: 1
      @SLEEPER@
@POD@
  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
        accessModes: [ReadWriteOnce]
        storageClassName: @CLASS@
        resources: {requests: {storage: 64Mi}}
",
        &[
            ("NAME", name),
            ("REPLICAS", &replicas.to_string()),
            ("SPEC", spec),
            ("SLEEPER", &sleeper(&mount(Mode::Filesystem, "data"))),
            ("POD", pod),
            ("CLASS", class),
        ],
    )
}

/// One scenario's view of the cluster: every call it makes, and what it says, go to its log.
pub struct Sc<'a> {
    pub node: &'a Node,
    log: Mutex<File>,
}

impl<'a> Sc<'a> {
    pub fn new(node: &'a Node, log: File) -> Self {
        Self {
            node,
            log: Mutex::new(log),
        }
    }

    /// A line in the scenario's log.
    pub fn say(&self, line: impl AsRef<str>) {
        if let Ok(mut f) = self.log.lock() {
            // The log is the scenario's record; a write that fails leaves the verdict alone.
            let _ = writeln!(f, "{}", line.as_ref());
        }
    }

    fn call(&self, tool: &str, args: &[&str], stdin: Option<&str>, logged: bool) -> Result<String> {
        if logged {
            let line = format!("k8s [{:.1}] {tool} {}", self.node.now(), args.join(" "));
            self.say(line.chars().take(160).collect::<String>());
        }
        let a = self.node.host.call(tool, args, stdin)?;
        if a.rc != 0 {
            bail!("{tool} {} ({}): {}", args.join(" "), a.rc, a.err.trim());
        }
        Ok(a.out.trim_end_matches('\n').to_owned())
    }

    /// kubectl, its call in the log.
    pub fn k(&self, args: &[&str]) -> Result<String> {
        self.call("kubectl", args, None, true)
    }

    /// kubectl, silent (a poll's, or a read whose value the scenario logs itself).
    pub fn q(&self, args: &[&str]) -> Result<String> {
        self.call("kubectl", args, None, false)
    }

    /// `k`, `q` and `helm` with the arguments of `line` split at spaces (none holds one).
    pub fn kw(&self, line: &str) -> Result<String> {
        self.k(&words(line))
    }

    pub fn qw(&self, line: &str) -> Result<String> {
        self.q(&words(line))
    }

    pub fn helmw(&self, line: &str) -> Result<String> {
        self.helm(&words(line))
    }

    /// `kubectl get WHAT... -o jsonpath=PATH`, silent.
    pub fn jp(&self, what: &[&str], path: &str) -> Result<String> {
        self.q(&[&["get"][..], what, &["-o", &format!("jsonpath={path}")]].concat())
    }

    /// Whether `jp` of `what` and `path` reads `want`.
    pub fn jp_is(&self, what: &[&str], path: &str, want: &str) -> bool {
        self.jp(what, path).is_ok_and(|v| v == want)
    }

    /// Does `kubectl get WHAT` (words) find it?
    pub fn exists(&self, what: &str) -> bool {
        self.qw(&format!("get {what}")).is_ok()
    }

    pub fn helm(&self, args: &[&str]) -> Result<String> {
        self.call("helm", args, None, true)
    }

    /// `helm VERB ublkd` of the packaged chart in the node's registry (bring-up pushed it),
    /// in ublkd-system, with `args`.
    pub fn helm_chart(&self, verb: &str, args: &[&str]) -> Result<String> {
        let meta = fs::read_to_string(self.node.input.chart.join("Chart.yaml"))?;
        let version = meta
            .lines()
            .find_map(|l| l.strip_prefix("version: "))
            .context("Chart.yaml has no version")?;
        let at = format!(
            "{verb} ublkd oci://{REGISTRY_FROM_HOST}/charts/ublkd --version {} --plain-http \
             --namespace ublkd-system",
            version.trim()
        );
        self.helm(&[&words(&at)[..], args].concat())
    }

    /// `opa eval QUERY` over the admission policies (tests/k8s/policy) with `input`: the value.
    pub fn opa(&self, input: &serde_json::Value, query: &str) -> Result<serde_json::Value> {
        let args = ["--format", "json", "--stdin-input", query];
        let out = self.call("opa", &args, Some(&input.to_string()), true)?;
        let v: serde_json::Value =
            serde_json::from_str(&out).with_context(|| format!("opa said {out}"))?;
        Ok(v["result"][0]["expressions"][0]["value"].clone())
    }

    /// `kubectl apply -f -` of a manifest.
    pub fn apply(&self, yaml: &str) -> Result<()> {
        self.call("kubectl", &["apply", "-f", "-"], Some(yaml), true)
            .map(|out| self.say(out))
    }

    /// `kubectl create --dry-run=server` of a manifest in `ns`: every admission step runs
    /// (Pod Security included), nothing is kept.
    pub fn dry_run(&self, ns: &str, manifest: &str) -> Result<String> {
        let args = ["create", "--dry-run=server", "-n", ns, "-f", "-"];
        self.call("kubectl", &args, Some(manifest), true)
    }

    /// What kubectl prints for `line` (its arguments in words), into the log (for the record;
    /// its failure is logged too).
    pub fn show(&self, line: &str) {
        self.tail(usize::MAX, line);
    }

    /// The last `n` lines of what kubectl prints for `line` (words), into the log.
    pub fn tail(&self, n: usize, line: &str) {
        match self.qw(line) {
            Ok(out) => self.say(last_lines(&out, n)),
            Err(e) => self.say(format!("({e:#})")),
        }
    }

    /// The messages of the Events (in default) that the field selector `sel` picks.
    pub fn events(&self, sel: &str) -> Result<String> {
        self.jp(&["events", "--field-selector", sel], "{.items[*].message}")
    }

    /// Whether what kubectl prints for `line` (words) contains `text`.
    pub fn shows(&self, line: &str, text: &str) -> bool {
        self.qw(line).is_ok_and(|out| out.contains(text))
    }

    /// The phase of `what` (words: `pvc NAME`).
    pub fn phase(&self, what: &str) -> Result<String> {
        self.jp(&words(what), "{.status.phase}")
    }

    /// `sh -c SCRIPT` in a pod's container; what it printed.
    pub fn in_pod(&self, pod: &str, script: &str) -> Result<String> {
        self.k(&["exec", pod, "--", "/bin/sh", "-c", script])
    }

    /// ublkctl with the arguments of `line` (words) in the first node's ublkd container.
    pub fn ublkctl(&self, line: &str) -> Result<String> {
        self.ublkctl_on(NODE, line)
    }

    /// ublkctl with the arguments of `line` (words) in `node`'s ublkd container.
    pub fn ublkctl_on(&self, node: &str, line: &str) -> Result<String> {
        let sel = format!(
            "-n ublkd-system pod -l app.kubernetes.io/name=ublkd --field-selector spec.nodeName={node}"
        );
        let pod = self.jp(&words(&sel), "{.items[0].metadata.name}")?;
        let exec = format!("-n ublkd-system exec {pod} -c ublkd -- /usr/local/bin/ublkctl");
        self.kw(&format!("{exec} {line}"))
    }

    /// The cluster's second node, when it has one (`UBLKD_K8S_NODES=2`).
    pub fn second_node(&self) -> Option<&str> {
        let other = self.node.input.nodes.iter().find(|n| *n != NODE);
        other.map(String::as_str)
    }

    /// The second node, for a scenario that needs it (`scenarios::TWO_NODES`, which are not
    /// run on one node).
    pub fn other_node(&self) -> Result<&str> {
        self.second_node()
            .context("this scenario needs a second node, and the tier booted one")
    }

    /// A node's guest powered `off` at once (no shutdown) or `on` again, by the host.
    pub fn power(&self, node: &str, what: &str) -> Result<()> {
        let a = self.node.host.call("power", &[node, what], None)?;
        ensure!(a.rc == 0, "power {node} {what}: {}", a.err.trim());
        self.say(a.out.trim());
        Ok(())
    }

    /// The first node's pod of the driver's `app` (`ds/NAME` would pick any node's).
    pub fn pod_on_node(&self, app: &str) -> Result<String> {
        let sel = format!(
            "-n ublkd-system pod -l app.kubernetes.io/name={app} --field-selector spec.nodeName={NODE}"
        );
        self.jp(&words(&sel), "{.items[0].metadata.name}")
    }

    /// kubectl's arguments for the log of `container` of the first node's pod of `app`.
    pub fn logs_on_node(&self, app: &str, container: &str) -> String {
        let pod = self
            .pod_on_node(app)
            .unwrap_or_else(|_| format!("-l app.kubernetes.io/name={app}"));
        format!("-n ublkd-system logs {pod} -c {container}")
    }

    /// The first node's CSIStorageCapacity objects (the provisioner of each node publishes its
    /// own, with the node in its topology): class and capacity, as the API writes them.
    pub fn capacities_on_node(&self) -> Result<Vec<(String, String)>> {
        self.capacities_on(NODE)
    }

    /// The CSIStorageCapacity `node`'s provisioner keeps for `class`, in bytes.
    pub fn published(&self, node: &str, class: &str) -> Option<u64> {
        let on_node = self.capacities_on(node).ok()?;
        let (_, capacity) = on_node.iter().find(|(c, _)| c == class)?;
        bytes(capacity).ok()
    }

    /// `node`'s CSIStorageCapacity objects: class and capacity.
    pub fn capacities_on(&self, node: &str) -> Result<Vec<(String, String)>> {
        let all: serde_json::Value =
            serde_json::from_str(&self.qw("get csistoragecapacities -A -o json")?)?;
        let items = all["items"].as_array().cloned().unwrap_or_default();
        Ok(items
            .iter()
            .filter(|c| c["nodeTopology"]["matchLabels"]["ublkd.io/node"] == node)
            .map(|c| {
                let class = c["storageClassName"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned();
                (class, c["capacity"].as_str().unwrap_or_default().to_owned())
            })
            .collect())
    }

    /// kubectl's arguments for the first node's node plugin's own log.
    pub fn csi_node_logs(&self) -> String {
        self.logs_on_node("ublkd-csi-node", "ublkd-csi")
    }

    /// Waits up to `secs` for `f`; fails saying what never came.
    pub fn wait(&self, secs: u64, what: &str, f: impl FnMut() -> bool) -> Result<()> {
        ensure!(wait_for(secs, f), "waited {secs} s: {what}");
        self.say(format!("k8s [{:.1}] {what}", self.node.now()));
        Ok(())
    }

    /// A ReadWriteOnce claim of `class`, `line` one more field of its spec.
    pub fn claim(&self, name: &str, class: &str, size: &str, line: &str) -> Result<()> {
        self.apply(&fill(
            "apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: @NAME@}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: @CLASS@
  @LINE@
  resources: {requests: {storage: @SIZE@}}
",
            &[
                ("NAME", name),
                ("CLASS", class),
                ("LINE", line),
                ("SIZE", size),
            ],
        ))
    }

    pub fn pvc(&self, name: &str, class: &str, size: &str, mode: Mode) -> Result<()> {
        self.claim(name, class, size, &format!("volumeMode: {mode:?}"))
    }

    /// A pod that keeps the claim mounted at /data (or as /dev/xvda), not waited for.
    pub fn start_pod(&self, name: &str, claim: &str, mode: Mode) -> Result<()> {
        self.start_pod_with(name, claim, mode, "")
    }

    /// `start_pod` with one more line of the pod's spec (`tolerations: ...`).
    pub fn start_pod_with(&self, name: &str, claim: &str, mode: Mode, line: &str) -> Result<()> {
        self.apply(&pod_yaml(name, claim, mode, line))
    }

    /// A StatefulSet of `replicas` sleeping pods, each with its claim `data` (64 MiB of
    /// `class` at /data): `spec` one more line of its spec (or none), `pod` its pod spec's
    /// lines on where to run (tolerations, affinity), each indented six spaces.
    pub fn statefulset(
        &self,
        name: &str,
        replicas: u32,
        class: &str,
        spec: &str,
        pod: &str,
    ) -> Result<()> {
        self.apply(&statefulset_yaml(name, replicas, class, spec, pod))
    }

    /// start_pod, waited for until Ready.
    pub fn pod(&self, name: &str, claim: &str, mode: Mode) -> Result<()> {
        self.start_pod(name, claim, mode)?;
        self.ready(name, claim)
    }

    /// Waits until a started pod of `claim` is Ready.
    pub fn ready(&self, name: &str, claim: &str) -> Result<()> {
        let pod = format!("pod/{name}");
        self.k(&["wait", "--for=condition=Ready", &pod, "--timeout=600s"])
            .inspect_err(|_| {
                self.tail(25, &format!("describe pod {name}"));
                self.tail(15, &format!("describe pvc {claim}"));
                self.tail(30, &self.csi_node_logs());
            })
            .map(drop)
    }

    /// `kubectl delete WHAT --wait=true`, WHAT in words.
    pub fn delete(&self, what: &str) -> Result<()> {
        self.kw(&format!("delete {what} --wait=true"))
            .map(|out| self.say(out))
    }

    /// `claim` grown to `size` MiB, `pod` using it: once its PV holds the size, an update to
    /// the pod, because the kubelet grows a mounted volume (NodeExpandVolume) when it next syncs
    /// the pod, a minute and more after the PV grew, and an update syncs it at once (a kubelet
    /// resyncing every 10 s instead cost the guest a tenth of its CPUs). The growth is still the
    /// resizer's, the kubelet's and the driver's.
    pub fn grow(&self, claim: &str, pod: &str, size: u64) -> Result<()> {
        let grow = format!(r#"{{"spec":{{"resources":{{"requests":{{"storage":"{size}Mi"}}}}}}}}"#);
        self.k(&["patch", "pvc", claim, "-p", &grow])?;
        let pv = self.jp(&["pvc", claim], "{.spec.volumeName}")?;
        let grown = || {
            self.jp(&["pv", &pv], "{.spec.capacity.storage}")
                .is_ok_and(|c| mib(&c).is_ok_and(|m| m >= size))
        };
        self.wait(300, &format!("{pv} holds {size} MiB"), grown)
            .inspect_err(|_| self.tail(15, &format!("describe pvc {claim}")))?;
        let resync = format!("ublkd.test/resync={:.0}", self.node.now());
        self.k(&["annotate", "pod", pod, "--overwrite", &resync])
            .map(drop)
    }

    /// The ublkd volume behind a claim.
    pub fn volume_of(&self, claim: &str) -> Result<String> {
        let pv = self.jp(&["pvc", claim], "{.spec.volumeName}")?;
        self.jp(&["pv", &pv], "{.spec.csi.volumeHandle}")
    }

    /// The node-loss controller's finalizer is on `node`.
    pub fn finalized(&self, node: &str) -> bool {
        self.jp(&["node", node], "{.metadata.finalizers}")
            .is_ok_and(|f| f.contains("ublkd.io/node"))
    }

    /// An Event of that reason on `node` (the node-loss controller's).
    pub fn node_event(&self, node: &str, reason: &str) -> bool {
        let sel = format!("involvedObject.kind=Node,involvedObject.name={node},reason={reason}");
        let events = self.jp(
            &["events", "-A", "--field-selector", &sel],
            "{.items[*].message}",
        );
        events.is_ok_and(|m| !m.trim().is_empty())
    }

    /// How many times the Events of `reason` on `node` were posted: one per Event, or its
    /// series' count (events.k8s.io's, which the controller posts: no `count`).
    pub fn event_count(&self, node: &str, reason: &str) -> Result<u64> {
        let sel = format!("involvedObject.kind=Node,involvedObject.name={node},reason={reason}");
        // one line per Event, "x" then the series' count if it has one
        let lines = self.jp(
            &["events", "-A", "--field-selector", &sel],
            r"{range .items[*]}x{.series.count}{'\n'}{end}",
        )?;
        Ok(lines
            .lines()
            .filter_map(|l| l.trim().strip_prefix('x'))
            .map(|n| n.parse::<u64>().unwrap_or(1).max(1))
            .sum())
    }

    /// That the Events of `reason` on `node` were posted once, not once per look of the
    /// controller (said in the log, with `over`: how long it looked).
    pub fn posted_once(&self, node: &str, reason: &str, over: Duration) -> Result<()> {
        let n = self.event_count(node, reason)?;
        self.say(format!(
            "{reason} posted {n} time(s) over {} s of looks",
            over.as_secs()
        ));
        ensure!(n == 1, "{reason} was posted {n} times, not once");
        Ok(())
    }

    /// The controller's Events on `node`, into the log.
    pub fn node_events(&self, node: &str) {
        let sel = format!("involvedObject.kind=Node,involvedObject.name={node}");
        let cols = "custom-columns=REASON:.reason,MESSAGE:.message";
        self.show(&format!("get events -A --field-selector {sel} -o {cols}"));
    }

    pub fn ublkd_pod(&self) -> Result<String> {
        self.jp(&words(UBLKD_PODS), "{.items[0].metadata.name}")
    }

    pub fn ublkd_restarts(&self) -> Result<u32> {
        let pod = self.ublkd_pod()?;
        let path = r#"{.status.containerStatuses[?(@.name=="ublkd")].restartCount}"#;
        let n = self.jp(&["-n", "ublkd-system", "pod", &pod], path)?;
        n.parse().with_context(|| format!("restart count {n:?}"))
    }

    pub fn ublkd_ready(&self) -> bool {
        let wait = format!("wait {UBLKD_PODS} --for=condition=Ready --timeout=5s");
        self.qw(&wait).is_ok()
    }

    /// The scenarios' node's Ready condition is True.
    pub fn node_ready(&self) -> bool {
        self.node_is_ready(NODE)
    }

    /// Node `name`'s Ready condition is True.
    pub fn node_is_ready(&self, name: &str) -> bool {
        let path = r#"{.status.conditions[?(@.type=="Ready")].status}"#;
        self.jp_is(&["node", name], path, "True")
    }

    /// The driver is registered in the node's CSINode.
    pub fn registered(&self) -> bool {
        self.jp(&["csinode", NODE], "{.spec.drivers[*].name}")
            .is_ok_and(|d| d.split_whitespace().any(|n| n == "ublkd.io"))
    }

    /// Every pod of the driver Ready, and at least three of them.
    pub fn all_ready(&self) -> bool {
        let wait = "-n ublkd-system wait --for=condition=Ready pod --all --timeout=5s";
        self.qw(wait).is_ok()
            && (self.qw("-n ublkd-system get pods --no-headers"))
                .is_ok_and(|o| o.lines().count() >= 3)
    }
}
