"""What a transport is served with in the process that runs it (the engine where server.workers = 1,
else each protocol worker), and what each served transport answers for its drain. The table of
transports is listening.py's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sized
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from appliance.config import Live
from appliance.protocol.messages import Handler
from appliance.transport.assembler import BodyBudget

if TYPE_CHECKING:
    from appliance.api.metrics import Metrics
    from appliance.kinds.base import ServedModel
    from appliance.transport.conncache import ConnectionCache
    from appliance.transport.quic_guards import Tickets


@dataclass
class EngineSide:
    """What a transport that serves the models themselves is served with (Wyoming, whose sessions use
    them directly): the engine process's, so such a transport runs there whatever server.workers."""

    models: dict[str, ServedModel]
    metrics: Metrics
    draining: Callable[[], bool]  # a drain order stands: new sessions go to another box (api/fleet_routes.py)
    stopping: asyncio.Event  # the daemon's stop has begun: sessions close once idle


@dataclass
class Serving:
    api: Handler  # the engine's Api, or a worker's RemoteApi
    live: Live
    budget: BodyBudget  # what the process holds, against the daemon's one bound (budget_ledger.py)
    on_failure: Callable[[BaseException], None]  # a background task a transport needs died: the process stops
    quic_port: int | None = None  # where QUIC serves, for HTTPS's Alt-Svc
    cache: ConnectionCache | None = None  # QUIC's connection cache (the engine's, or a worker's view of its pins)
    worker_key: int | None = None  # a QUIC worker's: its connection IDs start with it (QUIC steering)
    tickets: Tickets | None = None  # QUIC session tickets shared by every worker (the engine's store)
    clock: Callable[[], float] = time.monotonic  # times every connection's deadlines (a test may hold it)
    engine: EngineSide | None = None  # in the engine process: the models, for the transports served there


class Served(Protocol):
    """One transport served on its socket."""

    @property
    def connections(self) -> Sized: ...

    @property
    def in_flight(self) -> int: ...

    @property
    def delivering(self) -> int:
        """Connections whose answers are sent but not all taken yet, which a drain waits for too."""

    def check_timeouts(self, now: float) -> None:
        """Every deadline of its connections at `now`, on Serving.clock (it checks them itself, too)."""

    def stop_accepting(self) -> None:
        """The stop: no new connections; those open finish what is under way."""

    def close_all(self) -> None:
        """Drained (or out of grace time): every connection closed."""


TIMEOUT_CHECK_S = 0.5  # how often a stream listener checks its connections' deadlines on its clock


async def checking_timeouts(served: Served, clock: Callable[[], float]) -> None:
    """A stream listener's periodic check of its connections (check_timeouts at `clock`'s time): the
    loop's time only wakes it; each connection's clock judges."""
    while True:
        await asyncio.sleep(TIMEOUT_CHECK_S)
        served.check_timeouts(clock())
