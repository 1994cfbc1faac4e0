"""The speech_to_text kind: Whisper behind the box's VAD. A recording is cut by the VAD into speech,
packed into shards of at most the baked `max_tokens_per_shard` (20 ms each, Whisper's 30 s window at
most), and every shard of every waiting request runs in one engine call (engine/batch_queue.py,
live streams' shards first); the text comes back in order with segment times. Live streams feed the
VAD chunk by chunk and decode each segment as soon as the VAD closes it. Its tensors, config, query
and answers are the codec in speech_api.py; its routes and live streams are here.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine import cuda
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.sequences import OwnedTable
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.engine.whisper import SAMPLE_RATE, TOKEN_SECONDS, Decoded, Shard, WhisperEngine
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec
from appliance.firmware.manifest import Parameter
from appliance.kinds import speech_api
from appliance.kinds.audio_in import audio_input, decode_upload
from appliance.kinds.base import EngineModel, SequenceCall, ServedModel, Task
from appliance.kinds.segments import SegmentTracker
from appliance.kinds.speech_api import Options, Segment
from appliance.kinds.speech_shards import Packer, ShardPlan
from appliance.kinds.streaming import ndjson
from appliance.kinds.vad import VadModel
from appliance.protocol.messages import Opened, Request, Response
from appliance.protocol.tensors import InferRequest

SHARD_SAMPLES_PER_TOKEN = int(TOKEN_SECONDS * SAMPLE_RATE)  # 320: a token is one encoder position
assert SAMPLE_RATE == speech_api.SAMPLE_RATE


@dataclass(slots=True, eq=False)
class LiveStream:
    """A live stream (an entry of the model's OwnedTable): its VAD's segment tracker, the audio not yet
    decoded, and a sequence of the VAD under its own key (`vad_key`), ended when the stream is dropped."""

    options: Options
    tracker: SegmentTracker
    audio: list[np.ndarray] = field(default_factory=list)
    base: int = 0  # sample position of audio[0]'s first sample
    position: int = 0  # samples received
    client: str = ""
    serial: int = 0
    last_used: float = 0.0
    in_flight: int = 0
    # the decode of the span the VAD is about to close, started while it waits out min_silence_ms
    ahead: tuple[tuple[int, int], asyncio.Task[list[Segment]]] | None = None

    def drop_ahead(self) -> None:
        if self.ahead is not None:
            self.ahead[1].cancel()
            self.ahead = None


class SpeechToText(EngineModel):
    def __init__(
        self,
        spec: ModelSpec,
        bundle: Bundle,
        live: Live,
        loaded: Mapping[str, ServedModel],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.spec, self.live, self.clock, self.baked = spec, live, clock, bundle.manifest.baked
        params = spec.parameters
        vad = loaded.get(str(params["vad"]))
        if not isinstance(vad, VadModel):
            raise ApplianceError(
                f"model {spec.name}: parameters.vad {params['vad']!r} is not a VAD model listed before it"
            )
        self.vad = vad
        self.max_samples = _integer(params, "max_tokens_per_shard") * SHARD_SAMPLES_PER_TOKEN
        self.split_algorithm = str(params["split_algorithm"])
        self.max_batch = _integer(params, "max_batch")
        engine = live.config.engine
        self.engine = WhisperEngine(
            bundle.artifact(spec.file),
            engine.device,
            engine.threads,
            _integer(params, "beam_size"),
            self.baked.fallback_cpu_threshold,
            cuda.memory_used if cuda.cuda is not None else None,
            window_samples=self.max_samples,
        )
        self.stats = ModelStats()
        self.cutting = 0  # recordings in their VAD: their shards are on the way to the batcher
        self.batcher: BatchQueue[Shard, Decoded] = BatchQueue(
            self.engine.run,
            self.max_batch,
            self.stats,
            lambda: live.config.engine.queue_delay_us / 1e6,
            coming=lambda: self.cutting > 0,
        )
        self.sequences: OwnedTable[LiveStream] = OwnedTable(
            lambda: live.config.sequences,
            "streams",
            lambda key, stream: _dropped(stream, vad, vad_key(spec.name, key, stream)),
        )
        self.tasks: Mapping[str, Task] = {"transcribe": self._transcribe_route}

    def start(self) -> None:
        self.batcher.start()

    async def stop(self, timeout_s: float) -> bool:
        return await self.batcher.stop(timeout_s)

    async def probe(self) -> None:
        await self.batcher.submit([Shard(np.zeros(SAMPLE_RATE, np.float32))])[0]

    def metadata(self) -> dict[str, Any]:
        return speech_api.metadata(self.spec, self.engine_name, self.multilingual)

    @property
    def multilingual(self) -> bool:
        return self.engine.tokens.multilingual

    @property
    def queue_depth(self) -> int:
        return self.batcher.waiting

    def config(self) -> dict[str, Any]:
        return speech_api.config(self.spec, self.baked, self.live)

    def check(self, options: Options) -> None:
        self.engine.check(options.language, options.task)
        if not 0.0 <= options.temperature <= 1.0:
            raise BadRequest(f"temperature must be a number from 0 to 1, got {options.temperature}")

    def _shard(self, audio: np.ndarray, options: Options) -> Shard:
        prompt = self.engine.tokens.encode(options.prompt) if options.prompt else ()
        return Shard(audio, options.language, options.task, prompt, options.temperature)

    async def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncIterator[Segment]:
        """The segments of a recording, in order, each as soon as it and those before it are decoded.
        The VAD and Whisper overlap a batch at a time: the shards the VAD fills go to the engine
        together, once it has filled `max_batch` of them or the recording ends (the VAD is some 50
        times faster than Whisper, and one engine call of several windows costs less than each alone)."""
        self.check(options)
        spent = times or RequestTimes()
        packer = Packer(samples, self.max_samples, self.split_algorithm, SAMPLE_RATE)
        shards: asyncio.Queue[asyncio.Task[list[Segment]] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        held: list[ShardPlan] = []

        def send(plans: list[ShardPlan], last: bool = False) -> None:
            held.extend(plans)
            if len(held) >= self.max_batch or last:
                for plan in held:
                    shards.put_nowait(loop.create_task(self._decode(plan, samples, options, spent)))
                held.clear()

        async def cut() -> None:
            self.cutting += 1
            cutting_here = True
            try:
                async for segment in self.vad.segments(samples, self.live.config.vad):
                    send(packer.add(segment))
                self.cutting, cutting_here = self.cutting - 1, False  # before its last shards are sent
                send(packer.finish(), last=True)
            finally:
                if cutting_here:
                    self.cutting -= 1
                shards.put_nowait(None)

        cutting = loop.create_task(cut())
        started: list[asyncio.Task[list[Segment]]] = []
        try:
            while (task := await shards.get()) is not None:
                started.append(task)
                for segment in await task:
                    yield segment
            await cutting  # its error, if it failed
        finally:
            cutting.cancel()
            while not shards.empty():
                if (task := shards.get_nowait()) is not None:
                    started.append(task)
            for task in started:
                task.cancel()

    def _plans(self, samples: np.ndarray, segment: tuple[int, int]) -> list[ShardPlan]:
        """The shards of one segment on its own."""
        packer = Packer(samples, self.max_samples, self.split_algorithm, SAMPLE_RATE)
        return packer.add(segment) + packer.finish()

    async def _decode(
        self,
        plan: ShardPlan,
        samples: np.ndarray,
        options: Options,
        times: RequestTimes,
        urgent: bool = False,
        offset: int = 0,
    ) -> list[Segment]:
        """One shard's segments (times in seconds, `offset` samples added). Text goes to the VAD's
        spans by Whisper's timestamps, a segment per run of spans its pieces join (Whisper's own
        times drift; the VAD's edges do not). Where Whisper stopped before the last spans, those get a
        second pass of their own (a batched window has no seek as openai-whisper's loop has)."""
        shard = self._shard(plan.audio(samples), options)
        done = await self.batcher.submit([shard], (len(shard.prompt), shard.temperature), urgent=urgent)[0]
        times.queue_ns += done.queued_ns
        decoded = done.result
        runs = plan.align([(p.start, p.end, p.text) for p in decoded.pieces], SAMPLE_RATE)
        out = []
        for first, last, text in runs:
            start, end = (offset + plan.spans[first].start) / SAMPLE_RATE, (offset + plan.spans[last].end) / SAMPLE_RATE
            out.append(Segment(round(start, 3), round(end, 3), text, decoded.language))
        # Whisper read up to its last timestamp: the spans that start after it were not heard
        reached = max((p.end for p in decoded.pieces), default=0.0) * SAMPLE_RATE
        heard = sum(1 for span in plan.spans if span.offset < reached)
        if 0 < heard < len(plan.spans):
            packer = Packer(samples, self.max_samples, self.split_algorithm, SAMPLE_RATE)
            rest = [p for span in plan.spans[heard:] for p in packer.add((span.start, span.end))] + packer.finish()
            for found in await asyncio.gather(*(self._decode(p, samples, options, times, True, offset) for p in rest)):
                out += found
        return out

    async def live_chunk(
        self, samples: np.ndarray, sequence: SequenceCall, partial: bool, options: Options, times: RequestTimes
    ) -> tuple[list[Segment], str | None, int | None]:
        """One chunk of a live stream: the segments the VAD closed with it (decoded), the open
        segment's text so far when `partial`, and the stream's serial when this chunk opened it."""
        now = self.clock()
        if sequence.start:
            self.check(options)
            tracker = SegmentTracker(self.vad.frames.frame_samples, self.vad.frames.sample_rate, self.live.config.vad)
            stream = self.sequences.open(sequence.id, now, sequence.client, lambda: LiveStream(options, tracker))
        else:
            stream = self.sequences.get(sequence.id, now, sequence.client)
        serial = stream.serial if sequence.start else None
        stream.in_flight += 1
        try:
            key = vad_key(self.name, sequence.id, stream)
            probs, _ = await self.vad.infer_stream(samples, key, sequence.start, sequence.end, sequence.client)
            stream.audio.append(samples)
            stream.position += len(samples)
            closed = stream.tracker.feed(probs)
            if sequence.end:
                closed += stream.tracker.finish(stream.position)
            audio, base = np.concatenate(stream.audio), stream.base
            decoded = await asyncio.gather(*(self._final(stream, audio, base, span, times) for span in closed))
            text = None
            if partial and not sequence.end and (open_start := stream.tracker.open_start) is not None:
                text = " ".join(
                    s.text for s in await self._decode_live(stream, audio, base, (open_start, stream.position), times)
                )
            if closed:  # what comes next starts at or after the padded end of the last closed segment
                stream.audio, stream.base = [audio[closed[-1][1] - base :]], closed[-1][1]
                audio, base = stream.audio[0], stream.base
            self._decode_ahead(stream, audio, base, sequence.end)
            return [s for found in decoded for s in found], text, serial
        finally:
            stream.in_flight -= 1
            if sequence.end:
                self.sequences.end(sequence.id)

    async def _final(
        self, stream: LiveStream, audio: np.ndarray, base: int, span: tuple[int, int], times: RequestTimes
    ) -> list[Segment]:
        """A closed segment's text: the decode started before the close, where it was of this very span."""
        if stream.ahead is not None and stream.ahead[0] == span:
            task, stream.ahead = stream.ahead[1], None
            return await task
        return await self._decode_live(stream, audio, base, span, times)

    def _decode_ahead(self, stream: LiveStream, audio: np.ndarray, base: int, ending: bool) -> None:
        """Start decoding the span the VAD will close if the silence it hears goes on (the final text
        is then mostly done at the close); drop a decode the speech went on past."""
        closing = None if ending else stream.tracker.closing()
        if closing is not None and not base <= closing[0] < closing[1] <= base + len(audio):
            closing = None  # its padding not heard yet
        if stream.ahead is not None and stream.ahead[0] == closing:
            return
        stream.drop_ahead()
        if closing is not None:
            task = asyncio.get_running_loop().create_task(
                self._decode_live(stream, audio, base, closing, RequestTimes()), name="live-ahead"
            )
            task.add_done_callback(_consume_error)  # a dropped one's error matters to no one
            stream.ahead = (closing, task)

    async def _decode_live(
        self, stream: LiveStream, audio: np.ndarray, base: int, span: tuple[int, int], times: RequestTimes
    ) -> list[Segment]:
        """A span of a live stream's kept `audio` (from stream position `base`), decoded ahead of recordings."""
        plans = self._plans(audio, (span[0] - base, span[1] - base))
        found = await asyncio.gather(*(self._decode(p, audio, stream.options, times, True, base) for p in plans))
        return [s for segments in found for s in segments]

    def samples(self, request: InferRequest) -> np.ndarray:
        """An infer request's audio: samples, or one encoded file (decoded: call it off the event loop)."""
        return audio_input(request.inputs, self.name, SAMPLE_RATE, self.live)

    def recording(self, body: bytes) -> np.ndarray:
        """An uploaded recording as 16 kHz samples, at least MIN_SAMPLES long (call it off the event loop)."""
        return speech_api.long_enough(decode_upload(body, SAMPLE_RATE, self.live))

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        wanted = speech_api.options(request.parameters)
        if sequence is None:
            samples = speech_api.long_enough(await asyncio.to_thread(self.samples, request))
            return speech_api.tensors([s async for s in self.transcribe(samples, wanted, times)]), None
        samples = self.samples(request)
        partial = request.parameters.get("partial", False)
        final, text, serial = await self.live_chunk(samples, sequence, partial, wanted, times)
        outputs = speech_api.tensors(final)
        if text is not None:
            outputs["partial"] = np.array([text.encode()], dtype=object)
        opened = Opened(self.name, sequence.id, serial) if serial is not None and not sequence.end else None
        return outputs, opened

    async def _transcribe_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/transcribe[?stream=true&language=&task=&prompt=&response_format=]: a
        recording's segments (verbose_json unless asked otherwise), or NDJSON lines as they are decoded."""
        stream, response_format, wanted = speech_api.transcribe_query(query)
        self.check(wanted)
        samples = await asyncio.to_thread(self.recording, request.body)
        segments = self.transcribe(samples, wanted)
        duration = round(len(samples) / SAMPLE_RATE, 3)
        if stream:
            return ndjson(
                segments,
                speech_api.segment_json,
                lambda count: {"model_name": self.name, "duration": duration, "segments": count},
                f"streamed transcription by {self.name}",
                {"MODEL": self.name, "REQUEST_ID": request.headers.get("x-request-id", "-")},
            )
        return speech_api.render([s async for s in segments], response_format, wanted.task, duration)

    def expire_idle(self) -> int:
        return self.sequences.expire(self.clock())


def _dropped(stream: LiveStream, vad: VadModel, key: object) -> None:
    """A live stream dropped (ended, expired, replaced): its decode ahead and its VAD sequence go."""
    stream.drop_ahead()
    vad.sequences.end(key)


def _consume_error(task: asyncio.Task[list[Segment]]) -> None:
    if not task.cancelled():
        task.exception()


def vad_key(model: str, key: object, stream: LiveStream) -> object:
    """The key of a live stream's sequence in its VAD's table."""
    return (model, key, stream.serial)


def _integer(params: Mapping[str, Parameter], key: str) -> int:
    value = params[key]
    assert isinstance(value, int), f"{key}: the manifest reader checks its type"
    return value
