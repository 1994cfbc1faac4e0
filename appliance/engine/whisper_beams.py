"""Beam search on the continuous batch, as openai-whisper's BeamSearchDecoder (patience 1, no
length penalty): a shard decoding with beam size N holds N rows of the batch. Each step every beam
offers its N + 1 likeliest next tokens (under the logit rules) scored by its sum of log probabilities;
the best candidates in order become the next beams (an <|endoftext|> one a finished hypothesis instead)
until there are N; the group ends with N finished (or a full context), its answer the finished one
with the best mean log probability per token. The first step takes candidates from one beam only
(all still hold the same prompt)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from appliance.engine.whisper_rules import Rules, log_softmax


@dataclass(slots=True)
class BeamGroup:
    """The beams of one shard: `size` rows of the batch, and the hypotheses that ended."""

    size: int
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # (sum of log probs, tokens)

    def best(self) -> tuple[float, list[int]]:
        return max(self.finished, key=lambda f: f[0] / max(1, len(f[1])))


@dataclass(frozen=True, slots=True)
class Step:
    """What a group's step chose: for each beam, the beam it continues (its cache rows) and its tokens."""

    parents: list[int]
    tokens: list[list[int]]
    scores: list[float]
    done: bool


def beam_step(
    group: BeamGroup,
    rules: Rules,
    chosen: list[list[int]],
    scores: list[float],
    logits: np.ndarray,
    timestamps: bool,
    full: bool,
) -> Step:
    """One step of a group whose beams have `chosen` so far with sum log probabilities `scores`;
    `logits` [beams, vocabulary]; `full`: the decoder's context has no room for another token."""
    candidates: list[tuple[float, int, int]] = []
    for k in range(1 if not chosen[0] else len(chosen)):
        logprobs = log_softmax(rules.apply(logits[k], chosen[k], timestamps))
        for token in np.argsort(-logprobs, kind="stable")[: group.size + 1]:
            if np.isfinite(logprobs[token]):
                candidates.append((scores[k] + float(logprobs[token]), k, int(token)))
    candidates.sort(key=lambda c: -c[0])
    parents, tokens, new_scores = [], [], []
    for score, k, token in candidates:
        if token == rules.eot:
            if len(group.finished) < group.size:
                group.finished.append((score, [*chosen[k], token]))
        else:
            parents.append(k)
            tokens.append([*chosen[k], token])
            new_scores.append(score)
        if len(parents) == group.size:
            break
    while parents and len(parents) < group.size:  # fewer live candidates than beams: the best again
        parents.append(parents[0])
        tokens.append(list(tokens[0]))
        new_scores.append(new_scores[0])
    done = len(group.finished) >= group.size or full or not parents
    if done and full:
        group.finished += list(zip(new_scores, tokens))  # the context is full: the live beams end as they are
    return Step(parents, tokens, new_scores, done)
