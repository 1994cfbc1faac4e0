"""Whisper's weights read from a CTranslate2 model directory (its model.bin), for the box's own engine.

`firmware build` converts them once (the `cuda` target: firmware_build/bundle.py) into an .npz of
float16 arrays, hashed and signed with the bundle's other artifacts; the engine reads that file.
model.bin is CTranslate2's binary format (version 6): a spec name, then each variable's name, shape,
type and bytes, then aliases (the output projection is the token embedding). An int8 matrix comes
with its `weight_scale` per output row: dequantized here as weight / scale.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from appliance.errors import ApplianceError

TYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}  # CTranslate2 DataType
BFLOAT16 = 5


class _Reader:
    def __init__(self, data: bytes, path: Path) -> None:
        self.data, self.at, self.path = data, 0, path

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.data, self.at)
        self.at += struct.calcsize(fmt)
        return int(value)

    def text(self) -> str:
        n = self.take("<H")
        value = self.data[self.at : self.at + n].rstrip(b"\0").decode()
        self.at += n
        return value

    def array(self, dtype: int, shape: list[int], size: int) -> np.ndarray:
        raw = self.data[self.at : self.at + size]
        self.at += size
        if dtype == BFLOAT16:  # the high half of a float32
            return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).reshape(shape)
        if dtype not in TYPES:
            raise ApplianceError(f"{self.path}: variable of unknown type {dtype}")
        return np.frombuffer(raw, TYPES[dtype]).reshape(shape)


def read_ct2(path: Path) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 Whisper model.bin, int8 matrices dequantized to float32."""
    try:
        return _read(_Reader(path.read_bytes(), path))
    except (struct.error, ValueError):  # a length past the end, or bytes that fit no shape
        raise ApplianceError(f"{path}: cut short or damaged (not a whole CTranslate2 model.bin)") from None


def _read(reader: _Reader) -> dict[str, np.ndarray]:
    path = reader.path
    version = reader.take("<I")
    if version < 5:
        raise ApplianceError(f"{path}: CTranslate2 model format {version}; this reads 5 and later")
    spec = reader.text()
    reader.take("<I")  # the spec's revision
    if spec != "WhisperSpec":
        raise ApplianceError(f"{path}: a {spec} model, not Whisper")
    found: dict[str, np.ndarray] = {}
    for _ in range(reader.take("<I")):
        name = reader.text()
        shape = [reader.take("<I") for _ in range(reader.take("<B"))]
        dtype = reader.take("<B")
        found[name] = reader.array(dtype, shape, reader.take("<I"))
    aliases = [(reader.text(), reader.text()) for _ in range(reader.take("<I"))]
    for name in [n for n in found if n.endswith("/weight_scale")]:
        weight = name.removesuffix("_scale")
        scale = found.pop(name).astype(np.float32)
        found[weight] = found[weight].astype(np.float32) / scale.reshape(-1, *([1] * (found[weight].ndim - 1)))
    for alias, name in aliases:  # after the dequantization: an alias is the array its name now holds
        found[alias] = found[name]
    return found


def bundle_file(model: str) -> str:
    """Where a firmware bundle keeps a Whisper's converted weights (the `cuda` target)."""
    return f"models/{model}.whisper.npz"


ALIASES = "aliases"  # the .npz's list of "alias=name": an array CTranslate2 shares is stored once


def convert(model_dir: Path, out: Path) -> int:
    """model_dir's model.bin -> `out`, an .npz of the float16 arrays the engine reads (the scalars
    CTranslate2 keeps as flags are left out; an array it stores under two names is written once: the
    output projection is tiny.en's 40 MB embedding); returns how many names it holds."""
    weights: dict[str, np.ndarray] = {}
    stored: dict[int, str] = {}  # id of an array read -> the name it is written under
    aliases = []
    for name, value in read_ct2(model_dir / "model.bin").items():
        if value.ndim == 0 or value.dtype == np.int8 or name.startswith("decoder/alignment"):
            continue
        if (first := stored.get(id(value))) is not None:
            aliases.append(f"{name}={first}")
            continue
        stored[id(value)] = name
        weights[name.replace("/", ".")] = np.ascontiguousarray(value, np.float16)
    with open(out, "wb") as f:
        np.savez(f, **weights, **{ALIASES: np.array(aliases, dtype=str)})  # type: ignore[arg-type]  # numpy's stub puts allow_pickle before **kwds
    return len(weights) + len(aliases)


def load(path: Path) -> dict[str, np.ndarray]:
    """The arrays `convert` wrote, as float32 (the NumPy reference computes in float32), each alias
    the same array as its name."""
    with np.load(path) as arrays:
        found = {name.replace(".", "/"): arrays[name].astype(np.float32) for name in arrays.files if name != ALIASES}
        shared = arrays[ALIASES] if ALIASES in arrays.files else ()  # a bundle built before: each written out
        for alias, name in (pair.split("=") for pair in shared):
            found[alias] = found[name]
    return found
