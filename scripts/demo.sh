#!/usr/bin/env bash
# The demo: a target with two 256 MiB RAM exports on loopback, a 64 MiB file uploaded and read
# back (checksums compared), the export cloned inside the target (server-side copy, checksums
# compared), a short benchmark, then a clean stop.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=target/release/blkwire
work=$(mktemp -d)
pid=""
cleanup() {
    [ -n "$pid" ] && kill "$pid" 2>/dev/null && wait "$pid" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

# Bold headings on a terminal only: no escape codes in a log or a pipe.
if [ -t 1 ]; then
    step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
else
    step() { printf '\n== %s\n' "$*"; }
fi

step "start a target: blkwire serve --listen tcp://127.0.0.1:0 --export demo=mem:256M --export clone=mem:256M"
mkfifo "$work/ready"
$BIN serve --listen tcp://127.0.0.1:0 --export demo=mem:256M --export clone=mem:256M \
    --log-level warn >"$work/ready" &
pid=$!
# The target prints 'listening URL' once it accepts connections.
read -r -t 20 _ base <"$work/ready" || { echo "demo: target did not start" >&2; exit 1; }
url="$base/demo"
echo "serving $url"

step "blkwire info $url"
$BIN info "$url"

step "upload a 64 MiB file: blkwire cp demo.img $url"
head -c $((48 << 20)) /dev/urandom >"$work/demo.img"
head -c $((16 << 20)) /dev/zero >>"$work/demo.img"
$BIN cp "$work/demo.img" "$url"

step "download it again: blkwire cp $url back.img"
$BIN cp "$url" "$work/back.img"
want=$(sha256sum <"$work/demo.img" | cut -d' ' -f1)
got=$(head -c $((64 << 20)) "$work/back.img" | sha256sum | cut -d' ' -f1)
if [ "$want" = "$got" ]; then echo "sha256 match: $want"; else echo "sha256 MISMATCH: $want != $got" >&2; exit 1; fi

step "clone it inside the target (no data crosses the network): blkwire cp $url $base/clone"
$BIN cp "$url" "$base/clone"
$BIN cp "$base/clone" "$work/clone.img"
got=$(head -c $((64 << 20)) "$work/clone.img" | sha256sum | cut -d' ' -f1)
if [ "$want" = "$got" ]; then echo "sha256 match: $want"; else echo "sha256 MISMATCH: $want != $got" >&2; exit 1; fi

step "benchmark: 4k random reads, 32 in flight, 3 s"
$BIN bench "$url" --rw randread --bs 4k --iodepth 32 --jobs 1 --runtime 3
step "benchmark: 4k random reads, 1 in flight (latency), 3 s"
$BIN bench "$url" --rw randread --bs 4k --iodepth 1 --jobs 1 --runtime 3

step "stop the target (SIGTERM)"
kill -TERM "$pid"
wait "$pid"
pid=""
echo "target stopped cleanly. The binary is $BIN (install -m 755 $BIN /usr/local/bin/ puts it on"
echo "your PATH). Next: README.md, docs/ARCHITECTURE.md, docs/PROTOCOL.md."
