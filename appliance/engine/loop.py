"""Drives a Batcher on the event loop: one batched engine call per loop iteration, so the sockets
are read between calls and requests that arrive meanwhile join the next batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

W = TypeVar("W")


class Schedule(Protocol[W]):
    """What the loop drives: scheduler.Batcher (frames of sequences) or dynamic.DynamicBatcher (requests)."""

    max_batch: int

    @property
    def busy(self) -> bool: ...

    @property
    def waiting(self) -> int: ...

    def submit(self, work: W) -> None: ...

    def fill(self) -> int: ...

    def run_steps(self, budget_s: float = 0.0) -> list[tuple[W, BaseException | None]]: ...

    def finish(self, finished: list[tuple[W, BaseException | None]]) -> None: ...


class EngineLoop(Generic[W]):
    """Drives a Batcher on the event loop.

    A small batch runs right on the loop: handing it to another thread would cost more than
    its compute (measured here: ~60 us per wake-up each way against ~110 us for one frame).
    A batch of OFFLOAD_MIN_BATCH or more runs on the engine thread for up to STEP_BUDGET_S, so
    the loop keeps reading sockets and answering while the engine computes. A model whose every call
    is heavy (a graph of real compute) sets `offload_min_batch` to 1.
    """

    OFFLOAD_MIN_BATCH = 4
    STEP_BUDGET_S = 0.004

    def __init__(
        self, batcher: Schedule[W], queue_delay_s: Callable[[], float], offload_min_batch: int = OFFLOAD_MIN_BATCH
    ) -> None:
        self.batcher, self.queue_delay_s = batcher, queue_delay_s  # read per batch: the live config's
        self.offload_min_batch = offload_min_batch
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="engine")

    async def stop(self, timeout_s: float) -> bool:
        """Finish the batches under way; False when the engine did not within `timeout_s` (a wedged
        driver call): the loop stops anyway and the engine thread is left to the process's exit."""
        deadline = time.monotonic() + timeout_s
        while self.batcher.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        finished = not self.batcher.busy
        if self._task is not None:
            self._task.cancel()
        self._thread.shutdown(wait=finished, cancel_futures=True)
        return finished

    def submit(self, work: W) -> None:
        self.batcher.submit(work)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batcher = self.batcher
        while True:
            await self._wake.wait()
            self._wake.clear()
            if (delay := self.queue_delay_s()) > 0 and batcher.waiting < batcher.max_batch:
                await asyncio.sleep(delay)  # Triton's max queue delay: let others join
            while batcher.busy:
                if batcher.fill() >= self.offload_min_batch:
                    finished = await loop.run_in_executor(self._thread, batcher.run_steps, self.STEP_BUDGET_S)
                else:
                    finished = batcher.run_steps()
                    await asyncio.sleep(0)  # read sockets between engine calls
                batcher.finish(finished)
