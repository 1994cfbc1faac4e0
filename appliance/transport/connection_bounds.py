"""What every stream connection is held to, whatever its protocol: admission (connections in all, and
one peer's share of them: a user on a Unix socket, an address on TCP; TLS handshakes in flight the
same way; the bound itself is protocol/limits.py's over_bound, which Wyoming's listeners ask too),
descriptors kept for the Unix sockets, and the close after a rejection (RFC 9112's linger). The write deadline is protocol/flow.py's WriteProgress (HTTP/3's, what its peer acknowledged: h3_answers.py)."""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable, Iterable

from appliance.protocol.limits import over_bound
from appliance.transport.assembler import Rejection, limit_bit

# descriptors a TCP listener leaves to the rest of the process (the Unix sockets' accepts, models,
# shared memory): more than asyncio accepts in one wake (100), so a flood of TCP cannot starve them
FD_RESERVE = 128
LINGER_S = 2.0  # after a rejection, how long the rest of what the client sends is read and dropped


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


def linger(transport: asyncio.Transport, close: Callable[[], None]) -> None:
    """Close after a rejection the way RFC 9112 asks: stop sending, read and drop what the client is
    still sending for a moment, then close. Closing at once with its bytes unread would reset the
    connection, and the client could lose the answer that says why."""
    if transport.can_write_eof():
        transport.write_eof()
    transport.resume_reading()  # data_received drops it: the connection is rejected
    asyncio.get_running_loop().call_later(LINGER_S, close)
