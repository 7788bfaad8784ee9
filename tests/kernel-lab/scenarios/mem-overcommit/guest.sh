#!/bin/sh
# Scenario mem-overcommit, guest side: `blkwire serve` with a RAM export larger than the commit
# limit leaves room for, strict overcommit switched on, then 1 MiB writes until they are
# refused: the writes past the limit must fail with NO_SPACE (not the target), and the target
# must still answer afterwards.
. /lab/lib.sh

serve /tmp/serve.log --listen tcp://127.0.0.1:0 --export m=mem:768M --threads 1
port=$(sed -n 's#.*listening tcp://127\.0\.0\.1:\([0-9]*\).*#\1#p' /tmp/serve.log | head -n1)
[ -n "$port" ] || fail "no listening line: $(cat /tmp/serve.log)"
url=tcp://127.0.0.1:$port/m

step "strict overcommit, 320 MiB above what is committed now (the client takes about half)"
committed=$(awk '/^Committed_AS/ {print $2}' /proc/meminfo)
total=$(awk '/^MemTotal/ {print $2}' /proc/meminfo)
echo $(((committed + 327680) * 100 / total + 1)) >/proc/sys/vm/overcommit_ratio
echo 2 >/proc/sys/vm/overcommit_memory
info "CommitLimit $(awk '/^CommitLimit/ {print $2}' /proc/meminfo) kB, Committed_AS $committed kB"

step "write the whole export in 1 MiB writes"
if blkwire bench "$url" --rw write --bs 1M --iodepth 2 --runtime 60 --size 768M >/tmp/bench.out 2>&1; then
    cat /tmp/bench.out
    echo 0 >/proc/sys/vm/overcommit_memory
    fail "every write was taken: the commit limit was never reached"
fi
echo 0 >/proc/sys/vm/overcommit_memory
cat /tmp/bench.out
kill -0 "$served" 2>/dev/null || fail "the target died: $(tail -n5 /tmp/serve.log)"
grep -qi "space" /tmp/bench.out || fail "the writes failed, but not for want of space: $(tail -n1 /tmp/bench.out)"
bw info "$url"
info "the target refused what it could not back and lives on"
kill "$served"
