"""JSON written a slice at a time, for answers that can be long (an infer's tensors as JSON, an hour's
verbose_json with its words). One `json.dumps` call holds the GIL to its end, so on a thread too a long
one kept the event loop's thread from running: 65,536 FP32s for 30 ms, 1 MiB of them 137 ms. Here no
call writes more than about JSON_SLICE values; the text is the same as `json.dumps(doc,
separators=(",", ":"))` gives (NumPy arrays written as their `tolist()`; object keys are strings)."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

# Values one json.dumps call writes (FP32s: about 0.8 ms of it)
JSON_SLICE = 2048
# What writing one value costs against copying bytes (a JSON number, a text, a segment's field: 0.2
# to 0.4 us): an answer of 65,536 values weighs 64 MiB, and is written off the event loop
ELEMENT_BYTES = 1 << 10


def dumps(value: Any) -> str:
    """`value` as compact JSON, its long lists and arrays a slice at a time."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{_plain(key)}:{dumps(item)}" for key, item in value.items()) + "}"
    if isinstance(value, np.ndarray):
        flat = value.reshape(-1)
        return (
            "[" + ",".join(_plain(flat[at : at + JSON_SLICE].tolist())[1:-1] for at in _starts(flat, JSON_SLICE)) + "]"
        )
    if isinstance(value, (list, tuple)) and value:
        step = max(1, JSON_SLICE // _width(value[0]))
        if len(value) > step:
            return "[" + ",".join(_plain(value[at : at + step])[1:-1] for at in _starts(value, step)) + "]"
        if any(map(_long, value)) or any(isinstance(item, dict) and any(map(_long, item.values())) for item in value):
            return "[" + ",".join(dumps(item) for item in value) + "]"  # an infer's outputs: their data
    return _plain(value)


def _long(value: Any) -> bool:
    """What one json.dumps call may not write whole: an array, or a list past JSON_SLICE values."""
    return isinstance(value, np.ndarray) or (isinstance(value, (list, tuple)) and len(value) > JSON_SLICE)


def _starts(values: Any, step: int) -> range:
    return range(0, len(values), step)


def _width(item: Any) -> int:
    """About how many values one item of a long list holds (a word's dict: its keys and values)."""
    return max(1, 2 * len(item)) if isinstance(item, (dict, list, tuple)) else 1  # an empty one: one


def _plain(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))
