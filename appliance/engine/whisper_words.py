"""Word timestamps from CTranslate2's Whisper alignment (cross-attention over the decoded text, median
filtered, then dynamic time warping: `Whisper.align`), as faster-whisper's `word_timestamps` reads it:
a word starts where the alignment jumps to its first token and ends where it jumps to the next
word's; its probability is the mean of its tokens'. Words split on spaces (on characters for the
languages written without them); punctuation joins the word it belongs to. Plain functions.
"""

from __future__ import annotations

import string
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # only CTranslate2's engine calls these: the box's own Whisper runs without it
    import ctranslate2

TOKEN_SECONDS = 0.02  # an alignment step: one encoder position
NO_SPACES = frozenset({"zh", "ja", "th", "lo", "my", "yue"})  # languages split into characters, not words
PREPENDED = "\"'“¿([{-"  # punctuation that joins the word after it (faster-whisper's defaults)
APPENDED = "\"'.。,，!！?？:：”)]}、"  # and the word before it


@dataclass(frozen=True, slots=True)
class Word:
    start: float  # seconds from the shard's start
    end: float
    text: str  # as Whisper writes it, with its leading space
    probability: float


def aligned_words(
    model: ctranslate2.models.Whisper,
    inputs: tuple[np.ndarray, ctranslate2.StorageView],
    starts: list[list[int] | None],
    ids: list[list[int]],
    frames: list[int],
    eot: int,
    decode: Callable[[list[int]], str],
    languages: list[str],
) -> dict[int, list[Word]]:
    """The words of each decode of a batch whose start sequence is given (None: no words asked),
    from one `Whisper.align` call per start sequence (language and task): on the encoder's output
    (`inputs`: the batch's features and its encoding) where every decode of the batch is in it, else
    on those decodes' features."""
    from ctranslate2 import StorageView  # here: the box's own Whisper imports this module, not CTranslate2

    features, encoded = inputs
    texts = [[t for t in decoded if t < eot] for decoded in ids]
    by_start: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for at, start in enumerate(starts):
        if start is not None and texts[at]:
            by_start[tuple(start)].append(at)
    found: dict[int, list[Word]] = {}
    for start_ids, members in by_start.items():
        batch = encoded if len(members) == len(ids) else StorageView.from_array(np.ascontiguousarray(features[members]))
        aligned = model.align(batch, list(start_ids), [texts[at] for at in members], [frames[at] for at in members])
        for at, result in zip(members, aligned):
            words, word_tokens = split_words(texts[at] + [eot], decode, eot, languages[at])
            found[at] = timed_words(words, word_tokens, result.alignments, result.text_token_probs, eot)
    return found


def split_words(
    tokens: Sequence[int], decode: Callable[[list[int]], str], eot: int, language: str
) -> tuple[list[str], list[list[int]]]:
    """Tokens (ending with <|endoftext|>) -> words and the tokens of each."""
    subwords, subword_tokens = _split_on_unicode(tokens, decode)
    if language in NO_SPACES:
        return subwords, subword_tokens
    words: list[str] = []
    word_tokens: list[list[int]] = []
    for subword, pieces in zip(subwords, subword_tokens):
        starts = pieces[0] >= eot or subword.startswith(" ") or subword.strip() in string.punctuation
        if starts or not words:
            words.append(subword)
            word_tokens.append(list(pieces))
        else:
            words[-1] += subword
            word_tokens[-1].extend(pieces)
    return words, word_tokens


def _split_on_unicode(tokens: Sequence[int], decode: Callable[[list[int]], str]) -> tuple[list[str], list[list[int]]]:
    """Runs of tokens that decode to whole characters (a character may span several byte tokens)."""
    full = decode(list(tokens))
    words: list[str] = []
    word_tokens: list[list[int]] = []
    current: list[int] = []
    offset = 0
    for token in tokens:
        current.append(token)
        decoded = decode(current)
        broken = decoded.find("\ufffd")
        if broken < 0 or (offset + broken < len(full) and full[offset + broken] == "\ufffd"):
            words.append(decoded)
            word_tokens.append(current)
            current = []
            offset += len(decoded)
    return words, word_tokens


def timed_words(
    words: list[str],
    word_tokens: list[list[int]],
    alignments: Sequence[tuple[int, int]],
    token_probs: Sequence[float],
    eot: int,
) -> list[Word]:
    """The alignment's (text index, time index) path -> each word's start, end and probability."""
    if len(word_tokens) <= 1 or not alignments:
        return []
    text_indices = np.array([a[0] for a in alignments])
    time_indices = np.array([a[1] for a in alignments])
    boundaries = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(text_indices), (1, 0), constant_values=1).astype(bool)
    jump_times = time_indices[jumps] * TOKEN_SECONDS
    if len(jump_times) < len(boundaries):
        return []
    probs = np.asarray(token_probs, np.float64)
    out = []
    for i, (word, tokens) in enumerate(zip(words, word_tokens)):
        if tokens[0] >= eot:
            continue  # the closing <|endoftext|>
        a, b = boundaries[i], boundaries[i + 1]
        probability = float(np.mean(probs[a:b])) if b > a and len(probs) >= b else 0.0
        out.append(Word(float(jump_times[a]), float(jump_times[b]), word, round(probability, 4)))
    return merge_punctuation(out)


def merge_punctuation(words: list[Word]) -> list[Word]:
    """Punctuation on its own joins its word: an opening mark the next one, a closing mark the last one."""
    out: list[Word] = []
    pending = ""
    for word in words:
        text = word.text.strip()
        if text and all(c in PREPENDED for c in text) and word is not words[-1]:
            pending += word.text
            continue
        if text and all(c in APPENDED for c in text) and out:
            last = out[-1]
            out[-1] = Word(last.start, max(last.end, word.end), last.text + word.text.strip(), last.probability)
            continue
        if pending:
            word = Word(word.start, word.end, pending + word.text.lstrip(), word.probability)
            pending = ""
        out.append(word)
    return out
