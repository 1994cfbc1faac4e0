"""The VAD kind: streaming sequences, whole recordings cut into shards, speech segments.

Everything runs on the event loop; its batches run through an EngineLoop (appliance/engine/loop.py).
Its tensors, config and the `segments` route's query and answers are the codec in vad_api.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any

import numpy as np

from appliance.audio import to_frames
from appliance.config import Live
from appliance.engine.choice import load_engine
from appliance.engine.loop import EngineLoop
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.scheduler import Batcher, FrameModel, Sequence, Work
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec
from appliance.kinds import vad_api
from appliance.kinds.audio_in import audio_input, decode_upload
from appliance.kinds.base import EngineModel, SequenceCall, ServedModel, Task
from appliance.kinds.segments import SegmentParams, SegmentTracker
from appliance.kinds.shards import frame_energy, plan_shards
from appliance.kinds.streaming import ndjson
from appliance.protocol.messages import Opened, Request, Response, json_response
from appliance.protocol.tensors import InferRequest

OFF_LOOP_SAMPLES = 1 << 18  # about 16 s at 16 kHz: longer recordings are framed and planned on a thread
SHORT_RECORDING_FRAMES = 128  # about 4 s: a one-off request this short shares the live streams' lane


class VadModel(EngineModel):
    def __init__(
        self,
        spec: ModelSpec,
        bundle: Bundle,
        live: Live,
        loaded: Mapping[str, ServedModel],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.baked, self.live, self.clock = spec, bundle.manifest.baked, live, clock
        self.engine = engine = load_engine(live.config.engine.device, bundle, spec, live.config.engine.threads)
        self.tasks: Mapping[str, Task] = {"segments": self._segments_route}
        self.frames = FrameModel(spec, engine)
        self.batcher = Batcher(self.frames, self.baked.max_batch)
        self.engine_loop = EngineLoop(
            self.batcher, QueuePolicy(spec.name, lambda: live.config.engine, self.batcher.stats)
        )
        self.sequences: OwnedTable[Sequence] = OwnedTable(lambda: live.config.sequences)
        self.stats = self.batcher.stats

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    def start(self) -> None:
        self.engine_loop.start()

    async def probe(self) -> None:
        probs = await self.infer_recording(np.zeros(self.frames.frame_samples * 2, np.float32))
        if not np.all(np.isfinite(probs)):
            raise ApplianceError(f"model {self.name}: probe inference returned non-finite values")

    def metadata(self) -> dict[str, Any]:
        return vad_api.metadata(self.spec, self.baked, self.engine_name)

    def config(self) -> dict[str, Any]:
        return vad_api.config(self.spec, self.baked, self.live)

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        started = time.perf_counter_ns()
        samples = audio_input(request.inputs, self.name, self.frames.sample_rate)
        try:
            if sequence is None:
                return {vad_api.PROB_OUTPUT: await self.infer_recording(samples, times)}, None
            probs, serial = await self.infer_stream(
                samples,
                sequence.id,
                sequence.start,
                sequence.end,
                sequence.client,
                times,
                sequence.address,
                sequence.principal,
            )
        finally:
            times.queued_since(started, time.perf_counter_ns())
        opened = Opened(self.name, sequence.id, serial) if serial is not None and not sequence.end else None
        return {vad_api.PROB_OUTPUT: probs}, opened

    async def _segments_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/segments[?stream=true&threshold=...]: a recording's speech segments,
        or NDJSON lines as each is final."""
        stream, params = vad_api.segments_query(query, self.live.config.vad)
        rate = self.frames.sample_rate
        self.engine_loop.check_room()  # before the work and memory of decoding it
        samples = await asyncio.to_thread(decode_upload, request.body, rate, self.live)
        summary = {"model_name": self.name, "duration": vad_api.seconds(len(samples), rate)}
        if stream:
            return await ndjson(
                self.segments(samples, params, vad_api.STREAM_CHUNK_FRAMES),
                lambda segment: vad_api.segment_json(*segment, rate),
                lambda count: {**summary, "segments": count},
                f"streamed segments of {self.name}",
                {"MODEL": self.name, "REQUEST_ID": request.headers.get("x-request-id", "-")},
            )
        found = [vad_api.segment_json(*s, rate) async for s in self.segments(samples, params)]
        return json_response(200, {**summary, "segments": found})

    async def stop(self, timeout_s: float) -> bool:
        """False when the engine did not finish its batch in time (see EngineLoop.stop)."""
        return await self.engine_loop.stop(timeout_s)

    def _submit(
        self, sequence: Sequence, frames: np.ndarray, urgent: bool = False, times: RequestTimes | None = None
    ) -> asyncio.Future[np.ndarray]:
        """Queue frames of a sequence for the engine; the future gets their probabilities.
        Cancelling the future before the frames start running drops them from the queue."""
        future: asyncio.Future[np.ndarray] = asyncio.get_running_loop().create_future()

        def done(work: Work, error: BaseException | None) -> None:
            sequence.in_flight -= 1
            if future.done():  # the caller went away
                return
            if error is None:
                future.set_result(work.probs)
            else:
                future.set_exception(error)

        work = Work(sequence, frames, done, urgent=urgent, times=times)
        future.add_done_callback(lambda f: setattr(work, "cancelled", f.cancelled()))
        sequence.in_flight += 1
        self.engine_loop.submit(work)
        return future

    async def infer_stream(
        self,
        samples: np.ndarray,
        sequence_id: object,
        start: bool,
        end: bool,
        client: str = "",
        times: RequestTimes | None = None,
        address: str = "",
        principal: str = "",
    ) -> tuple[np.ndarray, int | None]:
        """Frames of a live stream; the runtime keeps its state and audio context between calls.
        Also the serial of the sequence when this call opened it."""
        frame = self.frames.frame_samples
        if len(samples) % frame:
            raise BadRequest(
                f"a sequence request carries whole frames: {len(samples)} samples is not a multiple of {frame}"
            )
        now = self.clock()
        if start:
            sequence = self.sequences.open(sequence_id, now, client, self.frames.new_sequence, address, principal)
        else:
            sequence = self.sequences.get(sequence_id, now, client)
        serial = sequence.serial if start else None
        try:
            if not len(samples):
                return np.empty(0, np.float32), serial
            return await self._submit(sequence, samples.reshape(-1, frame), urgent=True, times=times), serial
        finally:
            if end:
                self.sequences.end(sequence_id)

    async def recording_chunks(
        self, samples: np.ndarray, chunk_frames: int | None = None, times: RequestTimes | None = None
    ) -> AsyncIterator[np.ndarray]:
        """A whole recording, cut into shards of at most the baked frames, all run as one batch;
        yields its probabilities in order, in pieces of at most `chunk_frames` (a shard when None)
        as soon as each is computed, so a caller can stream long results as they are produced.
        Framing and planning count as the request's compute_input in `times`; a full queue refuses it."""
        with self.engine_loop.admitted():
            framing = time.perf_counter_ns()
            if (
                len(samples) > OFF_LOOP_SAMPLES
            ):  # framing a long recording takes long: not on the loop live streams need
                frames, plan = await asyncio.to_thread(self._shards, samples)
            else:
                frames, plan = self._shards(samples)
            if times is not None:
                times.compute_input_ns += time.perf_counter_ns() - framing
            pieces: list[asyncio.Future[np.ndarray]] = []
            short = len(frames) <= SHORT_RECORDING_FRAMES  # in the live streams' lane: never behind a long recording
            for start, end in plan:
                sequence = self.frames.new_sequence()
                if start:  # the audio just before the cut is the shard's context, as it would be in one sequence
                    sequence.context = frames[start - 1, -self.frames.context_samples :].copy()
                step = chunk_frames or max(end - start, 1)
                pieces += [
                    self._submit(sequence, frames[i : min(i + step, end)], urgent=short, times=times)
                    for i in range(start, end, step)
                ]
            try:
                for piece in pieces:
                    yield await piece
            finally:
                for piece in pieces:
                    piece.cancel()

    def _shards(self, samples: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
        frames = to_frames(samples, self.frames.frame_samples)
        return frames, plan_shards(frame_energy(frames), self.baked.max_tokens_per_shard, self.baked.split_algorithm)

    async def infer_recording(self, samples: np.ndarray, times: RequestTimes | None = None) -> np.ndarray:
        pieces = [p async for p in self.recording_chunks(samples, times=times)]
        return np.concatenate(pieces) if pieces else np.empty(0, np.float32)

    async def segments(
        self, samples: np.ndarray, params: SegmentParams, chunk_frames: int | None = None
    ) -> AsyncGenerator[tuple[int, int], None]:
        """Speech segments (sample positions), each yielded as soon as it is final. Each call is a
        request in the statistics (the segments route's, or a transcription's), a success once it ends."""
        tracker = SegmentTracker(self.frames.frame_samples, self.frames.sample_rate, params)
        started, times, ok = time.perf_counter_ns(), RequestTimes(), False
        try:
            async for probs in self.recording_chunks(samples, chunk_frames, times):
                for segment in tracker.feed(probs):
                    yield segment
            for segment in tracker.finish(len(samples)):
                yield segment
            ok = True
        finally:
            times.queued_since(started, time.perf_counter_ns())
            self.stats.record_request(ok, time.perf_counter_ns() - started, times, time.time_ns() // 1_000_000)

    def expire_idle(self) -> int:
        return self.sequences.expire(self.clock())
