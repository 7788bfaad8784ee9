# Helpers for guest scenario scripts (busybox sh, run with -e by /init). Source with: . /lab/lib.sh
#
#   step TEXT       announce the next step (shown in the log; named in the result if the scenario fails)
#   info TEXT       a fact worth keeping in the log (LAB-INFO lines are echoed by the host on success)
#   fail TEXT       end the scenario: LAB-RESULT: FAIL TEXT
#   run CMD...      step "CMD..." then run it; a non-zero exit fails the scenario, naming the command
#   emit KEY VALUE  a machine-readable line "LAB-KEY: VALUE" for the host-side checks

step() {
    echo "$*" >/tmp/lab-step
    echo "LAB-STEP: [$(cut -d' ' -f1 /proc/uptime)s] $*"
}
info() { echo "LAB-INFO: $*"; }
emit() {
    k=$1
    shift
    echo "LAB-$k: $*"
}
fail() {
    echo "$*" >/tmp/lab-fail
    echo "LAB-FAIL: $*"
    exit 1
}
run() {
    step "$*"
    "$@" || fail "'$*' exited with status $?"
}
