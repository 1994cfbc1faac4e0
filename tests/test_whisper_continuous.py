"""Continuous batching across requests (engine/whisper_decoding.py driven by engine/batch_queue.py):
the box's own Whisper (NumPy here, the CPU reference of its GPU path) takes a shard that arrives while
another decodes into the same batch at its next step and answers the short one first, each with the
text it gets alone. CTranslate2-style whole batches (`WholeBatches` over the same engine's `run`), beside
it, make the newcomer wait for the call under way to end. Asserted on the order of events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Hashable
from pathlib import Path

import pytest
from conftest import Keys
from speech import recording, say
from test_whisper_reference import ENGLISH, converted, model_dir

from appliance.config import EngineConfig
from appliance.engine.batch_queue import BatchQueue, Runner, WholeBatches
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.speech_engine import Decoded, Shard
from appliance.engine.stats import ModelStats
from appliance.engine.whisper_arrays_engine import ArrayWhisperEngine

WAIT_S = 600  # a bound that fails only where the thing never happens


class Recorded:
    """A runner that logs what began, what was answered and what was dropped, by the shards' names."""

    def __init__(self, runner: Runner[Shard, Decoded], names: dict[int, str]) -> None:
        self.runner, self.names, self.grouped = runner, names, runner.grouped
        self.events: list[tuple[str, str]] = []
        self.advances = 0
        self._keys: dict[Hashable, str] = {}
        self._lock = threading.Lock()

    @property
    def room(self) -> int:
        return self.runner.room

    def begin(self, keyed: list[tuple[Hashable, Shard]]) -> None:
        with self._lock:
            for key, shard in keyed:
                self._keys[key] = self.names[id(shard)]
                self.events.append(("begin", self._keys[key]))
        self.runner.begin(keyed)

    def advance(self) -> list[tuple[Hashable, Decoded]]:
        answers = self.runner.advance()
        with self._lock:
            self.advances += 1
            self.events += [("answer", self._keys[key]) for key, _ in answers]
        return answers

    def drop(self, key: Hashable) -> None:
        self.events.append(("drop", self._keys[key]))
        self.runner.drop(key)

    def clear(self) -> list[tuple[Hashable, Shard]]:
        return self.runner.clear()


@pytest.fixture(scope="module")
def engine(voice_bundle: Path, keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> ArrayWhisperEngine:
    return converted(model_dir(voice_bundle, keys, "whisper_tiny_en"), tmp_path_factory.mktemp("tiny"), max_batch=4)


@pytest.fixture(scope="module")
def shards() -> dict[str, Shard]:
    return {
        "long": Shard(recording(ENGLISH, gap_s=0.5)[0], "en"),
        "short": Shard(say("Thank you"), "en"),
    }


def text(decoded: Decoded) -> str:
    return " ".join(piece.text for piece in decoded.pieces)


async def until(condition, what: str) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.001)


def long_then_short(runner: Runner[Shard, Decoded], shards: dict[str, Shard], cancel_long: bool = False):  # type: ignore[no-untyped-def]
    """`long` is submitted; once it has advanced, `short` is; the events and the answers (None: cancelled)."""
    recorded = Recorded(runner, {id(shard): name for name, shard in shards.items()})

    async def run() -> dict[str, Decoded | None]:
        stats = ModelStats()
        queue = BatchQueue(recorded, 4, stats, QueuePolicy("whisper", lambda: EngineConfig(), stats))
        queue.start()
        (long,) = queue.submit([shards["long"]])
        await until(lambda: recorded.advances >= 1 or long.done(), "the long shard never advanced")
        (short,) = queue.submit([shards["short"]])
        answers: dict[str, Decoded | None] = {"short": None, "long": None}
        if cancel_long:
            await until(lambda: ("begin", "short") in recorded.events, "the short shard never began")
            long.cancel()
        else:
            answers["long"] = (await long).result
        answers["short"] = (await short).result
        assert await queue.stop(WAIT_S)
        return answers

    return recorded.events, asyncio.run(run())


def test_a_shard_joins_a_decode_under_way_and_each_gets_its_text_alone(engine, shards) -> None:  # type: ignore[no-untyped-def]
    alone = {name: text(engine.run([shard])[0]) for name, shard in shards.items()}
    assert "thank you" in alone["short"].lower() and "pharmacy" in alone["long"].lower(), alone

    events, answers = long_then_short(engine.decoding(4), shards)
    assert events == [("begin", "long"), ("begin", "short"), ("answer", "short"), ("answer", "long")], events
    assert {name: text(answer) for name, answer in answers.items() if answer} == alone

    # whole batches of the same engine: the newcomer waits for the call under way, with the same texts
    events, answers = long_then_short(WholeBatches(engine.run, 4), shards)
    assert events == [("begin", "long"), ("answer", "long"), ("begin", "short"), ("answer", "short")], events
    assert {name: text(answer) for name, answer in answers.items() if answer} == alone


def test_a_cancelled_shard_leaves_the_batch_and_the_others_decode_on(engine, shards) -> None:  # type: ignore[no-untyped-def]
    events, answers = long_then_short(engine.decoding(4), shards, cancel_long=True)
    assert ("drop", "long") in events and ("answer", "long") not in events, events
    assert answers["short"] is not None and text(answers["short"]) == text(engine.run([shards["short"]])[0])
    assert not engine.batch.rows  # nothing left decoding


def test_a_sampled_decode_is_the_same_whatever_was_sampled_before_or_beside_it(engine, shards) -> None:  # type: ignore[no-untyped-def]
    """A decode at a temperature above 0 samples from its own generator: the same audio is heard the
    same way on its own, again, and beside another sampled decode (issue 45: the same recording was
    heard otherwise after other requests)."""
    sampled = {name: Shard(shard.samples, "en", temperature=1.0) for name, shard in shards.items()}
    first = text(engine.run([sampled["long"]])[0])
    again = text(engine.run([sampled["long"]])[0])
    beside = text(engine.run([sampled["short"], sampled["long"]])[1])
    assert first == again == beside, (first, again, beside)
