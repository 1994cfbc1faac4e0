"""ONNX Runtime on the CPU: the embedded default engine."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
import onnxruntime as ort


class OnnxCpuEngine:
    name = "onnxruntime-cpu"

    def __init__(self, model_path: Path, threads: int) -> None:
        options = ort.SessionOptions()
        # One engine thread drives the session; intra-op threads beyond the box's cores only contend.
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        options.log_severity_level = 3
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        self._session = ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self._outputs = [o.name for o in self._session.get_outputs()]

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return dict(zip(self._outputs, self._session.run(self._outputs, dict(feeds))))
