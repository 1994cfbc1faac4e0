"""Word timestamps for the box's own Whisper from its alignment heads, as openai-whisper's
`find_alignment` (and CTranslate2's `Whisper.align`) compute them: the decoder run over the start,
<|notimestamps|>, the text and <|endoftext|>; the cross-attention of the model's alignment heads
(config.json) over the shard's frames, standardized per head, median filtered (7 wide) and averaged;
dynamic time warping through it gives each text token its encoder position. whisper_words.py turns
the path into words, as it does CTranslate2's."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from appliance.engine.whisper_model import KvCache, WhisperModel
from appliance.engine.whisper_ops import softmax, to_host
from appliance.engine.whisper_words import Word, split_words, timed_words

MEDIAN_WIDTH = 7


def alignment(
    model: WhisperModel,
    cross: list[tuple[object, object]],
    at: int,
    tokens: list[int],
    skip: int,
    frames: int,
    heads: Sequence[tuple[int, int]],
) -> tuple[np.ndarray, np.ndarray]:
    """The alignment heads' weights [heads, tokens - skip - 1, frames // 2] of decoding `tokens` on
    item `at` of `cross` (the rows from position `skip` on, the last one's left out), and each
    token's probability where the decoder met it [tokens]."""
    xp = model.xp
    cache = KvCache(model, 1, int(cross[0][0].shape[2]))  # type: ignore[attr-defined]
    cache.put(0, cross, at)
    rows, probs = [], [1.0]
    for position, token in enumerate(tokens):
        kept: list[object] = []
        logits = to_host(xp, model.step(cache, xp.asarray([token]), xp.asarray([position]), kept))[0]
        rows.append(np.stack([to_host(xp, kept[layer])[0, head, 0] for layer, head in heads]))
        if position + 1 < len(tokens):
            probs.append(float(softmax(np, logits)[tokens[position + 1]]))
    weights = np.stack(rows, axis=1)[:, skip:-1, : frames // 2]
    weights = weights / weights.sum(axis=-1, keepdims=True)  # the softmax over the shard's frames only
    return weights, np.asarray(probs)


def median_filter(x: np.ndarray) -> np.ndarray:
    """A running median MEDIAN_WIDTH wide along the last axis, the ends reflected (as torch pads)."""
    pad = MEDIAN_WIDTH // 2
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(pad, pad)], mode="reflect")
    return np.asarray(np.median(sliding_window_view(padded, MEDIAN_WIDTH, axis=-1), axis=-1))


def dtw(cost: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cheapest monotonic path through `cost` [tokens, frames]: its (token, frame) indices."""
    n, m = cost.shape
    total = np.full((n + 1, m + 1), np.inf, np.float32)
    trace = np.zeros((n + 1, m + 1), np.int8)
    total[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            diagonal, up, left = total[i - 1, j - 1], total[i - 1, j], total[i, j - 1]
            if diagonal < up and diagonal < left:
                best, move = diagonal, 0
            elif up < diagonal and up < left:
                best, move = up, 1
            else:
                best, move = left, 2
            total[i, j] = cost[i - 1, j - 1] + best
            trace[i, j] = move
    trace[0, :], trace[:, 0] = 2, 1
    path = []
    i, j = n, m
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        move = int(trace[i, j])
        i, j = (i - 1, j - 1) if move == 0 else (i - 1, j) if move == 1 else (i, j - 1)
    steps = np.array(path[::-1])
    return steps[:, 0], steps[:, 1]


def words(
    model: WhisperModel,
    cross: list[tuple[object, object]],
    at: int,
    start: list[int],
    text: list[int],
    special: tuple[int, int],
    frames: int,
    heads: Sequence[tuple[int, int]],
    decode: Callable[[list[int]], str],
    language: str,
) -> list[Word]:
    """The timed words of `text` decoded after `start` on item `at` of `cross` (`frames`: the
    shard's mel frames; `special`: <|notimestamps|> and <|endoftext|>)."""
    if not text:
        return []
    no_timestamps, eot = special
    tokens = [*start, no_timestamps, *text, eot]
    weights, probs = alignment(model, cross, at, tokens, len(start), frames, heads)
    mean, std = weights.mean(axis=-2, keepdims=True), weights.std(axis=-2, keepdims=True)
    weights = median_filter((weights - mean) / std)
    text_indices, time_indices = dtw(-weights.mean(axis=0))
    found, word_tokens = split_words([*text, eot], decode, eot, language)
    token_probs = [float(p) for p in probs[len(start) + 1 : len(start) + 1 + len(text)]]
    path = [(int(a), int(b)) for a, b in zip(text_indices, time_indices)]
    return timed_words(found, word_tokens, path, token_probs, eot)
