"""The VAD's codec: its KServe metadata and config, the `segments` route's query, and its answers as
plain values (sample positions in, seconds out). No model here: kinds/vad.py routes and runs."""

from __future__ import annotations

import math
from typing import Any

from appliance.config import VAD_MAX_MS, Live, VadConfig
from appliance.errors import BadRequest
from appliance.firmware import Baked, ModelSpec, TensorSpec
from appliance.kinds.audio_in import AUDIO_INPUT
from appliance.kinds.segments import SegmentParams
from appliance.kinds.streaming import query_flag
from appliance.kinds.triton_config import model_config

PROB_OUTPUT = "speech_prob"
SEGMENT_QUERY = ("threshold", "min_speech_ms", "min_silence_ms", "speech_pad_ms")  # the segments route's own
STREAM_CHUNK_FRAMES = 64  # streamed results: the engine reports each shard in pieces of ~2 s of audio


def metadata(spec: ModelSpec, baked: Baked, engine_name: str) -> dict[str, Any]:
    audio = spec.vad_audio
    return {
        "platform": "onnx",
        "inputs": [
            {
                "name": AUDIO_INPUT,
                "datatype": "FP32",
                "shape": [-1],
                "parameters": {"accepts": ["FP32", "INT16"], "sample_rate": audio.sample_rate},
            }
        ],
        "outputs": [{"name": PROB_OUTPUT, "datatype": "FP32", "shape": [-1]}],
        "parameters": {
            "kind": spec.kind,
            "engine": engine_name,
            "sample_rate": audio.sample_rate,
            "frame_samples": audio.frame_samples,
            "context_samples": audio.context_samples,
            "stateful": True,
            "baked": {
                "max_tokens_per_shard": baked.max_tokens_per_shard,
                "split_algorithm": baked.split_algorithm,
                "fallback_cpu_threshold": baked.fallback_cpu_threshold,
                "max_batch": baked.max_batch,
            },
            "graph": {
                "inputs": [t.name for t in spec.inputs],
                "outputs": [t.name for t in spec.outputs],
                "state": [{"input": p.input, "output": p.output} for p in spec.state],
            },
        },
    }


def config(spec: ModelSpec, baked: Baked, live: Live) -> dict[str, Any]:
    """Triton's model config: one stateful stream per request (its frames batched with other streams'
    frames by the sequence batcher), the recurrent state kept by the box."""
    return model_config(
        spec,
        baked,
        live,
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=0,
        inputs=[TensorSpec(AUDIO_INPUT, "FP32", (-1,))],
        outputs=[TensorSpec(PROB_OUTPUT, "FP32", (-1,))],
        dynamic_batching=False,
        stateful=True,
    )


def segments_query(query: dict[str, str], defaults: VadConfig) -> tuple[bool, SegmentParams]:
    """The segments route's query: `stream`, and its segment parameters over the config's defaults."""
    stream = query_flag(query, "stream")
    return stream, _segment_params(query, defaults)


def segment_json(start: int, end: int, rate: int) -> dict[str, float]:
    return {"start": seconds(start, rate), "end": seconds(end, rate)}


def seconds(samples: int, rate: int) -> float:
    return round(samples / rate, 3)


def _segment_params(query: dict[str, str], defaults: VadConfig) -> SegmentParams:
    """The query's segment parameters over the config's defaults, each range-checked."""
    unknown = sorted(k for k in query if k not in SEGMENT_QUERY)
    if unknown:
        raise BadRequest(f"unknown query parameter {_shown(unknown[0])} (known: stream, {', '.join(SEGMENT_QUERY)})")
    values: dict[str, Any] = {name: getattr(defaults, name) for name in SEGMENT_QUERY}
    for name, raw in query.items():
        values[name] = _threshold(raw) if name == "threshold" else _milliseconds(raw, name)
    return SegmentParams(**values)


def _threshold(raw: str) -> float:
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not 0.0 < value < 1.0:
        raise BadRequest(f"query parameter threshold: must be a number between 0 and 1, got {_shown(raw)}")
    return value


def _milliseconds(raw: str, name: str) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= len(str(VAD_MAX_MS)) and int(raw) <= VAD_MAX_MS):
        raise BadRequest(
            f"query parameter {name}: must be a whole number of milliseconds from 0 to {VAD_MAX_MS}, got {_shown(raw)}"
        )
    return int(raw)


def _shown(raw: str) -> str:
    """A query value as a one-line message shows it: its repr, cut short."""
    return repr(raw) if len(raw) <= 40 else repr(raw[:37]) + "..."
