"""Noise reduction over Wyoming: a `transcribe` event whose `context` holds `"noise_reduction":
"near_field"` (or `"far_field"`, the Realtime API's names; both RNNoise, appliance/denoise.py) has the
recording that follows cleaned before the VAD and Whisper hear it. Wyoming has no field of its own for
it; `context` is the event's free-form part, and Home Assistant sends none there, so its recordings are
heard as before. RNNoise's 20 ms lag leaves the recording's last 20 ms unheard (silence, at audio-stop).
"""

from __future__ import annotations

from wyoming.asr import Transcribe

from appliance.denoise import MODES, Denoiser
from appliance.errors import BadRequest


def denoiser(transcribe: Transcribe | None) -> Denoiser | None:
    """The recording's denoiser, where its transcribe event asks for one."""
    context = transcribe.context if transcribe is not None and isinstance(transcribe.context, dict) else {}
    mode = context.get("noise_reduction")
    if mode is None:
        return None
    if mode not in MODES:
        raise BadRequest(f"transcribe: context.noise_reduction must be near_field or far_field, got {str(mode)[:40]!r}")
    return Denoiser()
