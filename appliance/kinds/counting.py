"""Every route that runs a model counts in that model's Triton statistics, as an infer call does: a
request that ends well is a success, one that fails (an error status, an exception, a stream cut
short) a failure, and either sets last_inference. A streamed answer counts when its stream ends."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable

from appliance.engine.stats import ModelStats, RequestTimes
from appliance.protocol.messages import Response


async def counted(stats: ModelStats, answering: Awaitable[Response], times: RequestTimes | None = None) -> Response:
    """The route's answer, recorded in `stats` once it is known (at the end of its stream, if streamed)."""
    started, spent = time.perf_counter_ns(), times or RequestTimes()

    def record(ok: bool) -> None:
        stats.record_request(ok, time.perf_counter_ns() - started, spent, time.time_ns() // 1_000_000)

    try:
        response = await answering
    except BaseException:
        record(False)
        raise
    if response.stream is None:
        record(response.status < 400)
        return response
    return dataclasses.replace(response, stream=_recorded(response.stream, record))


async def _recorded(stream: AsyncGenerator[bytes, None], record: Callable[[bool], None]) -> AsyncGenerator[bytes, None]:
    ok = False
    try:
        async for piece in stream:
            yield piece
        ok = True
    finally:
        record(ok)
        await stream.aclose()
