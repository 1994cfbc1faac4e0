"""A model's configuration in Triton's JSON shape (what `GET /v2/models/{m}/config` answers): one function
every kind calls with what it knows, so the shape is written once."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from appliance.config import Live
from appliance.engine.queue_policy import triton_queue_policy
from appliance.firmware import Baked, ModelSpec, TensorSpec


def tensor_config(tensor: TensorSpec, batched: bool) -> dict[str, Any]:
    """Triton's tensor entry: TYPE_ datatypes, dims without the batch axis where the model batches."""
    dims = list(tensor.shape[1:] if batched else tensor.shape)
    return {
        "name": tensor.name,
        "data_type": f"TYPE_{'STRING' if tensor.datatype == 'BYTES' else tensor.datatype}",
        "dims": dims,
    }


def model_config(
    spec: ModelSpec,
    baked: Baked,
    live: Live,
    *,
    platform: str,
    backend: str,
    max_batch_size: int,
    inputs: Iterable[TensorSpec],
    outputs: Iterable[TensorSpec],
    dynamic_batching: bool,
    stateful: bool,
) -> dict[str, Any]:
    batched = max_batch_size > 0
    config: dict[str, Any] = {
        "name": spec.name,
        "platform": platform,
        "backend": backend,
        "max_batch_size": max_batch_size,
        "input": [tensor_config(t, batched) for t in inputs],
        "output": [tensor_config(t, batched) for t in outputs],
        "instance_group": [{"name": spec.name, "kind": "KIND_CPU", "count": 1}],
        # the baked shard parameters and the kind's own, as Triton's string-valued parameters
        "parameters": {
            key: {"string_value": str(value)} for key, value in {**asdict(baked), **spec.parameters}.items()
        },
    }
    if dynamic_batching:
        config["dynamic_batching"] = {
            "preferred_batch_size": [],
            "max_queue_delay_microseconds": live.config.engine.queue_delay_us,
            "default_queue_policy": triton_queue_policy(live.config.engine, spec.name),
        }
    if stateful:
        declared = {t.name: t for t in spec.inputs}
        config["sequence_batching"] = {
            "max_sequence_idle_microseconds": int(live.config.sequences.idle_timeout_s * 1e6),
            "state": [
                {
                    "input_name": pair.input,
                    "output_name": pair.output,
                    "data_type": tensor_config(declared[pair.input], False)["data_type"],
                    "dims": [d for axis, d in enumerate(declared[pair.input].shape) if axis != pair.batch_axis],
                    "initial_state": [],  # zeros, as Triton starts a state without initial_state
                }
                for pair in spec.state
            ],
        }
    return config
