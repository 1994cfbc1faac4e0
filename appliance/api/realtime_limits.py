"""What bounds a Realtime session, without I/O: its audio against the wall clock (the clock is an
argument); its manual buffer's bytes are held against the daemon's byte budget (protocol/limits.py's Held).

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

from appliance.config import Live
from appliance.protocol.limits import ByteBudget

# a debt smaller than this is not waited for yet: a session of tiny appends sleeps once per this much
# audio, not once per append
QUANTUM_S = 0.1


@dataclass(frozen=True, slots=True)
class Limits:
    """What bounds every session: the live config ([realtime]), the daemon's byte budget that a
    manual buffer takes from (None: unbounded, an API without transports), and the daemon's stop (set
    when it begins: a session with nothing under way but listening closes then)."""

    live: Live
    budget: ByteBudget | None
    stopping: asyncio.Event = field(default_factory=asyncio.Event)


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
