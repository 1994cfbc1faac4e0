"""The event loop's thread ahead of the engine's others (engine/loop_first.py): in a process of its
own, every thread but the one named is niced and that one is not; in a real daemon, the engine
process's main thread (its event loop's) stays at 0 and its other threads, ONNX Runtime's among
them, reach COMPUTE_NICE."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from waits import wait_until

from appliance.engine.loop_first import COMPUTE_NICE

SCRIPT = """
import os, threading
from appliance.engine.loop_first import nice_other_threads
release = threading.Event()
workers = [threading.Thread(target=release.wait) for _ in range(3)]
for w in workers:
    w.start()
changed = nice_other_threads(threading.get_native_id())
again = nice_other_threads(threading.get_native_id())
tids = [w.native_id for w in workers]
print(changed, again, os.getpriority(os.PRIO_PROCESS, threading.get_native_id()),
      *[os.getpriority(os.PRIO_PROCESS, t) for t in tids])
release.set()
"""


def test_every_thread_but_the_loops_is_niced_once() -> None:
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True).stdout.split()
    changed, again, loop, *others = map(int, out)
    assert changed >= 3 and again == 0, out  # its three threads (and any a library started), then none left
    assert loop == 0 and others == [COMPUTE_NICE] * 3, out


def nice_by_thread(pid: int) -> dict[int, int]:
    """Each thread's nice value (field 19 of its stat, after the command's closing parenthesis)."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = int(fields[16])
    return out


def test_a_daemons_loop_thread_stays_at_0_and_its_other_threads_are_niced(start_daemon) -> None:
    daemon = start_daemon()
    pid = daemon.proc.pid
    wait_until(lambda: all(n == COMPUTE_NICE for t, n in nice_by_thread(pid).items() if t != pid), "threads niced")
    threads = nice_by_thread(pid)
    assert threads[pid] == 0 and len(threads) > 2, threads
    assert os.getpriority(os.PRIO_PROCESS, pid) == 0
