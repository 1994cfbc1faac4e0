"""HTTP/1.1 Upgrade on the Unix socket: only a WebSocket handshake switches protocols; any other
Upgrade is ignored as RFC 9110 allows (the request is served whole, body and all, and the connection
goes on). The answers are read with h11, a peer's parser: an unsolicited response would be an error."""

from __future__ import annotations

import base64
import os
import socket

import h11
from conftest import Daemon
from speech import RATE, say

from appliance.audio import encode_wav


def exchange(daemon: Daemon, data: bytes, answers: int) -> list[tuple[int, bytes]]:
    """Send `data` at once; read `answers` responses with h11 (status, body), and check nothing else came."""
    client = h11.Connection(h11.CLIENT)
    out: list[tuple[int, bytes]] = []

    def expect_answer() -> None:  # h11 reads an answer to a request it saw sent: tell it one was
        client.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
        client.send(h11.EndOfMessage())

    expect_answer()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(20)
        sock.connect(str(daemon.socket))
        sock.sendall(data)
        status, body = 0, b""
        while len(out) < answers:
            event = client.next_event()
            if event is h11.NEED_DATA:
                client.receive_data(sock.recv(65536))
            elif event is h11.PAUSED:
                client.start_next_cycle()
                expect_answer()
            elif isinstance(event, h11.Response):
                status, body = event.status_code, b""
            elif isinstance(event, h11.Data):
                body += event.data
            elif isinstance(event, h11.EndOfMessage):
                out.append((status, body))
            elif isinstance(event, h11.ConnectionClosed):
                break
        sock.settimeout(0.5)
        try:
            extra = sock.recv(65536)
        except TimeoutError:
            extra = b""
    assert b"HTTP/1.1" not in extra, f"an unsolicited answer followed: {extra[:200]!r}"
    return out


def test_other_upgrades_are_ignored_and_bodies_kept(daemon: Daemon) -> None:
    wav = encode_wav(say("Hello there, this is a test of the upgrade path."), RATE)
    head = (
        "POST /v2/models/silero_vad/segments HTTP/1.1\r\nhost: x\r\nconnection: keep-alive, Upgrade\r\n"
        f"upgrade: h2c\r\ncontent-type: audio/wav\r\ncontent-length: {len(wav)}\r\n\r\n"
    )
    get = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\nconnection: Upgrade\r\nupgrade: foo/2\r\n\r\n"
    last = b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = exchange(daemon, get + head.encode() + wav + last, 3)
    assert [status for status, _ in answers] == [200, 200, 200], answers
    assert b'"start"' in answers[1][1], answers[1][1][:300]  # the body was read: the VAD found speech


def handshake(path: str, key: str | None = None, version: str = "13") -> bytes:
    lines = [f"GET {path} HTTP/1.1", "host: x", "connection: Upgrade", "upgrade: websocket"]
    if key is not None:
        lines.append(f"sec-websocket-key: {key}")
    lines.append(f"sec-websocket-version: {version}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_websocket_handshakes_refused_with_a_reason(daemon: Daemon) -> None:
    key = base64.b64encode(os.urandom(16)).decode()
    assert exchange(daemon, handshake("/v1/realtime"), 1)[0][0] == 400  # no key
    assert exchange(daemon, handshake("/v1/realtime", key, version="8"), 1)[0][0] == 400
    assert exchange(daemon, handshake("/no/such/socket", key), 1)[0][0] == 404
    assert (
        exchange(daemon, handshake("/v2/health/live", key), 1)[0][0] == 200
    )  # not a WebSocket route: answered, closed


def test_websocket_upgrade_after_pipelined_requests(daemon: Daemon) -> None:
    """The handshake is answered in its turn; with no speech model the route is a 404, then the close."""
    key = base64.b64encode(os.urandom(16)).decode()
    health = b"GET /v2/health/live HTTP/1.1\r\nhost: x\r\n\r\n"
    answers = exchange(daemon, health + handshake("/v1/realtime", key), 2)
    assert [a[0] for a in answers] == [200, 404], answers
