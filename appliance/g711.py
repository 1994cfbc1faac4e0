"""G.711 (ITU-T), the telephone network's 8 kHz audio: μ-law (`audio/pcmu`) and A-law (`audio/pcma`),
one byte a sample, as telephony bridges send Realtime sessions. Decoding is a 256-entry table; encoding
is the standard's segment search, vectorised (Python 3.13 dropped audioop, which did both)."""

from __future__ import annotations

import numpy as np

RATE = 8000  # G.711 is 8 kHz only
ULAW, ALAW = "audio/pcmu", "audio/pcma"
_BIAS = 0x84


def _ulaw_table() -> np.ndarray:
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    magnitude = (((code & 0x0F) << 3) + _BIAS) << ((code >> 4) & 0x07)
    return np.where(code & 0x80, _BIAS - magnitude, magnitude - _BIAS).astype(np.int16)


def _alaw_table() -> np.ndarray:
    code = np.arange(256, dtype=np.int32) ^ 0x55
    segment = (code >> 4) & 0x07
    mantissa = (code & 0x0F) << 4
    magnitude = np.where(segment == 0, mantissa + 8, (mantissa + 0x108) << np.maximum(segment - 1, 0))
    return np.where(code & 0x80, magnitude, -magnitude).astype(np.int16)


_DECODE = {ULAW: _ulaw_table(), ALAW: _alaw_table()}


def decode(data: bytes, law: str) -> np.ndarray:
    """G.711 bytes as float32 samples in [-1, 1)."""
    return _DECODE[law][np.frombuffer(data, np.uint8)].astype(np.float32) / 32768.0


def encode(samples: np.ndarray, law: str) -> bytes:
    """float samples in [-1, 1] as G.711 bytes."""
    pcm = np.clip(np.round(samples * 32768.0), -32768, 32767).astype(np.int32)
    return (_ulaw(pcm) if law == ULAW else _alaw(pcm)).astype(np.uint8).tobytes()


def _segment(magnitude: np.ndarray, ends: np.ndarray) -> np.ndarray:
    return np.searchsorted(ends, magnitude, side="left")  # the first segment whose end holds it


def _ulaw(pcm: np.ndarray) -> np.ndarray:
    pcm = pcm >> 2  # 14 bits
    mask = np.where(pcm < 0, 0x7F, 0xFF)
    magnitude = np.minimum(np.abs(pcm), 8159) + 0x21
    segment = _segment(magnitude, _ULAW_ENDS)
    code = (np.minimum(segment, 7) << 4) | ((magnitude >> (segment + 1)) & 0x0F)
    return np.where(segment >= 8, 0x7F, code) ^ mask


def _alaw(pcm: np.ndarray) -> np.ndarray:
    pcm = pcm >> 3  # 13 bits
    mask = np.where(pcm >= 0, 0xD5, 0x55)
    magnitude = np.where(pcm >= 0, pcm, -pcm - 1)
    segment = _segment(magnitude, _ALAW_ENDS)
    code = (np.minimum(segment, 7) << 4) | ((magnitude >> np.maximum(segment, 1)) & 0x0F)
    return np.where(segment >= 8, 0x7F, code) ^ mask


_ULAW_ENDS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_ENDS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])
