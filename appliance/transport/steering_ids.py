"""Host connection IDs that name their worker: the first 4 bytes of every ID a QUIC worker's connections
choose for themselves are its key, so that bpf/quic_steering.c hands their packets to its socket."""

from __future__ import annotations

from aioquic.quic.connection import QuicConnection

WORKER_KEY_LENGTH = 4  # bytes of a host connection ID that name its worker (bpf/quic_steering.c)


def tag_cid(cid: bytes, key: int) -> bytes:
    """`cid` with its first 4 bytes replaced by the worker's key, big-endian (as the steering program
    reads the wire); idempotent, so tagging an already tagged ID changes nothing."""
    return key.to_bytes(WORKER_KEY_LENGTH, "big") + cid[WORKER_KEY_LENGTH:]


def tag_connection_ids(quic: QuicConnection, key: int) -> None:
    """Make every connection ID this server-side connection chooses for itself start with `key`, so
    that bpf/quic_steering.c hands its packets to this worker's socket whatever the client's address.

    aioquic draws host IDs at random in two places: the first in QuicConnection.__init__, and the
    rest in _replenish_connection_ids (announced later in NEW_CONNECTION_ID frames). QuicServer calls
    our create_protocol right after constructing the connection, before anything is sent or the
    IDs are registered, so the first is retagged here (it is also the handshake's source ID and the
    initial_source_connection_id transport parameter) and the replenishing is wrapped. The ID of a
    Retry is drawn by QuicServer itself and stays random: the Initial that answers it comes from
    the same address and port, which the kernel's reuseport hash sends to this same socket."""
    first = quic._host_cids[0]
    first.cid = tag_cid(first.cid, key)
    quic.host_cid = first.cid
    quic._local_initial_source_connection_id = first.cid
    replenish = quic._replenish_connection_ids

    def replenish_tagged() -> None:
        replenish()
        for connection_id in quic._host_cids:
            connection_id.cid = tag_cid(connection_id.cid, key)

    quic._replenish_connection_ids = replenish_tagged  # type: ignore[method-assign]
