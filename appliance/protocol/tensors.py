"""KServe v2 tensors: JSON and the binary tensor data extension, both ways (pure functions).

Binary extension: the body starts with `Inference-Header-Content-Length` bytes of JSON; each
input whose parameters carry `binary_data_size` takes that many raw little-endian bytes from
what follows, in the order the inputs are listed.
"""

from __future__ import annotations

import json
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


@dataclass(slots=True)
class InferRequest:
    id: str | None
    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any]
    binary_outputs: set[str] = field(default_factory=set)
    all_binary: bool = False


def decode_infer(body: bytes, header_length: str | None) -> InferRequest:
    binary: bytes | memoryview
    if header_length is None:
        json_part, binary = body, b""
    else:
        try:
            size = int(header_length)
        except ValueError:
            raise BadRequest(f"Inference-Header-Content-Length is not a number: {header_length!r}") from None
        if not 0 <= size <= len(body):
            raise BadRequest(f"Inference-Header-Content-Length {size} exceeds the body ({len(body)} bytes)")
        json_part, binary = body[:size], memoryview(body)[size:]
    try:
        doc = json.loads(json_part)
    except (ValueError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    raw_inputs = doc.get("inputs")
    if not isinstance(raw_inputs, list) or not raw_inputs:
        raise BadRequest("'inputs' must be a non-empty list")
    parameters = doc.get("parameters", {})
    if not isinstance(parameters, dict):
        raise BadRequest("'parameters' must be an object")
    inputs: dict[str, np.ndarray] = {}
    offset = 0
    for i, item in enumerate(raw_inputs):
        array, used = _decode_input(item, i, binary[offset:] if binary else b"")
        offset += used
        inputs[item["name"]] = array
    if binary and offset != len(binary):
        raise BadRequest(f"binary data holds {len(binary)} bytes but the inputs' binary_data_size add up to {offset}")
    request_id = doc.get("id")
    if request_id is not None and not isinstance(request_id, str):
        raise BadRequest("'id' must be a string")
    binary_outputs, all_binary = set(), bool(parameters.get("binary_data_output", False))
    outputs = doc.get("outputs", [])
    if not isinstance(outputs, list):
        raise BadRequest("'outputs' must be a list")
    for out in outputs:
        if not isinstance(out, dict) or not isinstance(out.get("name"), str):
            raise BadRequest("each requested output needs a 'name'")
        if isinstance(out.get("parameters"), dict) and out["parameters"].get("binary_data"):
            binary_outputs.add(out["name"])
    return InferRequest(request_id, inputs, parameters, binary_outputs, all_binary)


def _decode_input(item: Any, index: int, binary: bytes | memoryview) -> tuple[np.ndarray, int]:
    if not isinstance(item, dict) or not isinstance(item.get("name"), str):
        raise BadRequest(f"inputs[{index}] needs a 'name'")
    name = item["name"]
    shape, datatype = item.get("shape"), item.get("datatype")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise BadRequest(f"input {name}: 'shape' must be a list of non-negative integers")
    if datatype not in NUMPY_TYPES:
        raise BadRequest(f"input {name}: datatype {datatype!r} is not supported (use one of {', '.join(NUMPY_TYPES)})")
    count = int(np.prod(shape, dtype=np.int64))
    dtype = np.dtype(NUMPY_TYPES[datatype])
    params = item.get("parameters") or {}
    size = params.get("binary_data_size") if isinstance(params, dict) else None
    if size is not None:
        if not isinstance(size, int) or size < 0:
            raise BadRequest(f"input {name}: binary_data_size must be a non-negative integer")
        if size > len(binary):
            raise BadRequest(
                f"input {name}: binary_data_size {size} but only {len(binary)} bytes of binary data remain (truncated)"
            )
        if size != count * dtype.itemsize:
            raise BadRequest(
                f"input {name}: binary_data_size {size} does not match shape {shape} of {datatype} ({count * dtype.itemsize} bytes)"
            )
        return np.frombuffer(binary[:size], dtype=dtype).reshape(shape), size
    if "data" not in item:
        raise BadRequest(f"input {name}: needs 'data' or parameters.binary_data_size")
    try:
        array = np.asarray(item["data"], dtype=dtype)
    except (ValueError, TypeError, OverflowError):
        raise BadRequest(f"input {name}: 'data' is not a list of {datatype} values") from None
    if array.size != count:
        raise BadRequest(f"input {name}: 'data' holds {array.size} values but shape {shape} needs {count}")
    return array.reshape(shape), 0


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
