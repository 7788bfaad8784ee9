#!/bin/sh
# Scenario ublk-recovery, guest side: map with the ublk frontend, mkfs.ext4, mount, write files;
# then kill -9 the map daemon with the filesystem mounted during a write (conv=fsync), check that `ls`
# reports the mapping dead and the device still exists, `blkwire map --recover /dev/ublkb0`, and
# the filesystem keeps working: the interrupted write completes, more files are written, every
# checksum verifies after a remount, fsck is clean, unmap. Checksums go to LAB-SHA256 lines.
# Then the same over udp:// to a target inside the guest, checking that `map --recover` fenced the
# dead daemon's sessions: its record names their queues, and the target no longer lists them.
#
# From the kernel command line (set by host.sh): lab.tcp_port, lab.export.
. /lab/lib.sh

host=10.0.2.2
: "${LAB_TCP_PORT:?lab.tcp_port= missing on the kernel command line}"
url="tcp://$host:$LAB_TCP_PORT/${LAB_EXPORT:-disk0}"
mnt=/mnt
dev=/dev/ublkb0

daemon_pid() { sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' /tmp/bw.out; }

write_set() { # DIR: files of assorted sizes
    mkdir -p "$1"
    dd if=/dev/urandom of="$1/random-4M.bin" bs=1M count=4 2>/dev/null
    i=0
    while [ $i -lt 16 ]; do
        head -c $((i * 797 + 1)) /dev/urandom >"$1/f$i"
        i=$((i + 1))
    done
}

run modprobe ublk_drv
run modprobe crc32c_generic
run modprobe ext4

bw map --frontend ublk --logfile $maplog "$url"
[ "$(tail -n1 /tmp/bw.out)" = $dev ] || fail "map printed '$(tail -n1 /tmp/bw.out)', expected $dev"
bw ls --json
pid=$(daemon_pid)
[ -n "$pid" ] || fail "no daemon pid in ls --json"
run mkfs.ext4 -q -F -L blkwire-lab $dev
run mount -t ext4 $dev "$mnt"
step "write files before the crash"
echo "hello from ublk, $(uname -r)" >"$mnt/hello.txt"
write_set "$mnt/before"
run sync

step "kill -9 the map daemon (pid $pid) under the mounted filesystem, during a write"
(dd if=/dev/urandom of="$mnt/crash.bin" bs=64k count=128 conv=fsync 2>/dev/null && echo ok >/tmp/crash.done) &
crash_writer=$!
sleep 0.5
if kill -0 $crash_writer 2>/dev/null; then info "the write was running when the daemon was killed"; fi
kill -9 "$pid"
i=0
while [ -d /proc/"$pid" ]; do
    i=$((i + 1))
    [ $i -le 100 ] || fail "daemon $pid did not die"
    sleep 0.1
done
bw ls --json
grep -q '"state": *"dead"' /tmp/bw.out || fail "ls does not report the mapping dead"
[ -e /sys/block/ublkb0 ] || fail "$dev disappeared when its daemon died (USER_RECOVERY should keep it)"
info "daemon $pid killed; $dev still exists, ls reports it dead"

step "write while no daemon serves the device (waits for recovery)"
(dd if=/dev/urandom of="$mnt/during.bin" bs=64k count=32 2>/dev/null && sync && echo ok >/tmp/during.done) &
writer=$!
sleep 1

bw map --recover $dev --logfile $maplog
[ "$(tail -n1 /tmp/bw.out)" = $dev ] || fail "map --recover printed '$(tail -n1 /tmp/bw.out)'"
bw ls --json
grep -q '"state": *"running"' /tmp/bw.out || fail "ls does not report the recovered mapping running"
info "recovered by pid $(daemon_pid)"

step "the write started during the outage completes"
wait $writer || fail "the write during the outage failed"
[ -f /tmp/during.done ] || fail "the write during the outage did not finish"

step "the write interrupted by the crash completes"
wait $crash_writer || fail "the write interrupted by the crash failed"
[ -f /tmp/crash.done ] || fail "the write interrupted by the crash did not finish"

step "write files after recovery"
write_set "$mnt/after"
run sync

step "checksums"
(cd "$mnt" && find . -type f ! -name lost+found | sort | xargs sha256sum) >/tmp/sums
while read -r sum path; do
    emit SHA256 "$sum ${path#.}"
done </tmp/sums
info "$(wc -l </tmp/sums) files"
run umount "$mnt"
run e2fsck -fn $dev
echo 3 >/proc/sys/vm/drop_caches
run mount -t ext4 -o ro $dev "$mnt"
step "verify checksums after re-reading from the target"
(cd "$mnt" && sha256sum -c /tmp/sums >/tmp/check 2>&1) || {
    grep -v ': OK$' /tmp/check | head -n 10
    fail "checksums differ after re-reading from the target"
}
run umount "$mnt"
bw unmap $dev
[ ! -e /sys/block/ublkb0 ] || fail "/sys/block/ublkb0 still exists after unmap"
info "unmapped"

# The dead daemon's sessions are fenced (PROTOCOL.md §2.6): the record names the target's queue of
# each device queue, and `map --recover` ends those queues, waiting until none of their writes still
# runs, before its own sessions send anything. Over udp:// a session nobody logs out would otherwise
# stay on the target until its idle timeout (~60 s). A target inside the guest: udp:// for the
# mapping, tcp:// for `stats`.
serve /tmp/userve.log --listen udp://127.0.0.1:7791 --listen tcp://127.0.0.1:7792 --export u=mem:64M
userve=$served
# The session ids in the output of `bw stats --json` (/tmp/bw.out).
listed_sessions() {
    grep -o '"session": *[0-9]*' /tmp/bw.out | grep -o '[0-9]*$' | sort -u | tr '\n' ' '
}
bw map --frontend ublk --logfile $maplog udp://127.0.0.1:7791/u
udev=$(tail -n1 /tmp/bw.out)
urec=${BLKWIRE_RUN_DIR:-/run/blkwire}/devices/${udev#/dev/}.json
grep -q '"queue_refs"' "$urec" || fail "the record of $udev names no target queues: $(cat "$urec")"
run dd if=/dev/urandom of=/tmp/u.bin bs=64k count=32
run dd if=/tmp/u.bin of="$udev" bs=64k conv=fsync
bw stats --json tcp://127.0.0.1:7792
old=$(listed_sessions)
[ -n "$old" ] || fail "the target lists no session while $udev is mapped"
upid=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$urec")
[ -n "$upid" ] || fail "no pid in $urec"
step "kill -9 the map daemon of $udev (pid $upid; target sessions: $old)"
kill -9 "$upid"
i=0
while [ -d /proc/"$upid" ]; do
    i=$((i + 1))
    [ $i -le 100 ] || fail "daemon $upid did not die"
    sleep 0.1
done
# A write that waits for the recovery (the kernel holds it, then reissues it to the new daemon).
(dd if=/tmp/u.bin of="$udev" bs=64k count=16 seek=32 conv=fsync 2>/dev/null && echo ok >/tmp/u.done) &
uwriter=$!
sleep 1
bw map --recover "$udev" --logfile $maplog
step "the dead daemon's sessions ($old) are gone from the target"
bw stats --json tcp://127.0.0.1:7792
now=$(listed_sessions)
for s in $old; do
    case " $now " in *" $s "*) fail "session $s of the dead daemon is still on the target after map --recover (sessions now: $now)" ;; esac
done
grep -q '"queue_refs"' "$urec" || fail "the recovered record of $udev names no target queues: $(cat "$urec")"
grep -q "$udev: the dead daemon's .* are closed with none of their requests running" $maplog ||
    fail "map --recover of $udev did not log the fence"
info "map --recover fenced the dead daemon's sessions ($old); the target now lists: $now"
wait $uwriter || fail "the write during the outage of $udev failed"
[ -f /tmp/u.done ] || fail "the write during the outage of $udev did not finish"
echo 3 >/proc/sys/vm/drop_caches
run dd if="$udev" of=/tmp/u.back bs=64k count=32
[ "$(sha256sum </tmp/u.bin)" = "$(sha256sum </tmp/u.back)" ] || fail "what was written before the crash reads back different"
run dd if="$udev" of=/tmp/u.back bs=64k count=16 skip=32
[ "$(head -c 1048576 /tmp/u.bin | sha256sum)" = "$(sha256sum </tmp/u.back)" ] || fail "the write held over the crash reads back different"
bw unmap "$udev"
[ ! -e "/sys/block/${udev#/dev/}" ] || fail "$udev still exists after unmap"
kill $userve
[ -f $maplog ] && sed 's/^/map.log| /' $maplog
info "$udev over udp://: recovered after kill -9 with the dead daemon's sessions fenced; data verified; unmapped"
