"""Whisper's input: log-mel features of 30 s windows, as openai-whisper computes them (plain numpy)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

SAMPLE_RATE = 16000
WINDOW_SAMPLES = 30 * SAMPLE_RATE  # Whisper's one input window: 30 s
N_FFT, HOP = 400, 160
WINDOW_FRAMES = WINDOW_SAMPLES // HOP  # 3000 mel frames
# A shard alone is encoded at twice its audio's length, at least 15 s, not always a 30 s window: the
# encoder's cost grows faster than its input (tiny.en on 2 threads: 53 ms for 15 s against 208 ms for
# 30 s; base 108 against 444 ms). Whisper was trained on 30 s windows, and what it needs is silence
# after the audio: measured on espeak-ng speech (8 clips each of 6, 10, 12, 14 and 17 s; 22 sentences
# x 3 voices), twice the audio heard as well as 30 s (WER tiny.en 0.149 against 0.150, base 0.127
# against 0.130), while 3 s of silence after 12 s of audio made base repeat itself (WER 0.93), as did
# every input of 5 s. Shared windows (whisper_windows.py) are always whole.
MIN_ENCODER_FRAMES = 1500


def encoder_frames(audio_frames: int) -> int:
    """The mel frames the encoder is given for a shard of `audio_frames`: twice that, at least
    MIN_ENCODER_FRAMES, at most a window; even (the encoder's convolution halves it)."""
    frames = min(WINDOW_FRAMES, max(MIN_ENCODER_FRAMES, 2 * audio_frames))
    return frames + frames % 2


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


def log_mel(shards: list[np.ndarray], filters: np.ndarray, frames: int = WINDOW_FRAMES) -> np.ndarray:
    """Whisper's input for each shard of at most 30 s: [batch, n_mels, frames] log-mel features of the
    shard padded with silence, the first `frames` of a 30 s window's (the silence after the audio is
    the quietest a frame can be, so the window's scale is the same whatever `frames` is)."""
    window = np.hanning(N_FFT + 1)[:-1].astype(np.float32)  # periodic Hann, as torch.stft uses
    out = np.empty((len(shards), filters.shape[0], frames), np.float32)
    for i, samples in enumerate(shards):
        padded = np.zeros(frames * HOP + N_FFT, np.float32)
        heard = samples[: frames * HOP]
        padded[N_FFT // 2 : N_FFT // 2 + len(heard)] = heard
        padded[: N_FFT // 2] = padded[N_FFT // 2 + 1 : N_FFT + 1][::-1]  # centred frames, reflected start
        frames_view = sliding_window_view(padded, N_FFT)[::HOP][:frames]
        power = np.abs(np.fft.rfft(frames_view * window, axis=1)) ** 2
        mel = np.log10(np.maximum(filters @ power.T, 1e-10))
        out[i] = (np.maximum(mel, mel.max() - 8.0) + 4.0) / 4.0
    return out
