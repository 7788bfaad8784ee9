#!/usr/bin/env bash
# Installs what blkwire's build, tests and benchmarks need and is missing. Idempotent and quiet
# when everything is present; needs root (or sudo) only when something must be installed.
set -euo pipefail

need=()
command -v cargo >/dev/null || { echo "deps: cargo not found; install Rust (https://rustup.rs) and retry" >&2; exit 1; }
rustup component list --installed 2>/dev/null | grep -q '^clippy' || rustup component add clippy rustfmt >/dev/null 2>&1 || true
command -v sha256sum >/dev/null || need+=(coreutils)
# The openssl crate links the system OpenSSL (TLS, GMAC): its headers and pkg-config.
command -v pkg-config >/dev/null || need+=(pkg-config)
[ -e /usr/include/openssl/ssl.h ] || need+=(libssl-dev)
command -v python3 >/dev/null || need+=(python3)
# A C compiler: linking blkwire, and bench/frame-cost.sh builds its probe.
command -v cc >/dev/null || need+=(gcc)
# A C++ compiler: `make test` builds the fuzz targets (fuzz/), whose libfuzzer-sys compiles libFuzzer.
command -v c++ >/dev/null || need+=(g++)
# TLS (crates/server, crates/client): the openssl crate builds against the system OpenSSL; the
# tests make certificates with the openssl CLI.
pkg-config --exists openssl 2>/dev/null || need+=(pkg-config libssl-dev)
command -v openssl >/dev/null || need+=(openssl)
# Peers for the benchmarks (bench/): installed up front so `make bench` works offline later.
command -v fio >/dev/null || need+=(fio)
command -v nbdkit >/dev/null || need+=(nbdkit)
command -v nbdinfo >/dev/null || need+=(libnbd-bin)
# tests/iscsi.rs: libiscsi's conformance suite (iscsi-test-cu) and iscsi-ls.
command -v iscsi-test-cu >/dev/null || need+=(libiscsi-bin)
command -v qemu-img >/dev/null || need+=(qemu-utils)
command -v nft >/dev/null || need+=(nftables)
command -v ip >/dev/null || need+=(iproute2)
# Every bench script draws its table as a PNG with gnuplot (bench/chart.sh); -nox: no X11.
command -v gnuplot >/dev/null || need+=(gnuplot-nox)
# Mapped block devices (crates/cli/tests/map.rs, bench/map-compare.sh): loop devices, ext4,
# namespaces, and nbdfuse as the comparison peer.
command -v losetup >/dev/null || need+=(mount)
command -v blkdiscard >/dev/null || need+=(util-linux)
command -v unshare >/dev/null || need+=(util-linux)
command -v mkfs.ext4 >/dev/null || need+=(e2fsprogs)
command -v nbdfuse >/dev/null || need+=(libnbd-bin)
# serve --metrics (crates/cli/tests/metrics.rs): scraped with curl, checked with promtool, which
# comes only with Debian's prometheus package (19 MB download, 96 MB installed: the server
# too, whose service is not started in containers without an init system).
# Server-side COPY (crates/cli/tests/copy.rs): reflinks on a loop-mounted XFS, extents read
# with filefrag (e2fsprogs); bench/copy-compare.sh limits a veth link with tc (iproute2).
command -v mkfs.xfs >/dev/null || need+=(xfsprogs)
command -v filefrag >/dev/null || need+=(e2fsprogs)
command -v curl >/dev/null || need+=(curl)
command -v promtool >/dev/null || need+=(prometheus)
# The rbd: backend (crates/backend/src/rbd) links librbd and librados: the default build has it
# only when their headers are here (build.rs). Its tests (crates/cli/tests/rbd.rs),
# bench/rbd-compare.sh and `make demo-rbd` run a one-node cluster (scripts/ceph-cluster.sh):
# a monitor, an OSD with the packaged object classes, and the ceph/rbd tools; fio's rbd engine
# is part of Debian's fio. Daemons only: nothing is started or enabled as a service.
[ -e /usr/include/rbd/librbd.h ] || need+=(librbd-dev)
[ -e /usr/include/rados/librados.h ] || need+=(librados-dev)
command -v ceph-mon >/dev/null || need+=(ceph-mon)
command -v ceph-osd >/dev/null || need+=(ceph-osd)
command -v rbd >/dev/null || need+=(ceph-common)
# iSCSI (issue 17): tgt is the reference target of bench/iscsi-compare.sh and of the kernel lab's
# LAB_ISCSI_REF=tgt (daemons started by them, never as a service); libiscsi-bin's iscsi-perf
# (above) is the benchmark's client; open-iscsi's iscsistart/iscsid/iscsiadm go into the lab's
# guest; qemu-block-extra holds qemu-img's iscsi driver (crates/cli/tests/iscsi_copy.rs).
PATH=$PATH:/usr/sbin:/sbin command -v tgtd >/dev/null || need+=(tgt)
PATH=$PATH:/usr/sbin:/sbin command -v iscsistart >/dev/null || need+=(open-iscsi)
qemu-img --help 2>/dev/null | grep -q '^Supported formats:.* iscsi' || need+=(qemu-block-extra)

if [ ${#need[@]} -gt 0 ]; then
    echo "deps: installing ${need[*]}"
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi
