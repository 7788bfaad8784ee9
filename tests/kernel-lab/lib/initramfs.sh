# shellcheck shell=bash
# The guest's initramfs: busybox-static, kernel modules (uncompressed, with their dependencies and a
# modules.dep built by depmod), dynamically linked host binaries with the libraries ldd lists, the
# guest /init and every scenario's guest script. One image serves every scenario (the union of what
# the scenarios ask for); the scenario to run is chosen on the kernel command line.
#
# Sourced by run.sh. build_initramfs MODULES BINARIES sets INITRD; the image is cached in
# $LAB_CACHE/initramfs/ under a hash of everything that goes into it.
#
#   MODULES:  module names, e.g. "nbd ext4" (dependencies are added from the kernel's modules.dep)
#   BINARIES: a command name found on PATH ("nbd-client") or a path ("/x/target/release/blkwire");
#             each is copied to /usr/bin/<name> in the guest

# Prints the module files (relative to lib/modules/$KVER) that loading MODULE needs, itself last.
module_files() {
    local out
    out=$(modprobe -d "$KERNEL_ROOT" -S "$KVER" --show-depends "$1" 2>&1) ||
        die "kernel $KVER has no module '$1': $out"
    # "insmod /abs/path/x.ko.xz [params]" lines; "builtin x" lines need nothing.
    awk '$1 == "insmod" { print $2 }' <<<"$out" | sed "s#^$KERNEL_ROOT/lib/modules/$KVER/##"
}

copy_with_libs() { # SRC DEST(inside $stage)
    local src=$1 dest=$2 lib
    install -D -m 0755 "$src" "$stage$dest"
    if ldd "$src" >/dev/null 2>&1; then
        if ldd "$src" | grep -q 'not found'; then
            die "$src: missing shared libraries: $(ldd "$src" | grep 'not found' | tr -s ' \t\n' ' ')"
        fi
        # "libx.so => /lib/x86_64-linux-gnu/libx.so (0x...)" and "/lib64/ld-linux-x86-64.so.2 (0x...)"
        for lib in $(ldd "$src" | awk '$2 == "=>" && $3 ~ /^\// { print $3 } $1 ~ /^\// { print $1 }'); do
            [ -e "$stage$lib" ] || install -D -m 0755 "$(readlink -f "$lib")" "$stage$lib"
        done
    fi
}

build_initramfs() {
    local modules=$1 binaries=$2 m b src
    local outdir=$LAB_CACHE/initramfs
    mkdir -p "$outdir"

    # Resolve inputs first: their content decides whether the cached image is still good.
    local modfiles=() binsrc=()
    local mf
    for m in $modules; do
        mf=$(module_files "$m") || exit 1
        [ -n "$mf" ] && mapfile -t -O "${#modfiles[@]}" modfiles <<<"$mf"
    done
    mapfile -t modfiles < <(printf '%s\n' "${modfiles[@]}" | awk '!seen[$0]++')
    for b in $binaries; do
        case $b in
        */*) src=$b ;;
        *) src=$(PATH=$PATH:/usr/sbin:/sbin command -v "$b") || die "'$b' not found on the host (needed in the guest)" ;;
        esac
        [ -x "$src" ] || die "$src: not an executable (needed in the guest)"
        binsrc+=("$src")
    done
    local busybox
    busybox=$(command -v busybox) || die "busybox not found (package busybox-static)"

    local key
    key=$({
        echo "kernel $KVER"
        printf 'module %s\n' "${modfiles[@]}"
        for src in "${binsrc[@]}" "$busybox" /etc/mke2fs.conf; do
            [ -e "$src" ] && echo "file $src $(sha256sum <"$src")"
        done
        # The guest side of the lab and this builder.
        (cd "$LAB_DIR" && { find guest -type f; find scenarios -name guest.sh; echo lib/initramfs.sh; } |
            LC_ALL=C sort | xargs sha256sum)
    } | sha256sum | cut -c1-16)
    INITRD=$outdir/initrd-$KVER-$key.cpio.gz
    if [ -f "$INITRD" ]; then
        log "initramfs: cached ${INITRD#"$REPO"/}"
        return 0
    fi

    log "initramfs: building (${#modfiles[@]} modules, ${#binsrc[@]} binaries + busybox)"
    local stage
    stage=$(mktemp -d "$outdir/.stage.XXXXXX")
    # merged /usr layout, like the host: /bin, /sbin, /lib, /lib64 point into /usr
    mkdir -p "$stage"/{usr/bin,usr/sbin,usr/lib,usr/lib64,dev,proc,sys,tmp,run,mnt,root,etc,var,lab}
    ln -s usr/bin "$stage/bin"
    ln -s usr/sbin "$stage/sbin"
    ln -s usr/lib "$stage/lib"
    ln -s usr/lib64 "$stage/lib64"

    # Modules, decompressed (busybox modprobe/insmod need plain .ko), then modules.dep for them.
    local kmods=$KERNEL_ROOT/lib/modules/$KVER dst
    for f in "${modfiles[@]}"; do
        dst=$stage/lib/modules/$KVER/$f
        mkdir -p "${dst%/*}"
        case $f in
        *.ko.xz) xz -dc "$kmods/$f" >"${dst%.xz}" ;;
        *.ko.zst) zstd -qdc "$kmods/$f" >"${dst%.zst}" ;;
        *.ko.gz) gzip -dc "$kmods/$f" >"${dst%.gz}" ;;
        *) cp "$kmods/$f" "$dst" ;;
        esac
    done
    cp "$kmods"/modules.builtin "$kmods"/modules.builtin.modinfo "$kmods"/modules.order "$stage/lib/modules/$KVER/"
    depmod -b "$stage" "$KVER" || die "depmod for the initramfs failed"

    # Binaries with their libraries; blkwire is stripped (its debug info is most of its size).
    for src in "${binsrc[@]}"; do
        copy_with_libs "$src" "/usr/bin/${src##*/}"
    done
    [ -f "$stage/usr/bin/blkwire" ] && command -v strip >/dev/null && strip -s "$stage/usr/bin/blkwire"
    [ -f /etc/mke2fs.conf ] && cp /etc/mke2fs.conf "$stage/etc/"

    # busybox and its applets, never shadowing a real binary copied above
    copy_with_libs "$busybox" /usr/bin/busybox
    local applet name
    for applet in $("$busybox" --list-full); do
        name=${applet##*/}
        [ "$applet" = linuxrc ] && continue
        [ -e "$stage/usr/bin/$name" ] || [ -e "$stage/usr/sbin/$name" ] || [ -L "$stage/$applet" ] ||
            ln -s /usr/bin/busybox "$stage/$applet"
    done

    # The guest side: /init, its helpers and every scenario's guest script.
    install -m 0755 "$LAB_DIR/guest/init" "$stage/init"
    install -m 0644 "$LAB_DIR/guest/lib.sh" "$stage/lab/lib.sh"
    local s
    for s in "$LAB_DIR"/scenarios/*/guest.sh; do
        install -D -m 0755 "$s" "$stage/lab/scenarios/$(basename "$(dirname "$s")").sh"
    done

    (cd "$stage" && find . -mindepth 1 -print0 | LC_ALL=C sort -z |
        cpio --null -o -H newc --owner=0:0 --quiet) | gzip -1 >"$INITRD.tmp"
    mv "$INITRD.tmp" "$INITRD"
    rm -rf "$stage"
    # Keep only the image just built.
    for f in "$outdir"/initrd-*.cpio.gz; do
        [ "$f" = "$INITRD" ] || rm -f "$f"
    done
    log "initramfs: ${INITRD#"$REPO"/} ($(du -h "$INITRD" | cut -f1))"
}
