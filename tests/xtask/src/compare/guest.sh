#!/bin/sh
# Guest side of `cargo xtask compare`: fio 4 KiB QD32 randread and randwrite, and randread at
# QD1, on a null volume served by `ublkd run` (2 queues, depth 128, fio unpinned), for each build
# in turn, forward then backward, twice (ABC CBA ABC CBA), so that a drift over the boot falls on
# every build alike. Each run also records blk-mq's CPU list per hardware queue and each CPU's
# busy share while fio ran (/proc/stat). Arguments: RUNTIME OUT LABEL|BINARY|FLAGS..., FLAGS
# (comma-separated, may be empty) added to `ublkd run`; one line per run is appended to OUT:
#   LABEL JOB VALUE MAP BUSY
# where VALUE is IOPS for randread and randwrite, and the mean latency in microseconds for
# randread-qd1.
set -u
runtime=$1 out=$2
shift 2
work=$(mktemp -d)

busy() {
    awk '/^cpu[0-9]/ { print $1, $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat
}

one() { # LABEL BINARY FLAGS JOB
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
        echo "$1 $4 failed - - no_device_after_${i}_tries:$(tail -1 "$work/err" | tr ' ' '_')" >>"$out"
        kill "$pid" 2>/dev/null
        wait "$pid"
        return
    fi
    name=$(basename "$dev")
    map=""
    for q in /sys/block/"$name"/mq/*; do
        map="$map$(basename "$q"):$(cat "$q/cpu_list"),"
    done
    busy >"$work/before"
    rw=${4%-qd1} qd=32
    [ "$rw" != "$4" ] && qd=1
    # terse v3: read IOPS is field 8, write IOPS 49, the mean read latency (us) 40.
    iops=$(fio --name=compare --filename="$dev" --rw="$rw" --bs=4k --iodepth="$qd" \
        --ioengine=io_uring --direct=1 --time_based --runtime="$runtime" --ramp_time=1 \
        --output-format=terse --terse-version=3 |
        awk -F';' -v job="$4" '{ if (job == "randread") print $8; else if (job == "randwrite") print $49; else print $40 }')
    busy >"$work/after"
    share=$(paste "$work/before" "$work/after" |
        awk '{ printf "%s=%.0f,", $1, 100 * ($5 - $2) / ($6 - $3) }')
    kill -TERM "$pid"
    wait "$pid"
    echo "$1 $4 ${iops:-failed} ${map:-none} ${share:-none}" >>"$out"
}

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
rm -rf "$work"
