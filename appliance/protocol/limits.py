"""Limits that bite are logged, at most one line per limit every LOG_EVERY_S: the transports' size and
time limits, and the API's bounds on what a body may hold."""

from __future__ import annotations

import logging
import time
from typing import Protocol

log = logging.getLogger("appliance.limits")
LOG_EVERY_S = 10.0


class LimitLog:
    """One log line per limit and interval, with how often it bit meanwhile: an attacker cannot
    flood the journal, and an operator still sees which limit is biting and how hard."""

    def __init__(self) -> None:
        self._last: dict[object, float] = {}
        self._count: dict[object, int] = {}

    def bit(self, limit: object, message: str) -> None:
        """`limit`: which one (its status, or a name), so each has its own line."""
        now = time.monotonic()
        self._count[limit] = self._count.get(limit, 0) + 1
        if now - self._last.get(limit, -LOG_EVERY_S) >= LOG_EVERY_S:
            log.warning("limit: %s (%d times in the last %.0f s)", message, self._count[limit], LOG_EVERY_S)
            self._last[limit], self._count[limit] = now, 0


LIMITS_BITTEN = LimitLog()


class ByteBudget(Protocol):
    """The daemon's one bound on the bytes its clients make it hold (transport/assembler.py's
    BodyBudget): request bodies, and a Realtime session's manual audio buffer."""

    def refuses(self, count: int, what: str) -> str: ...

    def take(self, count: int, what: str = "request bodies") -> None: ...

    def give(self, count: int) -> None: ...
