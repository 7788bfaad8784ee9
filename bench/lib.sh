# Helpers shared by the bench scripts (sourced; the caller defines `die MESSAGE`).

now_ms() { date +%s%3N; }

# need_root WHY: dies unless run as root, saying what for.
need_root() { [[ "$(id -u)" == 0 ]] || die "needs root ($1)"; }

# need_tools TOOL...: dies naming the first TOOL not in PATH.
need_tools() {
    local t
    for t in "$@"; do command -v "$t" >/dev/null || die "$t missing (scripts/deps.sh installs it)"; done
}

# A TCP port of 127.0.0.1 free right now (a peer server is started on it; a race with another
# program taking it first fails that start, which the callers report or retry).
free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# CPU ticks (utime+stime) of a process, from /proc/PID/stat (fields after the ")" of comm).
cpu_ticks() {
    local stat
    stat="$(cat "/proc/$1/stat" 2>/dev/null)" || { echo 0; return; }
    stat="${stat##*) }"
    # shellcheck disable=SC2086
    set -- $stat
    echo $(( ${12} + ${13} ))
}
CLK_TCK="$(getconf CLK_TCK)"

# Ticks all CPUs spent idle (idle + iowait, the first line of /proc/stat): over a run, how much
# of the machine nobody used.
idle_ticks() {
    local cpu user nice sys idle iowait rest
    read -r cpu user nice sys idle iowait rest </proc/stat
    echo $(( idle + iowait ))
}

HAVE_TIME=0
[[ -x /usr/bin/time ]] && HAVE_TIME=1

# run_timed OUT SRV_PID CMD...: runs CMD with stdout to OUT; prints "srv_cpu% cli_cpu%", the CPU
# the server process and the command used over the run, in percent of one core.
run_timed() {
    local out="$1" srv="$2"; shift 2
    local t0 t1 c0 c1 wall srv_pct cli_pct="n/a"
    local rc=0
    c0="$(cpu_ticks "$srv")"; t0="$(now_ms)"
    # (callers use `|| die`, which disables errexit in here: check the status by hand)
    if (( HAVE_TIME )); then
        /usr/bin/time -f '%U %S' -o "$out.time" "$@" >"$out" 2>"$out.err" || rc=$?
    else
        "$@" >"$out" 2>"$out.err" || rc=$?
    fi
    t1="$(now_ms)"; c1="$(cpu_ticks "$srv")"
    (( rc == 0 )) || return "$rc"
    kill -0 "$srv" 2>/dev/null || die "server pid $srv died during: $*"
    wall=$(( t1 - t0 ))
    srv_pct="$(python3 -c "print(f'{($c1-$c0)/$CLK_TCK*1000/$wall*100:.0f}')")"
    if (( HAVE_TIME )); then
        cli_pct="$(python3 -c "
u, s = open('$out.time').read().split()[-2:]
print(f'{(float(u)+float(s))*1000/$wall*100:.0f}')")"
    fi
    echo "$srv_pct $cli_pct"
}

# veth_pair T I N MTU: network namespaces T (target, 10.99.N.1 on vt) and I (initiator,
# 10.99.N.2 on vi) joined by a veth pair, links up; prints the target's MAC. Remove with
# veth_pair_remove T I (safe to call twice, and on a pair never made).
veth_pair() {
    local t=$1 i=$2 n=$3 mtu=$4
    ip netns add "$t"
    ip netns add "$i"
    ip link add vt netns "$t" type veth peer name vi netns "$i"
    ip -n "$t" addr add "10.99.$n.1/24" dev vt
    ip -n "$i" addr add "10.99.$n.2/24" dev vi
    for ns in "$t" "$i"; do ip -n "$ns" link set lo up; done
    ip -n "$t" link set vt mtu "$mtu" up
    ip -n "$i" link set vi mtu "$mtu" up
    ip netns exec "$t" cat /sys/class/net/vt/address
}

veth_pair_remove() {
    ip netns del "$1" 2>/dev/null || true
    ip netns del "$2" 2>/dev/null || true
}

# Charts. chart_begin NAME TITLE MEASURE...: the table's machine-readable copy, CHART_TSV =
# $BENCH_OUT/NAME-DATE.tsv (BENCH_OUT defaults to bench/out, relative to the repository root,
# where the scripts run), with its title, the run's date and script, and the header "group system
# MEASURE..." (measure names: see bench/chart.sh). chart_row GROUP SYSTEM VALUE... adds a row
# (a script's Python may append rows to $CHART_TSV itself); chart_end draws the PNG beside it with
# bench/chart.sh and prints both paths. A chart that cannot be drawn is a warning, not a failure.
chart_begin() {
    local name="$1" title="$2"; shift 2
    local dir="${BENCH_OUT:-bench/out}"
    mkdir -p "$dir"
    CHART_TSV="$dir/$name-$(date -u +%Y%m%d-%H%M%S).tsv"
    export CHART_TSV
    {
        printf '#title\t%s\n' "$title"
        printf '#run\t%s, bench/%s.sh\n' "$(date -u '+%Y-%m-%d %H:%M UTC')" "$name"
        printf 'group\tsystem'
        printf '\t%s' "$@"
        printf '\n'
    } >"$CHART_TSV"
}

# chart_meta KEY VALUE: a "#KEY<TAB>VALUE" line (e.g. peers) in the table.
chart_meta() { printf '#%s\t%s\n' "$1" "$2" >>"$CHART_TSV"; }

chart_row() {
    local IFS=$'\t'
    echo "$*" >>"$CHART_TSV"
}

chart_end() {
    local png="${CHART_TSV%.tsv}.png"
    if bench/chart.sh "$CHART_TSV" "$png"; then
        echo "chart: $png (table: $CHART_TSV)"
    else
        echo "chart: not drawn (table: $CHART_TSV)" >&2
    fi
}
