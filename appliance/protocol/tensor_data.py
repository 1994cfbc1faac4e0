"""An input's JSON `data` as its NumPy array: KServe's datatypes, the values checked against the
datatype and the shape, converted a bounded chunk at a time from the text the JSON reader kept
(`Flat`), so memory stays near the body's size. A mismatch is a 400 saying where, and what fits."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from appliance.errors import BadRequest
from appliance.protocol.json_reader import Flat, is_number, json_kind

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


def _accepts(datatype: str) -> str:
    if datatype == "BOOL":
        return "true or false"
    if datatype.startswith("FP"):
        return "numbers"
    info = np.iinfo(np.dtype(NUMPY_TYPES[datatype]))
    return f"integers from {info.min} to {info.max}"


def data_array(data: Any, shape: list[int], count: int, datatype: str, where: str) -> np.ndarray:
    """An input's JSON `data`: a flat list in row-major order, or lists nested as the shape."""
    accepted = f"{datatype} values ({_accepts(datatype)})"
    if isinstance(data, Flat):
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


def _rows(data: list[Any], shape: list[int], datatype: str, expected: str) -> list[Flat]:
    """The innermost lists of `data` when it is nested exactly as `shape`; else a 400 saying where not."""
    level: list[tuple[str, Any]] = [("data", data)]
    for depth, size in enumerate(shape):
        last = depth == len(shape) - 1
        below: list[tuple[str, Any]] = []
        for path, node in level:
            if last and isinstance(node, Flat) and node.count == size:
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
    if isinstance(node, Flat):
        return f"{path} holds {node.count} values, not {size}" if last else f"{path} holds values, not {size} lists"
    if not isinstance(node, list):
        return f"{path} is {json_kind(node)}"
    if len(node) != size:
        return f"{path} holds {len(node)} items, not {size}"
    for i, item in enumerate(node):
        is_list = isinstance(item, (list, Flat))
        is_value = isinstance(item, bool) if datatype == "BOOL" else is_number(item)
        if (last and not is_value) or (not last and not is_list):
            return f"{path}[{i}] is {json_kind(item)}"
    return f"{path} mixes lists and values"


def _convert(rows: list[Flat], count: int, datatype: str, where: str) -> np.ndarray:
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
