"""What Resemblyzer's GE2E encoder hears, in numpy (the box has no librosa): its volume normalization
and librosa's mel power spectrogram with Resemblyzer's settings (25 ms Hann windows every 10 ms,
40 Slaney mel bands, centred frames padded with zeros), and its partial utterances (160 frames,
1.6 s). Plain functions; tests/test_speaker_embedding.py holds them to Resemblyzer's own.
"""

from __future__ import annotations

import functools

import numpy as np

SAMPLE_RATE = 16000
N_FFT, HOP, MELS = 400, 160, 40
HIDDEN = 256  # the embedding's size
MELS_INPUT, EMBEDDING_OUTPUT = "mels", "embedding"  # the graph's tensors (firmware_build/ge2e.py)
PARTIAL_FRAMES = 160  # 1.6 s: what the encoder was trained on
TARGET_DBFS = -30.0  # Resemblyzer's loudness: quieter audio is raised to it, louder is left
INT16_MAX = 2**15 - 1


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's scale: linear below 1 kHz, logarithmic above (librosa's default, htk=False)."""
    linear = hz / (200.0 / 3)
    log_part = 15.0 + np.log(np.maximum(hz, 1e-10) / 1000.0) / (np.log(6.4) / 27.0)
    return np.where(hz >= 1000.0, log_part, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    linear = mel * (200.0 / 3)
    log_part = 1000.0 * np.exp((np.log(6.4) / 27.0) * (mel - 15.0))
    return np.where(mel >= 15.0, log_part, linear)


@functools.cache
def filterbank() -> np.ndarray:
    """[MELS, N_FFT // 2 + 1] triangles between 0 and 8 kHz, Slaney-normalized (equal area)."""
    bins = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)), _hz_to_mel(np.array(SAMPLE_RATE / 2)), MELS + 2))
    widths = np.diff(edges)
    ramps = edges[:, None] - bins[None, :]
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0, np.minimum(lower, upper))
    weights *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return weights.astype(np.float32)


@functools.cache
def _window() -> np.ndarray:
    return (0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)).astype(np.float32)  # periodic Hann


def mels(samples: np.ndarray) -> np.ndarray:
    """[frames, MELS] float32: one frame per HOP samples, plus one (librosa's centred frames)."""
    padded = np.pad(samples.astype(np.float32), N_FFT // 2)
    count = 1 + (len(padded) - N_FFT) // HOP
    frames = np.lib.stride_tricks.as_strided(
        padded, (count, N_FFT), (padded.strides[0] * HOP, padded.strides[0]), writeable=False
    )
    power = np.abs(np.fft.rfft(frames * _window(), axis=1)) ** 2
    return (power.astype(np.float32) @ filterbank().T).astype(np.float32)


def louder(samples: np.ndarray) -> np.ndarray:
    """Raised to TARGET_DBFS where quieter (Resemblyzer's normalize_volume, increase only)."""
    rms = float(np.sqrt(np.mean((samples.astype(np.float64) * INT16_MAX) ** 2)))
    if rms == 0.0:
        return samples
    change = TARGET_DBFS - 20 * np.log10(rms / INT16_MAX)
    return samples if change < 0 else (samples * 10 ** (change / 20)).astype(np.float32)


def partial_starts(samples: int, rate: float = 1.3, min_coverage: float = 0.75) -> list[int]:
    """The first frame of each partial utterance of an utterance (Resemblyzer's compute_partial_slices):
    `rate` partials a second, the last kept where at least `min_coverage` of it is audio."""
    frames = int(np.ceil((samples + 1) / HOP))
    step = int(np.round((SAMPLE_RATE / rate) / HOP))
    starts = list(range(0, max(1, frames - PARTIAL_FRAMES + step + 1), step))
    coverage = (samples - starts[-1] * HOP) / (PARTIAL_FRAMES * HOP)
    if coverage < min_coverage and len(starts) > 1:
        starts.pop()
    return starts


def utterance_mels(samples: np.ndarray) -> np.ndarray:
    """[partials, PARTIAL_FRAMES, MELS]: an utterance cut as Resemblyzer's embed_utterance cuts it."""
    starts = partial_starts(len(samples))
    needed = (starts[-1] + PARTIAL_FRAMES) * HOP
    padded = np.pad(samples, (0, max(0, needed - len(samples))))
    spectrogram = mels(padded)
    return np.stack([spectrogram[s : s + PARTIAL_FRAMES] for s in starts])
