"""The Upgrade path of an HTTP/1.1 connection (http1.py), and the head of an answer.

Only a WebSocket opening handshake (a GET with `Connection: upgrade` and `Upgrade: websocket`)
switches protocols, in its turn after the requests before it, when the API answers it with a
session; the bytes after it are the WebSocket's (transport/websocket.py). Any other Upgrade is
ignored as RFC 9110 7.8 allows: the request is served as plain HTTP, body and all, and the
connection goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable
from functools import partial
from http import HTTPStatus
from typing import Protocol

import httptools

from appliance.config import Live
from appliance.protocol.messages import Opened, Request, Response, error_response
from appliance.transport.answering import AnsweringServer, answer
from appliance.transport.assembler import Arrived
from appliance.transport.websocket import StreamIO, WebSocketPump, accept_token, is_upgrade


def encode_response(
    response: Response, keep_alive: bool, extra: Iterable[tuple[str, str]] = (), head_only: bool = False
) -> bytes:
    """The status line and headers (the transport's `extra` ones last), and the body unless it is
    streamed (then chunked follows) or `head_only` (a HEAD's answer: RFC 9110 9.3.2, its length the body's;
    the transport decides it by the request, whoever made the answer: a worker's 504 too)."""
    reason = HTTPStatus(response.status).phrase if response.status in HTTPStatus._value2member_map_ else ""
    length = "transfer-encoding: chunked" if response.stream else f"content-length: {len(response.body)}"
    lines = [f"HTTP/1.1 {response.status} {reason}", f"content-type: {response.content_type}", length]
    lines += [f"{k}: {v}" for k, v in (*response.headers, *extra)]
    if not keep_alive:
        lines.append("connection: close")
    body = b"" if response.stream or head_only else response.body
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


class UpgradeServer(AnsweringServer, Protocol):
    """What the Upgrade path needs of the connection's server (http1.Http1Server), besides a request's
    turn's (answering.py)."""

    live: Live
    clock: Callable[[], float]

    def extra_headers(self) -> Iterable[tuple[str, str]]: ...

    def opened(self, client: str, opened: Opened) -> None: ...


class Upgrading(Protocol):
    """What the Upgrade path needs of its HTTP/1.1 connection (http1.HttpConnection)."""

    transport: asyncio.Transport | None
    parser: httptools.HttpRequestParser
    writable: asyncio.Event  # clear while the client does not read what it was sent
    client: str
    websocket: WebSocketPump | None  # after the switch, the connection's protocol

    @property
    def server(self) -> UpgradeServer: ...

    def enqueue(self, entry: Arrived | Response, keep_alive: bool) -> None: ...

    def data_received(self, data: bytes) -> None: ...


class WebSocketUpgrade:
    """The Upgrade path of one HTTP/1.1 connection: the handshake waits for its turn, then the
    connection is the WebSocket's."""

    def __init__(self, connection: Upgrading) -> None:
        self.connection = connection
        self.request: Arrived | None = None  # a WebSocket handshake read, waiting for its turn
        self._trailing = b""  # what the client sent after it: the WebSocket's first bytes
        self._replay = b""  # the head of a request whose Upgrade is ignored, to parse again with its body

    def requested(self, arrived: Arrived) -> bool:
        """A request llhttp read with Upgrade: True where this path took it (a WebSocket handshake,
        queued; or a body to parse again without Upgrade, as llhttp ends the request at its head and
        takes the body for the new protocol), False where it is served as plain HTTP."""
        request = arrived.head
        if is_upgrade(request.method, request.headers):
            self.request = arrived
            self.connection.enqueue(arrived, False)
            return True
        if request.headers.get("content-length", "0") != "0" or "transfer-encoding" in request.headers:
            self._replay = head_without_upgrade(request)
            return True
        return False

    def held(self, data: bytes) -> bool:
        """Bytes read while a handshake waits for its turn (reading is paused soon after): the
        WebSocket's, kept for it."""
        if self.request is None:
            return False
        self._trailing += data
        return True

    def upgraded(self, rest: bytes) -> None:
        """llhttp stopped after a request with Upgrade. A WebSocket handshake: what follows is the
        WebSocket's, kept until the switch. Any other: ignored, and HTTP goes on with a fresh parser."""
        connection = self.connection
        if self.request is not None:
            self._trailing = rest
            if connection.transport is not None:
                connection.transport.pause_reading()
            return
        connection.parser = httptools.HttpRequestParser(connection)
        rest, self._replay = self._replay + rest, b""
        if rest:
            connection.data_received(rest)

    async def switch(self, arrived: Arrived) -> None:
        """The WebSocket handshake's turn: the API's session, or its refusal and the connection closes."""
        connection, server = self.connection, self.connection.server
        assert connection.transport is not None
        headers = arrived.head.headers
        key, version = headers.get("sec-websocket-key", ""), headers.get("sec-websocket-version")
        if not key or version != "13":
            server.budget.give(arrived.size)
            response = error_response(400, "a WebSocket handshake needs Sec-WebSocket-Key and Sec-WebSocket-Version 13")
            response.headers.append(("Sec-WebSocket-Version", "13"))
        else:
            response = await answer(server, arrived, partial(server.opened, connection.client))
        transport = connection.transport
        if transport.is_closing():
            return
        if response.session is None:
            transport.write(encode_response(response, False, server.extra_headers()))
            transport.close()
            return
        head = f"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: Upgrade\r\nsec-websocket-accept: {accept_token(key)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in response.headers)
        transport.write((head + "\r\n").encode("latin-1"))
        stream = StreamIO(
            transport.write,
            transport.pause_reading,
            transport.resume_reading,
            transport.close,
            connection.writable,
            transport.abort,
        )
        websocket = connection.websocket = WebSocketPump(
            stream, lambda: server.live.config.websocket, response.session, server.clock
        )
        trailing, self._trailing, self.request = self._trailing, b"", None
        websocket.start(trailing)
        transport.resume_reading()


def head_without_upgrade(request: Request) -> bytes:
    """The request's head again, its Upgrade dropped: what HTTP/1.1 makes of an upgrade it ignores."""
    headers = {k: v for k, v in request.headers.items() if k != "upgrade"}
    tokens = [t.strip() for t in headers.pop("connection", "").split(",") if t.strip().lower() not in ("upgrade", "")]
    if tokens:
        headers["connection"] = ", ".join(tokens)
    lines = [f"{request.method} {request.target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
