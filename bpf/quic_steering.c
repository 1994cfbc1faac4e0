/* QUIC steering across the worker sockets of one SO_REUSEPORT group: an SK_REUSEPORT program
 * (SO_ATTACH_REUSEPORT_EBPF), as nginx's ngx_quic_reuseport_helper.c does it.
 *
 * Every connection ID a worker chooses (8 bytes) starts with that worker's 4-byte key. For each
 * datagram this reads the destination connection ID (long header: after the version and the
 * length byte; short header: right after the first byte) and, when its first 4 bytes are a key
 * in the workers map, hands the datagram to that worker's socket. Anything else (a client's
 * first Initial or 0-RTT, whose DCID the client chose; the Initial that answers a Retry; an
 * unknown key; a short or garbled datagram) returns SK_PASS without selecting, and the kernel's
 * reuseport hash of the 4-tuple picks, as it would without this program. So a connection stays
 * with its worker when the client's address or port changes (migration, NAT rebinding), which
 * the hash alone cannot do.
 *
 * The context's data starts at the UDP header; bpf_skb_load_bytes bounds-checks every read.
 * The workers map (a SOCKHASH: the key's 4 bytes as on the wire -> a socket) is made and filled
 * by the loader, which passes its fd in: bcc has no way to name a map as a helper's argument,
 * so the program refers to it with bpf_pseudo_fd, which the kernel resolves at load time.
 * Set at load time (-D): WORKERS_FD, HOST_CID_LENGTH.
 */
#include <uapi/linux/bpf.h>

#define UDP_HEADER 8
#define KEY_LENGTH 4

int quic_steering(struct sk_reuseport_md *ctx) {
    u8 first, length;
    u32 offset, key;
    if (bpf_skb_load_bytes(ctx, UDP_HEADER, &first, 1) < 0)
        return SK_PASS;
    if (first & 0x80) {  /* long header: flags, version (4), DCID length, DCID */
        if (bpf_skb_load_bytes(ctx, UDP_HEADER + 5, &length, 1) < 0 || length != HOST_CID_LENGTH)
            return SK_PASS;
        offset = UDP_HEADER + 6;
    } else {  /* short header: flags, DCID (the length is ours) */
        offset = UDP_HEADER + 1;
    }
    if (bpf_skb_load_bytes(ctx, offset, &key, KEY_LENGTH) < 0)
        return SK_PASS;
    /* -ENOENT for an unknown key: nothing selected, and the kernel's hash picks */
    bpf_sk_select_reuseport(ctx, (void *)bpf_pseudo_fd(1, WORKERS_FD), &key, 0);
    return SK_PASS;
}
