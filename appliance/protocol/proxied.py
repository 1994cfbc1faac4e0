"""Connections a load balancer opens for its clients (HAProxy's `send-proxy-v2`): each begins with a
PROXY protocol v2 header naming the client, read here with proxy-protocol's codec, so that admission,
one host's share and Wyoming's allow-list see the client and not the balancer (behind HAProxy every
connection came from its address: 16 Wyoming satellites and 16 TLS handshakes at once filled its
share, and wyoming.allow took whoever HAProxy took).

A header is read only from `[fleet] proxies`; from anyone else its bytes are what they are (TLS or
Wyoming then fails on them). A connection from a proxy must begin with one, as the specification
asks: a receiver never guesses whether a header comes. A LOCAL header (the balancer's own health
check) names no client: the connection is the balancer's."""

from __future__ import annotations

import asyncio
import functools
import socket
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import cast

from proxyprotocol.reader import ProxyProtocolReader
from proxyprotocol.typing import StreamReaderProtocol
from proxyprotocol.v2 import ProxyProtocolV2

from appliance.networks import Network, cidrs, within
from appliance.protocol.limits import LIMITS_BITTEN

Address = tuple[str, int]
_READER = ProxyProtocolReader(ProxyProtocolV2())
# the client a Wyoming connection's header named, for the connection's own task (its handler's)
ORIGIN: ContextVar[Address | None] = ContextVar("origin", default=None)


class BadHeader(Exception):
    """A proxy's connection whose PROXY header is missing, malformed or cut short."""


@functools.lru_cache(maxsize=4)
def _networks(setting: str) -> list[Network]:
    return cidrs(setting)  # [fleet] proxies, checked when the config was read


def from_proxy(host: str, proxies: str) -> bool:
    """Whether `host` is one of `proxies` (CIDRs, comma-separated, as [fleet] proxies holds them)."""
    return bool(proxies.strip()) and within(host, _networks(proxies))


async def checked(reading: Awaitable[Address | None], timeout_s: float, where: str) -> Address | None:
    """The client that `reading` (origin_from or origin_from_socket) finds within `timeout_s`; else
    BadHeader, logged (once per 10 s) as `where` closed."""
    try:
        async with asyncio.timeout(timeout_s):
            return await reading
    except (BadHeader, TimeoutError, OSError) as exc:
        why = str(exc) if isinstance(exc, BadHeader) else "no whole PROXY header in time"
        LIMITS_BITTEN.bit("proxy header", f"{where} closed: {why}")
        raise BadHeader(why) from None


async def origin_from(reader: asyncio.StreamReader) -> Address | None:
    """The client the PROXY header at the start of `reader` names; None for a LOCAL header. BadHeader
    where the connection does not begin with one."""
    return await _origin(cast(StreamReaderProtocol, reader))


async def origin_from_socket(sock: socket.socket) -> Address | None:
    """The same, read from a socket just accepted: nothing past the header is read (TLS begins there)."""
    return await _origin(cast(StreamReaderProtocol, _SocketReader(sock)))


async def _origin(reader: StreamReaderProtocol) -> Address | None:
    try:
        result = await _READER.read(reader)
    except asyncio.IncompleteReadError:
        raise BadHeader("the connection ended inside its PROXY header") from None
    except (OSError, BadHeader):
        raise
    except Exception as exc:  # proxy-protocol's syntax and checksum errors, struct's on a short address part
        why = str(exc) or type(exc).__name__  # a v1 line (send-proxy) fails the v2 signature too
        raise BadHeader(f"no PROXY v2 header ({why}; the box reads HAProxy's send-proxy-v2)") from None
    if not result.proxied:
        return None
    peer = result.peername
    if not isinstance(peer, tuple):
        raise BadHeader(f"a PROXY header naming no TCP client ({result.type.name})")
    return str(peer[0]), int(peer[1])


class _SocketReader:
    """readexactly() on a non-blocking socket, for proxy-protocol's reader (v2 asks for nothing else)."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock, self.loop = sock, asyncio.get_running_loop()

    async def readexactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = await self.loop.sock_recv(self.sock, n - len(data))
            if not chunk:
                raise asyncio.IncompleteReadError(data, n)
            data += chunk
        return data

    async def readline(self) -> bytes:
        raise BadHeader("a PROXY v1 header: the box reads v2 (HAProxy's send-proxy-v2)")
