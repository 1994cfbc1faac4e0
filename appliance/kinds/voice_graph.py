"""A Piper voice graph (VITS) fed batches of phoneme-id shards from many requests.

The graph takes ids padded to the longest shard plus each shard's length, and one set of scales
for the whole batch (so a batch is one speed). Its audio comes back padded to the longest; each
shard's own length is the sum of its phoneme durations (the graph's Ceil output, which the firmware
build makes an output) times the hop length. On the CPU engine a batch is cut into `lanes` runs of
similar length that go to single-threaded ONNX Runtime sessions side by side: a VITS graph does not
get faster per shard in larger batches on a CPU (measured: 8 shards, 1.27 s one by one, 1.46 s as
one batch), but two cores on two shards do. A batch of one shard (a lone request's next sentence)
takes all the intra-op threads instead, so its first audio comes as soon as the engine can make it.
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
        order = sorted(range(len(shards)), key=lambda i: len(shards[i][0]))
        size = -(-len(order) // self.lanes)
        runs = [order[i : i + size] for i in range(0, len(order), size)]
        speed, alone = shards[0][1], len(runs) == 1
        audio: dict[int, np.ndarray] = {}
        pieces_of = lambda r: self._run([shards[i][0] for i in r], speed, alone)  # noqa: E731
        for run, pieces in zip(runs, self._pool.map(pieces_of, runs)):
            audio.update(zip(run, pieces))
        return [audio[i] for i in range(len(shards))]

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
        else:
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
