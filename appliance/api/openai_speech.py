"""OpenAI's text-to-speech route, `POST /v1/audio/speech`, on the firmware's speech models.

The body is OpenAI's: `model`, `input`, `voice`, `response_format` (mp3, the default as OpenAI's,
opus, aac, flac, wav or pcm), `speed` (0.25 to 4), `stream_format` (`audio`; `sse` is not served),
other fields (`instructions`: the voices here take no direction) are ignored. `model` is a speech model of
this firmware or one of OpenAI's model names (then `voice` picks the model). mp3, opus (Ogg), aac
(ADTS) and pcm (16-bit mono at the voice's rate, also in the `x-sample-rate` header) stream as each
sentence is ready; wav and flac are sent whole, their headers carrying the true sizes.
"""

from __future__ import annotations

import asyncio
import io
import logging
import re
import struct
from collections.abc import AsyncGenerator, Iterable, Mapping

import numpy as np
import soundfile

from appliance.api.bodies import json_body, openai_errors
from appliance.api.routes import Route
from appliance.audio_av import Encoder
from appliance.errors import BadRequest, NotFound
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import MAX_SPEED, MIN_SPEED, Speaker
from appliance.kinds.streaming import guarded
from appliance.kinds.text import checked_text
from appliance.protocol.messages import Request, Response

log = logging.getLogger("appliance.api")

KIND = "speech_synthesis"
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
FORMATS = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
WHOLE = ("wav", "flac")  # formats whose header holds the sizes: sent once all is synthesized


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
    doc = json_body(request.body)
    voices: list[Speaker] = [m for m in models if isinstance(m, Speaker)]
    model = _model(voices, doc.get("model"), doc.get("voice"))
    text = checked_text(doc.get("input"), "input")
    audio_format = doc.get("response_format", "mp3")
    if audio_format not in FORMATS:
        raise BadRequest(f"response_format {str(audio_format)[:40]!r} is not served (use one of: {', '.join(FORMATS)})")
    if doc.get("stream_format", "audio") != "audio":
        raise BadRequest(f"stream_format {str(doc['stream_format'])[:40]!r} is not served (only 'audio')")
    speed = doc.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise BadRequest(f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, got {str(speed)[:40]}")
    shards = await model.prepare(text)  # a text with nothing to say is a 400 here, before any audio
    pieces = model.synthesize(shards, float(speed))
    rate = model.sample_rate
    headers = [("x-sample-rate", str(rate))]
    if audio_format in WHOLE:
        try:
            samples = [p async for p in pieces]
        finally:
            await pieces.aclose()
        whole = np.concatenate(samples) if samples else np.zeros(0, np.int16)
        body = _flac(whole, rate) if audio_format == "flac" else wav_header(rate, 2 * len(whole)) + _pcm(whole)
        return Response(200, body, FORMATS[audio_format], headers)
    # each sentence's audio as soon as it is ready; a failure ends the stream early (the status has
    # been sent), logged; a client gone mid-stream drops the shards not yet started
    encoder = Encoder(audio_format, rate) if audio_format != "pcm" else None
    stream = guarded(
        _encoded(encoder, pieces), lambda b: b, lambda message: b"", f"speech from {model.name}", {"MODEL": model.name}
    )
    return Response(200, content_type=FORMATS[audio_format], headers=headers, stream=stream)


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
    """A 16-bit mono PCM WAV header for `data_bytes` of samples."""
    riff = 36 + data_bytes
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


def _pcm(samples: np.ndarray) -> bytes:
    return samples.astype("<i2").tobytes()


def _flac(samples: np.ndarray, rate: int) -> bytes:
    out = io.BytesIO()
    soundfile.write(out, samples, rate, format="FLAC")
    return out.getvalue()


async def _encoded(encoder: Encoder | None, pieces: AsyncGenerator[np.ndarray, None]) -> AsyncGenerator[bytes, None]:
    """Each sentence's samples in the answer's format, encoded off the loop; the encoder's tail at the end."""
    try:
        async for samples in pieces:
            data = _pcm(samples) if encoder is None else await asyncio.to_thread(encoder.encode, samples)
            if data:
                yield data
        if encoder is not None:
            yield await asyncio.to_thread(encoder.finish)
    finally:
        await pieces.aclose()
