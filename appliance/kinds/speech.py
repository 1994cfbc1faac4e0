"""The speech synthesis kinds: text in, 16-bit audio out, a sentence at a time, in one of the model's
voices: a Piper voice (kind speech_synthesis) or Kokoro's voices (kind kokoro_speech), each a
speaker (kinds/speakers.py, kinds/kokoro.py).

A request's text becomes clauses (kinds/text.py), their phonemes (kinds/phonemes.py, the espeak-ng
program, in the voice's language), and shards of at most the baked tokens (the speaker's ids): one
per sentence for `semantic`, a longer sentence cut between clauses, a longer clause at the limit;
`fixed` cuts all the phonemes at the limit. The shards of every waiting request run together
(engine/batch_queue.py) on the speaker, and each request gets its audio back in order, a shard as
soon as it is done, so speech streams before the whole text is synthesised.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue, Done
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds.base import NoSequences, QueuedModel, SequenceCall, ServedModel, Task, stateless
from appliance.kinds.capabilities import MAX_SPEED, MIN_SPEED, SpokenVoice
from appliance.kinds.phonemes import Phonemes, phonemize
from appliance.kinds.speakers import PiperSpeaker, Shard, VoiceBackend
from appliance.kinds.text import ShardLimits, checked_text, clauses, grouped_by_sentence, plan_shards, utf8
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

TEXT, AUDIO = "text", "audio"  # the KServe tensors
VOICE = "voice"  # the KServe parameter naming one of the model's voices
SHARDS_AHEAD = 2  # of a request's sentences, queued ahead of the one its client is taking


class SpeechModel(QueuedModel):
    """A voice backend's voices served (kind speech_synthesis: a Piper voice): KServe infer (a BYTES text
    in, INT16 audio out) and the OpenAI speech route (api/openai_speech.py) through `prepare` and
    `synthesize`."""

    def __init__(
        self,
        spec: ModelSpec,
        bundle: Bundle,
        live: Live,
        loaded: Mapping[str, ServedModel],
        speaker: VoiceBackend | None = None,
    ) -> None:
        speaker = speaker or PiperSpeaker(spec, bundle, live)
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        self.limits = ShardLimits.of(spec)
        self.tasks: Mapping[str, Task] = {}
        self.sequences = NoSequences()
        self.stats = ModelStats()
        self.speaker, self.engine, self.sample_rate = speaker, speaker.engine, speaker.sample_rate
        self.voices: Mapping[str, SpokenVoice] = speaker.voices
        self.voice_name = next(iter(self.voices))  # the model's default voice
        self.language = self.voices[self.voice_name].language
        # one shard of a request per batch: a lone request's first sentence runs alone on every thread
        # (first audio soonest), and concurrent requests share every batch
        self.queue: BatchQueue[Shard, np.ndarray] = BatchQueue(
            speaker.run,
            self.limits.max_batch,
            self.stats,
            QueuePolicy(spec.name, lambda: live.config.engine, self.stats),
            1,
        )

    async def probe(self) -> None:
        shards = await self.prepare("Ready.")
        audio = np.concatenate([p async for p in self.synthesize(shards, 1.0, RequestTimes())])
        if not audio.size or not np.any(audio):
            raise ApplianceError(f"model {self.name}: the warm-up sentence gave no audio")

    def voice(self, name: object | None) -> SpokenVoice:
        """One of the model's voices by name (None: its default); a 400 naming them for another."""
        if name is None:
            return self.voices[self.voice_name]
        found = self.voices.get(name) if isinstance(name, str) else None
        if found is None:
            raise BadRequest(f"model {self.name} has no voice {str(name)[:80]!r} (voices: {', '.join(self.voices)})")
        return found

    def listing(self) -> list[dict[str, Any]]:
        """The model's voices, for GET /v1/audio/voices and the metadata."""
        return [
            {"name": v.name, "language": v.language, "model": self.name, "sample_rate": self.sample_rate}
            for v in self.voices.values()
        ]

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": TEXT, "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": AUDIO, "datatype": "INT16", "shape": [-1]}],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "voice": self.voice_name,
                "language": self.language,  # what it speaks (the box's page picks a voice by it)
                "voices": self.listing(),
                "sample_rate": self.sample_rate,
                "speed": [MIN_SPEED, MAX_SPEED],
                "baked": {**dataclasses.asdict(self.baked), **dataclasses.asdict(self.limits)},
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="onnxruntime_onnx", backend=self.speaker.backend, max_batch_size=0,
            inputs=[TensorSpec(TEXT, "BYTES", (1,))], outputs=[TensorSpec(AUDIO, "INT16", (-1,))],
            dynamic_batching=True, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        stateless(self.name, sequence)
        text = one_text(request, self.name)
        speed = request.parameters.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise BadRequest(f"parameters.speed must be a number from {MIN_SPEED} to {MAX_SPEED}")
        voice = self.voice(request.parameters.get(VOICE)).name
        pieces = [p async for p in self.synthesize(await self.prepare(text, voice), float(speed), times, voice)]
        return {AUDIO: np.concatenate(pieces)}, None

    async def prepare(self, text: str, voice: str | None = None) -> list[list[int]]:
        """The ids of each shard of `text` in `voice` (the default where None), in order; a 400 when
        there is nothing to say."""
        spoken = self.voice(voice)
        speaker = self.speaker
        phonemes = await phonemize(clauses(text), spoken.espeak_voice, speaker.tie)
        around, per = speaker.ids_around, speaker.ids_per_phoneme

        def size(run: list[Phonemes]) -> int:
            return around + per * sum(len(p.phonemes) for p in run)

        def cut(run: list[Phonemes], max_tokens: int) -> list[list[Phonemes]]:
            """Phonemes cut at the limit: each piece at most `max_tokens` ids."""
            flat = [x for p in run for x in p.phonemes]
            step = max(1, (max_tokens - around) // per)
            return [[Phonemes(flat[i : i + step], True)] for i in range(0, len(flat), step)]

        shards = plan_shards(
            grouped_by_sentence(phonemes, lambda p: p.ends_sentence),
            self.limits.max_tokens_per_shard,
            self.limits.split_algorithm,
            size,
            cut,
        )
        ids = [speaker.ids(spoken.name, [x for p in shard for x in p.phonemes]) for shard in shards]
        bare = len(speaker.ids(spoken.name, []))
        ids = [x for x in ids if len(x) > bare]
        if not ids:
            raise BadRequest("the text has nothing to say (no letters or digits the voice can speak)")
        return ids

    def synthesize(
        self, shards: list[list[int]], speed: float, times: RequestTimes | None = None, voice: str | None = None
    ) -> AsyncGenerator[np.ndarray, None]:
        """Each shard's samples (INT16 at the voice's rate) in order, each as soon as it is ready.
        Without `times` the request is recorded in the stats here (the API's infer records its own).
        An unknown voice is a 400 and a full queue refuses the request here (QueueFull), before any audio."""
        return self._synthesized(shards, speed, self.voice(voice).name, self.queue.new_owner(), times)

    async def _synthesized(
        self, shards: list[list[int]], speed: float, name: str, owner: int, times: RequestTimes | None
    ) -> AsyncGenerator[np.ndarray, None]:
        started, record = time.perf_counter_ns(), times is None
        times = times or RequestTimes()
        ahead: deque[asyncio.Future[Done[np.ndarray]]] = deque()
        ok = False
        try:
            for index in range(len(shards)):
                # the next SHARDS_AHEAD sentences are queued, no more: a client that does not read
                # (its transport stops pulling) stops the synthesis for it
                while (submitted := index + len(ahead)) < min(len(shards), index + SHARDS_AHEAD):
                    ahead += self.queue.submit(
                        [(shards[submitted], speed, name)], speed, owner=owner, first_index=submitted
                    )
                done = await ahead.popleft()
                if index == 0:
                    times.queue_ns = done.queued_ns
                yield done.result
            ok = True
        finally:
            for future in ahead:
                future.cancel()  # the client went away: shards not yet started are dropped
            elapsed = time.perf_counter_ns() - started
            if record:
                self.stats.record_request(ok, elapsed, times, time.time_ns() // 1_000_000)


def one_text(request: InferRequest, model: str) -> str:
    """The one BYTES text of an infer request to a text model, as UTF-8 text."""
    array = request.inputs.get(TEXT)
    if set(request.inputs) != {TEXT} or array is None or array.dtype != object or array.size != 1:
        raise BadRequest(f"model {model} takes one input {TEXT!r}: BYTES, one element")
    return checked_text(utf8(array.reshape(-1)[0], TEXT), TEXT)
