"""One streaming wrapper and one `stream=` for every route that answers piece by piece.

A streamed answer's status goes out with its first piece: `begun` waits for that piece, so a request
refused before it began (its queue's timeout: a 503) is answered so. A failure later in the stream
cannot become an error status: `guarded` ends the stream with the format's own error piece (an NDJSON
`{"error": ...}` line, a server-sent `error` event; raw audio just ends), logs an unexpected failure
once with its context, and always closes the source, so a client gone mid-stream stops the work
behind it. `query_flag` is the one reading of a true/false query or form value (`stream` and others).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from typing import Any, TypeVar

from appliance.errors import ApiError, BadRequest
from appliance.protocol.messages import Response, json_line

log = logging.getLogger("appliance.api")

T = TypeVar("T")
TRUE, FALSE = ("1", "true", "yes"), ("0", "false", "no")
NDJSON = "application/x-ndjson"


async def whole(items: AsyncGenerator[T, None]) -> list[T]:
    """Every item of an answer produced piece by piece (a transcription's segments), the generator
    closed at once if the caller is cancelled (its client left): its work stops now, not when the
    garbage collector finds the generator."""
    async with contextlib.aclosing(items) as found:
        return [item async for item in found]


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


_NOTHING: Any = object()


async def begun(pieces: AsyncGenerator[T, None]) -> AsyncGenerator[T, None]:
    """`pieces`, once its first piece is ready: an error before it raises here (the answer's status),
    and the source is closed; the generator returned yields that first piece and the rest."""
    try:
        first = await anext(pieces, _NOTHING)
    except BaseException:
        await pieces.aclose()
        raise

    async def rest() -> AsyncGenerator[T, None]:
        async with contextlib.aclosing(pieces):
            if first is _NOTHING:
                return
            yield first
            async for piece in pieces:
                yield piece

    return rest()


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


async def ndjson(
    pieces: AsyncGenerator[T, None],
    line: Callable[[T], Any],
    summary: Callable[[int], dict[str, Any]],
    what: str,
    context: Mapping[str, str],
) -> Response:
    """A 200 whose body is a JSON line per piece as soon as it is ready, then `summary(count)` with "done"
    (or an `{"error": ...}` line); sent once the first piece is ready (an error before it is the status)."""
    lines = guarded(
        await begun(pieces),
        lambda piece: json_line(line(piece)),
        lambda message: json_line({"error": message}),
        what,
        context,
        lambda count: json_line({**summary(count), "done": True}),
    )
    return Response(200, content_type=NDJSON, stream=lines)
