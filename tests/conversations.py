"""Conversations with known turns, for the diarization tests: distinct voices (Kokoro's English voices
run outside the box, espeak-ng's variants) taking turns of one or two sentences, with the true
timeline of who speaks when; and the diarization error rate, written from its definition (NIST's
RT scoring, as pyannote.metrics computes it): (missed speech + false alarm + speaker confusion) over
the reference's speech, frame by frame (10 ms), with the best one-to-one map of the hypothesis's
speakers onto the reference's, and a collar around every reference boundary left out of the count."""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass

import numpy as np
from kokoro import Kokoro
from speech import RATE, say

SENTENCES = [
    "The train leaves at three in the afternoon, so we should hurry.",
    "My brother works at the hospital near the old station.",
    "Could you tell me where the museum is, please?",
    "We went to the market early on Saturday morning.",
    "I would like a cup of coffee and a slice of cake.",
    "The weather was cold, but the children played outside all day.",
    "Our neighbours painted their kitchen a bright shade of yellow.",
    "Please send me the report before the meeting on Tuesday.",
    "The library closes early during the summer holidays.",
    "He forgot his umbrella and walked home in the rain.",
    "Turn left at the bakery and the bank is on your right.",
    "She has been learning to play the violin for two years.",
]
KOKORO_VOICES = ("af_heart", "am_michael", "bf_emma", "bm_george")
ESPEAK_VOICES = ("en+f2", "en-us+m3")
FRAME_S = 0.01


@dataclass(frozen=True)
class Turn:
    start: float
    end: float
    speaker: str


@dataclass(frozen=True)
class Conversation:
    samples: np.ndarray
    turns: list[Turn]

    @property
    def speakers(self) -> set[str]:
        return {t.speaker for t in self.turns}


class Voices:
    """Each voice's sentences, synthesized once."""

    def __init__(self, kokoro: Kokoro) -> None:
        self.kokoro = kokoro
        self.made: dict[tuple[str, int], np.ndarray] = {}

    def sentence(self, voice: str, index: int) -> np.ndarray:
        key = (voice, index)
        if key not in self.made:
            text = SENTENCES[index]
            audio = say(text, voice) if voice in ESPEAK_VOICES else self.kokoro.speech16k(text, voice)
            loud = np.flatnonzero(np.abs(audio) > 0.01)
            self.made[key] = audio[loud[0] : loud[-1] + 1].astype(np.float32)
        return self.made[key]


def conversation(voices: Voices, speakers: list[str], seed: int, turns: int = 6) -> Conversation:
    """`turns` turns (each speaker at least once, never the same speaker twice in a row), one or two
    sentences each, no sentence twice, with gaps of 0.15 s (the VAD hears one span across them) to 0.8 s.
    (No sentence twice: with repeats, one sentence said four times in 24 s, the text compresses 2.79
    times, past openai-whisper's 2.4, and Whisper's loop check cut real speech from the transcript.)"""
    rng = random.Random(seed)
    order = list(speakers)
    while len(order) < turns:
        order.append(rng.choice([s for s in speakers if s != order[-1]]))
    parts, truth, position = [np.zeros(int(0.5 * RATE), np.float32)], [], 0.5
    unsaid = rng.sample(range(len(SENTENCES)), len(SENTENCES))
    for speaker in order:
        picked = [unsaid.pop() for _ in range(rng.choice((1, 1, 2)))]
        audio = np.concatenate([voices.sentence(speaker, i) for i in picked])
        truth.append(Turn(round(position, 3), round(position + len(audio) / RATE, 3), speaker))
        gap = rng.choice((0.15, 0.3, 0.5, 0.8))
        parts += [audio, np.zeros(int(gap * RATE), np.float32)]
        position += len(audio) / RATE + gap
    return Conversation(np.concatenate(parts), truth)


def _frames(turns: list[Turn], count: int) -> dict[str, np.ndarray]:
    found: dict[str, np.ndarray] = {}
    for t in turns:
        track = found.setdefault(t.speaker, np.zeros(count, bool))
        track[int(round(t.start / FRAME_S)) : int(round(t.end / FRAME_S))] = True
    return found


def der(reference: list[Turn], hypothesis: list[Turn], collar_s: float = 0.25) -> float:
    """The diarization error rate of `hypothesis` against `reference` (both lists of turns)."""
    end = max([t.end for t in reference + hypothesis], default=0.0)
    count = int(np.ceil(end / FRAME_S)) + 1
    scored = np.ones(count, bool)
    for t in reference:
        for edge in (t.start, t.end):
            scored[max(0, int(round((edge - collar_s) / FRAME_S))) : int(round((edge + collar_s) / FRAME_S))] = False
    ref, hyp = _frames(reference, count), _frames(hypothesis, count)
    ref_count = sum(r.astype(int) for r in ref.values()) if ref else np.zeros(count, int)
    hyp_count = sum(h.astype(int) for h in hyp.values()) if hyp else np.zeros(count, int)
    total = int((ref_count * scored).sum())
    missed = int((np.maximum(ref_count - hyp_count, 0) * scored).sum())
    false_alarm = int((np.maximum(hyp_count - ref_count, 0) * scored).sum())
    refs, hyps = list(ref), list(hyp)
    best_match = 0
    for chosen in itertools.permutations(hyps + [None] * len(refs), len(refs)):  # the best one-to-one map
        matched = sum(int((ref[r] & hyp[h] & scored).sum()) for r, h in zip(refs, chosen) if h is not None)
        best_match = max(best_match, matched)
    confusion = int((np.minimum(ref_count, hyp_count) * scored).sum()) - best_match
    return (missed + false_alarm + confusion) / max(total, 1)
