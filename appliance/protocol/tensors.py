"""KServe v2 tensors: JSON and the binary tensor data extension, both ways (pure functions).

Binary extension: the body starts with `Inference-Header-Content-Length` bytes of JSON; each
input whose parameters carry `binary_data_size` takes that many raw little-endian bytes from
what follows, in the order the inputs are listed.

Requests are hostile until checked. Every field is type-checked, and a bad one is a one-line 400
naming it and what is accepted. The JSON is read by `_JsonReader`, not `json.loads`: nesting is
bounded (MAX_DEPTH) and so is the number of values outside flat lists (MAX_VALUES), and an input's
`data` list of numbers or booleans is kept as its span of the text until the input's datatype and
shape are known, then converted a chunk at a time straight into its NumPy array, so memory stays
near the body's size instead of a Python object per number. A shape is checked with Python ints (at
most MAX_DIMS dimensions, no more elements than the body can carry) before anything is allocated.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.errors import BadRequest

NUMPY_TYPES = {
    "FP32": "<f4",
    "FP16": "<f2",
    "FP64": "<f8",
    "INT64": "<i8",
    "INT32": "<i4",
    "INT16": "<i2",
    "INT8": "i1",
    "UINT8": "u1",
    "UINT16": "<u2",
    "UINT32": "<u4",
    "UINT64": "<u8",
    "BOOL": "?",
}
DATATYPES = {np.dtype(v).str: k for k, v in NUMPY_TYPES.items()}
HEADER_LENGTH = "inference-header-content-length"

MAX_DIMS = 8
MAX_DEPTH = 32  # lists and objects inside each other; a request with 8-dimensional nested data needs 11
MAX_VALUES = 100_000  # JSON values (keys included) outside the flat lists that hold tensor data
MAX_NAME_BYTES = 256  # input and output names and the request id; the API core bounds sequence ids alike
MAX_SPAN = 1 << 32  # a shape's non-zero dimensions multiplied: NumPy must shape even an empty tensor
CHUNK_CHARS = 1 << 18  # flat data is converted this many characters at a time (a bounded list each)


@dataclass(slots=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    binary_outputs: set[str] = field(default_factory=set)
    all_binary: bool = False


def decode_infer(body: bytes, header_length: str | None) -> InferRequest:
    binary: bytes | memoryview = b""
    json_part = body
    if header_length is not None:
        size = _header_length(header_length, len(body))
        json_part, binary = body[:size], memoryview(body)[size:]
    doc = _JsonReader.read(json_part)
    if not isinstance(doc, dict):
        raise BadRequest(f"request body must be a JSON object, got {json_kind(doc)}")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        got = "an empty list" if isinstance(raw_inputs, list) else json_kind(raw_inputs)
        raise BadRequest(f"'inputs' must be a non-empty list, got {got}")
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest(f"'parameters' must be an object, got {json_kind(parameters)}")
    request_id = doc.get("id")
    if request_id is not None:
        _name(request_id, "'id'", min_bytes=0)
    all_binary = parameters.get("binary_data_output", False)
    if not isinstance(all_binary, bool):
        raise BadRequest(f"parameters.binary_data_output must be true or false, got {json_kind(all_binary)}")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(raw_inputs):
        name, array, used = _decode_input(item, i, binary[offset:], len(body))
        if name in inputs:
            raise BadRequest(f"inputs[{i}].name: input {name!r} is given twice")
        inputs[name] = array
        offset += used
    if offset != len(binary):
        raise BadRequest(f"binary data holds {len(binary)} bytes but the inputs' binary_data_size add up to {offset}")
    return InferRequest(request_id, inputs, parameters, _binary_outputs(doc.get("outputs", [])), all_binary)


def _header_length(raw: str, body_size: int) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 20):
        raise BadRequest(f"Inference-Header-Content-Length is not a number: {_show(raw)}")
    size = int(raw)
    if size > body_size:
        raise BadRequest(f"Inference-Header-Content-Length {size} exceeds the body ({body_size} bytes)")
    return size


def _binary_outputs(outputs: Any) -> set[str]:
    """The names of the requested outputs that asked for binary data."""
    if not isinstance(outputs, list):
        raise BadRequest(f"'outputs' must be a list, got {json_kind(outputs)}")
    names = set()
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise BadRequest(f"outputs[{i}] must be an object, got {json_kind(out)}")
        name = _name(out.get("name"), f"outputs[{i}].name")
        params = out.get("parameters", {})
        if not isinstance(params, dict):
            raise BadRequest(f"outputs[{i}].parameters must be an object, got {json_kind(params)}")
        binary = params.get("binary_data", False)
        if not isinstance(binary, bool):
            raise BadRequest(f"outputs[{i}].parameters.binary_data must be true or false, got {json_kind(binary)}")
        if binary:
            names.add(name)
    return names


def _decode_input(item: Any, index: int, binary: bytes | memoryview, capacity: int) -> tuple[str, np.ndarray, int]:
    """(name, array, binary bytes used) of inputs[index]; `capacity` bounds its element count."""
    if not isinstance(item, dict):
        raise BadRequest(f"inputs[{index}] must be an object, got {json_kind(item)}")
    name = _name(item.get("name"), f"inputs[{index}].name")
    where = f"input {name!r}"
    datatype = item.get("datatype")
    if not isinstance(datatype, str):
        raise BadRequest(
            f"{where}: 'datatype' must be a string, one of {', '.join(NUMPY_TYPES)}; got {json_kind(datatype)}"
        )
    if datatype not in NUMPY_TYPES:
        raise BadRequest(f"{where}: datatype {_show(datatype)} is not supported (use one of {', '.join(NUMPY_TYPES)})")
    shape = _shape(item.get("shape"), where)
    count = math.prod(shape)
    dtype = np.dtype(NUMPY_TYPES[datatype])
    params = item.get("parameters", {})
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: 'parameters' must be an object, got {json_kind(params)}")
    size = params.get("binary_data_size")
    if size is None:
        if "data" not in item:
            raise BadRequest(f"{where}: needs 'data' or parameters.binary_data_size")
        if count > capacity:  # a JSON value takes at least a byte (binary data is bounded by its own size below)
            raise BadRequest(
                f"{where}: 'shape' {_show(shape)} needs {count} elements, more than a {capacity}-byte body can carry"
            )
        return name, _data_array(item["data"], shape, count, datatype, where), 0
    if "data" in item:
        raise BadRequest(f"{where}: give 'data' or parameters.binary_data_size, not both")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest(f"{where}: parameters.binary_data_size must be a non-negative integer, got {_show(size)}")
    if size > len(binary):
        raise BadRequest(
            f"{where}: binary_data_size {size} but only {len(binary)} bytes of binary data remain (truncated)"
        )
    if size != count * dtype.itemsize:
        raise BadRequest(
            f"{where}: binary_data_size {size} does not match shape {shape} of {datatype} ({count * dtype.itemsize} bytes)"
        )
    array = np.frombuffer(binary[:size], dtype=dtype)
    if datatype == "BOOL":
        array = array.view(np.uint8) != 0  # any other byte than 0 or 1 is not a NumPy bool
    return name, array.reshape(shape), size


def _name(value: Any, where: str, min_bytes: int = 1) -> str:
    """A name or id: a string of `min_bytes` to MAX_NAME_BYTES bytes of UTF-8."""
    size = len(value.encode()) if isinstance(value, str) else -1
    if not min_bytes <= size <= MAX_NAME_BYTES:
        got = f"{size} bytes" if size >= 0 else json_kind(value)
        raise BadRequest(f"{where} must be a string of {min_bytes} to {MAX_NAME_BYTES} bytes, got {got}")
    return str(value)


def _shape(value: Any, where: str) -> list[int]:
    """A shape checked with Python ints (its product cannot wrap), before anything is allocated."""
    accepted = f"a list of at most {MAX_DIMS} non-negative integers"
    if not isinstance(value, list) or not all(isinstance(d, int) and not isinstance(d, bool) for d in value):
        raise BadRequest(f"{where}: 'shape' must be {accepted}, got {_show(value)}")
    if len(value) > MAX_DIMS:
        raise BadRequest(f"{where}: 'shape' has {len(value)} dimensions; it must be {accepted}")
    if any(d < 0 for d in value):
        raise BadRequest(f"{where}: 'shape' must be {accepted}, got {_show(value)}")
    if math.prod(d for d in value if d) > MAX_SPAN:
        raise BadRequest(f"{where}: 'shape' {_show(value)} is too large: its non-zero dimensions multiply past 2**32")
    return value


# --- tensor data in JSON ----------------------------------------------------------------------


def _accepts(datatype: str) -> str:
    if datatype == "BOOL":
        return "true or false"
    if datatype.startswith("FP"):
        return "numbers"
    info = np.iinfo(np.dtype(NUMPY_TYPES[datatype]))
    return f"integers from {info.min} to {info.max}"


def _data_array(data: Any, shape: list[int], count: int, datatype: str, where: str) -> np.ndarray:
    """An input's JSON `data`: a flat list in row-major order, or lists nested as the shape."""
    accepted = f"{datatype} values ({_accepts(datatype)})"
    if isinstance(data, _Flat):
        if data.count != count:
            raise BadRequest(f"{where}: 'data' holds {data.count} values but shape {shape} needs {count}")
        rows = [data]
    elif isinstance(data, list):
        rows = _rows(
            data,
            shape,
            datatype,
            f"{where}: 'data' must be a flat list of {count} {accepted} or lists nested as shape {shape}",
        )
    else:
        raise BadRequest(f"{where}: 'data' must be a list of {accepted}, got {json_kind(data)}")
    return _convert(rows, count, datatype, where).reshape(shape)


def _rows(data: list[Any], shape: list[int], datatype: str, expected: str) -> list[_Flat]:
    """The innermost lists of `data` when it is nested exactly as `shape`; else a 400 saying where not."""
    level: list[tuple[str, Any]] = [("data", data)]
    for depth, size in enumerate(shape):
        last = depth == len(shape) - 1
        below: list[tuple[str, Any]] = []
        for path, node in level:
            if last and isinstance(node, _Flat) and node.count == size:
                below.append((path, node))
            elif not last and isinstance(node, list) and len(node) == size:
                below += [(f"{path}[{i}]", child) for i, child in enumerate(node)]
            else:
                raise BadRequest(f"{expected}; {_misfit(path, node, size, last, datatype)}")
        level = below
    if len(shape) < 2:  # `data` is not flat, so something in it is not a value of the datatype
        raise BadRequest(f"{expected}; {_misfit('data', data, math.prod(shape), True, datatype)}")
    return [node for _, node in level]


def _misfit(path: str, node: Any, size: int, last: bool, datatype: str) -> str:
    """What is wrong at `path`, where `size` values (`last`) or `size` lists belong."""
    if isinstance(node, _Flat):
        return f"{path} holds {node.count} values, not {size}" if last else f"{path} holds values, not {size} lists"
    if not isinstance(node, list):
        return f"{path} is {json_kind(node)}"
    if len(node) != size:
        return f"{path} holds {len(node)} items, not {size}"
    for i, item in enumerate(node):
        is_list = isinstance(item, (list, _Flat))
        is_value = isinstance(item, bool) if datatype == "BOOL" else _is_number(item)
        if (last and not is_value) or (not last and not is_list):
            return f"{path}[{i}] is {json_kind(item)}"
    return f"{path} mixes lists and values"


def _convert(rows: list[_Flat], count: int, datatype: str, where: str) -> np.ndarray:
    """Flat lists of JSON text -> one array of `count` values, a bounded chunk at a time."""
    dtype = np.dtype(NUMPY_TYPES[datatype])
    out = np.empty(count, dtype)
    filled = 0
    for row in rows:
        if row.booleans != (datatype == "BOOL"):
            held = "booleans" if row.booleans else "numbers"
            raise BadRequest(f"{where}: 'data' holds {held}; {datatype} takes {_accepts(datatype)}")
        if dtype.kind in "iu" and row.has_fractions():
            raise BadRequest(
                f"{where}: 'data' holds numbers that are not integers; {datatype} takes {_accepts(datatype)}"
            )
        try:
            for values in row.chunks():
                piece = out[filled : filled + len(values)]
                with np.errstate(over="ignore"):
                    piece[:] = np.array(values, dtype=dtype)
                if dtype.kind == "f" and not np.isfinite(piece).all():
                    raise OverflowError
                filled += len(values)
        except OverflowError:
            raise BadRequest(
                f"{where}: 'data' holds a number outside {datatype}'s range; it takes {_accepts(datatype)}"
            ) from None
        except ValueError as exc:
            raise BadRequest(f"request body is not valid JSON: {exc} (in the 'data' of {where})") from None
    return out


# --- the JSON reader ----------------------------------------------------------------------------

_WHITESPACE = re.compile(r"[ \t\n\r]*")
_NUMBER = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?")
# What a list of only numbers, or only booleans, can hold between its brackets. One character class
# repeated: the regex engine keeps no state per character, however long the list.
_NUMBER_CHARS = re.compile(r"[-+.eE0-9, \t\n\r]*")
_BOOLEAN_CHARS = re.compile(r"[truefals, \t\n\r]*")
_LITERALS = (("true", True), ("false", False), ("null", None))
# What the reader is inside, so that only an input's `data` is kept as text.
_DOCUMENT, _INPUTS, _INPUT, _DATA, _OTHER = range(5)


@dataclass(frozen=True, slots=True)
class _Flat:
    """A JSON list of only numbers or only booleans, kept as its text between the brackets until
    its datatype is known; `chunks` checks it as JSON and gives its values a bounded list at a time."""

    text: str
    start: int
    end: int
    booleans: bool

    @property
    def count(self) -> int:
        if _match_end(_WHITESPACE, self.text, self.start) >= self.end:
            return 0
        return self.text.count(",", self.start, self.end) + 1

    def has_fractions(self) -> bool:
        return any(self.text.find(c, self.start, self.end) >= 0 for c in ".eE")

    def chunks(self) -> Iterator[list[Any]]:
        """Lists of at most about CHUNK_CHARS characters of values each; ValueError where not JSON."""
        if not self.count:
            return
        start = self.start
        while True:
            cut = self.text.find(",", min(start + CHUNK_CHARS, self.end), self.end)
            piece = self.text[start : self.end if cut < 0 else cut]
            try:  # only number (or only boolean) characters: only numbers (or only booleans) come back
                values = json.loads(f"[{piece}]")
            except json.JSONDecodeError as exc:
                raise ValueError(f"{exc.msg} at character {start + exc.pos - 1}") from None
            if len(values) != piece.count(",") + 1:
                raise ValueError(f"a value missing between commas after character {start}")
            yield values
            if cut < 0:
                return
            start = cut + 1


class _JsonReader:
    """JSON text -> Python values, as `json.loads` gives them but bounded: at most MAX_DEPTH lists and
    objects inside each other (a 400, never a RecursionError) and MAX_VALUES values, flat lists aside.
    An input's `data` list of only numbers or only booleans comes back as a `_Flat`; other flat lists
    are parsed whole by `json.loads`, their values counted; strings are read by the json module."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.values = 0
        self._decoder = json.JSONDecoder()

    @classmethod
    def read(cls, body: bytes) -> Any:
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise BadRequest(f"request body is not valid JSON: not UTF-8 at byte {exc.start}") from None
        reader = cls(text.removeprefix("\ufeff"))
        value, end = reader._value(reader._skip(0), 0, _DOCUMENT)
        end = reader._skip(end)
        if end != len(reader.text):
            raise reader._invalid(end, "more after the document")
        return value

    def _value(self, pos: int, depth: int, mode: int) -> tuple[Any, int]:
        self._count(1)
        text = self.text
        if text.startswith("{", pos):
            return self._object(pos, depth + 1, mode)
        if text.startswith("[", pos):
            return self._array(pos, depth + 1, mode)
        if text.startswith('"', pos):
            return self._string(pos)
        for word, value in _LITERALS:
            if text.startswith(word, pos):
                return value, pos + len(word)
        number = _NUMBER.match(text, pos)
        if number is None:
            raise self._invalid(pos, "expected a value")
        raw = number.group()
        try:
            return (float(raw) if any(c in raw for c in ".eE") else int(raw)), number.end()
        except ValueError:
            raise self._invalid(pos, "a number with too many digits") from None

    def _object(self, pos: int, depth: int, mode: int) -> tuple[dict[str, Any], int]:
        self._check_depth(depth)
        result: dict[str, Any] = {}
        pos = self._skip(pos + 1)
        if self.text.startswith("}", pos):
            return result, pos + 1
        while True:
            if not self.text.startswith('"', pos):
                raise self._invalid(pos, "expected a string key")
            self._count(1)
            key, pos = self._string(pos)
            pos = self._skip(pos)
            if not self.text.startswith(":", pos):
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
            if self.text.startswith(",", pos):
                pos = self._skip(pos + 1)
            elif self.text.startswith("}", pos):
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
            if self.text.startswith(",", pos):
                pos = self._skip(pos + 1)
            elif self.text.startswith("]", pos):
                return items, pos + 1
            else:
                raise self._invalid(pos, "expected ',' or ']'")

    def _flat(self, pos: int) -> _Flat | None:
        """The list at `pos` as a `_Flat` when it holds only number (or only boolean) characters."""
        for chars, booleans in ((_NUMBER_CHARS, False), (_BOOLEAN_CHARS, True)):
            end = _match_end(chars, self.text, pos + 1)
            if self.text.startswith("]", end):
                return _Flat(self.text, pos + 1, end, booleans)
        return None

    def _string(self, pos: int) -> tuple[str, int]:
        try:
            value, end = self._decoder.raw_decode(self.text, pos)
        except ValueError:
            raise self._invalid(pos, "a malformed string") from None
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
        if self.values > MAX_VALUES:
            raise BadRequest(
                f"request body holds more than {MAX_VALUES} JSON values besides flat lists of numbers; "
                "send tensor data as flat lists or as binary tensor data"
            )

    @staticmethod
    def _check_depth(depth: int) -> None:
        if depth > MAX_DEPTH:
            raise BadRequest(f"request body nests lists and objects more than {MAX_DEPTH} deep")

    @staticmethod
    def _invalid(pos: int, what: str) -> BadRequest:
        return BadRequest(f"request body is not valid JSON: {what} at character {pos}")


def _match_end(pattern: re.Pattern[str], text: str, pos: int) -> int:
    """Where a pattern that may match nothing stops matching from `pos`."""
    match = pattern.match(text, pos)
    return match.end() if match else pos


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def json_kind(value: Any) -> str:
    """A JSON value's type, as a message names it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if _is_number(value):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (list, _Flat)):
        return "a list"
    return "an object"


def _show(value: Any) -> str:
    """A value as a one-line message shows it: its repr, cut short."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def encode_infer(
    model: str, version: str, request: InferRequest, outputs: dict[str, np.ndarray], parameters: dict[str, Any]
) -> tuple[bytes, int | None]:
    """Return (body, JSON header length when binary data follows, else None)."""
    chunks: list[bytes] = []
    binary = lambda name: request.all_binary or name in request.binary_outputs  # noqa: E731
    entries = [_entry(name, array, binary(name), chunks) for name, array in outputs.items()]
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = parameters
    header = json.dumps(doc, separators=(",", ":")).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def encode_request(
    inputs: dict[str, np.ndarray],
    parameters: dict[str, Any] | None = None,
    binary: bool = True,
    request_id: str | None = None,
) -> tuple[bytes, int | None]:
    """Client side: an infer request body (binary tensors by default) and its JSON header length."""
    chunks: list[bytes] = []
    entries = [_entry(name, np.asarray(array), binary, chunks) for name, array in inputs.items()]
    doc: dict[str, Any] = {"inputs": entries}
    if request_id is not None:
        doc["id"] = request_id
    params = dict(parameters or {})
    if binary:
        params["binary_data_output"] = True
    if params:
        doc["parameters"] = params
    header = json.dumps(doc, separators=(",", ":")).encode()
    return (b"".join([header, *chunks]), len(header)) if binary else (header, None)


def decode_response(body: bytes, header_length: int | None) -> dict[str, np.ndarray]:
    """Client side: the outputs of an infer response as arrays."""
    head = body if header_length is None else body[:header_length]
    doc = json.loads(head)
    offset = header_length or 0
    outputs = {}
    for entry in doc["outputs"]:
        dtype = np.dtype(NUMPY_TYPES[entry["datatype"]])
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            outputs[entry["name"]] = np.frombuffer(body, dtype, size // dtype.itemsize, offset).reshape(entry["shape"])
            offset += size
        else:
            outputs[entry["name"]] = np.asarray(entry["data"], dtype).reshape(entry["shape"])
    return outputs


def _entry(name: str, array: np.ndarray, binary: bool, chunks: list[bytes]) -> dict[str, Any]:
    """One tensor's JSON entry; with `binary`, its raw bytes go to `chunks` (the binary extension)."""
    entry: dict[str, Any] = {"name": name, "datatype": DATATYPES[array.dtype.str], "shape": list(array.shape)}
    if binary:
        raw = np.ascontiguousarray(array).tobytes()
        entry["parameters"] = {"binary_data_size": len(raw)}
        chunks.append(raw)
    else:
        entry["data"] = array.reshape(-1).tolist()
    return entry
