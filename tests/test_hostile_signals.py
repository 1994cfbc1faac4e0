"""SIGHUP while the daemon starts, against a real daemon with one and two protocol workers: as soon
as the process holds it (its first instructions, while Python still imports the daemon for a second),
and just as the workers spawn (to the engine and to each worker). The daemon holds it until it and its
workers can act on it, then applies it once: never its death, never a failed start, no worker lost.
Before the interpreter reaches appliance's first line (about 0.1 s) nothing of ours can hold it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import pytest
from waits import wait_until


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def is_worker(pid: int) -> bool:
    try:
        return b"appliance.front.worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def holds_sighup(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            return bool(int(line.split()[1], 16) & 1 << (signal.SIGHUP - 1))
    return False


def reload_lines(log: Path) -> list[str]:
    """The config's reload outcome, one line a reload (the API keys' reload says its own line too)."""
    return [line for line in log.read_text().splitlines() if "appliance: " in line and "reload: applied" in line]


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
@pytest.mark.parametrize("moment", ["first-held", "workers-spawning"])
def test_sighup_during_start_is_applied_once_after_it(start_daemon, tls, workers, moment) -> None:
    d = start_daemon(tls=tls, workers=workers, wait=False)
    wait_until(lambda: d.proc.poll() is not None or holds_sighup(d.proc.pid), "held SIGHUP", poll_s=0.002)
    if moment == "workers-spawning":  # with one worker, none spawns: the engine's start is the moment
        wait_until(
            lambda: d.proc.poll() is not None or workers == 1 or any(map(is_worker, children(d.proc.pid))),
            "spawned a worker",
            poll_s=0.002,
        )
    d.proc.send_signal(signal.SIGHUP)
    for pid in children(d.proc.pid):  # a worker reached while it starts, as `kill -HUP` to the group would
        # a short-lived child (the connection cache's loader) may be gone already: the group's kill skips it
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGHUP)
    d.wait_ready()
    deadline = time.monotonic() + 20
    while not reload_lines(d.log) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)
    log = d.log.read_text()
    assert len(reload_lines(d.log)) == 1, log
    assert "exited" not in log and "restarting it" not in log, log
    assert d.stop() == 0, log
