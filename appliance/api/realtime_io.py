"""A Realtime session's sends on its WebSocket (SessionIO), from its reading path and its answers'
task; its receives give way to the daemon's stop (protocol/flow.py's `received`)."""

from __future__ import annotations

import asyncio

from appliance.protocol.messages import SessionIO


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
