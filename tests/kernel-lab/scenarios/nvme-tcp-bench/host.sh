# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario nvme-tcp-bench (optional: not in the default set; bench/nvme-tcp-lab.sh runs it and
# prints the table): blkwire's NVMe/TCP frontend against the kernel's nvmet, both inside the guest
# on its loopback, with fio (guest.sh). Nothing runs on the host; the results are the guest's
# LAB-FIO lines in the serial log. See scenarios/nbd/host.sh for the contract.
#
# Environment (bench/nvme-tcp-lab.sh sets them): LAB_BENCH_RUNTIME, LAB_BENCH_RAMP (seconds per
# run), LAB_BENCH_SIZE (MiB per image), LAB_BENCH_HQD, LAB_BENCH_HJOBS (the high-queue-depth run),
# LAB_BENCH_ETH=0 (no eth:// run), LAB_BENCH_BLKWIRE_NVME=0 (no blkwire NVMe/TCP target: for a
# blkwire without the frontend).

SCENARIO_OPTIONAL=1
SCENARIO_DESC="benchmark: blkwire NVMe/TCP frontend vs the kernel's nvmet, both in the guest, fio (+ ublk over tcp:// and eth://)"
HOST_PACKAGES="nvme-cli fio"
GUEST_MODULES="nvme-tcp nvme-fabrics crc32c_generic nvmet nvmet-tcp ublk_drv veth"
GUEST_BINARIES="nvme fio"

scenario_setup() {
    GUEST_ARGS="lab.runtime=${LAB_BENCH_RUNTIME:-5} lab.ramp=${LAB_BENCH_RAMP:-1} lab.size=${LAB_BENCH_SIZE:-192}"
    GUEST_ARGS+=" lab.hqd=${LAB_BENCH_HQD:-128} lab.hjobs=${LAB_BENCH_HJOBS:-16} lab.eth=${LAB_BENCH_ETH:-1}"
    GUEST_ARGS+=" lab.blkwire_nvme=${LAB_BENCH_BLKWIRE_NVME:-1} lab.bigqd=${LAB_BENCH_BIGQD:-8}"
}

scenario_verify() {
    local n
    n=$(guest_values FIO | wc -l)
    [ "$n" -gt 0 ] || die "the guest reported no fio results"
    log "$n fio results in ${SERIAL_LOG#"$REPO"/}"
}
