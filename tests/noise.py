"""Sounds that are not speech, for a VAD to ignore: silence, noise, mains hum, and the short sounds a
room makes (clicks of a keyboard or a mouse, knocks, breaths, beeps), each kind in a recording of its own
at 16 kHz, from one seeded generator."""

from __future__ import annotations

import numpy as np

RATE = 16000


def _n(seconds: float) -> int:
    return int(seconds * RATE)


def _peak(x: np.ndarray, level: float) -> np.ndarray:
    return (x / (np.abs(x).max() + 1e-9) * level).astype(np.float32)


def _spaced(parts: list[np.ndarray], gap_s: float) -> np.ndarray:
    gap = np.zeros(_n(gap_s), np.float32)
    return np.concatenate([np.concatenate([p.astype(np.float32), gap]) for p in parts])


def recordings(seed: int = 7) -> dict[str, np.ndarray]:
    """Each kind of sound: a minute of the steady ones, some 25 to 100 of the short ones with gaps."""
    rng = np.random.default_rng(seed)
    t60 = np.arange(_n(60)) / RATE

    def click(level: float) -> np.ndarray:
        x = np.zeros(_n(0.02), np.float32)
        x[5], x[6] = level, -0.8 * level
        return x

    def knock(level: float) -> np.ndarray:
        t = np.arange(_n(0.15)) / RATE
        body = np.sin(2 * np.pi * 120 * t) * np.exp(-t * 40)
        return (level * (body + 0.3 * rng.standard_normal(len(t)) * np.exp(-t * 80))).astype(np.float32)

    def breath(ms: float, level: float) -> np.ndarray:
        count = _n(ms / 1000)
        air = np.convolve(rng.standard_normal(count), np.ones(8) / 8, "same")  # low-passed noise
        return (air * np.sin(np.linspace(0, np.pi, count)) ** 2 * level / air.std()).astype(np.float32)

    def beep(ms: float, hz: float) -> np.ndarray:
        return (0.3 * np.sin(2 * np.pi * hz * np.arange(_n(ms / 1000)) / RATE)).astype(np.float32)

    brown = np.cumsum(rng.standard_normal(_n(60)))
    return {
        "silence, 60 s": np.zeros(_n(60), np.float32),
        "white noise at -40 dBFS, 60 s": (0.01 * rng.standard_normal(_n(60))).astype(np.float32),
        "white noise at -20 dBFS, 60 s": (0.1 * rng.standard_normal(_n(60))).astype(np.float32),
        "brown noise, 60 s": _peak(brown - np.convolve(brown, np.ones(400) / 400, "same"), 0.3),
        "mains hum (50 Hz and harmonics), 60 s": _peak(
            sum(np.sin(2 * np.pi * 50 * k * t60) / k for k in range(1, 8)), 0.3
        ),
        "100 clicks": _spaced([click(rng.uniform(0.2, 1.0)) for _ in range(100)], 0.25),
        "50 knocks": _spaced([knock(rng.uniform(0.2, 0.9)) for _ in range(50)], 0.5),
        "60 breaths, 150 to 700 ms": _spaced(
            [breath(rng.uniform(150, 700), rng.uniform(0.02, 0.3)) for _ in range(60)], 0.6
        ),
        "40 beeps, 100 to 300 ms": _spaced(
            [beep(rng.uniform(100, 300), rng.uniform(400, 2000)) for _ in range(40)], 0.5
        ),
    }
