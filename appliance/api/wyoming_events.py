"""Wyoming's events read with bounds of our own (the `wyoming` package's reader has none): a header
line of at most MAX_HEADER_BYTES, data and payload of at most [wyoming] max_payload_bytes, each in
time as the API's HTTP/1.1 is (an idle connection, a header line, a stalled payload); events written
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
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from wyoming.error import Error
from wyoming.event import Event
from wyoming.event import write_event as write_sync

from appliance.config import Config
from appliance.errors import BadRequest
from appliance.protocol.limits import LIMITS_BITTEN

log = logging.getLogger("appliance.wyoming")
MAX_HEADER_BYTES = 64 << 10
LINGER_S = 5.0  # how long a connection closing after an error still reads what the client sends


E = TypeVar("E")  # an event as the wyoming library reads it


class WyomingError(Exception):
    """The client broke the protocol or a bound: one `error` event, then the connection closes. A bound
    names itself (`limit`): it is logged as limits are (LIMITS_BITTEN), so a flood is not a flood of lines."""

    def __init__(self, message: str, limit: str = "", code: str = "") -> None:
        super().__init__(message)
        self.limit = limit
        self.code = code or limit or "protocol"  # the error event's


@dataclass(frozen=True, slots=True)
class Bounds:
    """What one connection may send, and how slowly: the config as it was when the connection came."""

    max_payload: int  # [wyoming] max_payload_bytes: an event's data, and its payload
    max_samples: int  # a recording, in 16 kHz samples: as much as the API's body as PCM16
    idle_s: float  # server.keepalive_timeout_s: no next event begun (the first: header_s)
    header_s: float  # server.header_timeout_s: an event's header line, from its first byte; the first event
    quiet_s: float  # server.body_timeout_s: its data and payload may go quiet this long
    write_s: float  # server.write_timeout_s: what the box sends may go untaken this long

    @classmethod
    def of(cls, config: Config) -> Bounds:
        server = config.server
        return cls(
            config.wyoming.max_payload_bytes,
            server.max_body_bytes // 2,
            server.keepalive_timeout_s,
            server.header_timeout_s,
            server.body_timeout_s,
            server.write_timeout_s,
        )


async def read_event(reader: asyncio.StreamReader, bounds: Bounds, idle_s: float) -> Event | None:
    """One event, begun within `idle_s` and bounded before anything is read into memory; None at the end
    of the stream."""
    try:
        async with asyncio.timeout(idle_s):
            first = await reader.read(1)
    except TimeoutError:
        raise WyomingError(f"no event for {idle_s:g} s", "idle_timeout") from None
    if not first:
        return None
    try:
        async with asyncio.timeout(bounds.header_s):
            line = first + await reader.readuntil(b"\n") if first != b"\n" else first
    except TimeoutError:
        raise WyomingError(f"an event header not complete within {bounds.header_s:g} s", "header_timeout") from None
    except asyncio.IncompleteReadError:
        raise WyomingError("the connection ended inside an event header") from None
    except asyncio.LimitOverrunError:
        raise WyomingError(f"an event header line is over {MAX_HEADER_BYTES} bytes", "header_too_large") from None
    try:
        header = json.loads(line)
    except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        raise WyomingError(f"an event header is not JSON: {exc}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise WyomingError("an event header is a JSON object with a string 'type'")
    data = header.get("data") or {}
    lengths = [header.get("data_length") or 0, header.get("payload_length") or 0]
    if not isinstance(data, dict) or not all(isinstance(n, int) and 0 <= n <= bounds.max_payload for n in lengths):
        raise WyomingError(
            f"data must be an object, data_length and payload_length integers of at most {bounds.max_payload}",
            "payload_too_large",
        )
    try:
        if lengths[0]:
            extra = json.loads(await _read_exactly(reader, lengths[0], bounds.quiet_s))
            if not isinstance(extra, dict):
                raise WyomingError("an event's data is a JSON object")
            data = {**data, **extra}
        payload = await _read_exactly(reader, lengths[1], bounds.quiet_s) if lengths[1] else None
    except asyncio.IncompleteReadError:
        raise WyomingError("the connection ended inside an event") from None
    except TimeoutError:
        raise WyomingError(f"an event's data or payload stalled for {bounds.quiet_s:g} s", "payload_timeout") from None
    except (ValueError, RecursionError) as exc:
        raise WyomingError(f"an event's data is not JSON: {exc}") from None
    return Event(type=header["type"], data=data, payload=payload)


async def _read_exactly(reader: asyncio.StreamReader, size: int, quiet_s: float) -> bytes:
    """`size` bytes, the client never quiet for `quiet_s` in between (TimeoutError where it is)."""
    parts: list[bytes] = []
    while size:
        async with asyncio.timeout(quiet_s):
            part = await reader.read(size)
        if not part:
            raise asyncio.IncompleteReadError(b"".join(parts), size)
        parts.append(part)
        size -= len(part)
    return b"".join(parts)


class WriteTimeout(Exception):
    """The client took nothing of what the box sent it for server.write_timeout_s."""


async def write_event(event: Event, writer: asyncio.StreamWriter, timeout_s: float) -> None:
    """`event` sent, returning once the client has taken enough that the send buffer is under its mark.
    A client that reads slowly is waited for while it takes anything; one that takes nothing for
    `timeout_s` is a WriteTimeout."""
    encoded = io.BytesIO()
    write_sync(event, encoded)
    writer.write(encoded.getvalue())
    buffered = writer.transport.get_write_buffer_size()
    while True:
        try:
            async with asyncio.timeout(timeout_s):
                await writer.drain()
            return
        except TimeoutError:
            if (now := writer.transport.get_write_buffer_size()) >= buffered:
                raise WriteTimeout(f"it took nothing the box sent for {timeout_s:g} s") from None
            buffered = now


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
) -> None:
    """The one `error` event before a close (sent within `write_s`, server.write_timeout_s), and its line
    in the log: a bound's as limits are logged."""
    if exc.limit:
        LIMITS_BITTEN.bit(f"wyoming {exc.limit}", f"Wyoming client {client}: {exc}")
    else:
        log.info("Wyoming client %s: %s; closed", client, exc)
    try:
        await write_event(Error(text=str(exc), code=exc.code).event(), writer, write_s)
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
    if (wrong := mistyped(found)) is not None:
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
