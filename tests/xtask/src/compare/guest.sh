#!/bin/sh
# Guest side of `cargo xtask compare`: fio 4 KiB QD32 randread and randwrite, and randread at
# QD1, on a null volume served by `ublkd run` (2 queues, depth 128, fio unpinned), for each build
# in turn, forward then backward, twice (ABC CBA ABC CBA), so that a drift over the boot falls on
# every build alike. Each run also records blk-mq's CPU list per hardware queue and each CPU's
# busy share while fio ran (/proc/stat; with --cpus=N among a build's flags, fio runs on the
# other CPUs), and what the mechanism costs per I/O: context switches
# (/proc/stat ctxt), rescheduling and function-call IPIs (/proc/interrupts RES and CAL), and
# io_uring_enter calls (a histogram trigger on the syscall's trace event, by thread), all over
# the I/Os the device completed. Arguments: RUNTIME OUT LABEL|BINARY|FLAGS..., FLAGS
# (comma-separated, may be empty) added to `ublkd run`; one line per run is appended to OUT:
#   LABEL JOB VALUE MAP BUSY TRACE
# where VALUE is IOPS for randread and randwrite, and the mean latency in microseconds for
# randread-qd1, and TRACE is `ctx=C,ipi=I,enter=E,enter_ublkd=U` per I/O (or `-`).
set -u
runtime=$1 out=$2
shift 2
work=$(mktemp -d)

T=/sys/kernel/tracing
[ -d "$T/events" ] || mount -t tracefs tracefs "$T" 2>/dev/null
EV=$T/events/syscalls/sys_enter_io_uring_enter

ipis() {
    awk '$1 == "RES:" || $1 == "CAL:" { for (i = 2; i <= NF && $i ~ /^[0-9]+$/; i++) n += $i } END { print n + 0 }' /proc/interrupts
}
ctxt() { awk '$1 == "ctxt" { print $2 }' /proc/stat; }
dev_ios() { awk '{ print $1 + $5 }' "/sys/block/$1/stat"; }

# io_uring_enter calls since the trigger was set: all threads, and those of process $1.
enters() {
    [ -r "$EV/hist" ] || { echo "- -"; return; }
    tids=" "
    for t in "/proc/$1/task/"*; do tids="$tids${t##*/} "; done
    awk -v tids="$tids" '/common_pid:/ {
        pid = $0; sub(/.*common_pid: */, "", pid); sub(/[^0-9].*/, "", pid)
        n = $0; sub(/.*hitcount: */, "", n); sub(/[^0-9].*/, "", n)
        all += n; if (index(tids, " " pid " ")) own += n
    } END { print all + 0, own + 0 }' "$EV/hist"
}

busy() {
    awk '/^cpu[0-9]/ { print $1, $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat
}

one() { # LABEL BINARY FLAGS JOB
    # Emptied here, not by the background job's own redirection: that happens in the child,
    # later, and the wait below then read the previous run's READY line (dev empty, and the
    # new ublkd killed: the lost "no_device_after_0_tries:exit_143" runs).
    : >"$work/out"
    : >"$work/err"
    # shellcheck disable=SC2046 # the flags are words, split on purpose
    "$2" run --size 1GiB --backend null --queues 2 --depth 128 $(echo "$3" | tr ',' ' ') \
        >"$work/out" 2>"$work/err" &
    pid=$!
    i=0
    # Up to 120 s: a slow emulated guest has needed more than 30 s for a device to appear.
    while ! grep -q READY "$work/out" && kill -0 "$pid" 2>/dev/null && [ "$i" -lt 1200 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    dev=$(awk '/READY/ { print $2 }' "$work/out")
    if [ -z "$dev" ]; then
        kill "$pid" 2>/dev/null
        wait "$pid"
        rc=$?
        why=$(cat "$work/err" "$work/out" | tail -2 | tr ' \n' '_;')
        echo "$1 $4 failed - - no_device_after_${i}_tries:exit_${rc}:${why}" >>"$out"
        return
    fi
    name=$(basename "$dev")
    map=""
    for q in /sys/block/"$name"/mq/*; do
        map="$map$(basename "$q"):$(cat "$q/cpu_list"),"
    done
    # A build given worker CPUs (--cpus=N, the dedicated model) has fio on the other CPUs.
    pin=""
    c=$(echo "$3" | tr ',' '\n' | sed -n 's/^--cpus=//p')
    if [ -n "$c" ]; then
        pin="taskset -c $(seq 0 $(($(nproc) - 1)) | grep -vx "$c" | paste -sd, -)"
    fi
    busy >"$work/before"
    ios0=$(dev_ios "$name") c0=$(ctxt) i0=$(ipis)
    echo 'hist:keys=common_pid:vals=hitcount' >"$EV/trigger" 2>/dev/null
    rw=${4%-qd1} qd=32
    [ "$rw" != "$4" ] && qd=1
    # terse v3: read IOPS is field 8, write IOPS 49, the mean read latency (us) 40.
    # shellcheck disable=SC2086 # $pin is a command and its arguments, or nothing
    iops=$($pin fio --name=compare --filename="$dev" --rw="$rw" --bs=4k --iodepth="$qd" \
        --ioengine=io_uring --direct=1 --time_based --runtime="$runtime" --ramp_time=1 \
        --output-format=terse --terse-version=3 |
        awk -F';' -v job="$4" '{ if (job == "randread") print $8; else if (job == "randwrite") print $49; else print $40 }')
    busy >"$work/after"
    ios1=$(dev_ios "$name") c1=$(ctxt) i1=$(ipis)
    en=$(enters "$pid")
    echo '!hist:keys=common_pid:vals=hitcount' >"$EV/trigger" 2>/dev/null
    trace=$(echo "$ios0 $ios1 $c0 $c1 $i0 $i1 $en" | awk '{ n = $2 - $1; if (n <= 0) { print "-"; exit }
        e = ($7 == "-") ? "-" : sprintf("%.3f", $7 / n); u = ($8 == "-") ? "-" : sprintf("%.3f", $8 / n)
        printf "ctx=%.3f,ipi=%.3f,enter=%s,enter_ublkd=%s", ($4 - $3) / n, ($6 - $5) / n, e, u }')
    share=$(paste "$work/before" "$work/after" |
        awk '{ printf "%s=%.0f,", $1, 100 * ($5 - $2) / ($6 - $3) }')
    kill -TERM "$pid"
    wait "$pid"
    echo "$1 $4 ${iops:-failed} ${map:-none} ${share:-none} ${trace:--}" >>"$out"
}

# Who sends SIGTERM, and to whom (a lost run's ublkd has died of it before its handler was
# installed): the kernel's signal_generate event, kept beside OUT.
if [ -d "$T/events/signal/signal_generate" ]; then
    echo 'sig == 15' >"$T/events/signal/signal_generate/filter"
    echo 1 >"$T/events/signal/signal_generate/enable"
fi
reverse=""
for a in "$@"; do
    reverse="$a $reverse"
done
for order in "$*" "$reverse" "$*" "$reverse"; do
    for a in $order; do
        rest=${a#*|}
        for job in randread randwrite randread-qd1; do
            one "${a%%|*}" "${rest%%|*}" "${rest#*|}" "$job"
        done
    done
done
[ -r "$T/trace" ] && grep signal_generate "$T/trace" >"$out.signals" 2>/dev/null
rm -rf "$work"
