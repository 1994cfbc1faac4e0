"""Progress of long jobs (hashing, copying, writing disks), one helper for every place that loops over bytes.

Library functions take a `Progress` and default to QUIET (the daemon verifies its firmware without a
word); the CLI passes `Progress()`. On a terminal each phase is one tqdm bar on stderr (bytes, rate,
time left). Elsewhere (the journal, a log file, a pipe) a bar's carriage returns would be noise, so
each phase is plain lines on stderr: "DESC: 10%" ... "DESC: 90%" for phases of 64 MiB or more, and
one closing line "DESC: 100%, SIZE in T s (RATE/s)" for every phase.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TextIO

from tqdm import tqdm

Advance = Callable[[int], None]  # called with the number of bytes just done
LINES_FROM = 64 << 20  # phases at least this large get a line every 10% in plain mode


def ignore(_: int) -> None:
    """An Advance that does nothing."""


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """Where long jobs report their phases. `bar=None` draws tqdm bars only when the stream is a terminal."""

    def __init__(self, stream: TextIO | None = None, bar: bool | None = None, enabled: bool = True) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.bar = enabled and (bar if bar is not None else _isatty(self.stream))

    @contextmanager
    def phase(self, desc: str, total: int) -> Iterator[Advance]:
        """A phase of `total` bytes; the body calls the yielded function with each block's size."""
        if not self.enabled:
            yield ignore
        elif self.bar:
            # A terminal that reports no size (a serial console, a fresh pty) would get an empty bar.
            columns, lines = _size(self.stream)
            size = {"dynamic_ncols": True} if columns and lines else {"ncols": columns or 80, "nrows": lines or 24}
            with tqdm(
                total=total,
                desc=desc,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                file=self.stream,
                leave=True,
                **size,
            ) as bar:
                yield bar.update
        else:
            with self._lines(desc, total) as advance:
                yield advance

    @contextmanager
    def _lines(self, desc: str, total: int) -> Iterator[Advance]:
        started, done, shown = time.monotonic(), 0, 0

        def advance(n: int) -> None:
            nonlocal done, shown
            done += n
            if total >= LINES_FROM:
                step = min(done * 100 // total, 99) // 10 * 10
                if step > shown:
                    shown = step
                    self.note(f"{desc}: {step}%")

        yield advance
        seconds = time.monotonic() - started
        rate = f"{format_bytes(done / seconds)}/s" if seconds > 0 else "-"
        self.note(f"{desc}: 100%, {format_bytes(done)} in {seconds:.1f} s ({rate})")

    def note(self, line: str) -> None:
        """A line between phases (what is happening that has no byte count, or what was done)."""
        if self.enabled:
            print(line, file=self.stream, flush=True)


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 0, 0
    return size.columns, size.lines


QUIET = Progress(enabled=False)
