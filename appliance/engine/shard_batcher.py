"""Cross-request batching of Whisper shards: every waiting shard of every request, up to max_batch,
goes into one engine call; shards that arrive while a call runs join the next one.

The engine call runs on one worker thread (CTranslate2 releases the GIL), so the event loop keeps
answering health, VAD and live requests while Whisper computes. Live streams' shards go first.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from appliance.engine.stats import ModelStats, RequestTimes
from appliance.errors import Unavailable

Item = TypeVar("Item")
Answer = TypeVar("Answer")


@dataclass(slots=True, eq=False)
class _Waiting(Generic[Item, Answer]):
    item: Item
    future: asyncio.Future[Answer]
    times: RequestTimes  # its request's: each of its items adds its queue and engine time
    queued_ns: int


class ShardBatcher(Generic[Item, Answer]):
    """`submit` an item, await its answer. `run(items) -> answers` is the engine call (same order);
    each call is recorded in `stats` (Triton's executions, by batch size)."""

    def __init__(
        self, run: Callable[[list[Item]], list[Answer]], max_batch: int, stats: ModelStats, engine_name: str
    ) -> None:
        self.run, self.max_batch, self.stats, self.engine_name = run, max_batch, stats, engine_name
        self._live: deque[_Waiting[Item, Answer]] = deque()
        self._bulk: deque[_Waiting[Item, Answer]] = deque()
        self._running = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="whisper")

    @property
    def queue_depth(self) -> int:
        return len(self._live) + len(self._bulk) + self._running

    @property
    def busy(self) -> bool:
        return bool(self.queue_depth)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="whisper")

    def submit(self, item: Item, times: RequestTimes, live: bool = False) -> asyncio.Future[Answer]:
        """Queue an item; cancelling the future before its batch starts drops it."""
        future: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        (self._live if live else self._bulk).append(_Waiting(item, future, times, time.perf_counter_ns()))
        self._wake.set()
        return future

    async def stop(self, timeout_s: float) -> bool:
        """Finish the batches under way; False when the engine did not within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while self.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.005)
        finished = not self.busy
        if self._task is not None:
            self._task.cancel()
        self._thread.shutdown(wait=finished, cancel_futures=True)
        return finished

    def _take(self) -> list[_Waiting[Item, Answer]]:
        batch: list[_Waiting[Item, Answer]] = []
        for queue in (self._live, self._bulk):
            while queue and len(batch) < self.max_batch:
                waiting = queue.popleft()
                if not waiting.future.done():  # cancelled: its caller went away
                    batch.append(waiting)
        return batch

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            while batch := self._take():
                self._running = len(batch)
                started = time.perf_counter_ns()
                try:
                    answers = await loop.run_in_executor(self._thread, self.run, [w.item for w in batch])
                except Exception as exc:  # an engine failure fails this batch, not the daemon
                    error = Unavailable(f"engine {self.engine_name} failed: {exc}", 500)
                    for waiting in batch:
                        if not waiting.future.done():
                            waiting.future.set_exception(error)
                    continue
                finally:
                    self._running = 0
                compute_ns = time.perf_counter_ns() - started
                self.stats.record_execution(len(batch), 0, compute_ns, 0)
                for waiting in batch:
                    waiting.times.queue_ns += started - waiting.queued_ns
                    waiting.times.compute_infer_ns += compute_ns
                for waiting, answer in zip(batch, answers):
                    if not waiting.future.done():
                        waiting.future.set_result(answer)
