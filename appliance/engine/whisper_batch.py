"""Continuous batching of Whisper's decoder: every step runs the sequences decoding at that moment.

A sequence joins with its encoder output (its cross-attention keys and values go into a free row of
the KV cache) and its prompt; each step feeds every row one token (the next of its prompt, else the
last it chose) and, for a row past its prompt, chooses the next under the logit rules (whisper_rules.py).
A sequence that ends (<|endoftext|>, or the decoder's context full) leaves at once: the last row
moves into its place, so the rows decoding are always 0..n-1. Nothing here knows about shards,
requests or threads; the engine joins sequences while there is room and steps until all have left.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.engine.whisper_beams import BeamGroup, beam_step
from appliance.engine.whisper_model import MAX_POSITIONS, KvCache, WhisperModel
from appliance.engine.whisper_ops import softmax, to_host
from appliance.engine.whisper_rules import Rules, log_softmax


@dataclass(slots=True)
class Sequence:
    """One decode: its prompt (the tokens fed before any is chosen) and what it chose."""

    prompt: list[int]
    key: Hashable = 0  # whose it is: the engine's name for its shard
    temperature: float = 0.0  # 0: greedy; above: sampled at that temperature
    timestamps: bool = True
    chosen: list[int] = field(default_factory=list)  # generated tokens, <|endoftext|> last where it ended
    logprob: float = 0.0  # the sum over `chosen`
    no_speech_prob: float = 0.0  # <|nospeech|>'s probability after <|startoftranscript|>
    fed: int = 0  # tokens fed to the decoder so far (its next position)
    group: BeamGroup | None = None  # one of a shard's beams (whisper_beams.py); None: greedy or sampled
    # a sampled decode's own generator, seeded by its caller: the same audio is sampled the same way
    # whatever else shares the batch, and whatever was sampled before it
    rng: np.random.Generator = field(default_factory=lambda: np.random.default_rng(0))

    @property
    def next_input(self) -> int:
        return self.prompt[self.fed] if self.fed < len(self.prompt) else self.chosen[self.fed - len(self.prompt)]


class DecodeBatch:
    """At most `capacity` sequences (the baked max_batch) decoding together on one KV cache."""

    def __init__(
        self,
        model: WhisperModel,
        rules: Rules,
        capacity: int,
        sot: int,
        no_speech: int | None,
        frames: int = 1500,
    ) -> None:
        """`frames`: the encoder positions of a window (1500: 30 s)."""
        self.model, self.rules, self.capacity = model, rules, capacity
        self.sot, self.no_speech = sot, no_speech
        self.cache = KvCache(model, capacity, frames)
        self.rows: list[Sequence] = []
        self.steps = 0  # decoder steps run, and rows they ran (statistics)
        self.rows_stepped = 0

    @property
    def free(self) -> int:
        return self.capacity - len(self.rows)

    def join(self, sequence: Sequence, cross: list[tuple[Any, Any]], at: int) -> None:
        """`sequence` decodes from the next step on, on item `at` of a batch's cross-attention keys and values."""
        if not self.free:
            raise RuntimeError("the decode batch is full")
        if not sequence.prompt or len(sequence.prompt) >= MAX_POSITIONS:
            raise ValueError(f"a prompt of {len(sequence.prompt)} tokens: the decoder takes 1 to {MAX_POSITIONS - 1}")
        self.cache.put(len(self.rows), cross, at)
        self.rows.append(sequence)

    def step(self) -> list[Sequence]:
        """One decoder step for every row; returns the sequences that ended (they have left)."""
        if not self.rows:
            return []
        xp = self.model.xp
        tokens = xp.asarray([s.next_input for s in self.rows])
        positions = xp.asarray([s.fed for s in self.rows])
        logits = self.model.step(self.cache, tokens, positions)
        self.steps, self.rows_stepped = self.steps + 1, self.rows_stepped + len(self.rows)
        chosen = self._chosen_on_device(logits)
        rest = [row for row in range(len(self.rows)) if row not in chosen]  # their logits come to the host
        host = dict(zip(rest, to_host(xp, logits[xp.asarray(rest, dtype=xp.int64)] if chosen else logits)))
        ended: list[int] = []  # rows that leave
        answers: list[Sequence] = []  # what they answer (a beam group: one for all its rows)
        groups: dict[int, list[int]] = {}
        for row, sequence in enumerate(self.rows):
            fed_token = sequence.next_input
            sequence.fed += 1
            if fed_token == self.sot and self.no_speech is not None:
                sequence.no_speech_prob = float(softmax(np, host[row])[self.no_speech])
            if sequence.fed < len(sequence.prompt):
                continue  # still feeding its prompt
            if sequence.group is not None:
                groups.setdefault(id(sequence.group), []).append(row)
                continue
            token = self._take(sequence, *chosen[row]) if row in chosen else self._choose(sequence, host[row])
            if token == self.rules.eot or sequence.fed >= MAX_POSITIONS - 1:
                ended.append(row)
                answers.append(sequence)
        for rows in groups.values():
            if self._beams(rows, np.stack([host[r] for r in rows])):
                ended += rows
                answers.append(self.rows[rows[0]])
        for row in sorted(ended, reverse=True):
            self._leave(row)
        return answers

    def _beams(self, rows: list[int], logits: np.ndarray) -> bool:
        """One beam-search step of the group on `rows` (`logits`: theirs): the beams' own caches follow
        their parents; True where the group ended (its first row then holds the answer)."""
        beams = [self.rows[r] for r in rows]
        group = beams[0].group
        assert group is not None and len(rows) == group.size
        full = beams[0].fed >= MAX_POSITIONS - 1
        found = beam_step(
            group,
            self.rules,
            [b.chosen for b in beams],
            [b.logprob for b in beams],
            logits,
            beams[0].timestamps,
            full,
        )
        if found.done:
            beams[0].logprob, beams[0].chosen = group.best()
            return True
        self.cache.reorder(rows, [rows[p] for p in found.parents])
        for beam, tokens, score in zip(beams, found.tokens, found.scores):
            beam.chosen, beam.logprob = tokens, score
        return False

    def _chosen_on_device(self, logits: Any) -> dict[int, tuple[int, float]]:
        """The rows that choose greedily with timestamps at this step, each row's token and its log
        probability chosen where the logits are (the model's ops; none where they cannot). A row fed
        <|startoftranscript|> goes to the host: its <|nospeech|> probability is read there."""
        rows = [
            row
            for row, s in enumerate(self.rows)
            if s.fed + 1 >= len(s.prompt) and s.group is None and not s.temperature and s.timestamps
            and s.next_input != self.sot
        ]  # fmt: skip
        if not rows or not self.model.ops.chooses:
            return {}
        histories, counts = np.zeros((len(rows), MAX_POSITIONS), np.int32), np.zeros(len(rows), np.int32)
        for at, row in enumerate(rows):
            chosen = self.rows[row].chosen
            histories[at, : len(chosen)], counts[at] = chosen, len(chosen)
        found = self.model.ops.greedy(logits, rows, histories, counts, self.rules)
        return {} if found is None else {row: (int(t), float(p)) for row, t, p in zip(rows, *found)}

    def _choose(self, sequence: Sequence, logits: np.ndarray) -> int:
        logits = self.rules.apply(logits, sequence.chosen, sequence.timestamps)
        logprobs = log_softmax(logits)
        if sequence.temperature > 0:
            token = int(sequence.rng.choice(len(logits), p=softmax(np, logits / sequence.temperature)))
        else:
            token = int(np.argmax(logits))
        return self._take(sequence, token, float(logprobs[token]))

    @staticmethod
    def _take(sequence: Sequence, token: int, logprob: float) -> int:
        sequence.chosen.append(token)
        sequence.logprob += logprob
        return token

    def leave(self, sequence: Sequence) -> None:
        """`sequence` stops decoding now (its caller went away); the others go on."""
        self._leave(next(row for row, s in enumerate(self.rows) if s is sequence))

    def _leave(self, row: int) -> Sequence:
        """The row's sequence leaves; the last row takes its place in the cache."""
        last = len(self.rows) - 1
        sequence = self.rows[row]
        if row != last:
            self.cache.move(last, row)
            self.rows[row] = self.rows[last]
        self.rows.pop()
        return sequence
