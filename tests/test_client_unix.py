"""The project's client on a Unix socket whose accept queue is full: the kernel answers EAGAIN at once
(TCP would hold the connection in its SYN queue), and the client waits it out, up to its connect
timeout, instead of reporting an overloaded daemon on the spot. 200 uploads at once met this in a full
suite on a loaded machine (test_long_running.py)."""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from appliance.client import Call, Client


def test_a_full_accept_queue_is_waited_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(tmp_path / "api.sock")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(0)
    queued = []
    while True:  # fill the accept queue: the next connect is refused with EAGAIN
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            sock.connect(path)
        except BlockingIOError:
            sock.close()
            break
        queued.append(sock)
    outcome: list[object] = []
    refused: list[int] = []  # the client's connects that met the full queue (EAGAIN)
    connect = socket.socket.connect

    def counted(sock: socket.socket, address: object) -> None:
        try:
            connect(sock, address)
        except BlockingIOError:
            refused.append(1)
            raise

    monkeypatch.setattr(socket.socket, "connect", counted)

    def call() -> None:
        try:
            with Client(path, timeout=60) as client:
                outcome.append(client.send(Call("GET", "/v2/health/ready")).json())
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    while len(refused) < 2:  # the client met the full queue, and tried again
        assert not outcome, outcome  # (before: it failed at the first)
        time.sleep(0.01)
    for _ in queued:  # the daemon drains its queue: the client's connection is accepted next
        server.accept()[0].close()
    connection, _ = server.accept()
    connection.recv(65536)
    body = json.dumps({"ready": True}).encode()
    connection.sendall(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    )
    caller.join(30)
    assert outcome == [{"ready": True}], outcome
    for sock in (*queued, connection, server):
        sock.close()
