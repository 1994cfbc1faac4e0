"""A JSON reader for request bodies that bounds what a hostile body can cost: nesting at most
MAX_DEPTH, at most MAX_VALUES values outside flat data lists, and flat lists of numbers kept as bytes
(`Flat`) until the tensor's datatype and shape are known, then converted in chunks, so a large
tensor never becomes a Python object per number. `json.loads` recurses without a bound and builds
every number as an object, which is what this replaces for infer bodies.

It reads the body's bytes, not a decoded copy: decoding 60 MiB as UTF-8 is one call that holds the
GIL for tens of milliseconds (the event loop's thread waits), and outside strings JSON is ASCII, so
only each string is decoded (which is where a body that is not UTF-8 is found)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from appliance.errors import BadRequest

MAX_DEPTH = 32  # lists and objects inside each other; a request with 8-dimensional nested data needs 11
MAX_VALUES = 100_000  # JSON values (keys included) outside the flat lists that hold tensor data
FAST_JSON_BYTES = 4096  # a document this small without tensor data is read by json.loads (see read_json)
CHUNK_CHARS = 1 << 18  # flat data is converted this many bytes at a time (a bounded list each)
# a long body is scanned this many bytes at a time (see _match_end); 2 at least, a string's escape
SCAN_CHARS = 1 << 20
# A string is decoded in one call, which holds the GIL (a 30 MiB one: 35 ms). No field takes more than
# 65,536 characters of text (256 KiB, or 768 KiB written as \u escapes); a 4 MiB string costs 6 ms.
MAX_STRING_BYTES = 4 << 20


_WHITESPACE = re.compile(rb"[ \t\n\r]*")
_NUMBER = re.compile(rb"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
# What a list of only numbers, or only booleans, can hold between its brackets. One character class
# repeated: the regex engine keeps no state per character, however long the list.
_NUMBER_CHARS = re.compile(rb"[-+.eE0-9, \t\n\r]*")
_BOOLEAN_CHARS = re.compile(rb"[truefals, \t\n\r]*")
# What a string holds between its quotes: anything but a quote or a backslash, and escapes.
_STRING_CHARS = re.compile(rb'(?:[^"\\]++|\\.)*+', re.DOTALL)
_LITERALS = ((b"true", True), (b"false", False), (b"null", None))
# What the reader is inside, so that only an input's `data` is kept as bytes.
_DOCUMENT, _INPUTS, _INPUT, _DATA, _OTHER = range(5)


class BeyondBounds(BadRequest):
    """The body is JSON, or may be, but holds more than the reader takes (depth, values)."""


@dataclass(frozen=True, slots=True)
class Flat:
    """A JSON list of only numbers or only booleans, kept as its bytes between the brackets until
    its datatype is known; `chunks` checks it as JSON and gives its values a bounded list at a time."""

    text: bytes
    start: int
    end: int
    booleans: bool

    @property
    def count(self) -> int:
        if _match_end(_WHITESPACE, self.text, self.start) >= self.end:
            return 0
        # a piece at a time, as _match_end scans: bytes.count holds the GIL through one call
        pieces = range(self.start, self.end, SCAN_CHARS)
        return sum(self.text.count(b",", at, min(at + SCAN_CHARS, self.end)) for at in pieces) + 1

    def has_fractions(self) -> bool:
        return any(self.text.find(c, self.start, self.end) >= 0 for c in (b".", b"e", b"E"))

    def chunks(self) -> Iterator[list[Any]]:
        """Lists of at most about CHUNK_CHARS bytes of values each; ValueError where not JSON."""
        if not self.count:
            return
        start = self.start
        while True:
            cut = self.text.find(b",", min(start + CHUNK_CHARS, self.end), self.end)
            piece = self.text[start : self.end if cut < 0 else cut]
            try:  # only number (or only boolean) characters: only numbers (or only booleans) come back
                values = json.loads(b"[" + piece + b"]")
            except json.JSONDecodeError as exc:
                raise ValueError(f"{exc.msg} at byte {start + exc.pos - 1}") from None
            if len(values) != piece.count(b",") + 1:
                raise ValueError(f"a value missing between commas after byte {start}")
            yield values
            if cut < 0:
                return
            start = cut + 1


class JsonReader:
    """JSON bytes -> Python values, as `json.loads` gives them but bounded: at most MAX_DEPTH lists and
    objects inside each other (a 400, never a RecursionError) and MAX_VALUES values, flat lists aside.
    An input's `data` list of only numbers or only booleans comes back as a `Flat`; other flat lists
    are parsed whole by `json.loads`, their values counted; each string is decoded and read by the json
    module."""

    def __init__(
        self, text: bytes, max_values: int = MAX_VALUES, tensors: bool = True, name: str = "request body"
    ) -> None:
        self.text, self.max_values, self.tensors, self.name = text, max_values, tensors, name
        self.values = 0
        self._decoder = json.JSONDecoder()

    @classmethod
    def read(cls, body: bytes, tensors: bool = True, max_values: int = MAX_VALUES, name: str = "request body") -> Any:
        """`tensors`: an infer body, whose inputs' `data` lists come back as `Flat`; else plain JSON.
        `name`: what the errors call the document."""
        reader = cls(body, max_values, tensors, name)
        start = 3 if body.startswith(b"\xef\xbb\xbf") else 0  # a UTF-8 byte order mark: skipped, still counted
        value, end = reader._value(reader._skip(start), 0, _DOCUMENT if tensors else _OTHER)
        end = reader._skip(end)
        if end != len(reader.text):
            raise reader._invalid(end, "more after the document")
        return value

    def _value(self, pos: int, depth: int, mode: int) -> tuple[Any, int]:
        self._count(1)
        text = self.text
        if text.startswith(b"{", pos):
            return self._object(pos, depth + 1, mode)
        if text.startswith(b"[", pos):
            return self._array(pos, depth + 1, mode)
        if text.startswith(b'"', pos):
            return self._string(pos)
        for word, value in _LITERALS:
            if text.startswith(word, pos):
                return value, pos + len(word)
        number = _NUMBER.match(text, pos)
        if number is None:
            raise self._invalid(pos, "expected a value")
        raw = number.group()
        try:
            return (float(raw) if raw.strip(b"-0123456789") else int(raw)), number.end()
        except ValueError:
            raise self._invalid(pos, "a number with too many digits") from None

    def _object(self, pos: int, depth: int, mode: int) -> tuple[dict[str, Any], int]:
        self._check_depth(depth)
        result: dict[str, Any] = {}
        pos = self._skip(pos + 1)
        if self.text.startswith(b"}", pos):
            return result, pos + 1
        while True:
            if not self.text.startswith(b'"', pos):
                raise self._invalid(pos, "expected a string key")
            self._count(1)
            key, pos = self._string(pos)
            pos = self._skip(pos)
            if not self.text.startswith(b":", pos):
                raise self._invalid(pos, "expected ':'")
            inner = (
                _INPUTS
                if mode == _DOCUMENT and key == "inputs"
                else _DATA
                if mode == _INPUT and key == "data"
                else _OTHER
            )
            result[key], pos = self._value(self._skip(pos + 1), depth, inner)
            pos = self._skip(pos)
            if self.text.startswith(b",", pos):
                pos = self._skip(pos + 1)
            elif self.text.startswith(b"}", pos):
                return result, pos + 1
            else:
                raise self._invalid(pos, "expected ',' or '}'")

    def _array(self, pos: int, depth: int, mode: int) -> tuple[Any, int]:
        self._check_depth(depth)
        flat = self._flat(pos)
        if flat is not None:
            if mode == _DATA:
                return flat, flat.end + 1
            self._count(flat.count)
            try:
                return json.loads(self.text[pos : flat.end + 1]), flat.end + 1
            except ValueError:
                raise self._invalid(pos, "a malformed list") from None
        inner = _INPUT if mode == _INPUTS else _DATA if mode == _DATA else _OTHER
        items: list[Any] = []
        pos = self._skip(pos + 1)
        while True:
            item, pos = self._value(pos, depth, inner)
            items.append(item)
            pos = self._skip(pos)
            if self.text.startswith(b",", pos):
                pos = self._skip(pos + 1)
            elif self.text.startswith(b"]", pos):
                return items, pos + 1
            else:
                raise self._invalid(pos, "expected ',' or ']'")

    def _flat(self, pos: int) -> Flat | None:
        """The list at `pos` as a `Flat` when it holds only number (or only boolean) characters."""
        for chars, booleans in ((_NUMBER_CHARS, False), (_BOOLEAN_CHARS, True)):
            end = _match_end(chars, self.text, pos + 1)
            if self.text.startswith(b"]", end):
                return Flat(self.text, pos + 1, end, booleans)
        return None

    def _string(self, pos: int) -> tuple[str, int]:
        end = _string_end(self.text, pos)
        if end < 0:
            raise self._invalid(pos, "a string without its closing quote")
        if end - pos - 2 > MAX_STRING_BYTES:  # between its quotes
            raise BeyondBounds(f"{self.name} holds a string of more than {MAX_STRING_BYTES} bytes, at byte {pos}")
        try:
            quoted = self.text[pos:end].decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"{self.name} is not valid JSON: not UTF-8 at byte {pos + exc.start}") from None
        try:
            value, read = self._decoder.raw_decode(quoted)
        except ValueError:
            raise self._invalid(pos, "a malformed string") from None
        if read != len(quoted):
            raise self._invalid(pos, "a malformed string")
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                raise self._invalid(pos, "a string with an unpaired surrogate escape") from None
        return value, end

    def _skip(self, pos: int) -> int:
        return _match_end(_WHITESPACE, self.text, pos)

    def _count(self, values: int) -> None:
        self.values += values
        if self.values > self.max_values:
            hint = "besides flat lists of numbers; send tensor data as flat lists or as binary tensor data"
            raise BeyondBounds(
                f"{self.name} holds more than {self.max_values} JSON values" + (f" {hint}" if self.tensors else "")
            )

    def _check_depth(self, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise BeyondBounds(f"{self.name} nests lists and objects more than {MAX_DEPTH} deep")

    def _invalid(self, pos: int, what: str) -> BadRequest:
        return BadRequest(f"{self.name} is not valid JSON: {what} at byte {pos}")


def read_json(body: bytes, tensors: bool = True, name: str = "request body") -> Any:
    """A JSON document, bounded as JsonReader bounds it. A small one without tensor data (the binary
    extension's header on every live frame, a Realtime event) goes through json.loads, ten times
    faster; anything else, and anything json.loads refuses (RecursionError included) or finds nested
    near the limit, goes through JsonReader, which also words the error (a BadRequest)."""
    if len(body) <= FAST_JSON_BYTES and not (tensors and b'"data"' in body):
        try:
            doc = json.loads(body, parse_constant=_refuse)
        except (ValueError, RecursionError):
            pass
        else:
            if not _nested_beyond(doc, MAX_DEPTH - 1):
                return doc
    return JsonReader.read(body, tensors, name=name)


def _refuse(constant: str) -> Any:
    raise ValueError(f"{constant} is not JSON")


def _nested_beyond(doc: Any, depth: int) -> bool:
    pending = [(doc, 1)]
    while pending:
        value, level = pending.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
        if children and level > depth:
            return True
        pending += [(child, level + 1) for child in children]
    return False


def _string_end(text: bytes, pos: int) -> int:
    """Just past the quote that closes the string opening at `pos` (-1 where none does). Scanned a
    piece at a time (_match_end); a piece that ends inside an escape stops before its backslash,
    and the scan goes on from there."""
    end = pos + 1
    while True:
        start, end = end, _match_end(_STRING_CHARS, text, end)
        if text.startswith(b'"', end):
            return end + 1
        if end == start or end >= len(text):  # a backslash that ends the body, or nothing more matched
            return -1


def _match_end(pattern: re.Pattern[bytes], text: bytes, pos: int) -> int:
    """Where a pattern that may match nothing (one character class, repeated) stops matching from
    `pos`. A long run is matched a piece at a time: `re` holds the GIL through one match, and a reader
    on a worker thread must let the event loop's thread run between pieces of a 60 MB body."""
    while True:
        match = pattern.match(text, pos, pos + SCAN_CHARS)
        end = match.end() if match else pos
        if end < pos + SCAN_CHARS or end >= len(text):
            return end
        pos = end


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_kind(value: Any) -> str:
    """A JSON value's type, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if is_number(value):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, Flat)):
        return "a list"
    return "an object"


def shown(value: Any) -> str:
    """A value as a one-line message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
