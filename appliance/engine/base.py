"""The one small interface every engine implements (ONNX Runtime now, CUDA and TensorRT later)."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from appliance.errors import ApplianceError


class Engine(Protocol):
    name: str

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Run the graph once on a batch of `batch` sequences; feeds and results keyed by tensor name."""
        ...


def load_engine(device: str, model_path: Path, threads: int) -> Engine:
    if device == "cpu":
        from appliance.engine.onnx_cpu import OnnxCpuEngine

        return OnnxCpuEngine(model_path, threads)
    raise ApplianceError(f"engine.device: no engine for {device!r}")
