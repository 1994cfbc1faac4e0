"""What the API shows of the QUIC listener's peers (/status, /metrics), as plain data, and the small
interface of whatever provides it: the connection cache does, and the API never imports it. And a
peer's budget in user space, a token bucket."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


@dataclass(slots=True)
class Peer:
    address: str
    first_seen: float  # time.monotonic() seconds
    last_seen: float
    packets: int = 0
    bytes: int = 0
    drops: int = 0
    dcid: str = ""  # hex
    validated: bool = False  # in the long-lived table: its handshake completed, or it passed Retry

    def as_dict(self, now: float) -> dict[str, Any]:
        return {
            "peer": self.address,
            "age_s": round(now - self.first_seen, 3),
            "idle_s": round(now - self.last_seen, 3),
            "packets": self.packets,
            "bytes": self.bytes,
            "drops": self.drops,
            "dcid": self.dcid,
            "validated": self.validated,
        }


@dataclass(slots=True)
class Totals:
    packets: int = 0
    bytes: int = 0
    drops: int = 0
    peers_seen: int = 0


class PeerTable(Protocol):
    backend: str  # "ebpf" or "user"
    reason: str  # why this backend, where the kernel one could not load

    def peers(self) -> dict[str, Peer]:
        """Every peer of both tables (the operator's /status: a walk of the whole cache)."""
        ...

    def validated_peers(self) -> dict[str, Peer]:
        """The peers whose handshake completed (a flood of other sources cannot grow this table)."""
        ...

    def validated_count(self) -> int:
        """How many validated peers (/metrics: a count, not 65,536 peers made and filtered)."""
        ...

    def droppers(self) -> dict[str, int]:
        """The drops of the peers that went over budget last (at most a few hundred)."""
        ...

    def totals(self) -> Totals: ...


async def without_stalling(table: PeerTable, read: Callable[[], T]) -> T:
    """`read` of the table where it cannot stall the event loop. The kernel's maps are read in a thread:
    a walk of a full validated table (65,536 peers) is 0.7 to 0.8 s of bpf() calls, and the kernel's
    maps may be read and trimmed beside the filter and the loop. The user-space tables are Python dicts
    that the loop changes, so they are read on it (a thread would walk them mid-change)."""
    return await asyncio.to_thread(read) if table.backend == "ebpf" else read()


@dataclass(slots=True)
class PeerReading:
    """A peer table as read once, for one /metrics or /status answer."""

    backend: str
    reason: str
    read_peers: dict[str, Peer]  # every peer (/status); none for /metrics, which counts the validated ones
    read_validated_count: int
    read_droppers: dict[str, int]
    read_totals: Totals

    def peers(self) -> dict[str, Peer]:
        return self.read_peers

    def validated_peers(self) -> dict[str, Peer]:
        return {address: peer for address, peer in self.read_peers.items() if peer.validated}

    def validated_count(self) -> int:
        return self.read_validated_count

    def droppers(self) -> dict[str, int]:
        return self.read_droppers

    def totals(self) -> Totals:
        return self.read_totals


async def reading(table: PeerTable, every_peer: bool) -> PeerReading:
    """The table as read once: with `every_peer` each peer (/status), else the validated ones counted
    (/metrics; a walk of the unvalidated sources' table would meet a flood at its largest)."""

    def read() -> PeerReading:
        peers = table.peers() if every_peer else {}
        count = sum(p.validated for p in peers.values()) if every_peer else table.validated_count()
        return PeerReading(table.backend, table.reason, peers, count, table.droppers(), table.totals())

    return await without_stalling(table, read)


class TokenBucket:
    """`rate` tokens a second, at most `burst` saved; `take` spends one if there is one."""

    __slots__ = ("rate", "burst", "clock", "tokens", "updated")

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst, self.clock = rate, burst, clock
        self.tokens, self.updated = burst, clock()

    def take(self) -> bool:
        now = self.clock()
        self.tokens = min(self.burst, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens < 1:
            return False
        self.tokens -= 1
        return True
