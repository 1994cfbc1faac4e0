"""What a model can do for the task APIs (OpenAI's audio and speech routes, LibreTranslate's, the
speech pipeline), as protocols: they find models by what they do, never by their kind's class, so a
new kind that transcribes, speaks or translates serves them unchanged, and importing an API loads no
kind's engine (a VAD-only firmware never imports CTranslate2, fxtranslate or sentencepiece).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from typing import Protocol, runtime_checkable

import numpy as np

from appliance.engine.stats import RequestTimes
from appliance.firmware import ModelSpec
from appliance.kinds.speech_api import Options, Segment

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # a Speaker's range for `speed` (OpenAI's)


@runtime_checkable
class Transcriber(Protocol):
    """Speech to text (kind speech_to_text)."""

    spec: ModelSpec

    @property
    def name(self) -> str: ...

    @property
    def multilingual(self) -> bool:
        """It hears other languages than English, and translates them to English."""
        ...

    def check(self, options: Options) -> None:
        """A 400 for options it cannot serve (a language it does not know, translate on an English-only model)."""
        ...

    def recording(self, body: bytes) -> np.ndarray:
        """An uploaded recording as the samples it hears (blocking: call it off the event loop)."""
        ...

    def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncIterator[Segment]: ...


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
