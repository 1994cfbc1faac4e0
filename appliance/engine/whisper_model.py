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

from appliance.engine.whisper_ops import MAX_POSITIONS, ArrayOps, gelu, softmax


class WhisperModel:
    """The weights on the array module, and the two passes."""

    def __init__(
        self, weights: Mapping[str, np.ndarray], xp: Any = np, dtype: Any = np.float32, ops: ArrayOps | None = None
    ) -> None:
        """`ops`: the fused steps (whisper_ops.py: the firmware's kernels on the GPU); the array module's own
        operations where None."""
        self.xp, self.dtype = xp, dtype
        self.ops = ops or ArrayOps(xp)
        on_device: dict[int, Any] = {}  # an array shared by two names (the projection is the embedding) goes once
        for value in weights.values():
            if id(value) not in on_device:
                on_device[id(value)] = xp.asarray(value, dtype=dtype)
        self.w = {name: on_device[id(value)] for name, value in weights.items()}
        self.heads = _heads(weights)
        self.encoder_layers = _count(weights, "encoder/layer_")
        self.decoder_layers = _count(weights, "decoder/layer_")
        self.dims = int(weights["decoder/embeddings/weight"].shape[1])
        self.vocabulary = int(weights["decoder/embeddings/weight"].shape[0])
        self.n_mels = int(weights["encoder/conv1/weight"].shape[1])

    def _linear(self, x: Any, name: str) -> Any:
        return x @ self.w[f"{name}/weight"].T + self.w[f"{name}/bias"]

    def _norm(self, x: Any, name: str) -> Any:
        return self.ops.layer_norm(x, self.w[f"{name}/gamma"], self.w[f"{name}/beta"])

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
        first = f"{at}/linear_0"
        hidden = self.ops.linear_gelu(
            self._norm(x, f"{at}/layer_norm"), self.w[f"{first}/weight"], self.w[f"{first}/bias"]
        )
        return self._linear(hidden, f"{at}/linear_1")

    def _decode_attend(self, q: Any, keys: Any, values: Any, lengths: Any, kept: list[Any] | None = None) -> Any:
        """A decoder step's attention: rows 0..n-1 of `q` [n, heads, 1, dh] against the first `lengths`
        positions of their rows of the cache's `keys` and `values` [capacity, heads, positions, dh]; fused
        where the ops have it (not where the attention weights are kept: word timestamps)."""
        fused = self.ops.decode_attention(q, keys, values, lengths) if kept is None else None
        if fused is not None:
            return fused
        n, length = len(q), int(lengths.max())
        mask = (self.xp.arange(length)[None, :] < lengths[:, None])[:, None, None, :]  # [n, 1, 1, T]
        if bool(mask.all()):  # every row reads every position (cross-attention): no masking pass
            mask = None
        return self._attend(q, keys[:n, :, :length], values[:n, :, :length], mask, kept)

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
        own_lengths = positions + 1  # each row attends to its tokens so far
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
            heard = self._decode_attend(self._split(q), keys, values, own_lengths)
            x = x + self._linear(heard, f"{at}/self_attention/linear_1")
            q = self._linear(self._norm(x, f"{at}/attention/layer_norm"), f"{at}/attention/linear_0")
            cross_k, cross_v = cache.cross[i]
            whole = xp.full(n, cross_k.shape[2], dtype=positions.dtype)  # every encoder position
            heard = self._decode_attend(self._split(q), cross_k, cross_v, whole, cross_weights)
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
