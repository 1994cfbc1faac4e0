"""GPU binaries for a firmware's `cuda` target, made at build time: kernels/ compiled by nvcc
with the baked shard parameters as -D macros, and the model's weights laid out for them.

The build machine needs nvcc (the CUDA toolkit), not a GPU. The cubin is for the box's card
(H100: sm_90); the PTX lets a newer driver JIT the same kernels for a later GPU.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np

from appliance.engine import reference
from appliance.engine.whisper_ops import kernel_files
from appliance.errors import ApplianceError
from appliance.firmware.manifest import AudioSpec, Baked

KERNELS = Path(__file__).resolve().parents[2] / "kernels"
SOURCE = KERNELS / "silero_vad.cu"
WHISPER_SOURCE = KERNELS / "whisper.cu"
ARCH = "sm_90"
NVCC_FALLBACK = Path("/usr/local/cuda/bin/nvcc")


def find_nvcc() -> str:
    """$NVCC where set (as $CC for C), else nvcc on PATH or in /usr/local/cuda."""
    if "NVCC" in os.environ:
        nvcc = shutil.which(os.environ["NVCC"])
    else:
        nvcc = shutil.which("nvcc") or (str(NVCC_FALLBACK) if NVCC_FALLBACK.exists() else None)
    if nvcc is None:
        raise ApplianceError(
            "firmware target 'cuda' needs nvcc (the CUDA toolkit) on the build machine: "
            'install it, or build with targets = ["cpu"]'
        )
    return nvcc


def baked_defines(baked: Baked, audio: AudioSpec) -> list[str]:
    return [
        f"-DMAX_BATCH={baked.max_batch}",
        f"-DSHARD_FRAMES={baked.max_tokens_per_shard}",
        f"-DFRAME_SAMPLES={audio.frame_samples}",
        f"-DCONTEXT_SAMPLES={audio.context_samples}",
    ]


def compile_vad_kernels(baked: Baked, audio: AudioSpec, out_dir: Path, arch: str = ARCH) -> list[Path]:
    """nvcc the VAD kernels into `out_dir`: a cubin for `arch` and PTX; return both paths."""
    return compile_kernels(SOURCE, baked_defines(baked, audio), out_dir, arch)


def compile_whisper_kernels(max_batch: int, shard_tokens: int, out_dir: Path, arch: str = ARCH) -> list[Path]:
    """nvcc kernels/whisper.cu with the model's baked batch (its decode batch's rows) and shard
    length (encoder positions), into `out_dir` under the model's own names."""
    defines = [f"-DMAX_BATCH={max_batch}", f"-DSHARD_TOKENS={shard_tokens}"]
    stem = Path(kernel_files(max_batch, shard_tokens, arch)[1]).stem  # the names the engine looks for
    return compile_kernels(WHISPER_SOURCE, defines, out_dir, arch, stem)


def compile_kernels(source: Path, defines: list[str], out_dir: Path, arch: str = ARCH, stem: str = "") -> list[Path]:
    """nvcc `source` with `defines` into `out_dir`: a cubin for `arch` and PTX; return both paths."""
    nvcc = find_nvcc()
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = stem or source.stem
    cubin, ptx = out_dir / f"{stem}.{arch}.cubin", out_dir / f"{stem}.ptx"
    for output, kind in ((cubin, ["-cubin", f"-arch={arch}"]), (ptx, ["-ptx", f"-arch=compute_{arch[3:]}"])):
        result = subprocess.run(
            [nvcc, *kind, "-O3", *defines, "-o", str(output), str(source)], capture_output=True, text=True
        )
        if result.returncode != 0:
            raise ApplianceError(f"nvcc failed on {source.name} for {arch}: {result.stderr.strip()[-2000:]}")
    return [cubin, ptx]


def cuda_weights(model_path: Path) -> dict[str, np.ndarray]:
    """The weights in the layouts kernels/silero_vad.cu reads: every matrix input-major."""
    w = reference.load_weights(model_path)
    out = {"stft_basis": w[reference.BASIS].transpose(1, 2, 0)}  # [1][256][258]
    for i, (weight, bias, _) in enumerate(reference.ENCODER):
        out[f"encoder{i}_weight"] = w[weight].transpose(1, 2, 0)  # [C_in][K][C_out]
        out[f"encoder{i}_bias"] = w[bias]
    w_ih, w_hh, b_ih, b_hh = (w[n] for n in reference.LSTM)
    out["lstm_weight_ih_t"], out["lstm_weight_hh_t"], out["lstm_bias"] = w_ih.T, w_hh.T, b_ih + b_hh
    out["decoder_weight"], out["decoder_bias"] = w[reference.DECODER[0]].reshape(-1), w[reference.DECODER[1]]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}
