"""The engine process's freed memory handed back to the kernel.

glibc keeps what Python, NumPy, ONNX Runtime and CTranslate2 free in its heaps (one per thread that
allocates, up to 8 a core) for the next allocation, and a mix of sizes leaves most of it there for good:
on the interpreter firmware after 20 min of mixed use (appliance bench --part memory) the engine
process held 2,263 MiB, and 1,044 MiB right after a malloc_trim(0), under the same load.

glibc also moves its mmap threshold up to the largest block freed (up to 32 MiB), so that the blocks
of a long recording or sentence go into those heaps once one has been freed, and stay there until the
next trim. The engine process fixes it at MMAP_THRESHOLD_BYTES before it loads its models: a block
that large is mapped on its own and unmapped when freed. appliance bench --part memory on the
interpreter firmware, each daemon beside one on the moving threshold: the median of the processes'
memory under load was 1,518 MiB against 2,028 over 15 min, 108 calls against 90 (fixed at 1 MiB:
1,329 against 1,963 over 40 min). Lower costs CTranslate2 page faults: Whisper base's CPU on eight
recordings of 6 to 25 s was 31-34 s moving, 34.7 s fixed at 8 MiB, 35.9 s at 4 MiB, 37-40 s at 1 MiB.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
from collections.abc import Callable

log = logging.getLogger("appliance")
# Whisper's batches free hundreds of MiB into the heaps, kept there until the next trim: Whisper alone
# in one process (four threads' batches, 5 min side by side) held a median of 790 MiB trimmed every 2 s
# against 1,087 every 30 s (at most 1,010 against 1,405), for 13.78 CPU-s a call against 13.63. A trim
# of a 2 GiB heap takes milliseconds, on a thread of its own.
TRIM_INTERVAL_S = 2.0
MMAP_THRESHOLD_BYTES = 8 << 20
M_MMAP_THRESHOLD = -3  # mallopt's parameter (malloc.h)


def fix_mmap_threshold(size: int = MMAP_THRESHOLD_BYTES) -> None:
    """Blocks of `size` bytes or more mapped on their own from now on, whatever was freed before (glibc's
    mallopt, where the C library has it)."""
    try:
        mallopt = ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        log.info("no mallopt in this C library: its mmap threshold moves with what is freed")
        return
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mallopt(M_MMAP_THRESHOLD, size)


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
