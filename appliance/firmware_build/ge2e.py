"""Resemblyzer's GE2E speaker encoder as an ONNX graph, made at `firmware build` without torch.

Resemblyzer 0.1.4 ships `pretrained.pt` in torch's legacy serialization: three small pickles (magic,
protocol, sizes), the checkpoint pickled with its tensors' storages as persistent ids, the storages'
keys, then each storage's raw bytes (an int64 element count, then the elements). A restricted
unpickler reads it: it resolves only the three globals such a checkpoint names (OrderedDict, torch's
float storage and tensor rebuilder), so the file cannot run code. The network (Resemblyzer's
voice_encoder.py): three LSTM layers of 256 over 40 mel channels, the last layer's final hidden state
through a 256x256 linear layer, ReLU, L2-normalized.
"""

from __future__ import annotations

import collections
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from appliance.errors import ApplianceError
from appliance.kinds.speaker_mels import EMBEDDING_OUTPUT, HIDDEN, MELS, MELS_INPUT

MAGIC = 0x1950A86A20F9469CFC6C  # torch's legacy serialization
PROTOCOL = 1001
LAYERS = 3
OPSET = 17
# torch's LSTM gates are (input, forget, cell, output); ONNX's are (input, output, forget, cell)
ONNX_GATE_ORDER = (0, 3, 1, 2)


class FloatStorage:
    """A storage named in the pickle: its bytes come after it."""


@dataclass(slots=True)
class _Storage:
    key: str
    numel: int
    data: np.ndarray | None = None


@dataclass(slots=True)
class _Tensor:
    storage: _Storage
    offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    def array(self) -> np.ndarray:
        assert self.storage.data is not None
        item = self.storage.data.itemsize
        flat = self.storage.data[self.offset :]
        return np.lib.stride_tricks.as_strided(flat, self.size, [s * item for s in self.stride]).copy()


def _rebuild_tensor(storage: _Storage, offset: int, size: tuple[int, ...], stride: tuple[int, ...], *_: Any) -> _Tensor:
    return _Tensor(storage, offset, tuple(size), tuple(stride))


ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch", "FloatStorage"): FloatStorage,
}


class _Checkpoint(pickle.Unpickler):
    def __init__(self, file: IO[bytes]) -> None:
        super().__init__(file)
        self.storages: dict[str, _Storage] = {}

    def find_class(self, module: str, name: str) -> Any:
        found = ALLOWED.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"the checkpoint names {module}.{name}, which a GE2E checkpoint does not")
        return found

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 6 and pid[0] == "storage" and pid[1] is FloatStorage):
            raise pickle.UnpicklingError(f"unexpected persistent id {str(pid)[:80]}")
        key = str(pid[2])
        return self.storages.setdefault(key, _Storage(key, int(pid[4])))


def read_state(path: Path) -> dict[str, np.ndarray]:
    """The checkpoint's `model_state` tensors as float32 arrays, read without torch."""
    with open(path, "rb") as f:
        try:
            if pickle.load(f) != MAGIC or pickle.load(f) != PROTOCOL:
                raise ApplianceError(f"{path.name}: not a checkpoint in torch's legacy format")
            pickle.load(f)  # the writer's type sizes: storages are read by element size below
            checkpoint = _Checkpoint(f)
            found = checkpoint.load()
            keys = pickle.load(f)
            for key in keys:
                storage = checkpoint.storages[key]
                (count,) = struct.unpack("<q", f.read(8))
                raw = f.read(4 * count)
                if count != storage.numel or len(raw) != 4 * count:
                    raise ApplianceError(f"{path.name}: storage {key} is truncated or of the wrong size")
                storage.data = np.frombuffer(raw, "<f4")
        except (pickle.UnpicklingError, EOFError, KeyError, struct.error) as exc:
            raise ApplianceError(f"{path.name}: unreadable checkpoint: {exc}") from None
    state = found.get("model_state") if isinstance(found, dict) else None
    if not isinstance(state, dict):
        raise ApplianceError(f"{path.name}: the checkpoint holds no model_state")
    return {name: t.array() for name, t in state.items() if isinstance(t, _Tensor)}


def _gates(matrix: np.ndarray) -> np.ndarray:
    return np.concatenate([np.split(matrix, 4)[i] for i in ONNX_GATE_ORDER])


def graph(state: dict[str, np.ndarray]) -> onnx.ModelProto:
    """mels [batch, frames, 40] (power, not log: Resemblyzer's) -> embedding [batch, 256]."""
    weights: list[TensorProto] = []
    nodes = [helper.make_node("Transpose", [MELS_INPUT], ["x0"], perm=[1, 0, 2])]  # ONNX's LSTM is time-major
    try:
        for layer in range(LAYERS):
            w, r = (_gates(state[f"lstm.weight_{kind}_l{layer}"])[None] for kind in ("ih", "hh"))
            bias = np.concatenate([_gates(state[f"lstm.bias_{kind}_l{layer}"]) for kind in ("ih", "hh")])[None]
            names = [f"W{layer}", f"R{layer}", f"B{layer}"]
            weights += [numpy_helper.from_array(a.astype(np.float32), n) for a, n in zip((w, r, bias), names)]
            outputs = [f"y{layer}", f"h{layer}"]
            nodes.append(helper.make_node("LSTM", [f"x{layer}", *names], outputs, hidden_size=HIDDEN))
            nodes.append(helper.make_node("Squeeze", [f"y{layer}", "axis1"], [f"x{layer + 1}"]))
        linear_w, linear_b = state["linear.weight"].T, state["linear.bias"]
    except KeyError as exc:
        raise ApplianceError(f"the checkpoint lacks tensor {exc}: not Resemblyzer's GE2E encoder") from None
    weights += [
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(linear_w.astype(np.float32), "linear_w"),
        numpy_helper.from_array(linear_b.astype(np.float32), "linear_b"),
    ]
    nodes += [
        helper.make_node("Squeeze", [f"h{LAYERS - 1}", "axis0"], ["last"]),  # the last layer's final hidden state
        helper.make_node("MatMul", ["last", "linear_w"], ["projected"]),
        helper.make_node("Add", ["projected", "linear_b"], ["biased"]),
        helper.make_node("Relu", ["biased"], ["raw"]),
        helper.make_node("ReduceL2", ["raw"], ["norm"], axes=[1], keepdims=1),
        helper.make_node("Div", ["raw", "norm"], [EMBEDDING_OUTPUT]),
    ]
    model = helper.make_model(
        helper.make_graph(
            nodes,
            "ge2e",
            [helper.make_tensor_value_info(MELS_INPUT, TensorProto.FLOAT, ["batch", "frames", MELS])],
            [helper.make_tensor_value_info(EMBEDDING_OUTPUT, TensorProto.FLOAT, ["batch", HIDDEN])],
            weights,
        ),
        opset_imports=[helper.make_opsetid("", OPSET)],
        producer_name="appliance firmware build (Resemblyzer GE2E)",
    )
    onnx.checker.check_model(model)
    return model


def convert(checkpoint: Path, out: Path) -> None:
    """The checkpoint at `checkpoint` written as an ONNX graph at `out`."""
    onnx.save(graph(read_state(checkpoint)), str(out))
