"""OpenAI's audio API on the box: POST /v1/audio/transcriptions and /v1/audio/translations.

A multipart form (python-multipart parses it): `file`, `model`, `language` (transcriptions only),
`prompt`, `response_format` (json | text | verbose_json | srt | vtt), `temperature`, `stream` (true:
server-sent events, a `transcript.text.delta` per segment as it is decoded, then `transcript.text.done`).
`model` names a speech_to_text model of the firmware; OpenAI's own names (whisper-1, ...) take the
first one that can do the task, so the official client works unchanged.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any

from python_multipart import FormParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from appliance.api.bodies import MAX_FORM_FIELDS, openai_errors, refused
from appliance.errors import BadRequest, NotFound
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Transcriber
from appliance.kinds.speech_api import FORMATS, SAMPLE_RATE, Options, Segment, render
from appliance.kinds.streaming import guarded, query_flag
from appliance.protocol.messages import Request, Response

FIELDS = {
    "file",
    "model",
    "language",
    "prompt",
    "response_format",
    "temperature",
    "stream",
    "timestamp_granularities[]",
}
MAX_FIELD_BYTES = 64 * 1024  # any form field but the file

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


def parse_form(request: Request) -> tuple[dict[str, str], bytes]:
    """The form's text fields and the file's bytes; a 400 naming what is wrong with the form."""
    content_type = request.headers.get("content-type", "")
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise BadRequest(f"send multipart/form-data with a boundary (got content-type {content_type[:60]!r})")
    fields: dict[str, str] = {}
    files: list[bytes] = []
    parts = 0

    def count_part() -> None:
        nonlocal parts
        parts += 1
        if parts > MAX_FORM_FIELDS:
            raise refused(400, f"the form has more than {MAX_FORM_FIELDS} parts")

    def on_field(field: Any) -> None:
        count_part()
        name = field.field_name.decode(errors="replace")
        value = field.value or b""
        if len(value) > MAX_FIELD_BYTES:
            raise BadRequest(f"form field {name!r} is longer than {MAX_FIELD_BYTES} bytes")
        fields[name] = value.decode(errors="replace")

    def on_file(file: Any) -> None:
        count_part()
        if file.field_name != b"file":
            raise BadRequest(f"form field {file.field_name.decode(errors='replace')!r} is a file; only 'file' may be")
        file.file_object.seek(0)
        files.append(file.file_object.read())

    # the body is in memory already (bounded by the server's body limit): keep parts there too
    config = {"MAX_MEMORY_FILE_SIZE": float("inf")}
    try:
        parser = FormParser("multipart/form-data", on_field, on_file, boundary=options[b"boundary"], config=config)
        parser.write(request.body)
        parser.finalize()
    except FormParserError as exc:
        raise BadRequest(f"malformed multipart form: {' '.join(str(exc).split())}") from None
    if not files:
        raise BadRequest("the form has no 'file' part: send the audio as the file field")
    unknown = sorted(set(fields) - FIELDS)
    if unknown:
        raise BadRequest(f"unknown form field {unknown[0]!r} (known: {', '.join(sorted(FIELDS))})")
    return fields, files[0]


def pick_model(models: dict[str, ServedModel], name: str, task: str) -> Transcriber:
    speech = [m for m in models.values() if isinstance(m, Transcriber)]
    if not name:
        raise BadRequest("the form needs a 'model' field")
    chosen = models.get(name)
    if chosen is not None:
        if not isinstance(chosen, Transcriber):
            raise BadRequest(f"model {name!r} is a {chosen.spec.kind} model, not speech_to_text")
        return chosen
    able = [m for m in speech if task == "transcribe" or m.multilingual]
    if name.startswith(("whisper", "gpt-")) and able:  # OpenAI's names: the box's first model that can
        return able[0]
    served = ", ".join(m.name for m in speech) or "none"
    raise NotFound(f"no speech_to_text model {name!r} (served: {served})")


async def answer(models: dict[str, ServedModel], request: Request, task: str) -> Response:
    fields, audio = await asyncio.to_thread(parse_form, request)  # a whole recording: off the loop
    model = pick_model(models, fields.get("model", ""), task)
    if task == "translate" and "language" in fields:
        raise BadRequest("translations take no 'language': the speech's language is detected, the text is English")
    response_format = fields.get("response_format", "json")
    if response_format not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}")
    try:
        temperature = float(fields.get("temperature", "0"))
    except ValueError:
        raise BadRequest(f"temperature must be a number, got {fields['temperature'][:40]!r}") from None
    if fields.get("timestamp_granularities[]", "segment") != "segment":
        raise BadRequest("timestamp_granularities: only 'segment' is served (no word timestamps)")
    stream = query_flag(fields, "stream", where="form field")
    options = Options(fields.get("language") or None, task, fields.get("prompt", ""), temperature)
    model.check(options)
    samples = await asyncio.to_thread(model.recording, audio)
    segments = model.transcribe(samples, options)
    if stream:
        return Response(200, content_type="text/event-stream", stream=_events(segments, model.name))
    found = [s async for s in segments]
    return render(found, response_format, task, len(samples) / SAMPLE_RATE)


def _events(segments: AsyncIterator[Segment], model: str) -> AsyncGenerator[bytes, None]:
    """Server-sent events as OpenAI streams a transcription: a delta per segment, then the whole text."""
    texts: list[str] = []

    def delta(segment: Segment) -> bytes:
        texts.append(segment.text)
        return _event({"type": "transcript.text.delta", "delta": (" " if len(texts) > 1 else "") + segment.text})

    return guarded(
        segments,
        delta,
        lambda message: _event({"type": "error", "error": {"message": message}}),
        f"streamed transcription by {model}",
        {"MODEL": model},
        lambda count: _event({"type": "transcript.text.done", "text": " ".join(texts)}),
    )


def _event(doc: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(doc, separators=(",", ":")).encode() + b"\n\n"
