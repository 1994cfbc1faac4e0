"""A recording's speech (the VAD's segments) packed into Whisper shards, and shard times mapped back.

A shard is at most `max_samples` of audio (Whisper's window is 30 s): the speech segments it holds,
silence between them shortened to GAP_S so the window holds speech, not pauses, while Whisper
still hears where one utterance ends. `semantic` packs whole segments and cuts between them (at
the VAD's silences); a segment longer than a shard is cut at its quietest frame. `fixed` fills
each shard to the limit, cutting wherever the limit falls.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from appliance.engine.stats import RequestTimes
from appliance.engine.whisper_tokens import Piece
from appliance.engine.whisper_words import Word as EngineWord
from appliance.kinds.shards import frame_energy, plan_shards
from appliance.kinds.speech_api import Options, Segment, Word
from appliance.kinds.text import ends_sentence

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
        return index, self._inside(index, start, rate), self._inside(index, end, rate)

    def _inside(self, index: int, seconds: float, rate: int) -> int:
        """A time in the shard -> the recording's sample, kept inside span `index`."""
        span = self.spans[index]
        return span.start + int(min(max(seconds * rate - span.offset, 0.0), span.end - span.start))

    def timed(self, pieces: list[tuple[float, float]], rate: int) -> list[tuple[int, int]]:
        """Whisper's timed pieces (its own segments, usually a clause or a sentence) -> each one's start
        and end in the recording (samples), in order. Where speech begins or ends, the VAD's edges (a
        span's first piece starts where it starts, its last ends where it ends: Whisper's own times
        drift by a few hundred ms); two pieces in one span meet at Whisper's timestamp between them."""
        spans: list[tuple[int, int]] = []
        for start, end in pieces:
            first, last = self.covered(start, end, rate)
            first = max(first, spans[-1][1]) if spans else first  # in order, though Whisper's times drift
            spans.append((first, max(first, last)))
        out: list[tuple[int, int]] = []
        for i, (first, last) in enumerate(spans):
            start = self.spans[first].start
            if out and spans[i - 1][1] == first:  # shares its first span with the piece before
                start = max(out[-1][0], self._inside(first, pieces[i][0], rate))
                out[-1] = (out[-1][0], start)
            out.append((start, self.spans[last].end))
        return out


class ShardDecoder(Protocol):
    """A speech model as the parts that cut and decode for it see it (SpeechToText): shards planned
    for segments of a recording, and a shard decoded into its segments."""

    @property
    def name(self) -> str: ...

    def plans(self, samples: np.ndarray, segments: list[tuple[int, int]]) -> list[ShardPlan]:
        """The shards of these segments of `samples` on their own."""
        ...

    async def decode(
        self,
        plan: ShardPlan,
        samples: np.ndarray,
        options: Options,
        times: RequestTimes,
        request: Hashable,
        urgent: bool = False,
        offset: int = 0,
        index: int = 0,
    ) -> list[Segment]:
        """One shard's segments (times in seconds, `offset` samples added)."""
        ...


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


def with_their_sentences(pieces: list[Piece]) -> list[Piece]:
    """Whisper's pieces, each that goes on with the sentence before it (that one ends none, it begins in
    lower case: "Turn off the lights in the kitchen" "please.") joined to it: it is part of that sentence,
    and Whisper's timestamps around so short a tail drift by more than its length (measured: "please."
    timed into the next sentence's speech, 0.5 s of it)."""
    out: list[Piece] = []
    for piece in pieces:
        if out and piece.text[:1].islower() and not ends_sentence(out[-1].text):
            last = out[-1]
            text = f"{last.text} {piece.text}"
            out[-1] = Piece(
                last.start, max(last.end, piece.end), text, last.words + piece.words, last.tokens + piece.tokens
            )
        else:
            out.append(piece)
    return out


def placed_words(
    plan: ShardPlan, segments: list[tuple[int, int]], words: list[EngineWord], offset: int, rate: int
) -> list[tuple[Word, ...]]:
    """The shard's words in recording time, each in the segment (start and end in the recording, less
    `offset`) it was heard in, inside that segment's times and in order."""
    placed: list[list[Word]] = [[] for _ in segments]
    if not segments:
        return []
    for word in words:
        _, start, end = plan.place(word.start, word.end, rate)
        middle = (start + end) / 2
        at = min(range(len(segments)), key=lambda k: max(segments[k][0] - middle, middle - segments[k][1], 0.0))
        low, high = segments[at]
        start = max(low, min(start, high))
        if placed[at]:
            start = max(start, round(placed[at][-1].end * rate) - offset)
        end = max(start, min(end, high))
        placed[at].append(
            Word(round((offset + start) / rate, 3), round((offset + end) / rate, 3), word.text, word.probability)
        )
    return [tuple(found) for found in placed]
