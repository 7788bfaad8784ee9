#!/bin/sh
# Scenario nvme-tcp-bench (optional, run by bench/nvme-tcp-lab.sh), guest side: two NVMe/TCP targets
# on this guest's loopback, each on a file on the same tmpfs, attached by the guest's own nvme-tcp
# host, run the same fio workloads:
#   blkwire  blkwire serve --listen nvme-tcp://127.0.0.1:4430 (export disk0=file:/bench/blkwire.img)
#   nvmet    the kernel's target through configfs (nvmet-tcp on 127.0.0.1:4420, file backend
#            /bench/nvmet.img, buffered_io=1: tmpfs has no O_DIRECT)
# Workloads (fio libaio, direct=1, one job unless said): 4k randread and randwrite at QD1 and QD32,
# 1M sequential read and write and 1M random mixed 30% read at QD$LAB_BIGQD (default 8); then 4k randread at
# QD$LAB_HQD x $LAB_HJOBS jobs on blkwire's NVMe/TCP namespace, on nvmet's, on /dev/ublkb0
# (`blkwire map --frontend ublk` of the same blkwire export over tcp://) and on /dev/ublkb1 (the
# same over eth:// on a veth pair in this guest), unless lab.eth=0.
# Each device is filled with 1M writes first, so reads return written data. The two targets run
# back to back within a workload, the order alternating from one workload to the next.
# Results: one "LAB-FIO: TARGET WORKLOAD TERSE" line per run (fio terse v3), read by the host.
#
# From the kernel command line: lab.runtime, lab.ramp (seconds), lab.size (MiB per image),
# lab.hqd, lab.hjobs, lab.bigqd (queue depth of the 1M workloads and the fill), lab.eth (0: skip
# eth://), lab.blkwire_nvme (0: no blkwire NVMe/TCP target, for a blkwire without the frontend:
# nvmet and the ublk runs only).
. /lab/lib.sh
maplog=/tmp/map.log

rt=${LAB_RUNTIME:-5}
ramp=${LAB_RAMP:-1}
size=${LAB_SIZE:-192}
hqd=${LAB_HQD:-128}
hjobs=${LAB_HJOBS:-16}
bigqd=${LAB_BIGQD:-8}
bw_nqn=nqn.2026-11.io.blkwire:disk0
info "bench: runtime=$rt ramp=$ramp size=$size hqd=$hqd hjobs=$hjobs bigqd=$bigqd"
kt_nqn=nqn.2026-11.io.nvmet:bench

run modprobe nvme-tcp
run modprobe crc32c_generic
run modprobe ublk_drv
nvme_host_ids
command -v fio >/dev/null || fail "fio is not in the initramfs"
run fio --version

mkdir -p /bench
run mount -t tmpfs -o size=$((size * 2 + 64))M tmpfs /bench
truncate -s "${size}M" /bench/blkwire.img /bench/nvmet.img

# eth:// needs a link: a veth pair inside this guest (busybox ip names the peer itself).
eth=${LAB_ETH:-1}
listen_eth=""
if [ "$eth" = 1 ]; then
    run modprobe veth
    run ip link add bwt type veth
    peer=""
    for l in /sys/class/net/*; do
        [ "${l##*/}" != bwt ] && [ "$(cat "$l/ifindex")" = "$(cat /sys/class/net/bwt/iflink)" ] && peer=${l##*/}
    done
    [ -n "$peer" ] || fail "no peer of veth bwt"
    run ip link set bwt up
    run ip link set "$peer" up
    listen_eth="--listen eth://bwt"
fi

# blkwire's target (the frontend under test)
bwnvme=${LAB_BLKWIRE_NVME:-1}
listen_nvme="--listen nvme-tcp://127.0.0.1:4430"
want=2
[ "$bwnvme" = 1 ] || { listen_nvme="" want=1; }
[ "$eth" = 1 ] && want=$((want + 1))
step "blkwire serve${listen_nvme:+ nvme-tcp,} tcp${listen_eth:+, eth}"
# shellcheck disable=SC2086  # listen_* are empty or two words
blkwire serve $listen_nvme --listen tcp://127.0.0.1:7700 $listen_eth \
    --rpc-socket none --export disk0=file:/bench/blkwire.img >/tmp/serve.log 2>&1 &
served=$!
i=0
until [ "$(grep -c '^listening ' /tmp/serve.log)" -ge $want ]; do
    kill -0 $served 2>/dev/null || fail "blkwire serve exited: $(tr '\n' ' ' </tmp/serve.log)"
    i=$((i + 1))
    [ $i -le 200 ] || fail "blkwire serve did not listen within 20 s: $(tr '\n' ' ' </tmp/serve.log)"
    sleep 0.1
done
info "blkwire serve: $(sed -n 's/^listening //p' /tmp/serve.log | tr '\n' ' ')"

# the kernel's target
nvmet_start
step "nvmet: $kt_nqn on 127.0.0.1:4420"
nvmet_port 1 127.0.0.1 4420
nvmet_subsys $kt_nqn /bench/nvmet.img 1 1

nq() { # NQN: the I/O queues its controller mapped, as the kernel logged them
    q_c=$(nvme_ctrl "$1")
    dmesg | sed -n "s#.*nvme ${q_c#/dev/}: mapped \([0-9/]*\) .*#\1#p" | tail -n1
}

run nvme connect -t tcp -a 127.0.0.1 -s 4420 -n $kt_nqn
kt_dev=$(nvme_ns $kt_nqn)
targets=nvmet
info "nvmet: $kt_dev ($(blockdev --getsize64 "$kt_dev") bytes, I/O queues $(nq $kt_nqn) default/read/poll)"
bw_dev=""
if [ "$bwnvme" = 1 ]; then
    run nvme connect -t tcp -a 127.0.0.1 -s 4430 -n $bw_nqn
    bw_dev=$(nvme_ns $bw_nqn)
    targets="blkwire nvmet"
    info "blkwire: $bw_dev ($(blockdev --getsize64 "$bw_dev") bytes, I/O queues $(nq $bw_nqn) default/read/poll)"
else
    info "NO blkwire NVMe/TCP target (lab.blkwire_nvme=0): nvmet and ublk runs only"
fi


fio_run() { # TARGET WORKLOAD DEV FIO-ARGS...
    f_t=$1 f_w=$2 f_dev=$3
    shift 3
    step "fio $f_t $f_w on $f_dev"
    fio --name="$f_w" --filename="$f_dev" --ioengine=libaio --direct=1 --time_based --runtime="$rt" \
        --ramp_time="$ramp" --norandommap --randrepeat=0 --group_reporting \
        --output-format=terse --terse-version=3 "$@" </dev/null >/tmp/fio.out 2>/tmp/fio.err ||
        fail "fio $f_t $f_w failed: $(tail -n 3 /tmp/fio.err | tr '\n' ' ') | kernel: $(nvme_dmesg 3)"
    line=$(grep '^3;' /tmp/fio.out | tail -n1)
    [ -n "$line" ] || fail "fio $f_t $f_w printed no terse line: $(tr '\n' ' ' </tmp/fio.out)"
    [ "$(echo "$line" | cut -d';' -f5)" = 0 ] || fail "fio $f_t $f_w reports error $(echo "$line" | cut -d';' -f5)"
    emit FIO "$f_t $f_w $line"
}

for d in $bw_dev $kt_dev; do
    step "fill $d"
    fio --name=fill --filename="$d" --ioengine=libaio --direct=1 --rw=write --bs=1M --iodepth="$bigqd" \
        </dev/null >/tmp/fill.out 2>&1 || fail "filling $d failed: $(tail -n 3 /tmp/fill.out | tr '\n' ' ')"
done

n=0
while read -r w args; do
    [ -n "$w" ] || continue
    n=$((n + 1))
    order=$targets
    if [ $((n % 2)) = 0 ] && [ "$bwnvme" = 1 ]; then order="nvmet blkwire"; fi
    for t in $order; do
        if [ "$t" = blkwire ]; then d=$bw_dev; else d=$kt_dev; fi
        # shellcheck disable=SC2086  # args are fio options, one word each
        fio_run "$t" "$w" "$d" $args
    done
done <<EOF
randread-4k-qd1 --rw=randread --bs=4k --iodepth=1
randread-4k-qd32 --rw=randread --bs=4k --iodepth=32
randwrite-4k-qd1 --rw=randwrite --bs=4k --iodepth=1
randwrite-4k-qd32 --rw=randwrite --bs=4k --iodepth=32
read-1m-qd$bigqd --rw=read --bs=1M --iodepth=$bigqd
write-1m-qd$bigqd --rw=write --bs=1M --iodepth=$bigqd
randrw30-1m-qd$bigqd --rw=randrw --rwmixread=30 --bs=1M --iodepth=$bigqd
EOF

# Many jobs at a high queue depth: blkwire's NVMe/TCP frontend, nvmet, and blkwire's own protocol
# through ublk (tcp://, eth://) from the same target.
hw=randread-4k-qd${hqd}x$hjobs
hargs="--rw=randread --bs=4k --iodepth=$hqd --numjobs=$hjobs"
if [ "$bwnvme" = 1 ]; then
    # shellcheck disable=SC2086
    fio_run blkwire "$hw" "$bw_dev" $hargs
fi
# shellcheck disable=SC2086
fio_run nvmet "$hw" "$kt_dev" $hargs
bw map --frontend ublk --logfile "$maplog" tcp://127.0.0.1:7700/disk0
u_tcp=$(tail -n1 /tmp/bw.out)
# shellcheck disable=SC2086
fio_run blkwire-ublk-tcp "$hw" "$u_tcp" $hargs
bw unmap "$u_tcp"
if [ "$eth" = 1 ]; then
    mac=$(sed -n 's#^listening eth://bwt/##p' /tmp/serve.log)
    [ -n "$mac" ] || fail "no 'listening eth://bwt/MAC' line: $(tr '\n' ' ' </tmp/serve.log)"
    bw map --frontend ublk --logfile "$maplog" "eth://$peer/$mac/disk0"
    u_eth=$(tail -n1 /tmp/bw.out)
    # shellcheck disable=SC2086
    fio_run blkwire-ublk-eth "$hw" "$u_eth" $hargs
    bw unmap "$u_eth"
fi

run nvme disconnect -n $kt_nqn
nvme_gone "$kt_dev"
if [ "$bwnvme" = 1 ]; then
    run nvme disconnect -n $bw_nqn
    nvme_gone "$bw_dev"
fi
kill $served
i=0
while kill -0 $served 2>/dev/null; do
    i=$((i + 1))
    [ $i -le 100 ] || fail "blkwire serve did not exit within 10 s of SIGTERM"
    sleep 0.1
done
wait $served || fail "blkwire serve exited with status $? after SIGTERM"
info "done: $(grep -c . /tmp/serve.log) lines in blkwire's log"
