"""The Unix socket transport: blocking HTTP/1.1 with keep-alive, reading while it sends so an early
answer (a 413) is read, not a broken pipe."""

from __future__ import annotations

import select
import socket
import time
from collections.abc import Iterator

from appliance.client.errors import (
    ClientError,
    ConnectError,
    NoAnswer,
    unix_connect_error,
)
from appliance.client.http import Call, HttpResponse, ResponseReader, checked


class UnixTransport:
    """HTTP/1.1 on the Unix socket; one keep-alive connection, reopened if the daemon closed it.

    `busy_poll_s`: spin on the socket this long before sleeping in recv. A latency-critical
    on-box app trades a core for the wake-up of a sleeping CPU (tens of microseconds in a VM).
    `connect_timeout`: how long connecting may take; `timeout`: how long the daemon may be silent.
    Connection failures raise `ConnectError` (naming the path and what is there), silence `NoAnswer`.
    """

    def __init__(
        self, socket_path: str, timeout: float, busy_poll_s: float = 0.0, connect_timeout: float | None = None
    ) -> None:
        self.socket_path, self.timeout, self.busy_poll_s = socket_path, timeout, busy_poll_s
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._sock: socket.socket | None = None
        self._reader = ResponseReader()
        self._cut_short = False  # the daemon answered before it had the whole request

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def _connected(self) -> socket.socket:
        """A new connection. A Unix socket whose accept queue is full answers EAGAIN at once (TCP would
        wait in its SYN queue): that is tried again until connect_timeout, as the daemon drains it."""
        deadline = time.monotonic() + self.connect_timeout
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout)
            try:
                sock.connect(self.socket_path)
                return sock
            except BlockingIOError as exc:
                sock.close()
                if time.monotonic() >= deadline:
                    raise unix_connect_error(self.socket_path, exc, self.connect_timeout) from None
                time.sleep(0.01)
            except OSError as exc:
                sock.close()
                raise unix_connect_error(self.socket_path, exc, self.connect_timeout) from None

    def _connect(self) -> tuple[socket.socket, ResponseReader]:
        """The open connection, or a new one where the daemon closed the last (its keep-alive timeout
        ends an idle connection: reused, it would answer the next call with an end of file)."""
        if self._sock is not None and self._readable_while_idle(self._sock):
            self.close()
        if self._sock is None:
            sock = self._connected()
            sock.settimeout(self.timeout)
            self._sock, self._reader, self._cut_short = sock, ResponseReader(), False
        self._reader.status, self._reader.arrived = 0, []  # what is left of the previous response is not ours
        return self._sock, self._reader

    @staticmethod
    def _readable_while_idle(sock: socket.socket) -> bool:
        """Between calls the daemon sends nothing: anything to read is its close (or a stray byte that
        would be taken for the next answer), so the connection is not reused."""
        poller = select.poll()
        poller.register(sock, select.POLLIN)
        return bool(poller.poll(0))

    def stream(self, call: Call) -> Iterator[bytes]:
        """Send one call; yield its body in pieces as they arrive (an error status raises first)."""
        sock, reader = self._connect()
        try:
            self._write(sock, reader, call.encode())
            while not reader.done:
                if reader.status and reader.status < 400 and reader.arrived:
                    pieces, reader.arrived = reader.arrived, []
                    yield from pieces
                self._read(sock, reader)
        except BaseException as exc:
            self.close()
            self._raise_as_client_error(exc)
            raise
        checked(self._take(reader))
        yield from reader.arrived

    def send(self, call: Call) -> HttpResponse:
        sock, reader = self._connect()
        try:
            self._write(sock, reader, call.encode())
            if self.busy_poll_s:
                self._busy_poll(sock, reader)
            while not reader.done:
                self._read(sock, reader)
        except BaseException as exc:
            self.close()
            self._raise_as_client_error(exc)
            raise
        return self._take(reader)

    def _raise_as_client_error(self, exc: BaseException) -> None:
        """An OSError on an open connection, said as what it means for the call."""
        if isinstance(exc, ClientError) or not isinstance(exc, OSError):
            return
        if isinstance(exc, TimeoutError):
            raise NoAnswer(f"the daemon at {self.socket_path} did not answer within {self.timeout:g} s") from None
        raise ConnectError(
            f"the connection to the daemon at {self.socket_path} broke before it answered ({exc.strerror or exc})"
        ) from None

    def _write(self, sock: socket.socket, reader: ResponseReader, data: bytes) -> None:
        """Send the request, reading while it goes out: the daemon may answer before it has the whole
        body (413 for one over its limit) and stop reading or close; that answer is the call's answer,
        not a broken pipe."""
        try:
            view = memoryview(data)[sock.send(data) :]
            if not view:
                return
            poller = select.poll()  # not select(): that fails for descriptors past 1023
            poller.register(sock, select.POLLIN | select.POLLOUT)
            deadline = time.monotonic() + self.timeout
            while view:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError
                for _, events in poller.poll(remaining * 1000):
                    if events & (select.POLLIN | select.POLLHUP | select.POLLERR):
                        self._read(sock, reader)
                        if reader.done:
                            self._cut_short = True
                            return
                    elif events & select.POLLOUT:
                        view = view[sock.send(view) :]
                        deadline = time.monotonic() + self.timeout
        except (BrokenPipeError, ConnectionResetError):
            self._cut_short = True  # the daemon stopped reading; its answer, if it sent one, is read next

    def _read(self, sock: socket.socket, reader: ResponseReader) -> None:
        data = sock.recv(1 << 20)
        if not data:
            what = "before it answered" if not reader.status else "in the middle of its answer"
            raise ConnectError(f"the daemon at {self.socket_path} closed the connection {what}")
        reader.feed(data)

    def _take(self, reader: ResponseReader) -> HttpResponse:
        """The completed response; the connection closes if the daemon said so, or answered early."""
        response = reader.done.pop(0)
        if response.headers.get("connection") == "close" or self._cut_short:
            self.close()
        return response

    def _busy_poll(self, sock: socket.socket, reader: ResponseReader) -> None:
        deadline = time.perf_counter() + self.busy_poll_s
        sock.setblocking(False)
        try:
            while not reader.done and time.perf_counter() < deadline:
                try:
                    self._read(sock, reader)
                except BlockingIOError:
                    continue
        finally:
            sock.settimeout(self.timeout)
