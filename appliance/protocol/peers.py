"""What the API shows of the QUIC listener's peers (/status, /metrics), as plain data, and the small
interface of whatever provides it: the connection cache does, and the API never imports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol


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

    def droppers(self) -> dict[str, int]:
        """The drops of the peers that went over budget last (at most a few hundred)."""
        ...

    def totals(self) -> Totals: ...
