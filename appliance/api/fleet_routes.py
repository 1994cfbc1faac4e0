"""The box's part in a fleet: its drain, its readiness and load as HAProxy's agent reads them
(api/fleet.py decides; this holds the state and serves the operator's routes).

    GET  /v2/fleet            the agent's answer, the weight, the drain and what is under way
    POST /v2/fleet/drain      {"then": "hold" | "stop" | "resume", "update": bool, "deadline_s": s}
    POST /v2/fleet/resume     end a held drain: take new work again

A drain (SIGUSR2, `appliance drain`, `appliance update`) answers new sequences, Realtime and
Wyoming sessions 503 with Retry-After (or an error event) at once; requests under way, stateless
requests that still come and open sessions finish, up to the deadline; then the box holds (new
requests of every kind refused 503), stops, or resumes, as asked.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from appliance.api.bodies import json_body
from appliance.api.fleet import RETRY_AFTER_S, BoxState, Capacity, agent_reply, metric_lines, not_ready, weight
from appliance.api.routes import Route
from appliance.config import Live
from appliance.errors import BadRequest, Unavailable
from appliance.firmware import Manifest
from appliance.kinds.base import ServedModel
from appliance.protocol.messages import Request, Response, json_response
from appliance.tasks import spawn

__all__ = ["Fleet", "not_ready", "refusal"]
log = logging.getLogger("appliance.fleet")
THEN = ("hold", "stop", "resume")
# what a drain still lets through: reading the box, and the operator's routes (a held drain resumes)
OPEN_DURING_DRAIN = frozenset({"fleet", "fleet_drain", "fleet_resume", "infer"})
GPU_ENGINES = ("cuda", "tensorrt")


def refusal(what: str) -> Unavailable:
    return Unavailable(f"draining: {what} go to another box", headers=(("Retry-After", str(RETRY_AFTER_S)),))


@dataclass(frozen=True, slots=True)
class DrainOrder:
    then: str = "hold"
    update: bool = False  # the agent says maint: the box is about to switch firmware or slots
    deadline_s: float = 30.0


class Fleet:
    """The drain and the load of one box. The daemon gives it `busy` (requests in flight, open
    sessions), `stop` and, where a GPU serves, `gpu_memory` once it serves."""

    def __init__(
        self, manifest: Manifest, models: dict[str, ServedModel], live: Live, ready: Callable[[], bool]
    ) -> None:
        self.manifest, self.models, self.live, self.ready = manifest, models, live, ready
        self.order: DrainOrder | None = None  # the drain asked for, until it resumes
        self.drained: dict[str, int] | None = None  # once the drain's wait is over: what it left unfinished
        self.stopping = False  # the daemon's own stop: the agent says drain; requests on open connections finish
        self.broken: str | None = None  # why the process cannot serve (liveness fails)
        self.busy: Callable[[], tuple[int, int]] = lambda: (0, 0)
        self.stop: Callable[[], None] = lambda: None
        self.gpu_memory: Callable[[], float] | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        return self.stopping or self.order is not None

    @property
    def holding(self) -> bool:
        """The drain's wait is over and it holds: new requests of every kind are refused (a drain that
        stops serves them on the connections still open, as a stop does)."""
        return self.order is not None and self.order.then == "hold" and self.drained is not None

    def admit(self, route: str, request: Request) -> None:
        """A drain refuses new sessions at once (they would hold it); a stateless request is served
        while the work under way finishes (the balancer stops sending within an agent check: refused,
        it would rest on the balancer's retry) and refused once the drain holds. A stop lets the
        requests of open connections finish."""
        if self.order is not None and route == "openai_realtime":
            raise refusal("new Realtime sessions")
        if self.holding and request.method == "POST" and route not in OPEN_DURING_DRAIN:
            raise refusal("new requests")

    def capacity(self) -> Capacity:
        engine, sequences = self.live.config.engine, self.live.config.sequences
        gpu = self.gpu_memory() if self.gpu_memory is not None else None
        return Capacity(
            queues={m.name: (m.queue_depth, engine.queue_policy(m.name)[0]) for m in self.models.values()},
            live=max((len(m.sequences) for m in self.models.values()), default=0),
            max_live=sequences.max_live,
            gpu_used=gpu,
            gpu_threshold=self.manifest.baked.fallback_cpu_threshold,
        )

    def state(self) -> BoxState:
        update = self.order is not None and self.order.update
        return BoxState(not self.ready(), self.draining, update, self.capacity())

    def metrics(self) -> str:
        return "\n".join(metric_lines(self.state(), self.manifest.name, self.manifest.version)) + "\n"

    def routes(self) -> list[Route]:
        return [
            ("GET", re.compile("/v2/fleet"), "fleet", self._show),
            ("POST", re.compile("/v2/fleet/drain"), "fleet_drain", self._drain),
            ("POST", re.compile("/v2/fleet/resume"), "fleet_resume", self._resume),
        ]

    def document(self) -> dict[str, Any]:
        state = self.state()
        in_flight, sessions = self.busy()
        return {
            "agent": agent_reply(state).decode().strip(),
            "weight": weight(state.capacity),
            "ready": not_ready(state) is None,
            "draining": state.draining,
            "update": state.updating,
            "then": self.order.then if self.order else None,
            "drained": self.drained,
            "in_flight": in_flight,
            "sessions": sessions,
        }

    def start_drain(self, order: DrainOrder) -> None:
        """Refuse new work from now; wait for work under way in a task of its own (SIGUSR2 or the route)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()  # a newer order replaces the one under way (its deadline, its `then`)
        self.order, self.drained = order, None
        log.info(
            "draining (then %s%s): up to %g s for work under way",
            order.then,
            order.update * ", update",
            order.deadline_s,
        )
        self._task = spawn(self._wait(order), "the drain")

    async def _wait(self, order: DrainOrder) -> None:
        deadline = time.monotonic() + order.deadline_s
        while any(self.busy()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        in_flight, sessions = self.busy()
        self.drained = {"in_flight": in_flight, "sessions": sessions}
        log.info("drained: %d requests and %d sessions still under way; then %s", in_flight, sessions, order.then)
        if order.then == "stop":
            self.stop()
        elif order.then == "resume":
            self.order = None

    async def _show(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(200, self.document())

    async def _drain(self, request: Request, params: dict[str, str]) -> Response:
        doc = await json_body(request) if request.body.strip() else {}
        unknown = sorted(set(doc) - {"then", "update", "deadline_s"})
        if unknown:
            raise BadRequest(f"/v2/fleet/drain: unknown field {unknown[0]!r} (known: then, update, deadline_s)")
        then = doc.get("then", "hold")
        if then not in THEN:
            raise BadRequest(f"/v2/fleet/drain: then must be one of {', '.join(THEN)}, got {then!r}")
        update = doc.get("update", False)
        if not isinstance(update, bool):
            raise BadRequest(f"/v2/fleet/drain: update must be true or false, got {update!r}")
        deadline_s = doc.get("deadline_s", self.live.config.server.shutdown_grace_s)
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, int | float) or not 0 <= deadline_s <= 86400:
            raise BadRequest(f"/v2/fleet/drain: deadline_s must be seconds from 0 to 86400, got {deadline_s!r}")
        self.start_drain(DrainOrder(then, update, float(deadline_s)))
        return json_response(202, self.document())

    async def _resume(self, request: Request, params: dict[str, str]) -> Response:
        if self._task is not None and not self._task.done():
            self._task.cancel()
        if self.order is not None:
            log.info("drain ended: taking new work again")
        self.order, self.drained = None, None
        return json_response(200, self.document())
