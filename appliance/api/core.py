"""The API core: a request in, a response out. No sockets here; every transport calls `Api.handle`.

Routes (KServe v2 / Open Inference Protocol, plus the voice task and Prometheus metrics):

    GET  /v2                              server metadata (firmware included)
    GET  /v2/health/live | /v2/health/ready
    GET  /v2/models                       the models this firmware serves
    GET  /v2/models/{name}[/versions/{v}] model metadata, baked parameters included
    GET  /v2/models/{name}[/versions/{v}]/ready
    GET  /v2/models/{name}[/versions/{v}]/config     Triton's model configuration, as JSON
    GET  /v2/models[/{name}[/versions/{v}]]/stats    Triton's statistics extension
    POST /v2/models/{name}[/versions/{v}]/infer      JSON or binary tensors; Triton sequence parameters
    POST /v2/models/{name}[/versions/{v}]/{task}     a route of the model's kind (the VAD's `segments`:
                                          a recording in, speech segments out; see kinds/vad_api.py)
    POST /v2/repository/index             Triton's model repository index: what this firmware serves
    POST /v2/repository/models/{name}/load | unload   refused: the signed firmware decides what is served
    GET  /v1/realtime                     a WebSocket: OpenAI's Realtime API, transcription (api/realtime.py)
    GET  /metrics
    GET  /v2/fleet | POST /v2/fleet/drain   the box in a fleet: its agent's answer; a drain (api/fleet_routes.py)
    GET  /v1/models[/{id}]                OpenAI's model list (api/openai_models.py)
    GET  /status                          firmware, engines, QUIC peers from the connection cache, TLS
    GET  / and /page/{file}               the box's own page (api/page.py); /tls/certificate.pem
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import re
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any
from urllib.parse import parse_qsl, urlsplit

from appliance import __version__
from appliance.api import (
    fleet_routes,
    infer,
    libretranslate,
    openai_audio,
    openai_models,
    openai_speech,
    page,
    realtime,
    repository,
)
from appliance.api import metrics as prometheus
from appliance.api.access import rooms
from appliance.api.access.gate import Access
from appliance.api.operator import OPERATOR_ROUTES, OPERATORS_ARE, status_document
from appliance.api.routes import Route
from appliance.config import Live
from appliance.errors import ApiError, NotFound
from appliance.firmware import Manifest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Interpreting
from appliance.protocol.encoding import accepted_coding, compress
from appliance.protocol.limits import ByteBudget
from appliance.protocol.messages import Opened, Request, Response, error_response, json_response
from appliance.protocol.peers import PeerTable, reading
from appliance.tasks import off_loop

log = logging.getLogger("appliance.api")
STREAMING_S = 1.0  # a sequence that had a request this recently is streaming (a stop waits for it)
COMPRESSED_ENDPOINTS = ("infer", "metrics")

# Triton's names for the protocol extensions served here (`segments` and `metrics` are routes of ours)
EXTENSIONS = [
    "binary_tensor_data",
    "sequence",
    "model_repository",
    "model_configuration",
    "statistics",
    "segments",
    "metrics",
]


class Api:
    def __init__(
        self, manifest: Manifest, models: dict[str, ServedModel], live: Live, budget: ByteBudget | None = None
    ) -> None:
        """`budget`: the bytes the daemon holds for its clients (the transports' BodyBudget), which
        Realtime's manual audio buffers take from too; None: unbounded (an API without transports)."""
        self.manifest, self.models, self.live, self.budget = manifest, models, live, budget
        self.metrics = prometheus.Metrics()
        self.access = Access(live, self.metrics)  # who may use the box (api/access/gate.py)
        self._readiness = self.started = False  # started: it has been ready (the stop ends readiness, not this)
        self.stopping = asyncio.Event()  # set when the daemon begins its stop: idle sessions close
        self.fleet = fleet_routes.Fleet(
            manifest, models, live, lambda: self.ready
        )  # drains, the agent's answer, readiness
        self.peer_table: PeerTable | None = None  # the QUIC listener's peers, where QUIC serves
        self.workers: Callable[[], list[dict[str, Any]]] | None = None  # the protocol workers, where there are
        self.quic: dict[str, Any] | None = None  # where QUIC serves: how many workers read its port, and why
        self.tls: dict[str, Any] | None = None  # where QUIC or HTTPS serves: the certificate and its fingerprint
        self.certificate_pem = b""  # the box's certificate, for clients to trust (GET /tls/certificate.pem)
        model = r"/v2/models/(?P<model>[^/]+)(?:/versions/(?P<version>[^/]+))?"
        self._routes: list[Route] = [
            ("GET", re.compile(r"/v2/?"), "server", self._server),
            ("GET", re.compile(r"/v2/health/live"), "live", self._live),
            ("GET", re.compile(r"/v2/health/ready"), "ready", self._ready),
            ("GET", re.compile(r"/v2/models/?"), "models", self._list_models),
            ("GET", re.compile(r"/v2/models/stats"), "stats", self._stats),
            ("GET", re.compile(model), "model", self._model_metadata),
            ("GET", re.compile(model + "/ready"), "model_ready", self._model_ready),
            ("GET", re.compile(model + "/config"), "model_config", self._model_config),
            ("GET", re.compile(model + "/stats"), "stats", self._stats),
            ("POST", re.compile(model + "/infer"), "infer", self._infer),
            ("POST", re.compile(model + r"/(?P<task>[a-z_]+)"), "task", self._task),
            ("POST", re.compile(r"/v2/repository/index"), "repository_index", self._repository_index),
            (
                "POST",
                re.compile(r"/v2/repository/models/(?P<model>[^/]+)/(?P<action>load|unload)"),
                "repository_control",
                self._repository_control,
            ),
            ("GET", re.compile(r"/metrics"), "metrics", self._metrics),
            ("GET", re.compile(r"/status"), "status", self._status),
            *openai_speech.routes(models),
            *libretranslate.routes(models, lambda: bool(self.access.keys), self.access.needs_key),
            *openai_audio.routes(models),
            *openai_models.routes(models, manifest),
            *realtime.routes(models, self.metrics, live, budget, self.stopping),
            *page.routes(lambda: self.certificate_pem),
            *rooms.routes(self.access.rooms, [m.name for m in models.values() if isinstance(m, Interpreting)]),
            *self.fleet.routes(),
        ]

    @property
    def ready(self) -> bool:
        return self._readiness

    @ready.setter
    def ready(self, ready: bool) -> None:
        self._readiness, self.started = ready, self.started or ready

    async def handle(self, request: Request) -> Response:
        started = time.perf_counter()
        url = urlsplit(request.target)
        endpoint, params = "unknown", {}
        response: Response
        try:
            for method, pattern, name, handler in self._routes:
                match = pattern.fullmatch(url.path)
                if match:
                    endpoint = name if name != "task" else self._task_label(match["task"])
                    _check_method(request.method, method, url.path)
                    if name in OPERATOR_ROUTES and not request.operator:
                        raise ApiError(f"{url.path} is for operators: {OPERATORS_ARE}", 403)
                    self.fleet.admit(name, request)
                    params = {k: v for k, v in match.groupdict().items() if v is not None}
                    if url.query:
                        params.update({f"query:{k}": v for k, v in parse_qsl(url.query)})
                    grant = await self.access.admit(request, name, params)
                    if grant.principal:  # its sequences count against the key's share of the table
                        request = dataclasses.replace(request, principal=grant.principal)
                    response = self.access.answered(grant, await handler(request, params))
                    break
            else:
                raise NotFound(f"no route for {url.path}")
        except asyncio.CancelledError:  # the client went away (protocol/flow.py): counted, not answered
            self.metrics.cancelled += 1
            raise
        except ApiError as exc:
            response = error_response(exc.status, exc.message, url.path)
            response.headers += exc.headers
        except Exception:
            log.exception("request %s %s crashed", request.method, url.path, extra=_log_fields(request, params))
            response = error_response(500, "internal error (logged)", url.path)
        # as Triton does: only an infer answer is compressed, and only when asked (its clients read
        # every other answer as it comes; tritonclient.http.aio turns off aiohttp's decompression);
        # and /metrics, as Prometheus exposers (Triton's too) do for the scrapers that ask
        compressible = endpoint in COMPRESSED_ENDPOINTS
        coding = accepted_coding(request.headers.get("accept-encoding", "")) if compressible else None
        if coding is not None and response.body and response.stream is None and response.status == 200:
            response = await _compressed(response, coding)
        if response.status >= 400:  # the client's mistakes at debug level; ours are errors
            log.log(
                logging.ERROR if response.status >= 500 else logging.DEBUG,
                "%s %s: %d %s",
                request.method,
                url.path,
                response.status,
                response.body[:200].decode("utf-8", "replace"),
                extra=_log_fields(request, params),
            )
        self.metrics.observe_request(endpoint, response.status, time.perf_counter() - started)
        if request.method == "HEAD" and response.stream is not None:  # its length, as a GET's (RFC 9110 8.6)
            response.body, response.stream = b"".join([piece async for piece in response.stream]), None
        if response.stream is not None:
            response.stream = _counted(response.stream, self.metrics)
        return response

    def end_opened(self, opened: Iterable[Opened]) -> None:
        """End sequences a transport's vanished client opened, where still the same."""
        for o in opened:
            if self.models[o.model].sequences.end_opened(o.id, o.serial):
                log.info("model %s: sequence %r ended: the client that opened it vanished", o.model, o.id)

    async def still_open(self, opened: list[Opened]) -> list[bool]:
        return [self.models[o.model].sequences.holds(o.id, o.serial) for o in opened]

    def _task_label(self, task: str) -> str:
        """The metrics label of a model's own route: its name where some model has it (bounded)."""
        return task if any(task in m.tasks for m in self.models.values()) else "unknown"

    def keep_connections(self) -> bool:
        """While draining, a connection stays open only as long as some sequence is still streaming on it."""
        return not self.fleet.draining or streaming(self.models.values()) > 0

    # --- metadata and health ----------------------------------------------------------------------

    def firmware_info(self) -> dict[str, Any]:
        m = self.manifest
        return {"name": m.name, "version": m.version, "built_at": m.built_at, "signing_key_id": m.signing_key_id}

    async def _server(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(
            200,
            {
                "name": "triton",  # Triton's clients check this name (NVIDIA's examples do)
                "version": __version__,
                "extensions": EXTENSIONS,
                "server": "appliance",
                "firmware": self.firmware_info(),
            },
        )

    async def _live(self, request: Request, params: dict[str, str]) -> Response:
        """Triton's liveness: fails only when the process is broken (a task it needs died)."""
        if self.fleet.broken:
            return error_response(503, f"not live: {self.fleet.broken}")
        return json_response(200, {"live": True})

    async def _ready(self, request: Request, params: dict[str, str]) -> Response:
        """Triton's readiness: it takes new work. Fails while starting, draining or overloaded."""
        if reason := fleet_routes.not_ready(self.fleet.state()):
            return error_response(503, reason)
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

    def _model(self, params: dict[str, str]) -> ServedModel:
        model = self.models.get(params["model"])
        if model is None:
            raise NotFound(  # Triton's text: its clients match on the start
                f"Request for unknown model: '{params['model']}' is not found (this firmware serves: {', '.join(self.models)})"
            )
        version = params.get("version")
        if version is not None and version != self.manifest.version:
            raise NotFound(
                f"Request for unknown model: '{model.name}' version {version} is not found (serving {self.manifest.version})"
            )
        return model

    async def _model_metadata(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        doc = {"name": model.name, "versions": [self.manifest.version], **model.metadata()}
        doc["parameters"] = {**doc.get("parameters", {}), "firmware": self.firmware_info()}
        return json_response(200, doc)

    async def _model_ready(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        if not self.ready:
            return error_response(503, f"model {model.name} is not ready")
        return json_response(200, {"name": model.name, "ready": True})

    async def _model_config(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(200, self._model(params).config())

    async def _stats(self, request: Request, params: dict[str, str]) -> Response:
        """Triton's statistics of one model, or of every model when the path names none."""
        models = [self._model(params)] if "model" in params else list(self.models.values())
        return json_response(200, {"model_stats": [m.stats.document(m.name, self.manifest.version) for m in models]})

    async def _repository_index(self, request: Request, params: dict[str, str]) -> Response:
        return json_response(200, repository.index(request.body, list(self.models), self.manifest.version, self.ready))

    async def _repository_control(self, request: Request, params: dict[str, str]) -> Response:
        raise repository.refusal(params["action"], params["model"], self.manifest, list(self.models))

    async def _metrics(self, request: Request, params: dict[str, str]) -> Response:
        workers = self.workers() if self.workers else None
        peers = None if self.peer_table is None else await reading(self.peer_table, every_peer=False)
        buffered = self.budget.held_by_daemon if self.budget is not None else 0
        text = prometheus.render(self.metrics, self.models.values(), peers, self.manifest.version, workers, buffered)
        text += self.fleet.metrics()
        return Response(200, text.encode(), "text/plain; version=0.0.4")

    async def _status(self, request: Request, params: dict[str, str]) -> Response:
        workers = self.workers() if self.workers else None
        peers = None if self.peer_table is None else await reading(self.peer_table, every_peer=True)
        doc = status_document(
            self.firmware_info(), self.ready, self.models.values(), workers, self.quic, self.tls, peers
        )
        return json_response(200, doc)

    # --- inference ----------------------------------------------------------------------------------

    async def _infer(self, request: Request, params: dict[str, str]) -> Response:
        return await infer.answer(self._model(params), request, self.fleet, self.manifest.version)

    async def _task(self, request: Request, params: dict[str, str]) -> Response:
        model = self._model(params)
        task = model.tasks.get(params["task"])
        if task is None:
            raise NotFound(
                f"model {model.name} has no route {params['task']!r} (it has: infer"
                f"{''.join(', ' + t for t in model.tasks)})"
            )
        return await task(request, {k[6:]: v for k, v in params.items() if k.startswith("query:")})


def _check_method(asked: str, route_method: str, path: str) -> None:
    """A 405 naming the methods the route takes in Allow (RFC 9110 15.5.6); HEAD where GET (9.1)."""
    allowed = ("GET", "HEAD") if route_method == "GET" else (route_method,)
    if asked not in allowed:
        why = f"{asked} is not allowed on {path} (use {' or '.join(allowed)})"
        raise ApiError(why, 405, headers=(("allow", ", ".join(allowed)),))


def _log_fields(request: Request, params: dict[str, str]) -> dict[str, str]:
    """Structured journal fields: which model, which request (the caller's x-request-id)."""
    return {"MODEL": params.get("model", "-"), "REQUEST_ID": request.headers.get("x-request-id", "-")}


def streaming(models: Iterable[ServedModel]) -> int:
    """Open sequences that are streaming: a request in flight, or one in the last STREAMING_S. A stop
    waits for these alone; idle ones end with it at once."""
    now = time.monotonic()
    return sum(m.sequences.streaming(now, STREAMING_S) for m in models)


async def _counted(stream: AsyncGenerator[bytes, None], metrics: prometheus.Metrics) -> AsyncGenerator[bytes, None]:
    """A streamed answer; one its client left before the end counts as cancelled."""
    whole = False
    try:
        async with contextlib.aclosing(stream) as pieces:
            async for piece in pieces:
                yield piece
        whole = True
    finally:
        if not whole:
            metrics.cancelled += 1


async def _compressed(response: Response, coding: str) -> Response:
    """The response in the coding the client accepts (streamed bodies go as they are)."""
    body = await off_loop(len(response.body), compress, response.body, coding)
    headers = [*response.headers, ("Content-Encoding", coding)]
    return dataclasses.replace(response, body=body, headers=headers)
