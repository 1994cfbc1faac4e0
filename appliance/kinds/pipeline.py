"""The speech pipeline kind: speech in, translated speech out, as Triton's ensembles chain models, from
models the firmware lists before it: a speech_to_text model (the VAD behind it cuts the speech),
text_translation pairs where the target asks for one, and a voice per target language.

Per segment of speech the VAD closes: Whisper transcribes it, or translates it to English where the
target is English and the model is multilingual; a pair translates the text where its language is
not the target's; the target's voice speaks it. A whole recording answers each segment as soon as it
is spoken (the `interpret` route, NDJSON) or all at once (KServe infer); a live stream of chunks under
Triton's sequence parameters answers each chunk with the segments that closed in it. Every answer
carries each stage's text, for subtitles.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.engine.sequences import ScopedSequences
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, BadRequest
from appliance.firmware import Bundle, ModelSpec, TensorSpec
from appliance.kinds.audio_in import decode_upload
from appliance.kinds.base import SequenceCall, ServedModel, Task
from appliance.kinds.capabilities import Speaker, SpokenVoice, Translator
from appliance.kinds.speech_api import SAMPLE_RATE, Options, Segment
from appliance.kinds.speech_to_text import SpeechToText
from appliance.kinds.streaming import ndjson
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened, Request, Response
from appliance.protocol.tensors import InferRequest

OUTPUTS = ("audio", "text", "source_text", "start", "end")
# Below this probability Whisper's language detection is a guess: the answer line says so.
LOW_LANGUAGE_PROBABILITY = 0.5


@dataclass(frozen=True, slots=True)
class Interpreted:
    """One segment through every stage."""

    segment: Segment  # its times, its text as heard (or as Whisper translated it), its language
    text: str  # in the target language
    audio: np.ndarray  # INT16 at the voice's rate
    note: str = ""  # why it is not spoken, or why to doubt it (the language Whisper heard)

    def as_json(self, sample_rate: int) -> dict[str, Any]:
        s = self.segment
        line = {
            "start": s.start,
            "end": s.end,
            "language": s.language,
            "language_probability": s.language_probability,
            "source_text": s.text,
            "text": self.text,
            "sample_rate": sample_rate,
            "audio": base64.b64encode(self.audio.astype("<i2").tobytes()).decode(),
        }
        return {**line, "note": self.note} if self.note else line


@dataclass(frozen=True, slots=True)
class Plan:
    """How one request's speech goes through the stages."""

    options: Options  # the speech_to_text model's: its language where known, transcribe or translate
    target: str
    speaker: Speaker  # the model whose `voice` speaks the target
    voice: str


class SpeechPipeline:
    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        params = spec.parameters
        self.stt = _loaded(spec, loaded, str(params["speech_to_text"]), SpeechToText)
        names = params["voices"]
        pairs = params["translations"]
        assert isinstance(names, list) and isinstance(pairs, list)
        voices = [_voice(spec, loaded, str(name)) for name in names]
        # the first voice of a language speaks it
        self.voices = {v.language: (model, v) for model, v in reversed(voices)}
        self.pairs = {(t.source, t.target): t for t in (_loaded(spec, loaded, n, Translator) for n in pairs)}
        if not self.voices:
            raise ApplianceError(f"model {spec.name}: parameters.voices names no voice")
        self.default_target = voices[0][1].language
        self.stats = ModelStats()
        self.sequences = ScopedSequences(self.stt.sequences, self.name)  # live streams: the stt model's
        self.tasks: Mapping[str, Task] = {"interpret": self._interpret_route}

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def engine_name(self) -> str:
        return "pipeline"

    @property
    def fallbacks(self) -> Mapping[str, int]:
        return {}

    @property
    def queue_depth(self) -> int:
        return 0  # its stages' models queue the work

    def start(self) -> None:
        pass  # its stages are models of their own, started by the daemon

    async def stop(self, timeout_s: float) -> bool:
        return True

    def expire_idle(self) -> int:
        return 0

    async def probe(self) -> None:
        pass  # each stage warmed up as a model of its own

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "ensemble",
            "inputs": [
                {
                    "name": "audio",
                    "datatype": "FP32",
                    "shape": [-1],
                    "parameters": {"accepts": ["FP32", "INT16", "BYTES"], "sample_rate": 16000},
                }
            ],
            "outputs": [_tensor(t) for t in self._outputs()],
            "parameters": {
                "kind": self.spec.kind,
                "steps": self._steps(),
                "targets": self.targets(),
                "stateful": True,
            },
        }

    def config(self) -> dict[str, Any]:
        config = model_config(
            self.spec, self.baked, self.live, platform="ensemble", backend="", max_batch_size=0,
            inputs=[TensorSpec("audio", "FP32", (-1,))], outputs=self._outputs(), dynamic_batching=False, stateful=True,
        )  # fmt: skip
        config["ensemble_scheduling"] = {"step": [{"model_name": name} for name in self._steps()]}
        config["targets"] = self.targets()
        return config

    def targets(self) -> dict[str, dict[str, Any]]:
        """Each target language: its voice and the paths that reach it (speech heard in which language,
        through which models); a target no path reaches is listed with none."""
        multilingual = self.stt.multilingual
        out = {}
        for language, (model, voice) in sorted(self.voices.items()):
            paths = [{"from": language, "through": [self.stt.name]}]  # heard in it: transcribed, spoken
            paths += [
                {"from": s, "through": [self.stt.name, pair.name]}
                for (s, t), pair in self.pairs.items()
                if t == language
            ]
            if language == "en" and multilingual:
                paths.append({"from": "any", "through": [f"{self.stt.name} (translate)"]})
            if language != "en" and not multilingual:
                paths = [p for p in paths if p["from"] == "en"]
            if not self.reachable(language):  # heard and spoken in it alone is no interpretation: a 400
                paths = []
            out[language] = {"voice": voice.name, "model": model.name, "paths": paths}
        return out

    def reachable(self, target: str) -> bool:
        """A target with a path from speech in another language (a pair, or Whisper's translation)."""
        multilingual = self.stt.multilingual
        return any(t == target for _, t in self.pairs) or (target == "en" and multilingual)

    def _outputs(self) -> list[TensorSpec]:
        return [
            TensorSpec("audio", "INT16", (-1,)),
            *(TensorSpec(n, "BYTES", (-1,)) for n in ("text", "source_text")),
            *(TensorSpec(n, "FP32", (-1,)) for n in ("start", "end")),
        ]

    def _steps(self) -> list[str]:
        return [
            self.stt.vad.name,
            self.stt.name,
            *(m.name for m in self.pairs.values()),
            *dict.fromkeys(model.name for model, _ in self.voices.values()),
        ]

    # --- the work -------------------------------------------------------------------------------

    def plan(self, target: str | None, source: str | None = None) -> Plan:
        """How a request's speech goes through the stages; a 400 for a target no voice speaks.

        Whisper translates to English itself where the target is English, the model is multilingual
        and no pair covers the source the caller names; else it transcribes (in `source` where named)
        and a pair translates each segment whose language is not the target's."""
        target = (target or self.default_target).lower()
        spoken = self.voices.get(target)
        reachable = [t for t in sorted(self.voices) if self.reachable(t)]
        if spoken is None:
            raise BadRequest(f"no voice speaks {target[:20]!r} (targets: {', '.join(reachable)})")
        if not self.reachable(target):
            raise BadRequest(
                f"no path to {target!r}: no translation reaches it in this firmware (targets: {', '.join(reachable)})"
            )
        source = source.lower() if source else None
        if source is not None and source != target and (source, target) not in self.pairs and target != "en":
            raise BadRequest(f"no translation from {source[:20]!r} to {target!r} in this firmware")
        multilingual = self.stt.multilingual
        by_whisper = target == "en" and multilingual and source != target and (source, target) not in self.pairs
        options = Options(language=source, task="translate" if by_whisper else "transcribe")
        self.stt.check(options)  # a source Whisper does not know is a 400 here, before the answer starts
        return Plan(options, target, spoken[0], spoken[1].name)

    async def interpret(self, segment: Segment, plan: Plan) -> Interpreted | None:
        """One segment through translation and speech; None where there is nothing to say."""
        heard = segment.text.strip()
        if not heard:
            return None
        language = "en" if plan.options.task == "translate" else segment.language
        silent = np.zeros(0, np.int16)
        doubt = ""
        if segment.language_probability < LOW_LANGUAGE_PROBABILITY:
            doubt = f"Whisper heard {segment.language!r} with probability {segment.language_probability:.2f} only"
        text = heard
        if language != plan.target:
            pair = self.pairs.get((language, plan.target))
            if pair is None:  # the segment alone is not spoken; the stream goes on
                sources = ", ".join(sorted(s for s, t in self.pairs if t == plan.target)) or "none"
                note = f"heard {language!r}: no path from it to {plan.target!r} (from: {sources}); not spoken"
                return Interpreted(segment, "", silent, f"{doubt}; {note}" if doubt else note)
            text = await pair.translate(heard)
        try:
            shards = await plan.speaker.prepare(text, plan.voice)
        except BadRequest:  # nothing a voice can say ("..."): the text alone
            return Interpreted(segment, text, silent, doubt)
        pieces = [p async for p in plan.speaker.synthesize(shards, 1.0, voice=plan.voice)]
        return Interpreted(segment, text, np.concatenate(pieces), doubt)

    async def recording(
        self, samples: np.ndarray, plan: Plan, times: RequestTimes
    ) -> AsyncGenerator[Interpreted, None]:
        """A whole recording's segments through every stage, each as soon as it is done."""
        async with contextlib.aclosing(self.stt.transcribe(samples, plan.options, times)) as segments:
            async for segment in segments:  # closed at once when its client leaves
                if (done := await self.interpret(segment, plan)) is not None:
                    yield done

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        languages = [request.parameters.get(name) for name in ("target", "source")]
        if not all(code is None or isinstance(code, str) for code in languages):
            raise BadRequest("parameters.target and parameters.source must be language codes")
        plan = self.plan(*languages)
        if sequence is None:
            samples = await asyncio.to_thread(self.stt.samples, request)
            return _tensors([d async for d in self.recording(samples, plan, times)]), None
        samples = self.stt.samples(request)
        inner = dataclasses.replace(sequence, id=self.sequences.key(sequence.id))
        chunk = await self.stt.live_chunk(samples, inner, False, plan.options, times)
        done = [d for s in chunk.segments if (d := await self.interpret(s, plan)) is not None]
        serial = chunk.serial
        opened = Opened(self.name, sequence.id, serial) if serial is not None and not sequence.end else None
        return _tensors(done), opened

    async def _interpret_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/interpret[?to=LANG&from=LANG]: a recording in (WAV, FLAC, Ogg), NDJSON
        out: a line per segment as soon as it is spoken (times, each stage's text, base64 PCM16), then
        a summary line with "done"."""
        unknown = sorted(set(query) - {"to", "from"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0][:40]!r} (known: to, from)")
        plan = self.plan(query.get("to"), query.get("from"))  # a 400 before any work
        samples = await asyncio.to_thread(decode_upload, request.body, SAMPLE_RATE, self.live)
        duration = round(len(samples) / SAMPLE_RATE, 3)
        return await ndjson(
            self._recorded(samples, plan),
            lambda done: done.as_json(plan.speaker.sample_rate),
            lambda count: {"model_name": self.name, "duration": duration, "segments": count},
            f"interpretation by {self.name}",
            {"MODEL": self.name, "REQUEST_ID": request.headers.get("x-request-id", "-")},
        )

    async def _recorded(self, samples: np.ndarray, plan: Plan) -> AsyncGenerator[Interpreted, None]:
        """`recording`, counted in the stats as one request when it ends (done, failed or abandoned)."""
        started, times, ok = time.perf_counter_ns(), RequestTimes(), False
        interpreted = self.recording(samples, plan, times)
        try:
            async for done in interpreted:
                yield done
            ok = True
        finally:
            await interpreted.aclose()
            self.stats.record_request(ok, time.perf_counter_ns() - started, times, time.time_ns() // 1_000_000)


def _loaded(spec: ModelSpec, loaded: Mapping[str, ServedModel], name: str, kind: type) -> Any:
    model = loaded.get(name)
    if not isinstance(model, kind):
        raise ApplianceError(f"model {spec.name}: {name!r} is not a {kind.__name__} model listed before it")
    return model


def _voice(spec: ModelSpec, loaded: Mapping[str, ServedModel], name: str) -> tuple[Speaker, SpokenVoice]:
    """A voice the pipeline names: a voice of a speech model listed before it, or such a model (its first voice)."""
    speakers = [m for m in loaded.values() if isinstance(m, Speaker)]
    for model in speakers:
        if name in model.voices:
            return model, model.voices[name]
    for model in speakers:
        if model.name == name:
            return model, model.voice(None)
    raise ApplianceError(f"model {spec.name}: {name!r} is not a voice of a speech model listed before it")


def _tensors(done: list[Interpreted]) -> dict[str, np.ndarray]:
    return {
        "audio": np.concatenate([d.audio for d in done]) if done else np.zeros(0, np.int16),
        "text": np.array([d.text.encode() for d in done], dtype=object),
        "source_text": np.array([d.segment.text.encode() for d in done], dtype=object),
        "start": np.array([d.segment.start for d in done], np.float32),
        "end": np.array([d.segment.end for d in done], np.float32),
    }


def _tensor(t: TensorSpec) -> dict[str, Any]:
    return {"name": t.name, "datatype": t.datatype, "shape": list(t.shape)}
