"""Address lists in the config (wyoming.allow, fleet.proxies): CIDRs, comma-separated, and whether a
host is within them; and the sockets the daemon listens on at configured addresses."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from appliance.errors import cannot_listen

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Bind = Callable[[Path], socket.socket]  # a Unix socket made at a path, as the API's is made


@dataclass(frozen=True)
class Listening:
    """A listener's socket as the daemon made it at its start, and what its end undoes."""

    sock: socket.socket
    path: Path | None = None  # its socket file, removed when the daemon ends
    goodbye: Callable[[], Awaitable[None]] | None = None  # its announcement on the LAN withdrawn


def cidrs(setting: str) -> list[Network]:
    """The networks of a comma-separated list of CIDRs; a ValueError names a bad one."""
    found = []
    for cidr in (c.strip() for c in setting.split(",") if c.strip()):
        try:
            found.append(ipaddress.ip_network(cidr, strict=False))
        except ValueError:
            raise ValueError(f"{cidr[:60]!r} is not an address or a CIDR (as 192.168.1.0/24)") from None
    return found


def within(host: str, networks: Iterable[Network]) -> bool:
    """Whether `host` (a peer's address: an IPv6 scope is dropped, an IPv4-mapped one read as IPv4) is
    in one of `networks`."""
    address = ipaddress.ip_address(host.split("%")[0])
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return any(address in network for network in networks)


def tcp_listener(key: str, host: str, port: int, backlog: int = 1024) -> socket.socket:
    """A TCP socket listening on `host`:`port` (IPv6 where the host is, IPv4 too on "::", as Linux has it;
    SO_REUSEADDR, so a restart binds again at once); a failure is the start's one line naming the config
    `key`."""
    six = ":" in host
    try:
        return socket.create_server(
            (host, port), family=socket.AF_INET6 if six else socket.AF_INET, backlog=backlog, dualstack_ipv6=six
        )
    except OSError as exc:
        raise cannot_listen(key, f"{host}:{port}", exc) from None
