# shellcheck shell=sh
# The Kubernetes tier's control plane, on the host (`cargo xtask k8s-test`), inside the tier's
# own network namespace: one CA and the certificates and kubeconfigs of every component, then
# etcd, kube-apiserver, kube-controller-manager, kube-scheduler and the cluster's DNS.
#
# Why here and not in the guest: under emulation on a 2-core host the control plane kept the
# guest's vCPUs so busy that the API server missed its clients' 10 s timeouts and the node never
# became Ready (CI, stop 29: 1084 s, then exit 100). A cluster's control plane is other machines
# than its nodes anyway; here it is the host, natively, and the guest is the one node, with the
# real kernel driver, its kubelet, containerd and the driver's pods.
#
# The network (the namespace has only its loopback): the guest reaches this side at 10.0.2.2
# (QEMU's user network: the API server on :6443, the DNS on :53), and this side reaches the
# kubelet at the node's address, 10.10.0.1:10250, which the namespace holds on its loopback and
# QEMU forwards into the guest.
#
# The guest's kubectl runs here too (`serve_kubectl`): under emulation each kubectl process cost
# the guest seconds of CPU, and the scenarios' waits run one after another, taking the vCPUs
# from the pods they wait for. The guest writes a request into the shared run directory and
# reads the answer.
#
# From the harness, in the environment: K8S_BIN (kube binaries), K8S_DEBS (etcd), K8S_COREDNS,
# K8S_PKI (the directory for certificates and kubeconfigs), K8S_LOGS (the logs' directory),
# K8S_KUBECTL (the requests' directory), K8S_HELM (helm, for the guest's requests),
# K8S_PLUGINS (a directory with kubectl-ublkd, on the guest's kubectl's PATH).
# `control.sh pki` makes the certificates and returns; `control.sh start` runs the components until it is killed (its process group).
set -u
B=$K8S_BIN
P=$K8S_PKI
L=$K8S_LOGS
NODE=ublkd-vm
NODE_IP=10.10.0.1
HOST_IP=10.0.2.2
mkdir -p "$P" "$L"

# EC P-256 keys: the guest's TLS handshakes are emulated, and EC is far cheaper there than RSA.
key() { openssl ecparam -name prime256v1 -genkey -noout -out "$P/$1.key" 2>/dev/null; }
cert() { # NAME SUBJECT [SUBJECT-ALT-NAMES]
    key "$1"
    openssl req -new -key "$P/$1.key" -subj "$2" -out "$P/$1.csr" || return 1
    {
        echo "basicConstraints=CA:FALSE"
        echo "keyUsage=digitalSignature,keyEncipherment"
        echo "extendedKeyUsage=serverAuth,clientAuth"
        [ -n "${3:-}" ] && echo "subjectAltName=$3"
    } >"$P/$1.ext"
    openssl x509 -req -in "$P/$1.csr" -CA "$P/ca.crt" -CAkey "$P/ca.key" -CAcreateserial \
        -days 7 -sha256 -extfile "$P/$1.ext" -out "$P/$1.crt" 2>/dev/null
}
kubeconfig() { # NAME SERVER-ADDRESS [FILE-NAME: NAME's certificate under another name]
    f=$P/${3:-$1}.conf
    "$B/kubectl" config --kubeconfig="$f" set-cluster test --server="https://$2:6443" \
        --certificate-authority="$P/ca.crt" --embed-certs >/dev/null &&
        "$B/kubectl" config --kubeconfig="$f" set-credentials "$1" --client-certificate="$P/$1.crt" \
            --client-key="$P/$1.key" --embed-certs >/dev/null &&
        "$B/kubectl" config --kubeconfig="$f" set-context test --cluster=test --user="$1" >/dev/null &&
        "$B/kubectl" config --kubeconfig="$f" use-context test >/dev/null
}

pki() {
    key ca
    openssl req -x509 -new -key "$P/ca.key" -sha256 -days 7 -subj "/CN=ublkd-test-ca" \
        -out "$P/ca.crt" || return 1
    cert apiserver "/CN=kube-apiserver" \
        "DNS:kubernetes,DNS:kubernetes.default,DNS:kubernetes.default.svc,DNS:kubernetes.default.svc.cluster.local,DNS:localhost,IP:127.0.0.1,IP:10.96.0.1,IP:$HOST_IP,IP:$NODE_IP" &&
        cert admin "/O=system:masters/CN=kubernetes-admin" &&
        cert controller-manager "/CN=system:kube-controller-manager" &&
        cert scheduler "/CN=system:kube-scheduler" &&
        cert kubelet "/O=system:nodes/CN=system:node:$NODE" &&
        cert kube-proxy "/CN=system:kube-proxy" &&
        cert apiserver-kubelet-client "/O=system:masters/CN=kube-apiserver-kubelet-client" &&
        # the kubelet's serving certificate (EC: it would make itself an RSA one)
        cert kubelet-serving "/CN=$NODE" "DNS:$NODE,IP:$NODE_IP" &&
        # the modify scenario's remote access (deploy/csi/README.md): ublkd's server
        # certificate for its Service's name, and the resizer's client certificate
        cert ublkd-grpc "/CN=ublkd-grpc.ublkd-system.svc" \
            "DNS:ublkd-grpc.ublkd-system.svc,DNS:ublkd-grpc.ublkd-system.svc.cluster.local" &&
        cert ublkd-csi-resizer "/CN=ublkd-csi-resizer" "URI:urn:ublkd:role:modify" || return 1
    key sa
    openssl ec -in "$P/sa.key" -pubout -out "$P/sa.pub" 2>/dev/null || return 1
    # this side's components on the loopback; the node's through QEMU's address for the host
    for c in controller-manager scheduler; do kubeconfig "$c" 127.0.0.1 || return 1; done
    kubeconfig admin 127.0.0.1 admin-host || return 1
    for c in admin kubelet kube-proxy; do kubeconfig "$c" "$HOST_IP" || return 1; done
}

# The guest's kubectl and helm requests (guest.sh's kubectl and helm): NAME.args (the tool,
# kubectl or helm, then its arguments, NUL-separated) and NAME.stdin, where it has one; the
# answer NAME.out, NAME.err and, last, NAME.rc. Each request runs in the background: a
# `kubectl wait` holds up no other. Both tools use the admin's kubeconfig.
serve_kubectl() {
    Q=$K8S_KUBECTL
    mkdir -p "$Q"
    while :; do
        for r in "$Q"/*.args; do
            [ -e "$r" ] || continue
            n=${r%.args}
            mv "$r" "$n.run" || continue
            t0=$(($(date +%s%N) / 1000000))
            (
                in=/dev/null
                [ -e "$n.stdin" ] && in=$n.stdin
                # the tool's own status (xargs would fold every failure into 123)
                # shellcheck disable=SC2016 # expanded by the inner sh
                RC=$n.rc.tmp xargs -0 -a "$n.run" sh -c '
                    tool=$1
                    shift
                    case $tool in
                        # KUBECONFIG rather than --kubeconfig: kubectl looks for a plugin
                        # (kubectl ublkd) only when no flag comes before its name.
                        kubectl) KUBECONFIG=$K8S_PKI/admin-host.conf PATH=$K8S_PLUGINS:$PATH \
                            "$K8S_BIN/kubectl" "$@" ;;
                        helm) "$K8S_HELM" --kubeconfig="$K8S_PKI/admin-host.conf" "$@" ;;
                        *) echo "control.sh: no tool $tool" >&2; false ;;
                    esac
                    echo $? >"$RC"' request <"$in" >"$n.out" 2>"$n.err"
                [ -s "$n.rc.tmp" ] || echo 125 >"$n.rc.tmp"
                mv "$n.rc.tmp" "$n.rc"
                # how long each request took here, against the guest's view in its scenario log
                echo "$(date +%s.%N | cut -c1-14) $(($(date +%s%N) / 1000000 - t0)) ms: $(tr '\0' ' ' <"$n.run" | cut -c1-120)" >>"$L/requests.log"
            ) &
        done
        sleep 0.05
    done
}

start() {
    ip link set lo up || exit 1
    ip addr add "$NODE_IP/32" dev lo || exit 1
    # Connections to the node leave from the loopback's 127.0.0.1, which QEMU shows the guest as
    # its host, 10.0.2.2. From the node's own address (the default source for a local
    # destination) the guest would answer itself, and the API server's TLS handshake with the
    # kubelet timed out (every exec and logs request).
    ip route replace local "$NODE_IP" dev lo proto kernel scope host src 127.0.0.1 table local ||
        exit 1
    "$K8S_DEBS/usr/bin/etcd" --data-dir "$K8S_PKI/../etcd" --unsafe-no-fsync \
        --listen-client-urls http://127.0.0.1:2379 --advertise-client-urls http://127.0.0.1:2379 \
        --listen-peer-urls http://127.0.0.1:2380 >"$L/etcd.log" 2>&1 &
    # The node is reached at its InternalIP (its host name resolves only in the guest).
    "$B/kube-apiserver" --etcd-servers=http://127.0.0.1:2379 --advertise-address="$HOST_IP" \
        --secure-port=6443 --tls-cert-file="$P/apiserver.crt" --tls-private-key-file="$P/apiserver.key" \
        --client-ca-file="$P/ca.crt" --service-account-key-file="$P/sa.pub" \
        --service-account-signing-key-file="$P/sa.key" \
        --service-account-issuer=https://kubernetes.default.svc \
        --service-cluster-ip-range=10.96.0.0/16 --authorization-mode=Node,RBAC \
        --enable-admission-plugins=NodeRestriction --allow-privileged=true \
        --kubelet-client-certificate="$P/apiserver-kubelet-client.crt" \
        --kubelet-client-key="$P/apiserver-kubelet-client.key" \
        --kubelet-preferred-address-types=InternalIP \
        --runtime-config=storage.k8s.io/v1beta1=true >"$L/kube-apiserver.log" 2>&1 &
    n=0
    until "$B/kubectl" --kubeconfig="$P/admin-host.conf" get --raw /readyz >/dev/null 2>&1; do
        n=$((n + 1))
        if [ "$n" -ge 300 ]; then
            echo "control.sh: the API server was not ready in 300 s" >>"$L/kube-apiserver.log"
            break
        fi
        sleep 1
    done
    # One of each: no leader election. node-ipam is off: the pod subnet is the CNI's.
    "$B/kube-controller-manager" --kubeconfig="$P/controller-manager.conf" --leader-elect=false \
        --use-service-account-credentials --service-account-private-key-file="$P/sa.key" \
        --root-ca-file="$P/ca.crt" --cluster-signing-cert-file="$P/ca.crt" \
        --cluster-signing-key-file="$P/ca.key" --controllers='*,-nodeipam' \
        >"$L/kube-controller-manager.log" 2>&1 &
    "$B/kube-scheduler" --kubeconfig="$P/scheduler.conf" --leader-elect=false \
        >"$L/kube-scheduler.log" 2>&1 &
    # The cluster's DNS (the kubelet's clusterDNS is this side's address): Service and pod names
    # from the API, nothing forwarded.
    cat >"$P/Corefile" <<EOC
cluster.local:53 in-addr.arpa:53 ip6.arpa:53 {
    bind 127.0.0.1
    errors
    cache 30
    kubernetes cluster.local in-addr.arpa ip6.arpa {
        kubeconfig $P/admin-host.conf test
        pods insecure
    }
}
EOC
    "$K8S_COREDNS" -conf "$P/Corefile" >"$L/coredns.log" 2>&1 &
    serve_kubectl
}

case ${1:-} in
    pki) pki ;;
    start) start ;;
    *)
        echo "usage: control.sh pki|start" >&2
        exit 2
        ;;
esac
