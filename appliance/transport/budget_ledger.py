"""What each process of the daemon holds for its clients, in one page of shared memory (a memfd that the
engine process makes and hands to each protocol worker), so that server.max_buffered_bytes bounds the
daemon whichever process holds the bytes: the engine process its Realtime and Wyoming buffers, each
worker the bodies it reads. Each process writes only its own slot and reads them all. Without a lock,
processes that take at the same moment may pass the bound by what each took then (a body's chunk, a
buffer's append); a worker that dies has its slot cleared by the engine process."""

from __future__ import annotations

import mmap
import os
import struct

SLOT = struct.Struct("=q")  # bytes held by one process


class BudgetLedger:
    def __init__(self, fd: int, slots: int, slot: int) -> None:
        """`slots`: the engine process (0) and each protocol worker (its index + 1); `slot`: this
        process's."""
        self.fd, self.slots, self.slot = fd, slots, slot
        self._page = mmap.mmap(fd, slots * SLOT.size)

    @classmethod
    def create(cls, workers: int) -> BudgetLedger:
        """The engine process's, for it and `workers` protocol workers."""
        fd = os.memfd_create("appliance-byte-budget", os.MFD_CLOEXEC)
        os.ftruncate(fd, (workers + 1) * SLOT.size)
        return cls(fd, workers + 1, 0)

    @classmethod
    def attached(cls, fd: int, slot: int) -> BudgetLedger:
        """A protocol worker's view of the engine process's ledger, writing to `slot`."""
        return cls(fd, os.fstat(fd).st_size // SLOT.size, slot)

    def total(self) -> int:
        return sum(max(0, held) for (held,) in SLOT.iter_unpack(self._page))  # one's slip cannot free the rest

    def publish(self, held: int) -> None:
        SLOT.pack_into(self._page, self.slot * SLOT.size, held)

    def clear(self, slot: int) -> None:
        """A worker that ended holds nothing: its memory went with it."""
        SLOT.pack_into(self._page, slot * SLOT.size, 0)
