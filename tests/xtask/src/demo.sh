# shellcheck shell=bash
# The guest side of `cargo xtask demo` (run with `bash -s`: /dev/tcp below needs bash): ublkd as a
# node service, driven by ublkctl, then the Kubernetes CSI driver in front of it.
# UBLKD, UBLKCTL and UBLKD_CSI are set by the harness to the workspace's binaries.
set -e
D=$TMPDIR/ublkd-demo
mkdir -p "$D/volumes" "$D/mnt"
ctl() { echo "\$ ublkctl $*"; "$UBLKCTL" --endpoint "unix://$D/ublkd.sock" "$@"; }
device_of() {
    "$UBLKCTL" --endpoint "unix://$D/ublkd.sock" get-volume "$1" -o json |
        sed -n 's/.*"device_path": *"\([^"]*\)".*/\1/p'
}

echo "== guest kernel $(uname -r); what its ublk driver offers:"
"$UBLKD" probe

cat > "$D/ublkd.toml" <<CONFIG
state_dir = "$D/state"
allowed_roots = ["$D/volumes"]
[grpc]
listen = ["unix://$D/ublkd.sock"]
[metrics]
listen = "127.0.0.1:9580"
CONFIG
echo "== starting ublkd (config $D/ublkd.toml)"
"$UBLKD" --config "$D/ublkd.toml" 2> "$D/ublkd.log" &
pid=$!
for _ in $(seq 100); do [ -S "$D/ublkd.sock" ] && break; sleep 0.1; done
sleep 0.5
ctl node-info
ctl create-volume scratch --size 256MiB --backend null
ctl create-volume cache --size 512MiB --backend ram --queues 2
ctl create-volume data --size 256MiB --backend "file+create:$D/volumes/data.img"

DEV=$(device_of data)
echo "== ext4 on the file volume $DEV"
mkfs.ext4 -q -F "$DEV"
mount "$DEV" "$D/mnt"
echo "hello from ublkd" > "$D/mnt/hello.txt"
sync
cat "$D/mnt/hello.txt"
df -h "$D/mnt" | tail -1
umount "$D/mnt"

CDEV=$(device_of cache)
echo "== fio: 3 s of 4k random reads at QD32 on the RAM volume $CDEV"
fio --name=demo --filename="$CDEV" --ioengine=io_uring --direct=1 --rw=randread --bs=4k \
    --iodepth=32 --runtime=3 --time_based 2>&1 | grep -E "IOPS=|clat \(usec\): min" | head -2
ctl resize-volume cache --size 1GiB

if [ -c /dev/ng0n1 ]; then
    echo "== NVMe passthrough: a 256 MiB window of /dev/ng0n1 (zero copy; poll = auto says why it polls or not)"
    ctl create-volume fast --size 256MiB --backend "nvme:/dev/ng0n1@0+256MiB"
    ctl get-volume fast | grep -E "backend|zero copy|poll"
    NDEV=$(device_of fast)
    fio --name=demo --filename="$NDEV" --ioengine=io_uring --direct=1 --rw=randread --bs=4k \
        --iodepth=32 --runtime=3 --time_based 2>&1 | grep -E "IOPS=" | head -1
fi
ctl list-volumes
ctl stats cache

echo "== metrics excerpt (http://127.0.0.1:9580/metrics)"
exec 3<>/dev/tcp/127.0.0.1/9580
printf 'GET /metrics HTTP/1.0\r\n\r\n' >&3
grep -E '^ublkd_(volume_io_ops_total|volume_info|volume_size_bytes|worker_busy)' <&3 |
    grep -v ' 0$' | head -18 || true
exec 3>&-

echo "== Kubernetes CSI: ublkd-csi in front of this ublkd, called as the provisioner and kubelet would"
K=$D/kubelet
mkdir -p "$K"
"$UBLKD_CSI" --csi-endpoint "unix://$D/csi.sock" --ublkd "unix://$D/ublkd.sock" \
    --node-id demo-node --kubelet-dir "$K" 2> "$D/csi.log" &
cpid=$!
for _ in $(seq 100); do [ -S "$D/csi.sock" ] && break; sleep 0.1; done
csi() { echo "\$ ublkd-csi ctl $*" >&2; "$UBLKD_CSI" ctl --csi-endpoint "unix://$D/csi.sock" "$@"; }
FILE_CLASS=(--param backend=file --param "root=$D/volumes")
echo "capacity for the file class: $(csi capacity "${FILE_CLASS[@]}") bytes"
VOL=$(csi create pvc-demo --size 134217728 "${FILE_CLASS[@]}")
STAGE=$K/plugins/ublkd.io/globalmount/$VOL
TARGET=$K/pods/web/volumes/$VOL
csi stage "$VOL" "$STAGE"
csi publish "$VOL" "$STAGE" "$TARGET"
echo "written through the pod's mount" > "$TARGET/index.html"
df -h "$TARGET" | tail -1
echo "capacity now $(csi expand "$VOL" "$TARGET" --size 268435456) bytes; the file system grew online:"
df -h "$TARGET" | tail -1
csi stats "$VOL" "$TARGET"
csi unpublish "$VOL" "$TARGET"
csi unstage "$VOL" "$STAGE"
csi stage "$VOL" "$STAGE"
echo "after unstage and stage again: $(cat "$STAGE/index.html")"
csi unstage "$VOL" "$STAGE"
csi delete "$VOL"
ls "$D/volumes"
kill -TERM "$cpid"
wait "$cpid" || true

echo "== stopping ublkd (SIGTERM): on_exit = keep leaves the devices, quiesced, for the next ublkd"
kill -TERM "$pid"
wait "$pid"
ls /dev/ublkb* 2>/dev/null || echo "(no ublk block devices left)"
ls "$D/state/registry"
echo "== demo done"
