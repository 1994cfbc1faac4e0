"""HTTP/1.1 over a stream socket (the Unix API socket): parse with httptools, call Api.handle, write.

One protocol object per connection. Requests on a keep-alive connection are answered in order;
malformed HTTP gets a 400 naming the problem and the connection is closed, leaving every other
connection untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncGenerator, Callable
from http import HTTPStatus

import httptools

from appliance.api.core import Api
from appliance.config import Live, ServerConfig
from appliance.protocol.messages import Request, Response, error_response
from appliance.transport.assembler import Rejection, RequestAssembler

log = logging.getLogger("appliance.http")


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
    """Shared state of all connections: the API, the live settings, and who is connected."""

    def __init__(self, api: Api, live: Live) -> None:
        self.api, self.live = api, live
        self.connections: set[HttpConnection] = set()

    @property
    def limits(self) -> ServerConfig:
        return self.live.config.server

    def protocol(self) -> HttpConnection:
        return HttpConnection(self)

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.connections)

    def close_all(self) -> None:
        for connection in list(self.connections):
            connection.close()


class HttpConnection(asyncio.Protocol):
    def __init__(self, server: Http1Server) -> None:
        self.server = server
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.queue: deque[tuple[Request, bool]] = deque()
        self.busy = False
        self._assembler = RequestAssembler(server.limits)
        self._rejected = False

    @property
    def in_flight(self) -> int:
        return len(self.queue) + self.busy

    # --- asyncio callbacks ---
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.server.connections) >= self.server.limits.max_connections:
            self._fail(error_response(503, f"too many connections (limit {self.server.limits.max_connections})"))
            return
        self.server.connections.add(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        self.queue.clear()

    def data_received(self, data: bytes) -> None:
        if self._rejected:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserCallbackError:
            if not self._rejected:  # not a Rejection (answered where it was raised): a bug of ours
                log.exception("HTTP/1.1 request assembly crashed")
                self._fail(error_response(500, "internal error (logged)"))
        except httptools.HttpParserUpgrade:
            self._fail(error_response(400, "protocol upgrade is not supported"))
        except httptools.HttpParserError as exc:
            self._fail(error_response(400, f"malformed HTTP request: {exc}"))

    # --- httptools callbacks: each feeds the assembler; a Rejection answers and stops the parser ---
    def on_message_begin(self) -> None:
        self._assembler = RequestAssembler(self.server.limits)

    def on_url(self, url: bytes) -> None:
        self._assemble(self._assembler.add_target, url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._assemble(self._assembler.add_header, name, value)

    def on_headers_complete(self) -> None:
        self._assemble(self._assembler.headers_complete, self.parser.get_method().decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self._assemble(self._assembler.add_body, body)

    def on_message_complete(self) -> None:
        self.queue.append((self._assembler.request(), self.parser.should_keep_alive()))
        if not self.busy:
            self.busy = True
            asyncio.get_running_loop().create_task(self._serve())

    # --- serving ---
    async def _serve(self) -> None:
        try:
            while self.queue and self.transport is not None:
                request, keep_alive = self.queue.popleft()
                response = await self.server.api.handle(request)
                if self.transport.is_closing():
                    return
                keep_alive = keep_alive and (self.server.api.keep_connections() or bool(self.queue))
                self.transport.write(encode_response(response, keep_alive))
                if response.stream is not None and not await self._write_chunks(response.stream):
                    return
                if not keep_alive:
                    self.transport.close()
                    return
        finally:
            self.busy = False

    async def _write_chunks(self, stream: AsyncGenerator[bytes, None]) -> bool:
        """Send each piece as it is produced; False if the client went away meanwhile."""
        async with contextlib.aclosing(stream) as pieces:
            async for piece in pieces:
                if self.transport is None or self.transport.is_closing():
                    return False
                self.transport.write(b"%x\r\n%s\r\n" % (len(piece), piece))
        if self.transport is None or self.transport.is_closing():
            return False
        self.transport.write(b"0\r\n\r\n")
        return True

    def _assemble(self, step: Callable[..., None], *args: object) -> None:
        try:
            step(*args)
        except Rejection as rejection:
            self._fail(rejection.response)
            raise  # httptools stops feeding this connection

    def _fail(self, response: Response) -> None:
        self._rejected = True
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(encode_response(response, keep_alive=False))
            self.transport.close()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
