#!/bin/sh
# Guest side of `cargo xtask compare`: fio 4 KiB QD32 randread and randwrite on a null volume
# served by `ublkd run` (2 queues, depth 128, fio unpinned), for each build in turn, forward then
# backward, twice (ABC CBA ABC CBA), so that a drift over the boot falls on every build alike.
# Each run also records blk-mq's CPU list per hardware queue and each CPU's busy share while fio
# ran (/proc/stat). Arguments: RUNTIME OUT LABEL=BINARY...; one line per run is appended to OUT:
#   LABEL RW IOPS MAP BUSY
set -u
runtime=$1 out=$2
shift 2
work=$(mktemp -d)

busy() {
    awk '/^cpu[0-9]/ { print $1, $2 + $3 + $4 + $7 + $8, $2 + $3 + $4 + $5 + $6 + $7 + $8 }' /proc/stat
}

one() { # LABEL BINARY RW
    "$2" run --size 1GiB --backend null --queues 2 --depth 128 >"$work/out" 2>"$work/err" &
    pid=$!
    i=0
    while ! grep -q READY "$work/out" && [ "$i" -lt 300 ]; do
        sleep 0.1
        i=$((i + 1))
    done
    dev=$(awk '/READY/ { print $2 }' "$work/out")
    if [ -z "$dev" ]; then
        echo "$1 $3 failed - - $(tail -1 "$work/err" | tr ' ' '_')" >>"$out"
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
    iops=$(fio --name=compare --filename="$dev" --rw="$3" --bs=4k --iodepth=32 \
        --ioengine=io_uring --direct=1 --time_based --runtime="$runtime" --ramp_time=1 \
        --output-format=terse --terse-version=3 |
        awk -F';' -v rw="$3" '{ if (rw == "randread") print $8; else print $49 }')
    busy >"$work/after"
    share=$(paste "$work/before" "$work/after" |
        awk '{ printf "%s=%.0f,", $1, 100 * ($5 - $2) / ($6 - $3) }')
    kill -TERM "$pid"
    wait "$pid"
    echo "$1 $3 ${iops:-failed} ${map:-none} ${share:-none}" >>"$out"
}

reverse=""
for a in "$@"; do
    reverse="$a $reverse"
done
for order in "$*" "$reverse" "$*" "$reverse"; do
    for a in $order; do
        for rw in randread randwrite; do
            one "${a%%=*}" "${a#*=}" "$rw"
        done
    done
done
rm -rf "$work"
