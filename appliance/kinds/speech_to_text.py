"""The speech_to_text kind: Whisper behind the box's VAD. A recording is cut by the VAD into speech,
packed into shards of at most the baked `max_tokens_per_shard` (20 ms each, Whisper's 30 s window at
most), and every shard of every waiting request runs in one engine call (engine/batch_queue.py,
live streams' shards first); the text comes back in order with segment times. Live streams feed the
VAD chunk by chunk and decode each segment as soon as the VAD closes it (live_speech.py). Its
tensors, config, query and answers are the codec in speech_api.py; its routes are here.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, Callable, Hashable, Mapping
from dataclasses import replace
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.sequences import OwnedTable
from appliance.engine.speech_choice import load_speech_engine
from appliance.engine.speech_engine import Decoded, Shard, SpeechEngine
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.engine.whisper_features import SAMPLE_RATE
from appliance.engine.whisper_tokens import TOKEN_SECONDS
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec
from appliance.firmware.manifest import Parameter
from appliance.kinds import speech_api
from appliance.kinds.audio_in import audio_input, decode_upload
from appliance.kinds.base import EngineModel, SequenceCall, ServedModel, Task
from appliance.kinds.counting import counted
from appliance.kinds.live_speech import LiveStream, LiveTranscription, dropped, vad_key
from appliance.kinds.speech_api import Options, Segment
from appliance.kinds.speech_languages import SegmentLanguages
from appliance.kinds.speech_shards import Packer, ShardPlan, placed_words, with_their_sentences
from appliance.kinds.streaming import ndjson, whole
from appliance.kinds.vad import VadModel
from appliance.protocol.messages import Opened, Request, Response
from appliance.protocol.tensors import InferRequest
from appliance.tasks import off_loop

SHARD_SAMPLES_PER_TOKEN = int(TOKEN_SECONDS * SAMPLE_RATE)  # 320: a token is one encoder position
PROMPTS_KEPT = 64  # prompts whose tokens are kept: the sessions and requests using them now
assert SAMPLE_RATE == speech_api.SAMPLE_RATE


class SpeechToText(EngineModel):
    """Recordings cut by the VAD and decoded in shards; its live streams are `streams`' (live_speech.py),
    its segments' languages `segment_languages`' (speech_languages.py)."""

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
        self.vad: VadModel = vad
        self.max_samples: int = _integer(params, "max_tokens_per_shard") * SHARD_SAMPLES_PER_TOKEN
        self.split_algorithm: str = str(params["split_algorithm"])
        self.max_batch = _integer(params, "max_batch")
        engine = live.config.engine
        self.engine: SpeechEngine = load_speech_engine(
            engine.device, bundle, spec, engine.threads, _integer(params, "beam_size"), self.max_samples
        )
        self.weight_bytes = self.engine.weight_bytes
        self.stats = ModelStats()
        self.cutting = 0  # recordings in their VAD: their shards are on the way to the batcher
        self.prompts = Prompts(self.engine.tokens.encode)
        self.batcher: BatchQueue[Shard, Decoded] = BatchQueue(
            self.engine.decoding(self.max_batch),
            self.max_batch,
            self.stats,
            QueuePolicy(spec.name, lambda: live.config.engine, self.stats),
            coming=lambda: self.cutting > 0,
        )
        self.sequences: OwnedTable[LiveStream] = OwnedTable(
            lambda: live.config.sequences,
            "streams",
            lambda key, stream: dropped(stream, vad, vad_key(spec.name, key, stream)),
        )
        self.streams = LiveTranscription(self, self.sequences)
        self.live_chunk, self.hear = self.streams.live_chunk, self.streams.hear
        self.segment_languages = SegmentLanguages(self)
        self.tasks: Mapping[str, Task] = {"transcribe": self._transcribe_route}
        self.loaded = loaded

    def start(self) -> None:
        self.segment_languages.listener = _listener(self, self.loaded)
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
    def languages(self) -> list[str]:
        return list(self.engine.tokens.languages) if self.multilingual else ["en"]

    @property
    def queue_depth(self) -> int:
        return self.batcher.queue_depth

    def config(self) -> dict[str, Any]:
        return speech_api.config(self.spec, self.baked, self.live)

    def check(self, options: Options) -> None:
        self.segment_languages.refer_to_listener(options)
        self.engine.check(options.language, options.task)
        speech_api.check_prompt(options.prompt)
        if not 0.0 <= options.temperature <= 1.0:
            raise BadRequest(f"temperature must be a number from 0 to 1, got {options.temperature}")

    async def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncGenerator[Segment, None]:
        """The segments of a recording, in order, each as soon as it and those before it are decoded.
        The VAD and Whisper overlap a batch at a time: the shards the VAD fills go to the engine
        together, once it has filled `max_batch` of them or the recording ends (the VAD is some 50
        times faster than Whisper, and one engine call of several windows costs less than each alone)."""
        self.check(options)
        options = replace(options, padding=self.live.config.vad.speech_pad_ms * SAMPLE_RATE // 1000)
        spent = times or RequestTimes()
        packer = Packer(samples, self.max_samples, self.split_algorithm, SAMPLE_RATE)
        shards: asyncio.Queue[asyncio.Task[list[Segment]] | None] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        held: list[ShardPlan] = []
        request = object()  # its shards may share Whisper windows, no one else's
        sent = 0

        def send(plans: list[ShardPlan], last: bool = False) -> None:
            nonlocal sent
            held.extend(plans)
            if len(held) >= self.max_batch or last:
                for plan in held:  # the shard's index: every request's first shard goes before anyone's next
                    shards.put_nowait(loop.create_task(self.decode(plan, samples, options, spent, request, index=sent)))
                    sent += 1
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
        previous: Segment | None = None  # what the next segment reads on from
        try:
            while (task := await shards.get()) is not None:
                started.append(task)
                for segment in await task:
                    previous = speech_api.continued(previous, segment)
                    yield previous
            await cutting  # its error, if it failed
        finally:
            cutting.cancel()
            while not shards.empty():
                if (task := shards.get_nowait()) is not None:
                    started.append(task)
            for task in started:
                task.cancel()

    def plans(self, samples: np.ndarray, segments: list[tuple[int, int]]) -> list[ShardPlan]:
        """The shards of these segments on their own."""
        packer = Packer(samples, self.max_samples, self.split_algorithm, SAMPLE_RATE)
        return [p for segment in segments for p in packer.add(segment)] + packer.finish()

    async def decode(
        self,
        plan: ShardPlan,
        samples: np.ndarray,
        options: Options,
        times: RequestTimes,
        request: Hashable,
        urgent: bool = False,
        offset: int = 0,
        index: int = 0,
    ) -> list[Segment]:
        """One shard's segments (times in seconds, `offset` samples added): one per piece of Whisper's
        text between its timestamps (a sentence's tail joined to it), timed in the VAD's spans
        (ShardPlan.timed). Where Whisper stopped before the last spans, those get a second pass of
        their own (a batched window has no seek as openai-whisper's loop has). Shards of one
        `request` may share a Whisper window. Where no language is named, a shard's segments may be
        identified first and decoded by language (speech_languages.py)."""
        if self.segment_languages.identifies(plan, options):
            return await self.segment_languages.by_language(
                plan, samples, options, times, request, urgent, offset, index
            )
        shard = shard_of(plan.audio(samples), options, await self.prompts.tokens(options.prompt), request)
        group = (len(shard.prompt), shard.temperature)
        done = await self.batcher.submit([shard], group, urgent=urgent, first_index=index)[0]
        times.queue_ns = max(times.queue_ns, done.queued_ns)  # the longest its shards waited (side by side)
        decoded = done.result
        out = _segments(decoded, plan, offset)
        # Whisper read up to its last timestamp: the spans that start after it were not heard
        reached = max((p.end for p in decoded.pieces), default=0.0) * SAMPLE_RATE
        heard = sum(1 for span in plan.spans if span.offset < reached)
        if 0 < heard < len(plan.spans):
            rest = self.plans(samples, [(span.start, span.end) for span in plan.spans[heard:]])
            for found in await asyncio.gather(
                *(self.decode(p, samples, options, times, request, True, offset) for p in rest)
            ):
                out += found
        return out

    async def samples(self, request: InferRequest) -> np.ndarray:
        """An infer request's audio: samples, or one encoded file, decoded off the event loop (a live
        chunk's too); samples checked there where they are many."""
        decode = functools.partial(audio_input, request.inputs, self.name, SAMPLE_RATE, self.live)
        if any(array.dtype == object for array in request.inputs.values()):
            return await asyncio.to_thread(decode)
        return await off_loop(sum(array.nbytes for array in request.inputs.values()), decode)

    async def recording(self, body: bytes) -> np.ndarray:
        """An uploaded recording as 16 kHz samples, at least MIN_SAMPLES long, decoded off the event loop;
        refused first when the queue is full (the work and memory of decoding are not spent on it)."""
        self.batcher.check_room()
        return speech_api.long_enough(await asyncio.to_thread(decode_upload, body, SAMPLE_RATE, self.live))

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        wanted = speech_api.options(request.parameters)
        if sequence is None:
            samples = speech_api.long_enough(await self.samples(request))
            return speech_api.tensors(await whole(self.transcribe(samples, wanted, times))), None
        samples = await self.samples(request)
        partial = request.parameters.get("partial", False)
        chunk = await self.live_chunk(samples, sequence, partial, wanted, times)
        outputs = speech_api.tensors(chunk.segments)
        if chunk.partial is not None:
            outputs["partial"] = np.array([chunk.partial.encode()], dtype=object)
        serial = chunk.serial
        opened = Opened(self.name, sequence.id, serial) if serial is not None and not sequence.end else None
        return outputs, opened

    async def _transcribe_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/transcribe[?stream=true&language=&task=&prompt=&response_format=&words=true]:
        a recording's segments (verbose_json unless asked otherwise), or NDJSON lines as they are decoded;
        counted in the statistics as a request of this model."""
        times = RequestTimes()  # filled by its shards' engine calls: the statistics' queue and compute
        return await counted(self.stats, _transcribed(self, request, query, times), times)

    def expire_idle(self) -> int:
        return self.sequences.expire(self.clock())


def _listener(model: SpeechToText, models: Mapping[str, ServedModel]) -> SpeechToText | None:
    """The model that identifies `model`'s segments' languages: itself where it is multilingual, else
    the one `languages_by` names (a multilingual speech_to_text model anywhere in the firmware: all are
    loaded when a model starts), else None."""
    if model.multilingual:
        return model
    name = str(model.spec.parameters.get("languages_by", ""))
    if not name:
        return None
    found = models.get(name)
    if not isinstance(found, SpeechToText) or not found.multilingual:
        raise ApplianceError(
            f"model {model.name}: parameters.languages_by {name!r} is not a multilingual speech_to_text model"
        )
    return found


def _segments(decoded: Decoded, plan: ShardPlan, offset: int) -> list[Segment]:
    """A decoded shard's segments: one per piece of Whisper's text between its timestamps (a sentence's
    tail joined to it), timed in the VAD's spans, `offset` samples added."""
    pieces = with_their_sentences(decoded.pieces)
    timed = plan.timed([(p.start, p.end) for p in pieces], SAMPLE_RATE)
    placed = placed_words(plan, timed, decoded.words, offset, SAMPLE_RATE)
    quality = decoded.quality
    return [
        Segment(
            round((offset + start) / SAMPLE_RATE, 3),
            round((offset + end) / SAMPLE_RATE, 3),
            piece.text,
            decoded.language,
            words,
            decoded.language_probability,
            tokens=piece.tokens,
            temperature=quality.temperature,
            avg_logprob=quality.avg_logprob,
            compression_ratio=quality.compression_ratio,
            no_speech_prob=quality.no_speech_prob,
        )
        for piece, (start, end), words in zip(pieces, timed, placed)
    ]


def shard_of(samples: np.ndarray, options: Options, prompt: tuple[int, ...], request: Hashable) -> Shard:
    return Shard(samples, options.language, options.task, prompt, options.temperature, options.words, request)


async def _transcribed(model: SpeechToText, request: Request, query: dict[str, str], times: RequestTimes) -> Response:
    stream, response_format, wanted = speech_api.transcribe_query(query)
    model.check(wanted)
    samples = await model.recording(request.body)
    segments = model.transcribe(samples, wanted, times)
    duration = round(len(samples) / SAMPLE_RATE, 3)
    if stream:
        return await ndjson(
            segments,
            speech_api.segment_json,
            lambda count: {"model_name": model.name, "duration": duration, "segments": count},
            f"streamed transcription by {model.name}",
            {"MODEL": model.name, "REQUEST_ID": request.headers.get("x-request-id", "-")},
        )
    shown = ("segment", "word") if wanted.words else ("segment",)
    return speech_api.render(await whole(segments), response_format, wanted.task, duration, shown)


class Prompts:
    """Prompts' previous-text tokens, each made once for every shard and turn that shares it (a
    session's prompt serves each of its turns), in a thread: tokenizing is not the event loop's work
    (a 900 KB prompt took 4 s, once per shard)."""

    def __init__(self, encode: Callable[[str], tuple[int, ...]]) -> None:
        self.encode = encode
        self.made: OrderedDict[str, asyncio.Future[tuple[int, ...]]] = OrderedDict()  # the newest last

    async def tokens(self, text: str) -> tuple[int, ...]:
        if not text:
            return ()
        made = self.made.pop(text, None) or asyncio.ensure_future(asyncio.to_thread(self.encode, text))
        self.made[text] = made
        while len(self.made) > PROMPTS_KEPT:
            self.made.popitem(last=False)
        return await asyncio.shield(made)  # one shard's cancellation is not its sharers'


def _integer(params: Mapping[str, Parameter], key: str) -> int:
    value = params[key]
    assert isinstance(value, int), f"{key}: the manifest reader checks its type"
    return value
