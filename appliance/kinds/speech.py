"""The speech synthesis kind: a Piper voice, text in, 16-bit audio out, a sentence at a time.

A request's text becomes clauses (kinds/text.py), their phonemes (kinds/phonemes.py, the espeak-ng
program), and shards of at most the baked tokens (phoneme ids here): one per sentence for
`semantic`, a longer sentence cut between clauses, a longer clause at the limit; `fixed` cuts all
the phonemes at the limit. The shards of every waiting request run together (engine/batch_queue.py)
on the voice graph (kinds/voice_graph.py), and each request gets its audio back in order, a shard
as soon as it is done, so speech streams before the whole text is synthesised.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.choice import load_engine
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds.base import NoSequences, QueuedModel, SequenceCall, ServedModel, Task
from appliance.kinds.capabilities import MAX_SPEED, MIN_SPEED
from appliance.kinds.phonemes import Phonemes, Voice, phonemize
from appliance.kinds.text import ShardLimits, checked_text, clauses, grouped_by_sentence, plan_shards, utf8
from appliance.kinds.triton_config import model_config
from appliance.kinds.voice_graph import VoiceGraph
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

TEXT, AUDIO = "text", "audio"  # the KServe tensors
IDS_AROUND = 3  # BOS, its pad and EOS around a shard's phonemes; each phoneme takes itself and a pad


class SpeechModel(QueuedModel):
    """A Piper voice served: KServe infer (a BYTES text in, INT16 audio out) and the OpenAI speech route
    (api/openai_speech.py) through `prepare` and `synthesize`."""

    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        self.limits = ShardLimits.of(spec)
        self.tasks: Mapping[str, Task] = {}
        self.sequences = NoSequences()
        self.stats = ModelStats()
        params = spec.parameters
        self.voice_name = str(params["voice"])
        voice = Voice.from_config(bundle.artifact(f"{spec.file}/{params['config']}"))
        graph = dataclasses.replace(spec, file=f"{spec.file}/{params['graph']}")
        engine_config = live.config.engine
        self.engine = engine = load_engine(engine_config.device, bundle, graph, engine_config.threads)
        # side by side single-threaded runs pay on the CPU engine only (see voice_graph.py)
        lanes = engine_config.threads if isinstance(engine, OnnxCpuEngine) else 1
        self.graph = VoiceGraph(engine, voice, lanes)
        self.voice, self.sample_rate, self.language = voice, voice.sample_rate, voice.language
        # one shard of a request per batch: a lone request's first sentence runs alone on every thread
        # (first audio soonest), and concurrent requests share every batch
        self.queue: BatchQueue[tuple[list[int], float], np.ndarray] = BatchQueue(
            self.graph.run, self.limits.max_batch, self.stats, lambda: live.config.engine.queue_delay_us / 1e6, 1
        )

    async def probe(self) -> None:
        audio = np.concatenate([p async for p in self.synthesize(await self.prepare("Ready."), 1.0, RequestTimes())])
        if not audio.size or not np.any(audio):
            raise ApplianceError(f"model {self.name}: the warm-up sentence gave no audio")

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "onnxruntime_onnx",
            "inputs": [{"name": TEXT, "datatype": "BYTES", "shape": [1]}],
            "outputs": [{"name": AUDIO, "datatype": "INT16", "shape": [-1]}],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "voice": self.voice_name,
                "sample_rate": self.sample_rate,
                "speed": [MIN_SPEED, MAX_SPEED],
                "baked": {**dataclasses.asdict(self.baked), **dataclasses.asdict(self.limits)},
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="onnxruntime_onnx", backend="piper", max_batch_size=0,
            inputs=[TensorSpec(TEXT, "BYTES", (1,))], outputs=[TensorSpec(AUDIO, "INT16", (-1,))],
            dynamic_batching=True, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        if sequence is not None:
            raise BadRequest(f"model {self.name} is stateless: it takes no sequence_id")
        text = one_text(request, self.name)
        speed = request.parameters.get("speed", 1.0)
        if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
            raise BadRequest(f"parameters.speed must be a number from {MIN_SPEED} to {MAX_SPEED}")
        pieces = [p async for p in self.synthesize(await self.prepare(text), float(speed), times)]
        return {AUDIO: np.concatenate(pieces)}, None

    async def prepare(self, text: str) -> list[list[int]]:
        """The phoneme ids of each shard of `text`, in order; a 400 when there is nothing to say."""
        phonemes = await phonemize(clauses(text), self.voice.espeak_voice)
        shards = plan_shards(
            grouped_by_sentence(phonemes, lambda p: p.ends_sentence),
            self.limits.max_tokens_per_shard,
            self.limits.split_algorithm,
            _size,
            _cut,
        )
        ids = [self.voice.ids([x for p in shard for x in p.phonemes]) for shard in shards]
        ids = [x for x in ids if len(x) > IDS_AROUND]
        if not ids:
            raise BadRequest("the text has nothing to say (no letters or digits)")
        return ids

    async def synthesize(
        self, shards: list[list[int]], speed: float, times: RequestTimes | None = None
    ) -> AsyncGenerator[np.ndarray, None]:
        """Each shard's samples (INT16 at the voice's rate) in order, each as soon as it is ready.
        Without `times` the request is recorded in the stats here (the API's infer records its own)."""
        started, record = time.perf_counter_ns(), times is None
        times = times or RequestTimes()
        futures = self.queue.submit([(ids, speed) for ids in shards], group=speed)
        ok = False
        try:
            for index, future in enumerate(futures):
                done = await future
                if index == 0:
                    times.queue_ns = done.queued_ns
                yield done.result
            ok = True
        finally:
            for future in futures:
                future.cancel()  # the client went away: shards not yet started are dropped
            elapsed = time.perf_counter_ns() - started
            times.compute_infer_ns = elapsed - times.queue_ns
            if record:
                self.stats.record_request(ok, elapsed, times, time.time_ns() // 1_000_000)


def one_text(request: InferRequest, model: str) -> str:
    """The one BYTES text of an infer request to a text model, as UTF-8 text."""
    array = request.inputs.get(TEXT)
    if set(request.inputs) != {TEXT} or array is None or array.dtype != object or array.size != 1:
        raise BadRequest(f"model {model} takes one input {TEXT!r}: BYTES, one element")
    return checked_text(utf8(array.reshape(-1)[0], TEXT), TEXT)


def _size(run: list[Phonemes]) -> int:
    return IDS_AROUND + 2 * sum(len(p.phonemes) for p in run)


def _cut(run: list[Phonemes], max_tokens: int) -> list[list[Phonemes]]:
    """Phonemes cut at the limit: each piece at most `max_tokens` ids."""
    flat = [x for p in run for x in p.phonemes]
    step = max(1, (max_tokens - IDS_AROUND) // 2)
    return [[Phonemes(flat[i : i + step], True)] for i in range(0, len(flat), step)]
