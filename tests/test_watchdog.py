"""systemd's watchdog in process (the daemon under systemd: test_systemd.py): its interval from
systemd's environment, and the order of its pings against an engine that answers its probes, hangs,
and recovers. No verdict is taken from a clock."""

from __future__ import annotations

import asyncio
import logging
import os
from types import SimpleNamespace

import pytest

from appliance import systemd
from appliance.daemon.watchdog import Watchdog


class Engine:
    """A model whose probes complete while `answering` is set, and wait while it is not."""

    def __init__(self) -> None:
        self.stats = SimpleNamespace(execution_count=0)
        self.answering = asyncio.Event()
        self.answering.set()

    async def probe(self) -> None:
        await self.answering.wait()
        self.stats.execution_count += 1


class Said(logging.Handler):
    def __init__(self, events: list[str]) -> None:
        super().__init__()
        self.events = events

    def emit(self, record: logging.LogRecord) -> None:
        if "withholding the ping" in record.getMessage():
            self.events.append("withheld")


def test_the_interval_is_half_watchdog_usec_for_this_process_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WATCHDOG_USEC", "1000000")
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
    assert systemd.watchdog_interval() == 0.5
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process of the unit
    assert systemd.watchdog_interval() is None
    monkeypatch.delenv("WATCHDOG_USEC")
    assert systemd.watchdog_interval() is None


def test_pings_stop_while_an_engine_hangs_or_a_worker_is_unheard_and_resume_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    unheard: list[int] = []
    monkeypatch.setattr(systemd, "watchdog_ping", lambda: events.append("ping"))
    handler = Said(events)
    logging.getLogger("appliance").addHandler(handler)

    async def until(count: int, event: str, since: str) -> None:
        while events[events.index(since) :].count(event) < count:
            await asyncio.sleep(0.001)

    async def scenario() -> None:
        engine = Engine()
        dog = asyncio.create_task(Watchdog({"vad": engine}, lambda: unheard).run(0.01))  # type: ignore[dict-item]
        events.append("started")
        await until(3, "ping", "started")
        engine.answering.clear()
        events.append("hung")
        await until(3, "withheld", "hung")
        engine.answering.set()
        events.append("answering")
        await until(2, "ping", "answering")
        unheard.append(2)
        events.append("worker unheard")
        await until(3, "withheld", "worker unheard")
        unheard.clear()
        events.append("worker heard")
        await until(1, "ping", "worker heard")
        dog.cancel()

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        logging.getLogger("appliance").removeHandler(handler)
    for cause in ("hung", "worker unheard"):
        after = events[events.index(cause) + 1 :]
        first = after.index("withheld")
        # a ping already on its way when the cause began may come before the first withholding; none after
        assert "ping" not in after[first : after.index("answering" if cause == "hung" else "worker heard")], events
