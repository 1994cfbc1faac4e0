"""A request as the API core receives it and the response it gives, whatever the transport."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, slots=True)
class Opened:
    """A stateful sequence a request opened; `serial` tells it apart from a later one under the same id."""

    model: str
    id: object
    serial: int


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names
    body: bytes = b""
    peer: str = ""  # the LAN client's address and port (QUIC); empty on the Unix socket
    # who is asking, as the transport knows it: "uid:N" (Unix socket peer credentials), "cert:FINGERPRINT"
    # (QUIC with mutual TLS) or "quic:CONNECTION" (QUIC without); a stateful sequence is its opener's alone
    client: str = ""
    # the transport vouches for an operator (/status, /metrics): on the Unix socket a peer of the socket's
    # group (or its owner, or root); over the network a client whose certificate the operator CA signed
    operator: bool = False


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: AsyncGenerator[bytes, None] | None = None  # set: the body is sent piece by piece as produced, `body` unused
    # the stateful sequence this request opened: a transport whose client vanishes ends it (api.end_opened)
    opened: Opened | None = None


class Handler(Protocol):
    """What a transport calls: the API core itself (api/core.py Api), or a worker process's proxy of
    the engine process's API (front/channel.py RemoteApi)."""

    async def handle(self, request: Request) -> Response: ...

    def keep_connections(self) -> bool:
        """While draining, keep a connection open only while some sequence may still stream on it."""
        ...

    def end_opened(self, opened: Iterable[Opened]) -> None:
        """End these sequences, where still the same: the client that opened them vanished."""
        ...

    async def still_open(self, opened: list[Opened]) -> list[bool]:
        """Which of these sequences are still open (not ended by sequence_end or idle expiry)."""
        ...


def json_response(status: int, doc: Any) -> Response:
    return Response(status, json.dumps(doc, separators=(",", ":")).encode())


def error_response(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


def json_line(doc: Any) -> bytes:
    """One line of NDJSON, for bodies streamed as they are produced."""
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"
