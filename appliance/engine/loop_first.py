"""The event loop's thread ahead of the engine's others: every other thread of the engine process runs
at COMPUTE_NICE, so that when the loop's thread wakes (a request's bytes, a health check, a timer) the
kernel runs it before Whisper's, ONNX Runtime's, the voices' and the off-loop threads, instead of
after their time slice. On 2 cores under load the loop's thread waited 160 to 480 ms a 20 s phase for
a core (the loop bench's schedstat). Work on those threads loses nothing while the loop is idle.

A thread starts with its creator's nice value, so the threads made by niced threads (CTranslate2's,
started by the batch queue's thread) are niced as they start; those started by the loop's thread (ONNX
Runtime's pools, made at load, and the executors' threads) are found by a sweep of /proc/self/task
every SWEEP_S. Raising one's own threads' nice value needs no privilege."""

from __future__ import annotations

import asyncio
import logging
import os
import threading

log = logging.getLogger("appliance")

COMPUTE_NICE = 5  # a nice-0 thread's share against a nice-5 one's: 1024 to 335
SWEEP_S = 2.0


def nice_other_threads(keep: int, nice: int = COMPUTE_NICE) -> int:
    """Every thread of this process but `keep` (a native thread id) at least at `nice`; how many changed."""
    changed = 0
    for entry in os.scandir("/proc/self/task"):
        tid = int(entry.name)
        if tid == keep:
            continue
        try:
            if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                os.setpriority(os.PRIO_PROCESS, tid, nice)
                changed += 1
        except (ProcessLookupError, PermissionError):  # ended meanwhile, or a thread of another user
            continue
    return changed


async def keep_the_loop_first(interval_s: float = SWEEP_S) -> None:
    """Sweep every `interval_s`, on the loop (a few system calls a thread: well under a millisecond)."""
    loop_thread = threading.get_native_id()
    log.info("the event loop's thread runs ahead: the engine's other threads at nice %d", COMPUTE_NICE)
    while True:
        nice_other_threads(loop_thread)
        await asyncio.sleep(interval_s)
