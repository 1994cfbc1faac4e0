"""TensorRT for any ONNX model of a firmware: the plan built at firmware build time on the target
GPU, and the engine that runs it (with pycuda for device memory).

A plan only runs on the GPU model and TensorRT version it was built with, so the manifest
records both; the runtime compares them with what it finds and, where they differ, says so and
leaves the model on ONNX Runtime.

Build: an optimization profile whose batch bound is the baked max_batch and whose other free
dimensions go up to the baked shard size (the audio input of a frame model is exactly one frame
plus its context); FP16 where the outputs stay within FP16_TOLERANCE of the FP32 plan on the
same inputs, else FP32; a timing cache kept next to the bundle so rebuilds are fast.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from appliance.engine.interface import GpuOutOfMemory
from appliance.errors import ApplianceError
from appliance.firmware import DATATYPES, Baked, ModelSpec, PlanSpec

FP16_TOLERANCE = 1e-3
WORKSPACE_BYTES = 1 << 30


try:  # the `gpu` extra, installed only where an NVIDIA driver answers
    import tensorrt
except ImportError as exc:
    tensorrt, TENSORRT_MISSING = None, exc
try:
    import pycuda.driver as cuda
except ImportError:
    cuda = None


def _tensorrt() -> Any:
    """The tensorrt module; ImportError (its own) where it is not installed."""
    if tensorrt is None:
        raise ImportError(str(TENSORRT_MISSING))
    return tensorrt


def found_gpu() -> tuple[str | None, str | None]:
    """(TensorRT version, compute capability "9.0") on this machine; None where absent."""
    try:
        version = _tensorrt().__version__
    except ImportError:
        version = None
    try:
        cuda.init()
        major, minor = cuda.Device(0).compute_capability()
        capability = f"{major}.{minor}"
    except Exception:  # noqa: BLE001 - no pycuda, no driver or no device: no GPU to match
        capability = None
    return version, capability


def plan_mismatch(plan: PlanSpec, tensorrt_version: str | None, compute_capability: str | None) -> str | None:
    """Why `plan` cannot run here, or None."""
    where = f"TensorRT plan {plan.file} (built with TensorRT {plan.tensorrt_version} for compute capability {plan.compute_capability})"
    if tensorrt_version is None:
        return f"{where}: TensorRT is not installed here"
    if compute_capability is None:
        return f"{where}: no CUDA GPU here"
    if tensorrt_version != plan.tensorrt_version:
        return f"{where}: this box has TensorRT {tensorrt_version}; a plan only loads in the version that built it"
    if compute_capability != plan.compute_capability:
        return f"{where}: this box's GPU has compute capability {compute_capability}"
    return None


# --- build ----------------------------------------------------------------------------------------


def _profile_bounds(model: ModelSpec, name: str, shape: tuple[int, ...], baked: Baked) -> tuple[tuple[int, ...], ...]:
    """(min, opt, max) for one input: the batch axis up to max_batch, other free axes up to the shard size."""
    batch_axis = next((p.batch_axis for p in model.state if p.input == name), 0)
    audio = model.audio
    low: list[int] = []
    opt: list[int] = []
    high: list[int] = []
    for axis, dim in enumerate(shape):
        if dim >= 0:
            bounds = (dim, dim, dim)
        elif axis == batch_axis:
            bounds = (1, min(64, baked.max_batch), baked.max_batch)
        elif audio is not None and name == audio.audio_input:
            frame = audio.context_samples + audio.frame_samples
            bounds = (frame, frame, frame)
        else:
            bounds = (1, baked.max_tokens_per_shard, baked.max_tokens_per_shard)
        for out, value in zip((low, opt, high), bounds):
            out.append(value)
    return tuple(low), tuple(opt), tuple(high)


def _build_serialized(onnx_path: Path, model: ModelSpec, baked: Baked, fp16: bool, timing_cache: Path) -> bytes:
    trt = _tensorrt()
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    network = builder.create_network(0)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ApplianceError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
    if fp16:
        config.set_flag(trt.BuilderFlag.FP16)
    cache = config.create_timing_cache(timing_cache.read_bytes() if timing_cache.exists() else b"")
    config.set_timing_cache(cache, ignore_mismatch=False)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        profile.set_shape(tensor.name, *_profile_bounds(model, tensor.name, tuple(tensor.shape), baked))
    config.add_optimization_profile(profile)
    plan = builder.build_serialized_network(network, config)
    if plan is None:
        raise ApplianceError(f"TensorRT could not build a plan for {onnx_path.name} (see its log above)")
    timing_cache.write_bytes(memoryview(config.get_timing_cache().serialize()))
    return bytes(plan)


def _sample_feeds(model: ModelSpec, batch: int) -> dict[str, np.ndarray]:
    """Inputs at the profile's opt shape: audio-like noise, zero state, the sample rate."""
    rng = np.random.default_rng(0)
    feeds = {}
    audio = model.audio
    # a free axis other than the batch: the audio frame for the VAD, a short length for any graph
    frame = audio.context_samples + audio.frame_samples if audio is not None else 16
    for spec in model.inputs:
        if audio is not None and spec.name == audio.sample_rate_input:
            feeds[spec.name] = np.array(audio.sample_rate, DATATYPES[spec.datatype])
            continue
        batch_axis = next((p.batch_axis for p in model.state if p.input == spec.name), 0)
        shape = [d if d >= 0 else batch if axis == batch_axis else frame for axis, d in enumerate(spec.shape)]
        feeds[spec.name] = (rng.standard_normal(shape) * 0.1).astype(DATATYPES[spec.datatype])
    return feeds


def build_plan(staging: Path, model: ModelSpec, baked: Baked, timing_cache: Path) -> PlanSpec:
    """Build the plan for `model` (its ONNX file in `staging`) on this machine's GPU, into
    models/<name>.plan; FP16 where it stays within tolerance of FP32."""
    version, capability = found_gpu()
    if version is None:
        raise ApplianceError(
            "firmware target 'tensorrt' needs TensorRT (the gpu extra) and the target GPU on the build machine"
        )
    if capability is None:
        raise ApplianceError(
            "firmware target 'tensorrt' needs the target GPU on the build machine: no CUDA device found"
        )
    onnx_path = staging / model.file
    fp32 = _build_serialized(onnx_path, model, baked, False, timing_cache)
    fp16 = _build_serialized(onnx_path, model, baked, True, timing_cache)
    feeds = _sample_feeds(model, min(64, baked.max_batch))
    batch = min(64, baked.max_batch)
    reference = TensorrtEngine(fp32, model).run(feeds, batch)
    candidate = TensorrtEngine(fp16, model).run(feeds, batch)
    error = max(float(np.abs(candidate[k].astype(np.float64) - reference[k]).max()) for k in reference)
    chosen, precision = (fp16, "fp16") if error <= FP16_TOLERANCE else (fp32, "fp32")
    relative = f"models/{model.name}.plan"
    (staging / relative).write_bytes(chosen)
    return PlanSpec(
        model=model.name,
        file=relative,
        tensorrt_version=version,
        compute_capability=capability,
        precision=precision,
        fp16_max_abs_error=error,
    )


# --- run ------------------------------------------------------------------------------------------


class TensorrtEngine:
    """A firmware's plan on the GPU: host feeds in, host results out (the Engine interface)."""

    name = "tensorrt"

    def __init__(self, serialized: bytes, model: ModelSpec) -> None:
        trt = _tensorrt()
        cuda.init()
        self.cuda, self.model = cuda, model
        self.gpu_context = cuda.Device(0).retain_primary_context()
        self.gpu_context.push()
        try:
            self.runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
            self.engine = self.runtime.deserialize_cuda_engine(serialized)
            if self.engine is None:
                raise ApplianceError(f"TensorRT could not load the plan for {model.name}")
            self.context = self.engine.create_execution_context()
            self.stream = cuda.Stream()
            self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
            self.outputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]
            self.inputs = [n for n in self.names if n not in self.outputs]
            self.dtypes = {n: np.dtype(trt.nptype(self.engine.get_tensor_dtype(n))) for n in self.names}
            self._buffers: dict[str, tuple[Any, int]] = {}  # tensor -> (device allocation, bytes)
        finally:
            cuda.Context.pop()

    def _device(self, name: str, nbytes: int) -> Any:
        """The tensor's device buffer, grown when a batch needs more; bound to the context."""
        held = self._buffers.get(name)
        if held is None or held[1] < nbytes:
            held = self._buffers[name] = (self.cuda.mem_alloc(max(nbytes, 1)), nbytes)
            self.context.set_tensor_address(name, int(held[0]))
        return held[0]

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        cuda = self.cuda
        self.gpu_context.push()
        try:
            for name in self.inputs:
                host = np.ascontiguousarray(feeds[name], self.dtypes[name])
                self.context.set_input_shape(name, host.shape)
                cuda.memcpy_htod_async(self._device(name, host.nbytes), host, self.stream)
            outputs = {}
            for name in self.outputs:
                outputs[name] = np.empty(tuple(self.context.get_tensor_shape(name)), self.dtypes[name])
                self._device(name, outputs[name].nbytes)
            if not self.context.execute_async_v3(self.stream.handle):
                raise ApplianceError(f"TensorRT failed to run {self.model.name} on a batch of {batch}")
            for name, host in outputs.items():
                cuda.memcpy_dtoh_async(host, self._buffers[name][0], self.stream)
            self.stream.synchronize()
            return outputs
        except cuda.MemoryError as exc:
            raise GpuOutOfMemory(str(exc)) from exc
        finally:
            cuda.Context.pop()
