"""What every stream connection is held to, whatever its protocol: admission (connections in all, and
one peer's share of them: a user on a Unix socket, an address on TCP; TLS handshakes in flight the
same way; the bound itself is protocol/limits.py's over_bound, which Wyoming's listeners ask too), and
descriptors kept for the Unix sockets. The write deadline is protocol/flow.py's WriteProgress."""

from __future__ import annotations

import resource
from collections.abc import Iterable

from appliance.protocol.limits import over_bound
from appliance.transport.assembler import Rejection, limit_bit

# descriptors a TCP listener leaves to the rest of the process (the Unix sockets' accepts, models,
# shared memory): more than asyncio accepts in one wake (100), so a flood of TCP cannot starve them
FD_RESERVE = 128


def descriptors_short(fd: int) -> bool:
    """Whether a socket just accepted as `fd` leaves less than FD_RESERVE under RLIMIT_NOFILE: the
    kernel gives the lowest free number, so every descriptor below it is taken."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return soft != resource.RLIM_INFINITY and fd >= soft - FD_RESERVE


def admission_refusal(
    held: Iterable[str], key: str, limit: int, share: int, workers: int, what: str = "connections"
) -> Rejection | None:
    """Why a new connection of `key` is refused (503, protocol/limits.py's over_bound), or None."""
    found = over_bound(held, key, limit, share, workers, what)
    return None if found is None else limit_bit(503, found[1])
