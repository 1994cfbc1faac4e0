"""OpenAI's audio API on the box: POST /v1/audio/transcriptions and /v1/audio/translations.

A multipart form (python-multipart parses it): `file`, `model`, `language` (transcriptions only),
`prompt`, `response_format` (json | text | verbose_json | srt | vtt), `temperature`, `stream` (true:
server-sent events, a `transcript.text.delta` per segment as it is decoded, then `transcript.text.done`),
`timestamp_granularities[]` (segment, word: word timestamps with probabilities in verbose_json and in
the stream's events), `chunking_strategy` (`auto` or a server_vad object: the box always cuts at its
VAD's silences), `include[]` (accepted; `logprobs` are not served) and the box's own `noise_reduction`
(`near_field` or `far_field`: RNNoise before the VAD and Whisper, appliance/denoise.py; `none`, the
default). `model` names a speech_to_text
model of the firmware or one of OpenAI's names (openai_models.py picks the best served model for it).
Errors are in OpenAI's shape, naming the field at fault.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from appliance.api import openai_models
from appliance.api import openai_speakers as speakers
from appliance.api.bodies import openai_errors, read_multipart
from appliance.denoise import MODES, denoise
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError, BadRequest
from appliance.kinds import diarized
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Transcriber, VoicePrinter
from appliance.kinds.counting import counted
from appliance.kinds.diarize import SpeakerCount
from appliance.kinds.diarized import Who
from appliance.kinds.speech_api import FORMATS, SAMPLE_RATE, SUBTITLES, Options, Segment, render, word_json
from appliance.kinds.streaming import begun, guarded, query_flag, whole
from appliance.protocol.json_reader import JsonReader
from appliance.protocol.json_text import ELEMENT_BYTES
from appliance.protocol.messages import Request, Response, json_response
from appliance.tasks import off_loop

FIELDS = {
    "file",
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "stream",
    "timestamp_granularities[]",
    "chunking_strategy",
    "include[]",
    "noise_reduction",
    "known_speaker_names[]",
    "known_speaker_references[]",
    "min_speakers",  # the box's own: bounds on the speaker count a diarization finds
    "max_speakers",
}
# list fields: one part per element
REPEATED = ("timestamp_granularities[]", "include[]", "known_speaker_names[]", "known_speaker_references[]")
GRANULARITIES = ("segment", "word")
DIARIZED = "diarized_json"  # OpenAI's answer with speakers
MAX_FIELD_BYTES = 64 * 1024  # any form field but the file and the speakers' clips
# a known speaker's clip as a data URL: 10 s of 48 kHz stereo PCM16 in base64 (the body limit bounds them all)
MAX_CLIP_BYTES = 4 * 1024 * 1024
SEGMENT_BYTES = 128 * ELEMENT_BYTES  # a segment's row, cue or line costs as much as this many values written

Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]


def routes(models: dict[str, ServedModel]) -> list[tuple[str, re.Pattern[str], str, Handler]]:
    """(method, path pattern, endpoint label, handler) for the API core's route table."""

    async def transcriptions(request: Request, params: dict[str, str]) -> Response:
        return await openai_errors(answer(models, request, "transcribe"))

    async def translations(request: Request, params: dict[str, str]) -> Response:
        return await openai_errors(answer(models, request, "translate"))

    return [
        ("POST", re.compile(r"/v1/audio/transcriptions"), "openai_transcriptions", transcriptions),
        ("POST", re.compile(r"/v1/audio/translations"), "openai_translations", translations),
    ]


def parse_form(request: Request) -> tuple[dict[str, str], dict[str, list[str]], bytes]:
    """The form's text fields, its list fields (REPEATED) and the file's bytes; a 400 naming what is
    wrong with the form."""
    fields: dict[str, str] = {}
    lists: dict[str, list[str]] = {name: [] for name in REPEATED}
    files: list[bytes] = []

    def on_field(name: str, value: bytes) -> None:
        limit = MAX_CLIP_BYTES if name == "known_speaker_references[]" else MAX_FIELD_BYTES
        if len(value) > limit:
            raise BadRequest(f"form field {name!r} is longer than {limit} bytes")
        if name in lists:
            lists[name].append(value.decode(errors="replace"))
        else:
            fields[name] = value.decode(errors="replace")

    def on_file(file: Any) -> None:
        if file.field_name != b"file":
            raise BadRequest(f"form field {file.field_name.decode(errors='replace')!r} is a file; only 'file' may be")
        file.file_object.seek(0)
        files.append(file.file_object.read())

    read_multipart(request, on_field, on_file)
    if not files:
        raise BadRequest("the form has no 'file' part: send the audio as the file field", param="file")
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown form field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})", param=unknown[0])
    return fields, lists, files[0]


async def answer(models: dict[str, ServedModel], request: Request, task: str) -> Response:
    fields, lists, audio = await off_loop(len(request.body), parse_form, request)  # a 64 MiB form: not on the loop
    if task == "translate" and "language" in fields:
        raise BadRequest(
            "translations take no 'language': the speech's language is detected, the text is English", param="language"
        )
    language = fields.get("language", "").lower() or None
    model = openai_models.speech_to_text(models, fields.get("model", ""), task, language)
    response_format = fields.get("response_format", "json")
    if response_format not in (*FORMATS, DIARIZED):
        raise BadRequest(
            f"response_format must be one of {', '.join(FORMATS)}, {DIARIZED}, got {response_format[:40]!r}",
            param="response_format",
        )
    try:
        temperature = float(fields.get("temperature", "0"))
    except ValueError:
        raise BadRequest(
            f"temperature must be a number, got {fields['temperature'][:40]!r}", param="temperature"
        ) from None
    granularities = lists["timestamp_granularities[]"]
    for granularity in granularities:
        if granularity not in GRANULARITIES:
            raise BadRequest(
                f"timestamp_granularities[] must be segment or word, got {granularity[:40]!r}",
                param="timestamp_granularities[]",
            )
    _check_chunking(fields.get("chunking_strategy", "auto"))
    try:
        stream = query_flag(fields, "stream", where="form field")
    except ApiError as exc:
        raise ApiError(exc.message, exc.status, param="stream") from None
    asked = speakers.asked(fields, lists, response_format == DIARIZED)
    # subtitles are cut at the words, and a diarization gives each word its speaker
    words = "word" in granularities or response_format in SUBTITLES or asked
    options = Options(language, task, fields.get("prompt", ""), temperature, words)
    try:
        model.check(options)
    except ApiError as exc:
        param = "temperature" if not 0.0 <= temperature <= 1.0 else "language" if language else "model"
        raise ApiError(exc.message, exc.status, param=param) from None
    noise = fields.get("noise_reduction", "none")
    if noise not in ("none", *MODES):
        raise BadRequest(
            f"noise_reduction must be none, near_field or far_field, got {noise[:40]!r}", param="noise_reduction"
        )
    printer = speakers.printer(models) if asked else None
    who = speakers.count(fields, lists) if asked else None
    quieter = noise != "none"
    times = RequestTimes()  # filled by its shards' engine calls: the statistics' queue and compute
    transcribed = _transcribed(
        model, audio, options, response_format, stream, granularities, printer, who, lists, quieter, times
    )
    return await counted(model.stats, transcribed, times)


async def _transcribed(
    model: Transcriber,
    audio: bytes,
    options: Options,
    response_format: str,
    stream: bool,
    granularities: list[str],
    printer: VoicePrinter | None,
    count: SpeakerCount | None,
    lists: dict[str, list[str]],
    quieter: bool,
    times: RequestTimes,
) -> Response:
    samples = await model.recording(audio)
    if quieter:  # RNNoise, some 50 ms a second of audio: a long recording's off the loop
        samples = await off_loop(samples.nbytes, denoise, samples)
    segments = model.transcribe(samples, options, times)
    if printer is not None and count is not None:
        who = Who(count, await speakers.known(printer, model, lists))
        segments = diarized.labelled(segments, asyncio.ensure_future(diarized.timeline(printer, samples, who)))
    duration = len(samples) / SAMPLE_RATE
    if stream:
        diarizing = response_format == DIARIZED
        events = _events(await begun(segments), model.name, "word" in granularities, diarizing, duration)
        return Response(200, content_type="text/event-stream", stream=events)
    found = await whole(segments)
    # an hour's transcript (900 segments) took 25 to 50 ms to write as SRT or verbose_json with its words
    weight = sum(SEGMENT_BYTES + len(s.words) * ELEMENT_BYTES for s in found)
    if response_format == DIARIZED:
        return await off_loop(weight, lambda: json_response(200, diarized.diarized_json(found, duration)))
    shown = tuple(granularities) or ("segment",)
    return await off_loop(weight, render, found, response_format, options.task, duration, shown)


def _check_chunking(value: str) -> None:
    """`auto`, or OpenAI's server_vad object (its thresholds are the box's [vad] config here)."""
    if value == "auto":
        return
    try:
        doc = JsonReader.read(value.encode(), tensors=False)  # bounded: depth and values
    except BadRequest:
        doc = None
    if not isinstance(doc, dict) or doc.get("type") != "server_vad":
        raise BadRequest(
            f"chunking_strategy must be 'auto' or a server_vad object, got {value[:60]!r}", param="chunking_strategy"
        )


def _events(
    segments: AsyncIterator[Segment], model: str, words: bool, diarizing: bool, duration: float
) -> AsyncGenerator[bytes, None]:
    """Server-sent events as OpenAI streams a transcription: a delta per segment (with its words when
    asked), then the whole text (and every word). Diarized (diarized_json): each delta names its
    segment, and a `transcript.text.segment` event with its speaker follows it."""
    texts: list[str] = []
    every: list[dict[str, Any]] = []

    def delta(segment: Segment) -> bytes:
        texts.append(segment.text)
        doc: dict[str, Any] = {"type": "transcript.text.delta", "delta": (" " if len(texts) > 1 else "") + segment.text}
        if words:
            doc["words"] = [word_json(w) for w in segment.words]
            every.extend(doc["words"])
        if not diarizing:
            return _event(doc)
        event = diarized.segment_event(len(texts) - 1, segment)
        return _event(doc | {"segment_id": event["id"]}) + _event(event)

    def done(count: int) -> bytes:
        doc: dict[str, Any] = {"type": "transcript.text.done", "text": " ".join(texts)}
        if words:
            doc["words"] = every
        if diarizing:
            doc["usage"] = {"type": "duration", "seconds": round(duration, 3)}
        return _event(doc)

    return guarded(
        segments,
        delta,
        lambda message: _event({"type": "error", "error": {"message": message}}),
        f"streamed transcription by {model}",
        {"MODEL": model},
        done,
    )


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"
