#!/bin/sh
# Scenario ublk-recovery, guest side: map with the ublk frontend, mkfs.ext4, mount, write files;
# then stop and kill -9 the map daemon with the filesystem mounted while a write (conv=fsync) waits
# for it, check that `ls` reports the mapping dead and the device still exists, start a write the
# device holds, `blkwire map --recover /dev/ublkb0`, and the filesystem keeps working: both
# writes complete, more files are written, every checksum verifies after a remount, fsck is
# clean, unmap. Checksums go to LAB-SHA256 lines.
# Then the same over udp:// to a target inside the guest, checking that `map --recover` fenced the
# dead daemon's sessions: its record names their queues, and the target no longer lists them;
# the export grows while the device has no daemon, and the recovery still takes it.
#
# From the kernel command line (set by host.sh): lab.tcp_port, lab.export.
. /lab/lib.sh

host=10.0.2.2
: "${LAB_TCP_PORT:?lab.tcp_port= missing on the kernel command line}"
url="tcp://$host:$LAB_TCP_PORT/${LAB_EXPORT:-disk0}"
mnt=/mnt
dev=/dev/ublkb0

daemon_pid() { sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' /tmp/bw.out; }

# held_in_fsync PID WHAT: waits (bounded, 20 s) until process PID (a busybox `dd conv=fsync`)
# sleeps uninterruptibly in fsync(2) (syscall 74 on x86_64): it has issued its writes and the
# device has not completed them. This is what the checks of a write "held over the outage"
# need; a fixed sleep only hopes for it. Fails the scenario if PID ends first or never gets there.
held_in_fsync() {
    i=0
    while :; do
        st=$(sed 's/^.*) //' /proc/"$1"/stat 2>/dev/null | cut -d' ' -f1)
        case $st in '' | Z | X) fail "$2 (pid $1) ended before it was seen waiting for the device" ;; esac
        sc=$(cut -d' ' -f1 /proc/"$1"/syscall 2>/dev/null) || sc=''
        [ "$st" = D ] && [ "$sc" = 74 ] && break
        i=$((i + 1))
        [ $i -le 400 ] || fail "$2 (pid $1) was never seen waiting in fsync for the device (state '$st', syscall '$sc')"
        sleep 0.05
    done
    info "$2 (pid $1) waits in fsync for the device"
}

kill_daemon() { # PID: kill -9 it and wait (10 s at most) until it is gone
    kill -9 "$1"
    i=0
    while [ -d /proc/"$1" ]; do
        i=$((i + 1))
        [ $i -le 100 ] || fail "daemon $1 did not die"
        sleep 0.1
    done
}

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
# Stopped first, so that the write surely waits for it (its requests handed to the daemon, not
# answered) when it is killed.
kill -STOP "$pid"
dd if=/dev/urandom of="$mnt/crash.bin" bs=64k count=128 conv=fsync 2>/dev/null &
crash_writer=$!
held_in_fsync $crash_writer "the write before the crash"
kill_daemon "$pid"
bw ls --json
grep -q '"state": *"dead"' /tmp/bw.out || fail "ls does not report the mapping dead"
[ -e /sys/block/ublkb0 ] || fail "$dev disappeared when its daemon died (USER_RECOVERY should keep it)"
info "daemon $pid killed; $dev still exists, ls reports it dead"

step "write while no daemon serves the device (waits for recovery)"
dd if=/dev/urandom of="$mnt/during.bin" bs=64k count=32 conv=fsync 2>/dev/null &
writer=$!
held_in_fsync $writer "the write during the outage"

bw map --recover $dev --logfile $maplog
[ "$(tail -n1 /tmp/bw.out)" = $dev ] || fail "map --recover printed '$(tail -n1 /tmp/bw.out)'"
bw ls --json
grep -q '"state": *"running"' /tmp/bw.out || fail "ls does not report the recovered mapping running"
info "recovered by pid $(daemon_pid)"

step "the write started during the outage completes"
wait $writer || fail "the write during the outage failed"

step "the write interrupted by the crash completes"
wait $crash_writer || fail "the write interrupted by the crash failed"

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
# A file export, so that it can grow while the mapping is down (below).
run truncate -s 64M /tmp/u.img
serve /tmp/userve.log --listen udp://127.0.0.1:7791 --listen tcp://127.0.0.1:7792 --export u=file:/tmp/u.img
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
kill_daemon "$upid"
# A write that waits for the recovery (the kernel holds it, then reissues it to the new daemon).
dd if=/tmp/u.bin of="$udev" bs=64k count=16 seek=32 conv=fsync 2>/dev/null &
uwriter=$!
held_in_fsync $uwriter "the write during the outage of $udev"
# The export grows meanwhile: the device keeps its own size through the recovery (a recovery
# sets no parameters), so the larger export still serves it (map --recover refused it once).
bw export resize u 128M
bw map --recover "$udev" --logfile $maplog
grep -q '"size": *67108864' "$urec" || fail "the recovered record of $udev does not keep the device's size: $(cat "$urec")"
[ "$(cat "/sys/block/${udev#/dev/}/size")" = 131072 ] || fail "$udev changed size in the recovery"
step "the dead daemon's sessions ($old) are gone from the target"
bw stats --json tcp://127.0.0.1:7792
now=$(listed_sessions)
for s in $old; do
    case " $now " in *" $s "*) fail "session $s of the dead daemon is still on the target after map --recover (sessions now: $now)" ;; esac
done
grep -q '"queue_refs"' "$urec" || fail "the recovered record of $udev names no target queues: $(cat "$urec")"
grep -q "$udev: asked the target .* to close the dead daemon's .* queue(s); it answered" $maplog ||
    fail "map --recover of $udev did not log the fence"
info "map --recover fenced the dead daemon's sessions ($old); the target now lists: $now"
wait $uwriter || fail "the write during the outage of $udev failed"
echo 3 >/proc/sys/vm/drop_caches
run dd if="$udev" of=/tmp/u.back bs=64k count=32
[ "$(sha256sum </tmp/u.bin)" = "$(sha256sum </tmp/u.back)" ] || fail "what was written before the crash reads back different"
run dd if="$udev" of=/tmp/u.back bs=64k count=16 skip=32
[ "$(head -c 1048576 /tmp/u.bin | sha256sum)" = "$(sha256sum </tmp/u.back)" ] || fail "the write held over the crash reads back different"
# A process holds the device open without O_EXCL (as a VM or dd does; unmap cannot see it):
# unmap still ends, the device goes, and the holder keeps a dead descriptor. (DEL_DEV waited
# for the holder without bound.)
rm -f /tmp/held
sh -c "exec 3<$udev; echo held >/tmp/held; exec sleep 600" &
holder=$!
wait_for_file /tmp/held "the opening of $udev by a holder"
bw unmap "$udev"
[ ! -e "/sys/block/${udev#/dev/}" ] || fail "$udev still exists after unmap"
kill $holder
kill $userve
[ -f $maplog ] && sed 's/^/map.log| /' $maplog
info "$udev over udp://: recovered after kill -9 with the dead daemon's sessions fenced; data verified; unmapped"
