# shellcheck shell=sh
# The shell functions of the bench's guest script (see guest.rs, which includes this file). The
# guest runs the script with /bin/sh (dash), so this is POSIX sh. The generated script sets, before
# this: RUNTIME (seconds per fio job), BACKING_BYTES, LOAD_CALLS, KUBLK, UBLKD and UBLKCTL (binaries, empty
# when missing), SOCK; and defines after it: run_workloads RUN DEVICE PIDS, qos_jobs (one qos_job
# per limit), then one line per case.
OUT="$UBLKD_VM_RUN"
HZ=$(getconf CLK_TCK)
FIO_ENGINE="--ioengine=io_uring --direct=1"
# 1 while ublkd_case runs the warm-up before an A/B group instead of the workloads.
WARMUP=0
note() { echo "bench: $*"; }
tail_of() { tail -n 5 "$1" 2>/dev/null | tr '\n' ' '; }

# Reads and writes completed by block device $1 (a name under /sys/block).
dev_ios() {
    awk '{ print $1 + $5 }' "/sys/block/$1/stat" 2>/dev/null || echo -
}

# Every CPU's busy time (user, nice, system, irq, softirq), in clock ticks: fio, the server
# and the kernel together, so that each case has a CPU cost per I/O, the kernel's peers too.
sys_ticks() {
    awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 }' /proc/stat
}

# utime + stime, in clock ticks, summed over the processes $1 (space-separated pids).
cpu_ticks() {
    [ -n "$1" ] || { echo none; return; }
    total=0
    for p in $1; do
        v=$(sed 's/^.*) //' "/proc/$p/stat" 2>/dev/null | awk '{ print $12 + $13 }')
        [ -n "$v" ] || { echo -; return; }
        total=$((total + v))
    done
    echo "$total"
}

# run_fio RUN DEVICE WORKLOAD RW QD PIDS BS JOBS (RW randrw: 70 % reads; JOBS reported together)
run_fio() {
    d="$OUT/$1"
    mix=""
    [ "$4" = randrw ] && mix="--rwmixread=70"
    blk=$(basename "$(readlink -f "$2")")
    ios0=$(dev_ios "$blk"); t0=$(cpu_ticks "$6"); s0=$(sys_ticks)
    # shellcheck disable=SC2086
    timeout -k 5 $((RUNTIME + 60)) fio --name="$3" --filename="$2" $FIO_ENGINE --bs="$7" --rw="$4" $mix --iodepth="$5" --numjobs="$8" --group_reporting --norandommap --time_based \
        --runtime="$RUNTIME" --ramp_time=1 --output-format=json --output="$d/$3.json" \
        > "$d/$3.log" 2>&1
    rc=$?
    s1=$(sys_ticks); t1=$(cpu_ticks "$6"); ios1=$(dev_ios "$blk")
    echo "$rc" > "$d/$3.rc"
    echo "$t0 $t1 $HZ $ios0 $ios1" > "$d/$3.counters"
    echo "$s0 $s1 $HZ $ios0 $ios1" > "$d/$3.syscounters"
    note "$1 $3: fio exit $rc, $(awk -v a="$ios0" -v b="$ios1" 'BEGIN { print b - a }') I/Os"
}

# Waits up to 10 s for block device $1 to appear.
wait_blk() {
    i=0
    while [ ! -b "$1" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    [ -b "$1" ]
}

# Waits up to $2 tenths of a second for file $1 to exist.
wait_file() {
    i=0
    while [ ! -e "$1" ] && [ $i -lt "$2" ]; do sleep 0.1; i=$((i + 1)); done
    [ -e "$1" ]
}

fail_case() {
    mkdir -p "$OUT/$1"
    echo "$2" > "$OUT/$1/error"
    note "$1: $2"
}

# stop_ublkd DIR PID [DEVICE]: SIGTERM, then wait for the exit and the device's removal.
stop_ublkd() {
    kill -TERM "$2" 2>/dev/null
    if ! wait_file "$1/exit" 300; then
        echo "did not exit within 30 s of SIGTERM (killed)" >> "$1/teardown_error"
        kill -KILL "$2" 2>/dev/null
        wait_file "$1/exit" 50
    elif [ "$(cat "$1/exit")" != 0 ]; then
        echo "exited with status $(cat "$1/exit") after SIGTERM: $(tail_of "$1/server.err")" \
            >> "$1/teardown_error"
    fi
    if [ -n "${3-}" ]; then
        i=0
        while [ -e "$3" ] && [ $i -lt 50 ]; do sleep 0.1; i=$((i + 1)); done
        [ -e "$3" ] && echo "$3 still exists after ublkd exited" >> "$1/teardown_error"
    fi
    return 0
}

# ublkd_case RUN ARGS...: start `ublkd run ARGS`, wait for READY, measure, stop.
ublkd_case() {
    run=$1; shift
    d="$OUT/$run"; mkdir -p "$d"
    note "$run: ublkd run $*"
    ( sh -c 'echo $$ > "$0/pid"; exec "$@"' "$d" "$UBLKD" run "$@" \
        > "$d/server.out" 2> "$d/server.err"
      rc=$?; echo "$rc" > "$d/exit.tmp"; mv "$d/exit.tmp" "$d/exit" ) &
    dev=""; i=0
    while [ $i -lt 600 ]; do
        dev=$(sed -n 's|^READY \(/dev/[^ ]*\).*|\1|p' "$d/server.out" 2>/dev/null | head -n 1)
        if [ -n "$dev" ] || [ -e "$d/exit" ]; then break; fi
        sleep 0.1; i=$((i + 1))
    done
    wait_file "$d/pid" 50
    pid=$(cat "$d/pid" 2>/dev/null)
    if [ -z "$dev" ]; then
        if [ -e "$d/exit" ]; then
            fail_case "$run" "ublkd exited with status $(cat "$d/exit") before READY: $(tail_of "$d/server.err")"
        else
            fail_case "$run" "ublkd printed no READY line within 60 s: $(tail_of "$d/server.err")"
            stop_ublkd "$d" "$pid"
        fi
        return
    fi
    if ! wait_blk "$dev"; then
        fail_case "$run" "ublkd said READY $dev, but that is no block device"
        stop_ublkd "$d" "$pid"
        return
    fi
    sleep 1
    cat "/proc/$pid/status" > "$d/status.idle" 2>/dev/null
    if [ "$WARMUP" = 1 ]; then
        # A warm-up before an A/B group: one job of randread QD32, measured by nobody.
        # shellcheck disable=SC2086
        timeout -k 5 $((RUNTIME + 60)) fio --name=warmup --filename="$dev" $FIO_ENGINE --bs=4k \
            --rw=randread --iodepth=32 --norandommap --time_based --runtime="$RUNTIME" \
            > "$d/warmup.log" 2>&1
        note "$run: warm-up fio exit $?"
    else
        run_workloads "$run" "$dev" "$pid"
    fi
    stop_ublkd "$d" "$pid" "$dev"
}

# kublk_case RUN ARGS...: `kublk add ARGS`, measure its daemon, `kublk del`.
kublk_case() {
    run=$1; shift
    d="$OUT/$run"; mkdir -p "$d"
    note "$run: kublk add $*"
    if ! timeout 60 "$KUBLK" add "$@" > "$d/server.out" 2> "$d/server.err"; then
        fail_case "$run" "kublk add $* failed: $(tail_of "$d/server.err")"
        return
    fi
    id=$(sed -n 's/^dev id \([0-9][0-9]*\):.*/\1/p' "$d/server.out" | head -n 1)
    pid=$(sed -n 's/.*daemon pid \([0-9][0-9]*\).*/\1/p' "$d/server.out" | head -n 1)
    if [ -z "$id" ] || [ -z "$pid" ]; then
        fail_case "$run" "no dev id or daemon pid in the output of kublk add: $(tail_of "$d/server.out")"
        [ -n "$id" ] && "$KUBLK" del -n "$id" >/dev/null 2>&1
        return
    fi
    if ! wait_blk "/dev/ublkb$id"; then
        fail_case "$run" "kublk added device $id, but /dev/ublkb$id did not appear"
    else
        run_workloads "$run" "/dev/ublkb$id" "$pid"
    fi
    if ! timeout 60 "$KUBLK" del -n "$id" > "$d/del.log" 2>&1; then
        echo "kublk del -n $id failed: $(tail_of "$d/del.log")" >> "$d/teardown_error"
    fi
}

# raw_nvme_case RUN PASSTHRU: fio on the namespace itself, polled: NVMe passthrough on
# /dev/ng0n1 with fixed buffers when PASSTHRU is true, else io_uring on /dev/nvme0n1.
raw_nvme_case() {
    d="$OUT/$1"; mkdir -p "$d"
    if [ "$(cat /sys/block/nvme0n1/queue/io_poll 2>/dev/null)" != 1 ]; then
        fail_case "$1" "/dev/nvme0n1 has no poll queues"
        return
    fi
    if [ "$2" = true ]; then
        note "$1: fio io_uring_cmd on /dev/ng0n1 (hipri, fixedbufs)"
        FIO_ENGINE="--ioengine=io_uring_cmd --cmd_type=nvme --hipri=1 --fixedbufs=1 --registerfiles=1"
        run_workloads "$1" /dev/ng0n1 ""
    else
        note "$1: fio io_uring on /dev/nvme0n1 (hipri)"
        FIO_ENGINE="--ioengine=io_uring --direct=1 --hipri=1 --fixedbufs=1 --registerfiles=1"
        run_workloads "$1" /dev/nvme0n1 ""
    fi
    FIO_ENGINE="--ioengine=io_uring --direct=1"
# 1 while ublkd_case runs the warm-up before an A/B group instead of the workloads.
WARMUP=0
}

# loop_case RUN FILE: a loop device with direct I/O on FILE.
loop_case() {
    d="$OUT/$1"; mkdir -p "$d"
    note "$1: losetup --direct-io=on $2"
    if ! dev=$(losetup --direct-io=on --find --show "$2" 2> "$d/server.err"); then
        fail_case "$1" "losetup failed: $(tail_of "$d/server.err")"
        return
    fi
    if [ "$(cat "/sys/block/$(basename "$dev")/loop/dio" 2>/dev/null)" != 1 ]; then
        fail_case "$1" "$dev did not switch to direct I/O"
    else
        run_workloads "$1" "$dev" ""
    fi
    losetup -d "$dev" 2>> "$d/teardown_error" || echo "losetup -d $dev failed" >> "$d/teardown_error"
    [ -s "$d/teardown_error" ] || rm -f "$d/teardown_error"
}

nullblk_case() {
    d="$OUT/$1"; mkdir -p "$d"
    note "$1: /dev/nullb0"
    if [ -b /dev/nullb0 ]; then
        run_workloads "$1" /dev/nullb0 ""
    else
        fail_case "$1" "/dev/nullb0 is missing (null_blk not loaded?)"
    fi
}

# ctl_case RUN VOLUMES SIZE DEPTH METRICS: ublkd as a node service (`ublkd --config`), driven
# by ublkctl. Records the daemon's /proc status with no volumes (status.0) and with VOLUMES idle
# null volumes (status.full), and times each create-volume (create.ns: NAME DEVICE NS) and
# delete-volume (delete.ns: NAME NS) end to end, ublkctl's start-up included.
ctl_case() {
    run=$1; n=$2; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/ublkd-bench-ctl"; SOCK="$C/ublkd.sock"
    node_config "$C" "$5"
    note "$run: ublkd --config $C/ublkd.toml, then $n volumes through ublkctl"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    sleep 1
    cat "/proc/$pid/status" > "$d/status.0" 2>/dev/null

    : > "$d/create.ns"
    k=1
    while [ $k -le "$n" ]; do
        name=$(printf 'v%03d' "$k")
        t0=$(date +%s%N)
        dev=$(ctl create-volume "$name" --size "$3" --backend null --depth "$4" 2>> "$d/create.err")
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "create-volume $name failed (exit $rc): $(tail_of "$d/create.err")" > "$d/create_error"
            break
        fi
        # Created: deleted below, whatever else goes wrong.
        echo "$name ${dev:--} $((t1 - t0))" >> "$d/create.ns"
        if [ ! -b "$dev" ]; then
            echo "create-volume $name returned ${dev:-nothing}, which is no block device" > "$d/create_error"
            break
        fi
        k=$((k + 1))
    done
    note "$run: $(wc -l < "$d/create.ns") volumes created"
    sleep 1
    cat "/proc/$pid/status" > "$d/status.full" 2>/dev/null
    # A Prometheus scrape with every volume present (scrape.ns: one NS per scrape), timed
    # inside one process so that no process start (slow over the guest's 9p root) counts.
    python3 - "$5" > "$d/scrape.ns" 2> "$d/scrape_error" <<'PY'
import socket, sys, time
host, port = sys.argv[1].rsplit(":", 1)
# The first name lookup imports codecs from the 9p root: the client's cost, not the server's.
socket.getaddrinfo(host, int(port))
for _ in range(10):
    t0 = time.perf_counter_ns()
    c = socket.create_connection((host, int(port)))
    c.sendall(b"GET /metrics HTTP/1.0\r\n\r\n")
    head = b""
    while True:
        b = c.recv(1 << 20)
        if not b:
            break
        head = head or b
    t1 = time.perf_counter_ns()
    if not head.startswith(b"HTTP/1.") or b" 200 " not in head.split(b"\r\n", 1)[0]:
        sys.exit("GET /metrics did not answer 200")
    print(t1 - t0)
PY
    [ -s "$d/scrape_error" ] || rm -f "$d/scrape_error"

    # Round trips to busy workers: a create hands the new queue to a worker and waits for its
    # answer (the worker reads commands between completions), a delete tears the queue down
    # through it. Timed again while fio keeps the workers busy on the first two volumes
    # (load_create.ns, load_delete.ns: NAME NS; load.json: fio's report of the load).
    # shellcheck disable=SC2046
    set -- $(awk 'NR <= 2 { print $2 }' "$d/create.ns")
    if [ $# -eq 2 ]; then
        # shellcheck disable=SC2086
        fio $FIO_ENGINE --bs=4k --rw=randread --iodepth=32 --norandommap --time_based \
            --runtime=300 --output-format=json --output="$d/load.json" \
            --name=load0 --filename="$1" --name=load1 --filename="$2" > "$d/load.log" 2>&1 &
        fio_pid=$!
        sleep 2
        : > "$d/load_create.ns"; : > "$d/load_delete.ns"
        k=1
        while [ $k -le "$LOAD_CALLS" ] && kill -0 "$fio_pid" 2> /dev/null; do
            name=$(printf 'l%03d' "$k")
            t0=$(date +%s%N)
            ctl create-volume "$name" --size 64MiB --backend null --depth 32 \
                > /dev/null 2>> "$d/load.err" || { echo "create-volume $name failed under load: $(tail_of "$d/load.err")" > "$d/load_error"; break; }
            t1=$(date +%s%N)
            ctl delete-volume "$name" > /dev/null 2>> "$d/load.err" ||
                { echo "delete-volume $name failed under load: $(tail_of "$d/load.err")" > "$d/load_error"; break; }
            t2=$(date +%s%N)
            echo "$name $((t1 - t0))" >> "$d/load_create.ns"
            echo "$name $((t2 - t1))" >> "$d/load_delete.ns"
            k=$((k + 1))
        done
        if [ ! -e "$d/load_error" ] && ! kill -0 "$fio_pid" 2> /dev/null; then
            echo "the fio load ended before the timed calls did: $(tail_of "$d/load.log")" > "$d/load_error"
        fi
        kill -INT "$fio_pid" 2> /dev/null
        wait "$fio_pid"
        note "$run: $(wc -l < "$d/load_create.ns") creates and deletes timed under load"
    else
        echo "fewer than 2 volumes to load" > "$d/load_error"
    fi

    : > "$d/delete.ns"
    # ns: the rest of the line, so that dev is the device alone.
    # shellcheck disable=SC2034
    while read -r name dev ns; do
        t0=$(date +%s%N)
        ctl delete-volume "$name" > /dev/null 2>> "$d/delete.err"
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "delete-volume $name failed (exit $rc): $(tail_of "$d/delete.err")" >> "$d/delete_error"
            continue
        fi
        echo "$name $((t1 - t0))" >> "$d/delete.ns"
        if [ -e "$dev" ]; then
            echo "$dev still exists after delete-volume $name returned" >> "$d/delete_error"
        fi
    done < "$d/create.ns"
    note "$run: $(wc -l < "$d/delete.ns") volumes deleted"
    stop_ublkd "$d" "$pid"
}

# csi_case RUN N PAR METRICS: ublkd (a node service, as in ctl_case) with ublkd-csi in front of
# it, driven by `ublkd-csi ctl` (copied to tmpfs: process start-up stays off the 9p root). For
# ext4 and xfs, N file volumes each timed from CreateVolume to a published, mounted file system
# (<fs>.ns: one NS per volume), each torn down before the next (the node's capacity is a tmpfs).
# Then PAR fresh ext4 volumes staged one at a time (stage_seq.ns: total NS), torn down, and PAR
# more staged all at once (stage_par.ns: total NS). Problems go to DIR/error or teardown_error.
csi_case() {
    run=$1; n=$2; par=$3; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/ublkd-bench-csi"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$4"
    K="$C/kubelet"; mkdir -p "$K"
    CSI="$TMPDIR/ublkd-csi"
    if ! cp "$UBLKD_CSI" "$CSI"; then fail_case "$run" "no ublkd-csi binary"; return; fi
    note "$run: $n volumes per file system to a mounted pod path; $par stages in sequence, $par in parallel"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    "$CSI" --csi-endpoint "unix://$C/csi.sock" --ublkd "unix://$SOCK" --node-id bench \
        --kubelet-dir "$K" 2> "$d/csi.log" &
    cpid=$!
    i=0
    while [ ! -S "$C/csi.sock" ] && [ $i -lt 100 ]; do sleep 0.1; i=$((i + 1)); done
    : > "$d/made"
    for fs in ext4 xfs; do
        # xfs refuses file systems under 300 MB.
        size=$((64 << 20)); [ "$fs" = xfs ] && size=$((320 << 20))
        : > "$d/$fs.ns"
        k=1
        while [ $k -le "$n" ] && [ ! -e "$d/error" ]; do
            name=$(printf 'pvc-%s-%03d' "$fs" "$k")
            t0=$(date +%s%N)
            if csi_up "$name" "$size" "$fs" "$K" 2>> "$d/csi.err"; then
                t1=$(date +%s%N)
                echo "$((t1 - t0))" >> "$d/$fs.ns"
            else
                echo "$name: $(tail_of "$d/csi.err")" > "$d/error"
            fi
            csi_teardown "$d"
            k=$((k + 1))
        done
    done
    for set in seq par; do
        [ -e "$d/error" ] && break
        k=1
        while [ $k -le "$par" ]; do
            name=$(printf 'pvc-%s-%03d' "$set" "$k")
            echo "$name" >> "$d/made"
            if ! csictl create "$name" --size $((64 << 20)) --param backend=file \
                    --param "root=$C/roots" > /dev/null 2>> "$d/csi.err"; then
                echo "$name: $(tail_of "$d/csi.err")" > "$d/error"
                break
            fi
            k=$((k + 1))
        done
        [ -e "$d/error" ] && break
        t0=$(date +%s%N)
        k=1; stages=""
        while [ $k -le "$par" ]; do
            name=$(printf 'pvc-%s-%03d' "$set" "$k")
            if [ "$set" = seq ]; then
                csictl stage "$name" "$K/staging/$name" 2>> "$d/csi.err" ||
                    echo "stage $name failed: $(tail_of "$d/csi.err")" >> "$d/error"
            else
                ( csictl stage "$name" "$K/staging/$name" 2>> "$d/csi.err" ||
                    echo "stage $name failed: $(tail_of "$d/csi.err")" >> "$d/error" ) &
                stages="$stages $!"
            fi
            k=$((k + 1))
        done
        for j in $stages; do wait "$j"; done
        t1=$(date +%s%N)
        echo "$((t1 - t0))" > "$d/stage_$set.ns"
        csi_teardown "$d"
    done
    note "$run: $(cat "$d/ext4.ns" "$d/xfs.ns" 2>/dev/null | wc -l) volumes timed to mounted"
    csi_teardown "$d"
    kill -TERM "$cpid" 2> /dev/null; wait "$cpid" 2> /dev/null
    stop_ublkd "$d" "$pid"
}

# csi_teardown DIR: unpublishes, unstages and deletes every volume listed in DIR/made, then
# empties the list; failures go to DIR/teardown_error.
csi_teardown() {
    while read -r name; do
        csi_down "$name" "$K" 2>> "$1/teardown.err" ||
            echo "tearing down $name failed: $(tail_of "$1/teardown.err")" >> "$1/teardown_error"
    done < "$1/made"
    : > "$1/made"
}

# csictl ARGS: `ublkd-csi ctl` against the CSI run's driver; never reads the caller's stdin.
csictl() {
    "$CSI" ctl --csi-endpoint "unix://$C/csi.sock" "$@" < /dev/null
}

# csi_up NAME SIZE FS KUBELET: CreateVolume, NodeStageVolume and NodePublishVolume, as the
# provisioner and the kubelet make them for a pod's first start; records NAME in $d/made.
csi_up() {
    echo "$1" >> "$d/made"
    csictl create "$1" --size "$2" --fs "$3" --param backend=file --param "root=$C/roots" \
        --param "fsType=$3" > /dev/null || return 1
    csictl stage "$1" "$4/staging/$1" --fs "$3" &&
        csictl publish "$1" "$4/staging/$1" "$4/pods/p/$1" --fs "$3"
}

# csi_down NAME KUBELET: unpublish, unstage, delete (each a no-op where there is nothing to undo).
csi_down() {
    csictl unpublish "$1" "$2/pods/p/$1" &&
        csictl unstage "$1" "$2/staging/$1" &&
        csictl delete "$1"
}

# qos_case RUN METRICS SIZE QD RUNTIME: ublkd as a node service (as in ctl_case); qos_jobs
# (generated from QOS_JOBS) runs qos_job once per limit, each on a fresh null volume of SIZE.
# Per job ID: ID.json, ID.rc and ID.log (fio), ID.volume.json (get-volume -o json: the limits as
# the daemon took them), ID.error (no measurement, and why). Volumes that outlive their job, or
# a daemon that will not stop, go to teardown_error.
qos_case() {
    run=$1; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$2"
    qsize=$3; qqd=$4; qrt=$5
    note "$run: null volumes with I/O limits, fio $qrt s at QD$qqd on each"
    : > "$d/volumes"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    qos_jobs
    rec_teardown "$d" "$C/ublkd.toml"
}

# qos_job ID RW BS [FLAGS...]: create-volume ID (null, $qsize) with FLAGS, its limits; fio RW at
# BS and depth $qqd for $qrt s after 1 s of ramp (the burst allowance is spent in the ramp);
# delete-volume ID. Reads $d, $qsize, $qqd and $qrt of qos_case.
qos_job() {
    id=$1; rw=$2; bs=$3; shift 3
    if ! dev=$(ctl create-volume "$id" --size "$qsize" --backend null "$@" 2>> "$d/create.err"); then
        echo "create-volume $id $* failed: $(tail_of "$d/create.err")" > "$d/$id.error"
        note "$id: $(cat "$d/$id.error")"
        return
    fi
    echo "$id $dev" >> "$d/volumes"
    if wait_blk "$dev"; then
        ctl get-volume "$id" -o json > "$d/$id.volume.json" 2>> "$d/create.err"
        # shellcheck disable=SC2086 # FIO_ENGINE is several words
        timeout -k 5 $((qrt + 60)) fio --name="$id" --filename="$dev" $FIO_ENGINE --bs="$bs" \
            --rw="$rw" --iodepth="$qqd" --numjobs=1 --norandommap --time_based --runtime="$qrt" \
            --ramp_time=1 --output-format=json --output="$d/$id.json" > "$d/$id.log" 2>&1
        echo $? > "$d/$id.rc"
        note "$id: fio exit $(cat "$d/$id.rc")"
    else
        echo "create-volume $id returned ${dev:-nothing}, which is no block device" > "$d/$id.error"
    fi
    if ! ctl delete-volume "$id" > /dev/null 2>> "$d/delete.err"; then
        echo "delete-volume $id failed: $(tail_of "$d/delete.err")" >> "$d/teardown_error"
    fi
}

# snap_case RUN METRICS FS_GIB FILL_MIB REPEATS GIB...: ublkd as a node service whose allowed
# root is an XFS made with reflink=1 on a loop device over a sparse file of FS_GIB GiB in the
# tmpfs (fs.log: how making it went; fs.txt: xfs_info). noop.ns: REPEATS `ublkctl node-info`
# calls (NS each), the floor of any call. Then snap_size for each GIB. Snapshots, volumes, the
# daemon, the file system and its loop device are all gone at the end (or teardown_error says).
# The loop and xfs modules are loaded at boot (the initramfs has them; modprobe in the chroot
# would look for the host's modules).
snap_case() {
    run=$1; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$2"
    img="$C/xfs.img"; sdev=""; fs_gib=$3; sfill=$4; sreps=$5
    shift 5
    note "$run: file volumes of $* GiB on XFS (reflink=1), $sreps snapshots and clones of each"
    : > "$d/volumes"; : > "$d/snapshots"
    if ! { truncate -s "${fs_gib}G" "$img" && sdev=$(losetup --find --show "$img") &&
            mkfs.xfs -q -f -m reflink=1 "$sdev" && mount "$sdev" "$C/roots"; } > "$d/fs.log" 2>&1; then
        fail_case "$run" "no XFS with reflink for the volumes: $(tail_of "$d/fs.log")"
        snap_fs_teardown
        return
    fi
    xfs_info "$C/roots" > "$d/fs.txt" 2>&1
    spawn_ublkd "$d" "$C/ublkd.toml"
    if ! wait_up "$run" "$d"; then snap_fs_teardown; return; fi
    : > "$d/noop.ns"
    k=1
    while [ $k -le "$sreps" ]; do
        t0=$(date +%s%N)
        ctl node-info > /dev/null 2>> "$d/noop.err"
        rc=$?
        t1=$(date +%s%N)
        [ $rc -eq 0 ] && echo "$((t1 - t0))" >> "$d/noop.ns"
        k=$((k + 1))
    done
    for gib in "$@"; do snap_size "$gib"; done
    while read -r sid; do
        if ! ctl delete-snapshot "$sid" > /dev/null 2>> "$d/delete.err"; then
            echo "delete-snapshot $sid failed: $(tail_of "$d/delete.err")" >> "$d/teardown_error"
        fi
    done < "$d/snapshots"
    rec_teardown "$d" "$C/ublkd.toml"
    snap_fs_teardown
}

# snap_size GIB: create-volume src-Ng of GIB GiB on a new sparse backing file (create.Ng.ns: NS),
# $sfill MiB written into it by fio (randwrite 64k across the whole volume, so the file has
# thousands of extents; fill.Ng.*), synced, its extents counted (extents.Ng: filefrag). Then
# $sreps times: create-snapshot snap-Ng-K, and create-volume clone-Ng-K --from-snapshot
# snap-Ng-K, each timed (snapshot.Ng.ns, clone.Ng.ns: `ID NS USED_BEFORE USED_AFTER`, bytes in
# use on the file system by df, synced, around the call). Failures: Ng.error (nothing to
# snapshot), snapshot.Ng.error, clone.Ng.error.
snap_size() {
    s="${1}g"; src="src-$s"
    t0=$(date +%s%N)
    if ! dev=$(ctl create-volume "$src" --size "${1}GiB" --backend "file+create:$C/roots/$src.img" \
            2>> "$d/create.err"); then
        echo "create-volume $src failed: $(tail_of "$d/create.err")" > "$d/$s.error"
        return
    fi
    t1=$(date +%s%N)
    echo "$src $dev" >> "$d/volumes"
    echo "$((t1 - t0))" > "$d/create.$s.ns"
    if ! wait_blk "$dev"; then
        echo "create-volume $src returned ${dev:-nothing}, which is no block device" > "$d/$s.error"
        return
    fi
    # shellcheck disable=SC2086 # FIO_ENGINE is several words
    timeout -k 5 180 fio --name=fill --filename="$dev" $FIO_ENGINE --bs=64k --rw=randwrite \
        --iodepth=16 --numjobs=1 --io_size="${sfill}m" --output-format=json \
        --output="$d/fill.$s.json" > "$d/fill.$s.log" 2>&1
    rc=$?
    if [ $rc -ne 0 ]; then
        echo "fio writing $sfill MiB into $src failed (exit $rc): $(tail_of "$d/fill.$s.log")" > "$d/$s.error"
        return
    fi
    sync
    filefrag "$C/roots/$src.img" > "$d/extents.$s" 2>&1
    note "$run: $(cat "$d/extents.$s")"
    : > "$d/snapshot.$s.ns"; : > "$d/clone.$s.ns"
    k=1
    while [ $k -le "$sreps" ]; do
        sid="snap-$s-$k"; u0=$(fs_used)
        t0=$(date +%s%N)
        ctl create-snapshot "$sid" --volume "$src" > /dev/null 2>> "$d/snapshot.err"
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "create-snapshot $sid failed (exit $rc): $(tail_of "$d/snapshot.err")" > "$d/snapshot.$s.error"
            break
        fi
        echo "$sid" >> "$d/snapshots"
        echo "$sid $((t1 - t0)) $u0 $(fs_used)" >> "$d/snapshot.$s.ns"
        name="clone-$s-$k"; u0=$(fs_used)
        t0=$(date +%s%N)
        cdev=$(ctl create-volume "$name" --size "${1}GiB" --backend "file+create:$C/roots/$name.img" \
            --from-snapshot "$sid" 2>> "$d/clone.err")
        rc=$?
        t1=$(date +%s%N)
        if [ $rc -ne 0 ]; then
            echo "create-volume $name --from-snapshot $sid failed (exit $rc): $(tail_of "$d/clone.err")" > "$d/clone.$s.error"
            break
        fi
        echo "$name ${cdev:--}" >> "$d/volumes"
        echo "$name $((t1 - t0)) $u0 $(fs_used)" >> "$d/clone.$s.ns"
        k=$((k + 1))
    done
    note "$run: $s: $(wc -l < "$d/snapshot.$s.ns") snapshots, $(wc -l < "$d/clone.$s.ns") clones timed"
}

# fs_used: bytes in use on the snapshot run's file system once it is synced; - if df fails.
fs_used() {
    sync -f "$C/roots" 2>/dev/null
    v=$(df -B1 --output=used "$C/roots" 2>/dev/null | awk 'NR == 2 { print $1 }')
    echo "${v:--}"
}

# snap_fs_teardown: unmounts the snapshot run's XFS, detaches its loop device ($sdev), removes
# its image; problems go to $d/teardown_error.
snap_fs_teardown() {
    if mountpoint -q "$C/roots" && ! umount "$C/roots" 2>> "$d/teardown.err"; then
        echo "umount $C/roots failed: $(tail_of "$d/teardown.err")" >> "$d/teardown_error"
    fi
    if [ -n "$sdev" ] && ! losetup -d "$sdev" 2>> "$d/teardown.err"; then
        echo "losetup -d $sdev failed: $(tail_of "$d/teardown.err")" >> "$d/teardown_error"
    fi
    rm -f "$img"
}

# node_config DIR METRICS: DIR/ublkd.toml, a node-service configuration keeping everything
# (state, roots, RAM files, socket) under DIR; devices are kept on exit (the default).
node_config() {
    mkdir -p "$1/roots"
    cat > "$1/ublkd.toml" <<CONFIG
state_dir = "$1/state"
allowed_roots = ["$1/roots"]
ram_dir = "$1/ram"
on_exit = "keep"

[grpc]
listen = ["unix://$1/ublkd.sock"]

[metrics]
listen = "$2"

[dataplane]
cpus = [0, 1]
CONFIG
}

# spawn_ublkd DIR CONFIG: `ublkd --config CONFIG` in the background, logging to DIR/server.*.
# It writes DIR/pid, then DIR/start.ns (date +%s%N right before the exec), and DIR/exit once the
# process is gone; sets $pid.
spawn_ublkd() {
    rm -f "$1/pid" "$1/start.ns" "$1/exit"
    ( sh -c 'echo $$ > "$0/pid.tmp"; mv "$0/pid.tmp" "$0/pid"; date +%s%N > "$0/start.ns"
             exec "$@"' "$1" "$UBLKD" --config "$2" >> "$1/server.out" 2>> "$1/server.err"
      rc=$?; echo "$rc" > "$1/exit.tmp"; mv "$1/exit.tmp" "$1/exit" ) &
    wait_file "$1/pid" 50
    pid=$(cat "$1/pid" 2>/dev/null)
}

# wait_up RUN DIR: waits up to 60 s for the daemon's socket ($SOCK) to answer node-info; if it
# does not, records why (fail_case), stops the daemon and returns 1.
wait_up() {
    i=0
    while [ $i -lt 600 ] && [ ! -e "$2/exit" ]; do
        if ctl node-info > "$2/node-info.out" 2> "$2/node-info.err"; then return 0; fi
        sleep 0.1; i=$((i + 1))
    done
    if [ -e "$2/exit" ]; then
        fail_case "$1" "ublkd exited with status $(cat "$2/exit") before its socket answered: $(tail_of "$2/server.err")"
    else
        fail_case "$1" "ublkd's socket did not answer node-info within 60 s: $(tail_of "$2/node-info.err") $(tail_of "$2/server.err")"
        stop_ublkd "$2" "$pid"
    fi
    return 1
}

# wait_ready DIR N: polls `list-volumes -o json` every 20 ms until it shows N volumes READY, then
# writes DIR/list.json (that answer), DIR/ready.ns (`START_NS READY_NS`: the daemon's exec and
# the moment that answer arrived) and DIR/poll.ns (`BEFORE_NS AFTER_NS` one more call). Gives up (returns 1, reason in $why) when a volume FAILED,
# the daemon exited, or 60 s passed.
wait_ready() {
    deadline=$(( $(date +%s) + 60 ))
    while :; do
        if ctl list-volumes -o json > "$1/list.tmp" 2>> "$1/list.err"; then
            t1=$(date +%s%N)
            if [ "$(grep -c '"VOLUME_STATE_READY"' "$1/list.tmp")" -eq "$2" ]; then
                mv "$1/list.tmp" "$1/list.json"
                echo "$(cat "$1/start.ns") $t1" > "$1/ready.ns"
                # What one poll costs (ublkctl's start-up included), for reading the above.
                p0=$(date +%s%N)
                ctl list-volumes -o json > /dev/null 2>&1
                echo "$p0 $(date +%s%N)" > "$1/poll.ns"
                return 0
            fi
            if grep -q '"VOLUME_STATE_FAILED"' "$1/list.tmp"; then
                why="a volume FAILED to come back: $(grep '"message"' "$1/list.tmp" | grep -v '""' | head -n 1)"
                return 1
            fi
        fi
        if [ -e "$1/exit" ]; then
            why="the new ublkd exited with status $(cat "$1/exit"): $(tail_of "$1/server.err")"
            return 1
        fi
        if [ "$(date +%s)" -ge "$deadline" ]; then
            why="not all $2 volumes READY within 60 s of the restart: $(grep -c '"VOLUME_STATE_READY"' "$1/list.tmp" 2>/dev/null) READY; $(tail_of "$1/list.err")"
            return 1
        fi
        sleep 0.02
    done
}

# crash_restart DIR CONFIG: kill -9 the daemon ($pid; DIR/kill.ns the moment), wait (polling every
# 10 ms) until it is gone, and start it again at once. Returns 1 (reason in $why) if it does not
# die within 10 s.
crash_restart() {
    date +%s%N > "$1/kill.ns"
    kill -KILL "$pid" 2>/dev/null
    i=0
    while [ ! -e "$1/exit" ] && [ $i -lt 1000 ]; do sleep 0.01; i=$((i + 1)); done
    if [ ! -e "$1/exit" ]; then
        why="ublkd did not exit within 10 s of kill -9"
        return 1
    fi
    spawn_ublkd "$1" "$2"
}

# rec_teardown DIR CONFIG: deletes every volume the daemon lists (starting it again first if it
# is gone), checks the devices in DIR/volumes (`NAME DEVICE` lines) are gone, stops the daemon
# with SIGTERM. Problems go to DIR/teardown_error.
rec_teardown() {
    if [ -e "$1/exit" ]; then
        spawn_ublkd "$1" "$2"
        i=0
        while [ $i -lt 100 ] && [ ! -e "$1/exit" ] && ! ctl node-info > /dev/null 2>&1; do
            sleep 0.1; i=$((i + 1))
        done
    fi
    if ! ctl list-volumes -o json > "$1/final.json" 2>> "$1/delete.err"; then
        echo "list-volumes failed before the deletes: $(tail_of "$1/delete.err")" >> "$1/teardown_error"
    fi
    # Volume ids are one word each (r001, s1): split on purpose.
    # shellcheck disable=SC2013
    for name in $(sed -n 's/.*"id": "\([^"]*\)".*/\1/p' "$1/final.json" 2>/dev/null); do
        if ! ctl delete-volume "$name" > /dev/null 2>> "$1/delete.err"; then
            echo "delete-volume $name failed: $(tail_of "$1/delete.err")" >> "$1/teardown_error"
        fi
    done
    while read -r name dev; do
        [ -e "$dev" ] && echo "$dev ($name) still exists after the deletes" >> "$1/teardown_error"
    done < "$1/volumes"
    if [ -e "$1/exit" ]; then
        echo "ublkd was not running for the deletes: $(tail_of "$1/server.err")" >> "$1/teardown_error"
    else
        stop_ublkd "$1" "$pid"
    fi
    return 0
}

# rec_case RUN N SIZE DEPTH METRICS: a fresh daemon, N null volumes (1 queue of DEPTH), kill -9,
# start it again; ready.ns times the new process from its exec until list-volumes shows all N
# READY. Then every volume is deleted and the daemon stopped.
rec_case() {
    run=$1; n=$2; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$5"
    note "$run: $n null volumes, kill -9 ublkd, start it again"
    : > "$d/volumes"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    k=1
    while [ $k -le "$n" ]; do
        name=$(printf 'r%03d' "$k")
        if ! dev=$(ctl create-volume "$name" --size "$3" --backend null --queues 1 --depth "$4" \
                2>> "$d/create.err"); then
            fail_case "$run" "create-volume $name failed: $(tail_of "$d/create.err")"
            rec_teardown "$d" "$C/ublkd.toml"
            return
        fi
        echo "$name $dev" >> "$d/volumes"
        k=$((k + 1))
    done
    if ! crash_restart "$d" "$C/ublkd.toml"; then
        fail_case "$run" "$why"
    else
        gone=""
        while read -r name dev; do [ -b "$dev" ] || gone="$gone $dev"; done < "$d/volumes"
        if ! wait_ready "$d" "$n"; then
            fail_case "$run" "$why"
        elif [ -n "$gone" ]; then
            fail_case "$run" "devices gone after kill -9 (they must survive the daemon):$gone"
        fi
    fi
    note "$run: $(cat "$d/ready.ns" 2>/dev/null || echo 'not READY')"
    rec_teardown "$d" "$C/ublkd.toml"
}

# stall_case RUN SIZE RUNTIME KILL_AT METRICS: fio randwrite 4k QD16 on a RAM volume for RUNTIME
# s with a per-I/O completion latency log (clat.log: `MS, NS, DIR, BS, OFFSET` lines); KILL_AT s
# after the device completed its first write, kill -9 ublkd and start it again at once.
# times.ns: `FIO_LAUNCH_NS FIRST_WRITE_NS`; kill.ns, ready.ns, poll.ns as above; fio.json, fio.rc.
stall_case() {
    run=$1; d="$OUT/$run"; mkdir -p "$d"
    C="$TMPDIR/$run"; SOCK="$C/ublkd.sock"
    rm -rf "$C"; node_config "$C" "$5"
    note "$run: fio on a RAM volume for $3 s, kill -9 ublkd $4 s in"
    : > "$d/volumes"
    spawn_ublkd "$d" "$C/ublkd.toml"
    wait_up "$run" "$d" || return
    if ! dev=$(ctl create-volume s1 --size "$2" --backend ram 2>> "$d/create.err"); then
        fail_case "$run" "create-volume s1 failed: $(tail_of "$d/create.err")"
        rec_teardown "$d" "$C/ublkd.toml"
        return
    fi
    echo "s1 $dev" > "$d/volumes"
    if ! wait_blk "$dev"; then
        fail_case "$run" "create-volume returned ${dev:-nothing}, which is no block device"
        rec_teardown "$d" "$C/ublkd.toml"
        return
    fi
    mkdir -p "$C/fio"
    ( timeout -k 5 $(($3 + 60)) fio --name=stall --filename="$dev" --ioengine=io_uring \
        --direct=1 --bs=4k --rw=randwrite --iodepth=16 --numjobs=1 --norandommap --time_based \
        --runtime="$3" --disable_slat=1 --disable_lat=1 --write_lat_log="$C/fio/stall" \
        --log_avg_msec=0 --output-format=json --output="$d/fio.json" > "$d/fio.log" 2>&1
      echo $? > "$d/fio.rc.tmp"; mv "$d/fio.rc.tmp" "$d/fio.rc" ) &
    t0=$(date +%s%N)
    # fio can take seconds to start its job (TCG): count from the device's first write.
    blk=$(basename "$dev"); i=0
    while [ "$(awk '{ print $5 }' "/sys/block/$blk/stat" 2>/dev/null || echo 0)" = 0 ] &&
        [ $i -lt 6000 ] && [ ! -e "$d/fio.rc" ]; do
        sleep 0.01; i=$((i + 1))
    done
    t1=$(date +%s%N)
    echo "$t0 $t1" > "$d/times.ns"
    if [ "$(awk '{ print $5 }' "/sys/block/$blk/stat" 2>/dev/null || echo 0)" = 0 ]; then
        fail_case "$run" "fio wrote nothing to $dev within 60 s: $(tail_of "$d/fio.log")"
    else
        sleep "$4"
        if ! crash_restart "$d" "$C/ublkd.toml"; then
            fail_case "$run" "$why"
        elif ! wait_ready "$d" 1; then
            fail_case "$run" "$why"
        fi
    fi
    if ! wait_file "$d/fio.rc" $((($3 + 70) * 10)); then
        fail_case "$run" "fio did not end within $(($3 + 70)) s"
    fi
    if ! cp "$C/fio/stall_clat.1.log" "$d/clat.log" 2>> "$d/fio.log"; then
        echo "fio wrote no completion latency log" >> "$d/fio.log"
    fi
    note "$run: fio exit $(cat "$d/fio.rc" 2>/dev/null), $(wc -l < "$d/clat.log" 2>/dev/null) I/Os logged"
    rec_teardown "$d" "$C/ublkd.toml"
}

# ublkctl against the control-plane run's daemon; never reads the caller's stdin.
ctl() {
    "$UBLKCTL" --endpoint "unix://$SOCK" "$@" < /dev/null
}

# The backing file for the file cases: ext4 on the NVMe namespace, written out in full so that
# reads reach the device. Sets BACKING, which the generated part of the script reads.
# shellcheck disable=SC2034
prepare_backing() {
    mnt="$TMPDIR/ublkd-bench"
    mkdir -p "$mnt" &&
        mkfs.ext4 -q -F /dev/nvme0n1 &&
        mount /dev/nvme0n1 "$mnt" &&
        dd if=/dev/zero of="$mnt/backing" bs=1M count=$((BACKING_BYTES >> 20)) oflag=direct \
            status=none &&
        BACKING="$mnt/backing"
}
