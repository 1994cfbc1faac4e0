"""Overload as a policy, Triton's way (dynamic_batching.default_queue_policy): a model's queue holds
at most `engine.max_queue_size` waiting requests and a request waits at most `engine.queue_timeout_s`
for its first piece of work to start (0: no timeout); past either it is refused at once with a 503 and Retry-After (timeout_action REJECT),
counted in the model's stats, instead of piling up work the box cannot do in time."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from appliance.config import EngineConfig
from appliance.engine.stats import ModelStats
from appliance.errors import QueueFull


class QueuePolicy:
    """One model's queue policy, read from the live config at each use (SIGHUP changes it)."""

    def __init__(self, model: str, settings: Callable[[], EngineConfig], stats: ModelStats) -> None:
        self.model, self.settings, self.stats = model, settings, stats

    def delay_s(self) -> float:
        """Triton's max_queue_delay: how long a batch waits for others to join it."""
        return self.settings().queue_delay_us / 1e6

    def admit(self, waiting: int) -> None:
        """Refuse one more request when `waiting` requests already wait."""
        limit, _ = self.settings().queue_policy(self.model)
        if waiting >= limit:
            self.stats.refused += 1
            raise QueueFull(f"model {self.model}: {limit} requests are waiting (engine.max_queue_size): retry later")

    def overdue(self, queued_ns: int, now_ns: int) -> QueueFull | None:
        """The error for a request queued at `queued_ns` that waited past the timeout, else None."""
        _, timeout_s = self.settings().queue_policy(self.model)
        if not timeout_s or now_ns - queued_ns <= timeout_s * 1e9:
            return None
        self.stats.timed_out += 1
        return QueueFull(f"model {self.model}: waited more than {timeout_s:g} s in the queue (engine.queue_timeout_s)")


def triton_queue_policy(settings: EngineConfig, model: str) -> dict[str, Any]:
    """dynamic_batching.default_queue_policy as Triton's model configuration shows it."""
    max_queue_size, timeout_s = settings.queue_policy(model)
    return {
        "timeout_action": "REJECT",
        "default_timeout_microseconds": int(timeout_s * 1e6),
        "allow_timeout_override": False,
        "max_queue_size": max_queue_size,
    }
