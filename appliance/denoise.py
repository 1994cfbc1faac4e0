"""Noise suppression before the VAD and Whisper: RNNoise (Xiph.Org, BSD-3: NOTICE-rnnoise.txt), its
weights compiled into the shared library the pyrnnoise package ships. The library is loaded here with
ctypes from the package's directory, never by importing the package (that imports PyAV).

RNNoise takes 10 ms frames at 48 kHz on the PCM16 scale; a stream here is 16 kHz float samples, taken
up and back down by the audio module's resamplers (state kept across feeds): the output lags the input
by 20 ms (LAG_S, measured at 16 kHz: 320 samples, the same for any split of the input).
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import weakref
from pathlib import Path

import numpy as np

from appliance.audio import StreamResampler
from appliance.errors import ApplianceError

RATE = 48000  # RNNoise's only rate
FRAME = 480  # its frame: 10 ms
SCALE = 32768.0  # it works on the PCM16 scale
MODES = ("near_field", "far_field")  # OpenAI's names; RNNoise has one model for both
LAG_S = 0.02  # the output lags the input by RNNoise's frame and window and the resamplers: 320 samples at 16 kHz


@functools.cache
def _library() -> ctypes.CDLL:
    spec = importlib.util.find_spec("pyrnnoise")  # finds the package without running its __init__
    folders = list(spec.submodule_search_locations or []) if spec else []
    if not folders or not (Path(folders[0]) / "librnnoise.so").exists():
        raise ApplianceError("noise reduction needs RNNoise's library: pip install pyrnnoise==0.4.5")
    lib = ctypes.CDLL(str(Path(folders[0]) / "librnnoise.so"))
    lib.rnnoise_create.argtypes = [ctypes.c_void_p]
    lib.rnnoise_create.restype = ctypes.c_void_p
    lib.rnnoise_destroy.argtypes = [ctypes.c_void_p]
    lib.rnnoise_process_frame.argtypes = [
        ctypes.c_void_p,
        ctypes.POINTER(ctypes.c_float),
        ctypes.POINTER(ctypes.c_float),
    ]
    lib.rnnoise_process_frame.restype = ctypes.c_float
    assert lib.rnnoise_get_frame_size() == FRAME
    return lib


class Denoiser:
    """One stream's RNNoise state: samples in, the same samples with their noise suppressed out."""

    def __init__(self, rate: int = 16000) -> None:
        self._lib = _library()
        self._state = self._lib.rnnoise_create(None)
        weakref.finalize(self, self._lib.rnnoise_destroy, self._state)
        self._up, self._down = StreamResampler(rate, RATE), StreamResampler(RATE, rate)
        self._held = np.zeros(0, np.float32)  # 48 kHz samples short of a frame

    def feed(self, samples: np.ndarray) -> np.ndarray:
        return self._down.feed(self._frames(self._up.feed(samples.astype(np.float32))))

    def flush(self) -> np.ndarray:
        """The last samples: the part of a frame held (made whole with silence) and the resamplers' tails."""
        tail = self._up.flush()
        padding = np.zeros(-(len(self._held) + len(tail)) % FRAME, np.float32)
        return np.concatenate([self._down.feed(self._frames(np.concatenate([tail, padding]))), self._down.flush()])

    def _frames(self, wide: np.ndarray) -> np.ndarray:
        """48 kHz samples through RNNoise, whole frames at a time (the rest held for the next)."""
        wide = np.concatenate([self._held, wide])
        whole = len(wide) - len(wide) % FRAME
        frames = np.ascontiguousarray(wide[:whole] * SCALE, np.float32)
        cleaned = np.empty_like(frames)
        pointer = ctypes.POINTER(ctypes.c_float)
        for at in range(0, whole, FRAME):
            out, into = cleaned[at : at + FRAME], frames[at : at + FRAME]
            self._lib.rnnoise_process_frame(self._state, out.ctypes.data_as(pointer), into.ctypes.data_as(pointer))
        self._held = wide[whole:]
        return cleaned / SCALE


def denoise(samples: np.ndarray, rate: int = 16000) -> np.ndarray:
    """A whole clip with its noise suppressed, aligned with it (the lag taken off) and as long."""
    lag = int(LAG_S * rate)
    denoiser = Denoiser(rate)
    out = np.concatenate([denoiser.feed(np.concatenate([samples, np.zeros(lag, np.float32)])), denoiser.flush()])
    return out[lag : lag + len(samples)]
