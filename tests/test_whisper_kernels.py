"""The box's own Whisper for the GPU, checked where no GPU is: kernels/whisper.cu compiled by nvcc
for sm_90 with the model's baked batch and shard length in the binary, and the `cuda` firmware target
converting a Whisper's CTranslate2 weights into a signed artifact. The kernels run in tests/gpu/run.sh
on a GPU machine."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
from conftest import ROOT, Keys, build_bundle, cli
from test_kernels import needs_nvcc

from appliance import firmware
from appliance.engine import whisper_weights

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


@needs_nvcc
def test_cuda_firmware_carries_a_whispers_converted_weights_signed(keys: Keys, tmp_path: Path) -> None:
    voice = (ROOT / "firmware" / "voice.toml").read_text()
    tiny_only = voice[: voice.index("# Whisper base")].replace('targets = ["cpu"]', 'targets = ["cpu", "cuda"]')
    copy = tmp_path / "voice-cuda.toml"
    copy.write_text(tiny_only.replace(', languages_by = "whisper_base"', ""))
    out = build_bundle(keys, tmp_path / "voice-cuda", copy)
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
