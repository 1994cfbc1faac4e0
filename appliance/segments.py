"""Per-frame speech probabilities -> speech segments, with hysteresis, minimum lengths and padding.

Follows the rules of silero-vad's get_speech_timestamps: speech starts at a frame above
`threshold`, ends after `min_silence_ms` below `threshold - 0.15`; segments shorter than
`min_speech_ms` are dropped; each side is padded by `speech_pad_ms`, splitting a shorter gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SegmentParams:
    threshold: float = 0.5
    min_speech_ms: int = 250
    min_silence_ms: int = 100
    speech_pad_ms: int = 30


def speech_segments(
    probs: np.ndarray, frame_samples: int, sample_rate: int, total_samples: int, params: SegmentParams
) -> list[tuple[int, int]]:
    """Return (start, end) sample positions of speech."""
    min_speech = sample_rate * params.min_speech_ms / 1000
    min_silence = sample_rate * params.min_silence_ms / 1000
    pad = int(sample_rate * params.speech_pad_ms / 1000)
    off_threshold = max(params.threshold - 0.15, 0.01)
    segments: list[list[int]] = []
    start: int | None = None
    silence_from = 0
    for i, p in enumerate(probs.tolist()):
        position = i * frame_samples
        if p >= params.threshold:
            silence_from = 0
            if start is None:
                start = position
        elif start is not None and p < off_threshold:
            if not silence_from:
                silence_from = position
            if position - silence_from >= min_silence:
                if silence_from - start > min_speech:
                    segments.append([start, silence_from])
                start, silence_from = None, 0
    if start is not None and total_samples - start > min_speech:
        segments.append([start, total_samples])
    for i, segment in enumerate(segments):
        if i == 0:
            segment[0] = max(0, segment[0] - pad)
        if i + 1 < len(segments):
            gap = segments[i + 1][0] - segment[1]
            share = gap // 2 if gap < 2 * pad else pad
            segment[1] += share
            segments[i + 1][0] -= share
        else:
            segment[1] = min(total_samples, segment[1] + pad)
    return [(s, e) for s, e in segments]
