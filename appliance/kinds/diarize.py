"""Who spoke when, from voiceprints of sliding windows in the VAD's speech (plain functions; the
answers are kinds/diarized.py's).

Windows of `window` samples every `step` inside each speech span (a span shorter than a window, down
to MIN_WINDOW_S, is one window of its own length). Clustering is agglomerative on cosine similarity
of the clusters' summed voiceprints: first only neighbours in time, down to MAX_ITEMS items (a
30-minute recording's 4,500 windows would make a 80 MB similarity matrix), then any pair, until no two
clusters are more alike than MERGE_SIMILARITY (the automatic count) or until the count fits
min_speakers/max_speakers. A cluster holding under MIN_SPEAKER_S of speech is folded into its nearest
one. Each window then takes the nearest cluster, and owns the time from halfway to its neighbours.
Thresholds measured on the tests' voices (docs/speakers.md).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from appliance.errors import BadRequest

MIN_WINDOW_S = 0.5
MAX_SPEAKERS = 26  # one letter each
MAX_ITEMS = 400
# cosine between two clusters' voiceprints: same voice, windows averaged 0.82 to 0.86; different voices
# 0.37 to 0.72 (Kokoro's af_heart and af_bella, two similar women, 0.72)
MERGE_SIMILARITY = 0.75
MIN_SPEAKER_S = 1.0
# a cluster takes a known speaker's name at this cosine to the speaker's reference (an utterance's
# voiceprint): same voice 0.85 to 0.96 on other sentences, different voices at most 0.73 (docs/speakers.md)
NAME_SIMILARITY = 0.78


@dataclass(frozen=True, slots=True)
class Turn:
    start: float  # seconds
    end: float
    speaker: str


@dataclass(frozen=True, slots=True)
class SpeakerCount:
    least: int = 1
    most: int | None = None  # None: as many as the voices say


def speaker_count(fields: Mapping[str, str]) -> SpeakerCount:
    """`min_speakers` and `max_speakers` of a form or a query (a 400 naming the one at fault)."""
    bounds = {}
    for name in ("min_speakers", "max_speakers"):
        value = fields.get(name)
        if value is not None and (not value.isdigit() or not 1 <= int(value) <= MAX_SPEAKERS):
            raise BadRequest(f"{name} must be a whole number from 1 to {MAX_SPEAKERS}, got {value[:40]!r}", param=name)
        bounds[name] = int(value) if value is not None else None
    least, most = bounds["min_speakers"] or 1, bounds["max_speakers"]
    if most is not None and most < least:
        raise BadRequest(f"max_speakers ({most}) is below min_speakers ({least})", param="max_speakers")
    return SpeakerCount(least, most)


def windows(spans: list[tuple[int, int]], window: int, step: int, rate: int) -> list[tuple[int, int, int]]:
    """(start, end, span index) samples of each window, in order."""
    found = []
    for index, (start, end) in enumerate(spans):
        if end - start < window:
            if end - start >= MIN_WINDOW_S * rate:
                found.append((start, end, index))
            continue
        starts = list(range(start, end - window + 1, step))
        if starts[-1] + window < end:
            starts.append(end - window)  # the span's tail: its last words have a window of their own
        found += [(s, s + window, index) for s in starts]
    return found


def _unit(v: np.ndarray) -> np.ndarray:
    return v / np.maximum(np.linalg.norm(v, axis=-1, keepdims=True), 1e-12)


def _neighbours_merged(sums: list[np.ndarray], members: list[list[int]], spans: list[int]) -> None:
    """Merge the most alike neighbours in time (of one speech span) until MAX_ITEMS are left."""

    def alike(i: int) -> float:
        if spans[i] != spans[i + 1]:
            return -2.0
        return float(_unit(sums[i]) @ _unit(sums[i + 1]))

    scores = [alike(i) for i in range(len(sums) - 1)]
    while len(sums) > MAX_ITEMS:
        i = int(np.argmax(scores))
        sums[i] = sums[i] + sums.pop(i + 1)
        members[i] += members.pop(i + 1)
        spans.pop(i + 1)
        scores.pop(i)
        if i < len(scores):
            scores[i] = alike(i)
        if i > 0:
            scores[i - 1] = alike(i - 1)


def clusters(embeddings: np.ndarray, span_of: list[int], seconds_each: float, count: SpeakerCount) -> np.ndarray:
    """A cluster number for each window (numbered in order of first appearance)."""
    n = len(embeddings)
    if n == 0:
        return np.zeros(0, np.int64)
    sums = list(embeddings.astype(np.float64))
    members = [[i] for i in range(n)]
    spans = list(span_of)
    if len(sums) > MAX_ITEMS:
        _neighbours_merged(sums, members, spans)
    matrix = _unit(np.array(sums))
    alike = matrix @ matrix.T
    np.fill_diagonal(alike, -np.inf)
    alive = list(range(len(sums)))
    most = count.most or len(sums)
    while len(alive) > max(count.least, 1):
        sub = alike[np.ix_(alive, alive)]
        a, b = np.unravel_index(int(np.argmax(sub)), sub.shape)
        if sub[a, b] < MERGE_SIMILARITY and len(alive) <= most:
            break
        keep, gone = alive[a], alive[b]
        sums[keep] = sums[keep] + sums[gone]
        members[keep] += members[gone]
        alive.remove(gone)
        row = _unit(sums[keep]) @ _unit(np.array([sums[j] for j in alive])).T
        alike[keep, alive] = row
        alike[alive, keep] = row
        alike[keep, keep] = -np.inf
    # too little speech to be a speaker of its own: into the nearest cluster that is one
    big = [c for c in alive if len(members[c]) * seconds_each >= MIN_SPEAKER_S] or alive
    while len(big) < count.least and len(big) < len(alive):
        big.append(max((c for c in alive if c not in big), key=lambda c: len(members[c])))
    centroids = _unit(np.array([sums[c] for c in big]))
    nearest = np.argmax(_unit(embeddings.astype(np.float64)) @ centroids.T, axis=1)
    order = {c: i for i, c in enumerate(dict.fromkeys(nearest.tolist()))}
    return np.array([order[c] for c in nearest.tolist()], np.int64)


def names(embeddings: np.ndarray, labels: np.ndarray, known: dict[str, np.ndarray]) -> dict[int, str]:
    """Each cluster's label: a known speaker's name where its voiceprint is close enough to that
    speaker's reference (each name once, the closest first), else a letter (A, B, ... in order of
    first appearance, skipping none)."""
    count = int(labels.max()) + 1 if len(labels) else 0
    centroids = _unit(np.array([embeddings[labels == c].sum(axis=0) for c in range(count)]))
    found: dict[int, str] = {}
    if known and count:
        refs = _unit(np.array(list(known.values())))
        alike = centroids @ refs.T
        for c, k in sorted(np.ndindex(alike.shape), key=lambda p: -alike[p]):
            if alike[c, k] >= NAME_SIMILARITY and c not in found and list(known)[k] not in found.values():
                found[c] = list(known)[k]
    letters = iter(_letters())
    for c in range(count):
        if c not in found:
            found[c] = next(letters)
    return found


def _letters() -> list[str]:
    single = list(string.ascii_uppercase)
    return single + [a + b for a in single for b in single]


def turns(bounds: list[tuple[int, int, int]], spans: list[tuple[int, int]], labels: list[str], rate: int) -> list[Turn]:
    """The speech spans cut where the windows' speaker changes: each window owns the time from halfway
    between its centre and its neighbours' (in its span), consecutive windows of one speaker merged."""
    found: list[Turn] = []
    centres = [(start + end) / 2 for start, end, _ in bounds]
    for i, (_, _, span) in enumerate(bounds):
        first = i == 0 or bounds[i - 1][2] != span
        last = i + 1 == len(bounds) or bounds[i + 1][2] != span
        before = spans[span][0] if first else (centres[i] + centres[i - 1]) / 2
        after = spans[span][1] if last else (centres[i] + centres[i + 1]) / 2
        turn = Turn(round(before / rate, 3), round(after / rate, 3), labels[i])
        if found and found[-1].speaker == turn.speaker and found[-1].end >= turn.start:
            turn = Turn(found.pop().start, turn.end, turn.speaker)
        found.append(turn)
    return found


def speaker_at(timeline: list[Turn], start: float, end: float) -> str:
    """Who speaks most of [start, end] (the nearest turn where none overlaps it); "" with no turns."""
    if not timeline:
        return ""
    overlaps = [(min(end, t.end) - max(start, t.start), t.speaker) for t in timeline]
    best = max(overlaps)
    if best[0] > 0:
        return best[1]
    middle = (start + end) / 2
    return min(timeline, key=lambda t: min(abs(t.start - middle), abs(t.end - middle))).speaker
