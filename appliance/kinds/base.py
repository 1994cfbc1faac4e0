"""The one small interface of a served model, whatever its kind: how its requests become engine
batches and answers. The API core, the daemon and the metrics use a model only through it.

A new kind is a module here with a class that has these members, registered in `kinds/__init__.py`
under the name a firmware spec gives as `kind` (and its parameters in firmware/manifest.py
KIND_PARAMETERS); nothing in api/ or transport/ changes for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import BadRequest
from appliance.firmware import ModelSpec
from appliance.protocol.messages import Opened, Request, Response
from appliance.protocol.tensors import InferRequest

# A route of the model's own under /v2/models/{name}/{task}: the request and its query parameters.
Task = Callable[[Request, dict[str, str]], Awaitable[Response]]


@dataclass(frozen=True, slots=True)
class SequenceCall:
    """Triton's sequence parameters of one request to a stateful model."""

    id: object
    start: bool
    end: bool
    client: str = ""  # who sends it (Request.client): only the client that opened a sequence may use it
    address: str = ""  # where from (Request.address): its clients share one share of the table
    principal: str = ""  # the API key or room it was admitted for (Request.principal): one share too


class OpenSequences(Protocol):
    """A model's open sequences (engine/sequences.py OwnedTable; NoSequences for a stateless model)."""

    def __len__(self) -> int: ...

    def holds(self, key: object, serial: int) -> bool: ...

    def end_opened(self, key: object, serial: int) -> bool: ...

    def expire(self, now: float) -> int: ...

    def streaming(self, now: float, within_s: float) -> int:
        """Sequences with a request in flight or one within the last `within_s`: a stop waits for
        these; the others are idle and end at once."""
        ...


class NoSequences:
    """The sequences of a stateless model: there are none, and none can open."""

    def __len__(self) -> int:
        return 0

    def holds(self, key: object, serial: int) -> bool:
        return False

    def end_opened(self, key: object, serial: int) -> bool:
        return False

    def expire(self, now: float) -> int:
        return 0

    def streaming(self, now: float, within_s: float) -> int:
        return 0


def stateless(model: str, sequence: SequenceCall | None) -> None:
    """A stateless model's infer: Triton's sequence parameters are a 400."""
    if sequence is not None:
        raise BadRequest(f"model {model} is stateless: it takes no sequence_id")


class EngineModel:
    """What every kind served by one engine shares: its name is its spec's, its engine's name, and the
    batches its engine handed to the CPU (only the GPU engines fall back)."""

    spec: ModelSpec
    engine: Any  # the kind's engine: it has a `name`, and `fallbacks` where it can fall back

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine_name(self) -> str:
        return str(self.engine.name)

    @property
    def fallbacks(self) -> Mapping[str, int]:
        return getattr(self.engine, "fallbacks", {})


class QueuedModel(EngineModel):
    """A stateless kind whose work goes through one BatchQueue (`queue`, engine/batch_queue.py): it
    starts and stops with its queue, its depth is what waits or runs there, and it has no sequences to expire."""

    queue: Any

    @property
    def queue_depth(self) -> int:
        return int(self.queue.queue_depth)

    def start(self) -> None:
        self.queue.start()

    async def stop(self, timeout_s: float) -> bool:
        return bool(await self.queue.stop(timeout_s))

    def expire_idle(self) -> int:
        return 0


class ServedModel(Protocol):
    spec: ModelSpec
    stats: ModelStats  # Triton's statistics: requests and engine calls (the stats route and the metrics)
    tasks: Mapping[str, Task]

    @property
    def sequences(self) -> OpenSequences: ...

    @property
    def queue_depth(self) -> int:
        """Requests (or their pieces) waiting or running in the engine."""
        ...

    @property
    def name(self) -> str: ...

    @property
    def engine_name(self) -> str: ...

    @property
    def fallbacks(self) -> Mapping[str, int]:
        """Batches the GPU engine handed to the CPU engine, by reason."""
        ...

    def start(self) -> None: ...

    async def stop(self, timeout_s: float) -> bool:
        """False when its engine did not finish the batch under way in time (wedged)."""
        ...

    async def probe(self) -> None:
        """One real inference: the warm-up before ready, and the watchdog's proof that the engine works."""
        ...

    def metadata(self) -> dict[str, Any]:
        """KServe model metadata: inputs, outputs and parameters (the API adds name and versions)."""
        ...

    def config(self) -> dict[str, Any]:
        """Triton's model configuration (GET .../config): what the server will do with a request."""
        ...

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        """The outputs by name, and the sequence this request opened, if it did; where the request's
        time went (queue, compute) goes into `times`, which the caller records in `stats`."""
        ...

    def expire_idle(self) -> int: ...
