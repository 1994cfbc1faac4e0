"""One audio input for every kind: a KServe tensor (FP32 or INT16 samples, or BYTES holding one
encoded file where the kind takes files) or an uploaded body, as float32 samples at the model's rate.

An encoded recording is decoded to at most `max_seconds`: what the body limit holds as mono PCM16 at
the model's rate, so a small compressed body cannot make the daemon decode hours. Decoding runs off
the event loop (its callers use asyncio.to_thread).
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from appliance.audio import decode_audio
from appliance.config import Live
from appliance.errors import BadRequest

AUDIO_INPUT = "audio"


def max_seconds(live: Live, rate: int) -> float:
    """The longest recording a request may carry at `rate`: the body limit as mono PCM16."""
    return live.config.server.max_body_bytes / (2 * rate)


def decode_upload(body: bytes, rate: int, live: Live) -> np.ndarray:
    """An uploaded recording (WAV, FLAC, Ogg) as float32 samples at `rate`."""
    return decode_audio(body, rate, max_seconds(live, rate))


def audio_input(
    inputs: Mapping[str, np.ndarray], model: str, rate: int, live: Live | None = None, name: str = AUDIO_INPUT
) -> np.ndarray:
    """The one audio tensor of an infer request as float32 samples; with `live`, a BYTES tensor of one
    encoded file is accepted too (decoded at `rate`)."""
    if set(inputs) != {name}:
        raise BadRequest(f"model {model} takes one input named {name!r}, got {sorted(inputs)}")
    array = inputs[name]
    if array.dtype == object and live is not None:
        if array.size != 1:
            raise BadRequest(f"input {name}: a BYTES input holds one encoded file, got {array.size} elements")
        return decode_upload(bytes(array.reshape(-1)[0]), rate, live)
    if array.ndim == 2 and array.shape[0] == 1:
        array = array[0]
    if array.ndim != 1:
        raise BadRequest(f"input {name}: shape must be [samples] or [1, samples], got {list(array.shape)}")
    if array.dtype == np.float32:
        if not np.isfinite(array).all():  # one NaN would poison a stream's recurrent state for good
            raise BadRequest(f"input {name}: samples must be finite numbers (no NaN or infinity)")
        return array
    if array.dtype == np.int16:
        return array.astype(np.float32) / 32768.0
    raise BadRequest(f"input {name}: datatype must be {'FP32, INT16 or BYTES' if live else 'FP32 or INT16'}")
