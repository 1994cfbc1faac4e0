"""Batching of stateless work across requests: the shards (sentences, phonemes) of every waiting
request run together, up to `max_batch` per engine call, on a thread of their own.

Theory of operation. A request submits its shards in order and awaits their futures in order, so
its results go back in order and a streamed answer can send each one as soon as it is done. The
queue takes the waiting shards with the lowest shard index first (then the oldest), so every
waiting request's first shard goes before anyone's second: a new request's first sentence is not
held up behind a long text. Only shards of one `group` run together (speech at one speed: the
graph takes one set of scales per call), and at most `per_request` shards of one request, where
the kind sets it. Shards that arrive while a batch runs join the next one. A cancelled future
(the client went away) drops its shard if it has not started.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from appliance.engine.stats import ModelStats

COMING_WAIT_S = 0.2  # the longest a batch waits for shards `coming` says are on their way
COMING_POLL_S = 0.005
T = TypeVar("T")
R = TypeVar("R")


@dataclass(frozen=True, slots=True)
class Done(Generic[R]):
    """A shard's result and how long it waited for its batch (Triton's queue time)."""

    result: R
    queued_ns: int


@dataclass(eq=False, slots=True)
class _Shard(Generic[T, R]):
    payload: T
    group: Hashable
    owner: int
    order: tuple[int, int]
    future: asyncio.Future[Done[R]]
    queued_ns: int = field(default_factory=time.perf_counter_ns)


class BatchQueue(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], list[R]],
        max_batch: int,
        stats: ModelStats,
        queue_delay_s: Callable[[], float] = lambda: 0.0,
        per_request: int | None = None,
        coming: Callable[[], bool] = lambda: False,
    ) -> None:
        """`run_batch` runs on the queue's thread; each call is an execution in `stats`. `coming`: whether
        shards are about to arrive (speech to text: a recording is in its VAD); a batch that is not full
        and holds no urgent shard waits for them up to COMING_WAIT_S."""
        self.run_batch, self.max_batch, self.stats, self.queue_delay_s = run_batch, max_batch, stats, queue_delay_s
        self.per_request, self.coming = per_request or max_batch, coming
        self._waiting: list[_Shard[T, R]] = []
        self._running = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch")
        self._owners, self._arrivals = itertools.count(), itertools.count()

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or self._running > 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-queue")

    async def stop(self, timeout_s: float) -> bool:
        """Finish the batch under way; False when it did not finish within `timeout_s` (wedged)."""
        deadline = time.monotonic() + timeout_s
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        finished = not self._running
        if self._task is not None:
            self._task.cancel()
        self._thread.shutdown(wait=finished, cancel_futures=True)
        return finished

    def submit(self, payloads: list[T], group: Hashable = None, urgent: bool = False) -> list[asyncio.Future[Done[R]]]:
        """Queue one request's shards, in order; a future per shard. `urgent` shards (a live stream's)
        go before every waiting shard that is not."""
        loop, owner = asyncio.get_running_loop(), next(self._owners)
        futures: list[asyncio.Future[Done[R]]] = []
        for index, payload in enumerate(payloads):
            future: asyncio.Future[Done[R]] = loop.create_future()
            order = (-1 if urgent else index, next(self._arrivals))
            self._waiting.append(_Shard(payload, group, owner, order, future))
            futures.append(future)
        self._wake.set()
        return futures

    def _take(self) -> list[_Shard[T, R]]:
        """The next batch: one group, lowest shard index first, at most per_request of one request."""
        self._waiting = [s for s in self._waiting if not s.future.done()]
        if not self._waiting:
            return []
        self._waiting.sort(key=lambda s: s.order)
        group = self._waiting[0].group
        taken: list[_Shard[T, R]] = []
        left: list[_Shard[T, R]] = []
        per_owner: dict[int, int] = {}
        for shard in self._waiting:
            count = per_owner.get(shard.owner, 0)
            if len(taken) < self.max_batch and shard.group == group and count < self.per_request:
                taken.append(shard)
                per_owner[shard.owner] = count + 1
            else:
                left.append(shard)
        self._waiting = left
        return taken

    async def _wait_for_coming(self) -> None:
        waited = 0.0
        while waited < COMING_WAIT_S and self.coming() and len(self._waiting) < self.max_batch:
            if any(s.order[0] < 0 for s in self._waiting):
                return  # a live shard goes now
            await asyncio.sleep(COMING_POLL_S)
            waited += COMING_POLL_S

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if (delay := self.queue_delay_s()) > 0 and len(self._waiting) < self.max_batch:
                await asyncio.sleep(delay)  # Triton's max queue delay: let others join
            await self._wait_for_coming()
            while batch := self._take():
                self._running = len(batch)
                started = time.perf_counter_ns()
                try:
                    results = await loop.run_in_executor(self._thread, self.run_batch, [s.payload for s in batch])
                except Exception as exc:  # the batch's requests get the error; the queue serves on
                    for shard in batch:
                        if not shard.future.done():
                            shard.future.set_exception(exc)
                else:
                    for shard, result in zip(batch, results):
                        if not shard.future.done():
                            shard.future.set_result(Done(result, started - shard.queued_ns))
                finally:
                    self._running = 0
                self.stats.record_execution(len(batch), 0, time.perf_counter_ns() - started, 0)
