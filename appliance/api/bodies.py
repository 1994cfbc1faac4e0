"""Request bodies of the task APIs (OpenAI, LibreTranslate): a JSON object, or a urlencoded or multipart
form; and errors in OpenAI's shape for its routes."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import parse_qsl

from python_multipart import FormParser
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import parse_options_header

from appliance.errors import ApiError, BadRequest
from appliance.protocol.json_reader import BeyondBounds, JsonReader
from appliance.protocol.limits import LIMITS_BITTEN
from appliance.protocol.messages import Request, Response, json_response, openai_error
from appliance.tasks import PARSE_OFF_LOOP_BYTES, off_loop_past

FORM = "application/x-www-form-urlencoded"
MULTIPART = "multipart/form-data"
MAX_TEXT_BODY_BYTES = 2 << 20  # a JSON or form body of a task route: texts and options, never media
MAX_TEXT_VALUES = 4096  # JSON values in such a body (a list of texts to translate, say)
MAX_FORM_FIELDS = 32  # fields of a urlencoded form, parts of a multipart one


def refused(status: int, message: str) -> ApiError:
    """A body refused by a bound (logged at most once per limit every 10 s, as the transports' are)."""
    LIMITS_BITTEN.bit(f"body {status}", message)
    return ApiError(message, status)


async def json_body(request: Request) -> dict[str, Any]:
    """The JSON object a task route's body holds, read by the bounded reader (depth and value count),
    its size checked before anything is parsed."""
    return await _off_the_loop(_json_object, request.body)


async def json_or_form(request: Request) -> dict[str, Any]:
    """The fields of a JSON body, or of a urlencoded or multipart form where the content type says so
    and the body is not a JSON object (`curl -d '{...}'` labels JSON as a form)."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if kind not in (FORM, MULTIPART) or request.body.lstrip()[:1] == b"{":
        return await json_body(request)
    if kind == MULTIPART:
        return await _off_the_loop(lambda _: _text_fields(request), request.body)
    return await _off_the_loop(_form, request.body)


async def _off_the_loop(read: Callable[[bytes], dict[str, Any]], body: bytes) -> dict[str, Any]:
    if len(body) > MAX_TEXT_BODY_BYTES:
        raise refused(
            413, f"request body of {len(body)} bytes exceeds this route's limit of {MAX_TEXT_BODY_BYTES} bytes"
        )
    return await off_loop_past(PARSE_OFF_LOOP_BYTES, len(body), read, body)


def _json_object(body: bytes) -> dict[str, Any]:
    try:
        doc = JsonReader.read(body, tensors=False, max_values=MAX_TEXT_VALUES)
    except BeyondBounds as exc:
        raise refused(exc.status, exc.message) from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def read_multipart(request: Request, on_field: Callable[[str, bytes], None], on_file: Callable[[Any], None]) -> None:
    """A multipart/form-data body read part by part (python-multipart): each text field's name and value
    to `on_field`, each file part to `on_file`; a 400 naming what is wrong with the form."""
    content_type = request.headers.get("content-type", "")
    kind, options = parse_options_header(content_type)
    if kind != b"multipart/form-data" or b"boundary" not in options:
        raise BadRequest(f"send multipart/form-data with a boundary (got content-type {content_type[:60]!r})")
    parts = 0

    def counted(handle: Callable[[Any], None]) -> Callable[[Any], None]:
        def part(found: Any) -> None:
            nonlocal parts
            parts += 1
            if parts > MAX_FORM_FIELDS:
                raise refused(400, f"the form has more than {MAX_FORM_FIELDS} parts")
            handle(found)

        return part

    def field(found: Any) -> None:
        on_field(found.field_name.decode(errors="replace"), found.value or b"")

    # the body is in memory already (bounded by the server's body limit): keep parts there too
    config = {"MAX_MEMORY_FILE_SIZE": float("inf")}
    try:
        boundary = options[b"boundary"]
        parser = FormParser("multipart/form-data", counted(field), counted(on_file), boundary=boundary, config=config)
        parser.write(request.body)
        parser.finalize()
    except FormParserError as exc:
        raise BadRequest(f"malformed multipart form: {' '.join(str(exc).split())}") from None


def _text_fields(request: Request) -> dict[str, Any]:
    """A multipart form of text fields alone (`curl -F q=...`, as LibreTranslate's Flask reads it)."""
    fields: dict[str, Any] = {}

    def on_field(name: str, value: bytes) -> None:
        try:
            fields[name] = value.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(f"form field {name[:40]!r} is not UTF-8 text") from None

    def on_file(found: Any) -> None:
        raise BadRequest(f"form field {found.field_name.decode(errors='replace')[:40]!r} is a file; send text")

    read_multipart(request, on_field, on_file)
    return fields


def _form(body: bytes) -> dict[str, Any]:
    if body.count(b"&") >= MAX_FORM_FIELDS:
        raise refused(400, f"form body has more than {MAX_FORM_FIELDS} fields")
    try:
        return dict(parse_qsl(body.decode("utf-8"), keep_blank_values=True, errors="strict"))
    except UnicodeDecodeError:
        raise BadRequest("form body is not UTF-8 text") from None


async def openai_errors(answering: Awaitable[Response]) -> Response:
    """An error in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, so its clients show the message."""
    try:
        return await answering
    except ApiError as exc:
        response = json_response(exc.status, openai_error(exc.status, exc.message, exc.param))
        response.headers += exc.headers
        return response
