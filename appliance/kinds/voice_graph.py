"""A Piper voice graph (VITS) fed batches of phoneme-id shards from many requests.

The graph takes ids padded to the longest shard plus each shard's length, and one set of scales
for the whole batch (so a batch is one speed). Its audio comes back padded to the longest; each
shard's own length is the sum of its phoneme durations (the graph's Ceil output, which the firmware
build makes an output) times the hop length. On the CPU engine a batch's shards run one at a time,
`lanes` side by side on single-threaded ONNX Runtime sessions: padding costs a VITS graph on a CPU
more than a batch saves (measured here, 8 sentences on 2 cores: 1.31 s as two padded batches, 0.90 s
one by one on two threads, 2.01 s one by one on one 2-thread session). A lone shard (a lone request's
next sentence) takes all the intra-op threads, so its audio comes as soon as the engine can make it.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Mapping

import numpy as np

from appliance.engine.interface import Engine
from appliance.engine.onnx_cpu import OnnxCpuEngine
from appliance.firmware.graphs import DURATIONS
from appliance.kinds.phonemes import Voice

IDS, LENGTHS, SCALES, AUDIO = "input", "input_lengths", "scales", "output"
PEAK = 32767.0


class VoiceGraph:
    def __init__(self, engine: Engine, voice: Voice, lanes: int) -> None:
        self.engine, self.voice = engine, voice
        self.lanes = max(1, lanes)
        self._pool = concurrent.futures.ThreadPoolExecutor(self.lanes, thread_name_prefix="voice")

    def run(self, shards: list[tuple[list[int], float]]) -> list[np.ndarray]:
        """Each shard's audio as INT16 samples; a batch is one speed (the queue groups by it)."""
        speed = shards[0][1]
        if isinstance(self.engine, OnnxCpuEngine):
            alone = len(shards) == 1
            return list(self._pool.map(lambda shard: self._run([shard[0]], speed, alone)[0], shards))
        return self._run([ids for ids, _ in shards], speed, False)

    def _run(self, ids: list[list[int]], speed: float, alone: bool) -> list[np.ndarray]:
        voice = self.voice
        lengths = np.array([len(x) for x in ids], np.int64)
        padded = np.zeros((len(ids), int(lengths.max())), np.int64)
        for row, x in zip(padded, ids):
            row[: len(x)] = x
        scales = np.array([voice.noise_scale, voice.length_scale / speed, voice.noise_w], np.float32)
        feeds: Mapping[str, np.ndarray] = {IDS: padded, LENGTHS: lengths, SCALES: scales}
        if isinstance(self.engine, OnnxCpuEngine):
            out = self.engine.run(feeds, len(ids), parallel=alone)
        else:  # a GPU engine: the whole batch in one call
            out = self.engine.run(feeds, len(ids))
        wave = out[AUDIO].reshape(len(ids), -1)
        durations = out[DURATIONS].reshape(len(ids), -1)  # each phoneme's frames (the build's output)
        pieces = []
        for i, length in enumerate(lengths):
            samples = int(durations[i, :length].sum()) * voice.hop_length
            pieces.append(_to_int16(wave[i, :samples]))
        return pieces


def _to_int16(audio: np.ndarray) -> np.ndarray:
    """Scaled to full range as Piper does per sentence (its normalize_audio), then 16-bit."""
    peak = float(np.max(np.abs(audio))) if audio.size else 0.0
    if peak < 1e-8:
        return np.zeros(audio.shape, np.int16)
    return np.clip(audio / peak * PEAK, -PEAK, PEAK).astype(np.int16)
