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

from appliance.client import Call, Client


def test_a_full_accept_queue_is_waited_out(tmp_path: Path) -> None:
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

    def call() -> None:
        try:
            with Client(path, timeout=60) as client:
                outcome.append(client.send(Call("GET", "/v2/health/ready")).json())
        except Exception as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    caller = threading.Thread(target=call)
    caller.start()
    time.sleep(0.3)  # the client meets the full queue (before: it failed here at once)
    assert not outcome, outcome
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
