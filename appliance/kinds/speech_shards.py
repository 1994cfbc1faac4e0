"""A recording's speech (the VAD's segments) packed into Whisper shards, and shard times mapped back.

A shard is at most `max_samples` of audio (Whisper's window is 30 s): the speech segments it holds,
silence between them shortened to GAP_S so the window holds speech, not pauses, while Whisper
still hears where one utterance ends. `semantic` packs whole segments and cuts between them (at
the VAD's silences); a segment longer than a shard is cut at its quietest frame. `fixed` fills
each shard to the limit, cutting wherever the limit falls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from appliance.engine.whisper_words import Word as EngineWord
from appliance.kinds.shards import frame_energy, plan_shards
from appliance.kinds.speech_api import Word

GAP_S = 0.3  # silence put between two segments in one shard
CUT_FRAME = 320  # 20 ms, one encoder position: the grain of a cut inside speech


@dataclass(frozen=True, slots=True)
class Span:
    start: int  # in the recording, samples
    end: int
    offset: int  # where it begins in the shard's audio


@dataclass(frozen=True, slots=True)
class ShardPlan:
    spans: list[Span]
    length: int  # samples of the shard's audio

    def audio(self, samples: np.ndarray) -> np.ndarray:
        out = np.zeros(self.length, np.float32)
        for span in self.spans:
            out[span.offset : span.offset + span.end - span.start] = samples[span.start : span.end]
        return out

    def covered(self, start: float, end: float, rate: int) -> tuple[int, int]:
        """The spans a piece of Whisper's text (times in the shard) stands for: those it overlaps by
        at least half their length, else the one nearest its middle. Whisper's timestamps drift by
        a few hundred ms; a span is where the VAD heard the speech."""
        a, b = start * rate, end * rate
        hit = [
            i
            for i, s in enumerate(self.spans)
            if min(b, s.offset + s.end - s.start) - max(a, s.offset) >= (s.end - s.start) / 2
        ]
        if hit:
            return hit[0], hit[-1]
        middle = (a + b) / 2
        distance = [abs(middle - (s.offset + (s.end - s.start) / 2)) for s in self.spans]
        nearest = int(np.argmin(distance))
        return nearest, nearest

    def place(self, start: float, end: float, rate: int) -> tuple[int, int, int]:
        """A word's times in the shard -> the span it was heard in (the one nearest its middle) and its
        start and end in the recording, inside that span: a word never runs across the VAD's silence."""
        middle = (start + end) / 2 * rate

        def distance(span: Span) -> float:
            return max(span.offset - middle, middle - (span.offset + span.end - span.start), 0.0)

        index = min(range(len(self.spans)), key=lambda i: distance(self.spans[i]))
        span = self.spans[index]

        def inside(seconds: float) -> int:
            return span.start + int(min(max(seconds * rate - span.offset, 0.0), span.end - span.start))

        return index, inside(start), inside(end)

    def align(self, pieces: list[tuple[float, float, str]], rate: int) -> list[tuple[int, int, str]]:
        """Whisper's timed pieces -> (first span, last span, text), one per run of spans the
        pieces join: a span's text is that of the pieces standing for it, its times are the VAD's."""
        runs: list[tuple[int, int, str]] = []
        for start, end, text in pieces:
            first, last = self.covered(start, end, rate)
            if runs and first <= runs[-1][1]:
                before = runs.pop()
                first, last, text = before[0], max(before[1], last), f"{before[2]} {text}"
            runs.append((first, last, text))
        return runs


class Packer:
    """Speech segments in, in order, as the VAD closes them; shards out as soon as each is full. A shard
    starts and ends with GAP_S of silence too: Whisper mishears a first word that starts the window."""

    def __init__(self, samples: np.ndarray, max_samples: int, algorithm: str, rate: int) -> None:
        self.samples, self.algorithm = samples, algorithm
        self.gap = int(GAP_S * rate)
        self.capacity = max_samples - 2 * self.gap  # speech and the gaps between
        self._spans: list[Span] = []
        self._used = 0

    def add(self, segment: tuple[int, int]) -> list[ShardPlan]:
        full = []
        for start, end in _split(self.samples, *segment, self.capacity, self.algorithm):
            while start < end:
                offset = self._used + self.gap if self._spans else 0
                room = self.capacity - offset
                if self._spans and (room <= 0 or (self.algorithm == "semantic" and end - start > room)):
                    full += self.finish()
                    continue
                take = min(end - start, room)
                self._spans.append(Span(start, start + take, self.gap + offset))
                self._used = offset + take
                start += take
        return full

    def finish(self) -> list[ShardPlan]:
        """The shard being filled, if it holds anything."""
        done = [ShardPlan(self._spans, self._used + 2 * self.gap)] if self._spans else []
        self._spans, self._used = [], 0
        return done


def _split(samples: np.ndarray, start: int, end: int, max_samples: int, algorithm: str) -> list[tuple[int, int]]:
    """A segment longer than a shard, cut at its quietest 20 ms in the last half of each window
    (`semantic`); `fixed` leaves cutting to the packing."""
    if end - start <= max_samples or algorithm != "semantic":
        return [(start, end)]
    count = -(-(end - start) // CUT_FRAME)
    frames = np.zeros((count, CUT_FRAME), np.float32)
    frames.reshape(-1)[: end - start] = samples[start:end]
    cuts = plan_shards(frame_energy(frames), max_samples // CUT_FRAME, algorithm)
    return [(start + a * CUT_FRAME, min(end, start + b * CUT_FRAME)) for a, b in cuts]


def placed_words(
    plan: ShardPlan, runs: list[tuple[int, int, str]], words: list[EngineWord], offset: int, rate: int
) -> list[tuple[Word, ...]]:
    """The shard's words in recording time, each in the segment (run of spans) it was heard in, inside
    that segment's times and in order (the VAD's edges are the segment's, as for its text)."""
    placed: list[list[Word]] = [[] for _ in runs]
    if not runs:
        return []
    for word in words:
        index, start, end = plan.place(word.start, word.end, rate)
        run = min(range(len(runs)), key=lambda r: max(runs[r][0] - index, index - runs[r][1], 0))
        low, high = plan.spans[runs[run][0]].start, plan.spans[runs[run][1]].end
        start = max(low, min(start, high))
        if placed[run]:
            start = max(start, round(placed[run][-1].end * rate) - offset)
        end = max(start, min(end, high))
        placed[run].append(
            Word(
                round((offset + start) / rate, 3),
                round((offset + end) / rate, 3),
                word.text,
                word.probability,
            )
        )
    return [tuple(found) for found in placed]
