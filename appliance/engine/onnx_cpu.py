"""ONNX Runtime on the CPU: the embedded default engine."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnxruntime as ort

from appliance.errors import ApplianceError

# A batch this large has enough work to split across intra-op threads (measured on 2 cores:
# batch 19 took 1126 us on one thread, 877 us on two); a small one only pays the fork-join.
PARALLEL_MIN_BATCH = 16


def session(model_path: Path, threads: int) -> ort.InferenceSession:
    """The intra-op threads block when they have no work instead of spinning: their spin took cores that
    Whisper and the other models share, for no speed (2 cores, 2 threads: Kokoro's run 1.29 s either
    way, its CPU 13.2 s instead of 15.5 s for six runs; the speaker encoder's 17 ms runs 40% less CPU)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    try:
        return ort.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own exception types, one per failure kind
        raise ApplianceError(f"{model_path}: ONNX Runtime cannot load the model: {exc}") from None


class OnnxCpuEngine:
    name = "onnxruntime-cpu"

    def __init__(self, model_path: Path, threads: int, varied_shapes: bool = False) -> None:
        """`varied_shapes`: each run's inputs are a different length (a voice's sentences). ONNX Runtime's
        arena keeps the largest run's memory for the next; here it hands back what it grew by at the end
        of each run. Without an arena, glibc's moving mmap threshold keeps the runs' large tensors in its
        heaps: Kokoro's peak over six sentences of 40 to 150 tokens was 2,082 MiB more than at rest,
        and 243 to 302 MiB with the shrinking arena, which also ran them in 28-29 s instead of 32-33 s."""
        self._single = session(model_path, 1)
        self._parallel = session(model_path, threads) if threads > 1 else self._single
        self._outputs = [o.name for o in self._single.get_outputs()]
        self._options = ort.RunOptions()
        if varied_shapes:
            self._options.add_run_config_entry("memory.enable_memory_arena_shrinkage", "cpu:0")

    def run(self, feeds: Mapping[str, np.ndarray], batch: int, parallel: bool | None = None) -> dict[str, np.ndarray]:
        """`parallel`: the intra-op threads or one, where the caller knows better than the batch size (a heavy
        graph run alone takes them all; runs side by side take one each)."""
        if parallel is None:
            parallel = batch >= PARALLEL_MIN_BATCH
        chosen = self._parallel if parallel else self._single
        return dict(zip(self._outputs, chosen.run(self._outputs, dict(feeds), self._options)))
