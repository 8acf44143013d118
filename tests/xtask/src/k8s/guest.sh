# shellcheck shell=sh
# The Kubernetes tier's node, inside the guest (writable root, `cargo xtask k8s-test`): the one
# node of a cluster whose control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, CoreDNS) runs on the host (`control.sh`). Here: containerd, the kubelet and
# kube-proxy from the binaries the harness built; it imports the offline images, installs
# deploy/helm/ublkd with `helm install` and the test values (image names only), and runs the
# scenarios. The guest reaches the control plane at 10.0.2.2 (QEMU's user network),
# and the API server reaches the kubelet at the node's address, 10.10.0.1, which QEMU forwards.
#
# From the harness, in the environment: K8S_BIN (kube binaries), K8S_DEBS (extracted Debian
# packages: containerd, CNI plugins), K8S_IMAGES (a file: "reference archive" per line),
# K8S_CHART and K8S_VALUES (the chart and the test's values), K8S_MODULES (the guest kernel's module tree),
# K8S_SCENARIOS (space-separated names, or "all"), K8S_PKI (the certificates and kubeconfigs
# control.sh made), UBLKD_VM_RUN (the shared run directory).
# Each scenario prints "SCENARIO <name> ok|FAILED <seconds>"; the exit status is the number
# that failed (or 100 when the cluster never came up).
# Functions here are called through run, wait_for and check, which shellcheck cannot follow.
# shellcheck disable=SC2317
set -u
B=$K8S_BIN
D=$K8S_DEBS
L=$UBLKD_VM_RUN/logs
mkdir -p "$L"
NODE=ublkd-vm
NODE_IP=10.10.0.1
HOST_IP=10.0.2.2
t0=$(cut -d' ' -f1 /proc/uptime)
now() { awk -v t0="$t0" '{printf "%.1f", $1 - t0}' /proc/uptime; }
say() { echo "k8s [$(now)] $*"; }
# kubectl and helm run on the host (control.sh's serve_kubectl), natively: a request file in
# the shared run directory, the answer read back. Only `-f -` reads standard input.
KQ=$UBLKD_VM_RUN/kubectl
mkdir -p "$KQ"
on_host() { # TOOL ARGS...
    r=$(mktemp "$KQ/req.XXXXXXXX") || return 1
    case " $* " in *" -f - "*) cat >"$r.stdin" ;; esac
    printf '%s\0' "$@" >"$r.tmp" && mv "$r.tmp" "$r.args" || return 1
    until [ -e "$r.rc" ]; do sleep 0.1; done
    cat "$r.out"
    cat "$r.err" >&2
    rc=$(cat "$r.rc")
    rm -f "$r" "$r".*
    return "$rc"
}
# In a scenario, each call's time in its log (where the time goes; a wait_for's polls are
# silent).
kubectl() {
    [ -z "${SCENARIO:-}" ] || echo "k8s [$(now)] kubectl $*" | cut -c1-160 >&2
    on_host kubectl "$@"
}
helm() { on_host helm "$@"; }
uptime_s() { cut -d. -f1 /proc/uptime; }
# waits up to $1 seconds (by the clock, whatever each try takes) for the command after it
wait_for() {
    deadline=$(($(uptime_s) + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        [ "$(uptime_s)" -ge "$deadline" ] && return 1
        sleep 1
    done
}
# runs the command after it up to $1 times, 5 s apart: the API server of a slow emulated guest
# can time a request out (its 60 s limit), and every apply here is idempotent
tries() {
    n=$1
    shift
    until "$@"; do
        n=$((n - 1))
        [ "$n" -le 0 ] && return 1
        sleep 5
    done
}
die() {
    say "cluster: $*"
    cp -r /var/log/pods "$L/pods" 2>/dev/null
    for f in "$L"/*.log; do
        echo "--- tail of $f"
        tail -15 "$f"
    done
    exit 100
}

# --- the node -------------------------------------------------------------------------------
K=$(uname -r)
mkdir -p "/usr/lib/modules/$K"
mount --bind "$K8S_MODULES" "/usr/lib/modules/$K" || die "cannot bind the kernel's modules"
# An overlay cannot be the upper layer of containerd's overlays, and the kubelet's and ublkd's
# state wants a plain file system: each gets a tmpfs of its own.
for d in /var/lib/containerd /var/lib/kubelet /var/lib/ublkd /var/lib/etcd; do
    mkdir -p "$d"
    mount -t tmpfs -o mode=0755 state "$d" || die "cannot mount a tmpfs on $d"
done
# The file classes' root on a file system that can reflink (snapshots, restores and clones are
# reflinks of a backing file): XFS with reflink=1 on a loop device over a sparse file, as an
# admin gives a node a disk for it.
mkdir -p /var/lib/node-disk /var/lib/ublkd/volumes
mount -t tmpfs -o mode=0755 disk /var/lib/node-disk || die "cannot mount a tmpfs for the node's disk"
truncate -s 4G /var/lib/node-disk/volumes.img
modprobe loop 2>>"$L/modprobe.log"
disk=$(losetup --find --show /var/lib/node-disk/volumes.img) || die "no loop device for the node's disk"
mkfs.xfs -q -m reflink=1 "$disk" >>"$L/node-disk.log" 2>&1 || die "mkfs.xfs on $disk"
mount -o discard "$disk" /var/lib/ublkd/volumes || die "cannot mount the node's disk"
mount --make-rshared /
# All of them now, before anything runs in parallel: a module load patches kernel text (static
# keys), and under TCG that has oopsed a guest once (int3 in kmem_cache_alloc, from ip6tables).
for m in virtio_net bridge veth br_netfilter dummy overlay nf_conntrack nf_nat nf_tables nft_compat \
    nft_chain_nat xt_MASQUERADE xt_comment xt_mark xt_addrtype xt_conntrack xt_nat \
    xt_statistic xt_multiport xt_tcpudp xt_physdev xt_limit ipt_REJECT nf_reject_ipv4 \
    iptable_nat iptable_filter iptable_mangle ip_tables ip6_tables ip6table_nat \
    ip6table_filter ip6table_mangle ip6t_REJECT nf_reject_ipv6; do
    modprobe "$m" 2>>"$L/modprobe.log" || echo "modprobe $m failed" >>"$L/modprobe.log"
done
sysctl -qw net.ipv4.ip_forward=1 net.bridge.bridge-nf-call-iptables=1 || die "sysctl"
if ! { ip link add node0 type dummy && ip addr add "$NODE_IP/24" dev node0 && ip link set node0 up; }; then
    die "cannot make the node's address"
fi
# The link to the control plane: QEMU's user network, its host at $HOST_IP.
nic=$(for n in /sys/class/net/*; do [ -e "$n/device" ] && basename "$n"; done | head -1)
if ! { [ -n "$nic" ] && ip link set "$nic" up && ip addr add 10.0.2.15/24 dev "$nic" &&
    ip route add default via "$HOST_IP" dev "$nic"; }; then
    die "cannot bring up the network to the control plane (${nic:-no NIC})"
fi
hostname "$NODE"
echo "127.0.0.1 localhost $NODE" >/etc/hosts
[ -f /sys/fs/cgroup/cgroup.controllers ] || mount -t cgroup2 none /sys/fs/cgroup ||
    die "no cgroup v2"
# Delegate every controller to the kubelet's hierarchy.
# shellcheck disable=SC2013 # one line of space-separated names
for c in $(cat /sys/fs/cgroup/cgroup.controllers); do
    echo "+$c" >/sys/fs/cgroup/cgroup.subtree_control 2>/dev/null || true
done

# --- the certificates and kubeconfigs the host made (control.sh) -------------------------------
P=/etc/kubernetes/pki
mkdir -p "$P"
cp "$K8S_PKI"/*.crt "$K8S_PKI"/*.key "$P/" || die "no certificates in $K8S_PKI"
for c in admin kubelet kube-proxy; do
    cp "$K8S_PKI/$c.conf" "/etc/kubernetes/$c.conf" || die "no kubeconfig for $c"
done
export KUBECONFIG=/etc/kubernetes/admin.conf
# Where the node's CPU goes: every process's CPU time, every two minutes (logs/cpu.log).
(
    while :; do
        echo "--- k8s [$(now)]"
        ps -eo pid,rss,time,comm --sort=-time | head -25
        sleep 120
    done
) >"$L/cpu.log" 2>&1 &
say "node ready, certificates in place"

# --- containerd and the images, before the control plane ---------------------------------------
# The import is the longest step of the boot under emulation (unpacking every layer), and the
# control plane, once up, keeps both vCPUs busy: it ran 4-7x slower beside it on a slow host
# (500-650 s against 70-120 s). So containerd imports the images first, two at a time, with
# the vCPUs to itself.
mkdir -p /etc/containerd /etc/cni/net.d
cat >/etc/containerd/config.toml <<EOC
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "ublkd.test/pause:test"
[plugins."io.containerd.grpc.v1.cri".cni]
  bin_dir = "$D/usr/lib/cni"
  conf_dir = "/etc/cni/net.d"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
  runtime_type = "io.containerd.runc.v2"
[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
  BinaryName = "/usr/sbin/runc"
[plugins."io.containerd.grpc.v1.cri".registry]
  config_path = "/etc/containerd/certs.d"
EOC
# The node's own registry (below) speaks plain HTTP on the loopback.
mkdir -p /etc/containerd/certs.d/127.0.0.1:5000
cat >/etc/containerd/certs.d/127.0.0.1:5000/hosts.toml <<EOC
server = "http://127.0.0.1:5000"
[host."http://127.0.0.1:5000"]
  capabilities = ["pull", "resolve"]
EOC
cat >/etc/cni/net.d/10-pods.conflist <<EOC
{"cniVersion": "0.4.0", "name": "pods", "plugins": [
  {"type": "bridge", "bridge": "cni0", "isGateway": true, "ipMasq": true, "hairpinMode": true,
   "ipam": {"type": "host-local", "ranges": [[{"subnet": "10.88.0.0/16"}]],
            "routes": [{"dst": "0.0.0.0/0"}]}},
  {"type": "loopback"}]}
EOC
PATH="$D/usr/bin:$PATH" "$D/usr/bin/containerd" >"$L/containerd.log" 2>&1 &
wait_for 60 "$D/usr/bin/ctr" version || die "containerd never answered"
import_one() { # REF ARCHIVE
    out=$("$D/usr/bin/ctr" -n k8s.io images import --base-name "${1%:*}" "$2" 2>&1) || {
        echo "importing $2: $out"
        return 1
    }
    got=$(echo "$out" | sed -n 's/^unpacking \([^ ]*\) .*/\1/p' | head -1)
    [ -n "$got" ] && [ "$got" != "$1" ] && "$D/usr/bin/ctr" -n k8s.io images tag "$got" "$1" >/dev/null
    return 0
}
mkdir -p /tmp/import
n=0 pids=""
while read -r ref archive; do
    n=$((n + 1))
    import_one "$ref" "$archive" >"/tmp/import/$n.log" 2>&1 &
    pids="$pids $!"
    # two at a time, one per vCPU; waiting on these pids only (containerd runs in the background too)
    if [ $((n % 2)) -eq 0 ]; then
        for p in $pids; do wait "$p"; done
        pids=""
    fi
done <"$K8S_IMAGES"
for p in $pids; do wait "$p"; done
cat /tmp/import/*.log >"$L/images.log" 2>/dev/null
grep -q "^importing" "$L/images.log" && die "$(grep -A3 "^importing" "$L/images.log" | head -8)"
while read -r ref archive; do
    "$D/usr/bin/ctr" -n k8s.io images ls -q | grep -qx "$ref" || die "image $ref missing after importing $archive: $(tail -3 "$L/images.log")"
done <"$K8S_IMAGES"
say "images imported: $(wc -l <"$K8S_IMAGES")"
# --- the control plane, on the host ---------------------------------------------------------
wait_for 600 kubectl get --raw /readyz || die "the API server (on the host, $HOST_IP) never answered"
say "API server ready"

mkdir -p /var/lib/kubelet
cat >/var/lib/kubelet/config.yaml <<EOC
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
authentication: {x509: {clientCAFile: $P/ca.crt}, webhook: {enabled: true}, anonymous: {enabled: false}}
authorization: {mode: Webhook}
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix:///run/containerd/containerd.sock
failSwapOn: false
resolvConf: /etc/resolv.conf
clusterDNS: [$HOST_IP]
clusterDomain: cluster.local
imageGCHighThresholdPercent: 100
evictionHard: {memory.available: "100Mi", nodefs.available: "1%", imagefs.available: "1%"}
# No QoS and pod cgroup levels: walking them on every housekeeping pass was a fifth of the
# kubelet's CPU in a profile of this guest (GetAllPodsFromCgroups), and the kubelet took two
# thirds of an emulated vCPU. The containers keep their own limits.
cgroupsPerQOS: false
enforceNodeAllocatable: []
tlsCertFile: $P/kubelet-serving.crt
tlsPrivateKeyFile: $P/kubelet-serving.key
EOC
# The kubelet runs as a node's systemd runs it (Restart=always, RestartSec=5): under emulation
# its first start can find containerd too busy to answer the CRI within its timeout ("error
# reading server preface"), and then it exits; the kubelet-restart scenario kills it and this
# brings it back. /run/kubelet.pid is the running kubelet's.
kubelet_service() {
    while :; do
        "$B/kubelet" --config=/var/lib/kubelet/config.yaml --kubeconfig=/etc/kubernetes/kubelet.conf \
            --hostname-override="$NODE" --node-ip="$NODE_IP" >>"$L/kubelet.log" 2>&1 &
        echo $! >/run/kubelet.pid
        wait $!
        echo "k8s [$(now)] the kubelet exited with status $?; starting it again in 5 s" >>"$L/kubelet.log"
        sleep 5
    done
}
kubelet_service &
"$B/kube-proxy" --kubeconfig=/etc/kubernetes/kube-proxy.conf --hostname-override="$NODE" \
    --cluster-cidr=10.88.0.0/16 --proxy-mode=iptables \
    --iptables-sync-period=5m >"$L/kube-proxy.log" 2>&1 &
node_ready() { kubectl get node "$NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' | grep -qx True; }
wait_for 600 node_ready || die "the node never became Ready"
say "node Ready"
# Pods reach the API server through the kubernetes Service (kube-proxy's rules).
wait_for 120 sh -c "iptables-save -t nat | grep -q KUBE-SVC" || die "kube-proxy wrote no Service rules"

# --- cluster add-ons: what deploy/csi/README.md ("Snapshots") has an admin install once --------
# The snapshot CRDs, and the snapshot-controller from its release's manifests with the two
# changes the README names (--enable-distributed-snapshotting, the rule on nodes); one replica,
# the image name of the offline build.
snapshot_addons() {
    tries 3 kubectl apply -k "$K8S_SNAPSHOT_CRDS" &&
        kubectl wait --for=condition=Established --timeout=60s \
            crd/volumesnapshots.snapshot.storage.k8s.io \
            crd/volumesnapshotcontents.snapshot.storage.k8s.io \
            crd/volumesnapshotclasses.snapshot.storage.k8s.io || return 1
    w=$UBLKD_VM_RUN/snapshot-controller  # where the host's kubectl reads it
    mkdir -p "$w"
    cp "$K8S_SNAPSHOT_CONTROLLER/rbac-snapshot-controller.yaml" \
        "$K8S_SNAPSHOT_CONTROLLER/setup-snapshot-controller.yaml" "$w/" || return 1
    cat >"$w/kustomization.yaml" <<EOK
apiVersion: kustomize.config.k8s.io/v1beta1
kind: Kustomization
resources: [rbac-snapshot-controller.yaml, setup-snapshot-controller.yaml]
replicas: [{name: snapshot-controller, count: 1}]
images:
  - name: registry.k8s.io/sig-storage/snapshot-controller
    newName: ublkd.test/snapshot-controller
    newTag: $K8S_SNAPSHOTTER_VERSION
patches:
  - target: {kind: Deployment, name: snapshot-controller}
    patch: |-
      - {op: add, path: /spec/template/spec/containers/0/args/-, value: --enable-distributed-snapshotting}
  - target: {kind: ClusterRole, name: snapshot-controller-runner}
    patch: |-
      - {op: add, path: /rules/-, value: {apiGroups: [""], resources: [nodes], verbs: [get, list, watch]}}
EOK
    tries 3 kubectl apply -k "$w"
}
snapshot_addons >"$L/snapshot-addons.log" 2>&1 || die "the snapshot add-ons: $(tail -5 "$L/snapshot-addons.log")"
say "snapshot CRDs and controller applied"

# --- ublkd's image in a registry, as a user's would be ------------------------------------------
# The distribution registry on the node's loopback; the image the host built pushed to it with
# `cargo xtask image --push`'s code (skopeo copy, then the served manifest's digest checked),
# as :test and as :roll (ublkd-restart's upgrade). The node never imported it: the install
# below pulls it through the chart's image.* values.
REG=127.0.0.1:5000
mkdir -p /var/lib/registry
cat >/etc/registry.yml <<EOR
version: 0.1
log: {level: warn}
storage: {filesystem: {rootdirectory: /var/lib/registry}}
http: {addr: $REG}
EOR
"$K8S_REGISTRY" serve /etc/registry.yml >"$L/registry.log" 2>&1 &
wait_for 60 curl -fsS "http://$REG/v2/" || die "the registry never answered: $(tail -5 "$L/registry.log")"
for tag in test roll; do
    "$K8S_XTASK" push-archive "$K8S_UBLKD_ARCHIVE" "$REG/ublkd:$tag" --manifest "$K8S_UBLKD_MANIFEST" \
        --insecure >>"$L/push.log" 2>&1 || die "pushing ublkd's image to $REG failed: $(tail -5 "$L/push.log")"
done
"$D/usr/bin/ctr" -n k8s.io images ls -q | grep -q "/ublkd:" && die "the node has a ublkd image before the install pulls one"
say "ublkd's image pushed to $REG: $(grep '^pushed' "$L/push.log" | tr '\n' ' ')"

# --- install as a user would: deploy/helm/ublkd (docs/kubernetes.md, "Install the driver") ------
install() {
    tries 3 kubectl apply -f - <<EON || return 1
apiVersion: v1
kind: Namespace
metadata:
  name: ublkd-system
  labels:
    pod-security.kubernetes.io/enforce: privileged
EON
    helm install ublkd "$K8S_CHART" --namespace ublkd-system --values "$K8S_VALUES" &&
        helm status ublkd --namespace ublkd-system
}
install >"$L/install.log" 2>&1 || die "helm install failed: $(tail -20 "$L/install.log")"
say "helm install of deploy/helm/ublkd done"
all_ready() {
    kubectl -n ublkd-system wait --for=condition=Ready pod --all --timeout=5s &&
        [ "$(kubectl -n ublkd-system get pods --no-headers | wc -l)" -ge 3 ]
}
if ! wait_for 600 all_ready; then
    kubectl -n ublkd-system get pods -o wide
    for c in ublkd:ublkd ublkd-csi-node:ublkd-csi; do
        echo "--- exec into $c"
        kubectl -n ublkd-system exec "ds/${c%:*}" -c "${c#*:}" -- /usr/local/bin/ublkctl --version 2>&1 | tail -3
        kubectl -n ublkd-system exec "ds/${c%:*}" -c "${c#*:}" -- /usr/local/bin/ublkd --version 2>&1 | tail -3
    done
    p=$(pidof ublkd | cut -d' ' -f1)
    echo "--- the ublkd process's mount namespace (pid $p)"
    nsenter -t "$p" -m ls -la /usr/local/bin 2>&1 | tail -5
    grep -c . "/proc/$p/mountinfo"
    grep -E " / | /usr" "/proc/$p/mountinfo" | head -5
    echo "--- through /proc/$p/root, and in each snapshot"
    # shellcheck disable=SC2012 # names to read, not to parse
    ls -la "/proc/$p/root/usr/local/bin" 2>&1 | head -5
    # shellcheck disable=SC2012 # names to read, not to parse
    for d in /var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots/*/fs; do
        echo "$d: $(ls "$d" | tr '\n' ' ' | cut -c1-120) | usr/local/bin: $(ls "$d/usr/local/bin" 2>/dev/null | tr '\n' ' ')"
    done | head -12
    kubectl -n ublkd-system describe pods | tail -60
    kubectl get events -A --field-selector type=Warning | tail -30
    die "the driver's pods never became Ready"
fi
say "every pod Ready"
pulled=$("$D/usr/bin/ctr" -n k8s.io images ls -q | grep "^$REG/ublkd:") || die "ublkd's pods are Ready but no image was pulled from $REG"
say "pulled from the node's registry: $pulled"
kubectl -n ublkd-system get pods -o wide

# --- scenarios ---------------------------------------------------------------------------------
wanted() { [ "$K8S_SCENARIOS" = all ] || echo " $K8S_SCENARIOS " | grep -q " $1 "; }
# The guest's busy and total CPU time so far, in ticks (/proc/stat's first line).
cpu_ticks() { awk '/^cpu /{b = $2 + $3 + $4 + $7 + $8; print b, b + $5 + $6}' /proc/stat; }
run() {
    name=$1
    shift
    wanted "$name" || return 0
    s=$(now)
    c0=$(cpu_ticks)
    say "scenario $name"
    # set -e holds inside the subshell only because its status is not tested right here.
    (
        set -e
        SCENARIO=$name
        "$@"
    ) >"$L/scenario-$name.log" 2>&1
    rc=$?
    took=$(awk -v a="$s" -v b="$(now)" 'BEGIN{printf "%.1f", b - a}')
    # How busy the guest's CPUs were meanwhile: near 100 % says the scenario waited on the
    # emulated CPUs, well under says it waited on Kubernetes's own loops.
    busy=$(echo "$c0 $(cpu_ticks)" | awk '{d = $4 - $2; printf "%.0f", (d > 0 ? 100 * ($3 - $1) / d : 0)}')
    # One write, so that scenarios run together do not interleave their reports.
    if [ "$rc" = 0 ]; then
        echo "SCENARIO $name ok $took" >"$L/report-$name"
    else
        echo "$name" >>"$L/failed-scenarios"
        { echo "SCENARIO $name FAILED $took"; tail -40 "$L/scenario-$name.log"; } >"$L/report-$name"
    fi
    echo "k8s [$(now)] scenario $name ended: the guest's CPUs $busy % busy while it ran" >>"$L/report-$name"
    cat "$L/report-$name"
}
# together NAME...: scenarios that share no object, no pool that one of them fills and no
# component that one of them restarts, run at once (each its own log and report). Most of a
# scenario's time is Kubernetes's loops (the kubelet's, the provisioner's), not the guest's CPUs.
together() {
    pids=
    for n in "$@"; do
        run "$n" "s_$(echo "$n" | tr - _)" &
        pids="$pids $!"
    done
    # only these: a bare wait would wait for the node's own daemons too
    # shellcheck disable=SC2086 # one pid per word
    wait $pids
}
fail() {
    echo "check failed: $*"
    return 1
}
ublkctl() { kubectl -n ublkd-system exec ds/ublkd -c ublkd -- /usr/local/bin/ublkctl "$@"; }
# finalized NODE: the node-loss controller's finalizer is on NODE
finalized() { kubectl get node "$1" -o jsonpath='{.metadata.finalizers}' | grep -q 'ublkd.io/node'; }
# node_event NODE REASON: an Event of that reason on Node NODE (the node-loss controller's)
node_event() {
    kubectl get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$1,reason=$2" \
        -o jsonpath='{.items[*].message}' | grep -q .
}
# node_events NODE: the node-loss controller's Events on Node NODE, for the log
node_events() {
    kubectl get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$1" \
        -o custom-columns=REASON:.reason,MESSAGE:.message | grep -E '^(REASON|Node)' || true
}

# The driver as the cluster sees it: CSINode with the topology key and a volume limit, and
# capacity objects for every class.
s_driver() {
    # How long ublkd took from its container's start to binding the listener of its startup
    # probe (printed for the record: a probe before that bind is a warning event, s_warnings).
    started=$(kubectl -n ublkd-system get pod -l app.kubernetes.io/name=ublkd \
        -o jsonpath='{.items[0].status.containerStatuses[?(@.name=="ublkd")].state.running.startedAt}')
    bound=$(kubectl -n ublkd-system logs ds/ublkd -c ublkd --timestamps | grep -m1 'metrics on' | cut -d' ' -f1)
    echo "ublkd container started $started; metrics listener bound $bound"
    keys=$(kubectl get csinode "$NODE" -o jsonpath='{.spec.drivers[?(@.name=="ublkd.io")].topologyKeys}')
    echo "topology keys: $keys"
    { [ -n "$keys" ] && [ "$keys" != "[]" ]; } || fail "CSINode lists ublkd.io with a topology key"
    count=$(kubectl get csinode "$NODE" -o jsonpath='{.spec.drivers[?(@.name=="ublkd.io")].allocatable.count}')
    echo "volume limit: $count"
    [ "${count:-0}" -gt 0 ] || fail "CSINode gives ublkd.io a volume limit"
    capacities() { [ "$(kubectl get csistoragecapacities -A --no-headers 2>/dev/null | wc -l)" -ge 3 ]; }
    # the provisioner publishes them once it has synced; a slow emulated node takes minutes
    wait_for 420 capacities ||
        { kubectl get csistoragecapacities -A; echo "fewer than 3 CSIStorageCapacity objects"; return 1; }
    kubectl get csistoragecapacities -A -o custom-columns=CLASS:.storageClassName,CAPACITY:.capacity,NODE:.nodeTopology.matchLabels
    # the node-loss controller's finalizer on the driver's node
    wait_for 120 finalized "$NODE" || fail "no finalizer ublkd.io/node on $NODE"
    for sc in ublkd-file ublkd-ram ublkd-nvme; do
        n=$(kubectl get csistoragecapacities -A -o jsonpath="{.items[?(@.storageClassName==\"$sc\")].capacity}")
        [ -n "$n" ] || fail "a CSIStorageCapacity for $sc"
    done
}

# start_pod NAME CLAIM [block]: a pod that keeps the claim mounted at /data (or as /dev/xvda),
# not waited for
start_pod() {
    if [ "${3:-}" = block ]; then
        mnt="volumeDevices: [{name: v, devicePath: /dev/xvda}]"
    else
        mnt="volumeMounts: [{name: v, mountPath: /data}]"
    fi
    kubectl apply -f - <<EOP
apiVersion: v1
kind: Pod
metadata: {name: $1}
spec:
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: ublkd.test/busybox:test
      command: ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]
      $mnt
  volumes: [{name: v, persistentVolumeClaim: {claimName: $2}}]
EOP
}
# pod NAME CLAIM [block]: start_pod, waited for until Ready
pod() {
    start_pod "$@" || return 1
    kubectl wait --for=condition=Ready "pod/$1" --timeout=600s || {
        kubectl describe pod "$1" | tail -25
        kubectl describe pvc "$2" | tail -15
        kubectl -n ublkd-system logs ds/ublkd-csi-node -c ublkd-csi --tail=30 || true
        return 1
    }
}
# claim NAME CLASS SIZE LINE: a ReadWriteOnce claim, LINE one more field of its spec.
claim() {
    kubectl apply -f - <<EOP
apiVersion: v1
kind: PersistentVolumeClaim
metadata: {name: $1}
spec:
  accessModes: [ReadWriteOnce]
  storageClassName: $2
  $4
  resources: {requests: {storage: $3}}
EOP
}
pvc() { # NAME CLASS SIZE [block]
    mode=Filesystem
    [ "${4:-}" = block ] && mode=Block
    claim "$1" "$2" "$3" "volumeMode: $mode"
}
# mib QUANTITY: a Kubernetes quantity in Mi or Gi (what capacities are written in), in MiB.
mib() {
    case $1 in
        *Gi) echo $((${1%Gi} * 1024)) ;;
        *Mi) echo "${1%Mi}" ;;
        *) echo $(($1 / 1048576)) ;;
    esac
}
in_pod() { kubectl exec "$1" -- /bin/sh -c "$2"; }

# A filesystem class: data written survives the pod, online expansion reaches df, and the
# claim's deletion takes the ublkd volume (and its backing file) with it.
s_filesystem() { # CLASS
    c=$1
    pvc "d-$c" "$c" 64Mi
    phase=$(kubectl get pvc "d-$c" -o jsonpath='{.status.phase}')
    echo "before a consumer: $phase"
    [ "$phase" = Pending ] || fail "WaitForFirstConsumer leaves the claim Pending until a pod"
    pod "p-$c" "d-$c"
    in_pod "p-$c" 'echo ublkd-k8s-data >/data/f && sync'
    kubectl delete pod "p-$c" --wait=true
    pod "p-$c" "d-$c"
    got=$(in_pod "p-$c" 'cat /data/f')
    [ "$got" = ublkd-k8s-data ] || fail "the data is there after the pod is recreated ($got)"
    before=$(in_pod "p-$c" "df -k /data | tail -1" | awk '{print $2}')
    # What the driver gave (an xfs class rounds a claim up to xfs's smallest, 300 MiB), and
    # 64 MiB more of it.
    have=$(mib "$(kubectl get pvc "d-$c" -o jsonpath='{.status.capacity.storage}')")
    echo "claimed 64 MiB, got $have MiB"
    [ "$have" -ge 64 ] || fail "the claim got at least what it asked for"
    pv=$(kubectl get pvc "d-$c" -o jsonpath='{.spec.volumeName}')
    kubectl patch pvc "d-$c" -p "{\"spec\":{\"resources\":{\"requests\":{\"storage\":\"$((have + 64))Mi\"}}}}"
    # The kubelet grows a mounted file system (NodeExpandVolume) when it next syncs the pod,
    # a minute and more after the PV grew; an update to the pod syncs it at once (a kubelet
    # resyncing every 10 s instead cost the guest a tenth of its CPUs). The growth is still the
    # resizer's, the kubelet's and the driver's.
    pv_grown() { [ "$(mib "$(kubectl get pv "$pv" -o jsonpath='{.spec.capacity.storage}')")" -gt "$have" ]; }
    wait_for 300 pv_grown || { kubectl describe pvc "d-$c" | tail -15; echo "the PV never grew"; return 1; }
    kubectl annotate pod "p-$c" --overwrite "ublkd.test/resync=$(now)"
    grown() { [ "$(in_pod "p-$c" "df -k /data | tail -1" | awk '{print $2}')" -gt $((before + 32768)) ]; }
    wait_for 420 grown || { kubectl describe pvc "d-$c" | tail -15; echo "df never grew from ${before} KiB"; return 1; }
    echo "df: ${before} KiB, then $(in_pod "p-$c" "df -k /data | tail -1" | awk '{print $2}') KiB"
    vol=$(kubectl get pv "$pv" -o jsonpath='{.spec.csi.volumeHandle}')
    echo "volume $vol"
    ublkctl list-volumes | grep -q "$vol" || { ublkctl list-volumes; echo "ublkd does not list $vol"; return 1; }
    # The claim the volume was made for, kept with it (the provisioner's --extra-create-metadata).
    claimed=$(ublkctl get-volume "$vol" | sed -n 's/^claim: *//p')
    echo "claim: $claimed"
    [ "$claimed" = "default/d-$c (pv $pv)" ] || fail "get-volume names the claim default/d-$c and its PV $pv"
    if [ "$c" = ublkd-file ]; then
        # The root is a hostPath: the node sees the backing file itself (the image has no ls).
        [ -n "$(find /var/lib/ublkd/volumes -name "*$vol*")" ] || fail "no backing file of $vol on the node"
    fi
    kubectl delete pod "p-$c" --wait=true
    kubectl delete pvc "d-$c" --wait=true
    gone() { ! kubectl get pv "$pv" >/dev/null 2>&1 && ! ublkctl list-volumes | grep -q "$vol"; }
    wait_for 300 gone || { ublkctl list-volumes; echo "$vol outlived its claim"; return 1; }
    if [ "$c" = ublkd-file ]; then
        [ -z "$(find /var/lib/ublkd/volumes -name "*$vol*")" ] || fail "the backing file of $vol outlived its claim"
    fi
}

s_file_ext4() { s_filesystem ublkd-file; }
s_ram() { s_filesystem ublkd-ram; }
s_nvme_xfs() { s_filesystem ublkd-nvme; }

# A raw-block claim: the device itself in the pod, its bytes kept across pods.
s_block() {
    pvc d-block ublkd-ram 64Mi block
    pod p-block d-block block
    in_pod p-block 'echo ublkd-k8s-block | dd of=/dev/xvda bs=512 count=1 conv=fsync'
    kubectl delete pod p-block --wait=true
    pod p-block d-block block
    got=$(in_pod p-block 'dd if=/dev/xvda bs=15 count=1 2>/dev/null')
    [ "$got" = ublkd-k8s-block ] || fail "the block device kept its bytes across pods ($got)"
    kubectl delete pod p-block --wait=true
    kubectl delete pvc d-block --wait=true
}

# A claim larger than the node can hold: the pod stays Pending, and the scheduler says why.
s_pending() {
    pvc d-huge ublkd-ram 100Ti
    kubectl apply -f - <<EOP
apiVersion: v1
kind: Pod
metadata: {name: p-huge}
spec:
  containers:
    - {name: app, image: ublkd.test/busybox:test, command: ["/bin/sh", "-c", "sleep 3600"],
       volumeMounts: [{name: v, mountPath: /data}]}
  volumes: [{name: v, persistentVolumeClaim: {claimName: d-huge}}]
EOP
    why() {
        kubectl get events --field-selector involvedObject.name=p-huge,reason=FailedScheduling \
            -o jsonpath='{.items[*].message}' | grep -qi storage
    }
    wait_for 300 why || { kubectl describe pod p-huge | tail -10; fail "no FailedScheduling event naming storage"; }
    kubectl get events --field-selector involvedObject.name=p-huge -o jsonpath='{.items[*].message}'
    echo
    [ "$(kubectl get pod p-huge -o jsonpath='{.status.phase}')" = Pending ] || fail "p-huge left Pending"
    [ "$(kubectl get pvc d-huge -o jsonpath='{.status.phase}')" = Pending ] || fail "d-huge left Pending"
    kubectl delete pod p-huge --wait=true
    kubectl delete pvc d-huge --wait=true
}

# pvc_from NAME CLASS SIZE KIND SOURCE: a claim made from a VolumeSnapshot or another claim.
pvc_from() {
    group=
    [ "$4" = VolumeSnapshot ] && group="apiGroup: snapshot.storage.k8s.io, "
    claim "$1" "$2" "$3" "dataSource: {${group}kind: $4, name: $5}"
}
volume_of() { kubectl get pv "$(kubectl get pvc "$1" -o jsonpath='{.spec.volumeName}')" -o jsonpath='{.spec.csi.volumeHandle}'; }

# Prometheus (built from its module: Debian's has no Kubernetes discovery) on the node,
# scraping the way the chart's ServiceMonitor does: the endpoints of the Services labelled
# app.kubernetes.io/name=ublkd in ublkd-system, port "metrics", job "ublkd" (the same relabel
# rules, since the cluster has no Prometheus Operator). Its rules are the chart's files/ublkd-rules.yaml with one change, said
# here: UblkdPoolAlmostFull's `for: 10m` cut to 20s. The file pool is then filled with files
# beside the volumes' (fallocate, to 5 % free as ublkd reports it): the alert fires for that
# pool, and clears once the files are gone.
s_monitoring() {
    w=/tmp/prometheus
    rm -rf "$w"
    mkdir -p "$w/data"
    sed '/alert: UblkdPoolAlmostFull/,/for:/ s/for: 10m/for: 20s/' "$K8S_CHART/files/ublkd-rules.yaml" >"$w/rules.yaml"
    grep -A2 'alert: UblkdPoolAlmostFull' "$w/rules.yaml" | grep -q 'for: 20s' || fail "the pool alert's for: was not where the test expects it"
    cat >"$w/prometheus.yml" <<EOP
global: {scrape_interval: 5s, evaluation_interval: 5s}
rule_files: [$w/rules.yaml]
scrape_configs:
  - job_name: serviceMonitor/ublkd-system/ublkd/0
    kubernetes_sd_configs:
      - role: endpoints
        kubeconfig_file: $K8S_PKI/admin.conf
        namespaces: {names: [ublkd-system]}
    relabel_configs:
      - {source_labels: [__meta_kubernetes_service_label_app_kubernetes_io_name], regex: ublkd, action: keep}
      - {source_labels: [__meta_kubernetes_endpoint_port_name], regex: metrics, action: keep}
      - {source_labels: [__meta_kubernetes_namespace], target_label: namespace}
      - {source_labels: [__meta_kubernetes_pod_name], target_label: pod}
      - {source_labels: [__meta_kubernetes_service_name], target_label: service}
      - {target_label: job, replacement: ublkd}
EOP
    "$K8S_PROMETHEUS" --config.file="$w/prometheus.yml" --storage.tsdb.path="$w/data" \
        --web.listen-address=127.0.0.1:9090 >"$L/prometheus.log" 2>&1 &
    prom=$!
    q() { curl -fsS --get http://127.0.0.1:9090/api/v1/query --data-urlencode "query=$1" | jq -r "$2"; }
    up() { [ "$(q 'up{job="ublkd"}' '.data.result[0].value[1]')" = 1 ]; }
    wait_for 300 up || {
        curl -fsS http://127.0.0.1:9090/api/v1/targets | jq -c '.data.activeTargets[] | {scrapeUrl, health, lastError}'
        tail -5 "$L/prometheus.log"
        kill "$prom"
        fail "Prometheus never scraped ublkd through the ServiceMonitor's rules"
    }
    pool=/var/lib/ublkd/volumes
    sel="backend=\"file\",pool=\"$pool\""
    total=$(q "ublkd_capacity_bytes{$sel}" '.data.result[0].value[1]')
    free=$(q "ublkd_capacity_free_bytes{$sel}" '.data.result[0].value[1]')
    echo "scraped: $(q 'up{job="ublkd"}' '.data.result[0].metric | "\(.pod) \(.service)"'); file pool $total bytes, $free free"
    fill=$(awk -v t="$total" -v f="$free" 'BEGIN { printf "%.0f", f - t * 0.05 }')
    [ "$fill" -gt 0 ] || { kill "$prom"; fail "the file pool has under 5 % free before the test fills it ($free of $total)"; }
    firing() { [ "$(q "ALERTS{alertname=\"UblkdPoolAlmostFull\",alertstate=\"firing\",$sel}" '.data.result | length')" = 1 ]; }
    firing && { kill "$prom"; fail "UblkdPoolAlmostFull fired before the pool was filled"; }
    # Filled in steps, each to 5 % of what ublkd last reported free, until it reports under 8 %
    # (printf "%.0f": busybox and mawk awk cap "%d" at 2^31 - 1, which once filled only half).
    n=0
    while :; do
        n=$((n + 1))
        fallocate -l "$fill" "$pool/filler.$n"
        echo "filler.$n: $fill bytes; the node's df: $(df -B1 --output=avail "$pool" | tail -1)"
        sleep 15
        free=$(q "ublkd_capacity_free_bytes{$sel}" '.data.result[0].value[1]')
        echo "ublkd reports $free free of $total"
        awk -v t="$total" -v f="$free" 'BEGIN { exit !(f < t * 0.08) }' && break
        [ "$n" -ge 5 ] && { rm -f "$pool"/filler.*; kill "$prom"; fail "the pool never reported under 8 % free"; }
        fill=$(awk -v t="$total" -v f="$free" 'BEGIN { printf "%.0f", f - t * 0.05 }')
    done
    wait_for 300 firing || {
        echo "free now: $(q "ublkd_capacity_free_bytes{$sel}" '.data.result[0].value[1]')"
        q ALERTS '.data.result'
        rm -f "$pool"/filler.*
        kill "$prom"
        fail "UblkdPoolAlmostFull did not fire with the pool filled to 5 % free"
    }
    echo "firing: $(q 'ALERTS{alertname="UblkdPoolAlmostFull"}' '.data.result[0].metric | "\(.alertname) \(.backend) \(.pool) \(.alertstate)"'), free $(q "ublkd_capacity_free_bytes{$sel}" '.data.result[0].value[1]')"
    rm "$pool"/filler.*
    cleared() { ! firing; }
    wait_for 300 cleared || { kill "$prom"; fail "UblkdPoolAlmostFull did not clear once the pool was freed"; }
    echo "cleared: free $(q "ublkd_capacity_free_bytes{$sel}" '.data.result[0].value[1]')"
    kill "$prom"
}

# A VolumeSnapshot of a file-xfs claim, a claim restored from it and a clone of the claim, on
# the node's reflink XFS: each holds the data of its moment, and deleting them leaves no file.
s_snapshots() {
    helm upgrade ublkd "$K8S_CHART" --namespace ublkd-system --reuse-values --set snapshots.enabled=true
    kubectl -n kube-system rollout status deploy/snapshot-controller --timeout=600s
    pvc s-src ublkd-file-xfs 300Mi
    pod p-src s-src
    in_pod p-src 'echo at-the-snapshot >/data/f && sync'
    kubectl apply -f - <<EOP
apiVersion: snapshot.storage.k8s.io/v1
kind: VolumeSnapshot
metadata: {name: snap1}
spec:
  volumeSnapshotClassName: ublkd-file
  source: {persistentVolumeClaimName: s-src}
EOP
    ready() { [ "$(kubectl get volumesnapshot snap1 -o jsonpath='{.status.readyToUse}')" = true ]; }
    wait_for 420 ready || {
        kubectl describe volumesnapshot snap1 | tail -20
        kubectl get volumesnapshotcontents -o yaml | tail -30
        kubectl -n kube-system logs deploy/snapshot-controller --tail=20
        kubectl -n ublkd-system logs ds/ublkd-csi-node -c csi-snapshotter --tail=20
        fail "snap1 never became readyToUse"
    }
    echo "snapshot: $(kubectl get volumesnapshot snap1 -o jsonpath='{.status.restoreSize} {.status.boundVolumeSnapshotContentName}')"
    in_pod p-src 'echo after-the-snapshot >/data/f && sync'
    pvc_from s-restore ublkd-file-xfs 300Mi VolumeSnapshot snap1
    pod p-restore s-restore
    got=$(in_pod p-restore 'cat /data/f')
    [ "$got" = at-the-snapshot ] || fail "the restore holds the snapshot's data ($got)"
    pvc_from s-clone ublkd-file-xfs 300Mi PersistentVolumeClaim s-src
    pod p-clone s-clone
    got=$(in_pod p-clone 'cat /data/f')
    [ "$got" = after-the-snapshot ] || fail "the clone holds its source's data ($got)"
    in_pod p-restore 'echo the-restore-wrote >/data/f && sync'
    got=$(in_pod p-src 'cat /data/f')
    [ "$got" = after-the-snapshot ] || fail "a write to the restore stays out of its source ($got)"
    vols="$(volume_of s-src) $(volume_of s-restore) $(volume_of s-clone)"
    echo "volumes: $vols"
    kubectl delete pod p-src p-restore p-clone --wait=true
    kubectl delete volumesnapshot snap1 --wait=true
    kubectl delete pvc s-src s-restore s-clone --wait=true
    gone() {
        [ -z "$(kubectl get volumesnapshotcontents --no-headers 2>/dev/null)" ] || return 1
        for v in $vols; do ublkctl list-volumes | grep -q "$v" && return 1; done
        [ -z "$(find /var/lib/ublkd/volumes -name '*.img')" ]
    }
    wait_for 420 gone || {
        kubectl get volumesnapshotcontents
        ublkctl list-volumes
        find /var/lib/ublkd/volumes
        fail "a snapshot, a volume or a file outlived its object"
    }
}

ublkd_pod() { kubectl -n ublkd-system get pod -l app.kubernetes.io/name=ublkd -o jsonpath='{.items[0].metadata.name}'; }
ublkd_restarts() { kubectl -n ublkd-system get pod "$(ublkd_pod)" -o jsonpath='{.status.containerStatuses[?(@.name=="ublkd")].restartCount}'; }
ublkd_ready() { kubectl -n ublkd-system wait --for=condition=Ready pod -l app.kubernetes.io/name=ublkd --timeout=5s; }

# A VolumeAttributesClass reaching ublkd's limits, installed as deploy/csi/README.md says
# ("Changing a volume's limits"): the Secrets for remote access made by hand with openssl (one
# CA: ublkd's server certificate for the Service's name, the resizer's client certificate; made
# with the cluster's in control.sh), `helm upgrade` with remote access and modify volume on, the
# ublkd pod deleted to take them (OnDelete); then a
# claim's class changed twice, each time checked in the claim's status and in ublkd.
s_modify() {
    for s in ublkd-grpc ublkd-csi-resizer; do
        kubectl -n ublkd-system create secret generic "$s-tls" --from-file=tls.crt="$K8S_PKI/$s.crt" \
            --from-file=tls.key="$K8S_PKI/$s.key" --from-file=ca.crt="$K8S_PKI/ca.crt"
    done
    helm upgrade ublkd "$K8S_CHART" --namespace ublkd-system --reuse-values \
        --set snapshots.enabled=true --set remoteAccess.enabled=true --set modifyVolume.enabled=true
    old=$(ublkd_pod)
    kubectl -n ublkd-system delete pod "$old" --wait=true
    rolled() { [ "$(ublkd_pod)" != "$old" ] && ublkd_ready; }
    wait_for 600 rolled || { kubectl -n ublkd-system get pods -o wide; fail "the ublkd pod with remote access never became Ready"; }
    kubectl -n ublkd-system rollout status deploy/ublkd-csi-resizer --timeout=600s
    kubectl -n ublkd-system logs deploy/ublkd-csi-resizer -c ublkd-csi | grep modify_volume
    pvc m-data ublkd-ram 64Mi
    pod p-m m-data
    # The name the resizer's driver resolves, through the cluster's DNS, from a pod.
    in_pod p-m 'nslookup ublkd-grpc.ublkd-system.svc.cluster.local' ||
        fail "the remote-access Service's name does not resolve in a pod"
    vol=$(volume_of m-data)
    qos() { ublkctl get-volume "$vol" | sed -n 's/^qos: *//p'; }
    echo "volume $vol, qos: $(qos)"
    class() { [ "$(kubectl get pvc m-data -o jsonpath='{.status.currentVolumeAttributesClassName}')" = "$1" ]; }
    applied() {
        wait_for 420 class "$1" || {
            kubectl describe pvc m-data | tail -15
            kubectl -n ublkd-system logs deploy/ublkd-csi-resizer -c csi-resizer --tail=20
            kubectl -n ublkd-system logs deploy/ublkd-csi-resizer -c ublkd-csi --tail=20
            fail "the claim's class never became $1"
        }
    }
    kubectl patch pvc m-data -p '{"spec":{"volumeAttributesClassName":"ublkd-limited"}}'
    applied ublkd-limited
    q=$(qos)
    echo "ublkd-limited applied, qos: $q"
    case $q in *"read 5000 IOPS"*"write 2000 IOPS"*) ;; *) fail "ublkd's limits are not ublkd-limited's ($q)" ;; esac
    kubectl patch pvc m-data -p '{"spec":{"volumeAttributesClassName":"ublkd-unlimited"}}'
    applied ublkd-unlimited
    q=$(qos)
    echo "ublkd-unlimited applied, qos: $q"
    [ "$q" = unlimited ] || fail "ublkd's limits were not lifted ($q)"
    kubectl delete pod p-m --wait=true
    kubectl delete pvc m-data --wait=true
}

# A pod writes with fsync (each write a new block, each checked) while ublkd is killed with
# SIGKILL and then upgraded to a new image the way docs/kubernetes.md ("Upgrading") says (helm
# upgrade, then the node's pod deleted: OnDelete). The devices wait for the next ublkd; the
# writer ends with no I/O error.
s_ublkd_restart() {
    pvc w-data ublkd-file 64Mi
    kubectl apply -f - <<EOP
apiVersion: v1
kind: Pod
metadata: {name: p-writer}
spec:
  restartPolicy: Never
  terminationGracePeriodSeconds: 1
  containers:
    - name: app
      image: ublkd.test/busybox:test
      command:
        - /bin/sh
        - -c
        - |
          i=0
          while [ ! -e /data/stop ]; do
            echo "block \$i" | dd of=/data/log bs=4096 seek=\$((i % 8192)) conv=fsync,notrunc 2>/tmp/err ||
              { echo "write \$i failed: \$(cat /tmp/err)"; exit 1; }
            i=\$((i + 1))
          done
          echo "wrote \$i blocks with fsync, none failed"
      volumeMounts: [{name: v, mountPath: /data}]
  volumes: [{name: v, persistentVolumeClaim: {claimName: w-data}}]
EOP
    kubectl wait --for=condition=Ready pod/p-writer --timeout=600s
    sleep 5
    before=$(ublkd_restarts)
    pid=$(pidof ublkd | cut -d' ' -f1)
    [ -n "$pid" ] || fail "no ublkd process on the node"
    kill -9 "$pid"
    echo "SIGKILL to ublkd (pid $pid); restarts were $before"
    restarted() { [ "$(ublkd_restarts)" -gt "$before" ] && ublkd_ready; }
    wait_for 600 restarted || { kubectl -n ublkd-system describe pod "$(ublkd_pod)" | tail -20; fail "ublkd did not come back after SIGKILL"; }
    echo "ublkd back after SIGKILL; the writer: $(kubectl get pod p-writer -o jsonpath='{.status.phase}')"
    # The roll, as docs/kubernetes.md ("Upgrading") says: helm upgrade to a new image tag (the
    # same build pushed to the node's registry as :roll), then the node's pod deleted.
    old=$(ublkd_pod)
    helm upgrade ublkd "$K8S_CHART" --namespace ublkd-system --reuse-values --set image.tag=roll
    helm history ublkd --namespace ublkd-system
    kubectl -n ublkd-system delete pod -l app.kubernetes.io/name=ublkd --field-selector spec.nodeName="$NODE" --wait=true
    rolled() { [ "$(ublkd_pod)" != "$old" ] && ublkd_ready &&
        kubectl -n ublkd-system get pod "$(ublkd_pod)" -o jsonpath='{.spec.containers[?(@.name=="ublkd")].image}' | grep -q ':roll$'; }
    wait_for 600 rolled || { kubectl -n ublkd-system get pods -o wide; fail "the rolled ublkd pod never became Ready"; }
    echo "rolled to $(ublkd_pod)"
    sleep 5
    in_pod p-writer 'touch /data/stop'
    done_ok() { [ "$(kubectl get pod p-writer -o jsonpath='{.status.phase}')" = Succeeded ]; }
    wait_for 300 done_ok || { kubectl logs p-writer | tail -5; kubectl describe pod p-writer | tail -10; fail "the writer did not finish cleanly"; }
    kubectl logs p-writer
    kubectl delete pod p-writer --wait=true
    kubectl delete pvc w-data --wait=true
}

# `kubectl ublkd` (the plugin, found on kubectl's PATH like any plugin; it reaches ublkd by exec
# through the API server with the caller's kubeconfig): a running pod's claim to its node,
# volume and stats; the nodes' table; a volume made outside Kubernetes listed as an orphan
# until it is deleted.
s_plugin() {
    pvc x-data ublkd-ram 64Mi
    pod p-x x-data
    in_pod p-x 'dd if=/dev/zero of=/data/f bs=4096 count=256 conv=fsync'
    vol=$(volume_of x-data)
    out=$(kubectl ublkd pvc x-data)
    echo "$out"
    echo "$out" | grep -q "^node: *$NODE$" || fail "kubectl ublkd pvc does not name the node"
    echo "$out" | grep -q "^volume: *$vol$" || fail "kubectl ublkd pvc does not name the volume $vol"
    echo "$out" | grep -q "^state: *ready$" || fail "kubectl ublkd pvc does not show the volume ready"
    echo "$out" | grep -q "^device: */dev/ublkb" || fail "kubectl ublkd pvc does not show the device"
    echo "$out" | grep -q "^qos:" || fail "kubectl ublkd pvc does not show the QoS"
    writes=$(echo "$out" | awk '$1 == "write" { print $2 }')
    [ "${writes:-0}" -gt 0 ] || fail "kubectl ublkd pvc shows no writes in the stats ($writes)"
    out=$(kubectl ublkd nodes)
    echo "$out"
    echo "$out" | awk -v n="$NODE" '$1 == n && $4 >= 1 { ok = 1 } END { exit !ok }' ||
        fail "kubectl ublkd nodes has no line for $NODE with a volume"
    echo "$out" | grep "^$NODE" | grep -q "ublkd-ram=" || fail "kubectl ublkd nodes shows no capacity for ublkd-ram"
    ublkctl create-volume stray-1 --size 16MiB --backend ram
    out=$(kubectl ublkd orphans)
    echo "$out"
    echo "$out" | grep -q "$NODE *volume without PV *stray-1" || fail "kubectl ublkd orphans does not list stray-1"
    echo "$out" | grep -q "$vol" && fail "kubectl ublkd orphans lists $vol, whose PV exists"
    ublkctl delete-volume stray-1
    out=$(kubectl ublkd orphans)
    echo "$out" | grep -q stray-1 && fail "stray-1 is still listed after it was deleted"
    kubectl delete pod p-x --wait=true
    kubectl delete pvc x-data --wait=true
}

# The kubelet restarted: the mounted volume stays mounted and keeps its data, the registrar
# registers the driver again, and a new pod still gets a new volume.
s_kubelet_restart() {
    pvc k-data ublkd-ram 64Mi
    pod p-keep k-data
    in_pod p-keep 'echo kept >/data/f && sync'
    old=$(cat /run/kubelet.pid)
    kill "$old"
    wait_for 30 sh -c "! kill -0 $old" || fail "the kubelet did not stop"
    # kubelet_service starts it again, as systemd would.
    wait_for 60 sh -c "[ \"\$(cat /run/kubelet.pid)\" != $old ] && kill -0 \$(cat /run/kubelet.pid)" ||
        fail "the kubelet was not started again"
    wait_for 600 node_ready || fail "the node never became Ready again"
    # The new kubelet takes the running pods back before it answers for them.
    wait_for 300 in_pod p-keep true || fail "the kubelet never took p-keep back"
    echo "kubelet restarted; the node Ready, p-keep taken back"
    registered() { kubectl get csinode "$NODE" -o jsonpath='{.spec.drivers[*].name}' | grep -qw ublkd.io; }
    wait_for 300 registered || fail "the driver is not registered after the restart"
    got=$(in_pod p-keep 'cat /data/f')
    [ "$got" = kept ] || fail "the mounted volume kept its data ($got)"
    pvc k-new ublkd-ram 64Mi
    pod p-new k-new
    in_pod p-new 'echo new >/data/f && sync'
    echo "a new pod got a volume after the restart"
    kubectl delete pod p-keep p-new --wait=true
    kubectl delete pvc k-data k-new --wait=true
}

# No warning events from the driver's objects: anything in ublkd-system, on a storage object,
# or about a volume on a pod (mount, map, resize, provisioning, snapshot). Run after the
# scenarios that use the driver and before those that restart ublkd on purpose (modify takes
# its new configuration by a restart): while ublkd is down, the kubelet reports ublkd's
# readiness probe failing, as it should. The pending
# scenario's FailedScheduling is the scheduler saying what it must.
s_warnings() {
    kubectl get events -A --field-selector type=Warning --no-headers \
        -o custom-columns=NS:.metadata.namespace,KIND:.involvedObject.kind,NAME:.involvedObject.name,REASON:.reason,FROM:.source.component,MESSAGE:.message \
        >/tmp/warnings
    echo "warning events: $(grep -c . /tmp/warnings)"
    cut -c1-220 /tmp/warnings
    bad=$(awk '$1 == "ublkd-system" ||
             $2 ~ /^(PersistentVolumeClaim|PersistentVolume|VolumeSnapshot|VolumeSnapshotContent|CSINode|CSIStorageCapacity|StorageClass)$/ ||
             $4 ~ /Mount|Volume|Provision|Resiz|Snapshot/' /tmp/warnings || true)
    [ -z "$bad" ] || { echo "from the driver's objects:"; echo "$bad" | cut -c1-300; fail "warning events from the driver's objects"; }
}

# Node maintenance as docs/kubernetes.md ("Drain a node for maintenance") says: cordon and
# drain the node (ublkd's DaemonSet pods stay, the claim's pod goes), its volume stays with its
# data, uncordon, and a new pod on the claim reads what the old one wrote.
s_drain() {
    pvc r-data ublkd-ram 64Mi
    pod p-r r-data
    in_pod p-r 'echo before-the-drain >/data/f && sync'
    vol=$(volume_of r-data)
    kubectl cordon "$NODE"
    kubectl drain "$NODE" --ignore-daemonsets --delete-emptydir-data --force --timeout=300s
    gone() { ! kubectl get pod p-r >/dev/null 2>&1; }
    wait_for 300 gone || fail "the drain left p-r"
    ublkctl get-volume "$vol" | grep -q "^state: *ready$" || fail "the volume $vol is not ready after the drain"
    [ "$(kubectl -n ublkd-system get pods -l app.kubernetes.io/name=ublkd --no-headers | wc -l)" = 1 ] ||
        fail "the drain took ublkd's pod"
    kubectl uncordon "$NODE"
    pod p-r2 r-data
    got=$(in_pod p-r2 'cat /data/f')
    [ "$got" = before-the-drain ] || fail "the claim's data after the drain is '$got'"
    kubectl delete pod p-r2 --wait=true
    kubectl delete pvc r-data --wait=true
}

# A pod stuck in ContainerCreating, looked at as docs/kubernetes.md ("Troubleshooting") says: a
# PV naming a volume this node's ublkd does not have (as one deleted by hand would), so the
# pod's volume can never be staged. `kubectl describe pod` shows the mount error and the node
# plugin's log the reason, with the volume's name.
s_stuck() {
    kubectl apply -f - <<EOP
apiVersion: v1
kind: PersistentVolume
metadata: {name: stuck-pv}
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  persistentVolumeReclaimPolicy: Retain
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: stuck}
  csi: {driver: ublkd.io, volumeHandle: stuck-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [$NODE]}]}]
EOP
    claim stuck ublkd-ram 64Mi "volumeName: stuck-pv"
    start_pod p-stuck stuck
    mount_failed() { kubectl describe pod p-stuck | grep -q 'FailedMount'; }
    wait_for 300 mount_failed || { kubectl describe pod p-stuck | tail -20; fail "no FailedMount event on p-stuck"; }
    kubectl describe pod p-stuck | tail -8
    reason=$(kubectl get pod p-stuck -o jsonpath='{.status.containerStatuses[0].state.waiting.reason}')
    [ "$reason" = ContainerCreating ] || fail "p-stuck is waiting in '$reason', not ContainerCreating"
    kubectl describe pod p-stuck | grep FailedMount | grep -q 'stuck-vol' ||
        fail "the mount error does not name the volume"
    kubectl -n ublkd-system logs ds/ublkd-csi-node -c ublkd-csi | grep 'stuck-vol' | tail -3
    kubectl -n ublkd-system logs ds/ublkd-csi-node -c ublkd-csi | grep -q 'call refused.*stuck-vol' ||
        fail "the node plugin's log does not say why stuck-vol cannot be staged"
    kubectl -n ublkd-system logs ds/ublkd -c ublkd | tail -3
    kubectl delete pod p-stuck --wait=true --timeout=120s
    kubectl delete pvc stuck --wait=true
    kubectl delete pv stuck-pv --wait=true
}

# Node loss (docs/kubernetes.md, "Retire a node"): a StatefulSet's pod on node B, B deleted,
# and the pod comes up on this node with a new volume. Node B is a Node object without a
# kubelet (two kubelets on one guest would need two containerds, mount namespaces and cgroup
# roots: a kubelet kills the pods of a shared containerd it does not know). Its volume is a
# real ublkd volume on this node standing in for B's, named by a PersistentVolume whose
# topology is B, as the provisioner writes them (its finalizer too). Deleted, B is not lost
# yet (NotReady for less than the chart's 5 minutes): the controller keeps everything and
# says why in an Event. Marked lost (the annotation ublkd.io/node-lost), it must set the PV to
# Retain, delete the claim and the PV and leave the volume: afterwards `kubectl ublkd orphans`
# lists it.
LOST=ublkd-vm-lost
s_node_loss() {
    kubectl apply -f - <<EON
apiVersion: v1
kind: Node
metadata:
  name: $LOST
  labels: {kubernetes.io/hostname: $LOST, kubernetes.io/os: linux, ublkd.io/node: $LOST}
EON
    # room for pods, as a kubelet would report it (the scheduler fits none on a Node without)
    kubectl patch node "$LOST" --subresource=status --type=merge \
        -p '{"status":{"capacity":{"cpu":"2","memory":"2Gi","pods":"10"},"allocatable":{"cpu":"2","memory":"2Gi","pods":"10"}}}'
    wait_for 120 finalized "$LOST" || fail "the controller put no finalizer on $LOST"
    ublkctl create-volume lost-vol --size 64MiB --backend ram
    kubectl apply -f - <<EOP
apiVersion: v1
kind: PersistentVolume
metadata:
  name: lost-pv
  annotations: {pv.kubernetes.io/provisioned-by: ublkd.io}
  finalizers: [kubernetes.io/pv-protection, external-provisioner.volume.kubernetes.io/finalizer]
spec:
  capacity: {storage: 64Mi}
  accessModes: [ReadWriteOnce]
  # Delete, as the provisioner makes them: the controller sets it to Retain before it deletes
  # the claim, so that no provisioner deletes the volume (it stands in for B's on this node);
  # a PV that was Retain already it would leave alone.
  persistentVolumeReclaimPolicy: Delete
  storageClassName: ublkd-ram
  claimRef: {namespace: default, name: data-lost-0}
  csi: {driver: ublkd.io, volumeHandle: lost-vol, fsType: ext4}
  nodeAffinity:
    required:
      nodeSelectorTerms: [{matchExpressions: [{key: ublkd.io/node, operator: In, values: [$LOST]}]}]
EOP
    kubectl apply -f - <<EOS
apiVersion: apps/v1
kind: StatefulSet
metadata: {name: lost}
spec:
  serviceName: lost
  replicas: 1
  selector: {matchLabels: {app: lost}}
  template:
    metadata: {labels: {app: lost}}
    spec:
      terminationGracePeriodSeconds: 1
      # node B has no kubelet: the node lifecycle controller taints it unreachable
      tolerations: [{operator: Exists}]
      containers:
        - name: app
          image: ublkd.test/busybox:test
          command: ["/bin/sh", "-c", "trap 'exit 0' TERM; while :; do sleep 1; done"]
          volumeMounts: [{name: data, mountPath: /data}]
  volumeClaimTemplates:
    - metadata: {name: data}
      spec:
        accessModes: [ReadWriteOnce]
        storageClassName: ublkd-ram
        resources: {requests: {storage: 64Mi}}
EOS
    on_node() { [ "$(kubectl get pod lost-0 -o jsonpath='{.spec.nodeName}')" = "$1" ]; }
    wait_for 300 on_node "$LOST" || { kubectl describe pod lost-0 | tail -20; fail "lost-0 was not scheduled to $LOST"; }
    [ "$(kubectl get pvc data-lost-0 -o jsonpath='{.spec.volumeName}')" = lost-pv ] || fail "data-lost-0 is not bound to lost-pv"
    # B's kubelet "stops" now: Ready Unknown from this moment (the node lifecycle controller
    # keeps the time of a condition already Unknown), and B has no Lease.
    t=$(date -u +%Y-%m-%dT%H:%M:%SZ)
    kubectl patch node "$LOST" --subresource=status -p "{\"status\":{\"conditions\":[{\"type\":\"Ready\",\"status\":\"Unknown\",\"reason\":\"NodeStatusUnknown\",\"message\":\"the test's lost node\",\"lastHeartbeatTime\":\"$t\",\"lastTransitionTime\":\"$t\"}]}}"
    echo "lost-0 on $LOST with lost-pv; deleting the node"
    kubectl delete node "$LOST" --wait=false
    # NotReady for seconds, not the 5 minutes of nodeLoss.lostAfter: kept, and said so
    wait_for 120 node_event "$LOST" NodeNotReadyTooShort || {
        node_events "$LOST"
        kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=30
        fail "no NodeNotReadyTooShort Event on $LOST"
    }
    node_events "$LOST"
    finalized "$LOST" || fail "the controller let $LOST go before it was lost"
    [ "$(kubectl get pvc data-lost-0 -o jsonpath='{.spec.volumeName}')" = lost-pv ] || fail "data-lost-0 was released before $LOST was lost"
    [ "$(kubectl get pv lost-pv -o jsonpath='{.spec.persistentVolumeReclaimPolicy}')" = Delete ] || fail "lost-pv was touched before $LOST was lost"
    # the operator says the machine is gone
    kubectl annotate node "$LOST" ublkd.io/node-lost=true
    nodegone() { ! kubectl get node "$LOST" >/dev/null 2>&1; }
    wait_for 300 nodegone || {
        node_events "$LOST"
        kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=30
        fail "$LOST was not released once marked lost"
    }
    kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=20
    node_events "$LOST"
    node_event "$LOST" NodeReleased || fail "no NodeReleased Event on $LOST"
    # The pod goes when its node has gone (the pod GC), the claim with it, and the StatefulSet
    # makes both again: scheduled here, provisioned here.
    moved() { on_node "$NODE" && kubectl wait --for=condition=Ready pod/lost-0 --timeout=5s; }
    wait_for 600 moved || {
        kubectl describe pod lost-0 | tail -20
        kubectl describe pvc data-lost-0 | tail -15
        kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=30
        fail "lost-0 did not come up on $NODE"
    }
    pvgone() { ! kubectl get pv lost-pv >/dev/null 2>&1; }
    wait_for 120 pvgone || { kubectl get pv lost-pv -o yaml | tail -30; fail "lost-pv outlived its node"; }
    new=$(volume_of data-lost-0)
    echo "lost-0 Ready on $NODE with volume $new"
    { [ -n "$new" ] && [ "$new" != lost-vol ]; } || fail "lost-0 came back on the old volume ($new)"
    in_pod lost-0 'echo moved >/data/f && sync'
    # the lost node's volume is never deleted from the cluster: an orphan to decide on
    ublkctl get-volume lost-vol | grep -q "^state: *ready$" || fail "lost-vol was deleted or is not ready"
    out=$(kubectl ublkd orphans)
    echo "$out"
    echo "$out" | grep -q "$NODE *volume without PV *lost-vol" || fail "kubectl ublkd orphans does not list lost-vol"
    # and the node's own report: the driver tells ublkd (every 15 s here, after two lists in a row),
    # ublkd shows it in `ublkctl orphans` and its metric
    reported() { ublkctl orphans | grep -qx 'lost-vol'; }
    wait_for 300 reported || { ublkctl orphans; fail "ublkctl orphans does not list lost-vol"; }
    ublkctl orphans
    ip=$(kubectl -n ublkd-system get pod -l app.kubernetes.io/name=ublkd -o jsonpath='{.items[0].status.podIP}')
    n=$(curl -fsS "http://$ip:9580/metrics" | awk '$1 == "ublkd_volumes_without_pv" { print $2 }')
    echo "ublkd_volumes_without_pv $n"
    [ "${n:-0}" -ge 1 ] || fail "ublkd_volumes_without_pv is '$n', not 1 or more"
    kubectl delete statefulset lost --wait=true
    kubectl delete pvc data-lost-0 --wait=true
    ublkctl delete-volume lost-vol
}

# A deleted Node is not a lost one (docs/kubernetes.md, "Retire a node"): the Node object of
# this, the running node, deleted with one claim in use by a pod and one bound but unused.
# The controller's finalizer holds the Node (Terminating) and its kubelet keeps renewing its
# Lease, so nothing may be released: after looks enough for a provisioner to have deleted a
# released volume, both claims (the same uids), both PVs (still Delete) and both ublkd
# volumes are there, the pod still reads its data, and an Event on the Node says why. Then
# the Node is given back as the document says (the finalizer off, the kubelet restarted,
# which registers it again) and, a minute after, nothing is released either.
s_node_alive() {
    # file volumes: should the pod garbage collector restart ublkd while the Node is away,
    # they are its registry's, taken back at start
    pvc a-used ublkd-file 64Mi
    pvc a-idle ublkd-file 64Mi
    pod p-alive a-used
    in_pod p-alive 'echo alive >/data/f && sync'
    # bound by a pod of its own (WaitForFirstConsumer), then unused
    pod p-alive-idle a-idle
    kubectl delete pod p-alive-idle --wait=true
    uid_used=$(kubectl get pvc a-used -o jsonpath='{.metadata.uid}')
    uid_idle=$(kubectl get pvc a-idle -o jsonpath='{.metadata.uid}')
    pv_used=$(kubectl get pvc a-used -o jsonpath='{.spec.volumeName}')
    pv_idle=$(kubectl get pvc a-idle -o jsonpath='{.spec.volumeName}')
    vol_used=$(volume_of a-used)
    vol_idle=$(volume_of a-idle)
    echo "in use: a-used $uid_used $pv_used $vol_used; unused: a-idle $uid_idle $pv_idle $vol_idle"
    { [ -n "$vol_used" ] && [ -n "$vol_idle" ]; } || fail "both claims bound to a volume"
    finalized "$NODE" || fail "no finalizer ublkd.io/node on $NODE before its deletion"
    node_uid=$(kubectl get node "$NODE" -o jsonpath='{.metadata.uid}')
    # nothing released: the claims, their PVs as the provisioner made them, the volumes
    intact() {
        [ "$(kubectl get pvc a-used -o jsonpath='{.metadata.uid} {.status.phase}')" = "$uid_used Bound" ] ||
            fail "a-used (in use) was deleted or unbound"
        [ "$(kubectl get pvc a-idle -o jsonpath='{.metadata.uid} {.status.phase}')" = "$uid_idle Bound" ] ||
            fail "a-idle (unused) was deleted or unbound"
        for pv in "$pv_used" "$pv_idle"; do
            got=$(kubectl get pv "$pv" -o jsonpath='{.spec.persistentVolumeReclaimPolicy} {.metadata.deletionTimestamp}')
            [ "$got" = "Delete " ] || fail "$pv was deleted or changed ('$got')"
        done
        vols=$(ublkctl list-volumes)
        for v in "$vol_used" "$vol_idle"; do
            echo "$vols" | grep -q "$v" || { echo "$vols"; fail "ublkd's volume $v disappeared"; }
        done
        if node_event "$NODE" NodeReleased; then
            node_events "$NODE"
            fail "the controller released the running node"
        fi
    }
    kubectl delete node "$NODE" --wait=false
    [ -n "$(kubectl get node "$NODE" -o jsonpath='{.metadata.deletionTimestamp}')" ] ||
        fail "$NODE went at once: its finalizer did not hold it"
    wait_for 120 node_event "$NODE" NodeLeaseRenewed || {
        node_events "$NODE"
        kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=30
        fail "no NodeLeaseRenewed Event on $NODE"
    }
    node_events "$NODE"
    # The controller looks every 10 s here (tests/k8s/values.yaml): two more looks. In issue
    # 38 the node's provisioner deleted the volumes of the released PVs within seconds.
    sleep 25
    intact
    [ "$(in_pod p-alive 'cat /data/f')" = alive ] || fail "p-alive lost its data while its Node was Terminating"
    n=$(kubectl get events -A --field-selector "involvedObject.kind=Node,involvedObject.name=$NODE,reason=NodeLeaseRenewed" \
        -o jsonpath='{range .items[*]}{.count}{"\n"}{end}' | awk '{ n += ($1 > 0 ? $1 : 1) } END { print n + 0 }')
    echo "NodeLeaseRenewed posted $n time(s) over 25 s of looks"
    [ "$n" -le 1 ] || fail "the same decision was posted $n times, not once"
    echo "nothing released while $NODE was Terminating; giving it back"
    # shellcheck disable=SC2016 # a patch directive, not a variable
    kubectl patch node "$NODE" -p '{"metadata":{"$deleteFromPrimitiveList/finalizers":["ublkd.io/node"]}}'
    # gone, or registered again already by a kubelet that does so on its own
    replaced() { [ "$(kubectl get node "$NODE" -o jsonpath='{.metadata.uid}' 2>/dev/null)" != "$node_uid" ]; }
    wait_for 120 replaced || fail "$NODE stayed after its finalizer was taken off"
    old=$(cat /run/kubelet.pid)
    kill "$old"
    wait_for 30 sh -c "! kill -0 $old" || fail "the kubelet did not stop"
    # kubelet_service starts it again, as systemd would; it registers the Node at start
    wait_for 600 node_ready || fail "the kubelet did not register $NODE again"
    registered() { kubectl get csinode "$NODE" -o jsonpath='{.spec.drivers[*].name}' | grep -qw ublkd.io; }
    wait_for 300 registered || fail "the driver is not registered on the new $NODE"
    wait_for 300 finalized "$NODE" || fail "the controller put no finalizer on the new $NODE"
    wait_for 600 all_ready || { kubectl -n ublkd-system get pods -o wide; fail "the driver's pods are not Ready again"; }
    echo "$NODE registered again; one more look"
    sleep 12
    intact
    node_events "$NODE"
    kubectl -n ublkd-system logs deploy/ublkd-csi-controller --tail=10
    kubectl delete pod p-alive --wait=true --ignore-not-found
    kubectl delete pvc a-used a-idle --wait=true
}

# Uninstall as docs/kubernetes.md ("Uninstall") says, last: every claim deleted first (with
# whatever pods a failed scenario left), then helm uninstall; the driver's objects, pods and devices are gone, the namespace is left.
s_uninstall() {
    # what a failed scenario left behind goes first, as a user would delete their workloads
    kubectl delete pod --all --namespace default --wait=true --timeout=300s
    kubectl delete pvc --all --namespace default --wait=true --timeout=300s
    left=$(kubectl get pvc -A --no-headers 2>/dev/null | wc -l)
    [ "$left" = 0 ] || { kubectl get pvc -A; fail "claims left before the uninstall"; }
    helm uninstall ublkd --namespace ublkd-system --wait --timeout 600s
    # the pre-delete hook took the controller's finalizer off the node
    finalized "$NODE" &&
        fail "the finalizer ublkd.io/node outlived the uninstall"
    # the kubectl users' step for the same (docs/kubernetes.md, "Uninstall"), on a finalizer
    # put back by hand
    kubectl patch node "$NODE" --type=merge -p '{"metadata":{"finalizers":["ublkd.io/node"]}}'
    # shellcheck disable=SC2016 # a patch directive, not a variable
    kubectl patch node "$NODE" -p '{"metadata":{"$deleteFromPrimitiveList/finalizers":["ublkd.io/node"]}}'
    finalized "$NODE" &&
        fail "the documented patch left the finalizer on $NODE"
    [ -z "$(kubectl get csidriver ublkd.io --ignore-not-found -o name)" ] || fail "the CSIDriver outlived the uninstall"
    kubectl get storageclass -o name | grep -q ublkd && fail "a StorageClass outlived the uninstall"
    nopods() { [ "$(kubectl -n ublkd-system get pods --no-headers 2>/dev/null | wc -l)" = 0 ]; }
    wait_for 300 nopods || { kubectl -n ublkd-system get pods; fail "ublkd's pods outlived the uninstall"; }
    # shellcheck disable=SC2012 # names to count
    n=$(ls /dev/ublkb* 2>/dev/null | wc -l)
    [ "$n" = 0 ] || { ls -la /dev/ublk*; fail "$n ublk devices outlived the uninstall"; }
    kubectl delete namespace ublkd-system --wait=true --timeout=300s
}

run driver s_driver
run file-ext4 s_file_ext4
run ram s_ram
run nvme-xfs s_nvme_xfs
# Light pairs only. All five of the lines above and this one at once saturated the guest's two
# CPUs for 680 s in one boot (280 s in another), long enough for the node plugin's liveness
# probe to time out (10 s), a warning the warnings scenario then rightly refused.
together block pending
# monitoring fills the file pool; plugin's volumes are RAM, its orphans its own.
together monitoring plugin
run snapshots s_snapshots
run warnings s_warnings
run modify s_modify
run ublkd-restart s_ublkd_restart
run kubelet-restart s_kubelet_restart
run drain s_drain
run stuck s_stuck
run node-loss s_node_loss
# deletes and re-registers this node: after every scenario that needs it untouched
run node-alive s_node_alive
run uninstall s_uninstall

# The pods' own logs, kept on every run (the registrar's or a sidecar's restart says why only
# there); the run directory is the host's.
cp -r /var/log/pods "$L/pods" 2>/dev/null || say "the pods' logs could not be kept"
failed=0
[ -e "$L/failed-scenarios" ] && failed=$(wc -l <"$L/failed-scenarios")
say "done: $failed failed"
exit "$failed"
