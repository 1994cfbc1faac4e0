"""Shares against a real daemon, one and two protocol workers: one local user's idle connections
cannot take the Unix socket's slots from others (per uid, for the whole daemon), one address cannot hold the QUIC
listener's (per address), and stalled uploads through all workers together meet one body budget
(max_buffered_bytes holds for the daemon, not for each worker).
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import pytest
from conftest import ROOT, open_to_all
from promtext import sample

from appliance.client import Call, Client
from appliance.client.quic import QuicSession

NOBODY = 65534
HOLD_AS_ANOTHER_USER = """
import socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
held = []
for _ in range(count):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(path)
    held.append(s)
time.sleep(0.5)
last = held[-1]
last.settimeout(5)
last.sendall(b"GET /v2/health/ready HTTP/1.1\\r\\nhost: x\\r\\n\\r\\n")
print(last.recv(4096).decode("latin-1").split("\\r\\n")[0], flush=True)
kept = 0  # the connections the daemon holds: nothing came back on them (a refused one got its 503)
for s in held[:-1]:
    s.setblocking(False)
    try:
        s.recv(1)
    except BlockingIOError:
        kept += 1
print(kept, flush=True)
time.sleep(float(sys.argv[3]))
"""


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_one_users_idle_connections_cannot_take_the_slots_of_others(start_daemon, tmp_path, workers) -> None:
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    share = 16
    daemon = start_daemon(
        workers=workers,
        extra_server=f'socket_mode = "0666"\nmax_connections = 64\nmax_connections_per_peer = {share}\n',
    )
    open_to_all(daemon.socket.parent)
    attacker = subprocess.Popen(
        [sys.executable, "-c", HOLD_AS_ANOTHER_USER, str(daemon.socket), "200", "15"],
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert attacker.stdout is not None
        assert attacker.stdout.readline().startswith("HTTP/1.1 503"), attacker.stderr.read() if attacker.stderr else ""
        kept = int(attacker.stdout.readline())
        assert share // 2 <= kept <= share, f"user nobody holds {kept} connections, its share is {share}"
        for _ in range(30):  # fresh clients of another user, each on a new connection
            with Client(str(daemon.socket), timeout=10) as client:
                assert client.health()["ready"]
    finally:
        attacker.kill()
        attacker.wait()
    assert f"too many connections from uid:{NOBODY} (its share is {share}" in daemon.log.read_text()


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_one_address_holds_at_most_its_share_of_quic_connections(start_daemon, tls, workers) -> None:
    share = 4
    daemon = start_daemon(tls=tls, workers=workers, extra_quic=f"max_connections_per_address = {share}\n")

    async def served(session: QuicSession) -> bool:
        try:
            await session.open()
            return (await session.send(Call("GET", "/v2/health/ready"))).status == 200
        except ConnectionError:  # refused: CONNECTION_REFUSED, perhaps just after its handshake
            return False

    async def scenario() -> tuple[int, int]:
        sessions = [
            QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile, local_host="127.0.0.5", connect_timeout=5)
            for _ in range(3 * share * workers)
        ]
        outcomes = [await served(session) for session in sessions]
        other = QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile, local_host="127.0.0.6")
        assert await served(other)
        for session in (*sessions, other):
            await session.close()
        return sum(outcomes), outcomes.count(False)

    held, refused = asyncio.run(scenario())
    assert held <= share * workers and refused >= share * workers, (held, refused)
    assert "QUIC connections from 127.0.0.5" in daemon.log.read_text()


def test_stalled_uploads_through_two_workers_meet_one_daemon_wide_budget(start_daemon) -> None:
    """max_buffered_bytes 1 MiB, two workers: what they hold is counted against one budget (the engine
    process's ledger), so of six 300 KB stalled uploads at most three are held and the rest refused at
    once (a budget per worker would have held six where the kernel spread them), and the engine's
    /metrics sees what the workers hold, within the bound."""
    daemon = start_daemon(workers=2, extra_server=f"max_buffered_bytes = {1 << 20}\nbody_timeout_s = 5.0\n")
    head = b"POST /v2/models/silero_vad/infer HTTP/1.1\r\ncontent-length: 900000\r\n\r\n"
    uploads = []
    for _ in range(6):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(3)
        sock.connect(str(daemon.socket))
        try:
            sock.sendall(head + b"x" * 300_000)
        except OSError:
            pass
        uploads.append(sock)
        time.sleep(0.1)
    with daemon.client() as client:
        buffered = sample(client.metrics(), "appliance_buffered_bytes")
    refused = 0
    for sock in uploads:
        try:
            refused += sock.recv(64).startswith(b"HTTP/1.1 503")
        except TimeoutError:  # stalled and held: answered 408 only at the body timeout
            pass
        sock.close()
    assert refused >= 3, refused
    assert 300_000 <= buffered <= 1 << 20, buffered  # what the workers hold, seen by the engine process
    assert "held by all clients are at the limit of 1048576 bytes" in daemon.log.read_text()
