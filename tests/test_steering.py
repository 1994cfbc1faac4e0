"""QUIC steering across worker sockets (bpf/quic_steering.c): several H3 servers in this process, each
on its own socket of one SO_REUSEPORT group with its worker key, and real aioquic clients.

Every datagram is traced from the client that sent it (its connection's datagrams_to_send) to the
socket that received it (each server's datagram_received), so each assertion is about where the
kernel put a connection's packets. Without steering the kernel hashes the 4-tuple, which already
keeps a connection that never moves on one socket; so the clients also migrate (a new local port,
a fresh connection ID from NEW_CONNECTION_ID), and a probe from the new port with an unknown key
shows where the hash alone would have sent them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
import socket
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import pytest
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from conftest import root_can

from appliance.bench.daemon import free_udp_port
from appliance.client.http import Call
from appliance.client.quic import QuicSession
from appliance.config import Config, ConnCacheConfig, Live
from appliance.protocol.messages import Request, Response
from appliance.transport.assembler import BodyBudget
from appliance.transport.conncache import STEERING_MAP, ConnectionCache, KernelCache
from appliance.transport.conncache_choice import open_cache
from appliance.transport.h3_server import H3Server
from appliance.transport.steering_ids import tag_cid, tag_connection_ids

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="loading BPF programs needs root")
PROBE = b"\x40" + bytes(8) + b"probe"  # short header, key 0: never a worker's, so the kernel's hash picks


def dcid(data: bytes) -> bytes:
    if data[0] & 0x80:
        return data[6 : 6 + data[5]]
    return data[1:9]


def worker_keys(count: int) -> list[int]:
    keys: set[int] = set()
    while len(keys) < count:
        keys.add(random.randrange(1, 1 << 32))
    return list(keys)


def reuseport_group(port: int, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(("127.0.0.1", port))
        socks.append(sock)
    return socks


def steered_cache(settings: Any, socks: list[socket.socket], keys: list[int]) -> ConnectionCache:
    """The engine's cache with steering; skipped only where bcc cannot load the connection cache itself
    (the steering compiles with the same bcc and headers, so its own failure is a failure here)."""
    cache = steered_cache_or_reason(settings, socks, keys)
    assert cache.steering_reason == "", cache.steering_reason
    return cache


# --- the tag -------------------------------------------------------------------------------------


def test_tag_cid_puts_the_key_first_big_endian_and_is_idempotent() -> None:
    cid = bytes.fromhex("0102030405060708")
    assert tag_cid(cid, 0xA1B2C3D4) == bytes.fromhex("a1b2c3d405060708")
    assert tag_cid(tag_cid(cid, 0xA1B2C3D4), 0xA1B2C3D4) == tag_cid(cid, 0xA1B2C3D4)
    assert tag_cid(cid, 1) == bytes.fromhex("0000000105060708")


def test_every_host_connection_id_of_a_server_connection_is_tagged(tls: tuple[Path, Path]) -> None:
    key = 0xDEADBEEF
    configuration = QuicConfiguration(is_client=False)
    configuration.load_cert_chain(tls[0], tls[1])
    quic = QuicConnection(configuration=configuration, original_destination_connection_id=os.urandom(8))
    tag_connection_ids(quic, key)
    assert quic.host_cid[:4] == key.to_bytes(4, "big") and len(quic.host_cid) == 8
    assert quic._local_initial_source_connection_id == quic.host_cid == quic._host_cids[0].cid
    quic._remote_active_connection_id_limit = 8  # as the client's transport parameters would allow
    quic._replenish_connection_ids()
    cids = [c.cid for c in quic._host_cids]
    assert len(cids) == 8 and len(set(cids)) == 8  # the other 4 bytes stay random
    assert all(c[:4] == key.to_bytes(4, "big") for c in cids), [c.hex() for c in cids]


# --- the program, with raw datagrams -----------------------------------------------------------


@needs_root
def test_the_program_reads_both_headers_and_passes_the_rest_to_the_hash() -> None:
    port, keys = free_udp_port(), worker_keys(3)
    socks = reuseport_group(port, 3)
    config = ConnCacheConfig(pin_dir=Path("/sys/fs/bpf") / f"appliance-test-steer-{os.getpid()}-raw")
    cache = steered_cache(lambda: config, socks, keys)
    senders = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(24)]
    try:
        assert (config.pin_dir / STEERING_MAP).exists()
        for sock in socks:
            sock.settimeout(1.0)

        def landed(datagrams: list[bytes]) -> list[int]:
            """Which socket received each datagram (sent in order, each from its own sender)."""
            for index, data in enumerate(datagrams):
                senders[index].sendto(data, ("127.0.0.1", port))
            where: dict[bytes, int] = {}
            for index, sock in enumerate(socks):
                sock.setblocking(False)
                while True:
                    try:
                        where[sock.recv(2048)] = index
                    except BlockingIOError:
                        break
            return [where[data] for data in datagrams]

        for index, key in enumerate(keys):
            tag = key.to_bytes(4, "big")
            short = [b"\x41" + tag + os.urandom(4 + 40) for _ in range(8)]
            long = [b"\xc3\x00\x00\x00\x01\x08" + tag + os.urandom(4) + b"\x08" + os.urandom(30) for _ in range(8)]
            assert landed(short) == [index] * 8
            assert landed(long) == [index] * 8
        # not ours: an unknown key, a DCID of another length, too short to read: the hash spreads them
        # by source port, as it would with no program
        tag = keys[0].to_bytes(4, "big")
        for others in (
            [b"\x40" + os.urandom(48) for _ in range(24)],
            [b"\xc3\x00\x00\x00\x01\x05" + tag + os.urandom(40) for _ in range(24)],
            [b"\x40" + bytes([i]) + tag[:2] for i in range(24)],  # each datagram unique, for `landed`
            [b"\xc3\x00\x00\x00" + bytes([i]) for i in range(24)],
        ):
            assert len(set(landed(others))) > 1
    finally:
        for sender in senders:
            sender.close()
        cache.close()
        for sock in socks:
            sock.close()
    assert not config.pin_dir.exists()


@needs_root
def test_steering_needs_two_sockets_and_the_kernel_backend() -> None:
    port = free_udp_port()
    (one,) = socks = reuseport_group(port, 1)
    config = ConnCacheConfig(pin_dir=Path("/sys/fs/bpf") / f"appliance-test-steer-{os.getpid()}-one")
    cache = open_cache(lambda: config, socks, [7])
    try:
        assert cache.steering_reason == "one socket: nothing to steer"
        assert not (config.pin_dir / STEERING_MAP).exists()
    finally:
        cache.close()
        one.close()
    user = dataclasses.replace(config, backend="user")
    socks = reuseport_group(free_udp_port(), 2)
    cache = open_cache(lambda: user, socks, [1, 2])
    assert cache.backend == "user" and "user-space" in cache.steering_reason
    with pytest.raises(ValueError):
        open_cache(lambda: user, socks, [1, 1])
    with pytest.raises(ValueError):
        open_cache(lambda: user, socks, [1])
    for sock in socks:
        sock.close()


@needs_root
def test_a_steering_failure_leaves_the_connection_cache_standing() -> None:
    socks = []
    for _ in range(2):  # two sockets but no SO_REUSEPORT group: the kernel refuses a group program
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        socks.append(sock)
    config = ConnCacheConfig(pin_dir=Path("/sys/fs/bpf") / f"appliance-test-steer-{os.getpid()}-nogroup")
    cache = steered_cache_or_reason(lambda: config, socks, worker_keys(2))
    try:
        assert cache.backend == "ebpf" and "one SO_REUSEPORT group?" in cache.steering_reason, cache.steering_reason
        assert not (config.pin_dir / STEERING_MAP).exists()
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sender:
            sender.bind(("127.0.0.2", 0))
            for sock in socks:
                sender.sendto(b"\x40" + os.urandom(40), sock.getsockname())
            peer = f"127.0.0.2:{sender.getsockname()[1]}"
            assert cache.peers()[peer].packets == 2  # the filter counts on both sockets
    finally:
        cache.close()
        for sock in socks:
            sock.close()


def steered_cache_or_reason(settings: Any, socks: list[socket.socket], keys: list[int]) -> ConnectionCache:
    cache = open_cache(settings, socks, keys)
    if cache.backend != "ebpf":
        cache.close()
        root_can(f"the eBPF connection cache cannot load here: {cache.reason}")
    return cache


# --- real QUIC connections ---------------------------------------------------------------------


class WorkerApi:
    """What each worker answers: its own index (the test checks the answer came from the right one)."""

    def __init__(self, index: int) -> None:
        self.index = index

    async def handle(self, request: Request) -> Response:
        return Response(200, f"worker {self.index}".encode(), content_type="text/plain")


class Trace:
    """Who sent each datagram (client index) and which socket received it (worker index)."""

    def __init__(self) -> None:
        self.sent: dict[bytes, int] = {}
        self.received: list[tuple[int, bytes, Any]] = []  # (worker, datagram, source address)

    def watch_server(self, server: H3Server, worker: int) -> None:
        quic_server = server._quic_server
        assert quic_server is not None
        receive = quic_server.datagram_received

        def received(data: bytes | str, addr: Any) -> None:
            self.received.append((worker, bytes(data), addr))  # type: ignore[arg-type]
            receive(data, addr)

        quic_server.datagram_received = received  # type: ignore[method-assign]

    def watch_client(self, session: QuicSession, client: int) -> None:
        quic = session._protocol._quic  # type: ignore[union-attr]
        datagrams_to_send = quic.datagrams_to_send

        def recorded(now: float) -> list[tuple[bytes, Any]]:
            out = datagrams_to_send(now=now)
            for data, _ in out:
                self.sent[data] = client
            return out

        quic.datagrams_to_send = recorded  # type: ignore[method-assign]


async def migrate(session: QuicSession) -> int:
    """The client moves to a new local port (as after a NAT rebinding or a network change) and
    switches to a fresh server connection ID (one the server announced in NEW_CONNECTION_ID)."""
    protocol, old = session._protocol, session._transport
    assert protocol is not None and old is not None
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    loop = asyncio.get_running_loop()
    session._transport, _ = await loop.create_datagram_endpoint(lambda: protocol, sock=sock)
    old.close()
    protocol.change_connection_id()
    protocol.transmit()
    return sock.getsockname()[1]


async def serve_and_call(
    tls: tuple[Path, Path], workers: int, clients: int, calls: int, retry: bool, pin_dir: Path
) -> tuple[Trace, list[dict[str, Any]], list[int]]:
    port, keys = free_udp_port(), worker_keys(workers)
    config = Config()
    config = dataclasses.replace(
        config,
        quic=dataclasses.replace(
            config.quic, enabled=True, port=port, certificate=tls[0], private_key=tls[1], retry=retry
        ),
        conncache=dataclasses.replace(config.conncache, pin_dir=pin_dir),
    )
    live = Live(config)
    socks = reuseport_group(port, workers)
    cache = steered_cache(lambda: live.config.conncache, socks, keys)
    servers, trace = [], Trace()
    try:
        for index, (sock, key) in enumerate(zip(socks, keys, strict=True)):
            server = H3Server(WorkerApi(index), live, BodyBudget(lambda: live.config.server), worker_key=key)  # type: ignore[arg-type]
            # the engine's cache for worker 0; the others read its pins, as worker processes would
            await server.start(sock, cache=cache if index == 0 else KernelCache.attached(lambda: live.config.conncache))
            trace.watch_server(server, index)
            servers.append(server)
        assert all(s.cache is not None and s.cache.steering_reason == "" for s in servers)

        async def one_client(index: int) -> dict[str, Any]:
            session = QuicSession(f"127.0.0.1:{port}", str(tls[0]))
            await session.open(wait_connected=False)
            trace.watch_client(session, index)
            protocol = session._protocol
            assert protocol is not None
            protocol.transmit()
            await asyncio.wait_for(protocol.connected, 10)
            quic = protocol._quic
            answers = [await session.send(Call("GET", "/whoami")) for _ in range(calls)]
            ports = [session._transport.get_extra_info("sockname")[1]]  # type: ignore[union-attr]
            ports.append(await migrate(session))
            session._transport.sendto(PROBE + bytes([index]), ("127.0.0.1", port))  # type: ignore[union-attr]
            for _ in range(calls):  # a migrated connection that lost its worker would wait out the idle timeout
                answers.append(await asyncio.wait_for(session.send(Call("GET", "/whoami")), 5))
            out = {
                "answers": [(a.status, a.body.decode()) for a in answers],
                "original_dcid": quic.original_destination_connection_id,
                "key": quic._peer_cid.cid[:4],
                "ports": ports,
                "retried": quic._retry_count,
            }
            await session.close()
            return out

        results = await asyncio.gather(*(one_client(i) for i in range(clients)))
        await asyncio.sleep(0.2)  # the closing datagrams land
        # one filter on every socket, one table: each client's two ports, whichever worker they reached,
        # and a worker's attached reader sees the same table
        table = {peer for peer in cache.peers() if peer.startswith("127.0.0.1:")}
        assert len(table) >= 2 * clients, table
        assert servers[1].cache is not None and set(servers[1].cache.peers()) >= table
    finally:
        for server in servers:
            server.close_all()
        if not servers:
            cache.close()
    assert not pin_dir.exists(), "the engine's cache left its pins behind"
    return trace, results, keys


@needs_root
@pytest.mark.parametrize("retry", [False, True], ids=["no-retry", "retry"])
def test_each_connection_reaches_the_socket_its_key_names_even_after_migrating(
    tls: tuple[Path, Path], retry: bool
) -> None:
    workers, clients, calls = 3, 16, 4
    pin_dir = Path("/sys/fs/bpf") / f"appliance-test-steer-{os.getpid()}-{'retry' if retry else 'plain'}"
    trace, results, keys = asyncio.run(serve_and_call(tls, workers, clients, calls, retry, pin_dir))
    tags = [key.to_bytes(4, "big") for key in keys]

    per_connection: dict[int, Counter[int]] = defaultdict(Counter)
    initial_flight: dict[int, set[int]] = defaultdict(set)
    hash_pick: dict[int, int] = {}
    for worker, data, _ in trace.received:
        if data.startswith(PROBE):
            hash_pick[data[len(PROBE)]] = worker
            continue
        client = trace.sent.get(data)
        assert client is not None, f"worker {worker} got a datagram no client sent: {data[:16].hex()}"
        result = results[client]
        if dcid(data) == result["original_dcid"] or (data[0] & 0xF0 == 0xC0 and dcid(data)[:4] not in tags):
            initial_flight[client].add(worker)  # the client's own DCID, or (Retry) the Retry's: hashed
            continue
        per_connection[client][worker] += 1
        assert dcid(data)[:4] == result["key"], "a connection used a server CID with another key"

    report = {c: dict(per_connection[c]) for c in range(clients)}
    print(f"datagrams per socket per connection after the Initial flight (retry={retry}): {report}")
    print(f"hash's pick for the migrated port: {hash_pick}")
    moved = 0
    for client, result in enumerate(results):
        worker = tags.index(result["key"])
        assert result["answers"] == [(200, f"worker {worker}")] * (2 * calls), (client, result["answers"])
        assert set(per_connection[client]) == {worker}, (client, worker, report[client])
        assert per_connection[client][worker] >= 2 * calls + 2  # requests, acks and the path validation
        assert initial_flight[client] == {worker}  # the hash gave the Initial to the worker that then named itself
        assert result["retried"] == (1 if retry else 0)
        moved += hash_pick[client] != worker
    assert len({tags.index(r["key"]) for r in results}) > 1, "every connection landed on one socket"
    # the hash alone would have moved some migrated connections to another worker: steering kept them
    assert moved > 0, hash_pick
