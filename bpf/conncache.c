/* The connection cache on the QUIC listener's UDP socket: a socket filter (SO_ATTACH_BPF).
 *
 * For every datagram it keeps, per peer address and port (IPv4 and IPv6), first and last seen
 * times, packets, bytes, drops and the destination connection ID of the peer's last QUIC packet,
 * in an LRU hash that the kernel bounds and evicts. It also enforces a per-peer packet budget
 * (a token bucket): a datagram over budget is dropped here, before it wakes the daemon.
 *
 * Two tables: `peers` holds only peers the daemon validated (their QUIC handshake completed: it moves
 * them there itself); every other source is kept in `fresh`, a small LRU of its own. A flood of
 * datagrams from sources that never complete a handshake churns `fresh` and cannot evict a validated
 * peer, nor grow the table the daemon reads every second.
 *
 * `droppers` counts the drops of the DROPPERS peers that were over budget last: /metrics reads it and
 * `totals` (one per-CPU array) and never walks `fresh`, however big a flood made it.
 *
 * Offset 0 of a socket filter on a UDP socket is the UDP header; the IP header is read
 * relative to the network header. Every load is bounds-checked by bpf_skb_load_bytes*.
 *
 * Set at load time from config (-D): MAX_ENTRIES, MAX_UNVALIDATED, RATE_PER_S, BURST, HOST_CID_LENGTH;
 * and DROPPERS (conncache.py's).
 */
#include <uapi/linux/bpf.h>
#include <uapi/linux/if_ether.h>
#include <uapi/linux/ip.h>
#include <uapi/linux/ipv6.h>

#define UDP_HEADER 8
#define MAX_CID 20
#define MILLI 1000ULL
#define NS_PER_S 1000000000ULL

struct peer_key {
    u8 family;  /* 4 or 6 */
    u8 pad;
    u16 port;   /* network byte order */
    u32 addr[4];
};

struct peer_stats {
    u64 first_seen_ns;  /* CLOCK_MONOTONIC */
    u64 last_seen_ns;
    u64 packets;        /* admitted */
    u64 bytes;          /* UDP payload bytes admitted */
    u64 drops;          /* over budget */
    u64 tokens_milli;   /* budget left, in thousandths of a packet */
    u64 refilled_ns;
    u8 dcid_len;
    u8 dcid[MAX_CID];
};

BPF_TABLE("lru_hash", struct peer_key, struct peer_stats, peers, MAX_ENTRIES);
BPF_TABLE("lru_hash", struct peer_key, struct peer_stats, fresh, MAX_UNVALIDATED);
BPF_TABLE("lru_hash", struct peer_key, u64, droppers, DROPPERS);

enum { TOTAL_PACKETS, TOTAL_BYTES, TOTAL_DROPS, TOTAL_PEERS, TOTAL_COUNT };
BPF_PERCPU_ARRAY(totals, u64, TOTAL_COUNT);

static __always_inline void count(int index, u64 n) {
    u64 *value = totals.lookup(&index);
    if (value)
        *value += n;
}

static __always_inline int peer_of(struct __sk_buff *skb, struct peer_key *key) {
    u16 source_port;
    if (bpf_skb_load_bytes(skb, 0, &source_port, sizeof(source_port)) < 0)
        return -1;
    key->port = source_port;
    if (skb->protocol == bpf_htons(ETH_P_IP)) {
        key->family = 4;
        return bpf_skb_load_bytes_relative(skb, offsetof(struct iphdr, saddr), &key->addr[0], 4,
                                           BPF_HDR_START_NET);
    }
    if (skb->protocol == bpf_htons(ETH_P_IPV6)) {
        key->family = 6;
        return bpf_skb_load_bytes_relative(skb, offsetof(struct ipv6hdr, saddr), key->addr, 16,
                                           BPF_HDR_START_NET);
    }
    return -1;
}

/* The token bucket: refill for the time since the last packet, then take one packet. */
static __always_inline int within_budget(struct peer_stats *stats, u64 now) {
    u64 full = BURST * MILLI;
    u64 elapsed = now - stats->refilled_ns;
    u64 tokens = stats->tokens_milli;
    if (elapsed >= NS_PER_S * BURST / RATE_PER_S + 1)
        tokens = full;
    else
        tokens += elapsed * RATE_PER_S / (NS_PER_S / MILLI);
    if (tokens > full)
        tokens = full;
    stats->refilled_ns = now;
    if (tokens < MILLI) {
        stats->tokens_milli = tokens;
        return 0;
    }
    stats->tokens_milli = tokens - MILLI;
    return 1;
}

/* QUIC's destination connection ID: after the version in a long header (with its length),
 * right after the first byte in a short header (the length is the server's own choice). */
static __always_inline void remember_dcid(struct __sk_buff *skb, struct peer_stats *stats) {
    u8 first, length;
    u32 offset;
    if (bpf_skb_load_bytes(skb, UDP_HEADER, &first, 1) < 0)
        return;
    if (first & 0x80) {
        if (bpf_skb_load_bytes(skb, UDP_HEADER + 5, &length, 1) < 0 || length > MAX_CID)
            return;
        offset = UDP_HEADER + 6;
    } else {
        length = HOST_CID_LENGTH;
        offset = UDP_HEADER + 1;
    }
    if (bpf_skb_load_bytes(skb, offset, stats->dcid, MAX_CID) < 0)
        return;  /* shorter than any real QUIC packet carrying a full-size ID */
    stats->dcid_len = length;
}

int conncache_filter(struct __sk_buff *skb) {
    struct peer_key key = {};
    if (peer_of(skb, &key) < 0)
        return skb->len;  /* not an IP/UDP datagram we can read: let user space judge it */
    u64 now = bpf_ktime_get_ns();
    struct peer_stats *stats = peers.lookup(&key);
    if (!stats)
        stats = fresh.lookup(&key);
    if (!stats) {
        struct peer_stats first = {};
        first.first_seen_ns = now;
        first.refilled_ns = now;
        first.tokens_milli = BURST * MILLI;
        fresh.update(&key, &first);
        stats = fresh.lookup(&key);
        if (!stats)
            return skb->len;
        count(TOTAL_PEERS, 1);
    }
    stats->last_seen_ns = now;
    if (!within_budget(stats, now)) {
        __sync_fetch_and_add(&stats->drops, 1);
        count(TOTAL_DROPS, 1);
        u64 *dropped = droppers.lookup(&key);
        if (dropped)
            __sync_fetch_and_add(dropped, 1);
        else
            droppers.update(&key, &stats->drops);
        return 0;  /* dropped in the kernel */
    }
    u64 payload = skb->len > UDP_HEADER ? skb->len - UDP_HEADER : 0;
    __sync_fetch_and_add(&stats->packets, 1);
    __sync_fetch_and_add(&stats->bytes, payload);
    count(TOTAL_PACKETS, 1);
    count(TOTAL_BYTES, payload);
    remember_dcid(skb, stats);
    return skb->len;
}
