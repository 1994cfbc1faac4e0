"""The client side of HTTP/3 (aioquic): one QUIC connection, many request streams.

The server is verified against a pinned certificate or CA file (`cafile`); nothing is fetched.
Session tickets are kept, so a reconnect resumes and can send GET requests as 0-RTT early data.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol, connect
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent
from aioquic.tls import SessionTicket

from appliance.client import Call, HttpResponse


class _H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.handshake: HandshakeCompleted | None = None
        self._pending: dict[int, tuple[asyncio.Future[HttpResponse], dict[str, str], list[bytes]]] = {}

    async def request(self, call: Call, authority: str) -> HttpResponse:
        stream_id = self._quic.get_next_available_stream_id()
        headers = [(b":method", call.method.encode()), (b":scheme", b"https"), (b":authority", authority.encode()),
                   (b":path", call.target.encode()), (b"content-length", str(len(call.body)).encode())]
        headers += [(k.lower().encode(), v.encode()) for k, v in call.headers]
        future: asyncio.Future[HttpResponse] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = (future, {}, [])
        self.http.send_headers(stream_id, headers, end_stream=not call.body)
        if call.body:
            self.http.send_data(stream_id, call.body, end_stream=True)
        self.transmit()
        return await future

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, HandshakeCompleted):
            self.handshake = event
        if isinstance(event, ConnectionTerminated):
            for future, _, _ in self._pending.values():
                if not future.done():
                    future.set_exception(ConnectionError(f"QUIC connection closed: {event.reason_phrase}"))
            self._pending.clear()
        for h3_event in self.http.handle_event(event):
            pending = self._pending.get(getattr(h3_event, "stream_id", -1))
            if pending is None:
                continue
            future, headers, body = pending
            if isinstance(h3_event, HeadersReceived):
                headers.update((k.decode().lower(), v.decode()) for k, v in h3_event.headers)
            elif isinstance(h3_event, DataReceived):
                body.append(h3_event.data)
            if getattr(h3_event, "stream_ended", False):
                del self._pending[h3_event.stream_id]
                status = int(headers.pop(":status", "0"))
                if not future.done():
                    future.set_result(HttpResponse(status, headers, b"".join(body)))


class QuicSession:
    """A reconnecting HTTP/3 session to HOST:PORT."""

    def __init__(self, address: str, cafile: str | None, certificate: tuple[str, str] | None = None) -> None:
        host, _, port = address.rpartition(":")
        self.certificate = certificate  # (certfile, keyfile) for servers that require mutual TLS
        self.host, self.port = host.strip("[]"), int(port)
        self.cafile = cafile
        self.ticket: SessionTicket | None = None
        self._context: contextlib.AbstractAsyncContextManager[Any] | None = None
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
        self._context = connect(self.host, self.port, configuration=self._configuration(),
                                create_protocol=_H3Client, session_ticket_handler=self._keep_ticket,
                                wait_connected=wait_connected)
        try:
            self._protocol = await self._context.__aenter__()
        except ConnectionError as exc:
            self._context = None
            raise ConnectionError(f"QUIC handshake with {self.host}:{self.port} failed ({exc or 'refused'}); "
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

    async def close(self) -> None:
        if self._context is not None:
            context, self._context, self._protocol = self._context, None, None
            await context.__aexit__(None, None, None)
