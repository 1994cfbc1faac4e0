"""The box's own Whisper decoding across calls: shards join the engine's continuous batch while it
has rows, whichever request they come from, and each leaves with its answer as soon as it is decoded.

A whole-batch call (CTranslate2's `generate`) holds its batch until the longest sequence ends, and new
work waits for it. Here the batch queue (batch_queue.py) hands shards in as rows free up (`room`,
`begin`: their encoder windows run together) and takes answers out between decoder steps (`advance`):
a new request's encoder output joins at the next step, and a short shard is answered while a long one
still decodes. The engine's own `run` and `decode` are this loop over one call's shards.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from appliance.engine import whisper_loops
from appliance.engine.speech_engine import Decoded, Shard
from appliance.engine.whisper_batch import DecodeBatch, Sequence
from appliance.engine.whisper_features import SAMPLE_RATE, log_mel
from appliance.engine.whisper_tokens import Generated, WhisperTokens
from appliance.engine.whisper_words import Word

# Decoder steps per `advance` when no shard ends sooner: a new shard waits at most this many steps for
# its turn to join, and the queue's thread is handed work once per this many (not once per step).
STEPS_PER_ADVANCE = 4


class Decoder(Protocol):
    """What a Decoding needs of its engine (whisper_arrays_engine.ArrayWhisperEngine)."""

    batch: DecodeBatch
    beam_size: int
    max_batch: int
    tokens: WhisperTokens
    filters: np.ndarray
    retried: Counter[str]
    windows: Counter[str]

    def beams_of(self, sequence: Sequence) -> list[Sequence]: ...

    def hotter(self, sequence: Sequence) -> Sequence | None: ...

    def stands(self, sequence: Sequence) -> bool: ...

    def encode(self, features: np.ndarray) -> list[list[tuple[Any, Any]]]: ...

    def languages(self, shards: list[Shard], cross: list[list[tuple[Any, Any]]]) -> list[tuple[str, float]]: ...

    def words(
        self, shard: Shard, language: str, ids: list[int], cross: list[tuple[Any, Any]], at: int
    ) -> list[Word]: ...


@dataclass(slots=True)
class _Open:
    """A shard decoding: where its encoder output is, and the language it decodes in."""

    shard: Shard
    cross: list[tuple[Any, Any]]  # its encoder chunk's cross-attention keys and values
    at: int  # its item in that chunk
    language: str
    probability: float


class Decoding:
    """Sequences (and the shards they decode) on `engine`'s one continuous batch, across calls."""

    grouped = False  # any prompts and temperatures decode together: each row is its own

    def __init__(self, engine: Decoder, fallback: bool = True) -> None:
        """`fallback`: a decode that loops or is unsure joins again at the next temperature."""
        self.engine, self.fallback = engine, fallback
        self._where: dict[Hashable, tuple[list[tuple[Any, Any]], int]] = {}
        self._units: list[list[Sequence]] = []  # waiting for rows (a beam group's all at once)
        self._open: dict[Hashable, _Open] = {}
        self._first: dict[Hashable, Sequence] = {}  # a falling-back shard's first decode

    @property
    def busy(self) -> bool:
        return bool(self._units or self.engine.batch.rows)

    @property
    def room(self) -> int:
        """Shards that can begin now and join at the next step."""
        free = self.engine.batch.free - sum(len(unit) for unit in self._units)
        return max(0, free) // self.engine.beam_size

    def add(self, sequence: Sequence, cross: list[tuple[Any, Any]], at: int) -> None:
        """`sequence` decodes on item `at` of `cross` from the first step with a free row."""
        self._where[sequence.key] = (cross, at)
        self._units.append(self.engine.beams_of(sequence))

    def step(self) -> list[Sequence]:
        """Waiting sequences join where rows are free; one decoder step; the sequences that ended for good."""
        batch = self.engine.batch
        while self._units and batch.free >= len(self._units[0]):
            for sequence in self._units.pop(0):
                cross, at = self._where[sequence.key]
                batch.join(sequence, cross, at)
        ended = []
        for sequence in batch.step():
            again = self.engine.hotter(sequence) if self.fallback else None
            if again is not None:
                self._first.setdefault(sequence.key, sequence)
                self.engine.retried["temperature"] += 1
                self._units.append([again])
                continue
            del self._where[sequence.key]
            first = self._first.pop(sequence.key, None)
            if first is not None and not self.engine.stands(sequence):  # none stood: the first, cut
                first.chosen = whisper_loops.cut(first.chosen, self.engine.tokens.eot)
                sequence = first
            ended.append(sequence)
        return ended

    def begin(self, keyed: list[tuple[Hashable, Shard]]) -> None:
        """Shards to decode: their encoder windows run now (max_batch at a time), their decodes join."""
        engine = self.engine
        shards = [shard for _, shard in keyed]
        cross = engine.encode(log_mel([s.samples for s in shards], engine.filters))
        detected = engine.languages(shards, cross)
        for i, ((key, shard), (language, probability)) in enumerate(zip(keyed, detected)):
            chunk, at = divmod(i, engine.max_batch)
            self._open[key] = _Open(shard, cross[chunk], at, language, probability)
            prompt = engine.tokens.prompt(shard.task, language, shard.prompt)
            self.add(Sequence(prompt, key, shard.temperature), cross[chunk], at)
        engine.windows.update(shards=len(shards), windows=len(shards))

    def advance(self) -> list[tuple[Hashable, Decoded]]:
        """Up to STEPS_PER_ADVANCE decoder steps, fewer where shards were decoded: their answers."""
        for _ in range(STEPS_PER_ADVANCE):
            if ended := self.step():
                return [(sequence.key, self._answer(sequence)) for sequence in ended]
            if not self.busy:
                break
        return []

    def drop(self, key: Hashable) -> None:
        """The shard's caller went away: it leaves the batch now, and the others go on."""
        self._open.pop(key, None)
        self._where.pop(key, None)
        self._first.pop(key, None)
        self._units = [unit for unit in self._units if unit[0].key != key]
        for sequence in [s for s in self.engine.batch.rows if s.key == key]:
            self.engine.batch.leave(sequence)

    def clear(self) -> list[tuple[Hashable, Shard]]:
        """Every decode stops (the engine failed under them); the shards that were open."""
        shards = [(key, opened.shard) for key, opened in self._open.items()]
        for key in list(self._where):
            self.drop(key)
        self._open.clear()
        return shards

    def _answer(self, sequence: Sequence) -> Decoded:
        engine, opened = self.engine, self._open.pop(sequence.key)
        shard = opened.shard
        ids = [t for t in sequence.chosen if t != engine.tokens.eot]
        generated = Generated(ids, sequence.logprob / max(1, len(ids)), sequence.no_speech_prob)
        return Decoded(
            opened.language,
            engine.tokens.pieces(ids, len(shard.samples) / SAMPLE_RATE),
            engine.words(shard, opened.language, ids, opened.cross, opened.at) if shard.words else [],
            language_probability=opened.probability,
            quality=engine.tokens.quality(generated, sequence.temperature),
        )
