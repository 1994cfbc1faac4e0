"""A box behind a balancer that opens its connections with a PROXY v2 header (HAProxy's send-proxy-v2,
`[fleet] proxies`): Wyoming's allow-list and one host's share, and HTTPS's, are the client's that the
header names, not the balancer's; a header is required from the balancer and read from nobody else.
The headers here are packed by hand from the specification (haproxy.org's proxy-protocol.txt, 2.2);
test_fleet_haproxy.py runs the real HAProxy."""

from __future__ import annotations

import asyncio
import http.client
import ipaddress
import socket
import ssl
import struct
from pathlib import Path

import pytest
from conftest import Daemon
from wyoming.client import AsyncTcpClient
from wyoming.error import Error
from wyoming.event import Event
from wyoming.info import Describe, Info

from appliance.bench.daemon import free_tcp_port

BALANCER = "127.0.0.1"  # the test's own connections come from here: the box takes it as its balancer
SIGNATURE = b"\r\n\r\n\x00\r\nQUIT\n"


def header(client: str | None, client_port: int = 40000) -> bytes:
    """A PROXY v2 header for TCP over IPv4 from `client`; None: a LOCAL one (a balancer's health check)."""
    if client is None:
        return SIGNATURE + bytes([0x20, 0x00]) + struct.pack("!H", 0)
    addresses = ipaddress.IPv4Address(client).packed + ipaddress.IPv4Address("127.0.0.1").packed
    body = addresses + struct.pack("!HH", client_port, 443)
    return SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", len(body)) + body


class Satellite(AsyncTcpClient):
    """A Wyoming client that HAProxy would have brought: its connection opens with `preface`."""

    def __init__(self, port: int, preface: bytes, source: str = BALANCER) -> None:
        super().__init__("127.0.0.1", port, read_timeout=30)
        self.preface, self.source = preface, source

    async def connect(self) -> None:
        self._reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port, local_addr=(self.source, 0))
        self._writer.write(self.preface)


@pytest.fixture(scope="module")
def box(tmp_path_factory: pytest.TempPathFactory, keys, bundle: Path, tls) -> Daemon:
    port = free_tcp_port()
    extra = (
        f'[wyoming]\ntcp = "127.0.0.1:{port}"\nallow = "127.0.0.0/8, 198.51.100.0/24"\nmax_connections_per_peer = 4\n'
        f'[fleet]\nproxies = "{BALANCER}/32"\n'
    )
    daemon = Daemon(tmp_path_factory.mktemp("proxied"), bundle, keys.trusted, extra, tls=tls, https="")
    daemon.wait_ready()
    daemon.wyoming_port = port  # type: ignore[attr-defined]
    yield daemon
    assert daemon.stop() == 0


async def answers(port: int, preface: bytes, source: str = BALANCER) -> str:
    """What a describe gets: "info", an error's code and text, or "closed"."""
    try:
        async with Satellite(port, preface, source) as satellite:
            await satellite.write_event(Describe().event())
            event = await satellite.read_event()
    except (ConnectionError, asyncio.IncompleteReadError):
        return "closed"
    if event is None:
        return "closed"
    if Info.is_type(event.type):
        return "info"
    error = Error.from_event(event)
    return f"{error.code}: {error.text}"


def test_wyoming_takes_the_client_a_header_names_for_its_allow_list(box: Daemon) -> None:
    port = box.wyoming_port  # type: ignore[attr-defined]
    assert asyncio.run(answers(port, header("198.51.100.7"))) == "info"
    refused = asyncio.run(answers(port, header("192.0.2.7")))
    assert refused.startswith("address: address 192.0.2.7 may not use Wyoming here (wyoming.allow)"), refused
    assert asyncio.run(answers(port, header(None))) == "info"  # a health check: the balancer's own connection


def test_wyoming_gives_each_client_behind_the_balancer_its_own_share(box: Daemon) -> None:
    """Eight clients through one balancer, two connections each, all served (the balancer alone would
    have had a share of 4); a fifth connection of one client is refused."""
    port = box.wyoming_port  # type: ignore[attr-defined]

    async def run() -> tuple[list[Event | None], str]:
        satellites = [Satellite(port, header(f"198.51.100.{20 + i // 2}", 40000 + i)) for i in range(16)]
        one_client = [Satellite(port, header("198.51.100.99", 41000 + i)) for i in range(4)]
        for satellite in [*satellites, *one_client]:
            await satellite.connect()
        try:
            for satellite in satellites:
                await satellite.write_event(Describe().event())
            heard = [await s.read_event() for s in satellites]
            return heard, await answers(port, header("198.51.100.99", 41009))
        finally:
            for satellite in [*satellites, *one_client]:
                await satellite.disconnect()

    heard, fifth = asyncio.run(run())
    assert all(e is not None and Info.is_type(e.type) for e in heard), heard
    assert fifth.startswith("too_many_connections_from_peer"), fifth


def test_a_connection_from_the_balancer_without_a_header_is_closed_and_one_from_elsewhere_is_not_read(
    box: Daemon,
) -> None:
    port = box.wyoming_port  # type: ignore[attr-defined]
    assert asyncio.run(answers(port, b"")) == "closed"  # a describe is no PROXY header
    short = SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", 0)  # TCP over IPv4 with no addresses
    assert asyncio.run(answers(port, short)) == "closed"
    assert asyncio.run(answers(port, header("198.51.100.7"))) == "info"  # and the next is served
    assert "a Wyoming connection from proxy 127.0.0.1 closed: no PROXY v2 header" in box.log.read_text()
    # from an address that is not a balancer, a header is the client's own bytes: not an event
    spoofed = asyncio.run(answers(port, header("198.51.100.7"), source="127.0.0.2"))
    assert spoofed != "info", spoofed
    assert asyncio.run(answers(port, b"", source="127.0.0.2")) == "info"


def https_status(daemon: Daemon, preface: bytes) -> int | str:
    """A health check over TLS on a connection that opens with `preface`; its status, or "closed"."""
    context = ssl.create_default_context(cafile=daemon.cafile)
    context.check_hostname = False
    raw = socket.create_connection(("127.0.0.1", daemon.https_port), timeout=30)
    raw.sendall(preface)
    try:
        sock = context.wrap_socket(raw)
    except (ssl.SSLError, ConnectionError):
        raw.close()
        return "closed"
    connection = http.client.HTTPConnection("box", timeout=30)
    connection.sock = sock
    connection.request("GET", "/v2/health/ready")
    status = connection.getresponse().status
    connection.close()
    return status


@pytest.fixture(scope="module")
def https_box(tmp_path_factory: pytest.TempPathFactory, keys, bundle: Path, tls) -> Daemon:
    extra = f'[fleet]\nproxies = "{BALANCER}/32"\n'
    daemon = Daemon(
        tmp_path_factory.mktemp("proxied-https"),
        bundle,
        keys.trusted,
        extra,
        tls=tls,
        https="max_connections_per_address = 2\n",
    )
    daemon.wait_ready()
    yield daemon
    assert daemon.stop() == 0


def test_https_behind_the_balancer_shares_by_the_client_it_names(https_box: Daemon) -> None:
    """Connections held open: two of each of three clients are served (the balancer alone would have
    had a share of 2); a third of one client is refused with a 503."""
    context = ssl.create_default_context(cafile=https_box.cafile)
    context.check_hostname = False
    held = []
    try:
        for client in ("192.0.2.1", "192.0.2.2", "192.0.2.3", "192.0.2.1", "192.0.2.2", "192.0.2.3"):
            raw = socket.create_connection(("127.0.0.1", https_box.https_port), timeout=30)
            raw.sendall(header(client))
            held.append(http.client.HTTPConnection("box", timeout=30))
            held[-1].sock = context.wrap_socket(raw)
        for connection in held:
            connection.request("GET", "/v2/health/ready")
            assert connection.getresponse().status == 200
        assert https_status(https_box, header("192.0.2.1", 40001)) == 503
        assert https_status(https_box, header("192.0.2.4")) == 200
        assert https_status(https_box, header(None)) == 200  # HAProxy's check of the traffic port
    finally:
        for connection in held:
            connection.close()
    assert https_status(https_box, b"") == "closed"  # the balancer's connection without its header
    assert https_status(https_box, SIGNATURE + bytes([0x21, 0x11]) + struct.pack("!H", 0)) == "closed"
    assert https_status(https_box, header("192.0.2.5")) == 200
