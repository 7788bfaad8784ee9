#!/bin/sh
# Hand check of crates/map's layering (lib.rs, "Layering"): every module may name only modules
# of a lower rank. Prints each violation; exits 1 if there is one. Run from anywhere.
cd "$(dirname "$0")/src" || exit 2
rank() {
    case $1 in
    log | state) echo 1 ;;
    sys | sockpoll) echo 2 ;;
    device) echo 3 ;;
    fuse/abi) echo 10 ;; fuse/channel) echo 11 ;; fuse/uring) echo 12 ;;
    fuse/loopdev | fuse/partial) echo 13 ;; fuse/worker) echo 14 ;; fuse/device) echo 15 ;; fuse/mod) echo 16 ;;
    ublk/abi) echo 10 ;; ublk/control) echo 11 ;; ublk/queue) echo 12 ;;
    ublk/device) echo 13 ;; ublk/mod) echo 14 ;;
    fuse | ublk) echo 20 ;;
    daemon) echo 30 ;;
    *) echo "unknown module $1" >&2; echo 99 ;;
    esac
}
bad=0
for f in $(find . -name '*.rs' ! -name lib.rs | sort); do
    m=${f#./}; m=${m%.rs}
    dir=${m%/*}; [ "$dir" = "$m" ] && dir=
    # crate::x (top level), super::x (a sibling inside fuse/ or ublk/), crate::fuse::x; unit
    # tests (after #[cfg(test)]) may use anything.
    used=$(sed '/^#\[cfg(test)\]/,$d' "$f" | grep -v '^ *//' | grep -o 'crate::[a-z_]*\(::[a-z_]*\)\?\|super::[a-z_]*' |
        sed -e 's/^crate::\(fuse\|ublk\)::\([a-z_]*\)$/\1\/\2/' -e 's/^crate::\([a-z_]*\).*/\1/' \
            -e "s|^super::|$dir/|" | sort -u)
    for u in $used; do
        case $u in log | */log) u=log ;; esac
        # A sibling that is an item of mod.rs (not a file) is the directory itself.
        [ -f "$u.rs" ] || [ "$u" = log ] || case $u in fuse/* | ublk/*) u=${u%%/*}/mod ;; esac
        [ "$u" = "$m" ] && continue
        [ "$(rank "$u")" -lt "$(rank "$m")" ] || { echo "$m uses $u"; bad=1; }
    done
done
[ $bad = 0 ] && echo "crates/map: no module uses one of its rank or above"
exit $bad
