"""Limits that bite are logged, at most one line per limit every LOG_EVERY_S: the transports' size and
time limits, and the API's bounds on what a body may hold."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
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
    BodyBudget): request bodies, Realtime's manual audio buffers, Wyoming's recordings."""

    def take_if_fits(self, count: int, what: str) -> str:
        """Take `count` bytes where they fit, checked once; else why not (taken: "")."""
        ...

    def give(self, count: int) -> None: ...

    @property
    def held_by_daemon(self) -> int:
        """What every process of the daemon holds against the bound, together."""
        ...


# what the byte budget holds beside request bodies, as a refusal of a Realtime buffer or a Wyoming recording says
HELD = "request bodies, audio buffers and recordings"


class Held:
    """The bytes one holder (a Realtime session's manual buffer, a Wyoming recording) takes from the
    daemon's byte budget as it grows, all given back at once (None: nothing bounds them)."""

    def __init__(self, budget: ByteBudget | None) -> None:
        self.budget, self.bytes = budget, 0

    def take(self, count: int) -> str:
        """Take `count` more bytes where they fit; else why not (taken: ""). One check: with protocol
        workers what the others hold may change between two."""
        if self.budget is not None and (why := self.budget.take_if_fits(count, HELD)):
            return why
        self.bytes += count
        return ""

    def give_all(self) -> None:
        if self.budget is not None:
            self.budget.give(self.bytes)
        self.bytes = 0


def worker_share(limit: int, workers: int) -> int:
    """One process's part of a daemon-wide limit: with N protocol workers each holds 1/N of it."""
    return max(1, limit // workers)


def over_bound(
    held: Iterable[str], key: str, limit: int, share: int, workers: int = 1, what: str = "connections"
) -> tuple[str, str] | None:
    """Which bound one more of `what` from peer `key` would pass ("limit": all of them, "share": its
    peer's) and why, or None: `held` names the peer of each this process holds; `limit` and `share` are
    the daemon's, of which this process holds 1/workers. Every listener's admission asks this."""
    held = list(held)
    if len(held) >= worker_share(limit, workers):
        return "limit", f"too many {what} (limit {worker_share(limit, workers)})"
    if sum(peer == key for peer in held) >= worker_share(share, workers):
        each = f", {worker_share(share, workers)} in each of {workers} workers" if workers > 1 else ""
        return "share", f"too many {what} from {key} (its share is {share}{each})"
    return None
