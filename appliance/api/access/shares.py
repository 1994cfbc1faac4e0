"""Each key's share of the box, daemon-wide (the engine process admits every request, whichever worker
took it): requests a minute (a token bucket), WebSocket sessions open at once, and audio seconds its
Realtime sessions send in any hour. One key's flood spends its own share only. The clock is an
argument, so a test holds it.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from appliance.api.access.keys import Share

HOUR_S = 3600.0


@dataclass
class Usage:
    """One principal's use now: a key's, or a room token's."""

    share: Share
    tokens: float = -1.0  # of the request bucket; -1 until the first request fills it
    refilled: float = 0.0
    sessions: dict[int, asyncio.Event] = field(default_factory=dict)  # each open session's stop
    audio: deque[tuple[float, float]] = field(default_factory=deque)  # (when, seconds) in the last hour


class Shares:
    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.usage: dict[str, Usage] = {}
        self._ids = 0

    def of(self, principal: str, share: Share) -> Usage:
        usage = self.usage.get(principal)
        if usage is None or usage.share != share:  # a reload may change a key's share
            usage = self.usage[principal] = Usage(share, sessions=usage.sessions if usage else {})
        return usage

    def over(self, principal: str, share: Share, session: bool) -> str:
        """Why `principal` may not have a request now (its bucket is empty, its sessions or its hour's
        audio are spent), or "" and the request is counted."""
        usage, now = self.of(principal, share), self.clock()
        if share.requests_per_minute:
            rate = share.requests_per_minute / 60.0
            if usage.tokens < 0:
                usage.tokens = float(share.requests_per_minute)
            usage.tokens = min(float(share.requests_per_minute), usage.tokens + (now - usage.refilled) * rate)
            usage.refilled = now
            if usage.tokens < 1.0:
                return f"rate: {share.requests_per_minute} requests a minute"
            usage.tokens -= 1.0
        if session and share.sessions and len(usage.sessions) >= share.sessions:
            return f"sessions: {share.sessions} open at once"
        if session and self.audio_spent(usage, now):
            return f"audio: {share.audio_seconds_per_hour} s an hour"
        return ""

    def audio_spent(self, usage: Usage, now: float) -> bool:
        while usage.audio and usage.audio[0][0] <= now - HOUR_S:
            usage.audio.popleft()
        bound = usage.share.audio_seconds_per_hour
        return bool(bound) and sum(s for _, s in usage.audio) >= bound

    def heard(self, principal: str, seconds: float) -> bool:
        """`seconds` of audio a session of `principal` sent; whether its hour's share is now spent."""
        usage = self.usage.get(principal)
        if usage is None:  # revoked: its sessions are being stopped
            return False
        usage.audio.append((self.clock(), seconds))
        return self.audio_spent(usage, self.clock())

    def opened(self, principal: str) -> tuple[int, asyncio.Event]:
        """A session of `principal` opened: its id, and the event that stops it (revoked, audio spent)."""
        self._ids += 1
        stop = self.usage[principal].sessions[self._ids] = asyncio.Event()
        return self._ids, stop

    def closed(self, principal: str, session: int) -> None:
        if (usage := self.usage.get(principal)) is not None:
            usage.sessions.pop(session, None)

    def stop_all(self, principals: set[str]) -> int:
        """Stop the open sessions of these principals (their keys were revoked); how many."""
        stopped = 0
        for principal in principals:
            usage = self.usage.pop(principal, None)
            for stop in usage.sessions.values() if usage else ():
                stop.set()
                stopped += 1
        return stopped
