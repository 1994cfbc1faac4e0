"""Hostile and careless HTTP/1.1 clients on the Unix socket and on the HTTPS listener (TLS on TCP):
each attack runs against a real daemon with short limits, once per transport with the same results,
and afterwards (or throughout) a good client is still served."""

from __future__ import annotations

import json
import select
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest
from conftest import Daemon, good_clients_throughout
from promtext import sample
from waits import wait_until

from appliance.audio import encode_wav
from appliance.client import Client
from appliance.client.unix import UnixTransport

LIMITS = (
    "header_timeout_s = 1.0\nbody_timeout_s = 1.0\nkeepalive_timeout_s = 1.5\n"
    f"max_header_bytes = {16 << 10}\nmax_buffered_bytes = {1 << 20}\npipeline_depth = 8\n"
)
HEALTH = b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n"


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, keys, bundle, tls):
    """The daemon under attack, with short limits and good clients on both transports throughout."""
    d = Daemon(tmp_path_factory.mktemp("hostile"), bundle, keys.trusted, extra_server=LIMITS, tls=tls, https="")
    d.wait_ready()
    with good_clients_throughout(d):
        yield d


@pytest.fixture(params=["unix", "https"])
def connect(request: pytest.FixtureRequest) -> Callable[[Daemon], socket.socket]:
    """A raw connection to the daemon's Unix socket, or a TLS one to its HTTPS port (handshake done)."""
    return lambda daemon: open_connection(daemon, request.param)


def open_connection(daemon: Daemon, transport: str) -> socket.socket:
    if transport == "https":
        context = ssl.create_default_context(cafile=daemon.cafile)
        tcp = socket.create_connection(("127.0.0.1", daemon.https_port), timeout=10)
        sock = context.wrap_socket(tcp, server_hostname="127.0.0.1")
        sock.settimeout(10)
        return sock
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(str(daemon.socket))
    return sock


def send(sock: socket.socket, data: bytes) -> None:
    """Send what the daemon will take: it may refuse a request before the client has sent it all."""
    try:
        sock.sendall(data)
    except OSError:  # refused (broken pipe, reset), or the test closed the socket
        pass


def read_all(sock: socket.socket) -> bytes:
    """Everything until the daemon closes the connection (over TLS, with or without close_notify)."""
    out = b""
    try:
        while chunk := sock.recv(1 << 16):
            out += chunk
    except (ssl.SSLEOFError, ConnectionResetError):
        pass
    return out


def responses(raw: bytes) -> list[tuple[int, bytes]]:
    """(status, body) of each response in a stream of them (content-length framed)."""
    out = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(int(v) for k, _, v in (line.partition(b": ") for line in lines[1:]) if k == b"content-length")
        out.append((int(lines[0].split()[1]), rest[:length]))
        raw = rest[length:]
    return out


def assert_served(daemon) -> None:
    with Client(str(daemon.socket), timeout=10) as client:
        assert client.health()["ready"]


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout(daemon, connect) -> None:
    """Closed with nothing said, and the daemon serves on (when: test_http1_timeouts.py, on a held clock)."""
    sock = connect(daemon)
    assert read_all(sock) == b""
    assert_served(daemon)


def test_a_head_that_never_ends_gets_408(daemon, connect) -> None:
    sock = connect(daemon)
    sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n")
    [(status, body)] = responses(read_all(sock))
    assert status == 408 and json.loads(body) == {"error": "request head not complete within 1 s"}
    assert "limit: request head not complete within 1 s" in daemon.log.read_text()
    assert_served(daemon)


def test_a_stalled_body_gets_408_and_its_bytes_go_back_to_the_budget(daemon, connect) -> None:
    for _ in range(3):  # more than the budget in total: each stalled body's bytes are given back
        sock = connect(daemon)
        sock.sendall(b"POST /v2/models/silero_vad/infer HTTP/1.1\r\ncontent-length: 700000\r\n\r\n" + b"x" * 600_000)
        [(status, body)] = responses(read_all(sock))
        assert status == 408 and json.loads(body) == {"error": "request body stalled for 1 s"}
    assert_served(daemon)


def test_stalled_uploads_together_meet_the_body_budget(daemon, connect) -> None:
    """An upload that keeps sending a byte now and then holds its 700 KB; the next one meets the budget.
    Once the first stops sending, it stalls: a 408."""
    upload = b"POST /v2/models/silero_vad/infer HTTP/1.1\r\ncontent-length: 900000\r\n\r\n" + b"x" * 700_000
    first = connect(daemon)
    first.sendall(upload)
    sending = threading.Event()
    sending.set()

    def trickle() -> None:  # never quiet for the body timeout (1 s), however slow the rest of the test
        while sending.is_set():
            first.sendall(b"x")
            time.sleep(0.1)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    try:
        with Client(str(daemon.socket), timeout=10) as client:
            wait_until(lambda: sample(client.metrics(), "appliance_buffered_bytes") >= 700_000, "the first held")
        second = connect(daemon)
        send(second, upload)
        [(status, body)] = responses(read_all(second))
    finally:
        sending.clear()
        trickler.join()
    assert status == 503 and "request bodies held by all clients are at the limit of 1048576 bytes" in body.decode()
    assert responses(read_all(first))[0][0] == 408
    assert_served(daemon)


def test_an_endless_header_line_is_refused_as_it_arrives(daemon, connect) -> None:
    sock = connect(daemon)
    send(sock, b"GET /" + b"a" * (4 << 20))  # 4 MiB of one line, never finished: refused as it arrives
    [(status, body)] = responses(read_all(sock))
    assert status == 431 and json.loads(body) == {"error": f"request line and headers exceed {16 << 10} bytes"}
    assert_served(daemon)


def test_a_good_request_then_garbage_are_answered_in_order(daemon, connect) -> None:
    sock = connect(daemon)
    sock.sendall(HEALTH + b"\x00\x01 not http\r\n\r\n")
    answers = responses(read_all(sock))
    assert [status for status, _ in answers] == [200, 400]
    assert json.loads(answers[0][1]) == {"ready": True}
    assert json.loads(answers[1][1])["error"].startswith("malformed HTTP request")


def test_a_client_that_half_closes_after_its_request_gets_the_answer(daemon) -> None:
    """The Unix socket only: asyncio's TLS has no half-close (docs/https.md)."""
    sock = open_connection(daemon, "unix")
    sock.sendall(HEALTH * 2)
    sock.shutdown(socket.SHUT_WR)
    assert [status for status, _ in responses(read_all(sock))] == [200, 200]


def test_pipelined_requests_are_all_answered_in_order_with_reading_paused(daemon, connect) -> None:
    sock = connect(daemon)
    count = 2000  # far more than pipeline_depth: the daemon stops reading until it has answered
    raw = exchange(sock, HEALTH * count, lambda raw: raw.count(b"HTTP/1.1 200") >= count)
    assert [status for status, _ in responses(raw)] == [200] * count


def exchange(sock: socket.socket, data: bytes, answered: Callable[[bytes], bool]) -> bytes:
    """Send `data` while reading the answers, in one thread (a TLS socket sent on and read from by two
    threads at once breaks the client: an empty read, or a crash in OpenSSL), until `answered`."""
    sock.setblocking(False)
    view, raw, deadline = memoryview(data), b"", time.monotonic() + 60
    blocked = (ssl.SSLWantReadError, ssl.SSLWantWriteError, BlockingIOError)
    while not answered(raw):
        assert time.monotonic() < deadline, f"{raw.count(b'HTTP/1.1 200')} answers within 60 s"
        moved = False
        try:
            chunk = sock.recv(1 << 16)
            assert chunk, f"closed after {raw.count(b'HTTP/1.1 200')} answers; its last bytes: {raw[-160:]!r}"
            raw, moved = raw + chunk, True
        except blocked:
            pass
        if view:
            try:
                view, moved = view[sock.send(view) :], True
            except blocked:
                pass
        if not moved:
            select.select([sock], [sock] if view else [], [], 1.0)
    return raw


def test_an_idle_keep_alive_connection_is_closed(daemon, connect) -> None:
    sock = connect(daemon)
    sock.sendall(HEALTH)
    raw = read_all(sock)  # answered, then closed with nothing more (when: test_http1_timeouts.py)
    assert [status for status, _ in responses(raw)] == [200]
    assert_served(daemon)


def test_the_client_opens_a_new_connection_where_the_keep_alive_timeout_closed_its_last(daemon) -> None:
    """The project's client keeps its connection between calls; idle past keepalive_timeout_s (1.5 s
    here) the daemon has closed it, and the next call goes on a new one instead of failing."""
    with Client(str(daemon.socket), timeout=10) as client:
        assert client.health()["ready"]
        assert isinstance(client.transport, UnixTransport)
        kept = client.transport._sock  # the connection it keeps between calls
        assert kept is not None
        wait_until(lambda: select.select([kept], [], [], 0)[0], "the idle connection closed by the daemon")
        assert kept.recv(1, socket.MSG_PEEK) == b""  # its end of file
        assert client.health()["ready"]
        assert client.transport._sock is not kept
        assert client.metrics()


def test_sigterm_while_a_body_uploads_finishes_the_upload(start_daemon, tls, connect) -> None:
    daemon = start_daemon(tls=tls, https="")
    wav = encode_wav(np.zeros(16000 * 5, np.float32), 16000)
    sock = connect(daemon)
    sock.sendall(b"POST /v2/models/silero_vad/segments HTTP/1.1\r\ncontent-length: %d\r\n\r\n" % len(wav) + wav[:1000])
    with Client(str(daemon.socket), timeout=10) as client:  # its head read, its first bytes held
        wait_until(lambda: sample(client.metrics(), "appliance_buffered_bytes") >= 1000, "its first bytes held")
    daemon.proc.send_signal(signal.SIGTERM)
    wait_until(lambda: "stopping: " in daemon.log.read_text(), "the stop begun")
    sock.sendall(wav[1000:])
    [(status, body)] = responses(read_all(sock))
    assert status == 200 and json.loads(body)["duration"] == 5.0
    assert daemon.proc.wait(30) == 0


def test_a_client_that_pipelines_and_never_reads_holds_little(daemon, connect) -> None:
    sock = connect(daemon)
    rss_before = daemon.rss_kib()
    sender = threading.Thread(target=send, args=(sock, HEALTH * 100_000))  # about 4 MiB of requests, never read
    sender.start()
    time.sleep(3)
    assert (daemon.rss_kib() - rss_before) / 1024 < 32  # reading paused, answers not queued past the buffer
    assert_served(daemon)
    sock.shutdown(socket.SHUT_RDWR)
    sender.join(10)
    sock.close()


def test_idle_connections_cannot_hold_every_slot(start_daemon, tls, connect) -> None:
    """Fifty connections that never send a byte hold every slot (the head's time, 5 s, is longer than
    fifty connects take on a slow machine): the next one gets a 503. Once the head's time is over they
    are closed, and a good client is served."""
    limits = "max_connections = 50\nheader_timeout_s = 5.0\n"
    daemon = start_daemon(extra_server=limits, tls=tls, https="max_connections = 50\n")
    idle = [connect(daemon) for _ in range(50)]  # every slot, and never a request
    wait_until(lambda: accept_queue(daemon) == 0, "all fifty accepted")  # a Unix connect returns before that
    refused = connect(daemon)
    [(status, body)] = responses(read_all(refused))
    assert status == 503 and json.loads(body) == {"error": "too many connections (limit 50)"}
    assert all(read_all(sock) == b"" for sock in idle)  # the head's time over: closed
    assert_served(daemon)


def accept_queue(daemon: Daemon) -> int:
    """Connections to the daemon's Unix socket that it has not accepted yet (its listener's Recv-Q)."""
    shown = subprocess.run(["ss", "-xlnH", "src", str(daemon.socket)], capture_output=True, text=True, check=True)
    return sum(int(line.split()[2]) for line in shown.stdout.splitlines())


def test_a_tcp_client_that_never_starts_tls_is_closed_after_the_header_timeout(daemon) -> None:
    """Slowloris below TLS: a TCP connection with no ClientHello has the head's time for its handshake."""
    sock = socket.create_connection(("127.0.0.1", daemon.https_port), timeout=10)
    assert read_all(sock) == b""  # closed by the daemon: the socket's 10 s timeout would raise instead
    assert_served(daemon)
