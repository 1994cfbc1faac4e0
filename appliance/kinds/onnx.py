"""The generic kind: any ONNX graph, its tensors as the graph declares them (KServe datatypes), requests
batched dynamically along the graph's batch axis (engine/dynamic.py), and implicit state for a graph
with declared state pairs (live sequences under Triton's sequence_id, state kept by the box).

A graph batches where every input and output (state pairs aside) has a free first dimension: its
`max_batch_size` is then the baked max_batch, and a request carries [rows, ...] with rows at most that.
Otherwise requests run one at a time, with the graph's shapes as they are.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.choice import load_engine
from appliance.engine.dynamic import DynamicBatcher, Job
from appliance.engine.loop import EngineLoop
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.scheduler import Sequence
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import DATATYPES, Bundle, ModelSpec, TensorSpec
from appliance.kinds.base import EngineModel, NoSequences, SequenceCall, ServedModel, Task
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

NUMPY_OF = {name: np.dtype(numpy) for name, numpy in DATATYPES.items()}


class StateRows:
    """New sequences of a stateful graph: zero rows of each state input, its batch axis removed."""

    def __init__(self, spec: ModelSpec) -> None:
        declared = {t.name: t for t in spec.inputs}
        self.rows: list[tuple[tuple[int, ...], np.dtype[Any]]] = []
        for pair in spec.state:
            tensor = declared[pair.input]
            shape = [d for axis, d in enumerate(tensor.shape) if axis != pair.batch_axis]
            if any(d < 0 for d in shape) or not -len(tensor.shape) <= pair.batch_axis < len(tensor.shape):
                raise ApplianceError(
                    f"model {spec.name}: state {pair.input} {list(tensor.shape)} needs a fixed shape besides "
                    f"its batch axis {pair.batch_axis}"
                )
            self.rows.append((tuple(shape), NUMPY_OF[tensor.datatype]))

    def new_sequence(self) -> Sequence:
        return Sequence(state=[np.zeros(shape, dtype) for shape, dtype in self.rows], context=np.empty(0))


class OnnxModel(EngineModel):
    def __init__(
        self,
        spec: ModelSpec,
        bundle: Bundle,
        live: Live,
        loaded: Mapping[str, ServedModel],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.baked, self.live, self.clock = spec, bundle.manifest.baked, live, clock
        self.engine = engine = load_engine(live.config.engine.device, bundle, spec, live.config.engine.threads)
        baked = self.baked
        self.tasks: Mapping[str, Task] = {}
        state_inputs = {p.input for p in spec.state}
        state_outputs = {p.output for p in spec.state}
        self.inputs = [t for t in spec.inputs if t.name not in state_inputs]
        self.outputs = [t for t in spec.outputs if t.name not in state_outputs]
        batchable = all(t.shape and t.shape[0] < 0 for t in (*self.inputs, *self.outputs))
        self.max_batch_size = baked.max_batch if batchable else 0
        self.stateful = bool(spec.state)
        self.batcher = DynamicBatcher(engine, self.max_batch_size, spec.state)
        self.stats = self.batcher.stats
        # every call of a real graph is heavy: always on the engine thread, so requests gather meanwhile
        self.policy = QueuePolicy(spec.name, lambda: live.config.engine, self.stats)
        self.engine_loop = EngineLoop(self.batcher, self.policy, 1)
        self.state_rows = StateRows(spec) if self.stateful else None
        self.sequences: OwnedTable[Sequence] | NoSequences = (
            OwnedTable(lambda: live.config.sequences) if self.state_rows else NoSequences()
        )

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    def start(self) -> None:
        self.engine_loop.start()

    async def stop(self, timeout_s: float) -> bool:
        return await self.engine_loop.stop(timeout_s)

    def expire_idle(self) -> int:
        return self.sequences.expire(self.clock())

    async def probe(self) -> None:
        """One request of one row, zeros (empty strings), every free dimension 1."""
        feeds = {}
        for t in self.inputs:
            shape = tuple(1 if d < 0 else d for d in t.shape)
            feeds[t.name] = (
                np.full(shape, b"", object) if t.datatype == "BYTES" else np.zeros(shape, NUMPY_OF[t.datatype])
            )
        outputs = await self._run(feeds, self._new_sequence())
        for name, array in outputs.items():
            if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
                raise ApplianceError(f"model {self.name}: warm-up output {name} holds non-finite values")

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "onnxruntime_onnx",
            "inputs": [_tensor_metadata(t) for t in self.inputs],
            "outputs": [_tensor_metadata(t) for t in self.outputs],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "max_batch_size": self.max_batch_size,
                "stateful": self.stateful,
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec,
            self.baked,
            self.live,
            platform="onnxruntime_onnx",
            backend="onnxruntime",
            max_batch_size=self.max_batch_size,
            inputs=self.inputs,
            outputs=self.outputs,
            dynamic_batching=self.max_batch_size > 0,
            stateful=self.stateful,
        )

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        feeds = self._checked_feeds(request.inputs)
        if sequence is None:
            return await self._run(feeds, self._new_sequence(), times), None
        if self.state_rows is None or not isinstance(self.sequences, OwnedTable):
            raise BadRequest(f"model {self.name} is stateless: it takes no sequence_id")
        now = self.clock()
        if sequence.start:
            held = self.sequences.open(
                sequence.id, now, sequence.client, self.state_rows.new_sequence, sequence.address, sequence.principal
            )
        else:
            held = self.sequences.get(sequence.id, now, sequence.client)
        held.in_flight += 1
        try:
            outputs = await self._run(feeds, held, times)
        finally:
            held.in_flight -= 1
            if sequence.end:
                self.sequences.end(sequence.id)
        opened = Opened(self.name, sequence.id, held.serial) if sequence.start and not sequence.end else None
        return outputs, opened

    def _new_sequence(self) -> Sequence | None:
        """A one-off request to a stateful graph starts from the initial (zero) state."""
        return self.state_rows.new_sequence() if self.state_rows else None

    async def _run(
        self, feeds: dict[str, np.ndarray], sequence: Sequence | None, times: RequestTimes | None = None
    ) -> dict[str, np.ndarray]:
        future: asyncio.Future[Job] = asyncio.get_running_loop().create_future()

        def done(job: Job, error: BaseException | None) -> None:
            if future.done():  # the caller went away
                return
            if error is None:
                future.set_result(job)
            else:
                future.set_exception(error)

        rows = next(iter(feeds.values())).shape[0] if self.max_batch_size else 1
        job = Job(feeds, rows, done, sequence, times=times or RequestTimes())  # the batcher fills in `times`
        future.add_done_callback(lambda f: setattr(job, "cancelled", f.cancelled()))
        with self.engine_loop.admitted():
            self.engine_loop.submit(job)
            finished = await future
        return finished.outputs

    def _checked_feeds(self, given: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The request's inputs checked against the graph: names, datatypes, shapes, rows."""
        check_input_names(self.name, [t.name for t in self.inputs], given)
        feeds, rows = {}, set()
        for t in self.inputs:
            array = given[t.name]
            datatype = "BYTES" if array.dtype == object else DATATYPES_OF.get(array.dtype.str)
            if datatype != t.datatype:
                raise BadRequest(
                    f"inference input '{t.name}' data-type is '{datatype}', but model '{self.name}' expects '{t.datatype}'"
                )
            if array.ndim != len(t.shape) or any(d >= 0 and d != n for d, n in zip(t.shape, array.shape)):
                raise BadRequest(
                    f"unexpected shape for input '{t.name}' for model '{self.name}'. "
                    f"Expected {_dims(t.shape)}, got {_dims(array.shape)}"
                )
            if t.datatype == "BYTES":  # ONNX Runtime takes strings as str
                try:
                    array = np.vectorize(lambda b: b.decode(), otypes=[object])(array)
                except UnicodeDecodeError:
                    raise BadRequest(f"input {t.name}: a BYTES element is not valid UTF-8") from None
            feeds[t.name] = array
            rows.add(array.shape[0] if self.max_batch_size else 1)
        if self.max_batch_size:
            if len(rows) > 1:
                raise BadRequest(f"inputs of model {self.name} disagree on the batch size: {sorted(rows)}")
            (count,) = rows
            if count > self.max_batch_size:
                raise BadRequest(
                    f"inference request batch-size must be <= {self.max_batch_size} for '{self.name}' (got {count} rows)"
                )
            if count < 1:
                raise BadRequest(f"model {self.name}: a request carries at least one row, got 0")
            if self.stateful and count != 1:
                raise BadRequest(f"model {self.name} keeps state per sequence: a request carries one row, got {count}")
        check_named_dims(self.name, self.inputs, feeds)
        return feeds


def check_input_names(model: str, expected: list[str], given: Mapping[str, object]) -> None:
    """The request names exactly the model's inputs; Triton's texts where not (its clients match them)."""
    unknown = [name for name in given if name not in expected]
    if unknown:
        raise BadRequest(f"unexpected inference input '{unknown[0]}' for model '{model}'")
    missing = [name for name in expected if name not in given]
    if missing:
        raise BadRequest(
            f"expected {len(expected)} inputs but got {len(given)} inputs for model '{model}'. "
            f"Got input(s) {sorted(given)}, but missing required input(s) {missing}. Please provide all required input(s)."
        )


def check_named_dims(model: str, inputs: list[TensorSpec], feeds: Mapping[str, np.ndarray]) -> None:
    """Free dimensions the graph names alike take one size in a request: the engine would fail on them."""
    seen: dict[str, tuple[str, int]] = {}
    for tensor in inputs:
        for dim_name, size in zip(tensor.dim_names, feeds[tensor.name].shape):
            if not dim_name:
                continue
            first, first_size = seen.setdefault(dim_name, (tensor.name, size))
            if size != first_size:
                raise BadRequest(
                    f"inputs '{first}' and '{tensor.name}' of model '{model}' disagree on dimension "
                    f"'{dim_name}': {first_size} and {size}"
                )


def _dims(shape: tuple[int, ...] | list[int]) -> str:
    """Dimensions as Triton prints them: [-1,16]."""
    return "[" + ",".join(str(d) for d in shape) + "]"


DATATYPES_OF = {dtype.str: name for name, dtype in NUMPY_OF.items() if name != "BYTES"}


def _tensor_metadata(tensor: TensorSpec) -> dict[str, Any]:
    return {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape)}
