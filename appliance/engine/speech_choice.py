"""The choice of speech-to-text engine for a Whisper model, as engine/choice.py chooses the VAD's.

`cpu`: CTranslate2 int8. `auto`: the box's own Whisper on the GPU (whisper_arrays_engine.py on CuPy,
float16) where CuPy finds a device and the firmware carries the model's converted weights (its `cuda`
target), with CTranslate2 on the CPU taking a batch that arrives while GPU memory is above the baked
`fallback_cpu_threshold` or that runs out of it; else CTranslate2 (its CUDA build where the box has
CUDA 12, the CPU otherwise), the reason logged. `cuda`: the same, a start-up error where no GPU engine
can run.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

import numpy as np

from appliance.engine import cuda, whisper_weights
from appliance.engine.batch_queue import Runner
from appliance.engine.failpoints import speech_failpoints
from appliance.engine.speech_engine import Decoded, Shard, SpeechEngine
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine
from appliance.engine.whisper_ops import ArrayOps, KernelOps, baked_shape, kernel_files
from appliance.errors import ApplianceError
from appliance.firmware import Bundle, ModelSpec

log = logging.getLogger("appliance")


def _cupy() -> tuple[Any, str | None]:
    """CuPy where it imports and finds a device, else None and why not."""
    try:
        import cupy  # the GPU machine's (CuPy for CUDA 13), not a dependency here
    except ImportError as exc:
        return None, f"CuPy is not installed: {exc}"
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            return None, "CuPy finds no CUDA device"
    except Exception as exc:  # noqa: BLE001 - cupy's CUDARuntimeError: no driver, no device
        return None, f"CUDA is not usable: {exc}"
    return cupy, None


def _memory_used(cupy: Any) -> Callable[[], float]:
    def used() -> float:
        free, total = cupy.cuda.runtime.memGetInfo()
        return 1.0 - free / total

    return used


class SpeechCpuFallback:
    """The GPU engine first; the CPU engine for a batch that arrives while GPU memory is above the
    threshold, or that ran out of it (the answer is the same Whisper's either way)."""

    def __init__(
        self,
        gpu: SpeechEngine,
        cpu: SpeechEngine,
        threshold: float,
        memory_used: Callable[[], float],
        out_of_memory: type[Exception] = MemoryError,
    ) -> None:
        self.gpu, self.cpu, self.threshold, self.memory_used = gpu, cpu, threshold, memory_used
        self.out_of_memory = out_of_memory
        self.name, self.tokens, self.weight_bytes = gpu.name, cpu.tokens, cpu.weight_bytes
        self.fallbacks: Counter[str] = Counter()

    @property
    def windows(self) -> Counter[str]:
        return self.gpu.windows + self.cpu.windows

    def check(self, language: str | None, task: str) -> None:
        self.cpu.check(language, task)

    def engine_now(self) -> SpeechEngine:
        """The GPU engine, or the CPU one while GPU memory is above the threshold (counted)."""
        if self.memory_used() > self.threshold:
            self.fallbacks["memory_pressure"] += 1
            return self.cpu
        return self.gpu

    def run(self, shards: list[Shard]) -> list[Decoded]:
        engine = self.engine_now()
        try:
            return engine.run(shards)
        except self.out_of_memory:
            if engine is self.cpu:
                raise
            return self.after_out_of_memory(shards)

    def after_out_of_memory(self, shards: list[Shard]) -> list[Decoded]:
        """Shards the GPU ran out of memory on, decoded on the CPU engine (counted, logged)."""
        self.fallbacks["out_of_memory"] += 1
        log.warning("engine %s: out of GPU memory on %d shards, ran them on the CPU", self.name, len(shards))
        return self.cpu.run(shards)

    def detect(self, clips: list[np.ndarray]) -> list[tuple[str, float]]:
        return self.engine_now().detect(clips)

    def decoding(self, max_batch: int) -> FallbackDecoding:
        return FallbackDecoding(self, self.gpu.decoding(max_batch))


class FallbackDecoding:
    """SpeechCpuFallback's runner: the GPU engine's continuous decoding, with the shards that begin while
    GPU memory is above the threshold, or that run out of it, decoded whole on the CPU engine."""

    def __init__(self, engines: SpeechCpuFallback, gpu: Runner[Shard, Decoded]) -> None:
        self.engines, self.gpu = engines, gpu
        self.grouped = gpu.grouped
        self._on_cpu: list[tuple[Hashable, Decoded]] = []  # answered, for the next advance

    @property
    def room(self) -> int:
        return self.gpu.room

    def begin(self, keyed: list[tuple[Hashable, Shard]]) -> None:
        engines = self.engines
        if engines.engine_now() is engines.cpu:
            self._answered(keyed, engines.cpu.run([shard for _, shard in keyed]))
            return
        try:
            self.gpu.begin(keyed)
        except engines.out_of_memory:
            for key, _ in keyed:
                self.gpu.drop(key)
            self._after_out_of_memory(keyed)

    def advance(self) -> list[tuple[Hashable, Decoded]]:
        if self._on_cpu:
            answered, self._on_cpu = self._on_cpu, []
            return answered
        try:
            return self.gpu.advance()
        except self.engines.out_of_memory:
            self._after_out_of_memory(self.gpu.clear())
            answered, self._on_cpu = self._on_cpu, []
            return answered

    def drop(self, key: Hashable) -> None:
        self.gpu.drop(key)
        self._on_cpu = [(k, answer) for k, answer in self._on_cpu if k != key]

    def clear(self) -> list[tuple[Hashable, Shard]]:
        self._on_cpu = []
        return self.gpu.clear()

    def _after_out_of_memory(self, keyed: list[tuple[Hashable, Shard]]) -> None:
        if keyed:
            self._answered(keyed, self.engines.after_out_of_memory([shard for _, shard in keyed]))

    def _answered(self, keyed: list[tuple[Hashable, Shard]], answers: list[Decoded]) -> None:
        self._on_cpu += [(key, answer) for (key, _), answer in zip(keyed, answers)]


def load_speech_engine(
    device: str, bundle: Bundle, model: ModelSpec, threads: int, beam_size: int, window_samples: int
) -> SpeechEngine:
    return speech_failpoints(_speech_engine(device, bundle, model, threads, beam_size, window_samples))


def _speech_engine(
    device: str, bundle: Bundle, model: ModelSpec, threads: int, beam_size: int, window_samples: int
) -> SpeechEngine:
    if device not in ("cpu", "cuda", "auto"):
        raise ApplianceError(f"engine.device: no engine for {device!r}")
    directory = bundle.artifact(model.file)
    threshold = bundle.manifest.baked.fallback_cpu_threshold
    if device != "cpu":
        cupy, reason = _cupy()
        if cupy is not None and whisper_weights.bundle_file(model.name) not in bundle.manifest.artifacts:
            cupy, reason = None, f"the firmware has no cuda target for model {model.name}"
        if cupy is not None:
            cpu = WhisperEngine(directory, "cpu", threads, beam_size, window_samples=window_samples)
            weights = whisper_weights.load(bundle.artifact(whisper_weights.bundle_file(model.name)))
            max_batch = int(str(model.parameters["max_batch"]))
            gpu = ArrayWhisperEngine(
                weights,
                directory,
                max_batch,
                cupy,
                cupy.float16,
                "whisper-cupy",
                cpu.weight_bytes,
                ops=_kernel_ops(cupy, bundle, model),
            )
            return SpeechCpuFallback(gpu, cpu, threshold, _memory_used(cupy), cupy.cuda.memory.OutOfMemoryError)
        log.info("model %s: the box's own Whisper does not run here (%s); CTranslate2 does", model.name, reason)
    memory_used = cuda.memory_used if cuda.cuda is not None else None
    return WhisperEngine(directory, device, threads, beam_size, threshold, memory_used, window_samples=window_samples)


def _kernel_ops(cupy: Any, bundle: Bundle, model: ModelSpec) -> ArrayOps:
    """The firmware's kernels/whisper.cu for this model, checked against its baked values; CuPy's own
    operations where the firmware carries no binary for it."""
    max_batch, shard_tokens = baked_shape(model.parameters)
    cubin, _ = kernel_files(max_batch, shard_tokens)
    if cubin not in bundle.manifest.artifacts:
        log.info("model %s: the firmware has no %s: CuPy's own operations run its steps", model.name, cubin)
        return ArrayOps(cupy)
    return KernelOps(cupy, cupy.RawModule(path=str(bundle.artifact(cubin))), max_batch, shard_tokens)
