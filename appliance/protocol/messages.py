"""A request as the API core receives it and the response it gives, whatever the transport."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from appliance.protocol import json_text

Message = str | bytes  # one WebSocket message: text or binary


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
    listener: str = "unix"  # which one it came by: "unix" (local users), "https" or "quic" (the LAN)
    # the API key ("key:NAME") or room the access gate admitted it for; "" where none was needed
    principal: str = ""

    @property
    def address(self) -> str:
        """Where the client is: the LAN host (the peer without its port); on the Unix socket, the
        client itself (its user)."""
        return self.peer.rpartition(":")[0] or self.client


@dataclass(slots=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: list[tuple[str, str]] = field(default_factory=list)
    stream: AsyncGenerator[bytes, None] | None = None  # set: the body is sent piece by piece as produced, `body` unused
    # the stateful sequence this request opened: a transport whose client vanishes ends it (api.end_opened)
    opened: Opened | None = None
    # set (with status 101): the request was a WebSocket upgrade and this runs its messages (see Session)
    session: Session | None = None


@dataclass(frozen=True, slots=True)
class Close:
    """How a session ends: a WebSocket close code (RFC 6455 7.4) and a reason of at most 123 bytes."""

    code: int = 1000
    reason: str = ""


class SessionIO(Protocol):
    """A session's side of a WebSocket. `receive` waits for the client's next message; `send`
    returns once the message is accepted within the connection's buffer bound (a client that stops
    reading stops the session's sender). A client that goes away cancels the session's task."""

    async def receive(self) -> Message: ...

    async def send(self, message: Message) -> None: ...


# A WebSocket's application: runs until it returns how to close, or is cancelled when the client leaves.
Session = Callable[[SessionIO], Awaitable[Close]]


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
    return Response(status, json_text.dumps(doc).encode())  # long lists a slice at a time (an hour's words)


def error_response(status: int, message: str, target: str = "") -> Response:
    """The error document: OpenAI's shape under /v1/ (its clients show only its `message`), else KServe's."""
    if target.startswith("/v1/"):
        return json_response(status, openai_error(status, message))
    return json_response(status, {"error": message})


OPENAI_CODES = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large", 429: "rate_limit_exceeded"}


def openai_error(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """{"error": {message, type, param, code}}, as OpenAI's API answers."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    if status == 429:
        kind = "rate_limit_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code or OPENAI_CODES.get(status)}}


def json_line(doc: Any) -> bytes:
    """One line of NDJSON, for bodies streamed as they are produced."""
    return json.dumps(doc, separators=(",", ":")).encode() + b"\n"
