"""Choosing the engine and falling back to the CPU, where no GPU is: the fallback logic with a
GPU memory reading the test controls, and `engine.device` through the daemon."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from appliance.engine.base import CpuFallback, GpuOutOfMemory
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.engine.reference import ReferenceVad
from speech import RATE, SENTENCES, recording


class FlakyGpu(ReferenceVad):
    """Stands in for the GPU engine: the NumPy forward pass, out of memory while `oom` is set."""

    name = "test-gpu"
    oom = False

    def run(self, feeds, batch):
        if self.oom:
            raise GpuOutOfMemory("cuMemAlloc failed: out of memory")
        return super().run(feeds, batch)


def run_stream(engine, frames: np.ndarray, before_each=lambda t: None) -> np.ndarray:
    """Frames [T, S, 512] of S streams, state and context carried from batch to batch."""
    steps, count = frames.shape[:2]
    state, context, probs = np.zeros((2, count, 128), np.float32), np.zeros((count, 64), np.float32), []
    for t in range(steps):
        before_each(t)
        out = engine.run({"input": np.concatenate([context, frames[t]], axis=1), "state": state,
                          "sr": np.array(RATE, np.int64)}, count)
        probs.append(out["output"][:, 0])
        state, context = out["stateN"], frames[t][:, -64:]
    return np.stack(probs)


@pytest.fixture(scope="module")
def speech_frames() -> np.ndarray:
    audio, _ = recording(SENTENCES[:2])
    whole = audio[: len(audio) // 512 * 512].reshape(-1, 512)
    return np.stack([whole, np.roll(whole, 40, axis=0), np.roll(whole, 90, axis=0)], axis=1)  # 3 streams


def test_batches_move_to_the_cpu_above_the_threshold_and_back_keeping_state(bundle: Path, speech_frames) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    gpu, cpu = FlakyGpu.from_onnx(model), OnnxCpuEngine(model, 1)
    reading = {"used": 0.10}
    engine = CpuFallback(gpu, cpu, threshold=0.85, memory_used=lambda: reading["used"])
    steps = len(speech_frames)

    def memory(t: int) -> None:  # the middle third of the recording arrives with GPU memory at 92%
        reading["used"] = 0.92 if steps // 3 <= t < 2 * steps // 3 else 0.10
        gpu.oom = t == steps - 5  # and one late batch runs out of memory on the GPU

    mixed = run_stream(engine, speech_frames, memory)
    assert engine.fallbacks == {"memory_pressure": 2 * steps // 3 - steps // 3, "out_of_memory": 1}
    all_cpu = run_stream(cpu, speech_frames)
    assert all_cpu.max() > 0.9  # speech was heard
    # Every frame matches a run that never switched: each stream's state crossed both switches.
    np.testing.assert_allclose(mixed, all_cpu, atol=1e-4, rtol=0)


def test_at_the_threshold_batches_stay_on_the_gpu(bundle: Path, speech_frames) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    engine = CpuFallback(FlakyGpu.from_onnx(model), OnnxCpuEngine(model, 1), 0.85, lambda: 0.85)
    run_stream(engine, speech_frames[:10])
    assert not engine.fallbacks


def test_device_cuda_without_a_usable_gpu_is_a_start_up_error(start_daemon) -> None:
    from appliance.engine import cuda

    if cuda.cuda is not None:
        pytest.skip("pycuda is installed here: the cuda engine may load")
    daemon = start_daemon('[engine]\ndevice = "cuda"\n', wait=False)
    assert daemon.proc.wait(60) == 3
    log = daemon.log.read_text()
    assert 'engine.device = "cuda": model silero_vad: pycuda is not installed' in log, log


def test_device_auto_serves_on_the_cpu_and_says_why(start_daemon) -> None:
    from appliance.engine import cuda

    if cuda.cuda is not None:
        pytest.skip("pycuda is installed here: auto may choose the GPU")
    daemon = start_daemon('[engine]\ndevice = "auto"\n')
    with daemon.client() as client:
        assert client.infer(np.zeros(1024, np.float32)).shape == (2,)
        metrics = client.metrics()
    assert 'appliance_engine_frames_total{model="silero_vad",engine="onnxruntime-cpu"} ' in metrics
    assert "model silero_vad: engine.device = auto runs it on the CPU: pycuda is not installed" in daemon.log.read_text()
