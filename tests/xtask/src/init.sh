#!/bin/busybox sh
# shellcheck shell=sh
# /init of the ublkd test VM. Loads the kernel modules the tests need (with their parameters from
# the kernel command line, which busybox insmod does not read by itself), mounts the host's root
# read-only over 9p (with `ublkd.overlay=1`, under a tmpfs overlay instead, so that the guest may
# write anywhere: the Kubernetes tier installs nothing on the host), mounts the run directory
# writable at its own host path, chroots and runs the command, records its exit status and powers
# off.
/bin/busybox --install -s /bin
export PATH=/bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "ublkd-vm: init started (uptime $(cut -d' ' -f1 /proc/uptime)s)"

# Word splitting is what these loops want: modules.order holds one path per line (no spaces), and
# /proc/cmdline is one line of space-separated words.
# shellcheck disable=SC2013
for m in $(cat /modules.order); do
    name=$(basename "$m" .ko | tr - _)
    params=""
    for word in $(cat /proc/cmdline); do
        case "$word" in
            "$name".*=*) params="$params ${word#"$name".}" ;;
        esac
    done
    # shellcheck disable=SC2086 # unquoted on purpose: each name=value is its own insmod argument
    insmod "/lib/modules/$m" $params || echo "ublkd-vm: insmod $m failed"
done
run_dir=""
overlay=0
host_tmp=0
# shellcheck disable=SC2013 # the words of the kernel command line, as above
for word in $(cat /proc/cmdline); do
    case "$word" in
        ublkd.run=*) run_dir="${word#ublkd.run=}" ;;
        ublkd.overlay=1) overlay=1 ;;
        ublkd.hosttmp=1) host_tmp=1 ;;
    esac
done

fail() {
    echo "ublkd-vm: $*"
    echo "UBLKD-VM-EXIT=250"
    poweroff -f
}

# Loopback, for daemons the tests talk to over 127.0.0.1 (metrics, TCP gRPC).
ip link set lo up 2>/dev/null || ifconfig lo 127.0.0.1 up

mkdir -p /newroot
if [ "$overlay" = 1 ]; then
    mkdir -p /lower /rw
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /lower || fail "cannot mount host root"
    mount -t tmpfs -o mode=0755 rw /rw || fail "cannot mount the overlay's tmpfs"
    mkdir -p /rw/upper /rw/work
    mount -t overlay -o lowerdir=/lower,upperdir=/rw/upper,workdir=/rw/work root /newroot || fail "cannot mount the writable root overlay"
else
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,cache=loose,msize=512000 hostroot /newroot || fail "cannot mount host root"
fi
mount -t proc proc /newroot/proc
mount -t sysfs sys /newroot/sys
mount -t devtmpfs dev /newroot/dev
mkdir -p /newroot/dev/pts /newroot/dev/shm 2>/dev/null
mount -t tmpfs shm /newroot/dev/shm
mount -t tmpfs run /newroot/run
# the bench counts syscalls with a trigger on raw_syscalls:sys_enter
mount -t tracefs tracefs /newroot/sys/kernel/tracing
# The workspace or the run directory under the host's /tmp (ublkd.hosttmp=1): keep it visible,
# scratch under /run. Else a tmpfs of the guest's own on /tmp.
if [ "$host_tmp" = 1 ]; then
    scratch=/run/tmp
    mkdir -p /newroot/run/tmp
else
    scratch=/tmp
    mount -t tmpfs tmp /newroot/tmp
fi
mount -t 9p -o trans=virtio,version=9p2000.L,msize=512000 xfer "/newroot$run_dir" || fail "cannot mount run dir $run_dir"
echo "ublkd-vm: modules loaded, running command (uptime $(cut -d' ' -f1 /proc/uptime)s)"

if [ "$overlay" = 1 ]; then
    # switch_root, not chroot: container runtimes pivot_root into a container and exec into it
    # through its mount namespace's root, which under a chroot stays the initramfs (the first
    # real cluster had every exec fail with "no such file" for binaries that were there).
    # Nothing of the initramfs is left to power off with, so the command's shell does it, then
    # spins in a builtin until the power goes: a `sleep` binary, loaded from the root being
    # shut down, failed and ended init (a panic after the exit status).
    # shellcheck disable=SC2016 # expanded by that shell, in the new root
    exec switch_root /newroot /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
        HOME=/root TMPDIR="$scratch" TERM=dumb UBLKD_VM=1 UBLKD_VM_RUN="$run_dir" \
        /bin/sh -c '/bin/sh "$UBLKD_VM_RUN/cmd.sh"; rc=$?; echo "$rc" > "$UBLKD_VM_RUN/rc"; sync; echo "UBLKD-VM-EXIT=$rc"; echo o > /proc/sysrq-trigger; while :; do :; done'
fi
chroot /newroot /usr/bin/env -i PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    HOME=/root TMPDIR="$scratch" TERM=dumb UBLKD_VM=1 UBLKD_VM_RUN="$run_dir" \
    /bin/sh "$run_dir/cmd.sh"
rc=$?
echo "$rc" > "/newroot$run_dir/rc"
sync
echo "UBLKD-VM-EXIT=$rc"
poweroff -f
