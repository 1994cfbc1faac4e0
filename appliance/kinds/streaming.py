"""One streaming wrapper and one `stream=` for every route that answers piece by piece.

A streamed answer's status has gone out before its work is done, so a failure during the stream
cannot become an error status: `guarded` ends the stream with the format's own error piece (an NDJSON
`{"error": ...}` line, a server-sent `error` event; raw audio just ends), logs an unexpected failure
once with its context, and always closes the source, so a client gone mid-stream stops the work
behind it. `query_flag` is the one reading of a true/false query or form value (`stream` and others).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from appliance.errors import ApiError, BadRequest
from appliance.protocol.messages import Response, json_line

log = logging.getLogger("appliance.api")

T = TypeVar("T")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")
NDJSON = "application/x-ndjson"


def query_flag(values: dict[str, str], name: str, default: bool = False, where: str = "query parameter") -> bool:
    """`values[name]` (removed) as true or false; anything else is a 400 naming it (`where`: what holds it)."""
    raw = values.pop(name, None)
    if raw is None:
        return default
    if raw.lower() in TRUE:
        return True
    if raw.lower() in FALSE:
        return False
    shown = repr(raw) if len(raw) <= 40 else repr(raw[:37]) + "..."
    raise BadRequest(f"{where} {name}: {shown} is not true or false")


async def guarded(
    pieces: AsyncIterator[T],
    encode: Callable[[T], bytes],
    error: Callable[[str], bytes],
    what: str,
    context: Mapping[str, str],
    last: Callable[[int], bytes] | None = None,
    head: bytes = b"",
) -> AsyncGenerator[bytes, None]:
    """`head`, each piece as `encode` writes it, then `last(count)`; a failure ends the stream with
    `error(message)` (an unexpected one logged as `what` crashing, with `context` as the log's fields)."""
    count = 0
    try:
        if head:
            yield head
        async for piece in pieces:
            count += 1
            yield encode(piece)
        if last is not None:
            yield last(count)
    except ApiError as exc:
        log.warning("%s ended early: %s", what, exc.message, extra=dict(context))
        if ending := error(exc.message):
            yield ending
    except Exception:
        log.exception("%s crashed while streaming", what, extra=dict(context))
        if ending := error("internal error (logged)"):
            yield ending
    finally:
        close = getattr(pieces, "aclose", None)
        if close is not None:
            await close()


def ndjson(
    pieces: AsyncIterator[T],
    line: Callable[[T], Any],
    summary: Callable[[int], dict[str, Any]],
    what: str,
    context: Mapping[str, str],
) -> Response:
    """A 200 whose body is a JSON line per piece as soon as it is ready, then `summary(count)` with "done"
    (or an `{"error": ...}` line)."""
    lines = guarded(
        pieces,
        lambda piece: json_line(line(piece)),
        lambda message: json_line({"error": message}),
        what,
        context,
        lambda count: json_line({**summary(count), "done": True}),
    )
    return Response(200, content_type=NDJSON, stream=lines)
