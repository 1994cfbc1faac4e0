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

How a batch runs is the queue's `Runner`: `WholeBatches` makes one engine call of it, and the next
batch is taken when the call returns; an engine that decodes continuously (the box's own Whisper,
whisper_decoding.py) takes shards whenever it has room and answers each as soon as it is done, so a
shard that arrives while others decode joins them at the engine's next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

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


class Runner(Protocol[T, R]):
    """How the queue's shards run on its thread: `begin` what there is `room` for, `advance` the work
    under way (the shards finished meanwhile, by key), `drop` one whose caller went away, `clear` all
    after a failure (the shards that were under way)."""

    grouped: bool  # a batch holds shards of one group only (one engine call takes one set of scales)

    @property
    def room(self) -> int: ...

    def begin(self, keyed: list[tuple[Hashable, T]]) -> None: ...

    def advance(self) -> list[tuple[Hashable, R]]: ...

    def drop(self, key: Hashable) -> None: ...

    def clear(self) -> list[tuple[Hashable, T]]: ...


class WholeBatches(Generic[T, R]):
    """One engine call per batch: `run_batch` on at most max_batch shards, all answered when it returns."""

    grouped = True

    def __init__(self, run_batch: Callable[[list[T]], list[R]], max_batch: int) -> None:
        self.run_batch, self.max_batch = run_batch, max_batch
        self._batch: list[tuple[Hashable, T]] = []

    @property
    def room(self) -> int:
        return 0 if self._batch else self.max_batch

    def begin(self, keyed: list[tuple[Hashable, T]]) -> None:
        self._batch = keyed

    def advance(self) -> list[tuple[Hashable, R]]:
        batch, self._batch = self._batch, []
        return list(zip([key for key, _ in batch], self.run_batch([payload for _, payload in batch])))

    def drop(self, key: Hashable) -> None:
        """Nothing to stop: the call under way runs whole, and the queue drops the shard's result."""

    def clear(self) -> list[tuple[Hashable, T]]:
        batch, self._batch = self._batch, []
        return batch


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
        run: Callable[[list[T]], list[R]] | Runner[T, R],
        max_batch: int,
        stats: ModelStats,
        policy: QueuePolicy,
        per_request: int | None = None,
        coming: Callable[[], bool] = lambda: False,
        clock_ns: Callable[[], int] = time.perf_counter_ns,
    ) -> None:
        """`run`: a Runner, or a function of a batch (WholeBatches); it runs on the queue's thread, and each
        advance is an execution in `stats`. `coming`: whether
        shards are about to arrive (speech to text: a recording is in its VAD); a batch that is not full
        and holds no urgent shard waits for them up to COMING_WAIT_S. `clock_ns` times the waits that
        the queue policy judges (a test's own clock)."""
        self.runner: Runner[T, R] = WholeBatches(run, max_batch) if callable(run) else run
        self.max_batch, self.stats, self.policy = max_batch, stats, policy
        self.clock_ns = clock_ns
        self.per_request, self.coming = per_request or max_batch, coming
        self._waiting: list[_Shard[T, R]] = []
        self._running: dict[Hashable, tuple[_Shard[T, R], int]] = {}  # by key: each with when it began
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="batch")
        self._owners, self._arrivals = itertools.count(), itertools.count()

    @property
    def busy(self) -> bool:
        return self.waiting > 0 or bool(self._running)

    @property
    def waiting(self) -> int:
        """Shards waiting for a batch (those whose caller went away are not: the next batch drops them)."""
        return sum(not s.future.done() for s in self._waiting)

    @property
    def queue_depth(self) -> int:
        """Shards waiting or in the engine call under way, as the other engines' queues count them."""
        return self.waiting + len(self._running)

    def start(self) -> None:
        self._task = spawn(self._run(), f"the batch queue of model {self.policy.model}", self._crashed)

    def _crashed(self, error: BaseException) -> None:
        """The queue's loop died (a bug of ours, logged by spawn): its requests get a 500 naming the
        model now instead of waiting forever, and a new loop serves the next ones."""
        failed = Unavailable(f"model {self.policy.model}: its batch queue crashed (logged); retry", 500)
        for shard in [*self._waiting, *(shard for shard, _ in self._running.values())]:
            if not shard.future.done():
                shard.future.set_exception(failed)
        self._waiting, self._running = [], {}
        self.runner.clear()
        self.stats.crashes += 1
        if self._task is not None:  # not stopped meanwhile
            self.start()

    async def stop(self, timeout_s: float) -> bool:
        """Finish the shards under way; False when they did not finish within `timeout_s` (wedged)."""
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

    def _take(self, room: int) -> list[_Shard[T, R]]:
        """The next shards, at most `room`: lowest shard index first, at most per_request of one request
        (in the batch under way too), of one group where the runner is `grouped`."""
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
        for shard, _ in self._running.values():
            per_owner[shard.owner] = per_owner.get(shard.owner, 0) + 1
        for shard in self._waiting:
            count = per_owner.get(shard.owner, 0)
            alike = shard.group == group or not self.runner.grouped
            if len(taken) < room and alike and count < self.per_request:
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
        keys = itertools.count()
        while True:
            await self._wake.wait()
            self._wake.clear()
            if (delay := self.policy.delay_s()) > 0 and len(self._waiting) < self.max_batch:
                await asyncio.sleep(delay)  # Triton's max queue delay: let others join
            await self._wait_for_coming()
            while self._waiting or self._running:
                failpoint(f"batch_queue:{self.policy.model}")
                for key in [k for k, (shard, _) in self._running.items() if shard.future.done()]:
                    del self._running[key]  # its caller went away while it ran
                    self.runner.drop(key)
                began = self.clock_ns()
                keyed: list[tuple[Hashable, _Shard[T, R]]] = [(next(keys), s) for s in self._take(self.runner.room)]
                self._running.update((key, (shard, began)) for key, shard in keyed)
                if not self._running:
                    break
                rows = len(self._running)
                try:
                    answers = await loop.run_in_executor(self._thread, self._advance, keyed)
                except Exception as exc:  # the shards under way get the error; the queue serves on
                    self.runner.clear()
                    running, self._running = self._running, {}
                    for shard, _ in running.values():
                        if not shard.future.done():
                            shard.future.set_exception(exc)
                else:
                    for key, result in answers:
                        shard, started = self._running.pop(key)
                        if not shard.future.done():  # else its caller went away while it ran: dropped
                            shard.future.set_result(Done(result, started - shard.queued_ns))
                self.stats.record_execution(rows, 0, self.clock_ns() - began, 0)

    def _advance(self, keyed: list[tuple[Hashable, _Shard[T, R]]]) -> list[tuple[Hashable, R]]:
        """On the queue's thread: the shards taken begin, and the runner advances."""
        if keyed:
            self.runner.begin([(key, shard.payload) for key, shard in keyed])
        return self.runner.advance()
