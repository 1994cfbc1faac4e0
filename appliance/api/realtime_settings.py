"""A Realtime session's settings (OpenAI's session.update, GA format) read and checked: the audio's
format (PCM16 at 24 or 16 kHz, G.711 μ-law or A-law at 8 kHz), the transcription's model, language and
prompt, the noise reduction, the turn detection (server VAD, semantic VAD or manual). A value it
cannot take is a RealtimeError: one `error` event with OpenAI's `code` and `param`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from appliance import g711
from appliance.config import VAD_MAX_MS, VadConfig
from appliance.denoise import MODES
from appliance.errors import ApiError, BadRequest
from appliance.kinds.speech_api import check_prompt

PCM = "audio/pcm"
RATES = (24000, 16000)
SERVER_VAD = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}  # OpenAI's defaults
# semantic_vad's eagerness as the silence that ends a turn: the box has no model of whether a sentence
# is finished, so a less eager turn detection waits longer (OpenAI's "auto" is "medium")
EAGERNESS_SILENCE_MS = {"low": 1500, "medium": 800, "auto": 800, "high": 300}

# the switches both turn detections take; an interpreter's next turn does not cancel the answer being
# spoken unless the client asks (OpenAI's default is true: an assistant's, not an interpreter's)
RESPONSES = {"create_response": True, "interrupt_response": False}


class RealtimeError(ApiError):
    """One `error` event: OpenAI's `code` and `param` beside the message."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message, 400)
        self.code, self.param = code, param


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    rate: int = 24000
    codec: str = PCM  # or G.711's audio/pcmu, audio/pcma (8 kHz)
    language: str | None = None
    prompt: str = ""
    vad: VadConfig | None = None  # None: no server VAD, the client commits its turns
    turn_detection: dict[str, Any] | None = None  # as the client sees it
    output_rate: int = 24000  # an interpreter session's translated speech
    output_codec: str = PCM
    noise_reduction: str | None = None  # near_field or far_field: RNNoise before the VAD and Whisper
    create_response: bool = True  # an interpreter answers each turn the VAD closes
    interrupt_response: bool = False  # speech heard cancels the answer being spoken (barge-in)


def as_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"'{name}' must be an object", "invalid_type", name)
    return value


def audio_format(value: Any, side: str = "input") -> tuple[str, int]:
    """The codec and rate of `session.audio.<side>.format`."""
    param = f"session.audio.{side}.format"
    fmt = as_object(value, param)
    codec = fmt.get("type", PCM)
    if codec in (g711.ULAW, g711.ALAW):
        if fmt.get("rate", g711.RATE) != g711.RATE:
            raise RealtimeError(f"{codec} is 8000 Hz, got {str(fmt.get('rate'))[:20]}", param=f"{param}.rate")
        return codec, g711.RATE
    if codec != PCM:
        raise RealtimeError(
            f"audio format {str(codec)[:40]!r} is not served: send audio/pcm (PCM16), audio/pcmu or audio/pcma",
            param=f"{param}.type",
        )
    rate = fmt.get("rate", 24000)
    if rate not in RATES:
        raise RealtimeError(f"rate must be 24000 or 16000, got {str(rate)[:20]}", param=f"{param}.rate")
    return codec, int(rate)


def describe_format(codec: str, rate: int) -> dict[str, Any]:
    return {"type": codec, "rate": rate} if codec == PCM else {"type": codec}


def with_noise_reduction(settings: Settings, given: Any) -> Settings:
    if given is None:
        return dataclasses.replace(settings, noise_reduction=None)
    kind = as_object(given, "session.audio.input.noise_reduction").get("type")
    if kind not in MODES:
        raise RealtimeError(
            f"noise_reduction.type must be near_field or far_field, got {str(kind)[:40]!r}",
            param="session.audio.input.noise_reduction.type",
        )
    return dataclasses.replace(settings, noise_reduction=kind)


def with_transcription(settings: Settings, given: dict[str, Any], models: tuple[str, ...]) -> Settings:
    model, language, prompt = given.get("model", settings.model), given.get("language"), given.get("prompt", "")
    if not isinstance(model, str) or not (model in models or model.startswith(("whisper", "gpt-"))):
        raise RealtimeError(
            f"no speech_to_text model {str(model)[:60]!r} (served: {', '.join(models)})",
            "model_not_found",
            "session.audio.input.transcription.model",
        )
    if language is not None and not isinstance(language, str) or not isinstance(prompt, str):
        raise RealtimeError("language and prompt must be strings", "invalid_type", "session.audio.input.transcription")
    try:
        check_prompt(prompt)  # refused here, once, rather than at each turn
    except BadRequest as exc:
        raise RealtimeError(exc.message, param="session.audio.input.transcription.prompt") from None
    return dataclasses.replace(settings, model=model, language=(language or None), prompt=prompt)


def with_turn_detection(settings: Settings, given: Any) -> Settings:
    name = "session.audio.input.turn_detection"
    if given is None:
        return dataclasses.replace(settings, vad=None, turn_detection=None)
    given = as_object(given, name)
    kind = given.get("type", "server_vad")
    if kind not in ("server_vad", "semantic_vad"):
        raise RealtimeError(
            f"turn_detection.type {str(kind)[:40]!r} is not served: use server_vad or semantic_vad",
            param=f"{name}.type",
        )
    switches = {**RESPONSES, **{k: v for k, v in given.items() if k in RESPONSES}}
    if not all(isinstance(v, bool) for v in switches.values()):
        raise RealtimeError("create_response and interrupt_response must be true or false", param=name)
    if kind == "semantic_vad":
        eagerness = given.get("eagerness", "auto")
        if eagerness not in EAGERNESS_SILENCE_MS:
            raise RealtimeError(
                f"turn_detection.eagerness must be low, medium, high or auto, got {str(eagerness)[:40]!r}",
                param=f"{name}.eagerness",
            )
        shown = {"type": kind, "eagerness": eagerness, **switches}
        merged: dict[str, Any] = {**SERVER_VAD, "silence_duration_ms": EAGERNESS_SILENCE_MS[eagerness]}
    else:
        merged = {**SERVER_VAD, **{k: v for k, v in given.items() if k in SERVER_VAD}}
        shown = {"type": kind, **merged, **switches}
    threshold = merged["threshold"]
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 < threshold < 1:
        raise RealtimeError("turn_detection.threshold must be a number between 0 and 1", param=f"{name}.threshold")
    for key in ("prefix_padding_ms", "silence_duration_ms"):
        value = merged[key]
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= VAD_MAX_MS:
            raise RealtimeError(
                f"turn_detection.{key} must be an integer from 0 to {VAD_MAX_MS}", param=f"{name}.{key}"
            )
    vad = VadConfig(
        float(threshold), min_silence_ms=merged["silence_duration_ms"], speech_pad_ms=merged["prefix_padding_ms"]
    )
    return dataclasses.replace(settings, vad=vad, turn_detection=shown, **switches)


def default_settings(model: str) -> Settings:
    return with_turn_detection(Settings(model), {"type": "server_vad"})
