"""GPU code checked where no GPU is: the NumPy reference against ONNX Runtime, the CUDA kernels
compiled for sm_90 with the baked values in the binary, and the cuda firmware target. The kernels
themselves run in tests/gpu/run.sh on a GPU machine."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
from conftest import DEFAULT_SPEC, ROOT, build_bundle, cli
from speech import RATE, SENTENCES, recording
from streams import one_stream

from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.engine.reference import ReferenceVad, load_weights
from appliance.firmware import AudioSpec, Baked

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc (CUDA toolkit) is not installed")
AUDIO = AudioSpec(16000, 512, 64, "input", "output", "sr")


def test_reference_matches_onnx_runtime_on_speech_and_silence(bundle: Path) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    speech, _ = recording(SENTENCES[:2])
    audio = np.concatenate([speech, np.zeros(3 * RATE, np.float32)])
    reference = one_stream(ReferenceVad(load_weights(model)), audio)
    onnx_runtime = one_stream(OnnxCpuEngine(model, 1), audio)
    assert reference.max() > 0.9 and reference[-50:].max() < 0.1  # speech was heard, silence was not
    np.testing.assert_allclose(reference, onnx_runtime, atol=1e-4, rtol=0)


def test_reference_matches_onnx_runtime_on_a_batch_with_state(bundle: Path) -> None:
    model = bundle / "models" / "silero_vad.onnx"
    rng = np.random.default_rng(3)
    feeds = {
        "input": (rng.standard_normal((64, 576)) * 0.2).astype(np.float32),
        "state": (rng.standard_normal((2, 64, 128)) * 0.5).astype(np.float32),
        "sr": np.array(16000, np.int64),
    }
    ours, theirs = ReferenceVad(load_weights(model)).run(feeds, 64), OnnxCpuEngine(model, 1).run(feeds, 64)
    np.testing.assert_allclose(ours["output"], theirs["output"], atol=1e-4, rtol=0)
    np.testing.assert_allclose(ours["stateN"], theirs["stateN"], atol=1e-4, rtol=0)


@needs_nvcc
def test_kernels_compile_for_sm_90_with_the_baked_values_in_the_binary(tmp_path: Path) -> None:
    from appliance.firmware_build.kernels import compile_vad_kernels

    small = compile_vad_kernels(Baked(1024, "semantic", 0.85, 64), AUDIO, tmp_path / "a")
    large = compile_vad_kernels(Baked(256, "fixed", 0.85, 8192), AUDIO, tmp_path / "b")
    ptx_small, ptx_large = small[1].read_text(), large[1].read_text()
    assert ".const .align 4 .u32 baked_max_batch = 64;" in ptx_small
    assert ".const .align 4 .u32 baked_shard_frames = 1024;" in ptx_small
    assert ".const .align 4 .u32 baked_max_batch = 8192;" in ptx_large
    assert ".const .align 4 .u32 baked_shard_frames = 256;" in ptx_large
    assert small[0].read_bytes() != large[0].read_bytes()  # the cubins differ too
    entries = {
        "appliance_baked",
        "pcm16_to_float",
        "frame_with_context",
        "gather_rows",
        "scatter_rows",
        "conv1d_tile",
        "magnitude",
        "lstm_decoder",
    }
    assert entries <= {line.split()[-1].rstrip("(") for line in ptx_small.splitlines() if ".entry" in line}
    if shutil.which("cuobjdump"):
        listing = subprocess.run(["cuobjdump", "-elf", str(small[0])], capture_output=True, text=True).stdout
        assert "sm_90" in listing


@needs_nvcc
def test_cuda_firmware_carries_signed_kernels_and_weights(keys, tmp_path: Path) -> None:
    spec = tmp_path / "gpu.toml"
    spec.write_text(DEFAULT_SPEC.read_text().replace('targets = ["cpu"]', 'targets = ["cpu", "cuda"]'))
    out = build_bundle(keys, tmp_path / "gpu", spec)
    for name in ("kernels/silero_vad.sm_90.cubin", "kernels/silero_vad.ptx", "models/silero_vad.cuda.npz"):
        assert (out / name).is_file(), name
    weights = np.load(out / "models" / "silero_vad.cuda.npz")
    assert weights["lstm_weight_ih_t"].shape == (128, 512) and weights["stft_basis"].shape == (1, 256, 258)
    cubin = out / "kernels" / "silero_vad.sm_90.cubin"
    cubin.write_bytes(cubin.read_bytes()[:-1] + bytes([cubin.read_bytes()[-1] ^ 1]))
    result = cli("firmware", "verify", out, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode != 0 and "silero_vad.sm_90.cubin" in result.stderr


def test_cuda_target_without_nvcc_is_a_clear_build_error(keys, tmp_path: Path) -> None:
    spec = tmp_path / "gpu.toml"
    spec.write_text(DEFAULT_SPEC.read_text().replace('targets = ["cpu"]', 'targets = ["cpu", "cuda"]'))
    env = {**os.environ, "NVCC": str(tmp_path / "no-such-nvcc")}  # a build machine without the toolkit
    result = subprocess.run(
        [
            str(ROOT / ".venv/bin/python"),
            "-m",
            "appliance",
            "firmware",
            "build",
            str(spec),
            "--key",
            str(keys.private),
            "--out",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    assert result.returncode != 0 and "needs nvcc" in result.stderr
    assert not (tmp_path / "out").exists()
