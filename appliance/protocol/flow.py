"""The one flow-control and cancellation contract between the API core and every transport.

A streamed answer (`Response.stream`) is an async generator that a transport pulls, and the engine
side produces a piece only when it is pulled (a voice submits its next sentences as the earlier ones
are taken). So a client that does not read stops the engine working for it, if every hop obeys:

1. A hop holds at most `server.stream_window_bytes` of one answer that its peer has not taken, in a
   `SendWindow`: it adds what it hands on, lowers it as the peer takes it, and pulls the next piece
   only once `wait()` returns (held under the window). HTTP/1.1: the socket's write buffer (asyncio's
   pause_writing/resume_writing, high-water mark the window); HTTP/3: the stream's unacknowledged
   send buffer in aioquic; the worker channel: the bytes sent to a worker minus the credit it
   returned ("credit" messages, one per piece its transport took).
2. A client that goes away (HTTP/1.1 close, an HTTP/3 stream reset or STOP_SENDING, a QUIC connection
   closed) has the task serving it cancelled: asyncio's CancelledError reaches the model kind, whose
   waiting shards leave the queues and whose engine call under way has its results dropped; a
   streamed answer's generator is closed (`aclose`). Through a worker, the worker sends "cancel".
3. Every such cancellation is counted (`appliance_requests_cancelled_total`), and the bytes the
   windows hold are shown (`appliance_stream_held_bytes`, `appliance_stream_held_bytes_max`).
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from appliance.protocol.limits import LIMITS_BITTEN

_OPEN: weakref.WeakSet[SendWindow] = weakref.WeakSet()


class SendWindow:
    """What one hop holds of one streamed answer that its peer has not taken yet, and a wait until
    that is within `limit` (uvicorn's flow_control.py, for the writing side)."""

    def __init__(self, limit: int) -> None:
        self.limit, self.held = limit, 0
        self._room = asyncio.Event()
        self._room.set()
        self.closed = False
        _OPEN.add(self)

    def hold(self, held: int) -> None:
        """The bytes held now, as the hop counts them (its buffer's length)."""
        self.held = max(0, held)
        if self.held > self.limit and not self.closed:
            self._room.clear()
        else:
            self._room.set()

    def add(self, count: int) -> None:
        self.hold(self.held + count)

    def taken(self, count: int) -> None:
        self.hold(self.held - count)

    @property
    def full(self) -> bool:
        """Held past the window: the answer's next piece waits until the peer takes some."""
        return not self._room.is_set()

    async def wait(self) -> None:
        """Return once the peer has taken enough (or the window closed: the caller checks its peer)."""
        await self._room.wait()

    def close(self) -> None:
        self.closed = True
        self._room.set()
        _OPEN.discard(self)


async def send_stream(
    stream: AsyncGenerator[bytes, None], window: SendWindow, send: Callable[[bytes], Awaitable[int | None]]
) -> bool:
    """A streamed answer handed on by one hop (rule 1 above), the loop every hop shares: each piece as
    it is produced (`send` hands it on and says what the hop holds now, None where its peer went), the
    next pulled only once the window has room; the generator closed however it ends. False where the
    peer went."""
    async with contextlib.aclosing(stream) as pieces:
        async for piece in pieces:
            if (held := await send(piece)) is None:
                return False
            window.hold(held)
            await window.wait()
    return True


@dataclass(frozen=True, slots=True)
class Held:
    """The bytes all open windows of a process hold, the largest one's, and how many windows wait for
    their peer (held past the window: the answer's next piece is not made until the peer takes some)."""

    total: int = 0
    largest: int = 0
    waiting: int = 0


def held() -> Held:
    windows = list(_OPEN)
    sizes = [w.held for w in windows]
    return Held(sum(sizes), max(sizes, default=0), sum(w.full for w in windows))


def unsent(transport: asyncio.WriteTransport) -> int:
    """What asyncio holds for a client that has not taken it. Over TLS, the TLS transport counts only
    what it has not encrypted yet, and hands a whole answer written at once to the TCP transport under
    it, whose buffer it does not count: that one is read here (asyncio offers no public way to it)."""
    below = getattr(getattr(transport, "_ssl_protocol", None), "_transport", None)
    return transport.get_write_buffer_size() + (below.get_write_buffer_size() if below is not None else 0)


class WriteProgress:
    """Whether a connection's writes move, from what its transport still holds at each check: while it
    holds something (the kernel's buffer is full) and none of it is taken, the deadline runs; a slow
    reader that takes anything starts it again."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._held = 0

    def overdue(self, now: float, held: int, timeout_s: float) -> bool:
        if not held:
            self._since = None
        elif self._since is None or held < self._held:
            self._since = now
        self._held = held
        return self._since is not None and now - self._since > timeout_s

    def cut_off(self, now: float, transport: asyncio.WriteTransport, timeout_s: float) -> bool:
        """A client that has taken nothing for `timeout_s` is cut off, closing or not: what is queued
        for it is dropped (a close would wait for it to be read), and its connection_lost frees its slot."""
        if not self.overdue(now, unsent(transport), timeout_s):
            return False
        LIMITS_BITTEN.bit("write timeout", f"a client read nothing for {timeout_s:g} s: connection closed")
        transport.abort()
        return True


# while the daemon stops, how often a busy session looks whether it is done
STOP_POLL_S = 0.05


async def received(receiving: asyncio.Future[Any], stopping: asyncio.Event, idle: Callable[[], bool]) -> bool:
    """Wait for the client's next message (`receiving`): True once it is there; False where the daemon
    stops while the session has nothing under way but listening: at once, or once its work is done
    (Realtime: a turn, a buffer, an answer; Wyoming: a recording, a synthesis). Work under way gets the
    stop's grace time; a session only waiting for speech closes."""
    while not receiving.done():
        if stopping.is_set() and idle():
            return False
        waiter = asyncio.ensure_future(asyncio.sleep(STOP_POLL_S) if stopping.is_set() else stopping.wait())
        try:
            await asyncio.wait((receiving, waiter), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
    return True


def peer_closed(transport: asyncio.BaseTransport | None) -> bool:
    """Whether the peer closed both directions, not only its sending side: on a Unix socket the kernel
    says so with POLLHUP (TCP cannot tell them apart until a write fails)."""
    sock = transport.get_extra_info("socket") if transport is not None else None
    if sock is None:
        return False
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN)
    return any(events & select.POLLHUP for _, events in poller.poll(0))
