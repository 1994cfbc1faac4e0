"""The client side of HTTP/3 (aioquic): one QUIC connection, many request streams.

The server is verified against a pinned certificate or CA file (`cafile`); nothing is fetched.
Session tickets are kept, so a reconnect resumes and can send GET requests as 0-RTT early data.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any, AsyncIterator

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent
from aioquic.tls import SessionTicket

from appliance.client import Call, HttpResponse


class _H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.handshake: HandshakeCompleted | None = None
        self._streams: dict[int, asyncio.Queue[dict[str, str] | bytes | Exception | None]] = {}

    async def exchange(self, call: Call, authority: str) -> AsyncIterator[dict[str, str] | bytes]:
        """Send a request; yield the response headers, then each body piece as it arrives."""
        stream_id = self._quic.get_next_available_stream_id()
        headers = [(b":method", call.method.encode()), (b":scheme", b"https"), (b":authority", authority.encode()),
                   (b":path", call.target.encode()), (b"content-length", str(len(call.body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in call.headers]
        parts = self._streams[stream_id] = asyncio.Queue()
        self.http.send_headers(stream_id, headers, end_stream=not call.body)
        if call.body:
            self.http.send_data(stream_id, call.body, end_stream=True)
        self.transmit()
        try:
            while (part := await parts.get()) is not None:
                if isinstance(part, Exception):
                    raise part
                yield part
        finally:
            self._streams.pop(stream_id, None)

    async def request(self, call: Call, authority: str) -> HttpResponse:
        parts = self.exchange(call, authority)
        headers = dict(await anext(parts))  # type: ignore[arg-type]
        body = b"".join([part async for part in parts])  # type: ignore[misc]
        return HttpResponse(int(headers.pop(":status", "0")), headers, body)

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake = event
        if isinstance(event, ConnectionTerminated):
            for parts in self._streams.values():
                parts.put_nowait(ConnectionError(f"QUIC connection closed: {event.reason_phrase}"))
        for h3_event in self.http.handle_event(event):
            parts = self._streams.get(getattr(h3_event, "stream_id", -1))
            if parts is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                parts.put_nowait({k.decode().lower(): v.decode() for k, v in h3_event.headers})
            elif isinstance(h3_event, DataReceived) and h3_event.data:
                parts.put_nowait(h3_event.data)
            if getattr(h3_event, "stream_ended", False):
                parts.put_nowait(None)


class QuicSession:
    """A reconnecting HTTP/3 session to HOST:PORT."""

    def __init__(self, address: str, cafile: str | None, certificate: tuple[str, str] | None = None,
                 local_host: str = "") -> None:
        host, _, port = address.rpartition(":")
        self.certificate = certificate  # (certfile, keyfile) for servers that require mutual TLS
        self.host, self.port = host.strip("[]"), int(port)
        self.cafile = cafile
        self.local_host = local_host  # the source address to send from; any when empty
        self.ticket: SessionTicket | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _H3Client | None = None

    def _configuration(self) -> QuicConfiguration:
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=self.host)
        if self.cafile:
            configuration.load_verify_locations(self.cafile)
        else:
            configuration.verify_mode = ssl.CERT_REQUIRED  # the system's CAs; a box normally pins its own
        if self.certificate:
            configuration.load_cert_chain(*self.certificate)
        configuration.session_ticket = self.ticket
        return configuration

    def _keep_ticket(self, ticket: SessionTicket) -> None:
        self.ticket = ticket

    async def open(self, wait_connected: bool = True) -> None:
        """Connect (aioquic's connect, with a choice of source address)."""
        loop = asyncio.get_running_loop()
        family, _, _, _, address = (await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM))[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((self.local_host, 0))
        except OSError:
            sock.close()
            raise
        connection = QuicConnection(configuration=self._configuration(), session_ticket_handler=self._keep_ticket)
        self._transport, self._protocol = await loop.create_datagram_endpoint(lambda: _H3Client(connection), sock=sock)
        self._protocol.connect(address, transmit=wait_connected)
        if wait_connected:
            try:
                await self._protocol.wait_connected()
            except ConnectionError as exc:
                await self.close()
                raise ConnectionError(f"QUIC handshake with {self.host}:{self.port} failed ({str(exc) or 'no answer'}); "
                                      "is the server's certificate in --cafile?") from None

    @property
    def handshake(self) -> HandshakeCompleted | None:
        """How the current connection's handshake went: session_resumed, early_data_accepted."""
        return self._protocol.handshake if self._protocol is not None else None

    async def send(self, call: Call) -> HttpResponse:
        if self._protocol is None:
            await self.open()
        assert self._protocol is not None
        return await self._protocol.request(call, f"{self.host}:{self.port}")

    async def exchange(self, call: Call) -> AsyncIterator[dict[str, str] | bytes]:
        """The response headers, then each body piece as it arrives."""
        if self._protocol is None:
            await self.open()
        assert self._protocol is not None
        async for part in self._protocol.exchange(call, f"{self.host}:{self.port}"):
            yield part

    async def close(self) -> None:
        if self._protocol is not None and self._transport is not None:
            protocol, transport, self._protocol, self._transport = self._protocol, self._transport, None, None
            protocol.close()
            await protocol.wait_closed()
            transport.close()
