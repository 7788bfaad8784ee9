#!/bin/sh
# Scenario ublk, guest side: `blkwire map --frontend ublk` against blkwire on the host, then
# mkfs.ext4, mount, write files, sync, umount, fsck, re-read them with caches dropped, unmap
# (refused while a mount in another mount namespace, or a mounted partition, holds the device);
# a stop signal to the map daemon of a mounted device is refused, and the device stops once
# unmounted; a write the target still runs at its timeout waits for the give-up fence.
# The checksums go to the log (LAB-SHA256 lines) for the host to check against what blkwire stored.
#
# From the kernel command line (set by host.sh): lab.tcp_port, lab.export.
. /lab/lib.sh

host=10.0.2.2
: "${LAB_TCP_PORT:?lab.tcp_port= missing on the kernel command line}"
url="tcp://$host:$LAB_TCP_PORT/${LAB_EXPORT:-disk0}"
mnt=/mnt

run modprobe ublk_drv
run modprobe crc32c_generic
run modprobe ext4
[ -e /dev/ublk-control ] || fail "/dev/ublk-control is missing after modprobe ublk_drv"

bw map --frontend ublk --logfile $maplog "$url"
dev=$(tail -n1 /tmp/bw.out)
[ "$dev" = /dev/ublkb0 ] || fail "map printed '$dev', expected /dev/ublkb0"
info "$dev: $(blockdev --getsize64 "$dev") bytes, logical block $(blockdev --getss "$dev"), $(ls /sys/block/ublkb0/mq | wc -l) queue(s)"
bw ls --json
grep -q '"frontend": *"ublk"' /tmp/bw.out || fail "ls --json does not show the ublk mapping"

q=/sys/block/ublkb0/queue
info "discard_max_bytes $(cat $q/discard_max_bytes), write_zeroes_max_bytes $(cat $q/write_zeroes_max_bytes), max_sectors_kb $(cat $q/max_sectors_kb), write_cache '$(cat $q/write_cache)', fua $(cat $q/fua), rotational $(cat $q/rotational)"
[ "$(cat $q/discard_max_bytes)" -gt 0 ] || fail "the device takes no discards although the export trims"
# DISCARD (-> TRIM on the target) of the whole device; mkfs discards it again.
run blkdiscard "$dev"
run mkfs.ext4 -q -F -L blkwire-lab "$dev"
run mount -t ext4 "$dev" "$mnt"
step "unmap refuses a mounted device"
if blkwire unmap "$dev" >/tmp/bw.out 2>&1; then fail "unmap of a mounted device succeeded"; fi
grep -q "is mounted on" /tmp/bw.out || fail "unexpected unmap error: $(cat /tmp/bw.out)"

write_test_files "$mnt" "hello from ublk, $(uname -r)"

run umount "$mnt"
run e2fsck -fn "$dev"

verify_after_reread "$dev" "$mnt"

# A mount in another mount namespace (a container's) is not in our /proc/self/mountinfo: the
# exclusive-open probe finds it, for unmap and for the daemon's own SIGTERM.
step "a mount in another mount namespace: unmap refuses, the daemon serves on after SIGTERM"
bw ls --json
mappid=$(tr -d '\n' </tmp/bw.out | sed -n 's/.*"pid": *\([0-9]*\).*/\1/p')
[ -n "$mappid" ] || fail "no pid in ls --json: $(cat /tmp/bw.out)"
rm -f /tmp/held
unshare -m sh -c "mount -t ext4 -o ro $dev $mnt && touch /tmp/held && exec sleep 600" &
holder=$!
wait_for_file /tmp/held "the mount in another mount namespace"
grep -q " $mnt " /proc/self/mountinfo && fail "the other namespace's mount shows in ours"
if blkwire unmap "$dev" >/tmp/bw.out 2>&1; then fail "unmap of a device mounted in another mount namespace succeeded"; fi
grep -q "is in use" /tmp/bw.out || fail "unexpected unmap error: $(cat /tmp/bw.out)"
kill -TERM "$mappid"
# The daemon waits up to 2 s for a hold to go before it refuses, and logs the refusal.
i=0
until grep -q "still serving it" $maplog; do
    i=$((i + 1))
    [ $i -le 100 ] || fail "the map daemon did not log its refusal: $(tail -n3 $maplog)"
    sleep 0.1
done
kill -0 "$mappid" 2>/dev/null || fail "the map daemon exited on SIGTERM with its device mounted in another namespace"
[ -e /sys/block/ublkb0 ] || fail "/sys/block/ublkb0 is gone after a refused SIGTERM"
echo 3 >/proc/sys/vm/drop_caches
run dd if="$dev" of=/dev/null bs=64k count=16 skip=1000
info "mounted in another mount namespace: unmap refused ($(cat /tmp/bw.out)), SIGTERM refused, still served"
kill $holder
wait $holder || true

# The SIGTERM it refused stands: released, the daemon stops by itself (it probes each second),
# so an unmap here would race it. Wait for it to go, and for what it leaves: nothing.
step "released, the map daemon stops as its SIGTERM asked"
i=0
while kill -0 "$mappid" 2>/dev/null; do
    i=$((i + 1))
    [ $i -le 300 ] || fail "the map daemon still runs 30 s after its device was released"
    sleep 0.1
done
grep -q "released after a stop signal" $maplog || fail "the map daemon did not log why it stopped: $(tail -n3 $maplog)"
[ ! -e /sys/block/ublkb0 ] || fail "/sys/block/ublkb0 still exists after its daemon stopped"
bw ls --json
[ "$(tr -d ' \n' </tmp/bw.out)" = "{}" ] || fail "ls --json still lists a mapping after its daemon stopped"
info "unmapped by the daemon itself once released"

# Failures leave nothing behind; read-only mappings refuse writes; --dev-num picks the device.
step "map of an unknown export fails with one line and creates no device"
if blkwire map --frontend ublk "tcp://$host:$LAB_TCP_PORT/nosuch" >/tmp/bw.out 2>&1; then
    fail "map of an unknown export succeeded"
fi
[ "$(wc -l </tmp/bw.out)" = 1 ] || fail "not one line: $(cat /tmp/bw.out)"
ls /sys/block | grep -q ublkb && fail "a ublk device was left behind: $(ls /sys/block)"
info "unknown export: $(cat /tmp/bw.out)"

bw map --frontend ublk --readonly --dev-num 3 --logfile $maplog "$url"
[ "$(tail -n1 /tmp/bw.out)" = /dev/ublkb3 ] || fail "map --dev-num 3 printed '$(tail -n1 /tmp/bw.out)'"
[ "$(blockdev --getro /dev/ublkb3)" = 1 ] || fail "/dev/ublkb3 is not read-only"
step "a read-only mapping refuses writes"
if dd if=/dev/zero of=/dev/ublkb3 bs=4k count=1 conv=fsync 2>/dev/null; then
    fail "a write to the read-only mapping succeeded"
fi
run mount -t ext4 -o ro /dev/ublkb3 "$mnt"
(cd "$mnt" && sha256sum -c /tmp/sums >/tmp/check 2>&1) || fail "checksums differ on the read-only mapping"
run umount "$mnt"
bw unmap /dev/ublkb3
[ ! -e /sys/block/ublkb3 ] || fail "/sys/block/ublkb3 still exists after unmap"
info "read-only mapping on /dev/ublkb3: writes refused, files verified, unmapped"

# ublk over udp:// (datagrams: fragments, CRC, credits under the kernel's own I/O pattern), to a
# target inside the guest on its loopback.
serve /tmp/userve.log --listen udp://127.0.0.1:7791 --export u=mem:64M
userve=$served
bw map --frontend ublk --logfile $maplog udp://127.0.0.1:7791/u
udev=$(tail -n1 /tmp/bw.out)
run dd if=/dev/urandom of=/tmp/u.bin bs=64k count=32
run dd if=/tmp/u.bin of="$udev" bs=64k conv=fsync
echo 3 >/proc/sys/vm/drop_caches
run dd if="$udev" of=/tmp/u.back bs=64k count=32
[ "$(sha256sum </tmp/u.bin)" = "$(sha256sum </tmp/u.back)" ] || fail "2 MiB written over udp:// read back different"
# A filesystem on a partition: the whole disk is not in mountinfo, the partition's claim holds it.
step "unmap refuses a device whose partition is mounted"
# An MBR with one partition, type 0x83, from sector 2048 to the end (129024 sectors of 64 MiB).
{
    head -c 446 /dev/zero
    printf '\000\000\000\000\203\000\000\000\000\010\000\000\000\370\001\000'
    head -c 48 /dev/zero
    printf '\125\252'
} >/tmp/mbr
[ "$(wc -c </tmp/mbr)" = 512 ] || fail "the MBR is $(wc -c </tmp/mbr) bytes"
run dd if=/tmp/mbr of="$udev" bs=512 count=1 conv=fsync
run blockdev --rereadpt "$udev"
[ -b "${udev}p1" ] || fail "${udev}p1 did not appear: $(ls /sys/block/${udev#/dev/})"
run mkfs.ext4 -q -F "${udev}p1"
run mount -t ext4 "${udev}p1" "$mnt"
if blkwire unmap "$udev" >/tmp/bw.out 2>&1; then fail "unmap of a device with a mounted partition succeeded"; fi
grep -q "is in use" /tmp/bw.out || fail "unexpected unmap error: $(cat /tmp/bw.out)"
info "partition ${udev}p1 mounted: unmap refused: $(cat /tmp/bw.out)"
run umount "$mnt"
bw unmap "$udev"
[ ! -e "/sys/block/${udev#/dev/}" ] || fail "$udev still exists after unmap"
kill $userve
info "$udev over udp://: 2 MiB written, read back after dropping caches, identical; unmapped"

# A stop signal to the daemon of a mounted device is refused: the filesystem keeps working, and
# the device stops by itself once unmounted (the way a shutdown's SIGTERM, then umount, goes),
# with everything written on the target. A target inside the guest.
serve /tmp/tserve.log --listen tcp://127.0.0.1:7793 --export t=mem:64M
tserve=$served
bw map --frontend ublk --logfile $maplog tcp://127.0.0.1:7793/t
tdev=$(tail -n1 /tmp/bw.out)
trec=${BLKWIRE_RUN_DIR:-/run/blkwire}/devices/${tdev#/dev/}.json
tpid=$(sed -n 's/.*"pid": *\([0-9]*\).*/\1/p' "$trec" 2>/dev/null || true)
[ -n "$tpid" ] && [ -d /proc/"$tpid" ] || fail "no live map daemon in the record of $tdev: $(cat "$trec" 2>&1)"
# alive PID: the process exists and is not a zombie.
alive() { [ -d /proc/"$1" ] && [ "$(sed 's/^.*) //' /proc/"$1"/stat 2>/dev/null | cut -d' ' -f1)" != Z ]; }
run mkfs.ext4 -q -F "$tdev"
run mount -t ext4 "$tdev" "$mnt"
run dd if=/dev/urandom of="$mnt/before-signal.bin" bs=64k count=16 conv=fsync
step "SIGTERM to the map daemon (pid $tpid) while $tdev is mounted"
kill -TERM "$tpid"
# The refusal is logged, by this daemon (an earlier one refused for the same device name): waited
# for (10 s at most), not slept on. The daemon first gives a mount 2 s to go (RELEASE_GRACE).
refusal="blkwire-map\[$tpid\] warn: signal 15: $tdev is in use"
i=0
until grep -q "$refusal" $maplog; do
    i=$((i + 1))
    alive "$tpid" || fail "the map daemon exited on SIGTERM with $tdev mounted: $(tail -n 3 $maplog)"
    [ $i -le 100 ] || fail "no refusal of the signal in the map log: $(tail -n 3 $maplog)"
    sleep 0.1
done
[ -e "/sys/block/${tdev#/dev/}" ] || fail "$tdev went away on a refused signal"
info "SIGTERM refused: $(grep "$refusal" $maplog | tail -n1)"
run dd if=/dev/urandom of="$mnt/after-signal.bin" bs=64k count=16 conv=fsync
(cd "$mnt" && sha256sum before-signal.bin after-signal.bin) >/tmp/tsums || fail "checksums of the files on $tdev"
released="blkwire-map\[$tpid\] info: released after a stop signal: stopping $tdev"
# While mounted the daemon must keep serving: it asks every second whether the device was
# released, so three seconds are three answers of "still held" (a time that must pass, not a
# wait for something to happen).
step "$tdev still mounted: the daemon keeps serving it"
sleep 3
alive "$tpid" || fail "the map daemon stopped while $tdev was still mounted: $(tail -n 3 $maplog)"
[ -e "/sys/block/${tdev#/dev/}" ] || fail "$tdev went away while mounted"
! grep -q "$released" $maplog || fail "the daemon took $tdev for released while it was mounted"
run umount "$mnt"
step "the daemon stops $tdev by itself once it is released (20 s at most)"
i=0
while alive "$tpid"; do
    i=$((i + 1))
    [ $i -le 200 ] || fail "the map daemon still runs 20 s after $tdev was unmounted: $(tail -n 3 $maplog)"
    sleep 0.1
done
[ ! -e "/sys/block/${tdev#/dev/}" ] || fail "$tdev still exists after its daemon stopped"
[ ! -e "$trec" ] || fail "the record of $tdev is left after its daemon stopped: $(cat "$trec")"
grep -q "$released" $maplog || fail "the daemon stopped, but not for the release: $(grep "blkwire-map\[$tpid\]" $maplog | tail -n 3)"
info "$tdev stopped $((i / 10)) s after the umount: $(grep "$released" $maplog | tail -n1)"
step "everything written is on the target: map it again and compare"
bw map --frontend ublk --logfile $maplog tcp://127.0.0.1:7793/t
tdev=$(tail -n1 /tmp/bw.out)
run e2fsck -fn "$tdev"
run mount -t ext4 -o ro "$tdev" "$mnt"
(cd "$mnt" && sha256sum -c /tmp/tsums >/tmp/check 2>&1) || fail "files written around the refused signal differ: $(cat /tmp/check)"
run umount "$mnt"
bw unmap "$tdev"
kill $tserve
info "files written before and after the refused SIGTERM read back identical from the target"

# The give-up fence (PROTOCOL.md §2.6): a write the target still runs at its timeout is answered
# EIO only once a reconnection naming its queue is welcomed, that is, once the write has landed
# (else a rewrite through another queue could be overtaken by it); with no such welcome within one
# more timeout, EIO unfenced, logged. A target inside the guest exports a file on an ext4
# filesystem (on another ublk device) that this step freezes, so the write stays running.
now_cs() { awk '{ print int($1 * 100) }' /proc/uptime; }
serve /tmp/bserve.log --listen tcp://127.0.0.1:7794 --export base=mem:64M
bserve=$served
bw map --frontend ublk --logfile $maplog tcp://127.0.0.1:7794/base
bdev=$(tail -n1 /tmp/bw.out)
fmnt=/tmp/fmnt
mkdir -p $fmnt
run mkfs.ext4 -q -F "$bdev"
run mount -t ext4 "$bdev" $fmnt
run dd if=/dev/zero of=$fmnt/disk bs=1M count=16 conv=fsync
serve /tmp/fserve.log --listen tcp://127.0.0.1:7795 --export f=file:$fmnt/disk
fserve=$served
bw map --frontend ublk --timeout 4 --logfile /tmp/fence.log tcp://127.0.0.1:7795/f
fdev=$(tail -n1 /tmp/bw.out)
run dd if=/dev/urandom of=/tmp/w1 bs=4k count=1
run fsfreeze --freeze $fmnt
step "a 4 KiB write to $fdev with the target's filesystem frozen"
dd if=/tmp/w1 of="$fdev" bs=4k count=1 oflag=direct 2>/tmp/w1.err &
wpid=$!
# Past the timeout (the daemon gives the connection up then, and logs it), the write must
# still wait (the target still runs it); thawed then, it lands and the fence comes well before
# the second timeout ends.
i=0
until grep -q " lost (" /tmp/fence.log; do
    i=$((i + 1))
    [ $i -le 300 ] || fail "the map daemon never gave the connection up: $(cat /tmp/fence.log)"
    sleep 0.1
done
alive $wpid || fail "a write the target still ran was answered at its timeout: $(cat /tmp/w1.err)"
thawed=$(now_cs)
run fsfreeze --unfreeze $fmnt
if wait $wpid; then fail "a write answered past its timeout succeeded"; fi
done_cs=$(now_cs)
grep -q "Input/output error" /tmp/w1.err || fail "the held write failed otherwise: $(cat /tmp/w1.err)"
dd if="$fdev" of=/tmp/w1.back bs=4k count=1 iflag=direct 2>/dev/null || fail "reading back $fdev failed"
cmp -s /tmp/w1 /tmp/w1.back || fail "the held write was answered before it landed"
grep -q "answered EIO unfenced" /tmp/fence.log && fail "answered unfenced: $(cat /tmp/fence.log)"
[ $((done_cs - thawed)) -lt 300 ] || fail "the held write was answered $(((done_cs - thawed) * 10)) ms after the thaw: unfenced?"
info "a write the target still ran was answered EIO $(((done_cs - thawed) * 10)) ms after the thaw, once it had landed"
run dd if=/dev/urandom of=/tmp/w2 bs=4k count=1
run fsfreeze --freeze $fmnt
step "a write held for a fence that never comes"
t0=$(now_cs)
if dd if=/tmp/w2 of="$fdev" bs=4k count=1 seek=2 oflag=direct 2>/tmp/w2.err; then
    fail "a write the target never finished succeeded"
fi
t1=$(now_cs)
run fsfreeze --unfreeze $fmnt
[ $((t1 - t0)) -ge 780 ] || fail "answered unfenced after $(((t1 - t0) * 10)) ms, before twice the 4 s timeout"
# Logged right after the answer: looked for a few times, not slept on.
i=0
until grep -q "answered EIO unfenced" /tmp/fence.log; do
    i=$((i + 1))
    [ $i -le 50 ] || fail "no unfenced EIO in the log: $(cat /tmp/fence.log)"
    sleep 0.1
done
info "with no fence: EIO unfenced after $(((t1 - t0) * 10)) ms: $(grep "answered EIO unfenced" /tmp/fence.log | tail -n1)"
bw unmap "$fdev"
kill $fserve
wait $fserve || true
run umount $fmnt
bw unmap "$bdev"
kill $bserve

# The target goes away: I/O fails with EIO after --timeout instead of hanging, and unmap still
# completes. A target inside the guest, so this scenario can kill it.
serve /tmp/serve.log --listen tcp://127.0.0.1:7790 --export scratch=mem:64M
bw map --frontend ublk --timeout 3 --logfile $maplog tcp://127.0.0.1:7790/scratch
sdev=$(tail -n1 /tmp/bw.out)
run dd if=/dev/urandom of="$sdev" bs=64k count=4 conv=fsync
step "kill -9 the target, then read a range never read before"
kill -9 $served
t0=$(cut -d. -f1 /proc/uptime)
if dd if="$sdev" of=/dev/null bs=64k count=1 skip=512 2>/tmp/dd.err; then
    fail "a read with the target gone succeeded"
fi
t1=$(cut -d. -f1 /proc/uptime)
[ $((t1 - t0)) -le 20 ] || fail "the read failed only after $((t1 - t0)) s (timeout 3 s)"
info "target gone: the read failed after ~$((t1 - t0)) s: $(tail -n1 /tmp/dd.err)"
bw unmap "$sdev"
[ ! -e "/sys/block/${sdev#/dev/}" ] || fail "$sdev still exists after unmap"
info "$sdev unmapped with its target gone"
