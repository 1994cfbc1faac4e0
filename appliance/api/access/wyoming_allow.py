"""Wyoming over TCP has no credentials (Home Assistant's peers rely on the network): its listener takes
a peer only from an address allow-list, `wyoming.allow` (CIDRs, comma-separated; read per connection,
so SIGHUP changes it). Unset, the box's own subnets (each interface's address and prefix) and loopback.
Behind a balancer in `[fleet] proxies`, the address is the client's that its PROXY header names
(protocol/proxied.py). A refused peer gets one `error` event naming its address and the setting, and
the connection closes; each refusal is counted (appliance_refused_total{reason="address",
listener="wyoming"}) and logged once per 10 s.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import time
from collections.abc import Awaitable, Callable

import ifaddr

from appliance.api.metrics import Metrics
from appliance.api.wyoming_codec import WyomingError
from appliance.api.wyoming_events import close_with_error
from appliance.config import Live
from appliance.networks import Network, cidrs, within
from appliance.protocol.proxied import ORIGIN, BadHeader, checked, from_proxy, origin_from

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
LOOPBACK = ("127.0.0.0/8", "::1/128")
OWN_NETWORKS_S = 10.0
# refused peers whose connection lingers at once, reading what they sent, so the error is read before the
# close (closing with their bytes unread resets it); past this, closed at once, so a flood holds no more
LINGERING = 64


def networks(setting: str) -> list[Network]:
    """The allow-list `setting` names, or the default where it is empty."""
    if setting.strip():
        return cidrs(setting)
    return _own_networks(int(time.monotonic() // OWN_NETWORKS_S))


@functools.lru_cache(maxsize=1)
def _own_networks(period: int) -> list[Network]:
    """Loopback and the subnets of this host's interfaces, read again each period (a DHCP lease may
    change an address); reading them costs 0.6 ms, too much for every connection of a flood."""
    # an IPv6 address comes from ifaddr as (address, flow info, scope)
    own = [
        f"{a.ip if isinstance(a.ip, str) else a.ip[0]}/{a.network_prefix}" for i in ifaddr.get_adapters() for a in i.ips
    ]
    return [ipaddress.ip_network(cidr, strict=False) for cidr in (*LOOPBACK, *own)]


def allowed(host: str, setting: str) -> bool:
    return within(host, networks(setting))


def guard(serve: Serve, live: Live, metrics: Metrics, clock: Callable[[], float] = time.monotonic) -> Serve:
    """`serve` for the peers the allow-list takes; the others refused before anything is read (the
    refusal's write deadline on `clock`, the listener's)."""

    lingering = 0

    async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal lingering
        host = str(writer.get_extra_info("peername")[0])
        if from_proxy(host, live.config.fleet.proxies):  # a balancer's: its header names the client
            try:
                timeout_s = live.config.server.header_timeout_s
                origin = await checked(origin_from(reader), timeout_s, f"a Wyoming connection from proxy {host}")
            except BaseException as exc:  # a bad header, or cancelled (the stop): the connection goes
                writer.close()
                if isinstance(exc, BadHeader):
                    return
                raise
            if origin is None:  # LOCAL: the balancer's own health check, which [fleet] proxies trusts
                await serve(reader, writer)
                return
            ORIGIN.set(origin)  # for this connection's task: serve's admission and owner see it
            host = origin[0]
        if allowed(host, live.config.wyoming.allow):
            await serve(reader, writer)
            return
        key = ("address", "wyoming")
        metrics.refused[key] = metrics.refused.get(key, 0) + 1
        refusal = WyomingError(f"address {host} may not use Wyoming here (wyoming.allow)", limit="address")
        linger = lingering < LINGERING
        lingering += linger
        try:
            await close_with_error(refusal, host, reader, writer, live.config.server.write_timeout_s, linger, clock)
        finally:
            lingering -= linger
            writer.close()

    return client
