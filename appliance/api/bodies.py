"""Request bodies of the task APIs (OpenAI, LibreTranslate): a JSON object, or a urlencoded form; and
errors in OpenAI's shape for its routes."""

from __future__ import annotations

import json
from collections.abc import Awaitable
from typing import Any
from urllib.parse import parse_qsl

from appliance.errors import ApiError, BadRequest
from appliance.protocol.messages import Request, Response, json_response, openai_error

FORM = "application/x-www-form-urlencoded"


def json_body(body: bytes) -> dict[str, Any]:
    try:
        doc = json.loads(body)
    except UnicodeDecodeError:
        raise BadRequest("request body is not UTF-8 text") from None
    except ValueError as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise BadRequest("request body must be a JSON object")
    return doc


def json_or_form(request: Request) -> dict[str, Any]:
    """The fields of a JSON body, or of a urlencoded form where the content type says so and the body
    is not a JSON object (`curl -d '{...}'` labels JSON as a form)."""
    is_form = request.headers.get("content-type", "").split(";")[0].strip().lower() == FORM
    if not is_form or request.body.lstrip()[:1] == b"{":
        return json_body(request.body)
    try:
        return dict(parse_qsl(request.body.decode("utf-8"), keep_blank_values=True, errors="strict"))
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
