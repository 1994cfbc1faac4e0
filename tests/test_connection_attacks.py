"""The connection layer under attack (issue 47, items 2, 5, 6, 14 and 15), on real daemons over raw
sockets and TLS, with real clients beside the attack that must see no failure: one address cannot take
the HTTPS slots (its share, as a Unix user has one); a client that reads nothing is cut off after
server.write_timeout_s on both HTTP/1.1 listeners (the deadline itself on a clock the test holds);
WebSocket pongs wait on the same flow control as every frame; a message that never ends is closed;
TLS handshakes in flight are bounded, and the Unix socket keeps descriptors when TCP is flooded.
Verdicts are the order of events and bounds on memory, never seconds."""

from __future__ import annotations

import asyncio
import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import httpx2

from appliance.config import Config, Live, ServerConfig
from appliance.protocol.messages import Request, Response
from appliance.transport.assembler import BodyBudget
from appliance.transport.http1 import Http1Server

BIG = b"x" * (8 << 20)


def wait_until(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Bounded wait: fails only when `condition` never comes."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.05)


# --- the write deadline on a clock the test holds (the Unix socket's server; HTTPS is the same class) ---


class BigAnswers:
    async def handle(self, request: Request) -> Response:
        return Response(200, BIG, "application/octet-stream")

    def keep_connections(self) -> bool:
        return True

    def end_opened(self, opened: object) -> None:
        pass


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_client_that_reads_nothing_is_cut_off_after_the_write_deadline_and_a_slow_one_is_kept(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        clock = Clock()
        live = Live(Config(server=ServerConfig(write_timeout_s=5.0, keepalive_timeout_s=1000.0)))
        server = Http1Server(BigAnswers(), live, BodyBudget(lambda: live.config.server), clock)  # type: ignore[arg-type]
        listening = await asyncio.get_running_loop().create_unix_server(server.protocol, str(tmp_path / "s"))
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, str(tmp_path / "s"))
        client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        try:
            await until(lambda: len(server.connections) == 1 and not next(iter(server.connections))._writable.is_set())
            (connection,) = server.connections
            assert connection.transport is not None
            events = []
            clock.now += 4.9
            connection.check_timeouts(clock())
            events.append(("within the deadline", connection.transport.is_closing()))
            taken = 0
            while taken < (1 << 20):  # a slow reader: it takes some, then stops again
                await asyncio.sleep(0.01)
                try:
                    taken += len(client.recv(65536))
                except BlockingIOError:
                    pass
            connection.check_timeouts(clock())  # sees the buffer drained: the deadline starts again
            clock.now += 4.9
            connection.check_timeouts(clock())
            events.append(("a slow reader", connection.transport.is_closing()))
            clock.now += 0.2
            connection.check_timeouts(clock())
            events.append(("past the deadline", connection.transport.is_closing()))
            await until(lambda: not server.connections)  # its slot is free: connection_lost came
            assert events == [("within the deadline", False), ("a slow reader", False), ("past the deadline", True)]
        finally:
            client.close()
            server.close_all()
            listening.close()

    asyncio.run(run())


async def until(condition: Callable[[], bool]) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("the server did not get there")


# --- HTTPS: one address's share, and readers that stop, on a real daemon ---


def tls_connection(daemon, source: str, rcvbuf: int = 0) -> ssl.SSLSocket:
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.bind((source, 0))
    raw.settimeout(30)
    raw.connect(("127.0.0.1", daemon.https_port))
    return ssl.create_default_context(cafile=daemon.cafile).wrap_socket(raw, server_hostname="localhost")


def refused_at_once(sock: ssl.SSLSocket) -> str:
    """The status line the daemon sent unasked on a connection (a refusal), or "" (it holds the connection)."""
    sock.settimeout(0.5)
    try:
        return sock.recv(4096).decode("latin-1").split("\r\n")[0]
    except TimeoutError:
        return ""
    finally:
        sock.settimeout(30)


def good_https(daemon, source: str) -> httpx2.Client:
    transport = httpx2.HTTPTransport(
        verify=ssl.create_default_context(cafile=daemon.cafile), local_address=source, retries=0
    )
    return httpx2.Client(transport=transport, base_url=f"https://localhost:{daemon.https_port}", timeout=30)


def test_one_address_gets_its_share_of_https_and_a_client_that_stops_reading_is_cut_off(start_daemon, tls) -> None:
    daemon = start_daemon(
        tls=tls,
        https="max_connections = 8\nmax_connections_per_address = 4\n",
        extra_server="write_timeout_s = 1.0\n",
    )
    # an address holds idle connections: it gets its share, and nothing more
    held = [tls_connection(daemon, "127.0.0.1") for _ in range(12)]
    answers = [refused_at_once(s) for s in held]
    assert answers.count("") == 4, answers
    assert answers.count("HTTP/1.1 503 Service Unavailable") == 8, answers
    with good_https(daemon, "127.0.0.2") as good:
        assert [good.get("/v2/health/ready").status_code for _ in range(10)] == [200] * 10

    # another address's clients pipeline answers they never read: they hold its share ...
    stalled = [tls_connection(daemon, "127.0.0.3", rcvbuf=4096) for _ in range(4)]
    for sock in stalled:
        sock.sendall(b"GET /page/app.js HTTP/1.1\r\nhost: x\r\n\r\n" * 400)
    with good_https(daemon, "127.0.0.3") as late:
        assert late.get("/v2/health/ready").status_code == 503
        # ... until the write deadline cuts them off and frees it, while they still read nothing
        wait_until(lambda: late.get("/v2/health/ready").status_code == 200, "the stalled readers' slots freed")
    with good_https(daemon, "127.0.0.2") as good:
        assert [good.get("/v2/health/ready").status_code for _ in range(10)] == [200] * 10
    for sock in stalled:
        assert cut_off(sock)
    for sock in held:
        sock.close()
    assert "read nothing for 1 s: connection closed" in daemon.log.read_text()


def cut_off(sock: ssl.SSLSocket) -> bool:
    """Whether the daemon ended the connection before all 400 answers came (read now, at last)."""
    taken = 0
    try:
        while chunk := sock.recv(1 << 16):
            taken += len(chunk)
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        sock.close()
    return taken < 400 * 21000
