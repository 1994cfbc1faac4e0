"""WebSocket over HTTP/3 (RFC 9220): an extended CONNECT (`:protocol websocket`) opens it on one
request stream, and the stream's DATA is the WebSocket's bytes, framed by the same pump as the
HTTP/1.1 upgrade (websocket.py) with the same [websocket] limits.

aioquic announces SETTINGS_ENABLE_CONNECT_PROTOCOL. What differs from a TCP stream is said here:
what the client sends before the server's 200 is held (bounded) and given to the pump with the
session; QUIC grants the peer stream credit as data arrives, not as it is read, so "not reading"
is holding here, up to [websocket] buffered_bytes, and a client that sends past that while the
session is behind is closed with 1008; the session's sends wait while the stream's unacknowledged
bytes are over server.stream_window_bytes. A stream reset, STOP_SENDING, the stream's end or the
connection's end ends the session. A close while the client takes nothing resets the stream, what is
queued for it dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Protocol

from aioquic.h3.events import DataReceived

from appliance.config import Live, ServerConfig, WebSocketConfig
from appliance.protocol.messages import Close, Response, Session
from appliance.transport.assembler import LIMITS_BITTEN
from appliance.transport.h3_answers import StreamAnswers
from appliance.transport.h3_bounds import BoundedH3Connection
from appliance.transport.websocket import StreamIO, WebSocketPump


def is_websocket_connect(headers: list[tuple[bytes, bytes]]) -> bool:
    """An extended CONNECT for a WebSocket (RFC 9220 3)."""
    pseudo = {name: value for name, value in headers if name.startswith(b":")}
    return pseudo.get(b":method") == b"CONNECT" and pseudo.get(b":protocol", b"").lower() == b"websocket"


class H3WebSocket:
    """One WebSocket on an HTTP/3 stream: before `accept` it holds what arrives; after, the pump reads it."""

    def __init__(
        self,
        send: Callable[[bytes, bool], bool],
        unacknowledged: Callable[[], int],
        window_bytes: Callable[[], int],
        limits: Callable[[], WebSocketConfig],
        reset: Callable[[], None],
    ) -> None:
        """`send(data, end_stream)` writes to the stream (False where it is gone); `unacknowledged()`:
        the stream's bytes the peer has not taken yet; `reset()` ends the stream both ways at once,
        what is queued dropped."""
        self._send, self._unacknowledged, self._window_bytes, self._limits = send, unacknowledged, window_bytes, limits
        self._reset = reset
        self.writable = asyncio.Event()
        self.writable.set()
        self._held: list[bytes] = []
        self._held_bytes = 0
        self._holding = True  # not accepted yet, or the session is behind
        self.pump: WebSocketPump | None = None
        self.ended = False

    def accept(self, session: Session) -> None:
        stream = StreamIO(self._write, self._pause, self._resume, self._close, self.writable, self._abort)
        self.pump = WebSocketPump(stream, self._limits, session)
        held, self._held, self._held_bytes, self._holding = b"".join(self._held), [], 0, False
        self.pump.start(held)

    def data_received(self, data: bytes) -> None:
        if not self._holding and self.pump is not None:
            self.pump.data_received(data)
            return
        self._held.append(data)
        self._held_bytes += len(data)
        limit = self._limits().buffered_bytes
        if self._held_bytes > limit:
            self._held, self._held_bytes = [], 0
            LIMITS_BITTEN.bit("websocket buffer", f"WebSocket client sent over {limit} bytes unread")
            if self.pump is not None:
                self.pump.close(Close(1008, f"sent over {limit} bytes the session has not read"))
            else:
                self.lost()

    def update(self) -> None:
        """The peer took some of what was sent (or not): the session may send again while under the window."""
        if self._unacknowledged() <= self._window_bytes():
            self.writable.set()
        else:
            self.writable.clear()

    def check_timeouts(self, now: float) -> None:
        if self.pump is not None:
            self.pump.check_timeouts(now)

    def going_away(self) -> None:
        if self.pump is not None:
            self.pump.close(Close(1001, "the server is going away"))

    def lost(self) -> None:
        """The stream or its connection ended: the session stops."""
        self.ended = True
        self.writable.set()  # a sender waiting finds the WebSocket closed
        if self.pump is not None:
            self.pump.lost()

    # --- what the pump calls ---
    def _write(self, data: bytes) -> None:
        if not self.ended and not self._send(data, False):
            self.lost()
        self.update()

    def _pause(self) -> None:
        self._holding = True

    def _resume(self) -> None:
        held, self._held, self._held_bytes, self._holding = b"".join(self._held), [], 0, False
        if held and self.pump is not None:
            self.pump.data_received(held)

    def _close(self) -> None:
        if not self.ended:
            self._send(b"", True)
            self.ended = True

    def _abort(self) -> None:
        if not self.ended:
            self.ended = True
            self._reset()


class WebSocketServer(Protocol):
    """What the WebSocket streams need of the connection's server (h3.H3Server)."""

    live: Live

    @property
    def limits(self) -> ServerConfig: ...


class WebSocketStreams:
    """One HTTP/3 connection's WebSockets (h3.H3Protocol's): its streams opened by extended CONNECT,
    answered through `answers`; `reset(stream_id)` ends a stream both ways."""

    def __init__(
        self,
        server: WebSocketServer,
        answers: StreamAnswers,
        http: Callable[[], BoundedH3Connection | None],
        reset: Callable[[int], None],
        transmit: Callable[[], None],
        ended: Callable[[], bool],
    ) -> None:
        self._server, self._answers, self._http, self._reset, self._transmit = server, answers, http, reset, transmit
        self._ended = ended
        self.streams: dict[int, H3WebSocket] = {}  # streams an extended CONNECT opened

    def register(self, stream_id: int) -> None:
        """An extended CONNECT's request is whole: what follows on its stream is the WebSocket's."""
        answers, server = self._answers, self._server
        self.streams[stream_id] = H3WebSocket(
            lambda data, end: answers.send_data(stream_id, data, end_stream=end),
            lambda: answers.unacknowledged(stream_id),
            lambda: server.limits.stream_window_bytes,
            lambda: server.live.config.websocket,
            lambda: self._reset(stream_id),
        )

    def data(self, event: DataReceived) -> bool:
        """True where the data is a WebSocket's (given to it; the stream's end ends it)."""
        if (websocket := self.streams.get(event.stream_id)) is None:
            return False
        websocket.data_received(event.data)
        if event.stream_ended:
            websocket.lost()
        return True

    def gone(self, stream_id: int | None) -> None:
        """A stream reset or STOP_SENDING (its id), or the connection's end (None)."""
        for websocket_id in list(self.streams) if stream_id is None else [stream_id]:
            if (websocket := self.streams.pop(websocket_id, None)) is not None:
                websocket.lost()

    def answer(self, stream_id: int, response: Response) -> bool:
        """The API's answer to an extended CONNECT where `stream_id` is one: a 200 and its session, or
        its refusal (the stream ends); False where it is not a WebSocket's."""
        if (websocket := self.streams.get(stream_id)) is None:
            return False
        http = self._http()
        if response.session is None or http is None or self._ended():
            del self.streams[stream_id]
            self._answers.respond(stream_id, response)
            return True
        headers = [(b":status", b"200"), *((k.lower().encode(), v.encode()) for k, v in response.headers)]
        http.send_headers(stream_id, headers)
        self._transmit()
        websocket.accept(response.session)
        return True

    def check_timeouts(self, now: float) -> None:
        """Each WebSocket's own timeouts (pings, idle); the ended ones forgotten."""
        for stream_id, websocket in list(self.streams.items()):
            if websocket.ended:
                del self.streams[stream_id]
            else:
                websocket.check_timeouts(now)

    def transmitted(self) -> None:
        for websocket in self.streams.values():
            websocket.update()

    def going_away(self) -> None:
        for websocket in self.streams.values():
            websocket.going_away()
