"""Frames of several live streams through an engine, state and audio context carried from one
batch to the next the way the runtime's batcher carries them (shared by the engine tests and
tests/gpu/check.py)."""

from __future__ import annotations

import numpy as np

FRAME, CONTEXT, RATE = 512, 64, 16000


def run_streams(engine, frames: np.ndarray, before_each=lambda t: None) -> np.ndarray:
    """Frames [T, S, FRAME] of S streams -> probabilities [T, S]; `before_each(t)` runs before batch t."""
    steps, count = frames.shape[:2]
    state, context = np.zeros((2, count, 128), np.float32), np.zeros((count, CONTEXT), np.float32)
    probs = np.empty((steps, count), np.float32)
    for t in range(steps):
        before_each(t)
        x = np.concatenate([context, frames[t]], axis=1)
        out = engine.run({"input": x, "state": state, "sr": np.array(RATE, np.int64)}, count)
        probs[t], state, context = out["output"][:, 0], out["stateN"], frames[t][:, -CONTEXT:]
    return probs


def one_stream(engine, audio: np.ndarray) -> np.ndarray:
    """One recording as one stream, zero-padded to whole frames."""
    frames = np.concatenate([audio, np.zeros(-len(audio) % FRAME, np.float32)]).reshape(-1, 1, FRAME)
    return run_streams(engine, frames)[:, 0]
