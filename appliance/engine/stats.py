"""A model's statistics, as Triton keeps them (its statistics extension): per request, how many succeeded
or failed and the time each spent queued, preparing inputs, in the engine and making outputs; per engine
call (an execution), the batch size. Every kind records into one; `/v2/models/stats` and `/metrics` read it.

Times are nanoseconds from time.perf_counter_ns, taken by the caller (nothing here reads a clock).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(slots=True)
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += max(ns, 0)


@dataclass(slots=True)
class BatchStats:
    """Executions of one batch size (Triton's batch_stats entry)."""

    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)


@dataclass(slots=True)
class RequestTimes:
    """What one request spent where; a kind fills it in as the request goes and records it at the end."""

    queue_ns: int = 0
    compute_input_ns: int = 0
    compute_infer_ns: int = 0
    compute_output_ns: int = 0

    def add_compute(self, input_ns: int, infer_ns: int, output_ns: int) -> None:
        self.compute_input_ns += input_ns
        self.compute_infer_ns += infer_ns
        self.compute_output_ns += output_ns

    def queued_since(self, started_ns: int, now_ns: int) -> None:
        """The request's time since `started_ns` that was not compute: waiting for its engine calls."""
        compute = self.compute_input_ns + self.compute_infer_ns + self.compute_output_ns
        self.queue_ns = max(now_ns - started_ns - compute, 0)


@dataclass(slots=True)
class ModelStats:
    inference_count: int = 0  # rows (batch elements, frames, shards) inferred: Triton's inference_count
    execution_count: int = 0  # engine calls
    last_inference_ms: int = 0  # wall-clock milliseconds of the last request that ended
    success: Duration = field(default_factory=Duration)
    fail: Duration = field(default_factory=Duration)
    queue: Duration = field(default_factory=Duration)
    compute_input: Duration = field(default_factory=Duration)
    compute_infer: Duration = field(default_factory=Duration)
    compute_output: Duration = field(default_factory=Duration)
    batches: dict[int, BatchStats] = field(default_factory=dict)
    refused: int = 0  # requests refused at a full queue (engine.max_queue_size)
    timed_out: int = 0  # requests that waited past engine.queue_timeout_s
    dropped: int = 0  # shards or frames whose caller went away: left the queue, or their results dropped
    crashes: int = 0  # times its engine loop or batch queue crashed and was restarted
    longest_execution_ns: int = 0  # the longest engine call so far (how long a stop waits for one)

    def record_execution(self, batch: int, input_ns: int, infer_ns: int, output_ns: int) -> None:
        """One engine call on `batch` rows."""
        self.execution_count += 1
        self.inference_count += batch
        self.longest_execution_ns = max(self.longest_execution_ns, input_ns + infer_ns + output_ns)
        entry = self.batches.get(batch)
        if entry is None:
            entry = self.batches[batch] = BatchStats()
        entry.compute_input.add(input_ns)
        entry.compute_infer.add(infer_ns)
        entry.compute_output.add(output_ns)

    def record_request(self, ok: bool, total_ns: int, times: RequestTimes, now_ms: int) -> None:
        """One request ended (`now_ms`: wall-clock time, for last_inference)."""
        self.last_inference_ms = now_ms
        if not ok:
            self.fail.add(total_ns)
            return
        self.success.add(total_ns)
        self.queue.add(times.queue_ns)
        self.compute_input.add(times.compute_input_ns)
        timed = times.compute_input_ns + times.compute_infer_ns + times.compute_output_ns
        # a kind whose engine calls are not its own (a continuous batch, a stream of sentences) times
        # none: its time not spent in the queue is its compute
        self.compute_infer.add(times.compute_infer_ns if timed else max(total_ns - times.queue_ns, 0))
        self.compute_output.add(times.compute_output_ns)

    @property
    def batch_sizes(self) -> dict[int, int]:
        return {size: entry.compute_infer.count for size, entry in self.batches.items()}

    def document(self, name: str, version: str) -> dict[str, Any]:
        """Triton's $model_stat (statistics extension). There is no response cache: its entries are 0."""
        durations = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output")
        none = {"count": 0, "ns": 0}
        return {
            "name": name,
            "version": version,
            "last_inference": self.last_inference_ms,
            "inference_count": self.inference_count,
            "execution_count": self.execution_count,
            "inference_stats": {
                **{key: asdict(getattr(self, key)) for key in durations},
                "cache_hit": none,
                "cache_miss": none,
            },
            "batch_stats": [
                {"batch_size": size, **asdict(entry)} for size, entry in sorted(self.batches.copy().items())
            ],
        }
