"""The steps of Whisper's forward pass that kernels/whisper.cu fuses, behind one small interface that
WhisperModel calls: `ArrayOps`, the array module's own operations (NumPy: the reference; CuPy where the
firmware has no kernels for the model), and `KernelOps`, the firmware's cubin launched with CuPy (layer
norm, the MLP's bias and GELU after cuBLAS's GEMM, a decoder step's attention, and the greedy choice
under the logit rules, so a step's logits stay on the device). GEMMs stay the array module's (cuBLAS).
Tested on the CPU through the same launch code with NumPy stand-ins of the kernels (tests/test_whisper_ops.py); tests/gpu/whisper_kernels.py runs the real ones against NumPy.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from appliance.engine.whisper_rules import MAX_INITIAL_TIMESTAMP_INDEX, Rules
from appliance.errors import ApplianceError

THREADS = 256  # each kernel's block (kernels/whisper.cu's THREADS)
HEAD_DIMS = 64  # every Whisper size
ENCODER_POSITIONS = 1500  # what a 30 s window's encoder gives, and the kernel's attention holds at most
MAX_POSITIONS = 448  # the decoder's context (kernels/whisper.cu's: a row of the tokens chosen)


def erf(xp: Any, x: Any) -> Any:
    """Abramowitz and Stegun 7.1.26 (|error| < 1.5e-7): NumPy has no erf, and one formula serves both
    array modules."""
    sign = xp.sign(x)
    a = xp.abs(x)
    t = 1.0 / (1.0 + ERF_P * a)
    poly = t * (ERF_A[0] + t * (ERF_A[1] + t * (ERF_A[2] + t * (ERF_A[3] + t * ERF_A[4]))))
    return sign * (1.0 - poly * xp.exp(-a * a))


ERF_P, ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def gelu(xp: Any, x: Any) -> Any:
    return 0.5 * x * (1.0 + erf(xp, x * 0.7071067811865476))


def layer_norm(xp: Any, x: Any, gamma: Any, beta: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(var + 1e-5) * gamma + beta


def to_host(xp: Any, array: Any) -> np.ndarray:
    """An array of the model's module as a NumPy one (CuPy's asnumpy copies it from the device)."""
    return np.asarray(xp.asnumpy(array) if hasattr(xp, "asnumpy") else array)


def softmax(xp: Any, x: Any, axis: int = -1) -> Any:
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def baked_shape(parameters: Mapping[str, object]) -> tuple[int, int]:
    """What a Whisper's kernels are built with: its decode batch's rows (max_batch) and a shard's encoder
    positions (max_tokens_per_shard, a window's at most)."""
    tokens = min(int(str(parameters["max_tokens_per_shard"])), ENCODER_POSITIONS)
    return int(str(parameters["max_batch"])), tokens


def kernel_files(max_batch: int, shard_tokens: int, arch: str = "sm_90") -> tuple[str, str]:
    """The firmware's cubin for `arch` and PTX of kernels/whisper.cu built with those values."""
    stem = f"kernels/whisper-b{max_batch}-t{shard_tokens}"
    return f"{stem}.{arch}.cubin", f"{stem}.ptx"


class ArrayOps:
    """The array module's own operations."""

    def __init__(self, xp: Any) -> None:
        self.xp = xp

    def layer_norm(self, x: Any, gamma: Any, beta: Any) -> Any:
        return layer_norm(self.xp, x, gamma, beta)

    def linear_gelu(self, x: Any, weight: Any, bias: Any) -> Any:
        """GELU(x W^T + b): the MLP's first layer."""
        return gelu(self.xp, x @ weight.T + bias)

    def decode_attention(self, q: Any, keys: Any, values: Any, lengths: Any) -> Any | None:
        """A decoder step's attention fused ([n, heads, 1, 64] queries against the first `lengths` of
        each row's [heads, positions, 64] keys and values), or None: the model attends by itself."""
        return None

    chooses = False  # whether `greedy` chooses (else the caller need not gather what it reads)

    def greedy(
        self, logits: Any, rows: list[int], histories: np.ndarray, counts: np.ndarray, rules: Rules
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """The greedy choice under the logit rules with timestamps (whisper_rules.py) of `rows` of a
        step's `logits` [n, vocabulary], made where the logits are: (tokens, log probabilities) as NumPy
        arrays; `histories` [len(rows), MAX_POSITIONS] the tokens each chose, `counts` how many. None:
        the caller brings the logits to the host and applies the rules there."""
        return None


Launch = Callable[[tuple[int, ...], tuple[int, ...], tuple[Any, ...]], None]


class KernelOps(ArrayOps):
    """kernels/whisper.cu's kernels from the firmware's cubin (`module`: a CuPy RawModule, or anything
    with its get_function), on float16 arrays. The cubin must say it was baked with the manifest's
    max_batch and shard length, else it is not used."""

    chooses = True

    def __init__(self, xp: Any, module: Any, max_batch: int, shard_tokens: int, dtype: Any = None) -> None:
        """`dtype`: what the kernels read (float16; a test's stand-ins read float32)."""
        super().__init__(xp)
        self.max_batch, self.dtype = max_batch, dtype or xp.float16
        run: Callable[[str], Launch] = module.get_function
        baked = xp.zeros(2, xp.int32)
        run("appliance_baked")((1,), (1,), (baked,))
        found = [int(v) for v in to_host(xp, baked)]
        if found != [max_batch, shard_tokens]:
            raise ApplianceError(
                f"kernels/whisper.cu: the cubin was baked with max_batch, shard tokens = {found}, "
                f"the manifest says {[max_batch, shard_tokens]}"
            )
        self._layer_norm, self._bias_gelu = run("layer_norm"), run("bias_gelu")
        self._attention, self._greedy = run("decode_attention"), run("greedy_with_rules")
        self._suppress: tuple[Rules, Any, Any] | None = None  # the rules' token lists, on the device

    def _half(self, *arrays: Any) -> bool:
        """Whether every array is of the kernels' dtype (anything else goes to ArrayOps)."""
        return all(a.dtype == self.dtype for a in arrays)

    def layer_norm(self, x: Any, gamma: Any, beta: Any) -> Any:
        if not self._half(x, gamma, beta):
            return super().layer_norm(x, gamma, beta)
        x = self.xp.ascontiguousarray(x)
        out = self.xp.empty_like(x)
        width = x.shape[-1]
        self._layer_norm((x.size // width,), (THREADS,), (x, gamma, beta, out, np.int32(width)))
        return out

    def linear_gelu(self, x: Any, weight: Any, bias: Any) -> Any:
        if not self._half(x, weight, bias):
            return super().linear_gelu(x, weight, bias)
        y = self.xp.ascontiguousarray(x @ weight.T)  # cuBLAS; the bias and GELU in one pass after it
        width = y.shape[-1]
        blocks = (y.size + THREADS - 1) // THREADS
        self._bias_gelu((blocks,), (THREADS,), (y, bias, np.int32(y.size // width), np.int32(width)))
        return y

    def decode_attention(self, q: Any, keys: Any, values: Any, lengths: Any) -> Any | None:
        n, heads = q.shape[0], q.shape[1]
        fits = n <= self.max_batch and len(lengths) >= n and keys.shape[0] >= n and values.shape == keys.shape
        fits = fits and keys.shape[1] == heads and keys.shape[3] == q.shape[-1] == HEAD_DIMS
        fits = fits and keys.shape[2] <= ENCODER_POSITIONS and self._half(q, keys, values)
        if not (fits and keys.flags.c_contiguous and values.flags.c_contiguous):  # it steps by rows of the cache
            return None
        xp = self.xp
        queries = xp.ascontiguousarray(q.reshape(n, heads, HEAD_DIMS))
        out = xp.empty((n, heads, HEAD_DIMS), queries.dtype)
        rows = xp.ascontiguousarray(lengths.astype(xp.int32))
        args = (queries, keys, values, rows, out, np.int32(heads), np.int32(keys.shape[2]))
        self._attention((n * heads,), (THREADS,), args)
        return out.reshape(n, 1, heads * HEAD_DIMS)

    def greedy(
        self, logits: Any, rows: list[int], histories: np.ndarray, counts: np.ndarray, rules: Rules
    ) -> tuple[np.ndarray, np.ndarray] | None:
        n, vocabulary = len(rows), logits.shape[-1]
        if n > self.max_batch or histories.shape != (n, MAX_POSITIONS) or vocabulary <= rules.timestamp_begin:
            return None
        xp = self.xp
        if self._suppress is None or self._suppress[0] is not rules:
            lists = (xp.asarray(ids.astype(np.int32)) for ids in (rules.suppress, rules.suppress_begin))
            self._suppress = (rules, *lists)
        _, suppress, begin = self._suppress
        x = xp.ascontiguousarray(logits[xp.asarray(rows)].astype(xp.float32))  # masked in place
        tokens, logprobs = xp.empty(n, xp.int32), xp.empty(n, xp.float32)
        args = (
            x,
            xp.asarray(histories.astype(np.int32)),
            xp.asarray(counts.astype(np.int32)),
            suppress,
            np.int32(len(suppress)),
            begin,
            np.int32(len(begin)),
            np.int32(vocabulary),
            np.int32(rules.eot),
            np.int32(rules.no_timestamps),
            np.int32(MAX_INITIAL_TIMESTAMP_INDEX),
            tokens,
            logprobs,
        )
        self._greedy((n,), (THREADS,), args)
        return to_host(xp, tokens), to_host(xp, logprobs)
