"""A WebSocket session across the worker channel: the transport and its WebSocket in the protocol
worker, the session (api/realtime.py) in the engine process, messages both ways.

Messages (beside channel.py's): worker to engine ("session_in", rid, Message) and ("session_ack",
rid, bytes); engine to worker ("session_out", rid, Message), ("session_ack", rid, bytes) and
("session_end", rid, Close). Each direction has a credit of WINDOW_BYTES: a sender waits while the
bytes it sent and the other side has not yet taken (the session read them; the transport wrote them
to the client) are over it, so neither process holds more than that per connection, whatever the
client or the session does. The client leaving sends ("cancel", rid): the session's task is cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Protocol

from appliance.protocol.messages import Close, Message, Session, SessionIO


class Channel(Protocol):
    """What a session needs of the worker channel (channel.py Channel, which imports this module)."""

    def send(self, message: tuple[Any, ...]) -> None: ...

    async def drain(self) -> None: ...


log = logging.getLogger("appliance.websocket")
WINDOW_BYTES = 1 << 20


class Credit:
    """Bytes sent and not yet taken by the other side, at most WINDOW_BYTES (one message always goes)."""

    def __init__(self) -> None:
        self.unacked = 0
        self._freed = asyncio.Event()

    async def take(self, count: int) -> None:
        while self.unacked and self.unacked + count > WINDOW_BYTES:
            self._freed.clear()
            await self._freed.wait()
        self.unacked += count

    def give(self, count: int) -> None:
        self.unacked -= count
        self._freed.set()


class EngineEnd:
    """The session's SessionIO in the engine process."""

    def __init__(self, channel: Channel, rid: int) -> None:
        self.channel, self.rid = channel, rid
        self.inbox: asyncio.Queue[Message] = asyncio.Queue()  # bounded by the worker's credit
        self.credit = Credit()

    async def receive(self) -> Message:
        message = await self.inbox.get()
        self.channel.send(("session_ack", self.rid, len(message)))
        return message

    async def send(self, message: Message) -> None:
        await self.credit.take(len(message))
        self.channel.send(("session_out", self.rid, message))
        await self.channel.drain()


class WorkerEnd:
    """The worker's stand-in for the engine's session: the transport runs it as the session itself."""

    def __init__(self, channel: Channel, rid: int) -> None:
        self.channel, self.rid = channel, rid
        self.outbox: asyncio.Queue[Message | Close] = asyncio.Queue()  # bounded by the engine's credit
        self.credit = Credit()

    async def __call__(self, io: SessionIO) -> Close:
        forward = asyncio.get_running_loop().create_task(self._forward(io))
        ended = False
        try:
            while not isinstance(item := await self.outbox.get(), Close):
                await io.send(item)
                self.channel.send(("session_ack", self.rid, len(item)))
            ended = True
            return item
        finally:
            forward.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await forward
            if not ended:  # the client went away: the engine stops the session
                self.channel.send(("cancel", self.rid))

    async def _forward(self, io: SessionIO) -> None:
        while True:
            message = await io.receive()
            await self.credit.take(len(message))
            self.channel.send(("session_in", self.rid, message))


async def run_session(sessions: dict[int, EngineEnd], channel: Channel, rid: int, session: Session) -> None:
    """The engine's side: run the session on messages from the worker, then tell it how it closed."""
    end = sessions[rid] = EngineEnd(channel, rid)
    try:
        close = await session(end)
    except Exception:
        log.exception("WebSocket session crashed")
        close = Close(1011, "internal error (logged)")
    finally:
        sessions.pop(rid, None)
    channel.send(("session_end", rid, close))


def to_session(sessions: dict[int, EngineEnd], message: tuple[Any, ...]) -> None:
    """A worker's session_in or session_ack, to its session where it still runs."""
    kind, rid, payload = message
    if (end := sessions.get(rid)) is not None:
        if kind == "session_in":
            end.inbox.put_nowait(payload)
        else:
            end.credit.give(payload)
