"""The wake_word kind: microWakeWord's streaming TFLite models (pymicro-wakeword's, Apache-2.0, the
firmware's files; the package's own TFLite C library runs them), served to Wyoming's `detect`
(api/wyoming_wake.py).

A stream is one satellite's audio after its `detect`: its own feature frontend (40 mel features per
10 ms) and one interpreter per wake word it listens for. Every connected stream's waiting audio goes
through one BatchQueue (one shard per stream per batch, live: never refused), so the audio of many
satellites is heard in one engine call per step on one thread, where a peer runs a process or a
thread per satellite. The graphs keep their streaming state inside their interpreter (TFLite
variables), so a step invokes each stream's interpreters in turn rather than one graph of batch N.

Baked bounds: `max_streams` streams at once (a `detect` past it is refused), `max_stream_s` seconds of
audio in one stream (past it the stream ends with an error: a satellite sends `detect` again).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures

from appliance.config import Live
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import ApplianceError, BadRequest, Unavailable
from appliance.firmware import Bundle, ModelSpec
from appliance.kinds.base import NoSequences, QueuedModel, SequenceCall, ServedModel, Task
from appliance.kinds.capabilities import WakePhrase
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Opened
from appliance.protocol.tensors import InferRequest

SAMPLE_RATE = 16000
FEATURE_MS = 10  # microWakeWord's feature step
# a wake word heard again within this long after it was detected is the same utterance (openWakeWord's
# refractory period: its probability stays over the cutoff for a few steps)
REFRACTORY_MS = 2000
# names of other companies' products that some models detect: said wherever the box lists them
MARKS = {
    "alexa": '"Alexa" is a trademark of Amazon.com, Inc.',
    "hey_mycroft": '"Mycroft" is a trademark of Mycroft AI, Inc.',
}


@dataclass(eq=False)
class WakeStream:
    """One satellite's stream: its frontend, a detector per wake word, and what it has heard. Touched
    only by the queue's thread once open; its interpreters are freed with it."""

    detectors: dict[str, MicroWakeWord]
    frontend: MicroWakeWordFeatures = field(default_factory=MicroWakeWordFeatures)
    samples: int = 0  # audio received
    features: int = 0  # feature frames made (each FEATURE_MS)
    last_detected: dict[str, int] = field(default_factory=dict)  # name -> its last detection (ms)

    def hear(self, audio: bytes) -> list[tuple[str, int]]:
        """The wake words detected in this audio (16 kHz PCM16), each with its time in the stream (ms)."""
        found = []
        for features in self.frontend.process_streaming(audio):
            self.features += 1
            now_ms = self.features * FEATURE_MS
            for name, detector in self.detectors.items():
                if (
                    detector.process_streaming(features)
                    and now_ms - self.last_detected.get(name, -REFRACTORY_MS) >= REFRACTORY_MS
                ):
                    self.last_detected[name] = now_ms
                    found.append((name, now_ms))
        return found


class WakeWordModel(QueuedModel):
    def __init__(self, spec: ModelSpec, bundle: Bundle, live: Live, loaded: Mapping[str, ServedModel]) -> None:
        self.spec, self.baked, self.live = spec, bundle.manifest.baked, live
        self.tasks: Mapping[str, Task] = {}
        self.sequences = NoSequences()
        self.stats = ModelStats()
        self.engine = None  # the TFLite C library on the CPU: nothing falls back
        params = spec.parameters
        self.max_streams, self.max_stream_s = int(params["max_streams"]), int(params["max_stream_s"])  # type: ignore[arg-type]
        names = [str(name) for name in params["models"]]  # type: ignore[union-attr]
        self.configs = {name: bundle.artifact(f"{spec.file}/{name}.json") for name in names}
        self.phrases = {name: _read(config) for name, config in self.configs.items()}
        self.open_streams = 0
        self.queue: BatchQueue[tuple[WakeStream, bytes], list[tuple[str, int]]] = BatchQueue(
            _hear_all,
            int(params["max_batch"]),  # type: ignore[arg-type]
            self.stats,
            QueuePolicy(spec.name, lambda: live.config.engine, self.stats),
            1,  # one shard of a stream per batch: its audio is heard in order
        )

    @property
    def engine_name(self) -> str:
        return "tflite"

    def open(self, names: list[str] | None) -> WakeStream:
        """A stream listening for these wake words (None or empty: all of them); refused past max_streams."""
        wanted = list(dict.fromkeys(names)) if names else list(self.phrases)
        unknown = [n for n in wanted if n not in self.phrases]
        if unknown:
            raise BadRequest(f"unknown wake word {str(unknown[0])[:40]!r} (models: {', '.join(self.phrases)})")
        if self.open_streams >= self.max_streams:
            raise Unavailable(f"too many wake-word streams (the firmware's bound is {self.max_streams})")
        self.open_streams += 1
        return WakeStream({n: MicroWakeWord.from_config(self.configs[n]) for n in wanted})

    def close(self, stream: WakeStream) -> None:
        """The stream's slot freed. Its interpreters go with the last reference to it (MicroWakeWord's
        __del__), never here: a batch on the queue's thread may still be invoking them."""
        self.open_streams -= 1

    async def hear(self, stream: WakeStream, audio: bytes) -> list[tuple[str, int]]:
        """The wake words this audio completes: heard in the next batch, with every other stream's."""
        samples = len(audio) // 2
        if stream.samples + samples > self.max_stream_s * SAMPLE_RATE:
            raise BadRequest(f"a wake-word stream over {self.max_stream_s} s (the firmware's bound): send detect again")
        stream.samples += samples
        (future,) = self.queue.submit([(stream, audio)], urgent=True)
        return (await future).result

    async def probe(self) -> None:
        stream = self.open(None)
        try:
            if await self.hear(stream, bytes(2 * SAMPLE_RATE)) or not stream.features:
                raise ApplianceError(f"model {self.name}: a second of silence was not heard as silence")
        finally:
            self.close(stream)

    def metadata(self) -> dict[str, Any]:
        return {
            "platform": "tflite",
            "inputs": [],
            "outputs": [],
            "parameters": {
                "kind": self.spec.kind,
                "engine": self.engine_name,
                "served_over": "wyoming",
                "wake_words": [
                    {"name": w.name, "phrase": w.phrase, "languages": list(w.languages), "description": w.description}
                    for w in self.phrases.values()
                ],
            },
        }

    def config(self) -> dict[str, Any]:
        return model_config(
            self.spec, self.baked, self.live, platform="tflite", backend="tflite", max_batch_size=0,
            inputs=[], outputs=[], dynamic_batching=False, stateful=False,
        )  # fmt: skip

    async def infer(
        self, request: InferRequest, sequence: SequenceCall | None, times: RequestTimes
    ) -> tuple[dict[str, np.ndarray], Opened | None]:
        raise BadRequest(f"model {self.name} hears wake words over Wyoming (detect), not through infer")


def _hear_all(batch: list[tuple[WakeStream, bytes]]) -> list[list[tuple[str, int]]]:
    """One engine call: every waiting stream's audio heard, on the queue's thread."""
    return [stream.hear(audio) for stream, audio in batch]


def _read(config: Path) -> WakePhrase:
    """A model's .json (microWakeWord's manifest): the phrase and the languages it was trained on."""
    try:
        found = json.loads(config.read_text(encoding="utf-8"))
        phrase, name = str(found["wake_word"]), config.stem
        mark = f"; {MARKS[name]} Named only to say what the model detects" if name in MARKS else ""
        return WakePhrase(name, phrase, tuple(found.get("trained_languages", [])), f"{phrase} (microWakeWord{mark})")
    except (OSError, ValueError, KeyError) as exc:
        raise ApplianceError(f"wake word {config.stem}: {config.name} is not a microWakeWord manifest: {exc}") from None
