# shellcheck shell=bash disable=SC2034  # the variables are read by run.sh
# Scenario mem-overcommit, host side: nothing runs on the host. In the guest (guest.sh) a target
# serves a RAM export under strict overcommit, and a client writes more than the kernel will
# back: those writes are refused NO_SPACE and the target lives on (a store into a page the kernel
# cannot give raised SIGBUS, which ended it). A kernel setting this machine's tests must not
# change on the host, hence the guest. See scenarios/nbd/host.sh for the contract.

SCENARIO_DESC="RAM export under strict overcommit in the guest: writes past what the kernel backs are refused, the target lives"
HOST_PACKAGES=""
GUEST_MODULES=""
GUEST_BINARIES=""

scenario_setup() {
    GUEST_ARGS=""
}

scenario_verify() {
    :
}
