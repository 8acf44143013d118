#!/bin/sh
# The file backend at QD1 against loop, counted (docs/performance.md, "The file backend at QD1
# against loop, counted"). Runs in the guest, after a release build of ublkd:
#   cargo build --release -p ublkd-server
#   cargo xtask vm-run -- sh "$PWD/tests/perf/file-qd1-vs-loop.sh" [ROUNDS [SPIN_US...]]
# It formats the guest's NVMe namespace. For each of ROUNDS rounds (2): fio 4 KiB randread QD1 on a
# ublkd file volume (workers on shared CPUs; then one worker on a dedicated CPU, spinning and
# not, with QD32 too, for each spin listed (1000 and 0 microseconds)), then on loop with direct I/O
# over the same file; per I/O: context switches,
# NVMe interrupts and IPIs per CPU; each ublkd thread's switches; the backing file's open flags.
set -u
ROUNDS=${1:-2}
[ $# -gt 0 ] && shift
SPINS=${*:-1000 0}
W=$(cd "$(dirname "$0")/../.." && pwd)
B=/tmp/file-qd1
mkfs.ext4 -q -F /dev/nvme0n1 && mkdir -p "$B" && mount /dev/nvme0n1 "$B" || exit 1
dd if=/dev/zero of="$B/backing" bs=1M count=256 oflag=direct status=none || exit 1
# The host's disk serves the first reads of newly written blocks slowly: pay that now, not in
# the first job (see the bench's `prepare_backing`).
dd if=/dev/nvme0n1 of=/dev/null bs=1M iflag=direct status=none || exit 1
# "NAME@cpuN VALUE" for the context switches, and each CPU's RES, CAL and NVMe queue interrupts.
counters() {
    awk '/^ctxt/{print "ctxt", $2}' /proc/stat
    awk '$1=="RES:"||$1=="CAL:"||/nvme0q/{k=($1 ~ /^[0-9]+:$/) ? $NF : $1; print k "@cpu0", $2; print k "@cpu1", $3}' /proc/interrupts
}
job() { # DEVICE NAME [DEPTH [FIO_CPU]]
    sync
    echo 3 >/proc/sys/vm/drop_caches
    counters >/tmp/c0
    pin=""
    [ -n "${4:-}" ] && pin="taskset -c $4"
    $pin fio --name="$2" --filename="$1" --direct=1 --ioengine=io_uring --rw=randread --bs=4k \
        --iodepth="${3:-1}" --runtime=4 --time_based --size=200M --output-format=json >/tmp/out 2>/tmp/err ||
        { cat /tmp/err; exit 1; }
    counters >/tmp/c1
    ios=$(jq '.jobs[0].read.total_ios' /tmp/out)
    lat=$(jq '.jobs[0].read.clat_ns.mean / 1000 | floor' /tmp/out)
    iops=$(jq '.jobs[0].read.iops | floor' /tmp/out)
    echo "$2 QD${3:-1}${4:+ fio on cpu$4}, ended $(date +%s): $ios I/Os, $iops IOPS, mean completion latency $lat us"
    awk -v n="$ios" 'NR==FNR{a[$1]=$2; next} $2-a[$1] > 0 {printf "  %s: %.2f per I/O\n", $1, ($2-a[$1])/n}' /tmp/c0 /tmp/c1
}
serve() { # NAME FIO_CPU UBLKD_ARGS...: a ublkd file volume, QD1 (and QD32 when fio is pinned)
    name=$1 cpu=$2
    shift 2
    "$W/target/release/ublkd" run --size 268435456 --backend "file:$B/backing" --queues 2 --depth 128 \
        --io-path per-io --zero-copy on --poll off "$@" >/tmp/ublkd.log 2>&1 &
    pid=$!
    for _ in $(seq 100); do [ -b /dev/ublkb0 ] && break; sleep 0.2; done
    [ -b /dev/ublkb0 ] || { cat /tmp/ublkd.log; exit 1; }
    sleep 1
    job /dev/ublkb0 "$name" 1 "$cpu"
    for t in /proc/"$pid"/task/*; do
        echo "  thread $(cat "$t/comm"): $(grep -h voluntary_ctxt_switches "$t/status" | tr -s '\t\n' '  ')"
    done
    for f in /proc/"$pid"/fd/*; do
        case $(readlink "$f") in
            *backing) echo "  backing file $(grep flags "/proc/$pid/fdinfo/${f##*/}")" ;;
        esac
    done
    [ -n "$cpu" ] && job /dev/ublkb0 "$name" 32 "$cpu"
    kill -INT "$pid"
    wait "$pid"
    grep "worker" /tmp/ublkd.log | sed 's/^/  /'
}
rm -f /dev/ublkb0
for round in $(seq "$ROUNDS"); do
    echo "round $round"
    serve ublkd-file ""
    # The worker alone on CPU 1 (the dedicated model), fio on CPU 0, for each spin asked for.
    for spin in $SPINS; do
        serve "ublkd-file-dedicated-spin$spin" 0 --cpus 1 --dedicated-cpus --idle-spin-us "$spin"
    done
    lo=$(losetup --direct-io=on --show -f "$B/backing") || exit 1
    job "$lo" loop-dio
    job "$lo" loop-dio 1 0
    job "$lo" loop-dio 32 0
    losetup -d "$lo"
done
