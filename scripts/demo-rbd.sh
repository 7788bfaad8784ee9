#!/usr/bin/env bash
# The RBD demo: a one-node Ceph cluster under a temporary directory (scripts/ceph-cluster.sh),
# a 256 MiB image served by blkwire (rbd:rbd/demo), a 64 MiB file uploaded through blkwire and
# read back both through blkwire and through librbd itself (`rbd export`), checksums compared,
# a short benchmark, then the target and the cluster stopped.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/blkwire
work=$(mktemp -d)
pid=""
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    scripts/ceph-cluster.sh stop "$work/ceph" || true
    rm -rf "$work"
}
trap cleanup EXIT

if [ -t 1 ]; then
    step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
    step() { printf '\n== %s\n' "$*"; }
fi

step "start a one-node Ceph cluster: scripts/ceph-cluster.sh start $work/ceph"
conf=$(scripts/ceph-cluster.sh start "$work/ceph")
echo "cluster up: $conf"
rbd -c "$conf" create --size 256M rbd/demo

spec="rbd:rbd/demo?conf=$conf"
step "serve it: blkwire serve --listen tcp://127.0.0.1:0 --export demo=$spec"
mkfifo "$work/ready"
$BIN serve --listen tcp://127.0.0.1:0 --rpc-socket none --export "demo=$spec" --log-level warn >"$work/ready" &
pid=$!
read -r -t 30 _ base <"$work/ready" || { echo "demo-rbd: target did not start" >&2; exit 1; }
url="$base/demo"
$BIN info "$url"

step "upload a 64 MiB file: blkwire cp demo.img $url"
head -c $((64 << 20)) /dev/urandom >"$work/demo.img"
$BIN cp --no-progress "$work/demo.img" "$url"
want=$(sha256sum <"$work/demo.img" | cut -d' ' -f1)

step "read it back through blkwire, and through librbd (rbd export)"
$BIN cp --no-progress "$url" "$work/back.img"
got=$(head -c $((64 << 20)) "$work/back.img" | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] && echo "blkwire: sha256 match $want" || { echo "sha256 MISMATCH via blkwire" >&2; exit 1; }
rbd -c "$conf" export --no-progress rbd/demo "$work/rbd-export.img"
got=$(head -c $((64 << 20)) "$work/rbd-export.img" | sha256sum | cut -d' ' -f1)
[ "$want" = "$got" ] && echo "rbd export: sha256 match $want" || { echo "sha256 MISMATCH via rbd export" >&2; exit 1; }

step "benchmark: 4k random reads, 32 in flight, 3 s"
$BIN bench "$url" --rw randread --bs 4k --iodepth 32 --runtime 3 --size 64M

step "stop the target and the cluster"
kill -TERM "$pid"
wait "$pid"
pid=""
echo "done. bench/rbd-compare.sh compares blkwire with librbd itself; docs/ARCHITECTURE.md"
echo "('The rbd: backend') says how it works."
