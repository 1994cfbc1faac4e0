"""One request, assembled from what a transport received, without I/O: headers and body pieces in,
a Request or a Rejection with its status out. HTTP/1.1 and HTTP/3 both feed it, so the size limits
(and what their errors say) are decided here and nowhere else."""

from __future__ import annotations

import time

from appliance.config import ServerConfig
from appliance.protocol.messages import Request, error_response


class Rejection(Exception):
    """The request cannot be served; `response` says why. The transport answers and forgets it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.response = error_response(status, message)


class RequestAssembler:
    def __init__(self, limits: ServerConfig, peer: str = "") -> None:
        self.limits = limits  # the live ones at the request's start: a reload applies from the next request
        self.peer = peer  # the LAN client's address (QUIC); empty on the Unix socket
        self.method = self.target = ""
        self._headers: dict[str, str] = {}
        self._header_bytes = 0
        self._body: list[bytes] = []
        self._body_bytes = 0
        self.last_heard = time.monotonic()

    def add_target(self, piece: bytes) -> None:
        self.target += piece.decode("latin-1")
        self._count_header_bytes(len(piece))

    def add_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def headers_complete(self, method: str) -> None:
        """The head is whole: check what it announces before any body is read."""
        self.method = method
        if not self.method or not self.target.startswith("/"):
            raise Rejection(400, "request needs a method and a path starting with /")
        length = self._headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_bytes:
            raise Rejection(413, f"body of {length} bytes exceeds the limit of {self.limits.max_body_bytes} bytes")

    def add_body(self, piece: bytes) -> None:
        self.last_heard = time.monotonic()
        self._body_bytes += len(piece)
        if self._body_bytes > self.limits.max_body_bytes:
            raise Rejection(413, f"body exceeds the limit of {self.limits.max_body_bytes} bytes")
        self._body.append(piece)

    def request(self) -> Request:
        return Request(self.method, self.target, self._headers, b"".join(self._body), self.peer)

    def quiet_since(self, moment: float) -> bool:
        return self.last_heard < moment

    def _count_header_bytes(self, count: int) -> None:
        self._header_bytes += count
        if self._header_bytes > self.limits.max_header_bytes:
            raise Rejection(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes")
