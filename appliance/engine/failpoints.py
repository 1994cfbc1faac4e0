"""Failpoints for tests, read from the environment only, never from config.

HANG: while this file exists, engine calls stall the way a wedged driver call would; if the file holds
a number N, the first N calls after it appeared still run. SPEECH_HANG: the same for the speech-to-text
engines' batches alone (Whisper held while the VAD before it cuts on). SLOWDOWN: each engine call
takes N times as long (a slower machine, for tests whose outcome must not depend on the engine's speed).
"""

from __future__ import annotations

import logging
import os
import time
from collections import Counter
from collections.abc import Hashable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, cast

import numpy as np

from appliance.engine.interface import Engine

if TYPE_CHECKING:  # a VAD-only daemon loads no speech-to-text module
    from appliance.engine.batch_queue import Runner
    from appliance.engine.speech_engine import Decoded, Shard, SpeechEngine

log = logging.getLogger("appliance")

HANG_FAILPOINT = "APPLIANCE_FAILPOINT_ENGINE_HANG"
SPEECH_HANG_FAILPOINT = "APPLIANCE_FAILPOINT_SPEECH_HANG"
SLOWDOWN_FAILPOINT = "APPLIANCE_FAILPOINT_ENGINE_SLOWDOWN"


class HangFile:
    """Stalls a caller while the trigger file exists, past the number of calls the file allows."""

    def __init__(self, trigger: Path) -> None:
        self.trigger = trigger
        self.calls_while_armed = 0

    def wait(self, engine: str) -> None:
        if not self.trigger.exists():
            self.calls_while_armed = 0
            return
        self.calls_while_armed += 1
        if self.calls_while_armed > self._allowance():
            log.warning("engine %s: held by the test's hang failpoint (%s)", engine, self.trigger)
            while self.trigger.exists():
                time.sleep(0.05)

    def _allowance(self) -> int:
        try:
            return int(self.trigger.read_text() or 0)
        except (OSError, ValueError):
            return 0


class _Wrapped:
    def __init__(self, engine: Engine) -> None:
        self.engine, self.name = engine, engine.name

    @property
    def fallbacks(self) -> Counter[str]:
        return cast(Counter[str], getattr(self.engine, "fallbacks", Counter()))


class _Held(_Wrapped):
    def __init__(self, engine: Engine, hang: HangFile) -> None:
        super().__init__(engine)
        self.hang = hang

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        self.hang.wait(self.name)
        return self.engine.run(feeds, batch)


class _Slowed(_Wrapped):
    def __init__(self, engine: Engine, factor: float) -> None:
        super().__init__(engine)
        self.factor = factor

    def run(self, feeds: Mapping[str, np.ndarray], batch: int) -> dict[str, np.ndarray]:
        started = time.perf_counter()
        outputs = self.engine.run(feeds, batch)
        time.sleep((self.factor - 1) * (time.perf_counter() - started))
        return outputs


def engine_failpoints(engine: Engine) -> Engine:
    """The engine, slowed or held where a test's environment asks."""
    if factor := os.environ.get(SLOWDOWN_FAILPOINT):
        engine = _Slowed(engine, float(factor))
    if trigger := os.environ.get(HANG_FAILPOINT):
        engine = _Held(engine, HangFile(Path(trigger)))
    return engine


class _HeldBatches:
    """A speech engine's batches, each step held while the hang file says so."""

    def __init__(self, runner: Runner[Shard, Decoded], hang: HangFile, engine: str) -> None:
        self.runner, self.hang, self.engine = runner, hang, engine
        self.grouped = runner.grouped

    @property
    def room(self) -> int:
        return self.runner.room

    def begin(self, keyed: list[tuple[Hashable, Shard]]) -> None:
        self.runner.begin(keyed)

    def advance(self) -> list[tuple[Hashable, Decoded]]:
        self.hang.wait(self.engine)
        return self.runner.advance()

    def drop(self, key: Hashable) -> None:
        self.runner.drop(key)

    def clear(self) -> list[tuple[Hashable, Shard]]:
        return self.runner.clear()


class _HeldSpeech:
    def __init__(self, engine: SpeechEngine, hang: HangFile) -> None:
        self.engine, self.hang = engine, hang
        self.name, self.tokens, self.weight_bytes = engine.name, engine.tokens, engine.weight_bytes
        self.fallbacks = engine.fallbacks

    @property
    def windows(self) -> Counter[str]:
        return self.engine.windows

    def check(self, language: str | None, task: str) -> None:
        self.engine.check(language, task)

    def run(self, shards: list[Shard]) -> list[Decoded]:
        self.hang.wait(self.name)
        return self.engine.run(shards)

    def decoding(self, max_batch: int) -> Runner[Shard, Decoded]:
        return _HeldBatches(self.engine.decoding(max_batch), self.hang, self.name)

    def detect(self, clips: list[np.ndarray]) -> list[tuple[str, float]]:
        return self.engine.detect(clips)


def speech_failpoints(engine: SpeechEngine) -> SpeechEngine:
    """The speech engine, its batches held where a test's environment asks."""
    if trigger := os.environ.get(SPEECH_HANG_FAILPOINT):
        return _HeldSpeech(engine, HangFile(Path(trigger)))
    return engine
