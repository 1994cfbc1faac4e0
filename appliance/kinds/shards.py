"""Where to cut a long recording into shards of at most the baked frames per shard.

`fixed` cuts at the limit. `semantic` cuts at the quietest frame of the last half of each shard
window, so a cut falls in a pause rather than inside a word whenever the recording has one.
"""

from __future__ import annotations

import numpy as np


def plan_shards(frame_energy: np.ndarray, max_frames: int, algorithm: str) -> list[tuple[int, int]]:
    """Return [start, end) frame ranges covering every frame, each at most max_frames long."""
    total = len(frame_energy)
    shards, start = [], 0
    while total - start > max_frames:
        end = start + max_frames
        if algorithm == "semantic":
            window_start = start + max(1, max_frames // 2)
            # cut before the quietest frame: that frame starts the next shard
            end = window_start + int(np.argmin(frame_energy[window_start:end]))
        shards.append((start, end))
        start = end
    if start < total or not shards:
        shards.append((start, total))
    return shards


def frame_energy(frames: np.ndarray) -> np.ndarray:
    return np.sqrt(np.mean(np.square(frames, dtype=np.float32), axis=1))
