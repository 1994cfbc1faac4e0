"""The daemon's signals, read by a thread of their own rather than by the event loop: a loop blocked
by a wedged engine call still learns of SIGTERM, and the stop gets a hard deadline after which the
process exits whatever it was doing.

Python's C-level handler writes each signal's number to the wakeup fd from whichever thread the
kernel picked, so the watcher thread sees it even while the main thread never returns to Python."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator

log = logging.getLogger("appliance")
STOP = (signal.SIGTERM, signal.SIGINT)
RELOAD = signal.SIGHUP
DRAIN = signal.SIGUSR2  # refuse new work, let work under way finish, keep serving it (api/fleet_routes.py)

# SIGHUP is held (blocked, so it waits pending) from the first thing `appliance run` does (cli/__init__.py)
# until the daemon has started (allow_reloads); a protocol worker inherits it held and allows it once it
# serves. A reload sent meanwhile is applied once, then: never the default action (death), never a
# failed start. Threads started while it is held keep it held; the main thread takes it.


def hold_reloads() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {RELOAD})


def allow_reloads() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {RELOAD})


@contextlib.contextmanager
def reloads_held() -> Iterator[None]:
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {RELOAD})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def spawn_holding_reloads(args: list[str], pass_fds: list[int]) -> subprocess.Popen[bytes]:
    """A child process that starts with SIGHUP held (the signal mask is inherited through exec)."""
    with reloads_held():
        return subprocess.Popen(args, pass_fds=pass_fds)


def watch(
    loop: asyncio.AbstractEventLoop,
    on_stop: Callable[[], None],
    on_reload: Callable[[], None],
    deadline_s: Callable[[], float],
    on_overdue: Callable[[bool], None],
    on_drain: Callable[[], None] = lambda: None,
) -> None:
    """Call on_reload for SIGHUP, on_drain for SIGUSR2 and on_stop for SIGTERM/SIGINT, on the loop;
    on_overdue from the watcher thread when the process still runs `deadline_s()` seconds after the first
    stop signal (False), or at once when a second stop signal comes before then (True: Ctrl-C twice stops now).
    Main thread only (set_wakeup_fd)."""
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)  # the C handler must never block
    for sig in (*STOP, RELOAD, DRAIN):
        signal.signal(sig, lambda *_: None)  # caught, not fatal: the wakeup fd carries it
    signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)

    def call(callback: Callable[[], None]) -> None:
        with contextlib.suppress(RuntimeError):  # the loop has closed: the process is exiting
            loop.call_soon_threadsafe(callback)

    def wait() -> None:
        while (number := os.read(read_fd, 1)[0]) in (RELOAD, DRAIN):  # one byte per signal, its number
            call(on_reload if number == RELOAD else on_drain)
        allowed = deadline_s()  # read before the stop begins: it marks the daemon not ready, which shortens it
        # from this thread: the event loop may be the thing that is stuck
        log.info("stop signal: stopping within %.0f s; a second stop signal (Ctrl-C again) stops now", allowed)
        deadline = time.monotonic() + allowed
        call(on_stop)
        while (left := deadline - time.monotonic()) > 0:
            if select.select([read_fd], [], [], left)[0] and os.read(read_fd, 1)[0] in STOP:
                on_overdue(True)
                return
        on_overdue(False)

    threading.Thread(target=wait, name="signals", daemon=True).start()
