"""A TCP port on 127.0.0.1 that pipes each connection, byte for byte, to the daemon's Unix socket:
NVIDIA's tritonclient speaks HTTP over TCP only, and the daemon serves HTTP/1.1 on a Unix socket.
Nothing is parsed or changed on the way, so what tritonclient gets is what the daemon sent."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from pathlib import Path


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := source.recv(1 << 16):
            sink.sendall(data)
    with contextlib.suppress(OSError):
        sink.shutdown(socket.SHUT_WR)  # the half-close travels too


def _serve(listener: socket.socket, unix_path: str) -> None:
    while True:
        try:
            tcp, _ = listener.accept()
        except OSError:  # closed: the test is over
            return
        threading.Thread(target=_connection, args=(tcp, unix_path), daemon=True).start()


def _connection(tcp: socket.socket, unix_path: str) -> None:
    with tcp, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as unix:
        unix.connect(unix_path)
        back = threading.Thread(target=_pipe, args=(unix, tcp), daemon=True)
        back.start()
        _pipe(tcp, unix)
        back.join()


@contextlib.contextmanager
def tcp_to_unix(unix_path: Path) -> Iterator[str]:
    """`host:port` for tritonclient's `url`, while the block runs."""
    listener = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_serve, args=(listener, str(unix_path)), daemon=True).start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        listener.close()
