"""A Whisper decode that loops on itself: the same words again and again, where the speech has none of
that (Portuguese told to be English: "We'll try and try and try..." some 200 times, "We will have a
great day" about 40). openai-whisper's test is the text's gzip compression ratio over 2.4; a loop that
ends before Whisper's length limit may stay under it, so a run of REPEAT_TOKENS tokens heard more than
MAX_REPEATS times in one decode is a loop too. Such a decode is sampled again at rising temperatures
(engine/whisper.py, whisper_decoding.py), and a sample stands only where it neither loops nor is unsure
(openai-whisper's test): samples of real speech said six times over were taken before with a mean log
probability of -2.2 ("We will meet attinestation before the train-ahiin lease"). Where none stands, the
first decode stands, cut where its loop begins.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

FALLBACK_TEMPERATURES = (0.2, 0.4, 0.6, 0.8, 1.0)
MAX_COMPRESSION = 2.4  # openai-whisper's compression_ratio_threshold
LOGPROB_LIMIT = -1.0  # its logprob_threshold: under it Whisper was unsure
NO_SPEECH_LIMIT = 0.6  # its no_speech_threshold: above it (and unsure) nothing was said
REPEAT_TOKENS = 4  # a run this long
MAX_REPEATS = 3  # heard at most this often in one window


def compression_ratio(text: str) -> float:
    data = text.encode()
    return len(data) / len(zlib.compress(data)) if data else 0.0


def looping(text_tokens: list[int], text: str) -> bool:
    """The decode repeats itself: its text compresses too well, or a run of tokens recurs too often."""
    if compression_ratio(text) > MAX_COMPRESSION:
        return True
    runs = Counter(tuple(text_tokens[i : i + REPEAT_TOKENS]) for i in range(len(text_tokens) - REPEAT_TOKENS + 1))
    return max(runs.values(), default=0) > MAX_REPEATS


def stands(text_tokens: list[int], text: str, mean_logprob: float, no_speech_prob: float) -> bool:
    """openai-whisper's test of a decode: no loop, and sure of itself unless nothing was said."""
    return not looping(text_tokens, text) and (mean_logprob >= LOGPROB_LIMIT or no_speech_prob > NO_SPEECH_LIMIT)


def looping_rows(ids: list[list[int]], eot: int, decode: Callable[[list[int]], str]) -> list[int]:
    """Which of a batch's decodes (token ids, special tokens from `eot` on) loop on themselves."""
    found = []
    for i, tokens in enumerate(ids):
        text = [t for t in tokens if t < eot]
        if looping(text, decode(text)):
            found.append(i)
    return found


def cut(ids: list[int], eot: int) -> list[int]:
    """The ids before the text token where a run of REPEAT_TOKENS begins its third time (the loop's
    first two turns kept, timestamps with them); all of them where no run recurs so."""
    positions = [i for i, token in enumerate(ids) if token < eot]
    text = [ids[i] for i in positions]
    seen: Counter[tuple[int, ...]] = Counter()
    for k in range(len(text) - REPEAT_TOKENS + 1):
        run = tuple(text[k : k + REPEAT_TOKENS])
        seen[run] += 1
        if seen[run] > 2:
            return ids[: positions[k]]
    return ids
