"""HTTP/1.1 over a stream socket (the Unix API socket): parse with httptools, call Api.handle, write.

One protocol object per connection. Requests on a keep-alive connection are answered in order,
also after the client half-closes; malformed HTTP gets a 400 naming the problem, in its turn after
the requests before it, and the connection is closed, leaving every other connection untouched.
The assembler (assembler.py) decides the limits: head size while it arrives, body size and the
shared body budget, head and body timeouts; idle keep-alive connections close after
keepalive_timeout_s, and a client that pipelines more than pipeline_depth requests is not read
until they are answered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncGenerator
from http import HTTPStatus

import httptools

from appliance.config import Live, ServerConfig
from appliance.protocol.messages import Handler, Request, Response
from appliance.transport.assembler import BodyBudget, Rejection, RequestAssembler, limit_bit
from appliance.transport.unix_peer import unix_peer

log = logging.getLogger("appliance.http")
TIMEOUT_CHECK_S = 0.5
LINGER_S = 2.0  # after a rejection, how long the rest of what the client sends is read and dropped


def encode_response(response: Response, keep_alive: bool) -> bytes:
    """The status line and headers, and the body unless it is streamed (then chunked follows)."""
    reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
    length = "transfer-encoding: chunked" if response.stream else f"content-length: {len(response.body)}"
    head = [f"HTTP/1.1 {response.status} {reason}", f"content-type: {response.content_type}", length]
    head += [f"{k}: {v}" for k, v in response.headers]
    if not keep_alive:
        head.append("connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (b"" if response.stream else response.body)


class Http1Server:
    """Shared state of all connections: the API, the live settings, the body budget, who is connected."""

    def __init__(self, api: Handler, live: Live, budget: BodyBudget) -> None:
        self.api, self.live, self.budget = api, live, budget
        self.connections: set[HttpConnection] = set()
        self._timeouts: asyncio.Task[None] | None = None

    @property
    def limits(self) -> ServerConfig:
        return self.live.config.server

    def protocol(self) -> HttpConnection:
        if self._timeouts is None:
            self._timeouts = asyncio.get_running_loop().create_task(self._enforce_timeouts())
        return HttpConnection(self)

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.connections)

    async def _enforce_timeouts(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUT_CHECK_S)
            now = time.monotonic()
            for connection in list(self.connections):
                connection.check_timeouts(now)

    def close_all(self) -> None:
        if self._timeouts is not None:
            self._timeouts.cancel()
        for connection in list(self.connections):
            connection.close()


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        # in order: requests to serve, and at most one last answer (a rejection) before closing
        self.queue: deque[tuple[Request | Response, bool]] = deque()
        self.busy = False
        self._assembler: RequestAssembler | None = None  # a request under way (begun, not complete)
        self.client, self.operator = "", False
        self._idle_since = time.monotonic()
        self._rejected = self._half_closed = self._paused = self._served_any = False
        self._writable = asyncio.Event()  # clear while the client does not read what it was sent
        self._writable.set()

    @property
    def in_flight(self) -> int:
        """Requests queued or being served, and one being uploaded: a stop waits for all of them."""
        return len(self.queue) + self.busy + (self._assembler is not None)

    # --- asyncio callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.client, self.operator = unix_peer(transport.get_extra_info("socket"))
        if len(self.server.connections) >= self.server.limits.max_connections:
            self._reject(limit_bit(503, f"too many connections (limit {self.server.limits.max_connections})"))
            return
        share = self.server.limits.max_connections_per_peer
        if sum(c.client == self.client for c in self.server.connections) >= share:
            self._reject(limit_bit(503, f"too many connections from {self.client} (its share is {share})"))
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self._writable.set()  # a task waiting to write finds the transport closed and ends
        self._release(self._assembler.body_bytes if self._assembler else 0)
        self._assembler = None
        self._release(sum(len(r.body) for r, _ in self.queue if isinstance(r, Request)))
        self.queue.clear()

    def pause_writing(self) -> None:
        """Our send buffer is over its high-water mark: no more answers until the client reads."""
        self._writable.clear()

    def resume_writing(self) -> None:
        self._writable.set()

    def eof_received(self) -> bool:
        """A half-close after whole requests: answer them, then close (True keeps the transport open)."""
        self._half_closed = True
        return not self._rejected and bool(self.busy or self.queue)

    def data_received(self, data: bytes) -> None:
        if self._rejected:
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
        except httptools.HttpParserUpgrade:
            self._reject(Rejection(400, "protocol upgrade is not supported"))
        except httptools.HttpParserError as exc:
            self._reject(Rejection(400, f"malformed HTTP request: {exc}"))
        else:
            if len(self.queue) >= self.server.limits.pipeline_depth and self.transport is not None:
                self.transport.pause_reading()  # answered requests resume it
                self._paused = True

    def check_timeouts(self, now: float) -> None:
        if self._rejected:
            return
        if self._assembler is not None:
            if (overdue := self._assembler.overdue(now)) is not None:
                self._reject(overdue)
        elif not self.busy and not self.queue:
            # a connection that never sent a request has the head's time; one that did, keep-alive's
            limits = self.server.limits
            if now - self._idle_since > (limits.keepalive_timeout_s if self._served_any else limits.header_timeout_s):
                self.close()

    # --- httptools callbacks: each feeds the assembler; a Rejection stops the parser ---
    def on_message_begin(self) -> None:
        self._assembler = RequestAssembler(
            self.server.limits, budget=self.server.budget, client=self.client, operator=self.operator
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
        request = self._step().request()
        self._assembler = None
        self._enqueue(request, self.parser.should_keep_alive())

    def _step(self) -> RequestAssembler:
        assert self._assembler is not None  # httptools calls on_message_begin first
        return self._assembler

    # --- serving ---
    def _enqueue(self, entry: Request | Response, keep_alive: bool) -> None:
        self.queue.append((entry, keep_alive))
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._serve())

    async def _serve(self) -> None:
        try:
            while self.queue and self.transport is not None:
                await self._writable.wait()  # a client that does not read gets no more answers queued
                if not self.queue or self.transport.is_closing():
                    return
                entry, keep_alive = self.queue.popleft()
                if self._paused and len(self.queue) < self.server.limits.pipeline_depth:
                    self._paused = False
                    self.transport.resume_reading()
                if isinstance(entry, Response):  # a rejection: the last answer on this connection
                    self.transport.write(encode_response(entry, keep_alive=False))
                    self._linger()
                    return
                try:
                    response = await self.server.api.handle(entry)
                finally:
                    self._release(len(entry.body))
                if self.transport.is_closing():
                    return
                keep_alive = keep_alive and (self.server.api.keep_connections() or bool(self.queue))
                keep_alive = keep_alive and not (self._half_closed and not self.queue)
                self.transport.write(encode_response(response, keep_alive))
                if response.stream is not None and not await self._write_chunks(response.stream):
                    return
                if not keep_alive:
                    self.transport.close()
                    return
        finally:
            self.busy, self._served_any = False, True
            self._idle_since = time.monotonic()

    async def _write_chunks(self, stream: AsyncGenerator[bytes, None]) -> bool:
        """Send each piece as it is produced; False if the client went away meanwhile."""
        async with contextlib.aclosing(stream) as pieces:
            async for piece in pieces:
                await self._writable.wait()
                if self.transport is None or self.transport.is_closing():
                    return False
                self.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(b"0\r\n\r\n")
        return True

    def _reject(self, rejection: Rejection) -> None:
        """Stop reading; the rejection is answered after the requests before it, then the connection closes."""
        self._rejected = True
        if self._assembler is not None:
            self._release(self._assembler.body_bytes)
            self._assembler = None
        if self.transport is not None and not self.transport.is_closing():
            self.transport.pause_reading()
            self._enqueue(rejection.response, False)

    def _linger(self) -> None:
        """Close after a rejection the way RFC 9112 asks: stop sending, read and drop what the client is
        still sending for a moment, then close. Closing at once with its bytes unread would reset the
        connection, and the client could lose the answer that says why."""
        assert self.transport is not None
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.transport.resume_reading()  # data_received drops it: the connection is rejected
        asyncio.get_running_loop().call_later(LINGER_S, self.close)

    def _release(self, count: int) -> None:
        self.server.budget.give(count)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
