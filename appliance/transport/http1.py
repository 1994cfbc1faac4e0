"""HTTP/1.1 over a stream socket (the Unix API socket; TLS on TCP, https.py): parse with httptools, call Api.handle, write.

One protocol object per connection. Requests on a keep-alive connection are answered in order,
also after the client half-closes; malformed HTTP gets a 400 naming the problem, in its turn after
the requests before it, and the connection is closed, leaving every other connection untouched.
The assembler (assembler.py) decides the limits: head size while it arrives, body size and the
shared body budget, head and body timeouts; idle keep-alive connections close after
keepalive_timeout_s, and a client that pipelines more than pipeline_depth requests is not read
until they are answered. Flow control and cancellation as protocol/flow.py says: a streamed answer's
next piece is pulled only while the write buffer is under server.stream_window_bytes, and a client
that closes its connection has the request being served cancelled. Admission and the write deadline
are every stream listener's (connection_bounds.py): a client that takes nothing of what it is sent for
server.write_timeout_s is cut off, and its slot freed.

Upgrade: only a WebSocket opening handshake switches protocols (http1_upgrade.py).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from functools import partial
from typing import TYPE_CHECKING

import httptools

from appliance.config import Live, ServerConfig
from appliance.protocol.flow import SendWindow, WriteProgress, peer_closed, send_stream, unsent
from appliance.protocol.messages import Close, Handler, Opened, Response
from appliance.protocol.proxied import Address
from appliance.protocol.unix_peer import unix_peer
from appliance.tasks import spawn
from appliance.transport.answering import answer
from appliance.transport.assembler import Arrived, BodyBudget, Rejection, RequestAssembler
from appliance.transport.connection_bounds import admission_refusal, linger
from appliance.transport.http1_upgrade import WebSocketUpgrade, encode_response
from appliance.transport.serving import Serving, checking_timeouts
from appliance.transport.websocket import WebSocketPump

if TYPE_CHECKING:
    from appliance.transport.tls_accept import TlsAcceptor

log = logging.getLogger("appliance.http")


class Http1Server:
    """Shared state of all connections: the API, the live settings, the body budget, who is connected.
    The Unix socket's; a TCP listener's (https.py) overrides who a client is, its connection limit,
    the headers every answer carries, and what a closed connection leaves behind."""

    half_close = True  # a client may half-close after its requests and still read the answers
    listener = "unix"  # Request.listener: who may use it (api/access)

    def __init__(
        self, api: Handler, live: Live, budget: BodyBudget, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`clock` times every connection's head, body and keep-alive timeouts (a test may hold it)."""
        self.api, self.live, self.budget, self.clock = api, live, budget, clock
        self.connections: set[HttpConnection] = set()
        self._timeouts: asyncio.Task[None] | None = None
        self._listener: asyncio.Server | TlsAcceptor | None = None
        # a deadline task that dies (our bug) stops the process (Serving.on_failure) rather than leave it
        # serving without deadlines; None where a test serves without a process
        self.on_failure: Callable[[BaseException], None] | None = None

    @classmethod
    async def serve(cls, serving: Serving, sock: socket.socket) -> Http1Server:
        """The Unix socket's listener (listening.py's table)."""
        server = cls(serving.api, serving.live, serving.budget, serving.clock)
        server.on_failure = serving.on_failure
        await server.listen(sock)
        return server

    async def listen(self, sock: socket.socket) -> None:
        self._listener = await asyncio.get_running_loop().create_unix_server(self.protocol, sock=sock)

    def stop_accepting(self) -> None:
        if self._listener is not None:
            self._listener.close()

    @property
    def limits(self) -> ServerConfig:
        return self.live.config.server

    @property
    def connection_limits(self) -> tuple[int, int]:
        """The daemon's limit of connections and one peer's share of it (a user's on the Unix socket)."""
        return self.limits.max_connections, self.limits.max_connections_per_peer

    def identify(self, transport: asyncio.BaseTransport, origin: Address | None) -> tuple[str, str, bool]:
        """Who the client is (Request.client), its address (Request.peer), and whether it is an operator;
        `origin`: the client a balancer's PROXY header named (HTTPS: protocol/proxied.py)."""
        client, operator = unix_peer(transport.get_extra_info("socket"))
        return client, "", operator

    def share_key(self, client: str, peer: str) -> str:
        """Whose share a connection takes: on the Unix socket its user."""
        return client

    def refusal(self, key: str) -> Rejection | None:
        """Why a new connection of `key` is not admitted (connection_bounds.admission_refusal), or None.
        With N protocol workers (BodyBudget.workers) each holds 1/N of the limit and the share."""
        limit, share = self.connection_limits
        return admission_refusal((c.share_key for c in self.connections), key, limit, share, self.budget.workers)

    def extra_headers(self) -> Iterable[tuple[str, str]]:
        return ()

    def opened(self, client: str, opened: Opened) -> None:
        """A request of `client` opened a sequence (the Unix socket's user keeps it past the connection)."""

    def closed(self, client: str) -> None:
        """A connection of `client` ended."""

    def protocol(self) -> HttpConnection:
        if self._timeouts is None:
            self._timeouts = spawn(checking_timeouts(self, self.clock), "the HTTP/1.1 timeouts", self.on_failure)
        return HttpConnection(self)

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.connections)

    @property
    def delivering(self) -> int:
        """Connections whose answers asyncio still holds for a client not taking them yet: a worker that
        returned at its stop would drop them with its event loop."""
        return sum(1 for c in self.connections if c.transport is not None and unsent(c.transport))

    def check_timeouts(self, now: float) -> None:
        """Each connection's head, body, keep-alive and write deadlines, at `now` on the server's clock, and
        whether a client that half-closed has closed since (the Unix socket's kernel tells)."""
        for connection in list(self.connections):
            connection.check_timeouts(now)

    def close_all(self) -> None:
        if self._timeouts is not None:
            self._timeouts.cancel()
        for connection in list(self.connections):
            connection.close()


class HttpConnection(asyncio.Protocol):
    server: Http1Server

    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # in order: requests to serve, and at most one last answer (a rejection) before closing
        self.queue: deque[tuple[Arrived | Response, bool]] = deque()
        self.busy = False
        self._assembler: RequestAssembler | None = None  # a request under way (begun, not complete)
        self.client = self.peer = ""
        self.operator = False
        self._idle_since = server.clock()
        self._rejected = self._half_closed = self._paused = self._served_any = False
        self.writable = asyncio.Event()  # clear while the client does not read what it was sent
        self.writable.set()
        self._progress = WriteProgress()  # whether what we write is taken (the write deadline)
        self.share_key = ""  # whose share of the connections this one takes (Http1Server.share_key)
        self.origin: Address | None = None  # the client its balancer's PROXY header named (HTTPS)
        self._serving: asyncio.Task[None] | None = None
        self._window: SendWindow | None = None  # the streamed answer being written, if one is
        self.upgrade = WebSocketUpgrade(self)
        self.websocket: WebSocketPump | None = None  # after an upgrade, the connection's protocol

    @property
    def in_flight(self) -> int:
        """Requests queued or being served, and one being uploaded: a stop waits for all of them."""
        return len(self.queue) + self.busy + (self._assembler is not None)

    # --- asyncio callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.transport.set_write_buffer_limits(high=self.server.limits.stream_window_bytes)  # type: ignore[union-attr]
        self.client, self.peer, self.operator = self.server.identify(transport, self.origin)
        self.share_key = self.server.share_key(self.client, self.peer)
        if (refusal := self.server.refusal(self.share_key)) is not None:
            self._reject(refusal)
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.server.connections:
            self.server.connections.discard(self)
            self.server.closed(self.client)
        if self.websocket is not None:
            self.websocket.lost()
        self.writable.set()  # a task waiting to write finds the transport closed and ends
        if self._serving is not None and not self._serving.done():
            self._serving.cancel()  # the client is gone: nobody reads the answer (its shards leave the queues)
        self.release(self._assembler.body_bytes if self._assembler else 0)
        self._assembler = None
        self.release(sum(entry.size for entry, _ in self.queue if isinstance(entry, Arrived)))
        self.queue.clear()

    def pause_writing(self) -> None:
        """Our send buffer is over its high-water mark: no more answers until the client reads."""
        self.writable.clear()

    def resume_writing(self) -> None:
        self.writable.set()
        if self._window is not None and self.transport is not None:
            self._window.hold(self.transport.get_write_buffer_size())

    def eof_received(self) -> bool:
        """A half-close after whole requests: answer them, then close (True keeps the transport open).
        A client that closed its socket altogether is gone: the transport closes, and connection_lost
        cancels what is being served for it."""
        self._half_closed = True
        return (
            self.server.half_close
            and not self._rejected
            and self.websocket is None
            and bool(self.busy or self.queue)
            and not peer_closed(self.transport)
        )

    def data_received(self, data: bytes) -> None:
        if self.websocket is not None:
            self.websocket.data_received(data)
            return
        if self.upgrade.held(data) or self._rejected:
            return
        in_head = self._assembler if self._assembler is not None and not self._assembler.head_complete else None
        try:
            self.parser.feed_data(data)
            if in_head is not None and in_head is self._assembler and not in_head.head_complete:
                in_head.received_in_head(len(data))  # the same head is still incomplete after this read
        except Rejection as rejection:
            self._reject(rejection)
        except httptools.HttpParserCallbackError as exc:
            if isinstance(exc.__context__, Rejection):
                self._reject(exc.__context__)
            else:  # a bug of ours, not the client's
                log.exception("HTTP/1.1 request assembly crashed")
                self._reject(Rejection(500, "internal error (logged)"))
        except httptools.HttpParserUpgrade as upgrade:
            self.upgrade.upgraded(data[upgrade.args[0] :] if upgrade.args else b"")
        except httptools.HttpParserError as exc:
            self._reject(Rejection(400, f"malformed HTTP request: {exc}"))
        else:
            if len(self.queue) >= self.server.limits.pipeline_depth and self.transport is not None:
                self.transport.pause_reading()  # answered requests resume it
                self._paused = True

    def check_timeouts(self, now: float) -> None:
        transport, write_timeout_s = self.transport, self.server.limits.write_timeout_s
        if transport is None or self._progress.cut_off(now, transport, write_timeout_s) or transport.is_closing():
            return  # a closing transport is closed once (a TLS one twice loses its protocol)
        if self._half_closed and peer_closed(transport):  # closed since: gone, and its work with it
            transport.abort()
            return
        if self.websocket is not None:
            self.websocket.check_timeouts(now)
            return
        if self._rejected:
            return
        if self._assembler is not None:
            # while the pipeline is full the server does not read: a head or body cut there is not late
            if not self._paused and (overdue := self._assembler.overdue(now)) is not None:
                self._reject(overdue)
        elif not self.busy and not self.queue:
            # a connection that never sent a request has the head's time; one that did, keep-alive's
            limits = self.server.limits
            if now - self._idle_since > (limits.keepalive_timeout_s if self._served_any else limits.header_timeout_s):
                self.close()

    # --- httptools callbacks: each feeds the assembler; a Rejection stops the parser ---
    def on_message_begin(self) -> None:
        self._assembler = RequestAssembler(
            self.server.limits,
            peer=self.peer,
            budget=self.server.budget,
            client=self.client,
            operator=self.operator,
            clock=self.server.clock,
            listener=self.server.listener,
        )

    def on_url(self, url: bytes) -> None:
        self._step().add_target(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._step().add_header(name, value)

    def on_headers_complete(self) -> None:
        self._step().headers_complete(self.parser.get_method().decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self._step().add_body(body)

    def on_message_complete(self) -> None:
        arrived = self._step().arrived()
        self._assembler = None
        if not (self.parser.should_upgrade() and self.upgrade.requested(arrived)):
            self.enqueue(arrived, self.parser.should_keep_alive())

    def _step(self) -> RequestAssembler:
        assert self._assembler is not None  # httptools calls on_message_begin first
        return self._assembler

    # --- serving ---
    def enqueue(self, entry: Arrived | Response, keep_alive: bool) -> None:
        self.queue.append((entry, keep_alive))
        if not self.busy:
            self.busy = True
            self._serving = spawn(self._serve(), f"HTTP/1.1 connection of {self.client}")

    async def _serve(self) -> None:
        try:
            while self.queue and self.transport is not None:
                await self.writable.wait()  # a client that does not read gets no more answers queued
                if not self.queue or self.transport.is_closing():
                    return
                entry, keep_alive = self.queue.popleft()
                if self._paused and len(self.queue) < self.server.limits.pipeline_depth:
                    self._paused = False
                    self.transport.resume_reading()
                    if self._assembler is not None:
                        self._assembler.reading_resumed()
                if isinstance(entry, Response):  # a rejection: the last answer on this connection
                    self.transport.write(encode_response(entry, False, self.server.extra_headers()))
                    assert self.transport is not None
                    linger(self.transport, self.close)
                    return
                if entry is self.upgrade.request:
                    await self.upgrade.switch(entry)
                    return
                response = await answer(self.server, entry, partial(self.server.opened, self.client))
                if self.transport.is_closing():
                    return
                keep_alive = keep_alive and (self.server.api.keep_connections() or bool(self.queue))
                keep_alive = keep_alive and not (self._half_closed and not self.queue)
                head_only = entry.head.method == "HEAD"
                self.transport.write(encode_response(response, keep_alive, self.server.extra_headers(), head_only))
                if response.stream is not None and not await self._write_chunks(response.stream):
                    return
                if not keep_alive:
                    self.transport.close()
                    return
        finally:
            self.busy, self._served_any = False, True
            self._idle_since = self.server.clock()

    async def _write_chunks(self, stream: AsyncGenerator[bytes, None]) -> bool:
        """Send each piece as it is produced, the next pulled only once the write buffer is under the
        window; False if the client went away meanwhile."""
        window = self._window = SendWindow(self.server.limits.stream_window_bytes)
        try:
            sent = await send_stream(stream, window, self._send_chunk)
        finally:
            window.close()
            self._window = None
        if not sent or self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(b"0\r\n\r\n")
        return True

    async def _send_chunk(self, piece: bytes) -> int | None:
        """One piece as a chunk: what the write buffer holds then, None where the client went."""
        if self.transport is None or self.transport.is_closing():
            return None
        if piece:  # a zero-size chunk would end the body here
            self.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        return self.transport.get_write_buffer_size()

    def _reject(self, rejection: Rejection) -> None:
        """Stop reading; the rejection is answered after the requests before it, then the connection closes."""
        self._rejected = True
        if self._assembler is not None:
            self.release(self._assembler.body_bytes)
            self._assembler = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
            self.enqueue(rejection.response, False)

    def release(self, count: int) -> None:
        self.server.budget.give(count)

    def close(self) -> None:
        if self.websocket is not None:
            self.websocket.close(Close(1001, "the server is going away"))
        elif self.transport is not None:
            self.transport.close()
