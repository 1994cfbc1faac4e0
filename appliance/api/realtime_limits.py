"""What bounds a Realtime session, without I/O: its audio against the wall clock (the clock is an
argument), and the bytes of its manual buffer against the daemon's byte budget.

A live stream's chunks go to the engine's urgent lane, ahead of every recording: a client that sends
speech faster than it is spoken would hold that lane for as long as it sends (one such client took a
good Wyoming transcription from 0.36 s p50 to 6.3 s). So a session may run at most `ahead_s` seconds
of audio ahead of real time (a bucket of that much audio, refilled as time passes, that each append
spends); once it has spent that, it is read no faster than real time. A client speaking live never
waits; an upload is slowed to the pace of speech, never refused.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.api.realtime_settings import RealtimeError
from appliance.config import Live
from appliance.protocol.limits import LIMITS_BITTEN, ByteBudget

# a debt smaller than this is not waited for yet: a session of tiny appends sleeps once per this much
# audio, not once per append
QUANTUM_S = 0.1
BUFFERS = "request bodies and Realtime audio buffers"  # what the byte budget holds, as its refusal says


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds every session: the live config ([realtime]), the daemon's byte budget that a
    manual buffer takes from (None: unbounded, an API without transports), and the daemon's stop (set
    when it begins: a session with nothing under way but listening closes then)."""

    live: Live
    budget: ByteBudget | None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)


class Held:
    """The bytes of one session's manual buffer, taken from the daemon's byte budget as it grows and
    given back when it is committed, cleared or dropped, or the session ends."""

    def __init__(self, budget: ByteBudget | None, session: str) -> None:
        self.budget, self.session, self.bytes = budget, session, 0

    def take(self, count: int) -> None:
        """Hold `count` more bytes, or a RealtimeError naming the bound (logged, rate-limited)."""
        if self.budget is None:
            return
        if why := self.budget.refuses(count, BUFFERS):
            LIMITS_BITTEN.bit("realtime buffers", f"Realtime session {self.session}: {why}")
            raise RealtimeError(f"{why} ([server] max_buffered_bytes)", "buffer_too_large")
        self.budget.take(count, BUFFERS)
        self.bytes += count

    def give_all(self) -> None:
        if self.budget is not None:
            self.budget.give(self.bytes)
        self.bytes = 0


class Pace:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.credit_s: float | None = None  # audio it may still send ahead of real time; None: full
        self.at = 0.0  # when the credit was last counted

    def spend(self, seconds: float, ahead_s: float) -> float:
        """`seconds` of audio arrived, with `ahead_s` the bound now: how long to wait before reading
        the session further (0: at once)."""
        now = self.clock()
        credit = ahead_s if self.credit_s is None else min(ahead_s, self.credit_s + now - self.at)
        self.credit_s, self.at = credit - seconds, now
        return -self.credit_s if self.credit_s < -QUANTUM_S else 0.0
