"""The API core: a request in, a response out. No sockets here; every transport calls `Api.handle`.

Routes (KServe v2 / Open Inference Protocol, plus the voice task and Prometheus metrics):

    GET  /v2                              server metadata (firmware included)
    GET  /v2/health/live | /v2/health/ready
    GET  /v2/models                       the models this firmware serves
    GET  /v2/models/{name}[/versions/{v}] model metadata, baked parameters included
    GET  /v2/models/{name}[/versions/{v}]/ready
    POST /v2/models/{name}[/versions/{v}]/infer      JSON or binary tensors; Triton sequence parameters
    POST /v2/models/{name}[/versions/{v}]/segments   a recording in (WAV, FLAC, Ogg), speech segments out
                                          (?stream=true: one JSON line per segment as soon as it is final)
    GET  /metrics
    GET  /status                          firmware, engines, QUIC peers from the connection cache
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import numpy as np

from appliance import __version__
from appliance.api import metrics as prometheus
from appliance.api.peers import PeerTable
from appliance.api.tensors import HEADER_LENGTH, InferRequest, decode_infer, encode_infer
from appliance.audio import decode_audio
from appliance.config import Live, VadConfig
from appliance.errors import ApiError, BadRequest, NotFound, Unavailable
from appliance.firmware import Manifest
from appliance.segments import SegmentParams
from appliance.vad import VadModel

log = logging.getLogger("appliance.api")

AUDIO_INPUT, PROB_OUTPUT = "audio", "speech_prob"
STREAM_CHUNK_FRAMES = 64  # streamed results: the engine reports each shard in pieces of ~2 s of audio
EXTENSIONS = ["binary_tensor_data", "sequence", "model_repository_index", "segments", "metrics"]


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    body: bytes = b""
    peer: str = ""  # the LAN client's address and port (QUIC); empty on the Unix socket


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: AsyncGenerator[bytes, None] | None = None  # set: the body is sent piece by piece as produced, `body` unused


def json_response(status: int, doc: Any) -> Response:
    return Response(status, json.dumps(doc, separators=(",", ":")).encode())


def error_response(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


class Api:
    def __init__(self, manifest: Manifest, models: dict[str, VadModel], live: Live) -> None:
        self.manifest, self.models, self.live = manifest, models, live
        self.metrics = prometheus.Metrics()
        self.ready = False
        self.draining = False  # shutting down: accepted requests and open sequences finish, no new sequence starts
        self.peer_table: PeerTable | None = None  # the QUIC listener's peers, where QUIC serves
        model = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        self._routes: list[tuple[str, re.Pattern[str], str, Handler]] = [
            ("GET", re.compile(r"/v2/?"), "server", self._server),
            ("GET", re.compile(r"/v2/health/live"), "live", self._live),
            ("GET", re.compile(r"/v2/health/ready"), "ready", self._ready),
            ("GET", re.compile(r"/v2/models/?"), "models", self._list_models),
            ("GET", re.compile(model), "model", self._model_metadata),
            ("GET", re.compile(model + "/ready"), "model_ready", self._model_ready),
            ("POST", re.compile(model + "/infer"), "infer", self._infer),
            ("POST", re.compile(model + "/segments"), "segments", self._segments),
            ("GET", re.compile(r"/metrics"), "metrics", self._metrics),
            ("GET", re.compile(r"/status"), "status", self._status),
        ]

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        url = urlsplit(request.target)
        endpoint, params = "unknown", {}
        response: Response
        try:
            for method, pattern, name, handler in self._routes:
                match = pattern.fullmatch(url.path)
                if match:
                    endpoint = name
                    if request.method != method:
                        raise ApiError(f"{request.method} is not allowed on {url.path} (use {method})", 405)
                    params = {k: v for k, v in match.groupdict().items() if v is not None}
                    if url.query:
                        params.update({f"query:{k}": v for k, v in parse_qsl(url.query)})
                    response = await handler(request, params)
                    break
            else:
                raise NotFound(f"no route for {url.path}")
        except ApiError as exc:
            response = error_response(exc.status, exc.message)
        except Exception:
            log.exception("request %s %s crashed", request.method, url.path, extra=self._log_fields(request, params))
            response = error_response(500, "internal error (logged)")
        if response.status >= 400:  # the client's mistakes at debug level; ours are errors
            log.log(
                logging.ERROR if response.status >= 500 else logging.DEBUG,
                "%s %s: %d %s",
                request.method,
                url.path,
                response.status,
                response.body[:200].decode("utf-8", "replace"),
                extra=self._log_fields(request, params),
            )
        self.metrics.observe_request(endpoint, response.status, time.perf_counter() - started)
        return response

    @staticmethod
    def _log_fields(request: Request, params: dict[str, str]) -> dict[str, str]:
        """Structured journal fields: which model, which request (the caller's x-request-id)."""
        return {"MODEL": params.get("model", "-"), "REQUEST_ID": request.headers.get("x-request-id", "-")}

    def sequence_owners(self) -> set[str]:
        return set().union(*(m.sequences.owners() for m in self.models.values()))

    def release_peer(self, peer: str) -> int:
        """A QUIC peer is gone (idle or evicted from the connection cache): end its sequences."""
        return sum(m.sequences.release_owner(peer) for m in self.models.values())

    def keep_connections(self) -> bool:
        """While draining, a connection stays open only as long as some sequence may still stream on it."""
        return not self.draining or any(len(m.sequences) for m in self.models.values())

    # --- metadata and health ----------------------------------------------------------------------

    def firmware_info(self) -> dict[str, Any]:
        m = self.manifest
        return {"name": m.name, "version": m.version, "built_at": m.built_at, "signing_key_id": m.signing_key_id}

    async def _server(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(
            200,
            {"name": "appliance", "version": __version__, "extensions": EXTENSIONS, "firmware": self.firmware_info()},
        )

    async def _live(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(200, {"live": True})

    async def _ready(self, request: Request, params: dict[str, str]) -> Response:
        if not self.ready:
            return error_response(503, "not ready (starting or shutting down)")
        return json_response(200, {"ready": True})

    async def _list_models(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(
            200,
            {
                "models": [
                    {
                        "name": m.name,
                        "version": self.manifest.version,
                        "state": "READY" if self.ready else "UNAVAILABLE",
                        "engine": m.engine_name,
                        "kind": m.spec.kind,
                    }
                    for m in self.models.values()
                ]
            },
        )

    def _model(self, params: dict[str, str]) -> VadModel:
        model = self.models.get(params["model"])
        if model is None:
            raise NotFound(f"unknown model {params['model']!r} (this firmware serves: {', '.join(self.models)})")
        version = params.get("version")
        if version is not None and version != self.manifest.version:
            raise NotFound(f"model {model.name} has no version {version!r} (serving {self.manifest.version})")
        return model

    async def _model_metadata(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        spec, audio = model.spec, model.spec.audio
        return json_response(
            200,
            {
                "name": model.name,
                "versions": [self.manifest.version],
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
                        "max_tokens_per_shard": model.baked.max_tokens_per_shard,
                        "split_algorithm": model.baked.split_algorithm,
                        "fallback_cpu_threshold": model.baked.fallback_cpu_threshold,
                        "max_batch": model.baked.max_batch,
                    },
                    "firmware": self.firmware_info(),
                    "graph": {
                        "inputs": [t.name for t in spec.inputs],
                        "outputs": [t.name for t in spec.outputs],
                        "state": [{"input": p.input, "output": p.output} for p in spec.state],
                    },
                },
            },
        )

    async def _model_ready(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        if not self.ready:
            return error_response(503, f"model {model.name} is not ready")
        return json_response(200, {"name": model.name, "ready": True})

    async def _metrics(self, request: Request, params: dict[str, str]) -> Response:
        text = prometheus.render(self.metrics, self.models.values(), self.peer_table)
        return Response(200, text.encode(), "text/plain; version=0.0.4")

    async def _status(self, request: Request, params: dict[str, str]) -> Response:
        """What `appliance status` shows: firmware, engines, sequences, and the QUIC peers."""
        cache = self.peer_table
        now = time.monotonic()
        return json_response(
            200,
            {
                "firmware": self.firmware_info(),
                "ready": self.ready,
                "models": [
                    {"name": m.name, "engine": m.engine_name, "live_sequences": len(m.sequences)}
                    for m in self.models.values()
                ],
                "conncache": None
                if cache is None
                else {
                    "backend": cache.backend,
                    "reason": cache.reason,
                    "totals": dataclasses.asdict(cache.totals()),
                    "peers": sorted((p.as_dict(now) for p in cache.peers().values()), key=lambda p: p["peer"]),
                },
            },
        )

    # --- inference ----------------------------------------------------------------------------------

    async def _infer(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        infer = decode_infer(request.body, request.headers.get(HEADER_LENGTH))
        samples = _audio_input(infer, model)
        sequence = _sequence_parameters(infer.parameters)
        if self.draining and sequence is not None and sequence[1]:
            raise Unavailable("shutting down: no new sequences; open ones may finish")
        if sequence is None:
            probs = await model.infer_recording(samples)
            out_params: dict[str, Any] = {}
        else:
            sequence_id, start, end = sequence
            probs = await model.infer_stream(samples, sequence_id, start, end, owner=request.peer)
            out_params = {"sequence_id": sequence_id, "sequence_start": start, "sequence_end": end}
        body, header_length = encode_infer(model.name, self.manifest.version, infer, {PROB_OUTPUT: probs}, out_params)
        if header_length is None:
            return Response(200, body)
        return Response(
            200, body, "application/octet-stream", [("Inference-Header-Content-Length", str(header_length))]
        )

    async def _segments(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        stream = _flag(params.pop("query:stream", "false"), "stream")
        segment_params = _segment_params(params, self.live.config.vad)
        rate = model.frames.sample_rate
        # At most what the body limit holds in the model's own format (mono PCM16): a small compressed
        # body cannot make the daemon decode hours. Decoding runs off the event loop.
        max_seconds = self.live.config.server.max_body_bytes / (2 * rate)
        samples = await asyncio.to_thread(decode_audio, request.body, rate, max_seconds)
        seconds = lambda s: round(s / rate, 3)  # noqa: E731
        summary = {"model_name": model.name, "duration": seconds(len(samples))}
        if stream:
            return Response(
                200,
                content_type="application/x-ndjson",
                stream=self._segment_lines(
                    model.segments(samples, segment_params, STREAM_CHUNK_FRAMES),
                    seconds,
                    summary,
                    self._log_fields(request, params),
                ),
            )
        segments = [s async for s in model.segments(samples, segment_params)]
        return json_response(
            200, {**summary, "segments": [{"start": seconds(s), "end": seconds(e)} for s, e in segments]}
        )

    async def _segment_lines(
        self,
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
                yield _json_line({"start": seconds(start), "end": seconds(end)})
        except ApiError as exc:
            yield _json_line({"error": exc.message})
            return
        except Exception:
            log.exception("streamed segments crashed", extra=log_fields)
            yield _json_line({"error": "internal error (logged)"})
            return
        yield _json_line({**summary, "segments": count, "done": True})


def _json_line(doc: Any) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"


def _flag(raw: str, name: str) -> bool:
    if raw.lower() in ("1", "true", "yes"):
        return True
    if raw.lower() in ("0", "false", "no"):
        return False
    raise BadRequest(f"query parameter {name}: {raw!r} is not true or false")


def _audio_input(infer: InferRequest, model: VadModel) -> np.ndarray:
    if set(infer.inputs) != {AUDIO_INPUT}:
        raise BadRequest(f"model {model.name} takes one input named {AUDIO_INPUT!r}, got {sorted(infer.inputs)}")
    array = infer.inputs[AUDIO_INPUT]
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise BadRequest(f"input {AUDIO_INPUT}: shape must be [samples] or [1, samples], got {list(array.shape)}")
    if array.dtype == np.float32:
        return array
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    raise BadRequest(f"input {AUDIO_INPUT}: datatype must be FP32 or INT16")


def _sequence_parameters(parameters: dict[str, Any]) -> tuple[object, bool, bool] | None:
    """Triton's sequence parameters: (id, start, end), or None for a one-off request."""
    sequence_id = parameters.get("sequence_id")
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    if not isinstance(start, bool) or not isinstance(end, bool):
        raise BadRequest("sequence_start and sequence_end must be booleans")
    if sequence_id is None or sequence_id == 0:
        if start or end:
            raise BadRequest("sequence_start/sequence_end need a non-zero sequence_id")
        return None
    if isinstance(sequence_id, bool) or not isinstance(sequence_id, (int, str)):
        raise BadRequest("sequence_id must be an integer or a string")
    return sequence_id, start, end


def _segment_params(params: dict[str, str], defaults: VadConfig) -> SegmentParams:
    values: dict[str, Any] = {}
    for name, kind in (("threshold", float), ("min_speech_ms", int), ("min_silence_ms", int), ("speech_pad_ms", int)):
        raw = params.get(f"query:{name}")
        try:
            values[name] = kind(raw) if raw is not None else getattr(defaults, name)
        except ValueError:
            raise BadRequest(f"query parameter {name}: {raw!r} is not a {kind.__name__}") from None
    if not 0.0 < values["threshold"] < 1.0:
        raise BadRequest("query parameter threshold: must be between 0 and 1")
    unknown = sorted(k[6:] for k in params if k.startswith("query:") and k[6:] not in values)
    if unknown:
        raise BadRequest(f"unknown query parameter {unknown[0]!r}")
    return SegmentParams(**values)
