"""What a model can do for the task APIs (OpenAI's audio and speech routes, LibreTranslate's, the
speech pipeline), as protocols: they find models by what they do, never by their kind's class, so a
new kind that transcribes, speaks or translates serves them unchanged, and importing an API loads no
kind's engine (a VAD-only firmware never imports CTranslate2, fxtranslate or sentencepiece).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any, Protocol, runtime_checkable

import numpy as np

from appliance.config import VadConfig
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.firmware import ModelSpec
from appliance.kinds.base import SequenceCall
from appliance.kinds.speech_api import LiveChunk, Options, Segment

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # a Speaker's range for `speed` (OpenAI's)


@runtime_checkable
class Transcriber(Protocol):
    """Speech to text (kind speech_to_text)."""

    spec: ModelSpec
    stats: ModelStats  # the task APIs count their requests in it
    weight_bytes: int  # how large it is: OpenAI's model names take the largest that can serve

    @property
    def name(self) -> str: ...

    @property
    def multilingual(self) -> bool:
        """It hears other languages than English, and translates them to English."""
        ...

    @property
    def languages(self) -> list[str]:
        """The language codes it hears (["en"] for an English-only model)."""
        ...

    def check(self, options: Options) -> None:
        """A 400 for options it cannot serve (a language it does not know, translate on an English-only model)."""
        ...

    def recording(self, body: bytes) -> np.ndarray:
        """An uploaded recording as the samples it hears (blocking: call it off the event loop)."""
        ...

    def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncGenerator[Segment, None]: ...


@runtime_checkable
class LiveTranscriber(Transcriber, Protocol):
    """Speech to text that also takes live streams, chunk by chunk, behind its VAD (/v1/realtime)."""

    sequences: Any  # its live streams (end(key) drops one without decoding it)

    async def live_chunk(
        self,
        samples: np.ndarray,
        sequence: SequenceCall,
        partial: bool,
        options: Options,
        times: RequestTimes,
        vad: VadConfig | None = None,
    ) -> LiveChunk: ...


@runtime_checkable
class Interpreting(Protocol):
    """Speech in, translated speech out, segment by segment (kind speech_pipeline)."""

    spec: ModelSpec
    stt: LiveTranscriber

    @property
    def name(self) -> str: ...

    def plan(self, target: str | None, source: str | None = None) -> Any:
        """How speech goes through the stages (pipeline.py Plan: options, target, voice); a 400 for a
        target no voice speaks. Typed loosely here: the pipeline module imports this one."""
        ...

    async def interpret(self, segment: Segment, plan: Any) -> Any:
        """One segment translated and spoken (pipeline.py Interpreted: text, audio), or None."""
        ...


@runtime_checkable
class Speaker(Protocol):
    """Text to speech (kind speech_synthesis): `prepare` a text's shards, `synthesize` them at a speed."""

    spec: ModelSpec
    voice_name: str
    language: str  # the language it speaks (ISO 639-1)
    sample_rate: int

    @property
    def name(self) -> str: ...

    async def prepare(self, text: str) -> list[list[int]]: ...

    def synthesize(
        self, shards: list[list[int]], speed: float, times: RequestTimes | None = None
    ) -> AsyncGenerator[np.ndarray, None]: ...


@runtime_checkable
class Translator(Protocol):
    """Text from one language to another (kind text_translation)."""

    spec: ModelSpec
    source: str
    target: str

    @property
    def name(self) -> str: ...

    async def translate(self, text: str, times: RequestTimes | None = None) -> str: ...
