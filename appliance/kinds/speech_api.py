"""The speech_to_text kind's face in the API: KServe tensors (audio in, text out as BYTES), its own
`transcribe` route (a recording in, segments out, NDJSON as they are ready with ?stream=true), and
the table of its live streams.

KServe infer: input `audio` is FP32 or INT16 samples at 16 kHz, or BYTES holding one encoded file
(WAV, FLAC, Ogg); parameters `language`, `task` (transcribe | translate), `prompt`, `temperature`.
Outputs: `text` (BYTES, one element per segment), `start` and `end` (FP32 seconds). Under Triton's
sequence parameters each 256 ms chunk answers the segments the VAD closed since the previous chunk
(final text), and with parameter `partial` true also `partial` (BYTES [1]): the open segment so far.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from appliance.audio import decode_audio
from appliance.engine.stats import RequestTimes
from appliance.engine.whisper import SAMPLE_RATE
from appliance.errors import ApiError, BadRequest, NotFound, TooManyRequests
from appliance.firmware import TensorSpec
from appliance.kinds.base import SequenceCall
from appliance.kinds.segments import SegmentTracker
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened, Request, Response, json_line, json_response
from appliance.protocol.tensors import InferRequest

if TYPE_CHECKING:
    from appliance.kinds.speech_to_text import SpeechToText

log = logging.getLogger("appliance.api")

AUDIO_INPUT = "audio"
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")  # OpenAI's response formats
MIN_SAMPLES = 512  # one VAD frame, 32 ms: anything shorter holds no speech to find
OUTPUTS = ("text", "start", "end")
PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "language": str,
    "task": str,
    "prompt": str,
    "temperature": (int, float),
    "partial": bool,
}


@dataclass(frozen=True, slots=True)
class Options:
    """How a request wants its audio decoded."""

    language: str | None = None
    task: str = "transcribe"
    prompt: str = ""
    temperature: float = 0.0


@dataclass(frozen=True, slots=True)
class Segment:
    start: float  # seconds in the recording
    end: float
    text: str
    language: str


@dataclass(slots=True, eq=False)
class LiveStream:
    """A live sequence: its VAD's segment tracker and the audio not yet decoded."""

    options: Options
    tracker: SegmentTracker
    client: str
    serial: int
    audio: list[np.ndarray] = field(default_factory=list)
    base: int = 0  # sample position of audio[0]'s first sample
    position: int = 0  # samples received
    last_used: float = 0.0
    in_flight: int = 0


def metadata(model: SpeechToText) -> dict[str, Any]:
    params = model.spec.parameters
    return {
        "platform": "ctranslate2",
        "inputs": [
            {
                "name": AUDIO_INPUT,
                "datatype": "FP32",
                "shape": [-1],
                "parameters": {"accepts": ["FP32", "INT16", "BYTES"], "sample_rate": SAMPLE_RATE},
            }
        ],
        "outputs": [
            {"name": "text", "datatype": "BYTES", "shape": [-1]},
            {"name": "start", "datatype": "FP32", "shape": [-1]},
            {"name": "end", "datatype": "FP32", "shape": [-1]},
            {"name": "partial", "datatype": "BYTES", "shape": [1]},
        ],
        "parameters": {
            "kind": model.spec.kind,
            "engine": model.engine_name,
            "sample_rate": SAMPLE_RATE,
            "multilingual": model.engine.tokens.multilingual,
            "tasks": ["transcribe", "translate"] if model.engine.tokens.multilingual else ["transcribe"],
            "stateful": True,
            "parameters": dict(params),
        },
    }


def config(model: SpeechToText) -> dict[str, Any]:
    """Triton's model config: shards of all requests batched up to max_batch, live streams as sequences."""
    return model_config(
        model.spec,
        model.baked,
        model.live,
        platform="ctranslate2",
        backend="ctranslate2",
        max_batch_size=0,  # a request is a recording, not a row: the shards inside are what batch
        inputs=[TensorSpec(AUDIO_INPUT, "FP32", (-1,))],
        outputs=[
            TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("start", "FP32", (-1,)),
            TensorSpec("end", "FP32", (-1,)),
        ],
        dynamic_batching=True,
        stateful=True,  # live streams: the box keeps their VAD state and the audio not yet decoded
    )


def options(parameters: dict[str, Any]) -> Options:
    """A request's decoding options from KServe parameters or an OpenAI form (same names)."""
    for name, value in parameters.items():
        kind = PARAMETERS.get(name)
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            raise BadRequest(f"parameters.{name} has the wrong type: {type(value).__name__}")
    language = parameters.get("language") or None
    return Options(
        language=language.lower() if language else None,
        task=parameters.get("task", "transcribe"),
        prompt=parameters.get("prompt", ""),
        temperature=float(parameters.get("temperature", 0.0)),
    )


def audio_input(infer: InferRequest, model: SpeechToText) -> np.ndarray:
    if set(infer.inputs) != {AUDIO_INPUT}:
        raise BadRequest(f"model {model.name} takes one input named {AUDIO_INPUT!r}, got {sorted(infer.inputs)}")
    array = infer.inputs[AUDIO_INPUT]
    if array.dtype == object:
        if array.size != 1:
            raise BadRequest(f"input {AUDIO_INPUT}: a BYTES input holds one encoded file, got {array.size} elements")
        return decode_recording(bytes(array.reshape(-1)[0]), model)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise BadRequest(f"input {AUDIO_INPUT}: shape must be [samples] or [1, samples], got {list(array.shape)}")
    if array.dtype == np.float32:
        if not np.isfinite(array).all():
            raise BadRequest(f"input {AUDIO_INPUT}: samples must be finite numbers (no NaN or infinity)")
        return array
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    raise BadRequest(f"input {AUDIO_INPUT}: datatype must be FP32, INT16 or BYTES")


def decode_recording(body: bytes, model: SpeechToText) -> np.ndarray:
    """An uploaded recording as 16 kHz samples (decode_audio), at least MIN_SAMPLES long."""
    return long_enough(decode_audio(body, SAMPLE_RATE, max_seconds(model)))


def long_enough(samples: np.ndarray) -> np.ndarray:
    if len(samples) < MIN_SAMPLES:
        raise BadRequest(
            f"audio too short: {len(samples)} samples at 16 kHz; at least {MIN_SAMPLES} ({MIN_SAMPLES // 16} ms)"
        )
    return samples


def max_seconds(model: SpeechToText) -> float:
    """At most what the body limit holds as mono PCM16: a small compressed body cannot make the daemon decode hours."""
    return model.live.config.server.max_body_bytes / (2 * SAMPLE_RATE)


def tensors(segments: list[Segment]) -> dict[str, np.ndarray]:
    return {
        "text": np.array([s.text.encode() for s in segments], dtype=object),
        "start": np.array([s.start for s in segments], np.float32),
        "end": np.array([s.end for s in segments], np.float32),
    }


async def infer(
    model: SpeechToText, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
) -> tuple[dict[str, np.ndarray], Opened | None]:
    wanted = options(request.parameters)
    if sequence is None:
        samples = long_enough(await asyncio.to_thread(audio_input, request, model))
        return tensors([s async for s in model.transcribe(samples, wanted, times)]), None
    samples = audio_input(request, model)
    partial = request.parameters.get("partial", False)
    final, text, serial = await model.live_chunk(samples, sequence, partial, wanted, times)
    outputs = tensors(final)
    if text is not None:
        outputs["partial"] = np.array([text.encode()], dtype=object)
    opened = Opened(model.name, sequence.id, serial) if serial is not None and not sequence.end else None
    return outputs, opened


async def transcribe_route(model: SpeechToText, request: Request, query: dict[str, str]) -> Response:
    """POST /v2/models/{name}/transcribe[?stream=true&language=&task=&prompt=&response_format=]: a
    recording's segments (verbose_json unless asked otherwise), or NDJSON lines as they are decoded."""
    stream = query.pop("stream", "false").lower() in ("1", "true", "yes")
    response_format = query.pop("response_format", "verbose_json")
    if response_format not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}, got {response_format[:40]!r}")
    unknown = sorted(set(query) - {"language", "task", "prompt"})
    if unknown:
        raise BadRequest(
            f"unknown query parameter {unknown[0]!r} (known: stream, language, task, prompt, response_format)"
        )
    wanted = options(dict(query))
    model.check(wanted)
    samples = await asyncio.to_thread(decode_recording, request.body, model)
    segments = model.transcribe(samples, wanted)
    duration = round(len(samples) / SAMPLE_RATE, 3)
    if stream:
        return Response(200, content_type="application/x-ndjson", stream=_lines(segments, model.name, duration))
    return render([s async for s in segments], response_format, wanted.task, duration)


def render(segments: list[Segment], response_format: str, task: str, duration: float) -> Response:
    doc = as_json(segments)
    if response_format == "json":
        return json_response(200, {"text": doc["text"]})
    if response_format == "text":
        return Response(200, (doc["text"] + "\n").encode(), content_type="text/plain; charset=utf-8")
    if response_format == "verbose_json":
        rows = [
            {"id": i, "seek": 0, "start": s.start, "end": s.end, "text": s.text, "tokens": [], "temperature": 0.0}
            for i, s in enumerate(segments)
        ]
        verbose = {"task": task, "language": doc["language"], "duration": round(duration, 3), "text": doc["text"]}
        return json_response(200, {**verbose, "segments": rows})
    return Response(200, subtitles(segments, response_format).encode(), content_type="text/plain; charset=utf-8")


def subtitles(segments: list[Segment], response_format: str) -> str:
    """SRT (numbered cues, comma decimals) or WebVTT (a header, dot decimals)."""
    comma = response_format == "srt"

    def clock(seconds: float) -> str:
        ms = round(seconds * 1000)
        text = f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"
        return text.replace(".", ",") if comma else text

    cues = [f"{clock(s.start)} --> {clock(s.end)}\n{s.text}\n" for s in segments]
    if comma:
        return "\n".join(f"{i}\n{cue}" for i, cue in enumerate(cues, 1))
    return "WEBVTT\n\n" + "\n".join(cues)


def as_json(segments: list[Segment]) -> dict[str, Any]:
    return {
        "language": segments[0].language if segments else "",
        "text": " ".join(s.text for s in segments),
        "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in segments],
    }


async def _lines(segments: AsyncIterator[Segment], model: str, duration: float) -> AsyncGenerator[bytes, None]:
    """NDJSON: a line per segment as soon as it is decoded, then a summary (or an error) line."""
    count = 0
    try:
        async for s in segments:
            count += 1
            yield json_line({"start": s.start, "end": s.end, "text": s.text, "language": s.language})
    except ApiError as exc:
        yield json_line({"error": exc.message})
        return
    except Exception:
        log.exception("streamed transcription crashed", extra={"MODEL": model})
        yield json_line({"error": "internal error (logged)"})
        return
    yield json_line({"model_name": model, "duration": duration, "segments": count, "done": True})


class LiveTable:
    """The model's live streams by sequence id, bounded and expired as the config's [sequences] says;
    each also holds a sequence of the VAD under its own key."""

    def __init__(self, model: SpeechToText) -> None:
        self.model = model
        self._live: dict[object, LiveStream] = {}
        self._per_client: Counter[str] = Counter()
        self._serials = 0

    def __len__(self) -> int:
        return len(self._live)

    def vad_key(self, key: object, stream: LiveStream) -> object:
        return (self.model.name, key, stream.serial)

    def start(self, key: object, now: float, client: str, wanted: Options) -> LiveStream:
        settings = self.model.live.config.sequences
        if (old := self._live.get(key)) is not None:
            self._owner(key, old, client)
            if old.in_flight:
                raise ApiError(f"sequence {key} has a request in flight; it cannot restart until that finishes", 409)
            self._drop(key)
        if len(self._live) >= settings.max_live or self._per_client[client] >= settings.max_per_client:
            self.expire(now)
        if len(self._live) >= settings.max_live:
            raise TooManyRequests(f"sequence table full ({settings.max_live} live streams): end one or retry later")
        if self._per_client[client] >= settings.max_per_client:
            raise TooManyRequests(f"this client holds {settings.max_per_client} live streams, its share: end one")
        vad = self.model.vad
        tracker = SegmentTracker(vad.frames.frame_samples, vad.frames.sample_rate, self.model.live.config.vad)
        self._serials += 1
        stream = LiveStream(wanted, tracker, client, self._serials, last_used=now)
        self._live[key] = stream
        self._per_client[client] += 1
        return stream

    def get(self, key: object, now: float, client: str) -> LiveStream:
        stream = self._live.get(key)
        if stream is None:
            raise BadRequest(f"sequence {key} is not open (never started, ended, or expired): send sequence_start=true")
        self._owner(key, stream, client)
        stream.last_used = now
        return stream

    def end(self, key: object) -> None:
        if key in self._live:
            self._drop(key)

    def holds(self, key: object, serial: int) -> bool:
        stream = self._live.get(key)
        return stream is not None and stream.serial == serial

    def end_opened(self, key: object, serial: int) -> bool:
        if not self.holds(key, serial):
            return False
        self._drop(key)
        return True

    def streaming(self, now: float, within_s: float) -> int:
        return sum(1 for s in self._live.values() if s.in_flight or now - s.last_used <= within_s)

    def expire(self, now: float) -> int:
        timeout = self.model.live.config.sequences.idle_timeout_s
        idle = [k for k, s in self._live.items() if not s.in_flight and now - s.last_used > timeout]
        for key in idle:
            self._drop(key)
        return len(idle)

    @staticmethod
    def _owner(key: object, stream: LiveStream, client: str) -> None:
        if stream.client != client:
            raise NotFound(f"sequence {key} belongs to another client")

    def _drop(self, key: object) -> None:
        stream = self._live.pop(key)
        self.model.vad.sequences.end(self.vad_key(key, stream))
        self._per_client[stream.client] -= 1
        if not self._per_client[stream.client]:
            del self._per_client[stream.client]
