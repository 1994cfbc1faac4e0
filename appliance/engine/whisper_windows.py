"""Whisper windows shared across shards: several short shards (of one request) in one 30 s window.

Whisper's encoder costs a whole 30 s window whatever it holds, so six 10 s shards cost six windows
when each has its own. Here shards that decode alike (one key: the engine's, from the request,
language, task and temperature, no previous-text prompt) are packed in order into windows of at
most `capacity` samples, with SEPARATOR_S of silence between two of them: Whisper closes a piece of text at a pause that long,
so its timestamps split the window's text back into each shard's. A piece that covers the audio of
two shards (more than REACH_S of each) is cut between them where its words were heard in order
on those shards' audio (all of it to one, where every word was heard in its audio and the piece's
times only drifted into the next); where they were not, those shards are decoded alone instead, as is a
shard the window's decode gave no text (Whisper may stop before the window's end). Plain functions of arrays and times: no engine here.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np

SEPARATOR_S = 1.5  # silence between two shards in one window (each shard also starts and ends with its own)
# How far a piece may reach into a member's audio and still not count as its text: Whisper's
# timestamps in a window drift by up to a second (tiny.en often lands on whole seconds).
REACH_S = 0.5


@dataclass(frozen=True, slots=True)
class Window:
    """Shards `members` (indexes in the batch) at `offsets` (samples) of one window `length` long."""

    members: tuple[int, ...]
    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def length(self) -> int:
        return self.offsets[-1] + self.lengths[-1]

    def audio(self, shards: Sequence[np.ndarray]) -> np.ndarray:
        out = np.zeros(self.length, np.float32)
        for member, offset in zip(self.members, self.offsets):
            out[offset : offset + len(shards[member])] = shards[member]
        return out

    def spans(self, rate: int) -> list[tuple[float, float]]:
        """Each member's audio in the window, in seconds."""
        return [(o / rate, (o + n) / rate) for o, n in zip(self.offsets, self.lengths)]


def pack(lengths: Sequence[int], keys: Sequence[Hashable | None], capacity: int, separator: int) -> list[Window]:
    """Windows for a batch of shards of `lengths` samples: those of one key (None: not packable) in
    order, a window filled while the next shard still fits; every shard in exactly one window."""
    windows: list[Window] = []
    open_by_key: dict[Hashable, list[int]] = {}

    def close(members: list[int]) -> None:
        offsets, at = [], 0
        for m in members:
            offsets.append(at)
            at += lengths[m] + separator
        windows.append(Window(tuple(members), tuple(offsets), tuple(lengths[m] for m in members)))

    for i, (length, key) in enumerate(zip(lengths, keys)):
        if key is None:
            close([i])
            continue
        members = open_by_key.get(key)
        if members is not None and sum(lengths[m] + separator for m in members) + length <= capacity:
            members.append(i)
            continue
        if members is not None:
            close(members)
        open_by_key[key] = [i]
    for members in open_by_key.values():
        close(members)
    windows.sort(key=lambda w: w.members[0])
    return windows


@dataclass(frozen=True, slots=True)
class Split:
    """A window's pieces given back: (start, end, text) per member in its own times, and the members
    that must be decoded alone."""

    pieces: dict[int, list[tuple[float, float, str]]]
    alone: set[int]


def split(
    window: Window,
    pieces: Sequence[tuple[float, float, str]],
    rate: int,
    words: Sequence[Sequence[tuple[float, str]]] | None = None,
) -> Split:
    """Each piece (times in the window) to the member whose audio it covers: the one it overlaps by
    more than REACH_S, or where none does, the one it overlaps most (else the nearest). A piece that
    overlaps two members by more than REACH_S holds words of both: it is cut between them where
    `words` (each word and where it was heard) fall in order on those members, each within REACH_S
    of its audio; else those members go alone."""
    spans = window.spans(rate)
    given: dict[int, list[tuple[float, float, str]]] = {m: [] for m in window.members}
    alone: set[int] = set()

    def give(at: int, start: float, end: float, text: str) -> None:
        offset, length = spans[at][0], spans[at][1] - spans[at][0]
        own = (min(max(start - offset, 0.0), length), min(max(end - offset, 0.0), length), text)
        given[window.members[at]].append(own)

    for n, (start, end, text) in enumerate(pieces):
        overlaps = [min(end, b) - max(start, a) for a, b in spans]
        owners = [i for i, o in enumerate(overlaps) if o > REACH_S]
        if len(owners) > 1:
            runs = _runs(spans, words[n] if words else ())
            # all its words heard in one shard's audio: its end (or start) only drifted into the next
            if runs is None or not {r[0] for r in runs} <= set(owners):
                alone.update(window.members[i] for i in owners)
                continue
            for k, (at, first, line) in enumerate(runs):
                give(at, first, runs[k + 1][1] if k + 1 < len(runs) else end, line)
            continue
        middle = (start + end) / 2
        nearest = min(range(len(spans)), key=lambda i: (-max(overlaps[i], 0.0), abs(middle - sum(spans[i]) / 2)))
        give(owners[0] if owners else nearest, start, end, text)
    alone.update(m for m, found in given.items() if not found)  # Whisper gave it nothing: ask it alone
    if len(window.members) == 1:
        alone.clear()  # a window of one is the shard decoded alone already
    return Split({m: p for m, p in given.items() if m not in alone}, alone)


def _runs(spans: list[tuple[float, float]], words: Sequence[tuple[float, str]]) -> list[tuple[int, float, str]] | None:
    """Words in runs by the member whose audio (within REACH_S) each was heard in: (member, time of
    its first word, text); None where a word is heard in no member's audio or the runs go back."""
    runs: list[tuple[int, float, str]] = []
    for time, word in words:
        at = next((i for i, (a, b) in enumerate(spans) if a - REACH_S <= time <= b + REACH_S), None)
        if at is None or (runs and at < runs[-1][0]):
            return None
        if runs and runs[-1][0] == at:
            runs[-1] = (at, runs[-1][1], runs[-1][2] + word)
        else:
            runs.append((at, time, word))
    return [(at, first, line.strip()) for at, first, line in runs] or None
