"""The default VAD model's forward pass (Silero VAD v5, 16 kHz) in NumPy.

Ground truth for the CUDA kernels in kernels/ (the GPU tests compare against it) and checked in
CI against ONNX Runtime. The weights are the ONNX initializers, read by name; the steps follow
the graph of silero_vad_16k_op15.onnx, the variant without control flow:

    x [B, 576] (64 samples of context + a 512-sample frame), reflect-padded by 64 on the right
    STFT as a convolution with the model's basis: 258 filters of 256 taps, stride 128 -> [B, 258, 4]
    magnitude of (real 129, imaginary 129) -> [B, 129, 4]
    four convolutions (kernel 3, padding 1; strides 1, 2, 2, 1), each with ReLU -> [B, 128, 1]
    an LSTM cell (gates i, f, g, o) on state (h, c) = state[0], state[1]
    ReLU, a 1x1 convolution to one channel, sigmoid -> the speech probability
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from onnx import numpy_helper

BASIS = "model.stft.forward_basis_buffer"
ENCODER = [
    (f"model.encoder.{i}.reparam_conv.weight", f"model.encoder.{i}.reparam_conv.bias", stride)
    for i, stride in enumerate((1, 2, 2, 1))
]
LSTM = (
    "model.decoder.rnn.weight_ih",
    "model.decoder.rnn.weight_hh",
    "model.decoder.rnn.bias_ih",
    "model.decoder.rnn.bias_hh",
)
DECODER = ("model.decoder.decoder.2.weight", "model.decoder.decoder.2.bias")
WEIGHT_NAMES = (BASIS, *[n for w, b, _ in ENCODER for n in (w, b)], *LSTM, *DECODER)
HOP, PAD = 128, 64


def load_weights(model_path: Path) -> dict[str, np.ndarray]:
    """The initializers the forward pass needs, as float32 arrays; a missing one names the graph."""
    graph = onnx.load(str(model_path)).graph
    found = {t.name: numpy_helper.to_array(t).astype(np.float32) for t in graph.initializer if t.name in WEIGHT_NAMES}
    for node in graph.node:  # the If-branching variants keep their weights inside subgraphs
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                for t in attribute.g.initializer:
                    if t.name in WEIGHT_NAMES and t.name not in found:
                        found[t.name] = numpy_helper.to_array(t).astype(np.float32)
    missing = [n for n in WEIGHT_NAMES if n not in found]
    if missing:
        raise ValueError(f"{model_path}: not a Silero VAD v5 graph (missing {', '.join(missing)})")
    return found


def conv1d(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, stride: int, padding: int) -> np.ndarray:
    """x [B, C, T], weight [O, C, K] -> [B, O, T']."""
    if padding:
        x = np.pad(x, ((0, 0), (0, 0), (padding, padding)))
    windows = np.lib.stride_tricks.sliding_window_view(x, weight.shape[2], axis=2)[:, :, ::stride, :]
    return np.einsum("bctk,ock->bot", windows, weight, optimize=True) + bias[None, :, None]


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


class ReferenceVad:
    """The Engine interface over the NumPy forward pass (feeds and results as ONNX Runtime's)."""

    name = "numpy-reference"

    def __init__(self, weights: Mapping[str, np.ndarray]) -> None:
        self.w = dict(weights)

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        probs, state = self.forward(feeds["input"], feeds["state"])
        return {"output": probs[:, None], "stateN": state}

    def forward(self, x: np.ndarray, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """x [B, 576], state [2, B, 128] -> (probabilities [B], new state [2, B, 128])."""
        w = self.w
        x = np.pad(x.astype(np.float32), ((0, 0), (0, PAD)), mode="reflect")
        frames = np.lib.stride_tricks.sliding_window_view(x, w[BASIS].shape[2], axis=1)[:, ::HOP, :]  # [B, 4, 256]
        spectrum = np.einsum("btk,ck->bct", frames, w[BASIS][:, 0, :], optimize=True)  # [B, 258, 4]
        half = spectrum.shape[1] // 2
        h = np.sqrt(spectrum[:, :half] ** 2 + spectrum[:, half:] ** 2)
        for weight_name, bias_name, stride in ENCODER:
            h = np.maximum(conv1d(h, w[weight_name], w[bias_name], stride, 1), 0.0)
        features = h[:, :, 0]  # [B, 128]
        hidden, cell = state[0], state[1]
        w_ih, w_hh, b_ih, b_hh = (w[n] for n in LSTM)
        gates = features @ w_ih.T + b_ih + hidden @ w_hh.T + b_hh
        i, f, g, o = np.split(gates, 4, axis=1)
        cell = sigmoid(f) * cell + sigmoid(i) * np.tanh(g)
        hidden = sigmoid(o) * np.tanh(cell)
        weight, bias = w[DECODER[0]][:, :, 0], w[DECODER[1]]
        probs = sigmoid(np.maximum(hidden, 0.0) @ weight.T + bias)[:, 0]
        return probs.astype(np.float32), np.stack([hidden, cell]).astype(np.float32)
