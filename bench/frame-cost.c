// What the kernel's per-frame path costs raw Ethernet over veth: AF_PACKET (sendmmsg, and a
// TPACKET_V2 receive ring, as blkwire's eth:// does; or a TPACKET_V2 transmit ring, "txring")
// against AF_XDP (an XDP program on the veth redirecting blkwire's EtherType to an XSK socket,
// copy mode: veth has no zero-copy AF_XDP).
// Issue 19 item 1 names AF_XDP and a TX ring as levers for eth:// at 4k QD32; this measures them without
// touching blkwire: a client keeps QD small request frames in flight, a server answers each with
// one reply frame of SIZE bytes, both busy-poll. Built and run by bench/frame-cost.sh, which makes
// the namespaces; not part of blkwire.
//
//   frame-cost server|client packet|xdp IFNAME PEER_MAC SIZE QD SECONDS [drv|skb|txring]
//
// The client prints "replies N seconds S busy_ticks B" (the machine's busy CPU over the run,
// from after its first window was sent); the script turns those into a rate and a cost.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/bpf.h>
#include <linux/if_ether.h>
#include <linux/if_link.h>
#include <linux/if_packet.h>
#include <linux/if_xdp.h>
#include <net/if.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define ETYPE 0x88B5
#define REQ_LEN 64
#define BATCH 64

static void die(const char *what) {
    fprintf(stderr, "frame-cost: %s: %s\n", what, strerror(errno));
    exit(1);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}

// The whole machine's busy CPU ticks (user, nice, system, irq, softirq), from /proc/stat.
static long busy_ticks(void) {
    long v[7] = {0};
    FILE *f = fopen("/proc/stat", "r");
    if (!f || fscanf(f, "cpu %ld %ld %ld %ld %ld %ld %ld", &v[0], &v[1], &v[2], &v[3], &v[4],
                     &v[5], &v[6]) != 7)
        die("/proc/stat");
    fclose(f);
    return v[0] + v[1] + v[2] + v[5] + v[6];
}

static int is_server, size, qd;
static double seconds;
static unsigned char my_mac[6], peer_mac[6];
static int ifindex;

static void fill_frame(unsigned char *f, int len, uint32_t seq) {
    memcpy(f, peer_mac, 6);
    memcpy(f + 6, my_mac, 6);
    f[12] = ETYPE >> 8;
    f[13] = ETYPE & 0xff;
    memcpy(f + 14, &seq, 4);
    (void)len;
}

static int frame_ok(const unsigned char *f, int len) {
    return len >= 18 && f[12] == (ETYPE >> 8) && f[13] == (ETYPE & 0xff);
}

// What a loop does after receiving `got` frames: -1 stop (the client's time is up), 0 poll
// again (nothing came), 1 answer them (the server) or send as many requests (the client).
static int after_receive(int got, long *replies, double end) {
    if (!is_server) {
        *replies += got;
        if (now() > end) return -1;
    }
    return got ? 1 : 0;
}

// Tells bench/frame-cost.sh that frames sent now will be answered.
static void ready(void) {
    printf("ready\n");
    fflush(stdout);
}

// ---- AF_PACKET: sendmmsg (or a TPACKET_V2 transmit ring) out, TPACKET_V2 ring in -------------

// The AF_PACKET sender: one sendmmsg of prepared frames, or (`txring`) a PACKET_TX_RING where
// each frame is written into a ring slot (a memcpy of its bytes, as a sender that builds replies
// would do) and one send() hands the batch to the kernel, whose skbs point at the ring's pages
// instead of copying them.
static struct {
    int fd, txring;
    unsigned char *ring;
    struct tpacket_req req;
    unsigned slot;
    unsigned char frame[BATCH][1 << 14];
    struct mmsghdr msgs[BATCH];
    struct iovec iov[BATCH];
} ptx;

static void packet_kick(void) {
    if (send(ptx.fd, NULL, 0, MSG_DONTWAIT) < 0 && errno != EAGAIN && errno != ENOBUFS)
        die("send (tx ring)");
}

static void packet_send(int n, int len) {
    if (!ptx.txring) {
        if (sendmmsg(ptx.fd, ptx.msgs, n, 0) != n) die("sendmmsg");
        return;
    }
    const size_t data_off = TPACKET2_HDRLEN - sizeof(struct sockaddr_ll);
    for (int i = 0; i < n; i++) {
        struct tpacket2_hdr *h = (void *)(ptx.ring + (size_t)ptx.slot * ptx.req.tp_frame_size);
        // A slot is free again once the kernel has freed its skb (on veth: after the receiver's
        // copy); kick until it is.
        while (__atomic_load_n(&h->tp_status, __ATOMIC_ACQUIRE) != TP_STATUS_AVAILABLE)
            packet_kick();
        memcpy((unsigned char *)h + data_off, ptx.frame[i], len);
        h->tp_len = len;
        __atomic_store_n(&h->tp_status, TP_STATUS_SEND_REQUEST, __ATOMIC_RELEASE);
        ptx.slot = (ptx.slot + 1) % ptx.req.tp_frame_nr;
    }
    packet_kick();
}

static void run_packet(int txring) {
    int fd = socket(AF_PACKET, SOCK_RAW, htons(ETYPE));
    if (fd < 0) die("packet socket");
    int v = TPACKET_V2;
    if (setsockopt(fd, SOL_PACKET, PACKET_VERSION, &v, sizeof v)) die("PACKET_VERSION");
    struct tpacket_req req = {.tp_block_size = 1 << 22, .tp_block_nr = 8, .tp_frame_size = 1 << 14};
    req.tp_frame_nr = req.tp_block_size / req.tp_frame_size * req.tp_block_nr;
    if (setsockopt(fd, SOL_PACKET, PACKET_RX_RING, &req, sizeof req)) die("PACKET_RX_RING");
    size_t rx_bytes = (size_t)req.tp_block_size * req.tp_block_nr, tx_bytes = 0;
    ptx.fd = fd;
    ptx.txring = txring;
    ptx.req = (struct tpacket_req){.tp_block_size = 1 << 22, .tp_block_nr = 2, .tp_frame_size = 1 << 14};
    ptx.req.tp_frame_nr = ptx.req.tp_block_size / ptx.req.tp_frame_size * ptx.req.tp_block_nr;
    if (txring) {
        if (setsockopt(fd, SOL_PACKET, PACKET_TX_RING, &ptx.req, sizeof ptx.req)) die("PACKET_TX_RING");
        tx_bytes = (size_t)ptx.req.tp_block_size * ptx.req.tp_block_nr;
    }
    // Both rings share one mapping, the receive ring first.
    unsigned char *ring = mmap(0, rx_bytes + tx_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (ring == MAP_FAILED) die("mmap ring");
    ptx.ring = ring + rx_bytes;
    struct sockaddr_ll sll = {.sll_family = AF_PACKET, .sll_protocol = htons(ETYPE),
                              .sll_ifindex = ifindex, .sll_halen = 6};
    memcpy(sll.sll_addr, peer_mac, 6);
    if (bind(fd, (struct sockaddr *)&sll, sizeof sll)) die("bind");

    ready();
    int out_len = is_server ? size : REQ_LEN;
    for (int i = 0; i < BATCH; i++) {
        fill_frame(ptx.frame[i], out_len, 0);
        ptx.iov[i] = (struct iovec){ptx.frame[i], out_len};
        ptx.msgs[i] = (struct mmsghdr){.msg_hdr = {.msg_name = &sll, .msg_namelen = sizeof sll,
                                                   .msg_iov = &ptx.iov[i], .msg_iovlen = 1}};
    }
    unsigned slot = 0;
    long replies = 0;
    if (!is_server)  // prime the window
        for (int i = 0; i < qd; i += BATCH) packet_send(qd - i < BATCH ? qd - i : BATCH, out_len);
    long busy = busy_ticks();
    double start = now(), end = start + seconds;
    for (;;) {
        int got = 0;
        for (;;) {
            struct tpacket2_hdr *h = (void *)(ring + (size_t)slot * req.tp_frame_size);
            if (!(__atomic_load_n(&h->tp_status, __ATOMIC_ACQUIRE) & TP_STATUS_USER)) break;
            if (frame_ok((unsigned char *)h + h->tp_mac, h->tp_snaplen)) got++;
            __atomic_store_n(&h->tp_status, TP_STATUS_KERNEL, __ATOMIC_RELEASE);
            slot = (slot + 1) % req.tp_frame_nr;
            if (got == BATCH) break;
        }
        int next = after_receive(got, &replies, end);
        if (next < 0) break;
        if (!next) continue;
        packet_send(got, out_len);
    }
    printf("replies %ld seconds %.3f busy_ticks %ld\n", replies, now() - start,
           busy_ticks() - busy);
}

// ---- AF_XDP: an XDP program redirects ETYPE to the socket of queue 0 -------------------------

static long bpf(int cmd, union bpf_attr *attr) {
    return syscall(__NR_bpf, cmd, attr, sizeof *attr);
}

struct ring {
    uint32_t *producer, *consumer, *flags;
    void *desc;
    uint32_t mask, cached;
};

static void map_ring(int fd, struct xdp_ring_offset *o, uint64_t pgoff, size_t entry, uint32_t n,
                     struct ring *r) {
    void *m = mmap(0, o->desc + n * entry, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd,
                   pgoff);
    if (m == MAP_FAILED) die("mmap xdp ring");
    r->producer = (uint32_t *)((char *)m + o->producer);
    r->consumer = (uint32_t *)((char *)m + o->consumer);
    r->flags = (uint32_t *)((char *)m + o->flags);
    r->desc = (char *)m + o->desc;
    r->mask = n - 1;
    r->cached = 0;
}

#define NFRAMES 4096
#define CHUNK 4096
#define MAX_SIZE 9000
// Multi-buffer AF_XDP (Linux 6.6; not in older uapi headers): a frame larger than a UMEM chunk
// is several descriptors, all but the last marked XDP_PKT_CONTD.
#ifndef XDP_USE_SG
#define XDP_USE_SG (1 << 4)
#endif
#ifndef XDP_PKT_CONTD
#define XDP_PKT_CONTD (1 << 0)
#endif

static int xdp_attach(int xsk_fd, const char *mode) {
    union bpf_attr a;
    memset(&a, 0, sizeof a);
    a.map_type = BPF_MAP_TYPE_XSKMAP;
    a.key_size = 4;
    a.value_size = 4;
    a.max_entries = 1;
    int map = bpf(BPF_MAP_CREATE, &a);
    if (map < 0) die("BPF_MAP_CREATE xskmap");
    uint32_t key = 0, val = xsk_fd;
    memset(&a, 0, sizeof a);
    a.map_fd = map;
    a.key = (uint64_t)(uintptr_t)&key;
    a.value = (uint64_t)(uintptr_t)&val;
    if (bpf(BPF_MAP_UPDATE_ELEM, &a)) die("xskmap update");
    // r2 = data; r3 = data_end; if data + 14 > data_end: pass; if ethertype != ETYPE: pass;
    // return bpf_redirect_map(map, rx_queue_index, XDP_PASS)
    struct bpf_insn p[] = {
        {BPF_LDX | BPF_W | BPF_MEM, 2, 1, 0, 0},
        {BPF_LDX | BPF_W | BPF_MEM, 3, 1, 4, 0},
        {BPF_ALU64 | BPF_MOV | BPF_X, 4, 2, 0, 0},
        {BPF_ALU64 | BPF_ADD | BPF_K, 4, 0, 0, 14},
        {BPF_JMP | BPF_JGT | BPF_X, 4, 3, 8, 0},
        {BPF_LDX | BPF_H | BPF_MEM, 5, 2, 12, 0},
        {BPF_JMP | BPF_JNE | BPF_K, 5, 0, 6, htons(ETYPE)},
        {BPF_LDX | BPF_W | BPF_MEM, 2, 1, 16, 0},
        {BPF_LD | BPF_DW | BPF_IMM, 1, BPF_PSEUDO_MAP_FD, 0, map},
        {0, 0, 0, 0, 0},
        {BPF_ALU64 | BPF_MOV | BPF_K, 3, 0, 0, XDP_PASS},
        {BPF_JMP | BPF_CALL, 0, 0, 0, BPF_FUNC_redirect_map},
        {BPF_JMP | BPF_EXIT, 0, 0, 0, 0},
        {BPF_ALU64 | BPF_MOV | BPF_K, 0, 0, 0, XDP_PASS},
        {BPF_JMP | BPF_EXIT, 0, 0, 0, 0},
    };
    static char log[65536];
    memset(&a, 0, sizeof a);
    a.prog_type = BPF_PROG_TYPE_XDP;
    a.prog_flags = BPF_F_XDP_HAS_FRAGS;  // it reads only the linear head, so frames may be any size
    a.insns = (uint64_t)(uintptr_t)p;
    a.insn_cnt = sizeof p / sizeof p[0];
    a.license = (uint64_t)(uintptr_t) "GPL";
    a.log_buf = (uint64_t)(uintptr_t)log;
    a.log_size = sizeof log;
    a.log_level = 1;
    int prog = bpf(BPF_PROG_LOAD, &a);
    if (prog < 0) {
        fprintf(stderr, "%s\n", log);
        die("BPF_PROG_LOAD");
    }
    memset(&a, 0, sizeof a);
    a.link_create.prog_fd = prog;
    a.link_create.target_ifindex = ifindex;
    a.link_create.attach_type = BPF_XDP;
    a.link_create.flags = strcmp(mode, "skb") == 0 ? XDP_FLAGS_SKB_MODE : XDP_FLAGS_DRV_MODE;
    int link;
    for (int tries = 0; (link = bpf(BPF_LINK_CREATE, &a)) < 0; tries++) {
        if (errno != EBUSY || tries == 300) die("attach XDP (BPF_LINK_CREATE)");
        usleep(10000);
    }
    return link;  // attached while open
}

static void run_xdp(const char *mode) {
    int fd = socket(AF_XDP, SOCK_RAW, 0);
    if (fd < 0) die("AF_XDP socket");
    unsigned char *umem = mmap(0, (size_t)NFRAMES * CHUNK, PROT_READ | PROT_WRITE,
                               MAP_PRIVATE | MAP_ANONYMOUS | MAP_POPULATE, -1, 0);
    if (umem == MAP_FAILED) die("mmap umem");
    struct xdp_umem_reg ur = {.addr = (uint64_t)(uintptr_t)umem, .len = (uint64_t)NFRAMES * CHUNK,
                              .chunk_size = CHUNK, .headroom = 0};
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_REG, &ur, sizeof ur)) die("XDP_UMEM_REG");
    uint32_t n = NFRAMES / 2;
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_FILL_RING, &n, 4)) die("FILL_RING");
    if (setsockopt(fd, SOL_XDP, XDP_UMEM_COMPLETION_RING, &n, 4)) die("COMPLETION_RING");
    if (setsockopt(fd, SOL_XDP, XDP_RX_RING, &n, 4)) die("RX_RING");
    if (setsockopt(fd, SOL_XDP, XDP_TX_RING, &n, 4)) die("TX_RING");
    struct xdp_mmap_offsets off;
    socklen_t ol = sizeof off;
    if (getsockopt(fd, SOL_XDP, XDP_MMAP_OFFSETS, &off, &ol)) die("XDP_MMAP_OFFSETS");
    struct ring fill, comp, rx, tx;
    map_ring(fd, &off.fr, XDP_UMEM_PGOFF_FILL_RING, 8, n, &fill);
    map_ring(fd, &off.cr, XDP_UMEM_PGOFF_COMPLETION_RING, 8, n, &comp);
    map_ring(fd, &off.rx, XDP_PGOFF_RX_RING, sizeof(struct xdp_desc), n, &rx);
    map_ring(fd, &off.tx, XDP_PGOFF_TX_RING, sizeof(struct xdp_desc), n, &tx);
    // frames [0, n) receive, [n, 2n) transmit
    uint64_t *fd_addrs = fill.desc;
    for (uint32_t i = 0; i < n; i++) fd_addrs[i] = (uint64_t)i * CHUNK;
    __atomic_store_n(fill.producer, n, __ATOMIC_RELEASE);
    uint32_t fill_prod = n;
    struct sockaddr_xdp sx = {.sxdp_family = AF_XDP, .sxdp_ifindex = ifindex, .sxdp_queue_id = 0,
                              .sxdp_flags = XDP_COPY | XDP_USE_SG};
    // The socket of the run before may still hold queue 0 for a moment after its process exits.
    for (int tries = 0; bind(fd, (struct sockaddr *)&sx, sizeof sx); tries++) {
        if (errno != EBUSY || tries == 300) die("bind AF_XDP");
        usleep(10000);
    }
    int link = xdp_attach(fd, mode);
    (void)link;
    ready();

    int out_len = is_server ? size : REQ_LEN;
    uint64_t free_tx[NFRAMES];
    uint32_t nfree = 0;
    for (uint32_t i = n; i < 2 * n; i++) {
        fill_frame(umem + (size_t)i * CHUNK, out_len, 0);
        free_tx[nfree++] = (uint64_t)i * CHUNK;
    }
    uint32_t rx_cons = 0, tx_prod = 0, comp_cons = 0;
    int continued = 0;
    long replies = 0;

// Queues `count` replies (or requests) on the TX ring; `kick` hands them to the kernel.
#define SEND(count)                                                                        \
    do {                                                                                   \
        uint32_t c_ = (count);                                                             \
        struct xdp_desc *d_ = tx.desc;                                                     \
        for (uint32_t k_ = 0; k_ < c_; k_++) {                                             \
            for (int left_ = out_len; left_ > 0; left_ -= CHUNK) {                         \
                if (!nfree) { fprintf(stderr, "frame-cost: out of tx frames\n"); exit(1); } \
                d_[tx_prod++ & tx.mask] = (struct xdp_desc){                               \
                    free_tx[--nfree], left_ > CHUNK ? CHUNK : left_,                        \
                    left_ > CHUNK ? XDP_PKT_CONTD : 0};                                    \
            }                                                                              \
        }                                                                                  \
        __atomic_store_n(tx.producer, tx_prod, __ATOMIC_RELEASE);                         \
    } while (0)

    if (!is_server)
        for (int i = 0; i < qd; i += BATCH) SEND(qd - i < BATCH ? qd - i : BATCH);
    long busy = busy_ticks();
    double start = now(), end = start + seconds;
    for (;;) {
        // In copy mode one sendto sends at most 32 descriptors: kick while any are left, so a
        // reply of several chunks does not wait for the next request.
        if (__atomic_load_n(tx.consumer, __ATOMIC_ACQUIRE) != tx_prod &&
            sendto(fd, NULL, 0, MSG_DONTWAIT, NULL, 0) < 0 && errno != EAGAIN && errno != EBUSY &&
            errno != ENOBUFS)
            die("sendto (tx kick)");
        // reclaim sent frames
        uint32_t cp = __atomic_load_n(comp.producer, __ATOMIC_ACQUIRE);
        uint64_t *ca = comp.desc;
        while (comp_cons != cp) free_tx[nfree++] = ca[comp_cons++ & comp.mask];
        __atomic_store_n(comp.consumer, comp_cons, __ATOMIC_RELEASE);

        uint32_t rp = __atomic_load_n(rx.producer, __ATOMIC_ACQUIRE);
        uint32_t got = 0;
        struct xdp_desc *rd = rx.desc;
        while (rx_cons != rp && got < BATCH) {
            struct xdp_desc d = rd[rx_cons++ & rx.mask];
            // A frame is counted at its first descriptor; its others only go back to the fill ring.
            if (!continued && frame_ok(umem + d.addr, d.len)) got++;
            continued = d.options & XDP_PKT_CONTD;
            fd_addrs[fill_prod++ & fill.mask] = d.addr;
        }
        __atomic_store_n(rx.consumer, rx_cons, __ATOMIC_RELEASE);
        __atomic_store_n(fill.producer, fill_prod, __ATOMIC_RELEASE);
        int next = after_receive(got, &replies, end);
        if (next < 0) break;
        if (!next) continue;
        SEND(got);
    }
    printf("replies %ld seconds %.3f busy_ticks %ld\n", replies, now() - start,
           busy_ticks() - busy);
}

static void parse_mac(const char *s, unsigned char *m) {
    if (sscanf(s, "%hhx:%hhx:%hhx:%hhx:%hhx:%hhx", &m[0], &m[1], &m[2], &m[3], &m[4], &m[5]) != 6) {
        fprintf(stderr, "frame-cost: '%s' is not a MAC address\n", s);
        exit(2);
    }
}

int main(int argc, char **argv) {
    if (argc < 8) {
        fprintf(stderr, "usage: frame-cost server|client packet|xdp IFNAME PEER_MAC SIZE QD SECONDS [drv|skb|txring]\n");
        return 2;
    }
    is_server = strcmp(argv[1], "server") == 0;
    ifindex = if_nametoindex(argv[3]);
    if (!ifindex) die(argv[3]);
    parse_mac(argv[4], peer_mac);
    size = atoi(argv[5]);
    qd = atoi(argv[6]);
    seconds = atof(argv[7]);
    if (size < REQ_LEN || size > MAX_SIZE || qd < 1 || qd > 1024) {
        fprintf(stderr, "frame-cost: SIZE must be %d..%d, QD 1..1024\n", REQ_LEN, MAX_SIZE);
        return 2;
    }
    char path[128];
    snprintf(path, sizeof path, "/sys/class/net/%s/address", argv[3]);
    FILE *f = fopen(path, "r");
    char buf[64];
    if (!f || !fgets(buf, sizeof buf, f)) die(path);
    fclose(f);
    parse_mac(buf, my_mac);
    if (strcmp(argv[2], "xdp") == 0)
        run_xdp(argc > 8 ? argv[8] : "drv");
    else
        run_packet(argc > 8 && strcmp(argv[8], "txring") == 0);
    return 0;
}
