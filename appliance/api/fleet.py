"""The box in a fleet, without I/O: how full it is, what its readiness says, and what it answers
HAProxy's agent check (docs/operations.md, "Many boxes behind HAProxy").

HAProxy's agent protocol (agent-check): the balancer connects to the agent's port, reads one line
and closes. The line holds words: a weight as a percentage of the server's configured weight
("75%"), an administrative state ("ready" clears a drain or maintenance set before, "drain",
"maint") and an operational one ("up", "down"). `agent_reply` makes that line from a `BoxState`.

The weight is the box's free capacity, the least of its parts, each from 0 to 1:
- each model's queue: 1 - depth / engine.max_queue_size (its own where [engine.models.NAME] sets it);
- the live sessions: 1 - open sequences / sequences.max_live, in the fullest model's table (each model
  has one of max_live; a Realtime session holds one in Whisper's and one in the VAD's);
- GPU memory, where a GPU serves: 1 - used / fallback_cpu_threshold (past the threshold batches fall
  back to the CPU, so the GPU is full there).
A box at a bound answers the least weight, MIN_WEIGHT (1%), not 0: HAProxy reads 0% as a drain, and
with every box at its bound the fleet should still spread what comes rather than refuse it all.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MIN_WEIGHT = 1  # percent: a full box still gets a share when all are full
RETRY_AFTER_S = 1  # a drained box's 503s say: try again (elsewhere) in this many seconds


@dataclass(frozen=True, slots=True)
class Capacity:
    """What the box holds against its bounds at one moment."""

    queues: dict[str, tuple[int, int]] = field(default_factory=dict)  # model: (depth, max_queue_size)
    live: int = 0  # open sequences (Realtime, Wyoming and KServe sessions) in the fullest model's table
    max_live: int = 1
    gpu_used: float | None = None  # fraction of the GPU's memory in use, where a GPU serves
    gpu_threshold: float = 1.0  # fallback_cpu_threshold

    def free(self) -> float:
        """The least free share of every bound, from 0 (one is full) to 1 (idle)."""
        parts = [1 - depth / bound for depth, bound in self.queues.values()]
        parts.append(1 - self.live / self.max_live)
        if self.gpu_used is not None:
            parts.append(1 - self.gpu_used / self.gpu_threshold)
        return max(0.0, min(parts))

    def full(self) -> str | None:
        """What is at its bound (the reason readiness fails), or None."""
        for model, (depth, bound) in self.queues.items():
            if depth >= bound:
                return f"model {model}'s queue is at its bound ({depth} of engine.max_queue_size {bound})"
        if self.live >= self.max_live:
            return f"a model's sequence table is full ({self.live} of sequences.max_live {self.max_live})"
        return None


@dataclass(frozen=True, slots=True)
class BoxState:
    """The box as the balancer sees it."""

    starting: bool
    draining: bool
    updating: bool  # draining before a firmware or image update (`appliance update`)
    capacity: Capacity


def weight(capacity: Capacity) -> int:
    """The agent's weight, in percent of the server's configured weight."""
    return max(MIN_WEIGHT, round(100 * capacity.free()))


def agent_reply(state: BoxState) -> bytes:
    """The line HAProxy's agent check reads."""
    if state.updating:
        return b"maint\n"
    if state.draining:
        return b"drain\n"
    if state.starting:
        return b"down\n"
    return f"up ready {weight(state.capacity)}%\n".encode()


def not_ready(state: BoxState) -> str | None:
    """Why /v2/health/ready fails (Triton's readiness: it serves new work), or None when ready."""
    if state.starting:
        return "not ready: starting"
    if state.updating or state.draining:
        return "not ready: draining" + (" for an update" if state.updating else "")
    full = state.capacity.full()
    return f"not ready: overloaded: {full}" if full else None


def metric_lines(state: BoxState, firmware: str, version: str) -> list[str]:
    """The fleet's view of the box for Prometheus: one series per box, the firmware as labels."""
    capacity = state.capacity
    out = [
        "# HELP appliance_firmware_info The firmware the box serves (its name and version as labels).",
        "# TYPE appliance_firmware_info gauge",
        f'appliance_firmware_info{{firmware="{firmware}",version="{version}"}} 1',
        "# HELP appliance_ready 1 while /v2/health/ready answers 200 (not starting, draining nor overloaded).",
        "# TYPE appliance_ready gauge",
        f"appliance_ready {int(not_ready(state) is None)}",
        "# HELP appliance_draining 1 while the box drains (SIGUSR2, appliance drain, an update, a stop).",
        "# TYPE appliance_draining gauge",
        f"appliance_draining {int(state.draining)}",
        "# HELP appliance_agent_weight The weight HAProxy's agent check reads, percent (api/fleet.py).",
        "# TYPE appliance_agent_weight gauge",
        f"appliance_agent_weight {weight(capacity)}",
        "# HELP appliance_live_sessions Open sequences in the fullest model's table (Realtime, Wyoming, KServe sessions).",
        "# TYPE appliance_live_sessions gauge",
        f"appliance_live_sessions {capacity.live}",
        "# HELP appliance_max_live_sessions sequences.max_live.",
        "# TYPE appliance_max_live_sessions gauge",
        f"appliance_max_live_sessions {capacity.max_live}",
    ]
    if capacity.gpu_used is not None:
        out += [
            "# HELP appliance_gpu_memory_used_ratio The GPU's memory in use, by anyone (batches go to the CPU"
            " past fallback_cpu_threshold).",
            "# TYPE appliance_gpu_memory_used_ratio gauge",
            f"appliance_gpu_memory_used_ratio {capacity.gpu_used:.4f}",
        ]
    return out
