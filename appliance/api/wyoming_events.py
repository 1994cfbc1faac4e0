"""Wyoming's events read with bounds of our own (the `wyoming` package's reader has none; the bounds and
the bytes' reading are wyoming_codec.py's: this is its pump on a connection's stream); events written
with its write deadline (a client that takes nothing of them for server.write_timeout_s is cut off:
WriteTimeout); and the one `error` event that closes a connection which broke one (WyomingError),
logged as limits are.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import json
import logging
import socket
import time
import typing
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from wyoming.error import Error
from wyoming.event import Event
from wyoming.event import write_event as write_sync

from appliance.api.wyoming_codec import EventReader, WyomingError
from appliance.errors import BadRequest
from appliance.protocol.flow import WriteProgress, peer_closed, unsent
from appliance.protocol.limits import LIMITS_BITTEN

log = logging.getLogger("appliance.wyoming")
LINGER_S = 5.0  # how long a connection closing after an error still reads what the client sends


E = TypeVar("E")  # an event as the wyoming library reads it


class Nudge:
    """The wait a connection's pump is in now (a read or a write): the listener's check_timeouts ends it
    early, so the pump asks its clock at once (the loop's time only wakes it; the clock judges)."""

    def __init__(self) -> None:
        self._waiting: asyncio.Timeout | None = None
        self._check: asyncio.Future[None] | None = None  # a wait for the listener's next check

    async def next_check(self) -> None:
        """Until the listener's next check_timeouts (a half-closed client's close makes no event here)."""
        self._check = asyncio.get_running_loop().create_future()
        try:
            await self._check
        finally:
            self._check = None

    @contextlib.contextmanager
    def waiting(self, timeout: asyncio.Timeout) -> Iterator[None]:
        self._waiting = timeout
        try:
            yield
        finally:
            self._waiting = None

    def now(self) -> None:
        if self._waiting is not None and not self._waiting.expired():
            self._waiting.reschedule(asyncio.get_running_loop().time())
        if self._check is not None and not self._check.done():
            self._check.set_result(None)


async def read_event(
    reader: asyncio.StreamReader, events: EventReader, clock: Callable[[], float], nudge: Nudge | None = None
) -> Event | None:
    """The connection's next event (None at its end), read by `events` within its deadlines on `clock`.
    Cancelled, it loses nothing: what was read is fed to `events` at once."""
    events.resume(clock())
    nudge = nudge or Nudge()
    while (event := events.next_event(clock())) is None:
        if events.finished:
            return None
        due, expired = events.due()
        try:
            async with asyncio.timeout(max(due - clock(), 0.0)) as timeout:
                with nudge.waiting(timeout):
                    data = await reader.read(events.wanted())
        except TimeoutError:
            if clock() >= due:
                raise expired from None
            continue  # the clock says not yet: wait again
        events.feed(data, clock())
    return event


async def answered(
    handling: Awaitable[list[Event]],
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    events: EventReader,
    clock: Callable[[], float],
    nudge: Nudge,
) -> list[Event]:
    """An event's answers, once `handling` has made them; where the client leaves meanwhile, its work is
    cancelled and the connection's end raised (a synthesis makes no answer until its first sentence is
    spoken: nothing else would notice). What the client sends meanwhile is read ahead into `events`; a
    client that only half-closed is looked at again at each of the listener's checks (`nudge`)."""
    task = asyncio.ensure_future(handling)
    watching = asyncio.ensure_future(_until_gone(reader, events, clock, lambda: _left(writer), nudge))
    try:
        await asyncio.wait([task, watching], return_when=asyncio.FIRST_COMPLETED)
        gone = watching.done()
    finally:
        watching.cancel()
        if not task.done():  # the client left (or this was cancelled): its work goes
            task.cancel()
        await asyncio.wait([task, watching])
    if gone and task.cancelled():
        raise ConnectionResetError("the client left while the box answered it")
    return task.result()


async def _until_gone(
    reader: asyncio.StreamReader,
    events: EventReader,
    clock: Callable[[], float],
    left: Callable[[], bool],
    nudge: Nudge,
) -> None:
    """Returns at the connection's end (or raises its reset); reads ahead within the next header's bound,
    past which the rest waits in the socket for the answer to be done (cancelled once it is made)."""
    while (room := events.room_ahead()) > 0:
        data = await reader.read(room)
        events.feed(data, clock())
        if not data:  # its sending side shut: it still reads, and is answered, unless it closes
            while not left():
                await nudge.next_check()
            return
    await asyncio.get_running_loop().create_future()


def _left(writer: asyncio.StreamWriter) -> bool:
    """At the end of what a client sends, whether it left: on a Unix socket the kernel tells a close
    from a half-close (shutdown(SHUT_WR): still reading, so answered on, as HTTP/1.1 is); on TCP it
    cannot, and Wyoming's clients keep the stream open both ways, so the end is a close."""
    sock = writer.get_extra_info("socket")
    return sock is None or sock.family != socket.AF_UNIX or peer_closed(writer.transport)


class WriteTimeout(Exception):
    """The client took nothing of what the box sent it for server.write_timeout_s."""


async def write_event(
    event: Event,
    writer: asyncio.StreamWriter,
    timeout_s: float,
    clock: Callable[[], float] = time.monotonic,
    nudge: Nudge | None = None,
) -> None:
    """`event` sent, returning once the client has taken enough that the send buffer is under its mark.
    A client that reads slowly is waited for while it takes anything; one that takes nothing for
    `timeout_s` on `clock` is a WriteTimeout (the deadline every transport's writes have: WriteProgress)."""
    encoded = io.BytesIO()
    write_sync(event, encoded)
    writer.write(encoded.getvalue())
    progress = WriteProgress()
    progress.overdue(clock(), unsent(writer.transport), timeout_s)  # the deadline runs from this write
    nudge = nudge or Nudge()
    while True:
        try:
            async with asyncio.timeout(timeout_s) as timeout:  # the loop's time wakes it to look; the clock judges
                with nudge.waiting(timeout):
                    await writer.drain()
            return
        except TimeoutError:
            if progress.overdue(clock(), unsent(writer.transport), timeout_s):
                raise WriteTimeout(f"it took nothing the box sent for {timeout_s:g} s") from None


def cut_off(exc: WriteTimeout, client: str, writer: asyncio.StreamWriter) -> None:
    """A client past its write deadline: what is queued for it dropped (a close would wait for it to be
    read, and no error event can reach it), the connection aborted, and its slot freed."""
    LIMITS_BITTEN.bit("wyoming write_timeout", f"Wyoming client {client}: {exc}; connection cut off")
    writer.transport.abort()


async def close_with_error(
    exc: WyomingError,
    client: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    write_s: float,
    linger: bool = True,
    clock: Callable[[], float] = time.monotonic,
) -> None:
    """The one `error` event before a close (sent within `write_s`, server.write_timeout_s), and its line
    in the log: a bound's as limits are logged."""
    if exc.limit:
        LIMITS_BITTEN.bit(f"wyoming {exc.limit}", f"Wyoming client {client}: {exc}")
    else:
        log.info("Wyoming client %s: %s; closed", client, exc)
    try:
        await write_event(Error(text=str(exc), code=exc.code).event(), writer, write_s, clock)
        if linger:
            await _linger(reader, writer)
    except WriteTimeout as stalled:
        cut_off(stalled, client, writer)
    except OSError:  # the client gone: ConnectionError, or ENOTCONN as we shut our side
        pass


async def _linger(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Before a close after an error: our side shut, what the client still sends read and dropped (up to
    LINGER_S), so its unread data does not reset the connection before it reads the error."""
    writer.write_eof()
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(LINGER_S):
            while await reader.read(1 << 16):
                pass


def read_as(read: Callable[[Event], E], event: Event) -> E:
    """The client's event read as the wyoming library reads it (`Transcribe.from_event`, ...): a field
    missing or of the wrong type is the client's error naming the event; any other failure is ours."""
    try:
        found = read(event)
    except KeyError as exc:
        raise BadRequest(f"bad {event.type} event: it has no {exc.args[0] if exc.args else exc!r}") from None
    except (TypeError, ValueError, AttributeError) as exc:
        raise BadRequest(f"bad {event.type} event: {exc}") from None
    if (wrong := mistyped(found) or unread_object(found, event.data)) is not None:
        raise BadRequest(f"bad {event.type} event: {wrong}")
    return found


@functools.cache
def hints(event_class: type) -> dict[str, typing.Any]:
    """An event class's fields and their types (read once: every audio chunk is checked)."""
    return typing.get_type_hints(event_class)


def mistyped(read: object) -> str | None:
    """The first text field of an event the library read (or of a dataclass in it, a voice) whose value
    is not a string: the library takes a language of 5 as it comes, and our code failed on it. Numbers
    are the audio format's, which PcmIn checks and names."""
    if not dataclasses.is_dataclass(read) or isinstance(read, type):
        return None
    for name, hint in hints(type(read)).items():
        value = getattr(read, name)
        if hint in (str, str | None) and not isinstance(value, str) and (value is not None or hint is str):
            return f"its {name!r} is {json.dumps(value)[:40]}, not a string"
        if (inner := mistyped(value)) is not None:
            return inner
    return None


def unread_object(read: object, data: dict[str, typing.Any]) -> str | None:
    """A field the library reads as an object (a voice) that the client sent as something else: the
    library reads {"voice": "pf_dora"} as no voice at all, and the first voice spoke the text."""
    if not dataclasses.is_dataclass(read) or isinstance(read, type):
        return None
    for name, hint in hints(type(read)).items():
        value = data.get(name)
        objects = [t for t in typing.get_args(hint) or (hint,) if dataclasses.is_dataclass(t)]
        if objects and value not in (None, "") and not isinstance(value, dict):  # "" for none, as the package reads it
            return f"its {name!r} is {json.dumps(value)[:40]}, not an object"
    return None
