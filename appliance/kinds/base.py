"""The one small interface of a served model, whatever its kind: how its requests become engine
batches and answers. The API core, the daemon and the metrics use a model only through it.

A new kind is a module here with a class that has these members, registered in `kinds/__init__.py`
under the name a firmware spec gives as `kind`; nothing in api/ or transport/ changes for it."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from appliance.engine.scheduler import Batcher, SequenceTable
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


class ServedModel(Protocol):
    spec: ModelSpec
    batcher: Batcher  # its engine calls, for the metrics
    sequences: SequenceTable  # its live sequences
    tasks: Mapping[str, Task]

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

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        """The outputs by name, and the sequence this request opened, if it did."""
        ...

    def expire_idle(self) -> int: ...
