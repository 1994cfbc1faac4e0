"""A Whisper decode that loops on itself: the same words again and again, where the speech has none of
that (Portuguese told to be English: "We'll try and try and try..." some 200 times, "We will have a
great day" about 40). openai-whisper's test is the text's gzip compression ratio over 2.4; a loop that
ends before Whisper's length limit may stay under it, so a run of REPEAT_TOKENS tokens heard more than
MAX_REPEATS times in one decode is a loop too. Such a decode is sampled again at rising temperatures
(engine/whisper.py); where every one loops, the text is cut where the loop begins.
"""

from __future__ import annotations

import zlib
from collections import Counter
from collections.abc import Callable

MAX_COMPRESSION = 2.4  # openai-whisper's compression_ratio_threshold
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
