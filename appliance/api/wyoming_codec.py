"""Wyoming's events read from bytes, sans I/O as h11 reads HTTP: `feed` what the connection gave, at the
time the caller's clock says, and `next_event` gives the next whole event (None while more is needed,
or where the stream ended between two events: `finished`). Nothing is read into memory past its bound: a header line of at most
MAX_HEADER_BYTES, data and payload of at most [wyoming] max_payload_bytes. Each part has its deadline,
as the API's HTTP/1.1: the next event begun within the idle time, its header line within header_s of
its first byte, its data and payload never quiet for quiet_s; the time the box takes to answer an
event is not the client's (`resume`). `due` says when the part read now expires and the error then;
the pump (wyoming_events.read_event) waits that long and no longer.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

from wyoming.event import Event

from appliance.config import Config

MAX_HEADER_BYTES = 64 << 10


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


class Part(enum.Enum):
    BETWEEN = "between events"
    HEADER = "in a header line"
    BODY = "in its data and payload"


class EventReader:
    """One connection's events, from the bytes it sent (`feed`) at the times they came."""

    def __init__(self, bounds: Bounds, now: float) -> None:
        self.bounds = bounds
        self._buffer = bytearray()
        self._ended = False
        self._part = Part.BETWEEN
        self._since = now  # when the part read now began (BODY: when its last byte came)
        self._idle_s = bounds.header_s  # a new connection's first event comes as soon as a new HTTP one's request
        self._header: dict[str, object] | None = None
        self._lengths = (0, 0)  # the header's data_length and payload_length

    def feed(self, data: bytes, now: float) -> None:
        """What the connection gave at `now`; b"" at its end."""
        if not data:
            self._ended = True
            return
        self._buffer += data
        if self._part is Part.BETWEEN:
            self._part, self._since = Part.HEADER, now
        elif self._part is Part.BODY:
            self._since = now  # progress: the quiet time counts from here

    def resume(self, now: float) -> None:
        """The connection is read again at `now`, its last event answered: the next one's deadline runs
        from here (while the box answers no bound runs: what it reads then is only read ahead)."""
        if self._part is not Part.BODY:
            self._since = now

    def due(self) -> tuple[float, WyomingError]:
        """When the part read now expires, and the error that closes the connection then."""
        part, bounds = self._part, self.bounds
        if part is Part.BETWEEN:
            return self._since + self._idle_s, WyomingError(f"no event for {self._idle_s:g} s", "idle_timeout")
        if part is Part.HEADER:
            message = f"an event header not complete within {bounds.header_s:g} s"
            return self._since + bounds.header_s, WyomingError(message, "header_timeout")
        message = f"an event's data or payload stalled for {bounds.quiet_s:g} s"
        return self._since + bounds.quiet_s, WyomingError(message, "payload_timeout")

    def wanted(self) -> int:
        """How many bytes to read next: no more than the part read now may hold."""
        if self._header is None:
            return max(MAX_HEADER_BYTES + 1 - len(self._buffer), 1)
        return sum(self._lengths) - len(self._buffer)

    def room_ahead(self) -> int:
        """How many bytes may be read ahead while the box answers the last event: up to the next header
        line's bound (nothing read ahead is parsed until the next event is asked for)."""
        return MAX_HEADER_BYTES + 1 - len(self._buffer) if self._header is None else 0

    @property
    def finished(self) -> bool:
        """The stream ended between two events."""
        return self._ended and self._part is Part.BETWEEN and not self._buffer

    def next_event(self, now: float) -> Event | None:
        """The next whole event; None while more is needed, or where `finished`. A WyomingError where the
        client broke the protocol or a bound."""
        if self._header is None and not self._read_header(now):
            self._at_end("the connection ended inside an event header")
            return None
        data_length, payload_length = self._lengths
        if len(self._buffer) < data_length + payload_length:
            self._at_end("the connection ended inside an event")
            return None
        assert self._header is not None
        data = self._header.get("data") or {}
        assert isinstance(data, dict)
        if data_length:
            try:
                extra = json.loads(self._buffer[:data_length])
            except (ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
                raise WyomingError(f"an event's data is not JSON: {exc}") from None
            if not isinstance(extra, dict):
                raise WyomingError("an event's data is a JSON object")
            data = {**data, **extra}
        payload = bytes(self._buffer[data_length : data_length + payload_length]) if payload_length else None
        event = Event(type=str(self._header["type"]), data=data, payload=payload)
        del self._buffer[: data_length + payload_length]
        self._header, self._lengths = None, (0, 0)
        self._part, self._since, self._idle_s = Part.BETWEEN, now, self.bounds.idle_s
        if self._buffer:  # the next event has begun already (its deadline runs from `resume`)
            self._part = Part.HEADER
        return event

    def _at_end(self, inside: str) -> None:
        """More is needed: where the stream has ended, inside an event, it never comes."""
        if self._ended and not self.finished:
            raise WyomingError(inside)

    def _read_header(self, now: float) -> bool:
        """The header line, where it has come whole: checked, and the body's part begun."""
        end = self._buffer.find(b"\n")
        if (end if end >= 0 else len(self._buffer)) >= MAX_HEADER_BYTES:  # the line, its newline included
            raise WyomingError(f"an event header line is over {MAX_HEADER_BYTES} bytes", "header_too_large")
        if end < 0:
            return False
        try:
            header = json.loads(self._buffer[: end + 1])
        except (ValueError, RecursionError) as exc:
            raise WyomingError(f"an event header is not JSON: {exc}") from None
        if not isinstance(header, dict) or not isinstance(header.get("type"), str):
            raise WyomingError("an event header is a JSON object with a string 'type'")
        lengths = (header.get("data_length") or 0, header.get("payload_length") or 0)
        limit = self.bounds.max_payload
        if not isinstance(header.get("data") or {}, dict) or not all(
            isinstance(n, int) and 0 <= n <= limit for n in lengths
        ):
            raise WyomingError(
                f"data must be an object, data_length and payload_length integers of at most {limit}",
                "payload_too_large",
            )
        del self._buffer[: end + 1]
        self._header, self._lengths = header, lengths
        self._part, self._since = Part.BODY, now
        return True
