"""Known speech in known noise, for noise suppression: babble (six espeak-ng talkers, other texts, each
voice and pace its own, mixed by sox) and fan noise (sox's brown and pink noise, low-passed, with the
blades' tremolo), mixed with a sentence at a given SNR (the speech's RMS over where it is voiced)."""

from __future__ import annotations

import functools
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
from speech import RATE, say

TALKERS = [  # voice, words a minute, pitch
    ("en-us", 165, 40),
    ("en-gb", 185, 60),
    ("en-gb-scotland", 150, 30),
    ("en-gb-x-rp", 175, 70),
    ("en-us", 200, 55),
    ("en-gb-x-gbclan", 160, 45),
]
CHATTER = [
    "So I told him that the meeting had been moved to Thursday, but he never checked his mail.",
    "Have you seen the new bakery on the high street? Their bread is wonderful, honestly.",
    "We drove for hours and hours, and when we finally arrived the hotel had lost our booking.",
    "My sister is moving to the north next spring, she found a job at the university there.",
    "I think the match was decided in the last ten minutes, nobody expected that second goal.",
    "The garden needs a lot of work this year, the roses did not like all that rain.",
]


def _sox(*args: str) -> None:
    if shutil.which("sox") is None:
        raise RuntimeError("sox is not installed (make deps installs it)")
    subprocess.run(["sox", "-R", *args], check=True, capture_output=True)  # -R: the same noise every run


def _read(path: Path) -> np.ndarray:
    raw = subprocess.run(
        ["sox", str(path), "-t", "raw", "-r", str(RATE), "-e", "signed", "-b", "16", "-c", "1", "-"],
        check=True,
        capture_output=True,
    ).stdout
    return np.frombuffer(raw, "<i2").astype(np.float32) / 32768


@functools.cache
def noise(kind: str, seconds: int = 40) -> np.ndarray:
    """`babble` or `fan`, `seconds` long at 16 kHz."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "noise.wav"
        if kind == "fan":
            _sox(
                *("-n", "-r", str(RATE), "-c", "1", "-b", "16", str(out)),
                *("synth", str(seconds), "brownnoise", "synth", str(seconds), "pinknoise", "mix"),
                *("lowpass", "2500", "tremolo", "22", "20", "norm", "-3"),
            )
            return _read(out)
        talkers = []
        for index, ((voice, pace, pitch), text) in enumerate(zip(TALKERS, CHATTER, strict=True)):
            wav = Path(tmp) / f"t{index}.wav"
            speech = subprocess.run(
                ["espeak-ng", "-v", voice, "-s", str(pace), "-p", str(pitch), "--stdout", text],
                check=True,
                capture_output=True,
            ).stdout
            (Path(tmp) / f"r{index}.wav").write_bytes(speech)
            # each talker from its own offset, said again and again to fill the time
            _sox(
                str(Path(tmp) / f"r{index}.wav"),
                "-r",
                str(RATE),
                str(wav),
                "pad",
                f"{0.37 * index:.2f}",
                "repeat",
                "12",
            )
            talkers.append(str(wav))
        _sox("-m", *talkers, str(out), "trim", "0", str(seconds), "norm", "-3")
        return _read(out)


def voiced_rms(speech: np.ndarray) -> float:
    """The speech's RMS over its voiced 20 ms frames (those within 30 dB of the loudest)."""
    frames = speech[: len(speech) // 320 * 320].reshape(-1, 320)
    power = (frames**2).mean(axis=1)
    return float(np.sqrt(power[power > power.max() / 1000].mean()))


def noisy(text: str, kind: str, snr_db: float, offset_s: float, lead_s: float = 0.5) -> np.ndarray:
    """The sentence (espeak-ng) with `lead_s` of noise on each side, the noise at `snr_db` below it."""
    lead = int(lead_s * RATE)
    speech = say(text)
    clean = np.concatenate([np.zeros(lead, np.float32), speech, np.zeros(lead, np.float32)])
    background = noise(kind)
    start = int(offset_s * RATE) % (len(background) - len(clean))
    part = background[start : start + len(clean)]
    gain = voiced_rms(speech) / (np.sqrt((part**2).mean()) * 10 ** (snr_db / 20))
    mixed = clean + gain * part
    return (mixed / max(1.0, float(np.abs(mixed).max()))).astype(np.float32)
