"""Whisper's input: log-mel features of 30 s windows, as openai-whisper computes them (plain numpy)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SAMPLE_RATE = 16000
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's one input window: 30 s
N_FFT, HOP = 400, 160
WINDOW_FRAMES = WINDOW_SAMPLES // HOP  # 3000 mel frames


def mel_filters(n_mels: int, sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT) -> np.ndarray:
    """Slaney-scale triangular filters [n_mels, n_fft // 2 + 1], as librosa builds Whisper's."""
    fft_freqs = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    min_log_mel, log_step = min_log_hz / f_sp, np.log(6.4) / 27.0
    mels = np.linspace(0.0, _hz_to_mel(sample_rate / 2), n_mels + 2)
    freqs = f_sp * mels
    log_region = mels >= min_log_mel
    freqs[log_region] = min_log_hz * np.exp(log_step * (mels[log_region] - min_log_mel))
    ramps = freqs[:, None] - fft_freqs[None, :]
    widths = np.diff(freqs)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    weights *= (2.0 / (freqs[2:] - freqs[:-2]))[:, None]  # equal energy per band
    return weights.astype(np.float32)


def _hz_to_mel(hz: float) -> float:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    f_sp, min_log_hz = 200.0 / 3, 1000.0
    if hz < min_log_hz:
        return hz / f_sp
    return min_log_hz / f_sp + float(np.log(hz / min_log_hz) / (np.log(6.4) / 27.0))


def log_mel(shards: list[np.ndarray], filters: np.ndarray) -> np.ndarray:
    """Whisper's input for each shard of at most 30 s: [batch, n_mels, 3000] log-mel features of the
    shard padded with silence to 30 s (the model was trained on full windows only)."""
    window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)  # periodic Hann, as torch.stft uses
    out = np.empty((len(shards), filters.shape[0], WINDOW_FRAMES), np.float32)
    for i, samples in enumerate(shards):
        padded = np.zeros(WINDOW_SAMPLES + N_FFT, np.float32)
        padded[N_FFT // 2 : N_FFT // 2 + len(samples)] = samples[:WINDOW_SAMPLES]
        padded[: N_FFT // 2] = padded[N_FFT // 2 + 1 : N_FFT + 1][::-1]  # centred frames, reflected start
        frames = sliding_window_view(padded, N_FFT)[::HOP][:WINDOW_FRAMES]
        power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2
        mel = np.log10(np.maximum(filters @ power.T, 1e-10))
        out[i] = (np.maximum(mel, mel.max() - 8.0) + 4.0) / 4.0
    return out
