"""What every stream connection is held to, whatever its protocol: admission (connections in all, and
one peer's share of them: a user on a Unix socket, an address on TCP; TLS handshakes in flight the
same way), descriptors kept for the Unix sockets, and the write deadline (a connection whose writes
make no progress for server.write_timeout_s is closed, its slot freed)."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Iterable

from appliance.transport.assembler import LIMITS_BITTEN, Rejection, limit_bit

# descriptors a TCP listener leaves to the rest of the process (the Unix sockets' accepts, models,
# shared memory): more than asyncio accepts in one wake (100), so a flood of TCP cannot starve them
FD_RESERVE = 128


def descriptors_short(fd: int) -> bool:
    """Whether a socket just accepted as `fd` leaves less than FD_RESERVE under RLIMIT_NOFILE: the
    kernel gives the lowest free number, so every descriptor below it is taken."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft != resource.RLIM_INFINITY and fd >= soft - FD_RESERVE


def worker_share(limit: int, workers: int) -> int:
    """One process's part of a daemon-wide limit: with N protocol workers each holds 1/N of it."""
    return max(1, limit // workers)


def admission_refusal(
    held: Iterable[str], key: str, limit: int, share: int, workers: int, what: str = "connections"
) -> Rejection | None:
    """Why a new connection of `key` is refused (503), or None: `held` names the peer of each of `what`
    this process holds; `limit` and `share` are the daemon's, of which this process holds 1/workers."""
    held = list(held)
    if len(held) >= worker_share(limit, workers):
        return limit_bit(503, f"too many {what} (limit {worker_share(limit, workers)})")
    if sum(peer == key for peer in held) >= worker_share(share, workers):
        each = f", {worker_share(share, workers)} in each of {workers} workers" if workers > 1 else ""
        return limit_bit(503, f"too many {what} from {key} (its share is {share}{each})")
    return None


class WriteProgress:
    """Whether a connection's writes move, from what its transport still holds at each check: while it
    holds something (the kernel's buffer is full) and none of it is taken, the deadline runs; a slow
    reader that takes anything starts it again."""

    def __init__(self) -> None:
        self._since: float | None = None
        self._held = 0

    def overdue(self, now: float, held: int, timeout_s: float) -> bool:
        if not held:
            self._since = None
        elif self._since is None or held < self._held:
            self._since = now
        self._held = held
        return self._since is not None and now - self._since > timeout_s

    def cut_off(self, now: float, transport: asyncio.WriteTransport, timeout_s: float) -> bool:
        """A client that has taken nothing for `timeout_s` is cut off, closing or not: what is queued
        for it is dropped (a close would wait for it to be read), and its connection_lost frees its slot."""
        if not self.overdue(now, transport.get_write_buffer_size(), timeout_s):
            return False
        LIMITS_BITTEN.bit("write timeout", f"a client read nothing for {timeout_s:g} s: connection closed")
        transport.abort()
        return True
