# shellcheck disable=SC2034  # globals for run.sh and the scenarios
# shellcheck shell=bash
# Kernel for the lab: Debian's linux-image-6.12*-amd64 from bookworm-backports, fetched through a
# private apt configuration (its own sources file, lists and cache under $LAB_CACHE/apt) that reuses
# the Debian mirror already configured on this machine. Nothing under /etc/apt is changed.
#
# Sourced by run.sh. Sets KVER, KERNEL_DIR (holds vmlinuz, config, System.map) and KERNEL_ROOT
# (a tree with lib/modules/$KVER, compressed modules plus the modules.dep that depmod wrote).
#
# Cache: $LAB_CACHE/kernel/<KVER>/ and $LAB_CACHE/kernel/current (the KVER in use). A cached kernel
# is reused without touching the network; LAB_REFRESH_KERNEL=1 looks for a newer one.
# LAB_APT_MIRROR=URI replaces the configured mirror (a machine whose apt sources name no Debian mirror).

BACKPORTS_SUITE=bookworm-backports
# Generic flavour only (not -cloud or -rt); the signed and the -unsigned package carry the same image.
KERNEL_PKG_RE='^linux-image-6\.12\.[0-9]+\+deb12(\.[0-9]+)?-amd64(-unsigned)?$'

# Prints "URI SIGNED-BY" of the Debian main archive mirror configured on this machine (the stanza
# or line whose suite is a plain release name such as "bookworm", not -security/-updates).
apt_mirror() {
    local f found=""
    for f in /etc/apt/sources.list.d/*.sources; do
        [ -f "$f" ] || continue
        found+=$(awk '
            BEGIN { RS = ""; FS = "\n" }
            {
                uri = ""; suites = ""; signed = ""; types = ""; enabled = "yes"
                for (i = 1; i <= NF; i++) {
                    line = $i
                    if (line ~ /^[ \t]*#/) continue
                    split(line, kv, ":")
                    key = tolower(kv[1]); val = substr(line, length(kv[1]) + 2)
                    gsub(/^[ \t]+|[ \t]+$/, "", val)
                    if (key == "types") types = val
                    else if (key == "uris") { split(val, u, /[ \t]+/); uri = u[1] }
                    else if (key == "suites") suites = val
                    else if (key == "signed-by") signed = val
                    else if (key == "enabled") enabled = tolower(val)
                }
                if (enabled == "no" || uri == "" || (" " types " ") !~ / deb /) next
                n = split(suites, s, /[ \t]+/)
                for (j = 1; j <= n; j++)
                    if (s[j] ~ /^[a-z]+$/) { print uri, (signed == "" ? "-" : signed); exit }
            }' "$f")$'\n'
    done
    # One-line format: deb [signed-by=...] URI SUITE COMPONENTS...
    for f in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
        [ -f "$f" ] || continue
        found+=$(awk '
            $1 != "deb" { next }
            {
                signed = "-"; i = 2
                if ($2 ~ /^\[/) {
                    for (; i <= NF; i++) {
                        if ($i ~ /signed-by=/) { signed = $i; sub(/.*signed-by=/, "", signed); sub(/\].*/, "", signed) }
                        if ($i ~ /\]$/) { i++; break }
                    }
                }
                if ($(i + 1) ~ /^[a-z]+$/) { print $i, signed; exit }
            }' "$f")$'\n'
    done
    found=$(grep -m1 . <<<"$found") || return 1
    echo "$found"
}

APT_LAB=()
apt_lab_setup() {
    local mirror signed adir=$LAB_CACHE/apt
    if [ -n "${LAB_APT_MIRROR:-}" ]; then
        mirror=$LAB_APT_MIRROR signed=-
    else
        read -r mirror signed < <(apt_mirror) ||
            die "no Debian mirror found in /etc/apt/sources.list.d/*.sources or /etc/apt/sources.list;" \
                "the lab reuses the configured mirror to reach $BACKPORTS_SUITE (or set LAB_APT_MIRROR=URI)"
    fi
    mkdir -p "$adir/lists/partial" "$adir/cache/archives/partial" "$adir/parts"
    {
        echo "# Written by tests/kernel-lab: the machine's own Debian mirror, $BACKPORTS_SUITE suite."
        echo "Types: deb"
        echo "URIs: $mirror"
        echo "Suites: $BACKPORTS_SUITE"
        echo "Components: main"
        if [ "$signed" != "-" ]; then
            echo "Signed-By: $signed"
        elif [ -f /usr/share/keyrings/debian-archive-keyring.gpg ]; then
            echo "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg"
        fi
    } >"$adir/backports.sources"
    APT_LAB=(-o "Dir::Etc::SourceList=$adir/backports.sources" -o "Dir::Etc::SourceParts=$adir/parts"
        -o "Dir::State::Lists=$adir/lists" -o "Dir::Cache=$adir/cache" -o Debug::NoLocking=1)
    # apt drops privileges to _apt for downloads; it cannot write into a root-owned cache here.
    [ "$(id -u)" -ne 0 ] || APT_LAB+=(-o APT::Sandbox::User=root)
    log "kernel: $BACKPORTS_SUITE from ${LAB_APT_MIRROR:+LAB_APT_MIRROR=}$mirror"
}

# Prints "PACKAGE VERSION" of the newest generic 6.12 kernel image in bookworm-backports.
newest_kernel_pkg() {
    local best="" bestv="" p v
    while read -r p v; do
        if [ -z "$best" ] || dpkg --compare-versions "$v" gt "$bestv"; then best=$p bestv=$v; fi
    done < <(apt-cache "${APT_LAB[@]}" dumpavail | awk '/^Package: /{p=$2} /^Version: /{print p, $2}' |
        grep -E "${KERNEL_PKG_RE%\$} " || true)
    # Prints nothing when there is none (the caller says so).
    if [ -n "$best" ]; then echo "$best $bestv"; fi
}

ensure_kernel() {
    local kdir=$LAB_CACHE/kernel
    mkdir -p "$kdir"
    if [ -z "${LAB_REFRESH_KERNEL:-}" ] && [ -s "$kdir/current" ]; then
        KVER=$(cat "$kdir/current")
        if [ -f "$kdir/$KVER/.complete" ]; then
            kernel_paths
            log "kernel: $KVER (cached in ${KERNEL_DIR#"$REPO"/})"
            return 0
        fi
    fi

    apt_lab_setup
    local ulog=$LAB_CACHE/apt/update.log
    apt-get "${APT_LAB[@]}" -qq --error-on=any update >"$ulog" 2>&1 ||
        die "cannot fetch the $BACKPORTS_SUITE package lists, so no kernel for the lab (apt-get update failed):" \
            "$(grep -E '^(E|W):' "$ulog" | head -n3 | tr '\n' ' ')"
    local found pkg ver
    found=$(newest_kernel_pkg)
    [ -n "$found" ] ||
        die "no linux-image-6.12*-amd64 package in $BACKPORTS_SUITE, so no kernel for the lab" \
            "$(grep -E '^(E|W):' "$ulog" | head -n3 | tr '\n' ' ')"
    read -r pkg ver <<<"$found"
    KVER=${pkg#linux-image-}
    KVER=${KVER%-unsigned}
    if [ -f "$kdir/$KVER/.complete" ]; then
        echo "$KVER" >"$kdir/current"
        kernel_paths
        log "kernel: $KVER (newest in $BACKPORTS_SUITE, already cached)"
        return 0
    fi

    log "kernel: downloading $pkg $ver"
    local tmp=$kdir/.download
    rm -rf "$tmp" "$kdir/${KVER:?}"
    mkdir -p "$tmp"
    (cd "$tmp" && apt-get "${APT_LAB[@]}" -qq download "$pkg=$ver") >"$tmp/download.log" 2>&1 ||
        die "cannot download $pkg=$ver from $BACKPORTS_SUITE: $(grep -E '^E:' "$tmp/download.log" | head -n3 | tr '\n' ' ')"
    local deb
    deb=$(find "$tmp" -maxdepth 1 -name '*.deb' | head -n1)
    [ -n "$deb" ] || die "apt-get download of $pkg produced no .deb"
    dpkg-deb -x "$deb" "$tmp/x" || die "dpkg-deb -x $deb failed"
    local moddir="" d
    for d in "$tmp/x/lib/modules/$KVER" "$tmp/x/usr/lib/modules/$KVER"; do
        [ -d "$d" ] && moddir=$d && break
    done
    if [ ! -f "$tmp/x/boot/vmlinuz-$KVER" ] || [ -z "$moddir" ]; then
        die "$pkg does not contain boot/vmlinuz-$KVER and lib/modules/$KVER"
    fi
    mkdir -p "$kdir/$KVER/root/lib/modules"
    mv "$tmp/x/boot/vmlinuz-$KVER" "$kdir/$KVER/vmlinuz"
    mv "$tmp/x/boot/config-$KVER" "$kdir/$KVER/config" 2>/dev/null || true
    mv "$tmp/x/boot/System.map-$KVER" "$kdir/$KVER/System.map" 2>/dev/null || true
    mv "$moddir" "$kdir/$KVER/root/lib/modules/$KVER"
    # The package ships no modules.dep (the postinst runs depmod); build it for this tree.
    depmod -b "$kdir/$KVER/root" "$KVER" || die "depmod -b $kdir/$KVER/root $KVER failed"
    echo "$pkg $ver" >"$kdir/$KVER/package"
    touch "$kdir/$KVER/.complete"
    rm -rf "$tmp"
    # Keep one kernel: older ones are dead weight (several hundred MB each).
    local d
    for d in "$kdir"/*/; do
        d=${d%/}
        [ "${d##*/}" = "$KVER" ] || rm -rf "$d"
    done
    echo "$KVER" >"$kdir/current"
    kernel_paths
    log "kernel: $KVER cached in ${KERNEL_DIR#"$REPO"/}"
}

kernel_paths() {
    KERNEL_DIR=$LAB_CACHE/kernel/$KVER
    KERNEL_ROOT=$KERNEL_DIR/root
    VMLINUZ=$KERNEL_DIR/vmlinuz
}
