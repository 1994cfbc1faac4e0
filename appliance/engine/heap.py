"""The engine process's freed memory handed back to the kernel.

glibc keeps what Python, NumPy, ONNX Runtime and CTranslate2 free in its heaps (one per thread that
allocates, up to 8 a core) for the next allocation, and a mix of sizes leaves most of it there for good:
on the interpreter firmware after 20 min of mixed use (appliance bench --part memory) the engine
process held 2,263 MiB, and 1,044 MiB right after a malloc_trim(0), under the same load.

glibc's mmap threshold is left to move: fixed at 1 MiB, every block that large is mapped and unmapped
again, and Whisper base's CPU went from 31-32 s to 37-40 s on eight recordings of 6 to 25 s (three
times the page faults), for a peak no lower than this trim gives (439 MiB above rest against 434).
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("appliance")
TRIM_INTERVAL_S = 30.0  # a trim of a 2 GiB heap takes milliseconds, on a thread of its own


def heap_trim() -> Callable[[], int] | None:
    """glibc's malloc_trim(0), where the C library has it (not musl)."""
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: int(trim(0))


async def trim_heap_forever(interval_s: float = TRIM_INTERVAL_S) -> None:
    """Every `interval_s`, the heaps' free memory back to the kernel (off the event loop: the trim
    takes the heaps' locks, so an allocating thread waits, never the loop)."""
    trim = heap_trim()
    if trim is None:
        log.info("no malloc_trim in this C library: freed memory stays with the allocator")
        return
    while True:
        await asyncio.sleep(interval_s)
        await asyncio.to_thread(trim)
