"""Batching of stateless work across requests: the shards (sentences, phonemes) of every waiting
request run together, up to `max_batch` per engine call, on a thread of their own.

Theory of operation. A request submits its shards in order and awaits their futures in order, so
its results go back in order and a streamed answer can send each one as soon as it is done. The
queue takes the waiting shards with the lowest shard index first (then the oldest), so every
waiting request's first shard goes before anyone's second: a new request's first sentence is not
held up behind a long text. Only shards of one `group` run together (speech at one speed: the
graph takes one set of scales per call), and at most `per_request` shards of one request, where
the kind sets it. Shards that arrive while a batch runs join the next one. A cancelled future
(the client went away) drops its shard if it has not started, and the results of one that ran meanwhile.
The model's QueuePolicy bounds the requests waiting and how long a request waits to begin (a 503 past either).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, TypeVar

from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats
from appliance.errors import Unavailable
from appliance.tasks import failpoint, spawn

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
    queued_ns: int


class BatchQueue(Generic[T, R]):
    def __init__(
        self,
        run_batch: Callable[[list[T]], list[R]],
        max_batch: int,
        stats: ModelStats,
        policy: QueuePolicy,
        per_request: int | None = None,
        coming: Callable[[], bool] = lambda: False,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """`run_batch` runs on the queue's thread; each call is an execution in `stats`. `coming`: whether
        shards are about to arrive (speech to text: a recording is in its VAD); a batch that is not full
        and holds no urgent shard waits for them up to COMING_WAIT_S. `clock_ns` times the waits that
        the queue policy judges (a test's own clock)."""
        self.run_batch, self.max_batch, self.stats, self.policy = run_batch, max_batch, stats, policy
        self.clock_ns = clock_ns
        self.per_request, self.coming = per_request or max_batch, coming
        self._waiting: list[_Shard[T, R]] = []
        self._running = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch")
        self._owners, self._arrivals = itertools.count(), itertools.count()

    @property
    def busy(self) -> bool:
        return self.waiting > 0 or self._running > 0

    @property
    def waiting(self) -> int:
        """Shards waiting for a batch (those whose caller went away are not: the next batch drops them)."""
        return sum(not s.future.done() for s in self._waiting)

    def start(self) -> None:
        self._task = spawn(self._run(), f"the batch queue of model {self.policy.model}", self._crashed)

    def _crashed(self, error: BaseException) -> None:
        """The queue's loop died (a bug of ours, logged by spawn): its requests get a 500 naming the
        model now instead of waiting forever, and a new loop serves the next ones."""
        failed = Unavailable(f"model {self.policy.model}: its batch queue crashed (logged); retry", 500)
        for shard in self._waiting:
            if not shard.future.done():
                shard.future.set_exception(failed)
        self._waiting, self._running = [], 0
        self.stats.crashes += 1
        if self._task is not None:  # not stopped meanwhile
            self.start()

    async def stop(self, timeout_s: float) -> bool:
        """Finish the batch under way; False when it did not finish within `timeout_s` (wedged)."""
        deadline = time.monotonic() + timeout_s
        while self._running and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        finished = not self._running
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._thread.shutdown(wait=finished, cancel_futures=True)
        return finished

    def submit(
        self,
        payloads: list[T],
        group: Hashable = None,
        urgent: bool = False,
        owner: int | None = None,
        first_index: int = 0,
    ) -> list[asyncio.Future[Done[R]]]:
        """Queue one request's shards, in order; a future per shard. `urgent` shards (a live stream's)
        go before every waiting shard that is not, and are never refused. A request that submits its
        shards a few at a time passes the index of the first (its place in the request: lower indices
        go first, and only index 0 can time out) and its `owner` (from `new_owner`, which admits it),
        or no owner to have each submission admitted on its own (Whisper's shards); one that submits
        them at once is admitted here."""
        loop = asyncio.get_running_loop()
        if owner is None:
            owner = self.new_owner(urgent)
        futures: list[asyncio.Future[Done[R]]] = []
        for index, payload in enumerate(payloads, first_index):
            future: asyncio.Future[Done[R]] = loop.create_future()
            future.add_done_callback(self._count_cancelled)
            order = (-1 if urgent else index, next(self._arrivals))
            self._waiting.append(_Shard(payload, group, owner, order, future, self.clock_ns()))
            futures.append(future)
        self._wake.set()
        return futures

    def _count_cancelled(self, future: asyncio.Future[Done[R]]) -> None:
        if future.cancelled():  # its caller went away: the shard leaves the queue, or its result is dropped
            self.stats.dropped += 1

    def new_owner(self, urgent: bool = False) -> int:
        """A new request's id among the shards; refused (QueueFull) when the queue is at its bound."""
        if not urgent:
            self.check_room()
        return next(self._owners)

    def check_room(self) -> None:
        """Refuse (QueueFull) a request now when the queue is at its bound: before its upload is decoded,
        so that under overload the box does not spend the work and memory of decoding what it refuses."""
        self.policy.admit(len({s.owner for s in self._waiting if not s.future.done()}))

    def _take(self) -> list[_Shard[T, R]]:
        """The next batch: one group, lowest shard index first, at most per_request of one request."""
        now, kept = self.clock_ns(), []
        for shard in self._waiting:
            if shard.future.done():  # its caller went away (counted then)
                continue
            # only a request's first shard can wait too long: once it has begun, its answer may be under
            # way and its later shards are its own (urgent ones, a live stream's, are never refused)
            if shard.order[0] == 0 and (overdue := self.policy.overdue(shard.queued_ns, now)) is not None:
                shard.future.set_exception(overdue)
            else:
                kept.append(shard)
        self._waiting = kept
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
            if (delay := self.policy.delay_s()) > 0 and len(self._waiting) < self.max_batch:
                await asyncio.sleep(delay)  # Triton's max queue delay: let others join
            await self._wait_for_coming()
            while batch := self._take():
                failpoint(f"batch_queue:{self.policy.model}")
                self._running = len(batch)
                started = self.clock_ns()
                try:
                    results = await loop.run_in_executor(self._thread, self.run_batch, [s.payload for s in batch])
                except Exception as exc:  # the batch's requests get the error; the queue serves on
                    for shard in batch:
                        if not shard.future.done():
                            shard.future.set_exception(exc)
                else:
                    for shard, result in zip(batch, results):
                        if not shard.future.done():  # else its caller went away while it ran: dropped
                            shard.future.set_result(Done(result, started - shard.queued_ns))
                finally:
                    self._running = 0
                self.stats.record_execution(len(batch), 0, self.clock_ns() - started, 0)
