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
from appliance.kinds.interpret_routes import ANY, PIVOT, asked, route, routes_from, sources, target_of, transcribed
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
    sample_rate: int  # the voice's
    target: str  # the language it was put into
    route: tuple[str, ...]  # the models it went through (interpret_routes.py); empty where there was none
    note: str = ""  # why it is not spoken, or why to doubt it (the language Whisper heard)

    def as_json(self) -> dict[str, Any]:
        s = self.segment
        line = {
            "start": s.start,
            "end": s.end,
            "language": s.language,
            "language_probability": s.language_probability,
            "source_text": s.text,
            "target": self.target,
            "text": self.text,
            "route": " > ".join(self.route),
            "sample_rate": self.sample_rate,
            "audio": base64.b64encode(self.audio.astype("<i2").tobytes()).decode(),
        }
        return {**line, "note": self.note} if self.note else line


async def interpreted(pipeline: SpeechPipeline, segment: Segment, plan: Plan) -> Interpreted | None:
    """One segment through its route (interpret_routes.py) and its target's voice, whole; or None."""
    answered = await pipeline.answer(segment, plan)
    if answered is None:
        return None
    done, voice = answered
    pieces = [p async for p in voice]
    return dataclasses.replace(done, audio=np.concatenate(pieces)) if pieces else done


def _way(pipeline: SpeechPipeline, segment: Segment, plan: Plan) -> tuple[str, Any]:
    """A segment's target language and its route there (None where none reaches it)."""
    target = plan.target(segment.language)
    return target, route(segment.language, target, set(pipeline.pairs), pipeline.stt.multilingual)


def _doubt(segment: Segment) -> str:
    """Why to doubt a segment's language (Whisper's detection was a guess), or nothing."""
    if segment.language_probability >= LOW_LANGUAGE_PROBABILITY:
        return ""
    return f"Whisper heard {segment.language!r} with probability {segment.language_probability:.2f} only"


async def _nothing() -> AsyncGenerator[np.ndarray, None]:
    """A voice that says nothing."""
    return
    yield


@dataclass(frozen=True, slots=True)
class Plan:
    """How one request's speech goes through the stages: one way into `targets[0]`, or, with two targets,
    conversation mode: each turn into the other language (a turn in neither goes into the first)."""

    options: Options  # the speech_to_text model's: its language where known, which languages it transcribes
    targets: tuple[str, ...]

    def target(self, heard: str) -> str:
        """The language a turn heard in `heard` goes into."""
        return target_of(self.targets, heard)


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
        # conversation mode's two languages where none are asked: the first two the voices speak that a
        # route reaches (the firmware's order); one way where there is no second
        reached = dict.fromkeys(v.language for _, v in voices if self.reachable(v.language))
        self.conversation = tuple(reached)[:2] if len(reached) >= 2 else (self.default_target,)
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
        """Each target language: its voice and the routes that reach it (speech heard in which language,
        through which models, best first: interpret_routes.py); a target no route reaches has none."""
        out = {}
        for language, (model, voice) in sorted(self.voices.items()):
            pairs, heard = set(self.pairs), sources((language,), set(self.pairs))
            found = routes_from(heard, lambda _: language, pairs, self.stt.multilingual)
            paths = [
                {"from": "any" if h == ANY else h, "through": r.steps(self.stt.name, voice.name)[:-1]}
                for h, _, r in found
            ]  # heard and spoken in it alone is no interpretation (a 400): no path
            out[language] = {
                "voice": voice.name,
                "model": model.name,
                "paths": paths if self.reachable(language) else [],
            }
        return out

    def reachable(self, target: str) -> bool:
        """A target with a route from speech in another language (a pair, or Whisper's translation)."""
        return any(t == target for _, t in self.pairs) or (target == PIVOT and self.stt.multilingual)

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

    def plan(self, target: str | None, source: str | None = None, languages: str | None = None) -> Plan:
        """How a request's speech goes through the stages; a 400 for a target no voice speaks or no route
        reaches, or a source no route leaves. `target`: one way; else conversation mode between
        `languages` ("en,pt"), by default the first two the voices speak."""
        targets = asked(target, languages) or self.conversation
        for code in targets:
            self._check_target(code)
        source = source.lower() if source else None
        pairs, multilingual = set(self.pairs), self.stt.multilingual
        keep = transcribed(targets, pairs, multilingual) if multilingual else ()
        translated = False
        if source is not None:
            found = route(source, target_of(targets, source), pairs, multilingual)
            if found is None:
                raise BadRequest(f"no route from {source[:20]!r} to {'/'.join(targets)!r} in this firmware")
            translated, keep = found.whisper_translates, ()
        task, conversation = "translate" if translated else "transcribe", targets if len(targets) == 2 else ()
        options = Options(source, task, transcribed=keep, conversation=conversation)
        self.stt.check(options)  # a source Whisper does not know is a 400 here, before the answer starts
        return Plan(options, targets)

    def _check_target(self, target: str) -> None:
        reachable = [t for t in sorted(self.voices) if self.reachable(t)]
        if target not in self.voices:
            raise BadRequest(f"no voice speaks {target[:20]!r} (targets: {', '.join(reachable)})")
        if not self.reachable(target):
            raise BadRequest(
                f"no path to {target!r}: no translation reaches it in this firmware (targets: {', '.join(reachable)})"
            )

    def routes(self, plan: Plan) -> str:
        """The routes a plan's speech takes by the language heard ("*" any other): the `x-route` header."""
        pairs = set(self.pairs)
        heard = sources(plan.targets, pairs) if plan.options.language is None else [plan.options.language]
        found = routes_from(heard, plan.target, pairs, self.stt.multilingual)
        return "; ".join(f"{h}={'>'.join(r.steps(self.stt.name, self.voices[t][1].name))}" for h, t, r in found)

    async def answer(self, segment: Segment, plan: Plan) -> tuple[Interpreted, AsyncGenerator[np.ndarray, None]] | None:
        """One segment translated (no audio in its `Interpreted`) and its voice, a sentence's INT16 samples at a
        time as made: one not read (a Realtime response.cancel) is never made. None: nothing to say."""
        heard = segment.text.strip()
        if not heard:
            return None
        target, found = _way(self, segment, plan)
        speaker, voice = self.voices[target]
        silent, doubt = np.zeros(0, np.int16), _doubt(segment)
        if found is None:
            note = f"heard {segment.language!r}: no route from it to {target!r}; not spoken"
            return Interpreted(
                segment, "", silent, speaker.sample_rate, target, (), "; ".join(filter(None, (doubt, note)))
            ), _nothing()
        steps = tuple(found.steps(self.stt.name, voice.name))
        text = heard
        for pair in found.pairs:
            text = await self.pairs[pair].translate(text)
        done = Interpreted(segment, text, silent, speaker.sample_rate, target, steps, doubt)
        try:
            shards = await speaker.prepare(text, voice.name)
        except BadRequest:  # nothing a voice can say ("..."): the text alone
            return done, _nothing()
        return done, speaker.synthesize(shards, 1.0, voice=voice.name)

    def heading(self, segment: Segment, plan: Plan) -> tuple[str, tuple[str, ...]]:
        """Before an answer is made: its target language and its route's models (none where none reaches)."""
        target, found = _way(self, segment, plan)
        return target, tuple(found.steps(self.stt.name, self.voices[target][1].name)) if found else ()

    async def recording(
        self, samples: np.ndarray, plan: Plan, times: RequestTimes
    ) -> AsyncGenerator[Interpreted, None]:
        """A whole recording's segments through every stage, each as soon as it is done."""
        async with contextlib.aclosing(self.stt.transcribe(samples, plan.options, times)) as segments:
            async for segment in segments:  # closed at once when its client leaves
                if (done := await interpreted(self, segment, plan)) is not None:
                    yield done

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        languages = [request.parameters.get(name) for name in ("target", "source")]
        if not all(code is None or isinstance(code, str) for code in languages):
            raise BadRequest("parameters.target and parameters.source must be language codes")
        plan = self.plan(languages[0] or self.default_target, languages[1])  # one way: its audio at one rate
        if sequence is None:
            samples = await self.stt.samples(request)
            return _tensors([d async for d in self.recording(samples, plan, times)]), None
        samples = await self.stt.samples(request)
        inner = dataclasses.replace(sequence, id=self.sequences.key(sequence.id))
        chunk = await self.stt.live_chunk(samples, inner, False, plan.options, times)
        done = [d for s in chunk.segments if (d := await interpreted(self, s, plan)) is not None]
        serial = chunk.serial
        opened = Opened(self.name, sequence.id, serial) if serial is not None and not sequence.end else None
        return _tensors(done), opened

    async def _interpret_route(self, request: Request, query: dict[str, str]) -> Response:
        """POST /v2/models/{name}/interpret[?to=LANG&from=LANG&languages=A,B]: a recording in (WAV, FLAC,
        Ogg), NDJSON out: a line per segment as soon as it is spoken (times, each stage's text, its target
        and route, base64 PCM16), then a summary line with "done". Without `to`, conversation mode. The
        `x-route` header names the route of each language heard."""
        unknown = sorted(set(query) - {"to", "from", "languages"})
        if unknown:
            raise BadRequest(f"unknown query parameter {unknown[0][:40]!r} (known: to, from, languages)")
        plan = self.plan(query.get("to"), query.get("from"), query.get("languages"))  # a 400 before any work
        samples = await asyncio.to_thread(decode_upload, request.body, SAMPLE_RATE, self.live)
        duration = round(len(samples) / SAMPLE_RATE, 3)
        response = await ndjson(
            self._recorded(samples, plan),
            Interpreted.as_json,
            lambda count: {
                "model_name": self.name,
                "duration": duration,
                "targets": list(plan.targets),
                "segments": count,
            },
            f"interpretation by {self.name}",
            {"MODEL": self.name, "REQUEST_ID": request.headers.get("x-request-id", "-")},
        )
        return dataclasses.replace(response, headers=[*response.headers, ("x-route", self.routes(plan))])

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
