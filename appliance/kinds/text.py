"""Text cut where a speaker would pause: sentences, and clauses inside them, with the punctuation
that ends each. The speech and translation kinds share it for their `semantic` shards.

A boundary is a run of terminators (. ! ? … , ; :) followed by closing quotes or brackets and then
white space or the end of the text, which is how espeak-ng (and so Piper) ends its clauses: "3.50"
and "e.g.x" are not cut, "Dr. Smith" is (espeak-ng cuts it too).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from appliance.errors import BadRequest
from appliance.firmware import ModelSpec
from appliance.protocol.tensors import InferRequest

SENTENCE_ENDS = ".!?…"
CLOSING = "\"'”’»)]"  # what may follow a sentence's end
BOUNDARY = re.compile(r"([.!?…,;:]+)[\"'”’»)\]]*(?=\s|$)")
T = TypeVar("T")
Cut = Callable[[list[T], int], list[list[T]]]  # clauses -> runs of at most N tokens, cut anywhere
MAX_TEXT_CHARS = 65536  # one request's text: ~10,000 words (longer is a 413 naming the limit)


@dataclass(frozen=True, slots=True)
class ShardLimits:
    """A text model's own shard parameters (its `parameters` in the firmware: baked, as the firmware's
    [baked] are, but in its own unit: a VAD's frames are not a voice's phonemes or a pair's pieces)."""

    max_tokens_per_shard: int
    split_algorithm: str
    max_batch: int

    @classmethod
    def of(cls, spec: ModelSpec) -> ShardLimits:
        p = spec.parameters  # types, bounds and choices checked by the firmware's reader (KIND_PARAMETERS)
        max_tokens, algorithm, max_batch = p["max_tokens_per_shard"], p["split_algorithm"], p["max_batch"]
        assert isinstance(max_tokens, int) and isinstance(algorithm, str) and isinstance(max_batch, int)
        return cls(max_tokens, algorithm, max_batch)


@dataclass(frozen=True, slots=True)
class Clause:
    text: str  # without its terminator
    terminator: str  # one of . ! ? , ; : or "" where the text just ends
    ends_sentence: bool


def clauses(text: str) -> list[Clause]:
    """The clauses of a text in order; empty ones (a lone terminator) are dropped."""
    found, start = [], 0
    for match in BOUNDARY.finditer(text):
        found.append(_clause(text[start : match.start()], match.group(1)))
        start = match.end()
    if text[start:].strip():
        found.append(Clause(text[start:].strip(), "", True))
    return [c for c in found if c.text]


def _clause(text: str, run: str) -> Clause:
    """A clause and its terminator: a question or an exclamation wins over a stop, as in '?!' and '...'."""
    terminator = next((t for t in "?!" if t in run), "." if any(c in SENTENCE_ENDS for c in run) else run[0])
    return Clause(text.strip(), terminator, terminator in ".!?")


class ArrivingText:
    """A text arriving in pieces (an LLM's words), given back whole sentences as they complete. A
    sentence ends as BOUNDARY says, once white space follows it ("3." may still become "3.50"). Each
    character is looked at once, as it arrives: a text cut into a million pieces costs what it costs
    whole, where rescanning what waits at each piece cost its square."""

    def __init__(self) -> None:
        self.length = 0  # every character given so far
        self._waiting: list[str] = []  # the pieces of the sentence not yet whole
        self._waiting_length = 0
        self._phase = _WORDS  # where the text's end is: in words, a run of terminators, its closers
        self._run_ends_sentence = False  # whether that run of terminators holds . ! ? or …

    def add(self, piece: str) -> str:
        """`piece` appended; the whole sentences it completes ("" where none)."""
        said = 0  # where the last whole sentence ends, in what waits
        for index, char in enumerate(piece, self._waiting_length):
            if char in _TERMINATORS:
                if self._phase != _TERMINATOR_RUN:
                    self._run_ends_sentence = False
                self._phase = _TERMINATOR_RUN
                self._run_ends_sentence |= char in SENTENCE_ENDS
            elif char in _CLOSERS and self._phase != _WORDS:
                self._phase = _CLOSERS_RUN
            else:
                if char.isspace() and self._phase != _WORDS and self._run_ends_sentence:
                    said = index
                self._phase = _WORDS
        self.length += len(piece)
        self._waiting.append(piece)
        self._waiting_length += len(piece)
        if not said:
            return ""
        waiting = "".join(self._waiting)
        self._waiting, self._waiting_length = [waiting[said:]], len(waiting) - said
        return waiting[:said]

    def rest(self) -> str:
        """What waits (the text ended): the last sentence, whole or not."""
        rest, self._waiting, self._waiting_length = "".join(self._waiting), [], 0
        return rest


_TERMINATORS, _CLOSERS = ".!?…,;:", "\"'”’»)]"  # as BOUNDARY's two character classes
_WORDS, _TERMINATOR_RUN, _CLOSERS_RUN = range(3)


def ends_sentence(text: str) -> bool:
    """The text's last clause ends its sentence (closing quotes or brackets may follow the stop)."""
    return text.rstrip().rstrip(CLOSING)[-1:] in SENTENCE_ENDS


def sentences(text: str) -> list[list[Clause]]:
    """The clauses grouped by sentence."""
    return grouped_by_sentence(clauses(text), lambda c: c.ends_sentence)


def grouped_by_sentence(items: list[T], ends: Callable[[T], bool]) -> list[list[T]]:
    grouped: list[list[T]] = [[]]
    for clause in items:
        grouped[-1].append(clause)
        if ends(clause):
            grouped.append([])
    return [s for s in grouped if s]


def joined(clauses: list[Clause]) -> str:
    return " ".join(c.text + c.terminator for c in clauses)


JSON_TYPES = {bool: "true or false", int: "a number", float: "a number", list: "a list", dict: "an object"}


def checked_text(raw: object, where: str) -> str:
    """A request's text: a non-empty string of at most MAX_TEXT_CHARS characters."""
    if raw is None:
        raise BadRequest(f"{where} is missing: give the text")
    if not isinstance(raw, str):
        raise BadRequest(f"{where} must be a string of text, not {JSON_TYPES.get(type(raw), type(raw).__name__)}")
    if len(raw) > MAX_TEXT_CHARS:
        raise BadRequest(f"{where} holds {len(raw)} characters; the most one request takes is {MAX_TEXT_CHARS}", 413)
    if not raw.strip():
        raise BadRequest(f"{where} is empty: there is no text to work on")
    return raw


def plan_shards(
    sentences: list[list[T]], max_tokens: int, algorithm: str, size: Callable[[list[T]], int], cut: Cut[T]
) -> list[list[T]]:
    """Shards of at most `max_tokens` tokens (as `size` measures a run of clauses), in order.

    `semantic`: one shard per sentence; a longer sentence is cut between clauses, and a clause longer
    still by `cut` (at the limit). `fixed`: all clauses cut by `cut` every `max_tokens` tokens."""
    if algorithm == "fixed":
        return cut([c for s in sentences for c in s], max_tokens)
    shards: list[list[T]] = []
    for sentence in sentences:
        if size(sentence) <= max_tokens:
            shards.append(sentence)
            continue
        pending: list[T] = []
        for clause in sentence:
            if pending and size([*pending, clause]) > max_tokens:
                shards.append(pending)
                pending = []
            if size([clause]) > max_tokens:
                shards += cut([clause], max_tokens)
            else:
                pending.append(clause)
        if pending:
            shards.append(pending)
    return shards


def utf8(element: object, where: str) -> str:
    try:
        return element.decode() if isinstance(element, bytes) else str(element)
    except UnicodeDecodeError:
        raise BadRequest(f"input {where}: a BYTES element is not valid UTF-8") from None


def request_texts(request: InferRequest, model: str, name: str) -> list[str]:
    """The texts of an infer request to a model that takes one BYTES input of one element or more
    (translation, language identification): each checked, MAX_TEXT_CHARS in all."""
    array = request.inputs.get(name)
    if set(request.inputs) != {name} or array is None or array.dtype != object or array.size == 0:
        raise BadRequest(f"model {model} takes one input {name!r}: BYTES, one element or more")
    texts = [checked_text(utf8(t, name), name) for t in array.reshape(-1)]
    if sum(map(len, texts)) > MAX_TEXT_CHARS:
        raise BadRequest(f"input {name} holds more than {MAX_TEXT_CHARS} characters in all", 413)
    return texts
