"""Continuous batching of stateful frame models (the VAD's recurrent state and audio context).

Theory of operation. A *sequence* is one live audio stream: its recurrent state rows and the
last `context_samples` of its audio. A *work* item asks for N frames of one sequence to be run.
The batcher repeatedly takes up to `max_batch` works (at most one per sequence: frames of
one sequence must run in order), stacks one frame of each into a batch, gathers their state
rows, runs the engine once, scatters the new state rows back and moves each work one frame on.
Finished works leave the batch and waiting ones join it between steps, so a stream never waits
for another stream's long request to finish, and concurrent streams share every engine call.

Nothing here knows about asyncio, threads or sockets: works carry a completion callback and the
Batcher runs one engine call when asked. Open sequences are kept in engine/sequences.py's OwnedTable.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from appliance.engine.interface import Engine
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, Unavailable
from appliance.firmware import ModelSpec


class FrameModel:
    """How to feed one batch of frames of a stateful audio model, read from its manifest entry."""

    def __init__(self, spec: ModelSpec, engine: Engine) -> None:
        self.spec, self.engine = spec, engine
        audio = spec.vad_audio
        self.frame_samples, self.context_samples = audio.frame_samples, audio.context_samples
        self.sample_rate = audio.sample_rate
        self._sample_rate_feed = np.array(audio.sample_rate, dtype=np.int64)
        declared = {t.name: t for t in spec.inputs}
        self._row_shapes: list[tuple[int, ...]] = []
        for pair in spec.state:
            shape = list(declared[pair.input].shape)
            del shape[pair.batch_axis]
            if any(d < 0 for d in shape):
                raise ApplianceError(
                    f"model {spec.name}: state {pair.input} needs a fixed shape besides its batch axis"
                )
            self._row_shapes.append(tuple(shape))

    def new_sequence(self) -> Sequence:
        return Sequence(
            state=[np.zeros(shape, np.float32) for shape in self._row_shapes],
            context=np.zeros(self.context_samples, np.float32),
        )

    def feeds(self, sequences: list[Sequence], frames: np.ndarray) -> dict[str, np.ndarray]:
        """One frame of each sequence (frames: [batch, frame_samples]) with its context and state rows."""
        audio = self.spec.vad_audio
        x = np.concatenate([np.stack([s.context for s in sequences]), frames], axis=1)
        feeds = {audio.audio_input: x, audio.sample_rate_input: self._sample_rate_feed}
        for i, pair in enumerate(self.spec.state):
            feeds[pair.input] = np.stack([s.state[i] for s in sequences], axis=pair.batch_axis)
        return feeds

    def absorb(self, sequences: list[Sequence], feeds: dict[str, np.ndarray], out: dict[str, np.ndarray]) -> np.ndarray:
        """The engine's outputs for `feeds`: each sequence's new state and context; the probabilities."""
        audio, batch = self.spec.vad_audio, len(sequences)
        for i, pair in enumerate(self.spec.state):
            rows = np.moveaxis(out[pair.output], pair.batch_axis, 0)
            for sequence, row in zip(sequences, rows):
                sequence.state[i] = row
        contexts = feeds[audio.audio_input][:, -self.context_samples :]
        for sequence, context in zip(sequences, contexts):
            sequence.context = context
        return out[audio.prob_output].reshape(batch, -1)[:, 0]


@dataclass(slots=True, eq=False)
class Sequence:
    """One stream's recurrent state rows and audio context; an entry of engine/sequences.py's OwnedTable
    (the table sets last_used, serial and client) or a recording shard's own."""

    state: list[np.ndarray]
    context: np.ndarray
    last_used: float = 0.0
    in_flight: int = 0
    serial: int = 0
    client: str = ""


@dataclass(slots=True, eq=False)
class Work:
    """Frames of one sequence to run; `on_done(work, error)` is called when they all ran, or failed."""

    sequence: Sequence
    frames: np.ndarray
    on_done: Callable[[Work, BaseException | None], None]
    probs: np.ndarray = field(init=False)
    next_frame: int = 0
    cancelled: bool = False  # its caller went away: never run it, or no further
    urgent: bool = False  # a live stream's frames, or a short request's: before recordings, and may push one out
    times: RequestTimes | None = None  # its request's: each engine call it is in adds its compute times once

    def __post_init__(self) -> None:
        self.probs = np.empty(len(self.frames), np.float32)


class Batcher:
    """Continuous batching of works up to the baked max_batch, live streams first.

    The caller drives it (engine/loop.py): `submit` works, `fill` the batch from the waiting
    ones, `run_steps` (engine calls; safe to run on another thread while `submit` goes on),
    then hand the finished works their results with `finish`. A live stream's frames never wait
    behind a recording: they are taken first, and when the batch is full a recording's shard steps
    out between two engine calls (its sequence keeps its state) and resumes when there is room.
    """

    def __init__(self, model: FrameModel, max_batch: int) -> None:
        self.model, self.max_batch = model, max_batch
        self.stats = ModelStats()
        self._urgent: deque[Work] = deque()
        self._bulk: deque[Work] = deque()
        self._active: list[Work] = []

    @property
    def queue_depth(self) -> int:
        return len(self._urgent) + len(self._bulk) + len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._urgent or self._bulk or self._active)

    @property
    def waiting(self) -> int:
        return len(self._urgent) + len(self._bulk)

    def submit(self, work: Work) -> None:
        (self._urgent if work.urgent else self._bulk).append(work)

    def fill(self) -> int:
        """Move waiting works into the batch (one per sequence, in order, live ones first, pushing
        recordings out for them); return the batch size."""
        active = self._active
        for work in [w for w in active if w.cancelled]:  # its caller went away while it ran: stop it here
            active.remove(work)
            self.stats.dropped += 1
            work.on_done(work, Unavailable("cancelled by its caller"))
        if self._urgent and len(active) >= self.max_batch:
            pushed = [w for w in active if not w.urgent][-len(self._urgent) :]
            active[:] = [w for w in active if w not in pushed]
            self._bulk.extendleft(reversed(pushed))  # first again when there is room
        busy = {id(w.sequence) for w in active}
        for queue in (self._urgent, self._bulk):
            skipped: list[Work] = []
            while queue and len(active) < self.max_batch:
                work = queue.popleft()
                if work.cancelled:
                    self.stats.dropped += 1
                    work.on_done(work, Unavailable("cancelled by its caller"))
                    continue
                if id(work.sequence) in busy:
                    skipped.append(work)  # a later request of a sequence already running: keep its order
                else:
                    active.append(work)
                    busy.add(id(work.sequence))
            queue.extendleft(reversed(skipped))
        return len(active)

    def run_steps(self, budget_s: float = 0.0) -> list[tuple[Work, BaseException | None]]:
        """Run engine calls on the current batch until a work finishes, work waits for a free
        slot, or `budget_s` is spent (one call when 0); return the finished works."""
        active = self._active
        deadline = time.perf_counter() + budget_s
        while active:
            started = time.perf_counter_ns()
            sequences = [w.sequence for w in active]
            try:
                feeds = self.model.feeds(sequences, np.stack([w.frames[w.next_frame] for w in active]))
                inputs_ready = time.perf_counter_ns()
                out = self.model.engine.run(feeds, len(active))
                inferred = time.perf_counter_ns()
                probs = self.model.absorb(sequences, feeds, out)
            except Exception as exc:  # an engine failure fails this batch, not the daemon (the loop logs it)
                error = Unavailable(f"engine {self.model.engine.name} failed: {exc}", 500)
                error.__cause__ = exc
                failed: list[tuple[Work, BaseException | None]] = [(w, error) for w in active]
                active.clear()
                return failed
            phases = (inputs_ready - started, inferred - inputs_ready, time.perf_counter_ns() - inferred)
            self.stats.record_execution(len(active), *phases)
            for times in {id(w.times): w.times for w in active if w.times is not None}.values():
                times.add_compute(*phases)  # once per request, however many of its works ran in this call
            finished: list[tuple[Work, BaseException | None]] = []
            for work, p in zip(active, probs):
                work.probs[work.next_frame] = p
                work.next_frame += 1
                if work.next_frame == len(work.frames):
                    finished.append((work, None))
            if finished:
                active[:] = [w for w in active if w.next_frame < len(w.frames)]
                return finished
            room = len(active) < self.max_batch
            # return so `fill` can take waiting works: where there is room, or a recording to push out
            waiting = (self._bulk or self._urgent) and room or (self._urgent and any(not w.urgent for w in active))
            if waiting or time.perf_counter() >= deadline:
                return finished
        return []

    @staticmethod
    def finish(finished: list[tuple[Work, BaseException | None]]) -> None:
        for work, error in finished:
            work.on_done(work, error)

    def fail_all(self, error: BaseException) -> None:
        works = [*self._active, *self._urgent, *self._bulk]
        self._active, self._urgent, self._bulk = [], deque(), deque()
        self.finish([(work, error) for work in works])
