"""OpenAI's text-to-speech route, `POST /v1/audio/speech`, on the firmware's speech models.

The body is OpenAI's: `model`, `input`, `voice`, `response_format` (mp3, the default as OpenAI's,
opus, aac, flac, wav or pcm), `speed` (0.25 to 4), `stream_format` (`audio`; `sse` is not served),
other fields (`instructions`: the voices here take no direction) are ignored. `model` is a speech model of
this firmware or one of OpenAI's model names (then `voice` picks the model). mp3, opus (Ogg), aac
(ADTS), flac and pcm (16-bit mono at the voice's rate, also in the `x-sample-rate` header) stream as each
sentence is ready, and so does wav: its header's sizes say "unknown" (0xFFFFFFFF, as OpenAI's streamed
WAV does), flac's STREAMINFO a total of 0 samples (unknown, as a FLAC encoder writing to a pipe does).
A sentence is synthesized only as the client reads (speech.py's SHARDS_AHEAD). `voice` is one of
the firmware's voices, or one of OpenAI's names (alloy, nova, ...: what OpenAI's clients send by default):
then the firmware's default voice of the text's language (the language identification model's answer;
the first voice of a language is its default), or the first voice where the firmware has none of that
language. The `x-voice` header says which voice spoke. `GET /v1/audio/voices` lists the voices.
"""

from __future__ import annotations

import asyncio
import logging
import re
import struct
from collections.abc import AsyncGenerator, Iterable, Mapping, Sequence

import numpy as np

from appliance.api.bodies import json_body, openai_errors
from appliance.api.routes import Route
from appliance.audio_av import ENCODINGS, Encoder
from appliance.errors import BadRequest, NotFound
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import MAX_SPEED, MIN_SPEED, LanguageDetector, Speaker
from appliance.kinds.streaming import begun, guarded
from appliance.kinds.text import checked_text
from appliance.protocol.messages import Request, Response, json_response

log = logging.getLogger("appliance.api")

KIND = "speech_synthesis"
OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
OPENAI_VOICES = ("alloy", "ash", "ballad", "coral", "echo", "fable", "nova", "onyx", "sage", "shimmer", "verse")
FORMATS = {
    "mp3": "audio/mpeg",
    "opus": "audio/ogg; codecs=opus",
    "aac": "audio/aac",
    "flac": "audio/flac",
    "wav": "audio/wav",
    "pcm": "audio/pcm",
}
STREAMED_SIZE = 0xFFFFFFFF  # a WAV's RIFF and data sizes when the length is not known when the header goes


def routes(models: Mapping[str, ServedModel]) -> list[Route]:
    return [
        (
            "POST",
            re.compile(r"/v1/audio/speech"),
            "openai_speech",
            lambda r, p: openai_errors(speech(models.values(), r)),
        ),
        ("GET", re.compile(r"/v1/audio/voices"), "openai_voices", lambda r, p: voices_listing(models.values())),
    ]


async def voices_listing(models: Iterable[ServedModel]) -> Response:
    """Every voice of the firmware, in its order, with its language and model, and each language's default."""
    voices = [v for m in models if isinstance(m, Speaker) for v in m.listing()]
    defaults: dict[str, str] = {}
    for v in voices:
        defaults.setdefault(v["language"], v["name"])
    return json_response(200, {"voices": voices, "defaults": defaults})


async def speech(models: Iterable[ServedModel], request: Request) -> Response:
    doc = await json_body(request)
    served = list(models)
    voices: list[Speaker] = [m for m in served if isinstance(m, Speaker)]
    text = checked_text(doc.get("input"), "input")
    model, voice, headers = _model(voices, doc.get("model"), doc.get("voice"), text, served)
    audio_format = doc.get("response_format", "mp3")
    if audio_format not in FORMATS:
        raise BadRequest(f"response_format {str(audio_format)[:40]!r} is not served (use one of: {', '.join(FORMATS)})")
    if doc.get("stream_format", "audio") != "audio":
        raise BadRequest(f"stream_format {str(doc['stream_format'])[:40]!r} is not served (only 'audio')")
    speed = doc.get("speed", 1.0)
    if isinstance(speed, bool) or not isinstance(speed, (int, float)) or not MIN_SPEED <= speed <= MAX_SPEED:
        raise BadRequest(f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}, got {str(speed)[:40]}")
    shards = await model.prepare(text, voice)  # a text with nothing to say is a 400 here, before any audio
    pieces = model.synthesize(shards, float(speed), voice=voice)
    rate = model.sample_rate
    headers = [("x-sample-rate", str(rate)), *headers]
    # each sentence's audio as soon as it is ready (the status with the first: a refusal before it is a
    # 503); a later failure ends the stream early, logged; a client gone mid-stream drops the shards not
    # yet started
    encoder = Encoder(audio_format, rate) if audio_format in ENCODINGS else None
    stream = guarded(
        _encoded(encoder, await begun(pieces)),
        lambda b: b,
        lambda message: b"",
        f"speech from {model.name}",
        {"MODEL": model.name},
        head=wav_header(rate) if audio_format == "wav" else b"",
    )
    return Response(200, content_type=FORMATS[audio_format], headers=headers, stream=stream)


def _model(
    voices: list[Speaker], name: object, voice: object, text: str, models: list[ServedModel]
) -> tuple[Speaker, str, list[tuple[str, str]]]:
    """The speech model and voice a request names, and the headers that say which spoke and why."""
    if not voices:
        raise NotFound("this firmware has no speech model")
    if not isinstance(name, str) or not isinstance(voice, str):
        field, value = ("model", name) if not isinstance(name, str) else ("voice", voice)
        problem = f"Missing required parameter: '{field}'" if value is None else f"'{field}' must be a string"
        raise BadRequest(f"{problem} (voices: {_names(voices)})")  # OpenAI's words where it is missing
    by_name = [m for m in voices if m.name == name]
    if not by_name and name not in OPENAI_MODELS:
        names = ", ".join(m.name for m in voices)
        raise NotFound(f"unknown speech model {name[:80]!r} (speech models: {names}; or {', '.join(OPENAI_MODELS)})")
    candidates = by_name or voices
    for m in candidates:
        if voice in m.voices:
            return m, voice, [("x-voice", voice)]
        if voice == m.name:
            return m, m.voice_name, [("x-voice", m.voice_name)]
    if voice.lower() not in OPENAI_VOICES:
        owner = next((m.name for m in voices if voice in m.voices), None)
        if owner is not None:  # a voice of the box, not of the model asked for
            raise BadRequest(
                f"voice {voice[:80]!r} belongs to model {owner!r}, not to {name!r} (whose voices are {_names(candidates)})"
            )
        openai_names = ", ".join(OPENAI_VOICES)
        raise BadRequest(
            f"unknown voice {voice[:80]!r} (voices: {_names(candidates)}; or OpenAI's {openai_names}:"
            " each maps to this box's voice for the text's language)"
        )
    model, chosen, detected = voice_for_text(candidates, models, text)
    headers = [("x-detected-language", f"{detected[0]}; confidence={detected[1]}")] if detected else []
    return model, chosen, [("x-voice", chosen), *headers]


def voice_for_text(
    voices: Sequence[Speaker], models: Iterable[ServedModel], text: str
) -> tuple[Speaker, str, tuple[str, float] | None]:
    """Where no voice is named: the first of `voices` in the text's language (the firmware's language
    identification), else the first of them; and the language detected."""
    detector = next((m for m in models if isinstance(m, LanguageDetector)), None)
    if detector is None:
        return voices[0], voices[0].voice_name, None
    detected = detector.detect(text)[0]
    for m, v in ((m, v) for m in voices for v in m.voices.values()):
        if v.language == detected[0]:  # the first voice of a language is its default
            return m, v.name, detected
    return voices[0], voices[0].voice_name, detected


def _names(voices: list[Speaker]) -> str:
    return ", ".join(v for m in voices for v in m.voices)


def wav_header(rate: int) -> bytes:
    """A 16-bit mono PCM WAV header whose samples run to the end of the answer (sizes unknown)."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", STREAMED_SIZE)
        + b"WAVEfmt "
        + struct.pack("<I", 16)
        + fmt
        + b"data"
        + struct.pack("<I", STREAMED_SIZE)
    )


def _pcm(samples: np.ndarray) -> bytes:
    return samples.astype("<i2").tobytes()


async def _encoded(encoder: Encoder | None, pieces: AsyncGenerator[np.ndarray, None]) -> AsyncGenerator[bytes, None]:
    """Each sentence's samples in the answer's format, encoded off the loop; the encoder's tail at the end."""
    try:
        async for samples in pieces:
            data = _pcm(samples) if encoder is None else await asyncio.to_thread(encoder.encode, samples)
            if data:
                yield data
        if encoder is not None and (tail := await asyncio.to_thread(encoder.finish)):
            yield tail
    finally:
        await pieces.aclose()
