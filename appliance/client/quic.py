"""The client side of HTTP/3 (aioquic): one QUIC connection, many request streams.

The server is verified against a pinned certificate or CA file (`cafile`); nothing is fetched.
Session tickets are kept, so a reconnect resumes and can send GET requests as 0-RTT early data.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, H3Connection
from aioquic.h3.events import DataReceived, HeadersReceived
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.events import ConnectionTerminated, HandshakeCompleted, QuicEvent
from aioquic.tls import SessionTicket
from cryptography import x509

from appliance.client.errors import (
    CertificateRejected,
    ClientError,
    ConnectError,
    NoAnswer,
    parse_quic_address,
)
from appliance.client.http import DEFAULT_CONNECT_TIMEOUT_S, Call, HttpResponse, checked

CRYPTO_ERRORS = range(0x100, 0x200)  # QUIC's CRYPTO_ERROR + the TLS alert (RFC 9001 section 4.8)


class _Connection(QuicConnection):
    """aioquic's connection, saying as soon as a close begins (not 3 PTO later) and who began it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.closing: tuple[ConnectionTerminated, bool] | None = None  # (why, whether the peer closed it)
        self.on_closing: Callable[[], object] | None = None

    def _close_begin(self, is_initiator: bool, now: float) -> None:
        super()._close_begin(is_initiator, now)
        if self.closing is None and self._close_event is not None:
            self.closing = (self._close_event, not is_initiator)
            if self.on_closing is not None:
                self.on_closing()


class _H3Client(QuicConnectionProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.http = H3Connection(self._quic)
        self.handshake: HandshakeCompleted | None = None
        self.terminated: ConnectionTerminated | None = None
        self.error_for: Callable[[ConnectionTerminated], Exception] = (  # what a request learns of the end
            lambda event: ConnectionError(f"QUIC connection closed: {event.reason_phrase}")
        )
        self.connected: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # the handshake or the end
        self._streams: dict[int, asyncio.Queue[dict[str, str] | bytes | Exception | None]] = {}

    async def exchange(self, call: Call, authority: str) -> AsyncIterator[dict[str, str] | bytes]:
        """Send a request; yield the response headers, then each body piece as it arrives."""
        stream_id = self._quic.get_next_available_stream_id()
        headers = [
            (b":method", call.method.encode()),
            (b":scheme", b"https"),
            (b":authority", authority.encode()),
            (b":path", call.target.encode()),
            (b"content-length", str(len(call.body)).encode()),
        ]
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
        if isinstance(event, (HandshakeCompleted, ConnectionTerminated)) and not self.connected.done():
            self.connected.set_result(None)
        if isinstance(event, ConnectionTerminated):
            self.terminated = event
            for parts in self._streams.values():
                parts.put_nowait(self.error_for(event))
        for h3_event in self.http.handle_event(event):
            waiting = self._streams.get(getattr(h3_event, "stream_id", -1))
            if waiting is None:
                continue
            if isinstance(h3_event, HeadersReceived):
                waiting.put_nowait({k.decode().lower(): v.decode() for k, v in h3_event.headers})
            elif isinstance(h3_event, DataReceived) and h3_event.data:
                waiting.put_nowait(h3_event.data)
            if getattr(h3_event, "stream_ended", False):
                waiting.put_nowait(None)


class QuicSession:
    """A reconnecting HTTP/3 session to HOST:PORT.

    Connecting fails within `connect_timeout` seconds: `NoAnswer` when nothing answered,
    `CertificateRejected` when either side refused the other's certificate, `ConnectError` otherwise.
    """

    def __init__(
        self,
        address: str,
        cafile: str | None,
        certificate: tuple[str, str] | None = None,
        local_host: str = "",
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self.host, self.port = parse_quic_address(address)
        self.certificate = certificate  # (certfile, keyfile) for servers that require mutual TLS
        self.cafile = cafile
        self.local_host = local_host  # the source address to send from; any when empty
        self.connect_timeout = connect_timeout
        self.ticket: SessionTicket | None = None
        self._transport: asyncio.DatagramTransport | None = None
        self._protocol: _H3Client | None = None

    @property
    def address(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    def _configuration(self) -> QuicConfiguration:
        configuration = QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN, server_name=self.host)
        if self.cafile:
            _check_certificates(self.cafile)
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
        """Connect (aioquic's connect, with a choice of source address and a handshake timeout)."""
        loop = asyncio.get_running_loop()
        family, _, _, _, address = (await loop.getaddrinfo(self.host, self.port, type=socket.SOCK_DGRAM))[0]
        sock = socket.socket(family, socket.SOCK_DGRAM)
        try:
            sock.bind((self.local_host, 0))
        except OSError:
            sock.close()
            raise
        connection = _Connection(configuration=self._configuration(), session_ticket_handler=self._keep_ticket)
        closing: asyncio.Future[None] = loop.create_future()

        def close_begun() -> None:
            if not closing.done():
                closing.set_result(None)

        connection.on_closing = close_begun
        self._transport, self._protocol = await loop.create_datagram_endpoint(lambda: _H3Client(connection), sock=sock)
        self._protocol.error_for = lambda event: self._closed_error(connection, event, "")
        self._protocol.connect(address, transmit=wait_connected)
        if not wait_connected:
            return
        done, _ = await asyncio.wait(
            {self._protocol.connected, closing}, timeout=self.connect_timeout, return_when=asyncio.FIRST_COMPLETED
        )
        if self._protocol.handshake is not None and connection.closing is None:
            return
        error = self._handshake_error(connection, timed_out=not done)
        await self._abort()
        raise error

    def _handshake_error(self, connection: _Connection, timed_out: bool) -> ConnectError:
        if timed_out:
            return NoAnswer(
                f"no answer from {self.address} over QUIC within {self.connect_timeout:g} s "
                "(is the daemon running with QUIC on that address and UDP port?)"
            )
        event = self._protocol.terminated if self._protocol is not None else None
        if connection.closing is None and event is None:
            return ConnectError(f"the QUIC handshake with {self.address} failed")
        return self._closed_error(connection, event, " during the QUIC handshake")

    def _closed_error(self, connection: _Connection, event: ConnectionTerminated | None, when: str) -> ConnectError:
        """Why the connection ended, for the caller: a certificate refused (either way) or a close."""
        if connection.closing is not None:
            event, by_peer = connection.closing
        else:  # ended without a close (idle timeout, stateless reset): nobody said why
            assert event is not None
            by_peer = None
        reason = event.reason_phrase or f"error 0x{event.error_code:x}"
        if event.error_code in CRYPTO_ERRORS and by_peer is False:
            trusted = f"the CA file {self.cafile} does" if self.cafile else "the system's CA certificates do"
            return CertificateRejected(
                f"the server at {self.address} presented a certificate that {trusted} not accept ({reason})"
            )
        if event.error_code in CRYPTO_ERRORS:
            mine = "this client's certificate" if self.certificate else "a client without a certificate"
            return CertificateRejected(
                f"the server at {self.address} refused {mine} in the TLS handshake ({reason})", by_server=True
            )
        if by_peer:
            return ConnectError(f"the server at {self.address} closed the QUIC connection{when} ({reason})")
        return ConnectError(f"the QUIC connection to {self.address} ended{when} ({reason})")

    async def _abort(self) -> None:
        """Drop a connection whose handshake failed: say so once, do not wait out the closing period."""
        if self._protocol is not None and self._transport is not None:
            protocol, transport, self._protocol, self._transport = self._protocol, self._transport, None, None
            protocol.close()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(protocol.wait_closed(), 0.2)
            transport.close()

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


class QuicTransport:
    """HTTP/3 to HOST:PORT on a private event loop thread, so blocking callers can use it."""

    def __init__(
        self,
        address: str,
        cafile: str | None,
        timeout: float,
        certificate: tuple[str, str] | None = None,
        local_host: str = "",
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT_S,
    ) -> None:
        self.address, self.timeout = address, timeout
        self._session = QuicSession(address, cafile, certificate, local_host, connect_timeout)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="quic-client", daemon=True)
        self._thread.start()

    def _run(self, coroutine: Any) -> Any:
        """Run on the client's loop; silence past the timeout is `NoAnswer`, a broken connection `ConnectError`."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result(self.timeout)
        except ClientError:
            raise
        except TimeoutError:
            future.cancel()
            raise NoAnswer(f"no answer from {self.address} over QUIC within {self.timeout:g} s") from None
        except ConnectionError as exc:
            raise ConnectError(
                f"the QUIC connection to {self.address} broke before it answered ({str(exc) or type(exc).__name__})"
            ) from None

    def send(self, call: Call) -> HttpResponse:
        return self._run(self._session.send(call))

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        parts = self._session.exchange(call)

        async def next_part() -> Any:
            return await anext(parts, None)

        def step() -> Any:
            return self._run(next_part())

        headers = dict(step())
        status = int(headers.pop(":status", "0"))
        if status >= 400:
            body = b"".join(iter(step, None))
            checked(HttpResponse(status, headers, body))
        yield from iter(step, None)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self._session.close(), self._loop).result(self.timeout)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


def _check_certificates(cafile: str) -> None:
    """Before any handshake: aioquic reads the CA file only inside it, and an unreadable one surfaces
    as a traceback on the event loop and a handshake that never ends."""
    try:
        x509.load_pem_x509_certificates(Path(cafile).read_bytes())
    except OSError as exc:
        raise ClientError(f"CA file {cafile}: cannot read it ({exc.strerror})") from None
    except ValueError:
        raise ClientError(
            f"CA file {cafile}: no PEM certificate in it; pass the server's certificate or its CA"
        ) from None
