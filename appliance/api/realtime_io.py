"""A Realtime session's I/O on its WebSocket (SessionIO): its sends, from its reading path and its
answers' task (`Output`), and its receives, which give way to the daemon's stop (`received`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from appliance.protocol.messages import Message, SessionIO

STOP_POLL_S = 0.05  # while the daemon stops, how often a busy session looks whether it is done


async def received(receiving: asyncio.Future[Message], stopping: asyncio.Event, idle: Callable[[], bool]) -> bool:
    """Wait for the client's next message: True once it is there; False where the daemon stops while
    the session has nothing under way but listening (at once, or once its turn or answer is done: work
    under way gets the stop's grace time, a session only waiting for speech closes)."""
    while not receiving.done():
        if stopping.is_set() and idle():
            return False
        waiter = asyncio.ensure_future(asyncio.sleep(STOP_POLL_S) if stopping.is_set() else stopping.wait())
        try:
            await asyncio.wait((receiving, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
    return True


class Output:
    """A session's sends, from its reading path and its answers' task. While one waits for the client
    to take it, the reading path takes none of the client's messages: an interpreter's answers are
    spoken in a task of their own, and a client that stopped reading them would otherwise still be read
    (silence, say) for as long as it sent."""

    def __init__(self, io: SessionIO) -> None:
        self.io = io
        self.waiting = 0  # sends under way
        self.sent = asyncio.Event()  # set while none is
        self.sent.set()

    async def send(self, message: str) -> None:
        self.waiting += 1
        self.sent.clear()
        try:
            await self.io.send(message)
        finally:
            self.waiting -= 1
            if not self.waiting:
                self.sent.set()
