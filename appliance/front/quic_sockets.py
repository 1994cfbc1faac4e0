"""The UDP sockets of the QUIC port: the engine's one where it serves QUIC itself, else one per protocol
worker in one SO_REUSEPORT group; and the keys that name each worker's connections (transport/steering_ids.py)."""

from __future__ import annotations

import secrets
import socket

from appliance.config import QuicConfig


def quic_sockets(quic: QuicConfig, from_systemd: socket.socket | None, count: int) -> tuple[list[socket.socket], str]:
    """One UDP socket per worker on the QUIC port, all in one SO_REUSEPORT group (for one, a socket of
    its own, which no other process can bind): systemd's socket (or our own) first. Fewer than `count`
    where the group cannot be made, with the reason."""
    first = from_systemd
    if first is None:
        family = socket.AF_INET6 if ":" in quic.host else socket.AF_INET
        first = socket.socket(family, socket.SOCK_DGRAM)
        if count > 1:  # alone, the port stays the box's: another process's bind fails
            first.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        try:
            first.bind((quic.host, quic.port))
        except OSError:
            first.close()
            raise
    _receive_buffer(first)
    if count == 1:
        return [first], ""
    if not first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT):
        return [first], "the UDP socket from systemd is not SO_REUSEPORT (ReusePort=yes in appliance.socket)"
    socks = [first]
    for _ in range(count - 1):
        extra = socket.socket(first.family, socket.SOCK_DGRAM)
        extra.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        _receive_buffer(extra)
        try:
            extra.bind(first.getsockname()[:2])
        except OSError as exc:  # e.g. systemd made the first socket as another user: no group with it
            extra.close()
            for made in socks[1:]:
                made.close()
            return [first], f"cannot join the QUIC port's SO_REUSEPORT group: {exc.strerror or exc}"
        socks.append(extra)
    return socks, ""


RECEIVE_BUFFER = 4 << 20  # per QUIC socket: a burst of datagrams waits while its worker is busy
SO_RCVBUFFORCE = 33  # asm-generic/socket.h; Python's socket module does not name it


def _receive_buffer(sock: socket.socket) -> None:
    """SO_RCVBUFFORCE where allowed (CAP_NET_ADMIN: the unit grants it), else as much as rmem_max allows."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, RECEIVE_BUFFER)
    except OSError:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECEIVE_BUFFER)


def worker_keys(count: int) -> list[int]:
    """Distinct random nonzero 32-bit keys, one per QUIC worker: its connection IDs start with it."""
    keys: set[int] = set()
    while len(keys) < count:
        keys.add(secrets.randbits(32) or 1)
    return list(keys)
