"""KServe v2 tensors: JSON and the binary tensor data extension, both ways (pure functions).

Binary extension: the body starts with `Inference-Header-Content-Length` bytes of JSON; each
input whose parameters carry `binary_data_size` takes that many raw little-endian bytes from
what follows, in the order the inputs are listed.

Requests are hostile until checked. Every field is type-checked, and a bad one is a one-line 400
naming it and what is accepted. The JSON is read by `JsonReader`, not `json.loads`: nesting is
bounded (MAX_DEPTH) and so is the number of values outside flat lists (MAX_VALUES), and an input's
`data` list of numbers or booleans is kept as its span of the text until the input's datatype and
shape are known, then converted a chunk at a time straight into its NumPy array, so memory stays
near the body's size instead of a Python object per number. A shape is checked with Python ints (at
most MAX_DIMS dimensions, no more elements than the body can carry) before anything is allocated.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from appliance.errors import BadRequest
from appliance.protocol import json_text
from appliance.protocol.json_reader import json_kind, read_json, shown
from appliance.protocol.json_text import ELEMENT_BYTES
from appliance.protocol.tensor_data import NUMPY_TYPES, data_array

DATATYPES = {np.dtype(v).str: k for k, v in NUMPY_TYPES.items()}
HEADER_LENGTH = "inference-header-content-length"

MAX_DIMS = 8
MAX_NAME_BYTES = 256  # input and output names and the request id; the API core bounds sequence ids alike
MAX_SPAN = 1 << 32  # a shape's non-zero dimensions multiplied: NumPy must shape even an empty tensor


@dataclass(slots=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    binary_outputs: set[str] = field(default_factory=set)
    all_binary: bool = False
    requested_outputs: list[str] = field(default_factory=list)  # empty: all of the model's outputs


def decode_infer(body: bytes, header_length: str | None) -> InferRequest:
    binary: bytes | memoryview = b""
    json_part = body
    if header_length is not None:
        size = _header_length(header_length, len(body))
        json_part, binary = body[:size], memoryview(body)[size:]
    doc = read_json(json_part)
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
    requested, binary_outputs = _requested_outputs(doc.get("outputs", []))
    return InferRequest(request_id, inputs, parameters, binary_outputs, all_binary, requested)


def _header_length(raw: str, body_size: int) -> int:
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 20):
        raise BadRequest(f"Inference-Header-Content-Length is not a number: {shown(raw)}")
    size = int(raw)
    if size > body_size:
        raise BadRequest(f"Inference-Header-Content-Length {size} exceeds the body ({body_size} bytes)")
    return size


def _requested_outputs(outputs: Any) -> tuple[list[str], set[str]]:
    """The names of the requested outputs, and of those that asked for binary data."""
    if not isinstance(outputs, list):
        raise BadRequest(f"'outputs' must be a list, got {json_kind(outputs)}")
    requested, names = [], set()
    for i, out in enumerate(outputs):
        if not isinstance(out, dict):
            raise BadRequest(f"outputs[{i}] must be an object, got {json_kind(out)}")
        name = _name(out.get("name"), f"outputs[{i}].name")
        requested.append(name)
        params = out.get("parameters", {})
        if not isinstance(params, dict):
            raise BadRequest(f"outputs[{i}].parameters must be an object, got {json_kind(params)}")
        binary = params.get("binary_data", False)
        if not isinstance(binary, bool):
            raise BadRequest(f"outputs[{i}].parameters.binary_data must be true or false, got {json_kind(binary)}")
        if binary:
            names.add(name)
    return requested, names


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
    if datatype not in NUMPY_TYPES and datatype != "BYTES":
        raise BadRequest(
            f"{where}: datatype {shown(datatype)} is not supported (use one of {', '.join(NUMPY_TYPES)}, BYTES)"
        )
    shape = _shape(item.get("shape"), where)
    count = math.prod(shape)
    params = item.get("parameters", {})
    if not isinstance(params, dict):
        raise BadRequest(f"{where}: 'parameters' must be an object, got {json_kind(params)}")
    size = params.get("binary_data_size")
    if datatype == "BYTES":
        return _bytes_input(item, shape, count, size, binary, where)
    dtype = np.dtype(NUMPY_TYPES[datatype])
    if size is None:
        if "data" not in item:
            raise BadRequest(f"{where}: needs 'data' or parameters.binary_data_size")
        if count > capacity:  # a JSON value takes at least a byte (binary data is bounded by its own size below)
            raise BadRequest(
                f"{where}: 'shape' {shown(shape)} needs {count} elements, more than a {capacity}-byte body can carry"
            )
        return name, data_array(item["data"], shape, count, datatype, where), 0
    if "data" in item:
        raise BadRequest(f"{where}: give 'data' or parameters.binary_data_size, not both")
    if not isinstance(size, int) or isinstance(size, bool) or size < 0:
        raise BadRequest(f"{where}: parameters.binary_data_size must be a non-negative integer, got {shown(size)}")
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


def _bytes_input(
    item: dict[str, Any], shape: list[int], count: int, size: Any, binary: bytes | memoryview, where: str
) -> tuple[str, np.ndarray, int]:
    """A BYTES input (strings): JSON strings, or Triton's binary form, each element a 4-byte little-endian
    length and its bytes. An object array of bytes."""
    if size is None:
        data = item.get("data")
        values = _flatten_strings(data, where) if isinstance(data, list) else None
        if values is None or len(values) != count:
            raise BadRequest(f"{where}: BYTES 'data' must be a list of {count} strings (shape {shape})")
        array = np.empty(count, object)
        array[:] = [v.encode() for v in values]
        return item["name"], array.reshape(shape), 0
    if "data" in item:
        raise BadRequest(f"{where}: give 'data' or parameters.binary_data_size, not both")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= len(binary):
        raise BadRequest(f"{where}: parameters.binary_data_size must be at most the {len(binary)} bytes that remain")
    raw, at = bytes(binary[:size]), 0
    elements: list[bytes] = []
    while at < size and len(elements) <= count:
        if at + 4 > size:
            raise BadRequest(f"{where}: BYTES binary data ends inside an element's 4-byte length")
        length = int.from_bytes(raw[at : at + 4], "little")
        if at + 4 + length > size:
            raise BadRequest(f"{where}: a BYTES element of {length} bytes runs past binary_data_size {size}")
        elements.append(raw[at + 4 : at + 4 + length])
        at += 4 + length
    if len(elements) != count:
        raise BadRequest(f"{where}: BYTES binary data holds {len(elements)}+ elements, shape {shape} needs {count}")
    array = np.empty(count, object)
    array[:] = elements
    return item["name"], array.reshape(shape), size


def _flatten_strings(data: list[Any], where: str) -> list[str] | None:
    """The strings of a flat or nested list, in row-major order; None if anything else is in it."""
    out: list[str] = []
    stack: list[Any] = [iter(data)]
    while stack:
        for value in stack[-1]:
            if isinstance(value, list):
                stack.append(iter(value))
                break
            if not isinstance(value, str):
                return None
            out.append(value)
        else:
            stack.pop()
    return out


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
        raise BadRequest(f"{where}: 'shape' must be {accepted}, got {shown(value)}")
    if len(value) > MAX_DIMS:
        raise BadRequest(f"{where}: 'shape' has {len(value)} dimensions; it must be {accepted}")
    if any(d < 0 for d in value):
        raise BadRequest(f"{where}: 'shape' must be {accepted}, got {shown(value)}")
    if math.prod(d for d in value if d) > MAX_SPAN:
        raise BadRequest(f"{where}: 'shape' {shown(value)} is too large: its non-zero dimensions multiply past 2**32")
    return value


# --- tensor data in JSON ----------------------------------------------------------------------


def encoding_size(request: InferRequest, outputs: dict[str, np.ndarray]) -> int:
    """What encoding `outputs` costs, in bytes: binary tensors' bytes, and each element written one by
    one (JSON data, BYTES strings) as ELEMENT_BYTES (counted by bytes alone, language ID's answer of
    65,536 texts was 768 KiB, and took 50 ms of the event loop)."""
    return sum(
        array.size * ELEMENT_BYTES if array.dtype == object or not _binary(request, name) else array.nbytes
        for name, array in outputs.items()
    )


def _binary(request: InferRequest, output: str) -> bool:
    return request.all_binary or output in request.binary_outputs


def encode_infer(
    model: str, version: str, request: InferRequest, outputs: dict[str, np.ndarray], parameters: dict[str, Any]
) -> tuple[bytes, int | None]:
    """Return (body, JSON header length when binary data follows, else None). Its JSON is written a
    slice at a time (`json_text`): on a thread too, one long write would hold up the event loop."""
    chunks: list[bytes] = []
    entries = [tensor_entry(name, array, _binary(request, name), chunks) for name, array in outputs.items()]
    doc: dict[str, Any] = {"model_name": model, "model_version": version, "outputs": entries}
    if request.id is not None:
        doc["id"] = request.id
    if parameters:
        doc["parameters"] = parameters
    header = json_text.dumps(doc).encode()
    if not chunks:
        return header, None
    return b"".join([header, *chunks]), len(header)


def tensor_entry(name: str, array: np.ndarray, binary: bool, chunks: list[bytes]) -> dict[str, Any]:
    """One tensor's entry, for `json_text.dumps` (its data the flat array, or the BYTES' texts); with
    `binary`, its raw bytes go to `chunks` (the binary extension). An object array is BYTES: strings
    (str or bytes, UTF-8) as Triton carries them."""
    if array.dtype == object:
        return _bytes_entry(name, array, binary, chunks)
    entry: dict[str, Any] = {"name": name, "datatype": DATATYPES[array.dtype.str], "shape": list(array.shape)}
    if binary:
        raw = np.ascontiguousarray(array).tobytes()
        entry["parameters"] = {"binary_data_size": len(raw)}
        chunks.append(raw)
    else:
        entry["data"] = array.reshape(-1)
    return entry


def _bytes_entry(name: str, array: np.ndarray, binary: bool, chunks: list[bytes]) -> dict[str, Any]:
    elements = [v.encode() if isinstance(v, str) else bytes(v) for v in array.reshape(-1)]
    entry: dict[str, Any] = {"name": name, "datatype": "BYTES", "shape": list(array.shape)}
    if binary:
        raw = b"".join(len(e).to_bytes(4, "little") + e for e in elements)
        entry["parameters"] = {"binary_data_size": len(raw)}
        chunks.append(raw)
    else:
        entry["data"] = [e.decode("utf-8", "replace") for e in elements]
    return entry
