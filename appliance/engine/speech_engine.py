"""The contract of a speech-to-text engine: shards of audio in, timed pieces and words out.

The speech_to_text kind, its live streams and the routes built on it (OpenAI, Realtime, Wyoming,
the pipeline) hold a `SpeechEngine`, never a particular one: CTranslate2 (whisper.py, the CPU engine,
and the CUDA one where the box has CUDA 12) and the box's own Whisper over an array module
(whisper_arrays_engine.py: NumPy as the reference, CuPy on the GPU) both meet it. What a caller
needs of one: its tokens (prompts, languages), `check` before audio is queued, `decoding`: how the
batch queue runs its shards (on the queue's thread: whole batches of at most the baked max_batch for
CTranslate2, shards joining and leaving a continuous batch for the box's own), `detect` for segment
languages, and the statistics /metrics reads.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from appliance.engine.batch_queue import Runner
from appliance.engine.whisper_tokens import Piece, Quality, WhisperTokens
from appliance.engine.whisper_words import Word
from appliance.errors import BadRequest

TASKS = ("transcribe", "translate")


@dataclass(frozen=True, slots=True)
class Shard:
    """One window of audio to decode, and how."""

    samples: np.ndarray  # float32 at 16 kHz, at most 30 s
    language: str | None = None  # None: detected (multilingual models), English for English-only ones
    task: str = "transcribe"
    prompt: tuple[int, ...] = ()  # previous-text tokens (the OpenAI `prompt`)
    temperature: float = 0.0
    words: bool = False  # word timestamps too (one alignment pass more)
    # Shards of one request may share a window; None: never shared. In a window Whisper's text of one
    # shard conditions the next one's, so another request's speech would change this one's text
    # (measured: "Set the temperature to twenty one degrees" after "Wake me up at seven thirty" in
    # one window heard as "10.10. Richard at 1.1 degrees").
    request: Hashable | None = None


@dataclass(frozen=True, slots=True)
class Decoded:
    language: str
    pieces: list[Piece]
    words: list[Word] = field(default_factory=list)  # where the shard asked for them
    language_probability: float = 1.0  # Whisper's own, where it detected the language (1.0 where it was told)
    quality: Quality = Quality()


class SpeechEngine(Protocol):
    """What the speech_to_text kind and its routes need of an engine."""

    name: str  # reported as the model's engine (/status, /metrics)
    tokens: WhisperTokens
    weight_bytes: int  # a larger Whisper hears better: OpenAI's model names pick by it
    fallbacks: Counter[str]  # batches handed to the CPU engine, by reason

    @property
    def windows(self) -> Counter[str]:
        """Shards, the windows they ran in, those decoded alone again."""
        ...

    def check(self, language: str | None, task: str) -> None:
        """A 400 for a language or task this model cannot do, before its audio is queued."""
        ...

    def run(self, shards: list[Shard]) -> list[Decoded]:
        """Decode a batch of at most max_batch shards; the answers in the shards' order."""
        ...

    def decoding(self, max_batch: int) -> Runner[Shard, Decoded]:
        """How the batch queue runs this engine's shards, at most max_batch at once."""
        ...

    def detect(self, clips: list[np.ndarray]) -> list[tuple[str, float]]:
        """Each clip's language and its probability (a multilingual model only)."""
        ...


def check_request(tokens: WhisperTokens, language: str | None, task: str) -> None:
    """`SpeechEngine.check` for any Whisper: what its tokenizer says it can do."""
    if task not in TASKS:
        raise BadRequest(f"task must be one of {', '.join(TASKS)}, got {task!r}")
    if not tokens.multilingual:
        if task == "translate":
            raise BadRequest("this model is English-only: it transcribes English and cannot translate")
        if language not in (None, "en"):
            raise BadRequest(f"this model is English-only: language {language!r} is not one it knows")
    elif language is not None and language not in tokens.languages:
        raise BadRequest(f"language {language!r} is not one of Whisper's ({len(tokens.languages)} codes)")
