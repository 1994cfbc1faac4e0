"""The choice of engine for a model: ONNX Runtime on the CPU, or a GPU engine (the CUDA kernels,
a TensorRT plan) with the CPU engine as its fallback under memory pressure."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping

import numpy as np

from appliance.engine import cuda, tensorrt
from appliance.engine.failpoints import engine_failpoints
from appliance.engine.interface import Engine, GpuOutOfMemory
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec

log = logging.getLogger("appliance")


def _gpu_engine(bundle: Bundle, model: ModelSpec) -> tuple[Engine | None, list[str]]:
    """The first GPU engine that can run `model` here, or None and why each could not."""
    reason = cuda.unavailable_reason(bundle, model)
    if reason is None:
        return cuda.CudaVadEngine(bundle, model), []
    reasons = [f"cuda engine: {reason}"]
    plan = next((p for p in bundle.manifest.plans if p.model == model.name), None)
    if plan is None:
        return None, reasons + ["no TensorRT plan for it in the firmware"]
    mismatch = tensorrt.plan_mismatch(plan, *tensorrt.found_gpu())
    if mismatch is not None:
        return None, reasons + [mismatch]
    return tensorrt.TensorrtEngine(bundle.artifact(plan.file).read_bytes(), model), reasons


class CpuFallback:
    """The GPU engine first; the CPU engine for a batch that arrives while GPU memory is above the
    baked threshold, or that ran out of GPU memory. State travels in the feeds, so a stream's
    next frame continues where the other engine left it."""

    def __init__(self, gpu: Engine, cpu: Engine, threshold: float, memory_used: Callable[[], float]) -> None:
        self.gpu, self.cpu, self.threshold, self.memory_used = gpu, cpu, threshold, memory_used
        self.name = gpu.name
        self.fallbacks: Counter[str] = Counter()

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        if self.memory_used() > self.threshold:
            self.fallbacks["memory_pressure"] += 1
            return self.cpu.run(feeds, batch)
        try:
            return self.gpu.run(feeds, batch)
        except GpuOutOfMemory as exc:
            self.fallbacks["out_of_memory"] += 1
            log.warning(
                "engine %s: out of GPU memory on a batch of %d, ran it on %s: %s", self.name, batch, self.cpu.name, exc
            )
            return self.cpu.run(feeds, batch)


def load_engine(device: str, bundle: Bundle, model: ModelSpec, threads: int, varied_shapes: bool = False) -> Engine:
    """`cpu`: ONNX Runtime. `cuda`: a GPU engine, a start-up error where none can run. `auto`: a
    GPU engine where one can run, else ONNX Runtime with the reason logged. The GPU engines, in
    order: the CUDA kernels (the default VAD model), then the firmware's TensorRT plan for the
    model. The CPU engine backs either under memory pressure. `varied_shapes`: each call's inputs
    are a different length (a voice's sentences), so ONNX Runtime's arena shrinks after each (engine/onnx_cpu.py)."""
    if device not in ("cpu", "cuda", "auto"):
        raise ApplianceError(f"engine.device: no engine for {device!r}")
    cpu = OnnxCpuEngine(bundle.artifact(model.file), threads, varied_shapes)
    engine: Engine = cpu
    if device != "cpu":
        gpu, reasons = _gpu_engine(bundle, model)
        if gpu is not None:
            engine = CpuFallback(gpu, cpu, bundle.manifest.baked.fallback_cpu_threshold, cuda.memory_used)
        elif device == "cuda":
            raise ApplianceError(f'engine.device = "cuda": model {model.name}: {"; ".join(reasons)}')
        else:
            log.info("model %s: engine.device = auto runs it on the CPU: %s", model.name, "; ".join(reasons))
    return engine_failpoints(engine)
