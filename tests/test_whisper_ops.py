"""KernelOps's launch code (engine/whisper_ops.py) on the CPU: kernels/whisper.cu's layer_norm, bias_gelu
and decode_attention written again in NumPy from the .cu (flat buffers, its index arithmetic, its grid,
contiguous memory required), behind a stand-in for CuPy's RawModule. The box's own Whisper through them
decodes what it decodes through the array module's own operations, and a cubin baked with other values
is refused. The kernels themselves run on a GPU in tests/gpu/whisper_kernels.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import Keys
from speech import say
from test_whisper_batching import FRAMES
from test_whisper_reference import ENGLISH, model_dir

from appliance.engine import whisper_weights
from appliance.engine.whisper_batch import DecodeBatch, Sequence
from appliance.engine.whisper_features import log_mel, mel_filters
from appliance.engine.whisper_model import WhisperModel
from appliance.engine.whisper_ops import ENCODER_POSITIONS, HEAD_DIMS, KernelOps, erf
from appliance.engine.whisper_rules import Rules
from appliance.engine.whisper_tokens import WhisperTokens
from appliance.errors import ApplianceError

MAX_BATCH, SHARD_TOKENS = 8, 1500


def flat(array: np.ndarray) -> np.ndarray:
    """The buffer a kernel reads: the array's memory, which must be contiguous (a copy would be lost)."""
    assert array.flags.c_contiguous, "a kernel argument that is not contiguous"
    return array.reshape(-1)


class Kernels:
    """kernels/whisper.cu's kernels as NumPy, launched as CuPy launches a RawModule's: (grid, block, args)."""

    def __init__(self, max_batch: int = MAX_BATCH, shard_tokens: int = SHARD_TOKENS) -> None:
        self.baked = (max_batch, shard_tokens)
        self.launches: list[str] = []

    def get_function(self, name: str) -> Any:
        def launch(grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...]) -> None:
            self.launches.append(name)
            getattr(self, name)(grid, block, *args)

        return launch

    def appliance_baked(self, grid: tuple[int, ...], block: tuple[int, ...], out: np.ndarray) -> None:
        flat(out)[:2] = self.baked

    def layer_norm(self, grid, block, x, gamma, beta, out, width) -> None:  # type: ignore[no-untyped-def]
        rows = flat(x)[: grid[0] * width].reshape(grid[0], width).astype(np.float32)  # one block per row
        mean = rows.mean(axis=1, keepdims=True)
        scale = 1 / np.sqrt(((rows - mean) ** 2).mean(axis=1, keepdims=True) + 1e-5)
        flat(out)[: grid[0] * width] = ((rows - mean) * scale * gamma + beta).reshape(-1)

    def bias_gelu(self, grid, block, x, bias, rows, width) -> None:  # type: ignore[no-untyped-def]
        i = np.arange(min(grid[0] * block[0], rows * width))  # one thread per element
        v = flat(x)[i].astype(np.float32) + flat(bias)[i % width]
        flat(x)[i] = 0.5 * v * (1.0 + erf(np, v * 0.70710678))

    def decode_attention(self, grid, block, q, keys, values, lengths, out, heads, positions) -> None:  # type: ignore[no-untyped-def]
        for at in range(grid[0]):  # one block per (row, head)
            row, head = divmod(at, heads)
            if row >= self.baked[0]:
                continue
            length = min(int(flat(lengths)[row]), positions, ENCODER_POSITIONS)
            base = (row * heads + head) * positions * HEAD_DIMS
            k = flat(keys)[base : base + length * HEAD_DIMS].reshape(length, HEAD_DIMS).astype(np.float32)
            v = flat(values)[base : base + length * HEAD_DIMS].reshape(length, HEAD_DIMS).astype(np.float32)
            query = flat(q)[(row * heads + head) * HEAD_DIMS :][:HEAD_DIMS].astype(np.float32) * 0.125
            scores = k @ query
            e = np.exp(scores - scores.max())
            flat(out)[(row * heads + head) * HEAD_DIMS :][:HEAD_DIMS] = (e @ v) / e.sum()


@pytest.fixture(scope="module")
def tiny(voice_bundle: Path, keys: Keys, tmp_path_factory: pytest.TempPathFactory):
    directory = model_dir(voice_bundle, keys, "whisper_tiny_en")
    converted = tmp_path_factory.mktemp("tiny") / "whisper.npz"
    whisper_weights.convert(directory, converted)
    tokens = WhisperTokens(directory / "tokenizer.json", False, [])
    return whisper_weights.load(converted), tokens, Rules.of(directory, tokens.eot, tokens.no_timestamps)


def decoded(model: WhisperModel, tokens: WhisperTokens, rules: Rules) -> tuple[list[list[int]], np.ndarray]:
    """Three sentences decoded together, greedily, and the encoder's output."""
    features = log_mel([say(s) for s in ENGLISH[:3]], mel_filters(model.n_mels))[:, :, :FRAMES]
    encoded = model.encode(features)
    batch = DecodeBatch(model, rules, MAX_BATCH, tokens.sot, None, frames=FRAMES // 2)
    cross = model.cross(encoded)
    for at in range(3):
        batch.join(Sequence(tokens.prompt("transcribe", "en", ())), cross, at)
    done = []
    while batch.rows:
        done += batch.step()
    return [s.chosen for s in done], np.asarray(encoded)


def test_the_kernels_launch_code_decodes_what_the_array_operations_decode(tiny) -> None:
    weights, tokens, rules = tiny
    kernels = Kernels()
    ours = WhisperModel(weights, ops=KernelOps(np, kernels, MAX_BATCH, SHARD_TOKENS, np.float32))
    theirs = WhisperModel(weights)
    (fused, fused_encoded), (plain, plain_encoded) = decoded(ours, tokens, rules), decoded(theirs, tokens, rules)
    assert {"layer_norm", "bias_gelu", "decode_attention"} <= set(kernels.launches)
    np.testing.assert_allclose(fused_encoded, plain_encoded, atol=2e-3)
    assert sorted(fused) == sorted(plain) and all(len(ids) > 3 for ids in fused)


def test_arrays_the_kernels_cannot_read_go_to_the_array_operations(tiny) -> None:
    """float32 arrays where the kernels read float16, or a cache of other heads: never launched."""
    kernels = Kernels()
    ops = KernelOps(np, kernels, MAX_BATCH, SHARD_TOKENS)
    x = np.ones((2, 64), np.float32)
    assert ops.layer_norm(x, np.ones(64, np.float32), np.zeros(64, np.float32)).shape == (2, 64)
    q, cache = np.zeros((2, 6, 1, 64), np.float16), np.zeros((8, 4, 448, 64), np.float16)
    assert ops.decode_attention(q, cache, cache, np.ones(2, np.int32)) is None
    assert kernels.launches == ["appliance_baked"]


def test_a_cubin_baked_with_other_values_is_refused(tiny) -> None:
    with pytest.raises(ApplianceError, match=r"baked with max_batch, shard tokens = \[16, 1500\]"):
        KernelOps(np, Kernels(max_batch=16), MAX_BATCH, SHARD_TOKENS)
