"""Whisper's forward pass written once over an array module: NumPy (float32, the reference that CI
runs against CTranslate2) or CuPy (float16 on the GPU, GEMMs through cuBLAS), by the same code.

    encoder: log-mel [B, n_mels, 3000] -> conv(k3) GELU -> conv(k3, stride 2) GELU -> + positions
             -> pre-norm blocks (self-attention, MLP) -> layer norm -> [B, 1500, d]
    decoder: token embedding + position -> pre-norm blocks (causal self-attention on a KV cache,
             cross-attention on the encoder's keys and values, MLP) -> layer norm -> logits (the
             embedding transposed)

The KV cache (`KvCache`) holds `capacity` rows; the rows decoding are always 0..n-1 (a row that
leaves is filled by the last one: rows.py keeps the bookkeeping), so a step reads slices, never
gathers. Weight names are CTranslate2's (whisper_weights.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

MAX_POSITIONS = 448  # the decoder's context
ERF_P, ERF_A = 0.3275911, (0.254829592, -0.284496736, 1.421413741, -1.453152027, 1.061405429)


def erf(xp: Any, x: Any) -> Any:
    """Abramowitz and Stegun 7.1.26 (error under 1.5e-7): the array module need not have one."""
    t = 1.0 / (1.0 + ERF_P * xp.abs(x))
    a1, a2, a3, a4, a5 = ERF_A
    y = 1.0 - ((((a5 * t + a4) * t + a3) * t + a2) * t + a1) * t * xp.exp(-x * x)
    return xp.sign(x) * y


def gelu(xp: Any, x: Any) -> Any:
    return 0.5 * x * (1.0 + erf(xp, x * np.float32(1 / np.sqrt(2))))


def layer_norm(xp: Any, x: Any, gamma: Any, beta: Any) -> Any:
    mean = x.mean(axis=-1, keepdims=True)
    var = ((x - mean) ** 2).mean(axis=-1, keepdims=True)
    return (x - mean) / xp.sqrt(var + 1e-5) * gamma + beta


def softmax(xp: Any, x: Any, axis: int = -1) -> Any:
    e = xp.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


class WhisperModel:
    """The weights on the array module, and the two passes."""

    def __init__(self, weights: Mapping[str, np.ndarray], xp: Any = np, dtype: Any = np.float32) -> None:
        self.xp, self.dtype = xp, dtype
        self.w = {name: xp.asarray(value, dtype=dtype) for name, value in weights.items()}
        self.heads = _heads(weights)
        self.encoder_layers = _count(weights, "encoder/layer_")
        self.decoder_layers = _count(weights, "decoder/layer_")
        self.dims = int(weights["decoder/embeddings/weight"].shape[1])
        self.vocabulary = int(weights["decoder/embeddings/weight"].shape[0])
        self.n_mels = int(weights["encoder/conv1/weight"].shape[1])

    def _linear(self, x: Any, name: str) -> Any:
        return x @ self.w[f"{name}/weight"].T + self.w[f"{name}/bias"]

    def _norm(self, x: Any, name: str) -> Any:
        return layer_norm(self.xp, x, self.w[f"{name}/gamma"], self.w[f"{name}/beta"])

    def _split(self, x: Any) -> Any:
        """[B, T, d] -> [B, heads, T, d / heads]."""
        b, t, _ = x.shape
        return x.reshape(b, t, self.heads, -1).transpose(0, 2, 1, 3)

    def _attend(self, q: Any, k: Any, v: Any, mask: Any = None, kept: list[Any] | None = None) -> Any:
        """Scaled dot-product attention, heads joined back: [B, H, Tq, dh] -> [B, Tq, d]; the
        attention weights [B, H, Tq, Tk] appended to `kept` where given."""
        scores = (q @ k.transpose(0, 1, 3, 2)) * self.dtype(1 / np.sqrt(q.shape[-1]))
        if mask is not None:
            scores = self.xp.where(mask, scores, self.dtype(-np.inf))
        weights = softmax(self.xp, scores.astype(self.xp.float32))
        if kept is not None:
            kept.append(weights)
        out = weights.astype(self.dtype) @ v
        b, _, t, _ = out.shape
        return out.transpose(0, 2, 1, 3).reshape(b, t, -1)

    def _conv(self, x: Any, name: str, stride: int) -> Any:
        """Kernel 3, padding 1: x [B, C, T] -> [B, O, T / stride] as one GEMM over the three taps."""
        xp, w = self.xp, self.w[f"{name}/weight"]
        padded = xp.pad(x, ((0, 0), (0, 0), (1, 1)))
        steps = (x.shape[2] + stride - 1) // stride
        taps = xp.stack([padded[:, :, k : k + stride * steps : stride] for k in range(3)], axis=2)
        columns = taps.reshape(x.shape[0], -1, steps)  # [B, C * 3, T']
        return w.reshape(w.shape[0], -1) @ columns + self.w[f"{name}/bias"][:, None]

    def encode(self, mel: np.ndarray) -> Any:
        """Log-mel features [B, n_mels, 3000] -> the encoder's output [B, 1500, d]."""
        xp = self.xp
        x = gelu(xp, self._conv(xp.asarray(mel, dtype=self.dtype), "encoder/conv1", 1))
        x = gelu(xp, self._conv(x, "encoder/conv2", 2)).transpose(0, 2, 1)
        x = x + self.w["encoder/position_encodings/encodings"][: x.shape[1]]
        for i in range(self.encoder_layers):
            at = f"encoder/layer_{i}"
            q, k, v = xp.split(
                self._linear(self._norm(x, f"{at}/self_attention/layer_norm"), f"{at}/self_attention/linear_0"),
                3,
                axis=-1,
            )
            x = x + self._linear(
                self._attend(self._split(q), self._split(k), self._split(v)), f"{at}/self_attention/linear_1"
            )
            x = x + self._mlp(x, f"{at}/ffn")
        return self._norm(x, "encoder/layer_norm")

    def _mlp(self, x: Any, at: str) -> Any:
        return self._linear(
            gelu(self.xp, self._linear(self._norm(x, f"{at}/layer_norm"), f"{at}/linear_0")), f"{at}/linear_1"
        )

    def cross(self, encoded: Any) -> list[tuple[Any, Any]]:
        """Each decoder layer's cross-attention keys and values of an encoder output [B, 1500, d]."""
        out = []
        for i in range(self.decoder_layers):
            k, v = self.xp.split(self._linear(encoded, f"decoder/layer_{i}/attention/linear_1"), 2, axis=-1)
            out.append((self._split(k), self._split(v)))
        return out

    def step(self, cache: KvCache, tokens: Any, positions: Any, cross_weights: list[Any] | None = None) -> Any:
        """One decoder step for rows 0..n-1 of `cache`: each row's token [n] at its position [n] in,
        its logits [n, vocabulary] (float32) out; the keys and values of the tokens stay in the cache.
        `cross_weights`: each layer's cross-attention weights [n, heads, 1, frames] appended to it."""
        xp, n = self.xp, len(tokens)
        x = (self.w["decoder/embeddings/weight"][tokens] + self.w["decoder/position_encodings/encodings"][positions])[
            :, None
        ]
        length = int(positions.max()) + 1
        mask = (xp.arange(length)[None, :] <= positions[:, None])[:, None, None, :]  # [n, 1, 1, T]
        rows = xp.arange(n)
        for i in range(self.decoder_layers):
            at = f"decoder/layer_{i}"
            q, k, v = xp.split(
                self._linear(self._norm(x, f"{at}/self_attention/layer_norm"), f"{at}/self_attention/linear_0"),
                3,
                axis=-1,
            )
            keys, values = cache.own[i]
            keys[rows, :, positions] = self._split(k)[:, :, 0]
            values[rows, :, positions] = self._split(v)[:, :, 0]
            heard = self._attend(self._split(q), keys[:n, :, :length], values[:n, :, :length], mask)
            x = x + self._linear(heard, f"{at}/self_attention/linear_1")
            q = self._linear(self._norm(x, f"{at}/attention/layer_norm"), f"{at}/attention/linear_0")
            cross_k, cross_v = cache.cross[i]
            heard = self._attend(self._split(q), cross_k[:n], cross_v[:n], kept=cross_weights)
            x = x + self._linear(heard, f"{at}/attention/linear_2")
            x = x + self._mlp(x, f"{at}/ffn")
        x = self._norm(x[:, 0], "decoder/layer_norm")
        return (x @ self.w["decoder/embeddings/weight"].T).astype(xp.float32)


class KvCache:
    """Keys and values of `capacity` decoding rows: their own tokens' (self-attention) and their
    encoder output's (cross-attention), per decoder layer."""

    def __init__(self, model: WhisperModel, capacity: int, frames: int = 1500) -> None:
        xp, heads, head_dims = model.xp, model.heads, model.dims // model.heads
        own = (capacity, heads, MAX_POSITIONS, head_dims)
        other = (capacity, heads, frames, head_dims)
        zeros = xp.zeros
        self.own = [(zeros(own, model.dtype), zeros(own, model.dtype)) for _ in range(model.decoder_layers)]
        self.cross = [(zeros(other, model.dtype), zeros(other, model.dtype)) for _ in range(model.decoder_layers)]

    def put(self, row: int, cross: list[tuple[Any, Any]], at: int) -> None:
        """Row `row` takes item `at` of a batch's cross-attention keys and values (a new sequence)."""
        for (k, v), (new_k, new_v) in zip(self.cross, cross):
            k[row], v[row] = new_k[at], new_v[at]

    def reorder(self, rows: list[int], sources: list[int]) -> None:
        """Rows `rows` take the own keys and values of rows `sources` (beams following their parents)."""
        for k, v in self.own:
            k[rows], v[rows] = k[sources], v[sources]

    def move(self, source: int, target: int) -> None:
        """Row `source` becomes row `target` (the last row fills the place of one that left)."""
        for k, v in (*self.own, *self.cross):
            k[target], v[target] = k[source], v[source]


def _count(weights: Mapping[str, np.ndarray], prefix: str) -> int:
    return len(
        {
            name[len(prefix) :].split("/")[0]
            for name in weights
            if name.startswith(prefix) and name[len(prefix)].isdigit()
        }
    )


def _heads(weights: Mapping[str, np.ndarray]) -> int:
    """CTranslate2 keeps the head count as a scalar; the converted file drops scalars, so the
    model's width says it (Whisper: 64 dimensions a head)."""
    return int(weights["decoder/embeddings/weight"].shape[1]) // 64
