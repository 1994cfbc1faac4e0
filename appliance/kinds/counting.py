"""Every route that runs a model counts in that model's Triton statistics, as an infer call does: a
request that ends well is a success, one that fails (an error status, an exception, a stream cut
short) a failure, and either sets last_inference. A streamed answer counts when its stream ends; a
Wyoming transcription when its transcript is sent."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator

from appliance.engine.stats import ModelStats, RequestTimes
from appliance.protocol.messages import Response


def _recorder(stats: ModelStats, times: RequestTimes | None = None) -> Callable[[bool], None]:
    """Records one request of `stats`' model, timed from now, once called with whether it ended well."""
    started, spent = time.perf_counter_ns(), times or RequestTimes()

    def record(ok: bool) -> None:
        stats.record_request(ok, time.perf_counter_ns() - started, spent, time.time_ns() // 1_000_000)

    return record


@contextlib.contextmanager
def recorded(stats: ModelStats) -> Iterator[RequestTimes]:
    """What the block does, recorded as one request of `stats`' model, its queue and compute the times
    it yields (for the block's engine calls to fill): a failure if it raises."""
    times = RequestTimes()
    record = _recorder(stats, times)
    try:
        yield times
    except BaseException:
        record(False)
        raise
    record(True)


async def counted(stats: ModelStats, answering: Awaitable[Response], times: RequestTimes | None = None) -> Response:
    """The route's answer, recorded in `stats` once it is known (at the end of its stream, if streamed)."""
    record = _recorder(stats, times)
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
