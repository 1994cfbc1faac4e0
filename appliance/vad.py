"""A served VAD model: streaming sequences, whole recordings cut into shards, speech segments.

Lives on the event loop; the engine thread does the work (see engine/scheduler.py).
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable

import numpy as np

from appliance.audio import to_frames
from appliance.engine.base import Engine
from appliance.engine.scheduler import FrameModel, Scheduler, Sequence, SequenceTable, Work
from appliance.errors import BadRequest
from appliance.firmware import Baked, ModelSpec
from appliance.segments import SegmentParams, speech_segments
from appliance.shards import frame_energy, plan_shards


class VadModel:
    def __init__(
        self, spec: ModelSpec, baked: Baked, engine: Engine, *, max_live: int, idle_timeout_s: float,
        queue_delay_s: float, clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.baked, self.clock = spec, baked, clock
        self.frames = FrameModel(spec, engine)
        self.scheduler = Scheduler(self.frames, baked.max_batch, queue_delay_s)
        self.sequences = SequenceTable(self.frames, max_live, idle_timeout_s)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine_name(self) -> str:
        return self.frames.engine.name

    def start(self) -> None:
        self.scheduler.start()

    def stop(self) -> None:
        self.scheduler.stop()

    async def _run(self, sequence: Sequence, frames: np.ndarray) -> np.ndarray:
        if not len(frames):
            return np.empty(0, np.float32)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[np.ndarray] = loop.create_future()

        def settle(work: Work, error: BaseException | None) -> None:
            if future.done():
                return
            if error is None:
                future.set_result(work.probs)
            else:
                future.set_exception(error)

        def done(work: Work, error: BaseException | None) -> None:  # engine thread
            loop.call_soon_threadsafe(settle, work, error)

        sequence.in_flight += 1
        try:
            self.scheduler.submit(Work(sequence, frames, done))
            return await future
        finally:
            sequence.in_flight -= 1

    async def infer_stream(self, samples: np.ndarray, sequence_id: object, start: bool, end: bool) -> np.ndarray:
        """Frames of a live stream; the runtime keeps its state and audio context between calls."""
        frame = self.frames.frame_samples
        if len(samples) % frame:
            raise BadRequest(f"a sequence request carries whole frames: {len(samples)} samples is not a multiple of {frame}")
        now = self.clock()
        sequence = self.sequences.start(sequence_id, now) if start else self.sequences.get(sequence_id, now)
        try:
            return await self._run(sequence, samples.reshape(-1, frame))
        finally:
            if end:
                self.sequences.end(sequence_id)

    async def infer_recording(self, samples: np.ndarray) -> np.ndarray:
        """A whole recording: cut into shards of at most the baked frames, run as one batch, stitched back."""
        frames = to_frames(samples, self.frames.frame_samples)
        plan = plan_shards(frame_energy(frames), self.baked.max_tokens_per_shard, self.baked.split_algorithm)
        runs = []
        for start, end in plan:
            sequence = self.frames.new_sequence()
            if start:  # the audio just before the cut is the shard's context, as it would be in one sequence
                sequence.context = frames[start - 1, -self.frames.context_samples:].copy()
            runs.append(self._run(sequence, frames[start:end]))
        return np.concatenate(await asyncio.gather(*runs)) if runs else np.empty(0, np.float32)

    async def segments(self, samples: np.ndarray, params: SegmentParams) -> list[tuple[int, int]]:
        probs = await self.infer_recording(samples)
        return speech_segments(probs, self.frames.frame_samples, self.frames.sample_rate, len(samples), params)

    def expire_idle(self) -> int:
        return self.sequences.expire(self.clock())
