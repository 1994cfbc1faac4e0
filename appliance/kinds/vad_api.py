"""The VAD's face in the API: its KServe tensors (audio in, speech probabilities out) and its own
route, `segments` (a recording in, speech segments out, streamed as NDJSON with ?stream=true)."""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from appliance.audio import decode_audio
from appliance.config import VAD_MAX_MS, VadConfig
from appliance.errors import ApiError, BadRequest
from appliance.firmware import TensorSpec
from appliance.kinds.segments import SegmentParams
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Request, Response, json_line, json_response
from appliance.protocol.tensors import InferRequest

if TYPE_CHECKING:
    from appliance.kinds.vad import VadModel

log = logging.getLogger("appliance.api")

AUDIO_INPUT, PROB_OUTPUT = "audio", "speech_prob"
SEGMENT_QUERY = ("threshold", "min_speech_ms", "min_silence_ms", "speech_pad_ms")  # the segments route's own
STREAM_CHUNK_FRAMES = 64  # streamed results: the engine reports each shard in pieces of ~2 s of audio


def metadata(model: VadModel) -> dict[str, Any]:
    spec, audio, baked = model.spec, model.spec.vad_audio, model.baked
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
            "engine": model.engine_name,
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


def config(model: VadModel) -> dict[str, Any]:
    """Triton's model config: one stateful stream per request (its frames batched with other streams'
    frames by the sequence batcher), the recurrent state kept by the box."""
    return model_config(
        model.spec,
        model.baked,
        model.live,
        platform="onnxruntime_onnx",
        backend="onnxruntime",
        max_batch_size=0,
        inputs=[TensorSpec(AUDIO_INPUT, "FP32", (-1,))],
        outputs=[TensorSpec(PROB_OUTPUT, "FP32", (-1,))],
        dynamic_batching=False,
        stateful=True,
    )


def audio_input(infer: InferRequest, model_name: str) -> np.ndarray:
    """The one audio tensor of an infer request, as float32 samples."""
    if set(infer.inputs) != {AUDIO_INPUT}:
        raise BadRequest(f"model {model_name} takes one input named {AUDIO_INPUT!r}, got {sorted(infer.inputs)}")
    array = infer.inputs[AUDIO_INPUT]
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise BadRequest(f"input {AUDIO_INPUT}: shape must be [samples] or [1, samples], got {list(array.shape)}")
    if array.dtype == np.float32:
        if not np.isfinite(array).all():  # one NaN would poison a stream's recurrent state for good
            raise BadRequest(f"input {AUDIO_INPUT}: samples must be finite numbers (no NaN or infinity)")
        return array
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    raise BadRequest(f"input {AUDIO_INPUT}: datatype must be FP32 or INT16")


async def segments_route(model: VadModel, request: Request, query: dict[str, str]) -> Response:
    stream = _flag(query.pop("stream", "false"), "stream")
    segment_params = _segment_params(query, model.live.config.vad)
    rate = model.frames.sample_rate
    # At most what the body limit holds in the model's own format (mono PCM16): a small compressed
    # body cannot make the daemon decode hours. Decoding runs off the event loop.
    max_seconds = model.live.config.server.max_body_bytes / (2 * rate)
    samples = await asyncio.to_thread(decode_audio, request.body, rate, max_seconds)
    seconds = lambda s: round(s / rate, 3)  # noqa: E731
    summary = {"model_name": model.name, "duration": seconds(len(samples))}
    if stream:
        log_fields = {"MODEL": model.name, "REQUEST_ID": request.headers.get("x-request-id", "-")}
        lines = _segment_lines(
            model.segments(samples, segment_params, STREAM_CHUNK_FRAMES), seconds, summary, log_fields
        )
        return Response(200, content_type="application/x-ndjson", stream=lines)
    found = [s async for s in model.segments(samples, segment_params)]
    return json_response(200, {**summary, "segments": [{"start": seconds(s), "end": seconds(e)} for s, e in found]})


async def _segment_lines(
    segments: AsyncIterator[tuple[int, int]],
    seconds: Callable[[int], float],
    summary: dict[str, Any],
    log_fields: dict[str, str],
) -> AsyncGenerator[bytes, None]:
    """NDJSON: a line per segment as soon as it is final, then the summary (or an error) line."""
    count = 0
    try:
        async for start, end in segments:
            count += 1
            yield json_line({"start": seconds(start), "end": seconds(end)})
    except ApiError as exc:
        yield json_line({"error": exc.message})
        return
    except Exception:
        log.exception("streamed segments crashed", extra=log_fields)
        yield json_line({"error": "internal error (logged)"})
        return
    yield json_line({**summary, "segments": count, "done": True})


def _flag(raw: str, name: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise BadRequest(f"query parameter {name}: {_shown(raw)} is not true or false")


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
