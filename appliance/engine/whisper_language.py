"""Whisper's spoken-language identification on one VAD segment at a time.

Whisper detects a language from its encoder's view of a 30 s window. A segment is a few seconds of one
speaker, so the window is cut to the segment and DETECT_PAD_S of the silence after it (CTranslate2's
encoder takes fewer frames than 3000): on 21 clips of 0.5 to 3 s (Kokoro Portuguese, espeak-ng English,
Spanish, French, Italian, German) base named 19 right both ways, and took 2.2 s for them against 15.2 s
on full windows (2 cores). Both miss "Sim." alone (heard as English).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import tokenizers

from appliance.engine.speech_engine import Shard
from appliance.engine.whisper_features import HOP, SAMPLE_RATE, WINDOW_FRAMES, log_mel

if TYPE_CHECKING:  # only CTranslate2's engine calls detect and shard_languages: the box's own Whisper runs without it
    import ctranslate2

DETECT_PAD_S = 3.0  # silence heard after the segment
DETECT_MAX_S = 8.0  # of a longer segment, its start: a language is told in seconds, the encoder's cost grows with them


def detect(model: ctranslate2.models.Whisper, filters: np.ndarray, clips: list[np.ndarray]) -> list[tuple[str, float]]:
    """Each clip's likeliest language (Whisper's code) and its probability, from its first DETECT_MAX_S;
    one encoder call for all, its window as long as the longest clip and the pad."""
    if not clips:
        return []
    clips = [c[: int(DETECT_MAX_S * SAMPLE_RATE)] for c in clips]
    frames = min(WINDOW_FRAMES, max(len(c) for c in clips) // HOP + int(DETECT_PAD_S * SAMPLE_RATE) // HOP)
    features = np.ascontiguousarray(log_mel(clips, filters)[:, :, :frames])
    from ctranslate2 import StorageView  # here: the box's own Whisper imports this module, not CTranslate2

    found = model.detect_language(StorageView.from_array(features))
    return [(code(best[0][0]), round(float(best[0][1]), 3)) for best in found]


def shard_languages(
    model: ctranslate2.models.Whisper, encoded: ctranslate2.StorageView, shards: list[Shard], multilingual: bool
) -> list[tuple[str, float]]:
    """Each shard's language and its probability: the caller's (1.0), else Whisper's detection on the
    shard's encoded window."""
    if not multilingual:
        return [("en", 1.0)] * len(shards)
    if all(s.language for s in shards):
        return [(s.language or "", 1.0) for s in shards]
    detected = model.detect_language(encoded)
    return [
        (s.language, 1.0) if s.language else (code(d[0][0]), round(float(d[0][1]), 3)) for s, d in zip(shards, detected)
    ]


def code(token: str) -> str:
    """A language token's code: "<|pt|>" -> "pt"."""
    return token.removeprefix("<|").removesuffix("|>")


def codes(directory: Path) -> list[str]:
    """Whisper's language codes, in the tokenizer's order (its tokens sit between <|startoftranscript|>
    and <|translate|>)."""
    tokenizer = tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json"))
    sot, translate = tokenizer.token_to_id("<|startoftranscript|>"), tokenizer.token_to_id("<|translate|>")
    if sot is None or translate is None:
        return []
    return [code(t) for t in (tokenizer.id_to_token(i) for i in range(sot + 1, translate)) if t is not None]
