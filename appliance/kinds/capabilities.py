"""What a model can do for the task APIs (OpenAI's audio and speech routes, LibreTranslate's, the
speech pipeline), as protocols: they find models by what they do, never by their kind's class, so a
new kind that transcribes, speaks or translates serves them unchanged, and importing an API loads no
kind's engine (a VAD-only firmware never imports CTranslate2, fxtranslate or sentencepiece).
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Collection, Mapping
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from appliance.config import VadConfig
from appliance.engine.stats import ModelStats, RequestTimes
from appliance.firmware import ModelSpec
from appliance.kinds.base import SequenceCall
from appliance.kinds.speech_api import LiveChunk, Options, Segment

MIN_SPEED, MAX_SPEED = 0.25, 4.0  # a Speaker's range for `speed` (OpenAI's)


@dataclass(frozen=True, slots=True)
class SpokenVoice:
    """One voice of a Speaker."""

    name: str
    language: str  # two-letter code ("pt")
    espeak_voice: str  # the espeak-ng voice that makes its phonemes ("pt-br")


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

    async def recording(self, body: bytes) -> np.ndarray:
        """An uploaded recording as the samples it hears, decoded off the event loop; refused first (a
        503) when the model's queue is full."""
        ...

    def transcribe(
        self, samples: np.ndarray, options: Options, times: RequestTimes | None = None
    ) -> AsyncGenerator[Segment, None]: ...


@runtime_checkable
class VoicePrinter(Protocol):
    """Voiceprints (kind speaker_embedding): who speaks, for diarization and known speakers."""

    window_frames: int  # a diarization window, in 10 ms mel frames
    step_frames: int  # from one window to the next

    async def embed(self, windows: list[np.ndarray]) -> np.ndarray:
        """[len(windows), dims], L2-normalized: each window of mel frames [frames, mels]."""
        ...

    async def utterance(self, samples: np.ndarray) -> np.ndarray:
        """One voiceprint of a whole clip (16 kHz samples)."""
        ...

    def speech(self, samples: np.ndarray) -> AsyncGenerator[tuple[int, int], None]:
        """Its VAD's speech spans of a recording (sample positions), as a transcription cuts it."""
        ...


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
        partial_waits: bool = True,
    ) -> LiveChunk: ...

    def hear(self, options: Options, client: str) -> HeardRecording:
        """A recording to be transcribed at its end, heard by the VAD as it arrives (a Wyoming client's)."""
        ...


@dataclass(frozen=True, slots=True)
class VoiceHeard:
    """What the VAD has heard of a recording so far (sample positions at 16 kHz)."""

    listening: bool  # False once the recording is no longer heard as it arrives (sent too fast or slow)
    speech_from: int | None  # where the speech being heard began; None in silence
    speech_to: int  # where the last speech that ended ended (0 before any)
    heard: int  # samples through the VAD


class HeardRecording(Protocol):
    """A recording that arrives as it is spoken, its text asked for at its end (LiveTranscriber.hear)."""

    def voice(self) -> VoiceHeard:
        """Where its speech begins and ends, as far as the VAD heard it."""
        ...

    async def feed(self, samples: np.ndarray) -> None:
        """Its next samples, as they arrive."""
        ...

    def segments(self, samples: np.ndarray) -> AsyncGenerator[Segment, None]:
        """At its end, given all its samples: its segments, in order."""
        ...

    def close(self) -> None:
        """Its work and its VAD sequence dropped (ended, or its client left)."""
        ...


@runtime_checkable
class Interpreting(Protocol):
    """Speech in, translated speech out, segment by segment (kind speech_pipeline)."""

    spec: ModelSpec
    stt: LiveTranscriber
    conversation: tuple[str, ...]  # conversation mode's two languages where none are asked

    @property
    def name(self) -> str: ...

    def plan(self, target: str | None, source: str | None = None, languages: str | None = None) -> Any:
        """How speech goes through the stages (pipeline.py Plan: options, targets): one way to `target`,
        else conversation mode between `languages`; a 400 for a target no voice speaks. Typed loosely
        here: the pipeline module imports this one."""
        ...

    def heading(self, segment: Segment, plan: Any) -> tuple[str, tuple[str, ...]]:
        """A segment's target language and route, before its answer is made."""
        ...

    async def answer(self, segment: Segment, plan: Any) -> tuple[Any, AsyncGenerator[np.ndarray, None]] | None:
        """One segment translated (Interpreted, no audio yet) and its voice as the engine makes it, or None."""
        ...


@runtime_checkable
class Speaker(Protocol):
    """Text to speech (kinds speech_synthesis, kokoro_speech): `prepare` a text's shards in one of its
    voices, `synthesize` them at a speed."""

    spec: ModelSpec
    voice_name: str  # its default voice
    language: str  # its default voice's language (ISO 639-1)
    sample_rate: int
    voices: Mapping[str, SpokenVoice]  # by name, in the firmware's order

    @property
    def name(self) -> str: ...

    def voice(self, name: object | None) -> SpokenVoice:
        """One of its voices by name (None: the default); a 400 naming them for another."""
        ...

    def listing(self) -> list[dict[str, Any]]:
        """Its voices with their language, model and rate (GET /v1/audio/voices, the metadata)."""
        ...

    async def prepare(self, text: str, voice: str | None = None) -> list[list[int]]: ...

    def synthesize(
        self, shards: list[list[int]], speed: float, times: RequestTimes | None = None, voice: str | None = None
    ) -> AsyncGenerator[np.ndarray, None]: ...


@runtime_checkable
class LanguageDetector(Protocol):
    """Text in, its likeliest languages out (kind language_identification)."""

    @property
    def name(self) -> str: ...

    def detect(self, text: str, candidates: int = 1, among: Collection[str] = ()) -> list[tuple[str, float]]:
        """Language codes with their probability (0 to 1), best first; of `among` where given (else of
        the firmware's languages)."""
        ...


@runtime_checkable
class Translator(Protocol):
    """Text from one language to another (kind text_translation)."""

    spec: ModelSpec
    source: str
    target: str

    @property
    def name(self) -> str: ...

    async def translate(self, text: str, times: RequestTimes | None = None) -> str: ...


@dataclass(frozen=True, slots=True)
class WakePhrase:
    """One wake word a WakeWordDetector hears: its model's name, the phrase, the languages it was
    trained on, and what the box says of it where it lists it (another company's mark, where it is)."""

    name: str
    phrase: str
    languages: tuple[str, ...]
    description: str


@runtime_checkable
class WakeWordDetector(Protocol):
    """Wake words in streamed audio (kind wake_word): a stream opened per detect, its audio heard in
    batches with every other stream's."""

    spec: ModelSpec
    phrases: Mapping[str, WakePhrase]

    def open(self, names: list[str] | None) -> Any:
        """A stream listening for these wake words (None: all); refused past the firmware's bound."""
        ...

    def close(self, stream: Any) -> None: ...

    async def hear(self, stream: Any, audio: bytes) -> list[tuple[str, int]]:
        """The wake words this 16 kHz PCM16 audio completes, each with its time in the stream (ms)."""
        ...
