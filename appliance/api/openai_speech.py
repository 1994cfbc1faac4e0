"""OpenAI's text-to-speech route, `POST /v1/audio/speech`, on the firmware's speech models.

The body is OpenAI's: `model`, `input`, `voice`, `response_format` (wav, pcm or flac here),
`speed` (0.25 to 4). `model` is a speech model of this firmware or one of OpenAI's model names
(then `voice` picks the model). WAV and PCM are streamed as each sentence is ready: a WAV header
whose sizes say "unknown length" (0xFFFFFFFF, as streaming encoders write it), then 16-bit mono
samples at the voice's rate (in the `x-sample-rate` header too). FLAC is sent whole.
"""

from __future__ import annotations

import io
import logging
import re
import struct
from collections.abc import Iterable, Mapping

import numpy as np
import soundfile

from appliance.api.bodies import json_body, openai_errors
from appliance.api.routes import Route
from appliance.errors import BadRequest, NotFound
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import MAX_SPEED, MIN_SPEED, Speaker
from appliance.kinds.streaming import guarded
from appliance.kinds.text import checked_text
from appliance.protocol.messages import Request, Response

log = logging.getLogger("appliance.api")

KIND = "speech_synthesis"
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
FORMATS = {"wav": "audio/wav", "pcm": "audio/pcm", "flac": "audio/flac"}
STREAMED_UNKNOWN = 0xFFFFFFFF


def routes(models: Mapping[str, ServedModel]) -> list[Route]:
    return [
        (
            "POST",
            re.compile(r"/v1/audio/speech"),
            "openai_speech",
            lambda r, p: openai_errors(speech(models.values(), r)),
        )
    ]


async def speech(models: Iterable[ServedModel], request: Request) -> Response:
    doc = await json_body(request)
    voices: list[Speaker] = [m for m in models if isinstance(m, Speaker)]
    model = _model(voices, doc.get("model"), doc.get("voice"))
    text = checked_text(doc.get("input"), "input")
    audio_format = doc.get("response_format", "wav")
    if audio_format not in FORMATS:
        raise BadRequest(f"response_format {str(audio_format)[:40]!r} is not served (use one of: {', '.join(FORMATS)})")
    speed = doc.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise BadRequest(f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, got {str(speed)[:40]}")
    shards = await model.prepare(text)  # a text with nothing to say is a 400 here, before any audio
    pieces = model.synthesize(shards, float(speed))
    rate = model.sample_rate
    headers = [("x-sample-rate", str(rate))]
    if audio_format == "flac":
        samples = [p async for p in pieces]
        return Response(200, _flac(samples, rate), FORMATS["flac"], headers)
    # the header, then each sentence's samples as soon as it is ready; a failure ends the stream early
    # (the status has been sent), logged; a client gone mid-stream drops the shards not yet started
    first = wav_header(rate, STREAMED_UNKNOWN) if audio_format == "wav" else b""
    body = guarded(
        pieces,
        lambda s: s.astype("<i2").tobytes(),
        lambda message: b"",
        f"speech from {model.name}",
        {"MODEL": model.name},
        head=first,
    )
    return Response(200, content_type=FORMATS[audio_format], headers=headers, stream=body)


def _model(voices: list[Speaker], name: object, voice: object) -> Speaker:
    if not voices:
        raise NotFound("this firmware has no speech model")
    served = ", ".join(m.voice_name for m in voices)
    if not isinstance(name, str) or not isinstance(voice, str):
        raise BadRequest(f"'model' and 'voice' must be strings (voices: {served})")
    by_name = [m for m in voices if m.name == name]
    if not by_name and name not in OPENAI_MODELS:
        raise NotFound(f"unknown speech model {name[:80]!r} (speech models: {', '.join(m.name for m in voices)})")
    chosen = [m for m in by_name or voices if voice in (m.voice_name, m.name)]
    if not chosen:
        raise BadRequest(f"unknown voice {voice[:80]!r} (voices: {served})")
    return chosen[0]


def wav_header(rate: int, data_bytes: int) -> bytes:
    """A 16-bit mono PCM WAV header; STREAMED_UNKNOWN sizes where the length is not known yet."""
    riff = STREAMED_UNKNOWN if data_bytes == STREAMED_UNKNOWN else 36 + data_bytes
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", riff)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", data_bytes)
    )


def _flac(pieces: list[np.ndarray], rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, np.concatenate(pieces) if pieces else np.zeros(0, np.int16), rate, format="FLAC")
    return out.getvalue()
