"""WebSocket on any byte stream (an HTTP/1.1 upgrade, an HTTP/3 extended CONNECT stream): wsproto's
frame codec (sans-I/O) between the stream and a session (protocol/messages.py Session).

The limits of [websocket] hold for every connection: a message over max_message_bytes closes with
1009 as soon as its frames pass the bound (nothing bigger is held), and one in more than
MAX_MESSAGE_FRAMES frames, or not finished idle_timeout_s after its first frame, with 1008; messages the session has not yet
read are held up to buffered_bytes, then the stream is not read until it catches up; a client quiet
for idle_timeout_s is closed with 1001; a quiet client is pinged every ping_interval_s and closed with
1011 when the pong is not back by the next ping (not while the box itself is not reading it: the
pong could not be read; idle_timeout_s still bounds that). A protocol error closes with wsproto's code (1002,
1007). The session's own sends wait on the stream's flow control, so a client that stops reading
stops the session's sender, never grows a buffer; so do pongs: while the client does not take what
was sent, its frames are not read (its pings wait in the stream). A close while it takes nothing
drops what is queued and ends the stream at once. The client leaving cancels the session.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
import time
from collections import deque
from collections.abc import Callable

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Ping, Pong, TextMessage
from wsproto.utilities import LocalProtocolError

from appliance.config import WebSocketConfig
from appliance.protocol.messages import Close, Message, Session
from appliance.tasks import spawn
from appliance.transport.assembler import LIMITS_BITTEN

log = logging.getLogger("appliance.websocket")
CLOSE_LINGER_S = 2.0  # after our close frame: how long the client's close is awaited before the stream closes
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"
MAX_MESSAGE_FRAMES = 4096  # frames of one message (each is held until the message ends, even an empty one)


def accept_token(key: str) -> str:
    """Sec-WebSocket-Accept for a client's Sec-WebSocket-Key (RFC 6455 4.2.2)."""
    return base64.b64encode(hashlib.sha1(key.strip().encode("latin-1") + GUID).digest()).decode()


def is_upgrade(method: str, headers: dict[str, str]) -> bool:
    """An HTTP/1.1 WebSocket opening handshake (RFC 6455 4.1): any other Upgrade is ignored."""
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    return method == "GET" and "upgrade" in tokens and headers.get("upgrade", "").strip().lower() == "websocket"


class StreamIO:
    """What the pump needs of the byte stream under it."""

    def __init__(
        self,
        write: Callable[[bytes], None],
        pause: Callable[[], None],
        resume: Callable[[], None],
        close: Callable[[], None],
        writable: asyncio.Event,
        abort: Callable[[], None],
    ) -> None:
        """`close` ends the stream after what was written; `abort` ends it now, dropping what is queued."""
        self.write, self.pause, self.resume, self.close, self.writable = write, pause, resume, close, writable
        self.abort = abort


class WebSocketPump:
    """One WebSocket: bytes in through data_received, the session's messages out through its send."""

    def __init__(
        self,
        stream: StreamIO,
        limits: Callable[[], WebSocketConfig],
        session: Session,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`clock`: the transport's, which check_timeouts gets the time of (a test may hold it)."""
        self.stream, self._limits, self._session, self._clock = stream, limits, session, clock
        self.ws = Connection(ConnectionType.SERVER)
        self._inbox: deque[Message] = deque()
        self._inbox_bytes = 0
        self._arrived = asyncio.Event()
        self._parts: list[str | bytes] = []  # the message being received, frame by frame
        self._part_bytes = 0
        self._message_began = 0.0  # when the message being received had its first frame
        self._holds: set[str] = set()  # why the stream is not read: "inbox" (the session is behind), "writes"
        self._writes_task: asyncio.Task[None] | None = None  # waits for the client to take what was sent
        self.last_heard = clock()
        self._ping_sent: float | None = None
        self._task: asyncio.Task[None] | None = None
        self.closed = False

    @property
    def limits(self) -> WebSocketConfig:
        return self._limits()

    def start(self, trailing: bytes = b"") -> None:
        self._task = spawn(self._run(), "a WebSocket session")
        if trailing:
            self.data_received(trailing)

    # --- the session's side ---
    async def receive(self) -> Message:
        while not self._inbox:
            self._arrived.clear()
            await self._arrived.wait()
        message = self._inbox.popleft()
        self._inbox_bytes -= len(message)
        if "inbox" in self._holds and self._inbox_bytes <= self.limits.buffered_bytes // 2:
            self._release("inbox")
        return message

    async def send(self, message: Message) -> None:
        await self.stream.writable.wait()  # the client reads what it was sent before more is written
        if self.closed or self.ws.state is not ConnectionState.OPEN:
            raise ConnectionError("the WebSocket is closed")
        event = TextMessage(data=message) if isinstance(message, str) else BytesMessage(data=message)
        self.stream.write(self.ws.send(event))

    async def _run(self) -> None:
        try:
            close = await self._session(self)
        except asyncio.CancelledError:
            return
        except ConnectionError:  # the session wrote after the client went or the close began
            return
        except Exception:
            log.exception("WebSocket session crashed")
            close = Close(1011, "internal error (logged)")
        self.close(close)

    # --- the stream's side ---
    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        self.last_heard = self._clock()
        try:
            self.ws.receive_data(data)
        except LocalProtocolError:  # data after the close handshake finished
            return
        self._take_events()

    def _take_events(self) -> None:
        """The frames read so far; while the client takes nothing, those after a pong wait in wsproto."""
        for event in self.ws.events():
            if isinstance(event, TextMessage | BytesMessage):
                if self._take_part(
                    event.data if isinstance(event.data, str) else bytes(event.data), event.message_finished
                ):
                    return
            elif isinstance(event, Ping):
                self.stream.write(self.ws.send(event.response()))
                if not self.stream.writable.is_set():
                    self._hold_until_writable()
                    return
            elif isinstance(event, Pong):
                self._ping_sent = None
            elif isinstance(event, CloseConnection):
                if self.ws.state is ConnectionState.REMOTE_CLOSING:
                    self.stream.write(self.ws.send(event.response()))
                    self._finish()
                elif self.ws.state is ConnectionState.CLOSED:  # the answer to our close
                    self._finish()
                else:  # a protocol error wsproto found: close with its code
                    self.close(Close(event.code, event.reason or ""))
                return

    def _hold_until_writable(self) -> None:
        if "writes" in self._holds:
            return
        self._hold("writes")
        self._writes_task = spawn(self._take_when_writable(), "a WebSocket waiting for its client to read")

    async def _take_when_writable(self) -> None:
        await self.stream.writable.wait()
        if not self.closed:
            self._release("writes")
            self._take_events()  # those left waiting: no new bytes may come to wake them

    def _hold(self, reason: str) -> None:
        if not self._holds:
            self.stream.pause()
        self._holds.add(reason)

    def _release(self, reason: str) -> None:
        if reason in self._holds:
            self._holds.discard(reason)
            if not self._holds:
                self.stream.resume()
                self.last_heard, self._ping_sent = self._clock(), None  # heard again from now

    def _take_part(self, data: str | bytes, finished: bool) -> bool:
        """True when the message is over a bound (the connection is closing)."""
        if not self._parts:
            self._message_began = self._clock()
        self._parts.append(data)
        self._part_bytes += len(data)
        limit = self.limits.max_message_bytes
        if self._part_bytes > limit:
            LIMITS_BITTEN.bit("websocket message", f"WebSocket message over {limit} bytes")
            self.close(Close(1009, f"message over the limit of {limit} bytes"))
            return True
        if len(self._parts) > MAX_MESSAGE_FRAMES:
            LIMITS_BITTEN.bit("websocket frames", f"WebSocket message in over {MAX_MESSAGE_FRAMES} frames")
            self.close(Close(1008, f"message in over the limit of {MAX_MESSAGE_FRAMES} frames"))
            return True
        if finished:
            parts, self._parts, self._part_bytes = self._parts, [], 0
            message: Message = "".join(parts) if isinstance(data, str) else b"".join(parts)  # type: ignore[arg-type]
            self._inbox.append(message)
            self._inbox_bytes += len(message)
            self._arrived.set()
            if self._inbox_bytes > self.limits.buffered_bytes:
                self._hold("inbox")
        return False

    def check_timeouts(self, now: float) -> None:
        limits = self.limits
        if self.closed or self.ws.state is not ConnectionState.OPEN:
            return
        if now - self.last_heard > limits.idle_timeout_s:
            LIMITS_BITTEN.bit("websocket idle", f"WebSocket quiet for {limits.idle_timeout_s:g} s")
            self.close(Close(1001, f"no message for {limits.idle_timeout_s:g} s"))
        elif self._parts and now - self._message_began > limits.idle_timeout_s:
            LIMITS_BITTEN.bit("websocket unfinished", f"WebSocket message unfinished for {limits.idle_timeout_s:g} s")
            self.close(Close(1008, f"message not finished within {limits.idle_timeout_s:g} s"))
        elif self._holds:
            return  # the box is not reading this client (the session is behind, or it reads nothing): no pong could be read
        elif self._ping_sent is not None and now - self._ping_sent > limits.ping_interval_s:
            self.close(Close(1011, f"no pong within {limits.ping_interval_s:g} s"))
        elif self._ping_sent is None and now - self.last_heard > limits.ping_interval_s:
            self._ping_sent = now
            self.stream.write(self.ws.send(Ping(b"appliance")))

    def close(self, close: Close) -> None:
        """Our close frame, then the stream closes when the client answers (or is cut off after
        CLOSE_LINGER_S); a client that takes nothing is cut off at once: the frame would queue behind
        what it has not read."""
        if self.closed:
            return
        if not self.stream.writable.is_set():
            self._finish(self.stream.abort)
            return
        if self.ws.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            reason = close.reason.encode()[:123].decode("utf-8", "ignore")
            self.stream.write(self.ws.send(CloseConnection(code=close.code, reason=reason)))
        if self._holds:
            self._holds.clear()
            self.stream.resume()  # to read the client's close
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
        if self.ws.state is ConnectionState.CLOSED:
            self._finish()
        else:
            asyncio.get_running_loop().call_later(CLOSE_LINGER_S, self._finish, self.stream.abort)

    def _finish(self, end: Callable[[], None] | None = None) -> None:
        """The stream ends: closed after what was written, or `end` (abort: the client never answered)."""
        if not self.closed:
            self.closed = True
            (end or self.stream.close)()
        self.lost()

    def lost(self) -> None:
        """The stream is gone: the session stops."""
        self.closed = True
        self._inbox.clear()
        self._parts.clear()
        for task in (self._task, self._writes_task):
            if task is not None and not task.done():
                task.cancel()
