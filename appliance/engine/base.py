"""The one small interface every engine implements (ONNX Runtime now, CUDA and TensorRT later)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from appliance.errors import ApplianceError


class Engine(Protocol):
    name: str

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        """Run the graph once on a batch of `batch` sequences; feeds and results keyed by tensor name."""
        ...


# Failpoint for tests: while this file exists, engine calls stall the way a wedged driver call
# would; if the file holds a number N, the first N calls after it appeared still run. Read from
# the environment only, never from config.
HANG_FAILPOINT = "APPLIANCE_FAILPOINT_ENGINE_HANG"


class _StallWhenFilePresent:
    def __init__(self, engine: Engine, trigger: Path) -> None:
        self.engine, self.trigger, self.name = engine, trigger, engine.name
        self.calls_while_armed = 0

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        if self.trigger.exists():
            self.calls_while_armed += 1
            if self.calls_while_armed > self._allowance():
                while self.trigger.exists():
                    time.sleep(0.05)
        else:
            self.calls_while_armed = 0
        return self.engine.run(feeds, batch)

    def _allowance(self) -> int:
        try:
            return int(self.trigger.read_text() or 0)
        except (OSError, ValueError):
            return 0


def load_engine(device: str, model_path: Path, threads: int) -> Engine:
    if device != "cpu":
        raise ApplianceError(f"engine.device: no engine for {device!r}")
    from appliance.engine.onnx_cpu import OnnxCpuEngine

    engine: Engine = OnnxCpuEngine(model_path, threads)
    if trigger := os.environ.get(HANG_FAILPOINT):
        engine = _StallWhenFilePresent(engine, Path(trigger))
    return engine
