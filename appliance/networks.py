"""Address lists in the config (wyoming.allow, fleet.proxies): CIDRs, comma-separated, and whether a
host is within them."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


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
