"""Bounded waits on events: a test fails only when what it waits for never happens, never from the
clock (its bound is a guard against a hang, generous on any machine)."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path


def wait_until(
    condition: Callable[[], object], what: str, timeout_s: float = 120.0, log: Path | None = None, poll_s: float = 0.05
) -> None:
    """A bounded wait: fails only when `condition` never holds (no verdict from the clock), with the
    tail of `log` where one is given (what the daemon did instead); `condition` is asked every `poll_s`
    (a moment that lasts little, as a start's, needs a short one)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(poll_s)
    tail = "\n" + log.read_text()[-4000:] if log is not None else ""
    raise AssertionError(f"never happened: {what}{tail}")
