#!/usr/bin/env bash
# A single-node Ceph cluster for tests, benchmarks and demos, without systemd or containers:
# one monitor and one OSD (bluestore on a sparse file, or memstore), pool 'rbd' of size 1,
# everything under DIR, the monitor on a free port of 127.0.0.1 (the OSD picks its own there).
#
#   scripts/ceph-cluster.sh start DIR   # prints DIR/ceph.conf once the pool takes I/O
#   scripts/ceph-cluster.sh stop DIR    # stops the daemons by their pid files, removes DIR
#
# Clients use it with `CEPH_CONF=DIR/ceph.conf` or `rbd:rbd/IMAGE?conf=DIR/ceph.conf`; the
# admin key is in DIR/keyring, which the config names. CEPH_OBJECTSTORE=memstore keeps the OSD
# in RAM (slower here, but no 8 GiB sparse file). A start that fails stops what it started and
# removes DIR. Needs ceph-mon, ceph-osd, ceph-common (scripts/deps.sh installs them).
set -euo pipefail

usage() { echo "usage: $0 start|stop DIR" >&2; exit 2; }
[ $# -eq 2 ] || usage
cmd=$1
dir=$2

# Where the packaged object classes live (cls_rbd is required): /usr/lib/<multiarch>.
cls=$(ls /usr/lib/*/rados-classes/libcls_rbd.so /usr/lib*/rados-classes/libcls_rbd.so 2>/dev/null | head -1 || true)
libdir=${cls%/rados-classes/libcls_rbd.so}

stop() {
    local d=$1
    [ -d "$d" ] || return 0
    local pids=()
    for f in "$d"/run/*.pid; do
        [ -e "$f" ] || continue
        local p
        p=$(cat "$f" 2>/dev/null || true)
        # Only a process started from this directory's config: a stale pid file must not
        # name someone else's process.
        if [ -n "$p" ] && grep -qs -- "$d/ceph.conf" "/proc/$p/cmdline"; then
            kill -9 "$p" 2>/dev/null || true
            pids+=("$p")
        fi
    done
    for p in "${pids[@]}"; do
        # Wait for the process to be gone (bounded) so nothing writes into DIR after rm.
        for _ in $(seq 100); do
            kill -0 "$p" 2>/dev/null || break
            sleep 0.05
        done
    done
    rm -rf "$d"
}

case "$cmd" in
stop)
    stop "$dir"
    exit 0
    ;;
start) ;;
*) usage ;;
esac

for tool in ceph-mon ceph-osd ceph ceph-authtool monmaptool rbd; do
    command -v "$tool" >/dev/null || {
        echo "ceph-cluster: $tool not found: apt-get install ceph-mon ceph-osd ceph-common (scripts/deps.sh)" >&2
        exit 1
    }
done
[ -n "$libdir" ] || { echo "ceph-cluster: rados-classes (cls_rbd) not found: apt-get install ceph-osd" >&2; exit 1; }
if [ -e "$dir" ] && [ -n "$(ls -A "$dir" 2>/dev/null)" ]; then
    echo "ceph-cluster: $dir exists and is not empty" >&2
    exit 1
fi
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
trap 'status=$?; if [ $status -ne 0 ]; then echo "ceph-cluster: start failed; logs:" >&2; tail -n 20 "$dir"/log/*.log >&2 2>/dev/null || true; stop "$dir"; fi' EXIT
mkdir -p "$dir"/{run,log,mon,osd}

port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fsid=$(cat /proc/sys/kernel/random/uuid)
store=${CEPH_OBJECTSTORE:-bluestore}
conf=$dir/ceph.conf
cat > "$conf" <<CONF
[global]
fsid = $fsid
mon host = v2:127.0.0.1:$port
public addr = 127.0.0.1
ms bind msgr1 = false
ms bind ipv6 = false
auth cluster required = cephx
auth service required = cephx
auth client required = cephx
keyring = $dir/keyring
run dir = $dir/run
admin socket = $dir/run/\$name.asok
pid file = $dir/run/\$name.pid
log file = $dir/log/\$name.log
log to stderr = false
err to stderr = false
osd pool default size = 1
osd pool default min size = 1
osd pool default pg autoscale mode = off
mon allow pool size one = true
mon warn on pool no redundancy = false
mon data avail warn = 1
mon data avail crit = 0
osd crush chooseleaf type = 0
osd class dir = $libdir/rados-classes
erasure code dir = $libdir/ceph/erasure-code
plugin dir = $libdir/ceph
[mon]
mon data = $dir/mon
[osd]
osd data = $dir/osd
keyring = $dir/osd/keyring
osd objectstore = $store
osd memory target = 1073741824
bluestore block create = true
bluestore block size = 8589934592
bluestore fsck on mkfs = false
bluestore cache autotune = false
bluestore cache size = 268435456
memstore device bytes = 4294967296
CONF

ceph-authtool --create-keyring "$dir/keyring" --gen-key -n mon. --cap mon 'allow *' >/dev/null
ceph-authtool "$dir/keyring" --gen-key -n client.admin --cap mon 'allow *' --cap osd 'allow *' \
    --cap mgr 'allow *' >/dev/null
monmaptool --create --addv a "[v2:127.0.0.1:$port]" --fsid "$fsid" "$dir/monmap" >/dev/null
ceph-mon -c "$conf" --mkfs -i a --monmap "$dir/monmap" --keyring "$dir/keyring"
ceph-mon -c "$conf" -i a   # daemonises once it listens

ceph() { command ceph -c "$conf" --connect-timeout 20 "$@"; }
uuid=$(cat /proc/sys/kernel/random/uuid)
id=$(ceph osd new "$uuid")
ceph auth get-or-create "osd.$id" mon 'allow profile osd' mgr 'allow profile osd' osd 'allow *' \
    -o "$dir/osd/keyring"
ceph-osd -c "$conf" -i "$id" --mkfs --osd-uuid "$uuid" >/dev/null 2>&1 || {
    echo "ceph-cluster: ceph-osd --mkfs failed" >&2
    exit 1
}
ceph-osd -c "$conf" -i "$id"
ceph osd pool create rbd 32 32 >/dev/null 2>&1
# Both write to the pool, so they return once its placement groups are active: the readiness
# signal (without a manager, `ceph -s` shows no pools or PGs at all).
timeout 60 rbd -c "$conf" pool init rbd
timeout 60 rbd -c "$conf" create --size 4M rbd/.ready
timeout 60 rbd -c "$conf" rm --no-progress rbd/.ready
trap - EXIT
echo "$conf"
