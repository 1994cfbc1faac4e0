"""The batch queue's overload policy on a clock the test holds: a request whose first shard waited past
engine.queue_timeout_s is refused, one whose first shard started in time is served to its end, and
how long the engine takes does not enter into it (the clock moves only when the test moves it)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from appliance.config import EngineConfig
from appliance.engine.batch_queue import BatchQueue
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.stats import ModelStats
from appliance.errors import QueueFull

SECOND_NS = 1_000_000_000


class HeldEngine:
    """An engine whose every call blocks until the test releases it; it records what each call ran."""

    def __init__(self) -> None:
        self.calls: list[list[str]] = []
        self.started = threading.Semaphore(0)
        self.release = threading.Semaphore(0)

    def run_batch(self, payloads: list[str]) -> list[str]:
        self.calls.append(list(payloads))
        self.started.release()
        self.release.acquire()
        return [p.upper() for p in payloads]

    async def next_call(self) -> list[str]:
        """The batch of the engine's next call (a queue that never calls it fails the test)."""
        assert await asyncio.to_thread(self.started.acquire, timeout=60), "the engine was not called"
        return self.calls[-1]


def queue(engine: HeldEngine, clock: list[int], timeout_s: float) -> tuple[BatchQueue[str, str], ModelStats]:
    stats = ModelStats()
    policy = QueuePolicy("voice", lambda: EngineConfig(queue_timeout_s=timeout_s), stats)
    # one shard of a request per batch, as the voice runs a text's sentences
    return BatchQueue(engine.run_batch, 4, stats, policy, per_request=1, clock_ns=lambda: clock[0]), stats


@pytest.mark.parametrize("engine_call_s", [0.0, 0.3], ids=["fast-engine", "slow-engine"])
def test_a_request_waiting_past_the_timeout_is_refused_and_one_under_way_is_not(engine_call_s: float) -> None:
    """A long request is in the engine; `early` waits 2 s (on the queue's clock) behind it, `fresh`
    arrives at the end of those 2 s. With a timeout of 1 s: `early` is refused with the setting's name,
    `fresh` runs in the next batch beside the long request's second shard, and the long request, whose
    later shards waited as long as `early`, is never refused. The engine's own speed changes nothing."""
    clock = [0]
    engine = HeldEngine()

    async def run() -> tuple[dict[str, object], ModelStats]:
        batches, stats = queue(engine, clock, timeout_s=1.0)
        batches.start()
        long = batches.submit(["long0", "long1", "long2"])
        assert await engine.next_call() == ["long0"]
        (early,) = batches.submit(["early"])
        clock[0] += 2 * SECOND_NS
        (fresh,) = batches.submit(["fresh"])
        await asyncio.sleep(engine_call_s)  # the engine's call takes this long in real time
        engine.release.release()
        assert await engine.next_call() == ["fresh", "long1"]  # first shards first; `early` was refused
        engine.release.release()
        assert await engine.next_call() == ["long2"]
        engine.release.release()
        outcomes: dict[str, object] = {}
        for name, future in [("early", early), ("fresh", fresh), *zip(("long0", "long1", "long2"), long)]:
            try:
                outcomes[name] = (await future).result
            except QueueFull as exc:
                outcomes[name] = exc
        await batches.stop(5)
        return outcomes, stats

    outcomes, stats = asyncio.run(run())
    refusal = outcomes.pop("early")
    assert isinstance(refusal, QueueFull) and "engine.queue_timeout_s" in str(refusal), refusal
    assert outcomes == {"fresh": "FRESH", "long0": "LONG0", "long1": "LONG1", "long2": "LONG2"}
    assert stats.timed_out == 1


def test_a_request_that_waited_exactly_the_timeout_is_served() -> None:
    """The bound is inclusive: a wait of exactly queue_timeout_s is served; a nanosecond more is refused."""
    clock = [0]
    engine = HeldEngine()

    async def run() -> list[object]:
        batches, stats = queue(engine, clock, timeout_s=1.0)
        batches.start()
        batches.submit(["busy"])
        await engine.next_call()
        (over,) = batches.submit(["over"])
        clock[0] += 1
        (on_time,) = batches.submit(["on-time"])
        clock[0] += SECOND_NS  # on-time waited exactly 1 s, over 1 ns more
        engine.release.release()
        assert await engine.next_call() == ["on-time"]
        engine.release.release()
        outcomes: list[object] = [(await on_time).result, stats.timed_out]
        with pytest.raises(QueueFull):
            await over
        await batches.stop(5)
        return outcomes

    assert asyncio.run(run()) == ["ON-TIME", 1]


def test_the_depth_counts_the_shards_waiting_and_those_in_the_engine_call() -> None:
    """appliance_queue_depth, as the VAD's and the ONNX kinds' queues count it: what waits and what the
    engine call under way holds, so a depth of 0 means the engine has nothing left of it."""
    engine = HeldEngine()

    async def run() -> list[int]:
        batches, _ = queue(engine, [0], timeout_s=0.0)
        batches.start()
        depths = [batches.queue_depth]
        shards = batches.submit(["a0", "a1"])
        assert await engine.next_call() == ["a0"]
        depths.append(batches.queue_depth)  # a0 in the engine, a1 waiting
        engine.release.release()
        assert await engine.next_call() == ["a1"]
        depths.append(batches.queue_depth)  # a1 in the engine
        engine.release.release()
        await asyncio.gather(*shards)
        depths.append(batches.queue_depth)
        await batches.stop(5)
        return depths

    assert asyncio.run(run()) == [0, 2, 1, 0]
