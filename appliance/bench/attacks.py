"""Hostile HTTP/3 peers, for the tests (tests/test_hostile_h3.py) and the bench (hostile.py): aioquic's
own client with its QPACK encoder stream and HEADERS frames written by hand, so that what it sends is
not for aioquic's encoder to check: one 4 KB dynamic-table entry referenced by thousands of one-byte
field lines (a QPACK bomb), or a HEADERS frame that says it is 16 MB long."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, QuicEvent, StopSendingReceived

ENTRY = b"a" * 4000  # the dynamic-table entry a bomb references


def prefixed(value: int, bits: int, flags: int = 0) -> bytes:
    """An HPACK/QPACK prefix integer (RFC 7541 section 5.1)."""
    mask = (1 << bits) - 1
    if value < mask:
        return bytes([flags | value])
    out, value = bytearray([flags | mask]), value - mask
    while value >= 0x80:
        out.append(0x80 | value & 0x7F)
        value >>= 7
    return bytes([*out, value])


def bomb(references: int) -> bytes:
    """A request's field section: the pseudo-headers from the static table, then `references`
    one-byte references to dynamic entry 0 (Required Insert Count 1, encoded as 2; Base 1)."""
    static = bytes([0xD1, 0xD7, 0xC1])  # :method GET, :scheme https, :path /
    authority = b"\x50" + prefixed(9, 7) + b"localhost"  # :authority from the static name
    return b"\x02\x00" + static + authority + b"\x80" * references


# GET /v2/health/ready, static table only: :method GET, :scheme https, :authority and :path by name
HEALTH = b"\x00\x00\xd1\xd7\x50" + prefixed(9, 7) + b"localhost" + b"\x51" + prefixed(16, 7) + b"/v2/health/ready"


class HandEncoder:
    """The attacker's QPACK encoder: its instructions are written by hand, so what the server's decoder
    acknowledges is not for aioquic's own encoder to check."""

    def apply_settings(self, max_table_capacity: int, blocked_streams: int) -> bytes:
        return b""  # the table is the hand's: capacity 4096 is set with the first insert

    def feed_decoder(self, data: bytes) -> None:
        pass


class Attacker(QuicConnectionProtocol):
    """A QUIC peer with HTTP/3's control streams, whose requests are raw bytes on request streams."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.http._encoder = HandEncoder()  # type: ignore[assignment]  # aioquic's Encoder, by duck typing
        self.answers: dict[int, asyncio.Future[tuple[int, bytes]]] = {}
        self.bodies: dict[int, bytes] = {}
        self.statuses: dict[int, int] = {}
        self.stopped: dict[int, int] = {}  # stream -> STOP_SENDING's error code
        self.closed: asyncio.Future[ConnectionTerminated] = asyncio.get_running_loop().create_future()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StopSendingReceived):
            self.stopped[event.stream_id] = event.error_code
        elif isinstance(event, ConnectionTerminated) and not self.closed.done():
            self.closed.set_result(event)
        for h3 in self.http.handle_event(event):
            if not isinstance(h3, HeadersReceived | DataReceived):
                continue
            if isinstance(h3, HeadersReceived):
                self.statuses[h3.stream_id] = int(dict(h3.headers)[b":status"])
            else:
                self.bodies[h3.stream_id] = self.bodies.get(h3.stream_id, b"") + h3.data
            if h3.stream_ended and h3.stream_id in self.answers:
                self.answers[h3.stream_id].set_result((self.statuses[h3.stream_id], self.bodies.get(h3.stream_id, b"")))

    async def settings(self) -> dict[int, int]:
        for _ in range(200):
            if self.http.received_settings is not None:
                return self.http.received_settings
            await asyncio.sleep(0.01)
        raise AssertionError("no SETTINGS from the server")

    async def insert(self, name: bytes, value: bytes) -> None:
        """Set the dynamic table's capacity and insert one entry (RFC 9204 sections 4.3.1, 4.3.3); return
        once the server has it (the server allows no blocked streams: a reference may not overtake it)."""
        instructions = prefixed(4096, 5, 0x20) + prefixed(len(name), 5, 0x40) + name + prefixed(len(value), 7) + value
        stream_id = self.http._local_encoder_stream_id
        assert stream_id is not None  # opened with the connection's control streams
        self._quic.send_stream_data(stream_id, instructions)
        self.transmit()
        sender = self._quic._streams[stream_id].sender
        for _ in range(500):
            if sender._buffer_start == sender._buffer_stop:  # all acknowledged
                return
            await asyncio.sleep(0.01)
        raise AssertionError("the server did not acknowledge the encoder stream")

    def send_raw(self, data: bytes, end_stream: bool = True) -> int:
        stream_id = self._quic.get_next_available_stream_id()
        self.answers[stream_id] = asyncio.get_running_loop().create_future()
        self._quic.send_stream_data(stream_id, data, end_stream=end_stream)
        self.transmit()
        return stream_id


@contextlib.asynccontextmanager
async def attacker(address: str, cafile: str) -> AsyncIterator[Attacker]:
    """An Attacker connected to the QUIC listener at `address` ("host:port"), the server's certificate
    checked against `cafile`."""
    configuration = QuicConfiguration(alpn_protocols=H3_ALPN, verify_mode=ssl.CERT_REQUIRED)
    configuration.load_verify_locations(cafile)
    host, port = address.rsplit(":", 1)
    async with connect(host, int(port), configuration=configuration, create_protocol=Attacker) as protocol:
        assert isinstance(protocol, Attacker)
        yield protocol
