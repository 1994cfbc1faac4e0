"""systemd's watchdog: pinged only while every engine proves itself and every protocol worker reports."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from appliance import systemd
from appliance.errors import ApplianceError
from appliance.kinds import ServedModel

log = logging.getLogger("appliance")

PROBE_SHARE = 0.02  # the most of its time an idle model spends on the watchdog's probes


class Watchdog:
    """A model proves itself by completing engine calls for requests, or else by a probe (a real
    inference). A heavy model's probe (Whisper: a 30 s window) is run at most PROBE_SHARE of the
    time, so an idle box does not spend a core on proofs; a cheap one (the VAD) runs every interval."""

    def __init__(self, models: dict[str, ServedModel], unheard_workers: Callable[[], list[int]]) -> None:
        self.models, self.unheard_workers = models, unheard_workers
        self.proven: dict[str, tuple[float, int]] = {}  # model -> (when it last proved itself, its executions then)
        self.cost: dict[str, float] = {}  # model -> how long its last probe took

    async def run(self, interval: float) -> None:
        """Ping only when every engine proved itself lately: a wedged engine stops the pings."""
        log.info("watchdog: probing the engines every %.2f s at the most", interval)
        while True:
            started = time.monotonic()
            due = self._due(started, interval)
            if unheard := self.unheard_workers():
                log.error("watchdog: protocol workers %s are not serving (restarting); withholding the ping", unheard)
                await asyncio.sleep(interval)
                continue
            try:
                await asyncio.wait_for(asyncio.gather(*(self._probe(name) for name in due)), interval)
            except TimeoutError:
                log.error("watchdog: an engine did not complete a probe within %.2f s; withholding the ping", interval)
                continue  # the probes stay queued: a recovering engine answers them and pings resume
            except ApplianceError as exc:
                log.error("watchdog: %s; withholding the ping", exc)
            else:
                systemd.watchdog_ping()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    def _due(self, now: float, interval: float) -> list[str]:
        """The models to probe now: those that ran no request since they last proved themselves, once
        their probe's share of the time allows."""
        due = []
        for name, model in self.models.items():
            when, executions = self.proven.get(name, (0.0, -1))
            if model.stats.execution_count != executions and executions >= 0:
                self.proven[name] = (now, model.stats.execution_count)  # requests ran on it since
            elif now - when >= max(interval, self.cost.get(name, 0.0) / PROBE_SHARE):
                due.append(name)
        return due

    async def _probe(self, name: str) -> None:
        model, started = self.models[name], time.monotonic()
        await model.probe()
        done = time.monotonic()
        self.cost[name] = done - started
        self.proven[name] = (done, model.stats.execution_count)
