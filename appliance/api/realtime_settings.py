"""A Realtime session's settings (OpenAI's session.update, GA format) read and checked: the audio's
rate, the transcription's model, language and prompt, the turn detection (server VAD or manual). A
value it cannot take is a RealtimeError: one `error` event with OpenAI's `code` and `param`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from appliance.config import VAD_MAX_MS, VadConfig
from appliance.errors import ApiError, BadRequest
from appliance.kinds.speech_api import check_prompt

RATES = (24000, 16000)
SERVER_VAD = {"threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}  # OpenAI's defaults


class RealtimeError(ApiError):
    """One `error` event: OpenAI's `code` and `param` beside the message."""

    def __init__(self, message: str, code: str = "invalid_value", param: str | None = None) -> None:
        super().__init__(message, 400)
        self.code, self.param = code, param


@dataclass(frozen=True, slots=True)
class Settings:
    model: str
    rate: int = 24000
    language: str | None = None
    prompt: str = ""
    vad: VadConfig | None = None  # None: no server VAD, the client commits its turns
    turn_detection: dict[str, Any] | None = None  # as the client sees it
    output_rate: int = 24000  # an interpreter session's translated speech


def as_object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"'{name}' must be an object", "invalid_type", name)
    return value


def audio_rate(value: Any, side: str = "input") -> int:
    fmt = as_object(value, f"session.audio.{side}.format")
    if fmt.get("type", "audio/pcm") != "audio/pcm":
        raise RealtimeError(
            f"audio format {str(fmt.get('type'))[:40]!r} is not served: send audio/pcm (PCM16)",
            param="session.audio.input.format.type",
        )
    rate = fmt.get("rate", 24000)
    if rate not in RATES:
        raise RealtimeError(
            f"rate must be 24000 or 16000, got {str(rate)[:20]}", param="session.audio.input.format.rate"
        )
    return int(rate)


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
    if given.get("type", "server_vad") != "server_vad":
        raise RealtimeError(
            f"turn_detection.type {str(given.get('type'))[:40]!r} is not served: use server_vad", param=f"{name}.type"
        )
    merged = {**SERVER_VAD, **{k: v for k, v in given.items() if k in SERVER_VAD}}
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
    return dataclasses.replace(settings, vad=vad, turn_detection={"type": "server_vad", **merged})


def default_settings(model: str) -> Settings:
    return with_turn_detection(Settings(model), {"type": "server_vad"})
