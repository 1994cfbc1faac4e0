"""Drives a Batcher on the event loop: one batched engine call per loop iteration, so the sockets
are read between calls and requests that arrive meanwhile join the next batch."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Generic, Protocol, TypeVar

from appliance.engine.queue_policy import QueuePolicy
from appliance.errors import Unavailable
from appliance.tasks import failpoint, spawn

W = TypeVar("W")
log = logging.getLogger("appliance.engine")


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

    def fail_all(self, error: BaseException) -> None:
        """Every work waiting or in the batch ends with `error` (the loop driving it crashed)."""
        ...


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

    def __init__(self, batcher: Schedule[W], policy: QueuePolicy, offload_min_batch: int = OFFLOAD_MIN_BATCH) -> None:
        self.batcher, self.policy = batcher, policy  # read per batch: the live config's
        self.offload_min_batch = offload_min_batch
        self._wake = asyncio.Event()
        self._requests = 0  # admitted and not answered yet
        self._task: asyncio.Task[None] | None = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        # until a work is done, a failure is the warm-up's: the start reports it in one line, no traceback
        self._warmed = False
        self._failing = ""  # the failure the last batch ended with, if it failed: a repeat is not logged again

    def start(self) -> None:
        self._task = spawn(self._run(), f"the engine loop of model {self.policy.model}", self._crashed)

    def _crashed(self, error: BaseException) -> None:
        """The loop died (a bug of ours, logged by spawn): its works get a 500 naming the model now
        instead of waiting forever, and a new loop serves the next ones."""
        self.batcher.fail_all(Unavailable(f"model {self.policy.model}: its engine loop crashed (logged); retry", 500))
        self.policy.stats.crashes += 1
        if self._task is not None:  # not stopped meanwhile
            self.start()
            self._wake.set()

    async def stop(self, timeout_s: float) -> bool:
        """Finish the batches under way; False when the engine did not within `timeout_s` (a wedged
        driver call): the loop stops anyway and the engine thread is left to the process's exit."""
        deadline = time.monotonic() + timeout_s
        while self.batcher.busy and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        finished = not self.batcher.busy
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self._thread.shutdown(wait=finished, cancel_futures=True)
        return finished

    def check_room(self) -> None:
        """Refuse (QueueFull) a request now when max_queue_size requests are in: before its upload is
        decoded (the admission itself comes after, in `admitted`)."""
        self.policy.admit(self._requests)

    @contextlib.contextmanager
    def admitted(self) -> Iterator[None]:
        """One request's stay in the queue, from before it submits its works to its answer: refused
        (QueueFull) when max_queue_size requests are in already. A live stream's frames are not
        refused (its sequence was admitted when it opened)."""
        self.policy.admit(self._requests)
        self._requests += 1
        try:
            yield
        finally:
            self._requests -= 1

    def submit(self, work: W) -> None:
        self.batcher.submit(work)
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        batcher = self.batcher
        while True:
            await self._wake.wait()
            self._wake.clear()
            if (delay := self.policy.delay_s()) > 0 and batcher.waiting < batcher.max_batch:
                await asyncio.sleep(delay)  # Triton's max queue delay: let others join
            while batcher.busy:
                failpoint(f"engine_loop:{self.policy.model}")
                if batcher.fill() >= self.offload_min_batch:
                    finished = await loop.run_in_executor(self._thread, batcher.run_steps, self.STEP_BUDGET_S)
                else:
                    finished = batcher.run_steps()
                    await asyncio.sleep(0)  # read sockets between engine calls
                batcher.finish(finished)
                self._report(finished)

    def _report(self, finished: list[tuple[W, BaseException | None]]) -> None:
        """A failed batch logged once, with the engine's traceback (each request's 500 is one line); the
        same failure batch after batch (an engine that stays broken) at debug level after the first."""
        failure = next((e.__cause__ for _, e in finished if e is not None and e.__cause__ is not None), None)
        if failure is None:
            if any(e is None for _, e in finished):  # a work done: the engine serves (again)
                self._warmed, self._failing = True, ""
            return
        again, self._failing = self._failing == repr(failure), repr(failure)
        level = logging.ERROR if self._warmed and not again else logging.DEBUG
        log.log(
            level, "model %s: its engine failed a batch of %d works", self.policy.model, len(finished), exc_info=failure
        )
