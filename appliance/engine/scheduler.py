"""Continuous batching of stateful frame models (the VAD's recurrent state and audio context).

Theory of operation. A *sequence* is one live audio stream: its recurrent state rows and the
last `context_samples` of its audio. A *work* item asks for N frames of one sequence to be run.
The batcher repeatedly takes up to `max_batch` works (at most one per sequence: frames of
one sequence must run in order), stacks one frame of each into a batch, gathers their state
rows, runs the engine once, scatters the new state rows back and moves each work one frame on.
Finished works leave the batch and waiting ones join it between steps, so a stream never waits
for another stream's long request to finish, and concurrent streams share every engine call.

Nothing here knows about asyncio, threads or sockets: works carry a completion callback, the
Batcher runs one engine call when asked, and the SequenceTable takes the time as an argument.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from appliance.config import SequenceConfig
from appliance.engine.interface import Engine
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApiError, ApplianceError, BadRequest, NotFound, TooManyRequests, Unavailable
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

    def new_sequence(self, key: object = None) -> Sequence:
        return Sequence(
            key=key,
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
    key: object
    state: list[np.ndarray]
    context: np.ndarray
    last_used: float = 0.0
    in_flight: int = 0
    serial: int = 0  # tells this sequence apart from an earlier or later one under the same key
    client: str = ""  # who opened it (see protocol.messages.Request.client): only it may use it


class SequenceFactory(Protocol):
    def new_sequence(self, key: object = None) -> Sequence: ...


@dataclass(slots=True, eq=False)
class Work:
    """Frames of one sequence to run; `on_done(work, error)` is called when they all ran, or failed."""

    sequence: Sequence
    frames: np.ndarray
    on_done: Callable[[Work, BaseException | None], None]
    probs: np.ndarray = field(init=False)
    next_frame: int = 0
    cancelled: bool = False  # its caller went away before it started: never run it
    live: bool = False  # a live stream's frames, or a short request's: before recordings, and may push one out
    times: RequestTimes | None = None  # its request's: each engine call it is in adds its compute times once

    def __post_init__(self) -> None:
        self.probs = np.empty(len(self.frames), np.float32)


class SequenceTable:
    """Live sequences by id, bounded in count, expired after an idle time. The caller passes `now`;
    `settings` gives the bounds as the live config holds them now; `model` makes a new sequence."""

    def __init__(self, model: SequenceFactory, settings: Callable[[], SequenceConfig]) -> None:
        self.model, self._settings = model, settings
        self._live: dict[object, Sequence] = {}
        self._per_client: Counter[str] = Counter()
        self._serials = 0

    @property
    def max_live(self) -> int:
        return self._settings().max_live

    @property
    def idle_timeout_s(self) -> float:
        return self._settings().idle_timeout_s

    def __len__(self) -> int:
        return len(self._live)

    def start(self, key: object, now: float, client: str = "") -> Sequence:
        """Open a sequence for `client`; a start on its own live id restarts it (it reconnected)."""
        old = self._live.get(key)
        if old is not None:
            self._check_owner(key, old, client)
            if old.in_flight:
                raise ApiError(f"sequence {key} has a request in flight; it cannot restart until that finishes", 409)
            self._drop(key)
        share = self._settings().max_per_client
        if len(self._live) >= self.max_live or self._per_client[client] >= share:
            self.expire(now)
        if len(self._live) >= self.max_live:
            raise TooManyRequests(
                f"sequence table full ({self.max_live} live sequences): end a sequence or retry later"
            )
        if self._per_client[client] >= share:
            raise TooManyRequests(f"this client holds {share} live sequences, its share: end one or retry later")
        sequence = self.model.new_sequence(key)
        self._serials += 1
        sequence.last_used, sequence.serial, sequence.client = now, self._serials, client
        self._live[key] = sequence
        self._per_client[client] += 1
        return sequence

    def get(self, key: object, now: float, client: str = "") -> Sequence:
        sequence = self._live.get(key)
        if sequence is None:
            raise BadRequest(
                f"sequence {key} is not open (never started, ended, or expired after "
                f"{self.idle_timeout_s:g} s idle): send sequence_start=true first"
            )
        self._check_owner(key, sequence, client)
        sequence.last_used = now
        return sequence

    def end(self, key: object) -> None:
        if key in self._live:
            self._drop(key)

    def holds(self, key: object, serial: int) -> bool:
        sequence = self._live.get(key)
        return sequence is not None and sequence.serial == serial

    def end_opened(self, key: object, serial: int) -> bool:
        """End the sequence under `key` if it is still the one opened with `serial` (a transport
        releasing what its vanished client opened); False if it ended or was reopened meanwhile."""
        if not self.holds(key, serial):
            return False
        self._drop(key)
        return True

    def expire(self, now: float) -> int:
        idle = [k for k, s in self._live.items() if not s.in_flight and now - s.last_used > self.idle_timeout_s]
        for key in idle:
            self._drop(key)
        return len(idle)

    @staticmethod
    def _check_owner(key: object, sequence: Sequence, client: str) -> None:
        """Only the client that opened a sequence may feed, restart or end it; others do not see it."""
        if sequence.client != client:
            raise NotFound(f"sequence {key} belongs to another client")

    def _drop(self, key: object) -> None:
        sequence = self._live.pop(key)
        self._per_client[sequence.client] -= 1
        if not self._per_client[sequence.client]:
            del self._per_client[sequence.client]


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
        self._live: deque[Work] = deque()
        self._bulk: deque[Work] = deque()
        self._active: list[Work] = []

    @property
    def queue_depth(self) -> int:
        return len(self._live) + len(self._bulk) + len(self._active)

    @property
    def busy(self) -> bool:
        return bool(self._live or self._bulk or self._active)

    @property
    def waiting(self) -> int:
        return len(self._live) + len(self._bulk)

    def submit(self, work: Work) -> None:
        (self._live if work.live else self._bulk).append(work)

    def fill(self) -> int:
        """Move waiting works into the batch (one per sequence, in order, live ones first, pushing
        recordings out for them); return the batch size."""
        active = self._active
        if self._live and len(active) >= self.max_batch:
            pushed = [w for w in active if not w.live][-len(self._live) :]
            active[:] = [w for w in active if w not in pushed]
            self._bulk.extendleft(reversed(pushed))  # first again when there is room
        busy = {id(w.sequence) for w in active}
        for queue in (self._live, self._bulk):
            skipped: list[Work] = []
            while queue and len(active) < self.max_batch:
                work = queue.popleft()
                if work.cancelled:
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
            except Exception as exc:  # an engine failure fails this batch, not the daemon
                error = Unavailable(f"engine {self.model.engine.name} failed: {exc}", 500)
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
            waiting = (self._bulk or self._live) and room or (self._live and any(not w.live for w in active))
            if waiting or time.perf_counter() >= deadline:
                return finished
        return []

    @staticmethod
    def finish(finished: list[tuple[Work, BaseException | None]]) -> None:
        for work, error in finished:
            work.on_done(work, error)
