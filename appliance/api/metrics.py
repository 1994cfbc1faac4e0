"""Prometheus text exposition of the daemon's counters, written by hand (no client library needed)."""

from __future__ import annotations

import bisect
from collections.abc import Callable, Iterable
from typing import Any

from appliance.kinds.base import ServedModel
from appliance.protocol import flow
from appliance.protocol.peers import PeerTable
from appliance.tasks import LAG_BUCKETS, LOOP_LAG

LATENCY_BUCKETS = (
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float, times: int = 1) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += times
        self.sum += value * times
        self.count += times

    def lines(self, name: str, labels: str = "") -> Iterable[str]:
        cumulative = 0
        sep = "," if labels else ""
        for bound, count in zip(self.buckets, self.counts):
            cumulative += count
            yield f'{name}_bucket{{{labels}{sep}le="{bound:g}"}} {cumulative}'
        yield f'{name}_bucket{{{labels}{sep}le="+Inf"}} {self.count}'
        braces = f"{{{labels}}}" if labels else ""
        yield f"{name}_sum{braces} {self.sum:.6f}"
        yield f"{name}_count{braces} {self.count}"


class Metrics:
    def __init__(self) -> None:
        self.requests: dict[tuple[str, int], int] = {}
        self.latency: dict[str, Histogram] = {}
        self.cancelled = 0  # requests whose client went away before their answer was whole
        self.live_latency: dict[tuple[str, str, str], Histogram] = {}  # by model, protocol and until what
        self.refused: dict[tuple[str, str], int] = {}  # by reason and listener (api/access)

    def observe_live(self, model: str, protocol: str, seconds: float, until: str = "transcript") -> None:
        """A live turn: from the audio that ended it reaching the box to its final transcript sent
        (`until` "transcript"), or to the first audio of its translation ("first_audio")."""
        histogram = self.live_latency.get((model, protocol, until))
        if histogram is None:
            histogram = self.live_latency[(model, protocol, until)] = Histogram(LATENCY_BUCKETS)
        histogram.observe(seconds)

    def observe_request(self, endpoint: str, status: int, seconds: float) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1
        histogram = self.latency.get(endpoint)
        if histogram is None:
            histogram = self.latency[endpoint] = Histogram(LATENCY_BUCKETS)
        histogram.observe(seconds)

    @property
    def total_requests(self) -> int:
        return sum(self.requests.values())


def render(
    metrics: Metrics,
    models: Iterable[ServedModel],
    conncache: PeerTable | None = None,
    version: str = "",
    workers: list[dict[str, Any]] | None = None,
    buffered: int = 0,
) -> str:
    """Text format 0.0.4; `version`: the firmware's, each model's version label; `workers`: the protocol
    workers as /status shows them, where there are; `buffered`: the bytes the daemon holds against
    server.max_buffered_bytes."""
    models = list(models)  # read once per section
    out = [
        "# HELP appliance_requests_total API requests by endpoint and HTTP status.",
        "# TYPE appliance_requests_total counter",
    ]
    out += [
        f'appliance_requests_total{{endpoint="{e}",code="{s}"}} {n}' for (e, s), n in sorted(metrics.requests.items())
    ]
    out += [
        "# HELP appliance_refused_total Requests and connections refused by who may use the box, by reason"
        " (no_key, bad_key, route, origin, rate, sessions, audio, address) and listener.",
        "# TYPE appliance_refused_total counter",
    ]
    out += [
        f'appliance_refused_total{{reason="{r}",listener="{w}"}} {n}' for (r, w), n in sorted(metrics.refused.items())
    ]
    out += [
        "# HELP appliance_request_duration_seconds Time from a request's last byte to its response.",
        "# TYPE appliance_request_duration_seconds histogram",
    ]
    for endpoint, histogram in sorted(metrics.latency.items()):
        out += histogram.lines("appliance_request_duration_seconds", f'endpoint="{endpoint}"')
    out += [
        "# HELP appliance_live_latency_seconds End of a live turn's speech (the chunk that carried it"
        " received) to its final transcript sent (until=transcript) or its translation's first audio"
        " sent (until=first_audio), by model and protocol (realtime, wyoming).",
        "# TYPE appliance_live_latency_seconds histogram",
    ]
    for (name, protocol, until), histogram in sorted(metrics.live_latency.items()):
        labels = f'model="{name}",protocol="{protocol}",until="{until}"'
        out += histogram.lines("appliance_live_latency_seconds", labels)
    sections: dict[str, list[str]] = {
        "appliance_batch_size": [
            "# HELP appliance_batch_size Sequences per engine call.",
            "# TYPE appliance_batch_size histogram",
        ],
        "appliance_engine_frames_total": [
            "# HELP appliance_engine_frames_total Frames run by the engine.",
            "# TYPE appliance_engine_frames_total counter",
        ],
        "appliance_queue_depth": [
            "# HELP appliance_queue_depth Works waiting or running in the engine.",
            "# TYPE appliance_queue_depth gauge",
        ],
        "appliance_live_sequences": [
            "# HELP appliance_live_sequences Open stateful sequences.",
            "# TYPE appliance_live_sequences gauge",
        ],
        "appliance_engine_fallbacks_total": [
            "# HELP appliance_engine_fallbacks_total Batches the GPU engine handed to the CPU engine, by reason.",
            "# TYPE appliance_engine_fallbacks_total counter",
        ],
    }
    for model in models:
        label = f'model="{model.name}",engine="{model.engine_name}"'
        stats = model.stats
        batches = Histogram(BATCH_BUCKETS)
        for size, count in list(stats.batch_sizes.items()):
            batches.observe(size, count)
        sections["appliance_batch_size"] += batches.lines("appliance_batch_size", label)
        sections["appliance_engine_frames_total"].append(
            f"appliance_engine_frames_total{{{label}}} {stats.inference_count}"
        )
        sections["appliance_queue_depth"].append(f"appliance_queue_depth{{{label}}} {model.queue_depth}")
        sections["appliance_live_sequences"].append(f"appliance_live_sequences{{{label}}} {len(model.sequences)}")
        fallbacks = model.fallbacks
        sections["appliance_engine_fallbacks_total"] += [
            f'appliance_engine_fallbacks_total{{{label},reason="{reason}"}} {count}'
            for reason, count in sorted(fallbacks.items())
        ]
    for lines in sections.values():
        out += lines
    out += _triton_lines(models, version)
    out += _flow_lines(metrics, models)
    out += [
        "# HELP appliance_buffered_bytes Bytes the daemon holds for clients (request bodies, Realtime's manual"
        " buffers, Wyoming's recordings), its workers' included; bound: server.max_buffered_bytes.",
        "# TYPE appliance_buffered_bytes gauge",
        f"appliance_buffered_bytes {buffered}",
    ]
    if conncache is not None:
        out += _conncache_lines(conncache)
    if workers:
        out += _worker_lines(workers)
    return "\n".join(out) + "\n"


# Triton's per-model metrics (docs/user_guide/metrics.md), same names, types and labels, so a dashboard
# made for Triton reads these as they are: (name, type, help, value of a model's stats in whole units).
TRITON_METRICS: tuple[tuple[str, str, str, Callable[[ServedModel], int]], ...] = (
    ("nv_inference_request_success", "counter", "Number of successful inference requests, all batch sizes",
     lambda m: m.stats.success.count),
    ("nv_inference_request_failure", "counter", "Number of failed inference requests, all batch sizes",
     lambda m: m.stats.fail.count),
    ("nv_inference_count", "counter", "Number of inferences performed (does not include cached requests)",
     lambda m: m.stats.inference_count),
    ("nv_inference_exec_count", "counter", "Number of model executions performed (does not include cached requests)",
     lambda m: m.stats.execution_count),
    ("nv_inference_request_duration_us", "counter",
     "Cumulative inference request duration in microseconds (includes cached requests)",
     lambda m: m.stats.success.ns // 1000),
    ("nv_inference_queue_duration_us", "counter",
     "Cumulative inference queuing duration in microseconds (includes cached requests)",
     lambda m: m.stats.queue.ns // 1000),
    ("nv_inference_compute_input_duration_us", "counter",
     "Cumulative compute input duration in microseconds (does not include cached requests)",
     lambda m: m.stats.compute_input.ns // 1000),
    ("nv_inference_compute_infer_duration_us", "counter",
     "Cumulative compute inference duration in microseconds (does not include cached requests)",
     lambda m: m.stats.compute_infer.ns // 1000),
    ("nv_inference_compute_output_duration_us", "counter",
     "Cumulative inference compute output duration in microseconds (does not include cached requests)",
     lambda m: m.stats.compute_output.ns // 1000),
    ("nv_inference_pending_request_count", "gauge", "Instantaneous number of pending requests awaiting execution per-model.",
     lambda m: m.queue_depth),
)  # fmt: skip


def _triton_lines(models: Iterable[ServedModel], version: str) -> list[str]:
    out = []
    for name, kind, help_text, value in TRITON_METRICS:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f'{name}{{model="{m.name}",version="{version}"}} {value(m)}' for m in models]
    return out


WORKER_METRICS = (
    ("appliance_worker_up", "gauge", "1 while the protocol worker serves, 0 while it is (re)starting.",
     lambda w: int(w["up"])),
    ("appliance_worker_restarts_total", "counter", "Times the protocol worker was replaced after it died.",
     lambda w: w["restarts"]),
    ("appliance_worker_requests_in_flight", "gauge", "Requests the worker is serving.", lambda w: w.get("in_flight", 0)),
    ("appliance_worker_unix_connections", "gauge", "Unix socket connections the worker holds.",
     lambda w: w.get("connections", 0)),
    ("appliance_worker_https_connections", "gauge", "HTTPS (TLS on TCP) connections the worker holds.",
     lambda w: w.get("tcp_connections", 0)),
    ("appliance_worker_quic_connections", "gauge", "QUIC connections the worker holds.",
     lambda w: len(w.get("quic_peers", []))),
    ("appliance_worker_quic_datagrams_total", "counter", "Datagrams received on the worker's UDP socket.",
     lambda w: w.get("quic_datagrams", 0)),
    ("appliance_worker_quic_stray_datagrams_total", "counter",
     "Short-header datagrams for a connection the worker does not hold (steering missed, or a restart).",
     lambda w: w.get("quic_stray_datagrams", 0)),
    ("appliance_worker_stream_held_bytes", "gauge",
     "Bytes of streamed answers the worker holds for clients that have not taken them.",
     lambda w: w.get("held_bytes", 0)),
    ("appliance_worker_stream_held_bytes_max", "gauge", "The most bytes the worker holds for one streamed answer.",
     lambda w: w.get("held_largest_bytes", 0)),
    ("appliance_worker_event_loop_lag_seconds", "gauge", "How late the worker's event loop ran a timer lately.",
     lambda w: w.get("loop_lag_s", 0.0)),
)  # fmt: skip


MODEL_FLOW_METRICS = (
    ("appliance_queue_refused_total", "counter",
     "Requests refused at a full queue (engine.max_queue_size), answered 503 with Retry-After.", lambda m: m.stats.refused),
    ("appliance_queue_timed_out_total", "counter",
     "Requests that waited past engine.queue_timeout_s, answered 503 with Retry-After.", lambda m: m.stats.timed_out),
    ("appliance_cancelled_work_total", "counter",
     "Shards or frames whose client went away: dropped from the queue, or their results dropped.",
     lambda m: m.stats.dropped),
    ("appliance_engine_loop_crashes_total", "counter",
     "Times the model's engine loop or batch queue crashed (its requests got a 500) and was restarted.",
     lambda m: m.stats.crashes),
)  # fmt: skip


def _flow_lines(metrics: Metrics, models: list[ServedModel]) -> list[str]:
    """Flow control, cancellation, queue policy and the event loop's lag of the engine process
    (protocol/flow.py; each worker's own are in its appliance_worker_ lines)."""
    held = flow.held()
    out = [
        "# HELP appliance_requests_cancelled_total Requests whose client went away before their answer was whole.",
        "# TYPE appliance_requests_cancelled_total counter",
        f"appliance_requests_cancelled_total {metrics.cancelled}",
        "# HELP appliance_stream_held_bytes Bytes of streamed answers held for clients that have not taken them.",
        "# TYPE appliance_stream_held_bytes gauge",
        f"appliance_stream_held_bytes {held.total}",
        "# HELP appliance_stream_held_bytes_max The most bytes held for one streamed answer (bound: stream_window_bytes).",
        "# TYPE appliance_stream_held_bytes_max gauge",
        f"appliance_stream_held_bytes_max {held.largest}",
        "# HELP appliance_streams_waiting_for_client Streamed answers held past the window: none of their next"
        " pieces is made until their client takes some.",
        "# TYPE appliance_streams_waiting_for_client gauge",
        f"appliance_streams_waiting_for_client {held.waiting}",
        "# HELP appliance_event_loop_lag_seconds How late the event loop ran a timer lately (CPU work on the loop).",
        "# TYPE appliance_event_loop_lag_seconds gauge",
        f"appliance_event_loop_lag_seconds {LOOP_LAG.last:.6f}",
        "# HELP appliance_event_loop_lag_duration_seconds The event loop's lag, every 0.1 s.",
        "# TYPE appliance_event_loop_lag_duration_seconds histogram",
    ]
    lag = Histogram(LAG_BUCKETS)
    lag.counts, lag.sum, lag.count = list(LOOP_LAG.counts), LOOP_LAG.sum, LOOP_LAG.count
    out += lag.lines("appliance_event_loop_lag_duration_seconds")
    for name, kind, help_text, value in MODEL_FLOW_METRICS:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f'{name}{{model="{m.name}"}} {value(m)}' for m in models]
    return out


def _worker_lines(workers: list[dict[str, Any]]) -> list[str]:
    out = []
    for name, kind, help_text, value in WORKER_METRICS:
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        out += [f'{name}{{worker="{w["worker"]}"}} {value(w)}' for w in workers]
    return out


def _conncache_lines(cache: PeerTable) -> list[str]:
    # no walk of the unvalidated sources' table: a flood makes it as big as it may be
    totals, validated, droppers = cache.totals(), cache.validated_count(), cache.droppers()
    label = f'backend="{cache.backend}"'
    out = []
    for name, kind, help_text, value in (
        (
            "appliance_quic_peers",
            "gauge",
            "QUIC peers (address and port) in the connection cache's validated table (handshake completed).",
            validated,
        ),
        (
            "appliance_quic_sources_total",
            "counter",
            "Sources (address and port) the connection cache saw first, validated or not.",
            totals.peers_seen,
        ),
        ("appliance_quic_packets_total", "counter", "Datagrams admitted to the QUIC listener.", totals.packets),
        ("appliance_quic_bytes_total", "counter", "UDP payload bytes admitted to the QUIC listener.", totals.bytes),
        ("appliance_quic_dropped_total", "counter", "Datagrams dropped over a peer's budget.", totals.drops),
    ):
        out += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}", f"{name}{{{label}}} {value}"]
    out += [
        "# HELP appliance_quic_peer_dropped_total Datagrams dropped over budget, by peer (the last few hundred over it).",
        "# TYPE appliance_quic_peer_dropped_total counter",
    ]
    out += [
        f'appliance_quic_peer_dropped_total{{{label},peer="{address}"}} {drops}'
        for address, drops in sorted(droppers.items(), key=lambda item: -item[1])
    ]
    return out
