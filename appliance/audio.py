"""Audio in: WAV decoding and framing (pure functions)."""

from __future__ import annotations

import io
import wave

import numpy as np

from appliance.errors import BadRequest


def decode_wav(data: bytes, sample_rate: int) -> np.ndarray:
    """PCM16 mono WAV at the model's rate -> float32 samples in [-1, 1); anything else is a clear 400."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            channels, width, rate, count = w.getnchannels(), w.getsampwidth(), w.getframerate(), w.getnframes()
            pcm = w.readframes(count)
    except (wave.Error, EOFError) as exc:
        raise BadRequest(f"not a PCM WAV file: {exc}") from None
    problems = []
    if channels != 1:
        problems.append(f"{channels} channels (need mono)")
    if width != 2:
        problems.append(f"{8 * width}-bit samples (need 16-bit PCM)")
    if rate != sample_rate:
        problems.append(f"{rate} Hz (need {sample_rate} Hz)")
    if problems:
        raise BadRequest(f"WAV format not supported: {', '.join(problems)}")
    if len(pcm) < count * 2:
        raise BadRequest(f"WAV is truncated: header says {count} samples, data holds {len(pcm) // 2}")
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def encode_wav(samples: np.ndarray, sample_rate: int) -> bytes:
    """float32 samples -> PCM16 mono WAV bytes (used by the client and the tests)."""
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(sample_rate)
        w.writeframes(pcm)
    return buffer.getvalue()


def to_frames(samples: np.ndarray, frame_samples: int) -> np.ndarray:
    """[n] samples -> [ceil(n / frame), frame], the last frame zero-padded."""
    count = -(-len(samples) // frame_samples)
    frames = np.zeros((count, frame_samples), np.float32)
    frames.reshape(-1)[: len(samples)] = samples
    return frames
