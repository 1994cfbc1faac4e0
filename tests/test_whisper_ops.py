"""KernelOps's launch code (engine/whisper_ops.py) on the CPU: kernels/whisper.cu's layer_norm, bias_gelu,
decode_attention and greedy_with_rules written again in NumPy from the .cu (flat buffers, its index arithmetic, its grid,
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
from appliance.engine.whisper_ops import ENCODER_POSITIONS, HEAD_DIMS, MAX_POSITIONS, KernelOps, erf
from appliance.engine.whisper_rules import Rules, log_softmax
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

    def greedy_with_rules(  # type: ignore[no-untyped-def]
        self, grid, block, logits, history, counts, suppress, suppress_count, suppress_begin, begin_count,
        vocabulary, eot, no_timestamps, max_initial, tokens, logprobs,
    ) -> None:  # fmt: skip
        for row in range(grid[0]):  # one block per row
            if row >= self.baked[0]:
                continue
            x = flat(logits)[row * vocabulary : (row + 1) * vocabulary]  # masked in place
            chosen = flat(history)[row * MAX_POSITIONS :][: int(flat(counts)[row])]
            count, begin = len(chosen), no_timestamps + 1
            x[flat(suppress)[:suppress_count]] = -np.inf
            if count == 0:
                x[flat(suppress_begin)[:begin_count]] = -np.inf
            x[no_timestamps] = -np.inf
            cut_from, text_to = vocabulary, 0  # [cut_from, vocabulary) and [0, text_to) go
            if count == 0:
                text_to, cut_from = begin, begin + max_initial + 1
            else:
                last, penultimate = chosen[-1] >= begin, count < 2 or chosen[-2] >= begin
                cut_from = begin if last and penultimate else cut_from
                text_to = eot if last and not penultimate else text_to
                stamps = chosen[chosen >= begin]
                if len(stamps) and cut_from > begin:  # never back in time; a piece is never empty
                    x[begin : stamps[-1] + (0 if last and not penultimate else 1)] = -np.inf
            x[:text_to], x[cut_from:] = -np.inf, -np.inf
            top, text_top = x.max(), x[:begin].max()
            e = np.exp(x - top)
            total, stamped = e.sum(), e[begin:].sum()
            with np.errstate(divide="ignore"):  # no timestamp left: log(0)
                force_stamp = np.log(stamped) > text_top - top
            token = begin + int(np.argmax(x[begin:])) if force_stamp else int(np.argmax(x))
            flat(tokens)[row] = token
            flat(logprobs)[row] = x[token] - top - np.log(stamped if force_stamp else total)


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
    assert {"layer_norm", "bias_gelu", "decode_attention", "greedy_with_rules"} <= set(kernels.launches)
    np.testing.assert_allclose(fused_encoded, plain_encoded, atol=2e-3)
    assert sorted(fused) == sorted(plain) and all(len(ids) > 3 for ids in fused)


def test_the_greedy_kernel_chooses_as_the_rules_do_after_every_kind_of_history(tiny) -> None:
    """Random logits after no token, text, a timestamp that opens a piece, one that closes it, a pair,
    and text again, each with a winner the rules forbid (a timestamp back in time, a suppressed token)
    or a tie: each row's token and log probability as whisper_rules.py's rules and argmax give them."""
    _, tokens, rules = tiny
    begin, rng = rules.timestamp_begin, np.random.default_rng(7)
    histories = [
        [],
        [400, 401],
        [begin + 10, 400],
        [begin + 10, 400, begin + 30],
        [begin + 10, 400, begin + 30, begin + 30],
        [400],
    ]
    logits = rng.normal(0, 4, (len(histories), begin + 1501)).astype(np.float32)
    logits[2:5, begin + 40 : begin + 60] += 12  # timestamps likelier than text where the rules allow them
    logits[0, begin + 60] = 100  # past the first timestamp's limit (1 s in)
    logits[2, begin + 10], logits[2, begin + 5] = 100, 90  # back in time: the piece's own opening and before
    logits[3, begin + 20], logits[3, begin + 30] = 110, 100  # before the piece's opening; its closing itself
    logits[4, int(rules.suppress[0])] = 100  # never generated
    logits[5, 500] = logits[5, 600] = 100  # a tie: the lower token, as NumPy's argmax
    table = np.zeros((len(histories), MAX_POSITIONS), np.int32)
    for at, chosen in enumerate(histories):
        table[at, : len(chosen)] = chosen
    counts = np.asarray([len(h) for h in histories], np.int32)
    ops = KernelOps(np, Kernels(), MAX_BATCH, SHARD_TOKENS, np.float32)
    found = ops.greedy(logits.copy(), list(range(len(histories))), table, counts, rules)
    assert found is not None
    for at, chosen in enumerate(histories):
        masked = rules.apply(logits[at].copy(), chosen, True)
        expected = int(np.argmax(masked))
        assert int(found[0][at]) == expected, (at, chosen)
        assert abs(float(found[1][at]) - float(log_softmax(masked)[expected])) < 1e-4, (at, chosen)
    assert [int(t) - begin for t in found[0][[0, 3]]] == [int(np.argmax(logits[0, begin : begin + 51])), 30]
    assert int(found[0][5]) == 500 and int(found[0][4]) < begin


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
