"""Dynamic batching of whole requests to any graph, as Triton's dynamic batcher, with implicit state as
its sequence batcher keeps it.

Theory of operation. A *job* is one request's inputs, `rows` on the graph's batch axis (axis 0). The
batcher takes waiting jobs in arrival order whose inputs agree on every axis but the batch one (a job
that does not waits for a later call) until their rows would pass `max_batch`, concatenates them, runs
the engine once, and splits every output back by rows. A graph without a batch axis (`max_batch` 0)
runs one job per call. A job of a stateful sequence (the graph's declared state pairs) carries its
sequence: the sequence's state rows are stacked into the state inputs on the pair's batch axis and the
new rows scattered back after the call, so several sequences share each engine call; one job per
sequence per call keeps a sequence's requests in order.

Like scheduler.Batcher, nothing here knows about asyncio, threads or sockets: engine/loop.py drives it
through the same members (submit, fill, run_steps, finish, busy, waiting, max_batch).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import numpy as np

from appliance.engine.interface import Engine
from appliance.engine.scheduler import Sequence
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import Unavailable
from appliance.firmware import StatePair


@dataclass(slots=True, eq=False)
class Job:
    feeds: dict[str, np.ndarray]
    rows: int  # on the batch axis; 1 for a graph without one
    on_done: Callable[[Job, BaseException | None], None]
    sequence: Sequence | None = None  # its `state`: one row per state pair (the pair's batch axis removed)
    submitted_ns: int = field(default_factory=time.perf_counter_ns)
    times: RequestTimes = field(default_factory=RequestTimes)
    outputs: dict[str, np.ndarray] = field(default_factory=dict)
    cancelled: bool = False  # its caller went away before it ran: never run it

    def shape_key(self) -> tuple[tuple[str, tuple[int, ...], str], ...]:
        """What must agree for two jobs to share an engine call: every input's shape past the batch axis."""
        return tuple((name, array.shape[1:], array.dtype.str) for name, array in sorted(self.feeds.items()))


class DynamicBatcher:
    def __init__(self, engine: Engine, max_batch: int, state: Iterable[StatePair] = ()) -> None:
        """`max_batch`: the most rows in one call; 0 when the graph has no batch axis (one job a call)."""
        self.engine, self.state_pairs = engine, tuple(state)
        self.batched = max_batch > 0
        self.max_batch = max(max_batch, 1)
        self.stats = ModelStats()
        self._waiting: deque[Job] = deque()
        self._active: list[Job] = []

    @property
    def queue_depth(self) -> int:
        return len(self._waiting) + len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._waiting or self._active)

    @property
    def waiting(self) -> int:
        return sum(job.rows for job in self._waiting)

    def submit(self, job: Job) -> None:
        self._waiting.append(job)

    def fill(self) -> int:
        """Take waiting jobs that fit one call (arrival order; same shapes; one per sequence); their rows."""
        active, waiting = self._active, self._waiting
        while waiting and waiting[0].cancelled:
            job = waiting.popleft()
            self.stats.dropped += 1
            job.on_done(job, Unavailable("cancelled by its caller"))
        if active or not waiting:
            return sum(job.rows for job in active)
        first = waiting.popleft()
        active.append(first)
        rows, key, sequences = first.rows, first.shape_key(), {id(first.sequence)}
        if self.batched:
            skipped: list[Job] = []
            while waiting and rows < self.max_batch:
                job = waiting.popleft()
                if job.cancelled:
                    self.stats.dropped += 1
                    job.on_done(job, Unavailable("cancelled by its caller"))
                elif rows + job.rows > self.max_batch:
                    skipped.append(job)
                    break  # arrival order: a job that does not fit goes first next time
                elif job.shape_key() != key or (job.sequence is not None and id(job.sequence) in sequences):
                    skipped.append(job)
                else:
                    active.append(job)
                    rows += job.rows
                    sequences.add(id(job.sequence))
            waiting.extendleft(reversed(skipped))
        return rows

    def run_steps(self, budget_s: float = 0.0) -> list[tuple[Job, BaseException | None]]:
        """One engine call on the batch `fill` took; every job of it is finished (or failed)."""
        jobs, self._active = self._active, []
        if not jobs:
            return []
        started = time.perf_counter_ns()
        try:
            feeds = self._feeds(jobs)
            rows = sum(job.rows for job in jobs)
            inputs_ready = time.perf_counter_ns()
            outputs = self.engine.run(feeds, rows)
            inferred = time.perf_counter_ns()
            self._split(jobs, outputs)
        except Exception as exc:  # an engine failure fails this batch, not the daemon (the loop logs it)
            error = Unavailable(f"engine {self.engine.name} failed: {exc}", 500)
            error.__cause__ = exc
            return [(job, error) for job in jobs]
        done = time.perf_counter_ns()
        input_ns, infer_ns, output_ns = inputs_ready - started, inferred - inputs_ready, done - inferred
        self.stats.record_execution(rows, input_ns, infer_ns, output_ns)
        for job in jobs:
            job.times.queue_ns += started - job.submitted_ns
            job.times.add_compute(input_ns, infer_ns, output_ns)
        return [(job, None) for job in jobs]

    def _feeds(self, jobs: list[Job]) -> dict[str, np.ndarray]:
        if len(jobs) == 1:
            feeds = dict(jobs[0].feeds)
        else:
            feeds = {name: np.concatenate([job.feeds[name] for job in jobs]) for name in jobs[0].feeds}
        for i, pair in enumerate(self.state_pairs):
            rows = [job.sequence.state[i] for job in jobs if job.sequence is not None]
            feeds[pair.input] = np.stack(rows, axis=pair.batch_axis)
        return feeds

    def _split(self, jobs: list[Job], outputs: dict[str, np.ndarray]) -> None:
        state_outputs = {pair.output for pair in self.state_pairs}
        offsets = np.cumsum([0] + [job.rows for job in jobs])
        for name, array in outputs.items():
            if name in state_outputs:
                continue
            for job, start, end in zip(jobs, offsets, offsets[1:]):
                job.outputs[name] = array[start:end] if self.batched else array
        for i, pair in enumerate(self.state_pairs):
            rows = np.moveaxis(outputs[pair.output], pair.batch_axis, 0)
            for job, row in zip(jobs, rows):
                assert job.sequence is not None
                job.sequence.state[i] = row.copy()

    @staticmethod
    def finish(finished: list[tuple[Job, BaseException | None]]) -> None:
        for job, error in finished:
            job.on_done(job, error)

    def fail_all(self, error: BaseException) -> None:
        jobs = [*self._active, *self._waiting]
        self._active, self._waiting = [], deque()
        self.finish([(job, error) for job in jobs])
