"""Background tasks with an owner: `spawn` starts every one, keeps a reference (asyncio keeps only a
weak one), and logs its failure once with its name and traceback; `on_failure` hears it (an engine
loop fails its pending requests and is restarted). `LoopLag` measures how late the event loop runs
its callbacks (CPU work on the loop shows here first). `failpoint` lets a test make a named place
fail, through APPLIANCE_TEST_FAILPOINTS (comma-separated names; each fails once, after the start):
set only by tests. `freeze_start_up` keeps start-up's objects out of the collector's full passes."""

from __future__ import annotations

import asyncio
import bisect
import gc
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

log = logging.getLogger("appliance.tasks")

_OWNED: set[asyncio.Task[Any]] = set()
_FAILPOINTS: set[str] = set()


def spawn(
    coroutine: Coroutine[Any, Any, Any], name: str, on_failure: Callable[[BaseException], None] | None = None
) -> asyncio.Task[Any]:
    task = asyncio.get_running_loop().create_task(coroutine, name=name)
    _OWNED.add(task)

    def finished(task: asyncio.Task[Any]) -> None:
        _OWNED.discard(task)
        if task.cancelled() or (error := task.exception()) is None:
            return
        log.error("%s crashed", name, exc_info=error)
        if on_failure is not None:
            on_failure(error)

    task.add_done_callback(finished)
    return task


P = ParamSpec("P")
R = TypeVar("R")
OFF_LOOP_BYTES = 1 << 20  # work on more than this (a body, an output) leaves the event loop
# A body parsed into values costs more a byte: KServe's JSON strings 0.3 us (5 ms at this size), its
# binary BYTES 0.05 us (65,536 texts in 320 KiB: 17 ms on the loop, under OFF_LOOP_BYTES)
PARSE_OFF_LOOP_BYTES = 16 << 10


async def off_loop(size: int, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """`function(*args)` on a thread when it works on `size` bytes past OFF_LOOP_BYTES (JSON of a
    long output, a FLAC encoding), so the loop keeps serving everyone else; inline when small (a
    thread's hand-over costs more than the work)."""
    return await off_loop_past(OFF_LOOP_BYTES, size, function, *args, **kwargs)


async def off_loop_past(limit: int, size: int, function: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """off_loop for work that costs more a byte: on a thread past `limit` bytes."""
    if size > limit:
        return await asyncio.to_thread(function, *args, **kwargs)
    return function(*args, **kwargs)


def arm_failpoints() -> None:
    """The daemon is ready: the failpoints a test named may fire from now on (not in the warm-up)."""
    _FAILPOINTS.update(name for name in os.environ.get("APPLIANCE_TEST_FAILPOINTS", "").split(",") if name)


def failpoint(name: str) -> None:
    """Raise here once if a test named this place in APPLIANCE_TEST_FAILPOINTS."""
    if name in _FAILPOINTS:
        _FAILPOINTS.discard(name)
        raise RuntimeError(f"failpoint {name} (APPLIANCE_TEST_FAILPOINTS)")


LAG_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class LoopLag:
    """How late a callback scheduled every INTERVAL_S runs: the event loop's lag (gauge: the last
    one; histogram: all of them, in LAG_BUCKETS)."""

    INTERVAL_S = 0.1

    def __init__(self) -> None:
        self.last = 0.0
        self.counts = [0] * (len(LAG_BUCKETS) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, lag: float) -> None:
        self.last = lag
        self.counts[bisect.bisect_left(LAG_BUCKETS, lag)] += 1
        self.sum += lag
        self.count += 1

    async def run(self) -> None:
        while True:
            due = time.monotonic() + self.INTERVAL_S
            await asyncio.sleep(self.INTERVAL_S)
            self.observe(max(0.0, time.monotonic() - due))


LOOP_LAG = LoopLag()  # this process's
LOOP_SWITCH_S = 0.001  # how long the loop's thread waits for the GIL at most before a busy thread lets it go


def run_loop(main: Coroutine[Any, Any, R]) -> R:
    """A process's event loop, run with a shorter GIL switch interval than Python's 5 ms: the threads
    that take work off the loop (language ID's detection, a body's JSON scan) hold the GIL for that long
    at a time, and each time the loop woke it waited for them (the loop bench's health check: p50
    5.5 ms while language ID ran; 1.4 ms at 1 ms, for the same work done and CPU). Threads that work
    side by side lose nothing to it: 8 Wyoming transcriptions at once, median of six, 2.73 s against
    2.66 s at 5 ms."""
    sys.setswitchinterval(LOOP_SWITCH_S)
    return asyncio.run(main)


def freeze_start_up() -> None:
    """What start-up made lives as long as the process: out of the collector's full passes, which held
    the loop for up to 17 ms at a time (84 ms beside a walk of a full QUIC peer table). Its garbage is
    collected first: what is frozen is never collected."""
    gc.collect()
    gc.freeze()
