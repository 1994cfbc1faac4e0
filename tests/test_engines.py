"""Choosing the engine and falling back to the CPU, where no GPU is: the fallback logic with a
GPU memory reading the test controls, `engine.device` through the daemon, and TensorRT plans
refused where the TensorRT version or the GPU differs from the build machine's."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import DEFAULT_SPEC, cli
from speech import SENTENCES, recording
from streams import run_streams

from appliance import firmware
from appliance.engine.choice import CpuFallback
from appliance.engine.interface import GpuOutOfMemory
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.engine.reference import ReferenceVad, load_weights
from appliance.engine.tensorrt import plan_mismatch
from appliance.firmware import PlanSpec
from appliance.firmware_build.bundle import sign
from appliance.keys import load_private_key


class FlakyGpu(ReferenceVad):
    """Stands in for the GPU engine: the NumPy forward pass, out of memory while `oom` is set."""

    name = "test-gpu"
    oom = False

    def run(self, feeds, batch):
        if self.oom:
            raise GpuOutOfMemory("cuMemAlloc failed: out of memory")
        return super().run(feeds, batch)


@pytest.fixture(scope="module")
def speech_frames() -> np.ndarray:
    audio, _ = recording(SENTENCES[:2])
    whole = audio[: len(audio) // 512 * 512].reshape(-1, 512)
    return np.stack([whole, np.roll(whole, 40, axis=0), np.roll(whole, 90, axis=0)], axis=1)  # 3 streams


def test_batches_move_to_the_cpu_above_the_threshold_and_back_keeping_state(bundle: Path, speech_frames) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    gpu, cpu = FlakyGpu(load_weights(model)), OnnxCpuEngine(model, 1)
    reading = {"used": 0.10}
    engine = CpuFallback(gpu, cpu, threshold=0.85, memory_used=lambda: reading["used"])
    steps = len(speech_frames)

    def memory(t: int) -> None:  # the middle third of the recording arrives with GPU memory at 92%
        reading["used"] = 0.92 if steps // 3 <= t < 2 * steps // 3 else 0.10
        gpu.oom = t == steps - 5  # and one late batch runs out of memory on the GPU

    mixed = run_streams(engine, speech_frames, memory)
    assert engine.fallbacks == {"memory_pressure": 2 * steps // 3 - steps // 3, "out_of_memory": 1}
    all_cpu = run_streams(cpu, speech_frames)
    assert all_cpu.max() > 0.9  # speech was heard
    # Every frame matches a run that never switched: each stream's state crossed both switches.
    np.testing.assert_allclose(mixed, all_cpu, atol=1e-4, rtol=0)


def test_at_the_threshold_batches_stay_on_the_gpu(bundle: Path, speech_frames) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    engine = CpuFallback(FlakyGpu(load_weights(model)), OnnxCpuEngine(model, 1), 0.85, lambda: 0.85)
    run_streams(engine, speech_frames[:10])
    assert not engine.fallbacks


def test_device_cuda_without_a_usable_gpu_is_a_start_up_error(start_daemon) -> None:
    from appliance.engine import cuda

    if cuda.cuda is not None:
        pytest.skip("pycuda is installed here: the cuda engine may load")
    daemon = start_daemon('[engine]\ndevice = "cuda"\n', wait=False)
    assert daemon.proc.wait(60) == 3
    log = daemon.log.read_text()
    assert 'engine.device = "cuda": model silero_vad: cuda engine: pycuda is not installed' in log, log
    assert "no TensorRT plan for it in the firmware" in log


def test_device_auto_serves_on_the_cpu_and_says_why(start_daemon) -> None:
    from appliance.engine import cuda

    if cuda.cuda is not None:
        pytest.skip("pycuda is installed here: auto may choose the GPU")
    daemon = start_daemon('[engine]\ndevice = "auto"\n')
    with daemon.client() as client:
        assert client.speech_probs(np.zeros(1024, np.float32)).shape == (2,)
        metrics = client.metrics()
    assert 'appliance_engine_frames_total{model="silero_vad",engine="onnxruntime-cpu"} ' in metrics
    assert (
        "model silero_vad: engine.device = auto runs it on the CPU: cuda engine: pycuda is not installed"
        in daemon.log.read_text()
    )


# --- TensorRT plans: built on the target GPU, refused anywhere else ---------------------------------

H100_PLAN = PlanSpec(
    model="silero_vad",
    file="models/silero_vad.plan",
    tensorrt_version="10.13.3.9",
    compute_capability="9.0",
    precision="fp16",
    fp16_max_abs_error=2e-4,
)


@pytest.mark.parametrize(
    "found, expected",
    [
        (("10.13.3.9", "9.0"), None),
        (("10.14.1.48", "9.0"), "this box has TensorRT 10.14.1.48; a plan only loads in the version that built it"),
        (("10.13.3.9", "8.9"), "this box's GPU has compute capability 8.9"),
        ((None, "9.0"), "TensorRT is not installed here"),
        (("10.13.3.9", None), "no CUDA GPU here"),
    ],
)
def test_a_plan_runs_only_with_the_tensorrt_and_gpu_it_was_built_for(found, expected) -> None:
    message = plan_mismatch(H100_PLAN, *found)
    if expected is None:
        assert message is None
    else:
        assert message.startswith(
            "TensorRT plan models/silero_vad.plan (built with TensorRT 10.13.3.9 for compute capability 9.0): "
        ) and message.endswith(expected), message


def test_tensorrt_target_without_tensorrt_is_a_clear_build_error(keys, tmp_path: Path) -> None:
    try:
        import tensorrt  # noqa: F401

        pytest.skip("TensorRT is installed here")
    except ImportError:
        pass
    spec = tmp_path / "trt.toml"
    spec.write_text(DEFAULT_SPEC.read_text().replace('targets = ["cpu"]', 'targets = ["cpu", "tensorrt"]'))
    result = cli("firmware", "build", spec, "--key", keys.private, "--out", tmp_path / "out", check=False)
    assert result.returncode != 0 and "target 'tensorrt' needs TensorRT" in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


def with_plan(bundle: Path, keys, out: Path, plan: PlanSpec) -> Path:
    """The bundle as a build machine with TensorRT would have made it: a plan file, recorded and signed."""
    shutil.copytree(bundle, out)
    (out / plan.file).write_bytes(os.urandom(4096))  # a serialized plan is opaque to everything but TensorRT
    manifest = firmware.verify(bundle, keys.trusted).manifest
    manifest = dataclasses.replace(
        manifest,
        targets=(*manifest.targets, "tensorrt"),
        plans=(plan,),
        artifacts={**manifest.artifacts, plan.file: firmware.sha256_file(out / plan.file)},
    )
    sign(out, manifest, load_private_key(keys.private))
    return out


def test_a_plan_for_another_gpu_is_refused_and_the_model_served_on_the_cpu(
    start_daemon, bundle, keys, tmp_path
) -> None:
    from appliance.engine import cuda

    if cuda.cuda is not None:
        pytest.skip("pycuda is installed here: the cuda engine would take the model first")
    planned = with_plan(bundle, keys, tmp_path / "planned", H100_PLAN)
    assert firmware.verify(planned, keys.trusted).manifest.plans == (H100_PLAN,)  # round trip through the manifest
    daemon = start_daemon('[engine]\ndevice = "auto"\n', bundle_dir=planned)
    with daemon.client() as client:
        assert client.speech_probs(np.zeros(512, np.float32)).shape == (1,)
        assert 'engine="onnxruntime-cpu"' in client.metrics()
    # pycuda is absent (above), so this box shows no GPU; TensorRT itself may be installed or not
    why = "TensorRT is not installed here" if importlib.util.find_spec("tensorrt") is None else "no CUDA GPU here"
    log = daemon.log.read_text()
    assert "runs it on the CPU: cuda engine: pycuda is not installed" in log
    assert (
        "TensorRT plan models/silero_vad.plan (built with TensorRT 10.13.3.9 for compute capability 9.0): " + why
    ) in log, log


def test_a_plan_naming_a_file_outside_the_bundle_fails_verification(bundle, keys, tmp_path) -> None:
    planned = with_plan(bundle, keys, tmp_path / "planned", H100_PLAN)
    manifest = firmware.verify(planned, keys.trusted).manifest
    stray = dataclasses.replace(H100_PLAN, file="models/elsewhere.plan")
    sign(planned, dataclasses.replace(manifest, plans=(stray,)), load_private_key(keys.private))
    result = cli("firmware", "verify", planned, "--trusted-keys", keys.trusted, check=False)
    assert (
        result.returncode != 0 and "plan models/elsewhere.plan names no model or file of this bundle" in result.stderr
    )
