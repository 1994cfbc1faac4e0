"""Test audio: real speech from espeak-ng, placed at known times between known silences."""

from __future__ import annotations

import functools
import io
import shutil
import subprocess
import wave

import numpy as np

from appliance.kinds.segments import SegmentParams, SegmentTracker

RATE = 16000


@functools.cache  # one espeak-ng run per sentence per session; callers do not modify the result
def say(text: str, voice: str = "en", words_per_minute: int = 175) -> np.ndarray:
    """espeak-ng speech at 16 kHz (in `voice`, a language code; at espeak-ng's own pace unless told),
    trimmed to where the voice is."""
    if shutil.which("espeak-ng") is None:
        raise RuntimeError("espeak-ng is not installed (make deps installs it)")
    command = ["espeak-ng", "-v", voice, "-s", str(words_per_minute), "--stdout", text]
    raw = subprocess.run(command, capture_output=True, check=True).stdout
    with wave.open(io.BytesIO(raw)) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768.0
    count = int(len(x) * RATE / rate)
    x = np.interp(np.arange(count) * rate / RATE, np.arange(len(x)), x).astype(np.float32)
    loud = np.flatnonzero(np.abs(x) > 0.01)
    return x[loud[0] : loud[-1] + 1]


def recording(
    sentences: list[str], gap_s: float = 1.5, lead_s: float = 1.0, voice: str = "en"
) -> tuple[np.ndarray, list[tuple[float, float]]]:
    """Sentences separated by silence; returns the samples and each sentence's (start, end) in seconds."""
    parts, spans, position = [np.zeros(int(lead_s * RATE), np.float32)], [], int(lead_s * RATE)
    for text in sentences:
        spoken = say(text, voice)
        spans.append((position / RATE, (position + len(spoken)) / RATE))
        parts += [spoken, np.zeros(int(gap_s * RATE), np.float32)]
        position += len(spoken) + int(gap_s * RATE)
    return np.concatenate(parts), spans


SENTENCES = [
    "Hello there this is the first sentence",
    "And here comes a second one that is a little longer than the first",
    "Good bye and thank you",
]


def speech_segments(
    probs: np.ndarray, frame_samples: int, sample_rate: int, total_samples: int, params: SegmentParams
) -> list[tuple[int, int]]:
    """(start, end) sample positions of speech in a whole recording: the tracker fed all at once."""
    tracker = SegmentTracker(frame_samples, sample_rate, params)
    return tracker.feed(probs) + tracker.finish(total_samples)
