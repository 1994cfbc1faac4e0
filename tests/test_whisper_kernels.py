"""The box's own Whisper for the GPU, checked where no GPU is: kernels/whisper.cu compiled by nvcc
for sm_90 with the model's baked batch and shard length in the binary, the `cuda` firmware target
converting a Whisper's CTranslate2 weights into a signed artifact, and `engine.device = auto` choosing
it where CuPy finds a device (a stand-in CuPy over NumPy, the kernels' NumPy stand-ins reading the
firmware's binary). The kernels run in tests/gpu/run.sh on a GPU machine."""

from __future__ import annotations

import logging
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import ROOT, Keys, build_bundle, cli
from test_kernels import needs_nvcc
from test_whisper_ops import Kernels

from appliance import firmware
from appliance.engine import whisper_weights
from appliance.engine.speech_choice import SpeechCpuFallback, load_speech_engine
from appliance.engine.whisper import WhisperEngine
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine
from appliance.engine.whisper_ops import KernelOps

KERNELS = {"appliance_baked", "layer_norm", "bias_gelu", "decode_attention", "greedy_with_rules"}


@needs_nvcc
def test_whisper_kernels_compile_for_sm_90_with_the_baked_values_in_the_binary(tmp_path: Path) -> None:
    from appliance.firmware_build.kernels import compile_whisper_kernels

    small = compile_whisper_kernels(8, 1400, tmp_path / "a")
    large = compile_whisper_kernels(64, 1500, tmp_path / "b")
    ptx_small, ptx_large = small[1].read_text(), large[1].read_text()
    assert ".const .align 4 .u32 baked_max_batch = 8;" in ptx_small
    assert ".const .align 4 .u32 baked_shard_tokens = 1400;" in ptx_small
    assert ".const .align 4 .u32 baked_max_batch = 64;" in ptx_large
    assert ".const .align 4 .u32 baked_shard_tokens = 1500;" in ptx_large
    assert small[0].read_bytes() != large[0].read_bytes()
    assert KERNELS <= set(re.findall(r"\.entry (\w+)\(", ptx_small))
    if shutil.which("cuobjdump"):
        listing = subprocess.run(["cuobjdump", "-elf", str(small[0])], capture_output=True, text=True).stdout
        assert "sm_90" in listing


def tiny_en_firmware(keys: Keys, out: Path, targets: str = '["cpu", "cuda"]') -> Path:
    """The voice firmware's tiny.en alone, built for `targets`."""
    voice = (ROOT / "firmware" / "voice.toml").read_text()
    tiny_only = voice[: voice.index("# Whisper base")].replace('targets = ["cpu"]', f"targets = {targets}")
    spec = out.parent / f"{out.name}.toml"
    spec.write_text(tiny_only.replace(', languages_by = "whisper_base"', ""))
    return build_bundle(keys, out, spec)


@needs_nvcc
def test_cuda_firmware_carries_a_whispers_converted_weights_signed(keys: Keys, tmp_path: Path) -> None:
    out = tiny_en_firmware(keys, tmp_path / "voice-cuda")
    bundle = firmware.verify(out, keys.trusted)
    for name in (
        "models/whisper_tiny_en.whisper.npz",
        "kernels/whisper-b8-t1400.sm_90.cubin",
        "kernels/whisper-b8-t1400.ptx",
    ):
        assert name in bundle.manifest.artifacts, name
    weights = whisper_weights.load(out / "models" / "whisper_tiny_en.whisper.npz")
    theirs = whisper_weights.read_ct2(out / "models" / "whisper_tiny_en" / "model.bin")
    assert weights.keys() == {k for k, v in theirs.items() if v.ndim and not k.startswith("decoder/alignment")}
    np.testing.assert_array_equal(weights["encoder/conv1/weight"], theirs["encoder/conv1/weight"].astype(np.float32))
    converted = out / "models" / "whisper_tiny_en.whisper.npz"
    converted.write_bytes(converted.read_bytes()[:-1] + bytes([converted.read_bytes()[-1] ^ 1]))
    result = cli("firmware", "verify", out, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode != 0 and "whisper_tiny_en.whisper.npz" in result.stderr


class StandInCupy:
    """CuPy as speech_choice.py uses it, over NumPy: one device whose memory reading the test sets, and
    RawModule loading the kernels' NumPy stand-ins with the baked values the firmware's binary holds
    (read from its PTX: a cubin baked for another batch would be refused)."""

    def __init__(self) -> None:
        self.free, self.total = 60 << 30, 80 << 30
        self.loaded: list[str] = []
        runtime = SimpleNamespace(getDeviceCount=lambda: 1, memGetInfo=lambda: (self.free, self.total))
        self.cuda = SimpleNamespace(runtime=runtime, memory=SimpleNamespace(OutOfMemoryError=MemoryError))

    def __getattr__(self, name: str) -> Any:
        return getattr(np, name)

    def RawModule(self, path: str) -> Kernels:  # noqa: N802 - CuPy's name
        self.loaded.append(Path(path).name)
        ptx = Path(path).with_suffix("").with_suffix(".ptx").read_text()
        pattern = r"\.u32 baked_(max_batch|shard_tokens) = (\d+);"
        baked = dict(re.findall(pattern, ptx))
        return Kernels(int(baked["max_batch"]), int(baked["shard_tokens"]))


@needs_nvcc
def test_auto_chooses_the_boxs_own_whisper_where_cupy_finds_a_device_and_the_firmware_has_its_cuda_target(
    keys: Keys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """With a device: the own engine on the firmware's converted weights in float16 and its kernels,
    CTranslate2 on the CPU behind it above the baked memory threshold. Not chosen where the firmware
    has no `cuda` target (the reason logged), nor with engine.device = cpu."""
    cupy = StandInCupy()
    monkeypatch.setitem(sys.modules, "cupy", cupy)
    bundle = firmware.verify(tiny_en_firmware(keys, tmp_path / "cuda"), keys.trusted)
    spec = next(m for m in bundle.manifest.models if m.name == "whisper_tiny_en")
    engine = load_speech_engine("auto", bundle, spec, 1, 5, 1400 * 320)
    assert isinstance(engine, SpeechCpuFallback) and isinstance(engine.cpu, WhisperEngine)
    gpu = engine.gpu
    assert isinstance(gpu, ArrayWhisperEngine) and gpu.name == engine.name == "whisper-cupy"
    assert isinstance(gpu.model.ops, KernelOps) and cupy.loaded == ["whisper-b8-t1400.sm_90.cubin"]
    assert gpu.model.w["encoder/conv1/weight"].dtype == np.float16
    assert engine.threshold == bundle.manifest.baked.fallback_cpu_threshold
    assert engine.engine_now() is gpu
    cupy.free = int(cupy.total * (1 - engine.threshold)) - 1  # GPU memory past the threshold: the CPU
    assert engine.engine_now() is engine.cpu and engine.fallbacks["memory_pressure"] == 1
    assert isinstance(load_speech_engine("cpu", bundle, spec, 1, 5, 1400 * 320), WhisperEngine)
    cpu_only = firmware.verify(tiny_en_firmware(keys, tmp_path / "cpu", '["cpu"]'), keys.trusted)
    with caplog.at_level(logging.INFO, logger="appliance"):
        engine = load_speech_engine("auto", cpu_only, spec, 1, 5, 1400 * 320)
    assert isinstance(engine, WhisperEngine) and engine.name == "ctranslate2-cpu"
    assert "the firmware has no cuda target for model whisper_tiny_en" in caplog.text
