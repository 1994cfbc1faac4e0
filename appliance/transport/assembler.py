"""One request, assembled from what a transport received, without I/O: headers and body pieces in,
what arrived (its head and its body's pieces) or a Rejection with its status out. HTTP/1.1 and
HTTP/3 both feed it, so the size and time limits (and what their errors say) are decided here and
nowhere else, and each limit that bites is logged (at most one line per limit every LOG_EVERY_S)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from appliance.config import ServerConfig
from appliance.errors import ApiError
from appliance.protocol.encoding import IDENTITY, BodyDecoder, DecodedTooLarge
from appliance.protocol.limits import LIMITS_BITTEN
from appliance.protocol.messages import Request, error_response
from appliance.transport.budget_ledger import BudgetLedger


@dataclass(slots=True)
class Arrived:
    """A request as it arrived: `head` is the Request but its body (what a transport decides by:
    method, target, headers), `pieces` the body as received (emptied once joined: the body is then
    held once), `size` bytes of them held in the budget until its answer is made."""

    head: Request
    pieces: list[bytes]
    size: int = 0


class Rejection(Exception):
    """The request cannot be served; `response` says why. The transport answers and forgets it."""

    def __init__(self, status: int, message: str, target: str = "") -> None:
        super().__init__(message)
        self.response = error_response(status, message, target)


def limit_bit(status: int, message: str, target: str = "") -> Rejection:
    """A rejection because a limit bit (logged, rate-limited), not because the request was malformed; a
    503 (busy) says when to retry, as the queues' refusals do."""
    LIMITS_BITTEN.bit(status, message)
    rejection = Rejection(status, message, target)
    if status == 503:
        rejection.response.headers.append(("Retry-After", "1"))
    return rejection


class BodyBudget:
    """Bytes held for clients (request bodies, Realtime's and Wyoming's buffers), bounded as a whole:
    many slow or stalled uploads cannot together take the box's memory. With protocol workers each
    process publishes what it holds in the daemon's `ledger` (budget_ledger.py) and refuses by what all
    of them hold, so that max_buffered_bytes bounds the daemon, not each process. `workers` divides
    each listener's connection limits among the workers."""

    def __init__(
        self, limits: Callable[[], ServerConfig], workers: int = 1, ledger: BudgetLedger | None = None
    ) -> None:
        self._limits, self.workers, self.ledger, self.held = limits, workers, ledger, 0

    @property
    def limits(self) -> ServerConfig:
        return self._limits()

    def take(self, count: int, what: str = "request bodies") -> None:
        if why := self.take_if_fits(count, what):
            raise limit_bit(503, f"{why} (server.max_buffered_bytes); retry later")

    def take_if_fits(self, count: int, what: str) -> str:
        if why := self.refuses(count, what):
            return why
        self._hold(self.held + count)
        return ""

    def refuses(self, count: int, what: str) -> str:
        """Why `count` more bytes of `what` do not fit ("" where they do)."""
        limit = self.limits.max_buffered_bytes
        if self.held_by_daemon + count <= limit:
            return ""
        return f"busy: {what} held by all clients are at the limit of {limit} bytes"

    def give(self, count: int) -> None:
        self._hold(self.held - count)

    @property
    def held_by_daemon(self) -> int:
        return self.ledger.total() if self.ledger is not None else self.held

    def _hold(self, held: int) -> None:
        self.held = held
        if self.ledger is not None:
            self.ledger.publish(held)


class RequestAssembler:
    def __init__(
        self,
        limits: ServerConfig,
        peer: str = "",
        budget: BodyBudget | None = None,
        client: str = "",
        operator: bool = False,
        clock: Callable[[], float] = time.monotonic,
        listener: str = "unix",
    ) -> None:
        """`clock` times the head's and the body's timeouts (the transport's, which a test may hold)."""
        self.limits = limits  # the live ones at the request's start: a reload applies from the next request
        self.clock = clock
        self.peer, self.client, self.operator, self.listener = peer, client, operator, listener  # see Request
        self.budget = budget  # body bytes are taken from it as they arrive; the transport gives them back
        self.method = self.target = ""
        self.head_complete = False
        self._headers: dict[str, str] = {}
        self._header_bytes = self._raw_head_bytes = 0
        self._body: list[bytes] = []
        self.body_bytes = 0  # held: decoded where the body has a content coding
        self.wire_bytes = 0  # received
        self._decoder: BodyDecoder | None = None
        self.started = self.last_heard = clock()

    def add_target(self, piece: bytes) -> None:
        self.target += piece.decode("latin-1")
        self._count_header_bytes(len(piece))

    def add_header(self, name: bytes, value: bytes) -> None:
        self._count_header_bytes(len(name) + len(value))
        self._headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def headers_complete(self, method: str) -> None:
        """The head is whole: check what it announces before any body is read."""
        self.method, self.head_complete = method, True
        if not self.method or not self.target.startswith("/"):
            raise Rejection(400, "request needs a method and a path starting with /")
        # ASCII digits only ('²'.isdigit() is true); more than 18 of them is over any limit, and int() is spared
        length = self._headers.get("content-length", "")
        if length.isascii() and length.isdigit() and (len(length) > 18 or int(length) > self.limits.max_body_bytes):
            shown = length if len(length) <= 18 else f"{length[:18]}... ({len(length)} digits)"
            raise limit_bit(
                413, f"body of {shown} bytes exceeds the limit of {self.limits.max_body_bytes} bytes", self.target
            )
        coding = self._headers.get("content-encoding", "")
        if coding.strip().lower() not in IDENTITY:
            try:
                self._decoder = BodyDecoder(coding)
            except ApiError as exc:
                raise Rejection(exc.status, exc.message) from None
            del self._headers["content-encoding"]  # what the API gets is the decoded body

    def add_body(self, piece: bytes) -> None:
        """Both what arrives and what it decodes to are bounded by max_body_bytes, and the decoded
        bytes are what is held (and taken from the budget): a compressed body is undone as it arrives."""
        self.last_heard = self.clock()
        self.wire_bytes += len(piece)
        if self.wire_bytes > self.limits.max_body_bytes:
            raise limit_bit(413, f"body exceeds the limit of {self.limits.max_body_bytes} bytes", self.target)
        if self._decoder is None:
            self._hold(piece)
            return
        try:
            pieces = self._decoder.feed(piece, self.limits.max_body_bytes - self.body_bytes)
        except DecodedTooLarge:
            raise limit_bit(
                413, f"body decompressed exceeds the limit of {self.limits.max_body_bytes} bytes", self.target
            ) from None
        except ApiError as exc:
            raise Rejection(exc.status, exc.message) from None
        for decoded in pieces:
            self._hold(decoded)

    def _hold(self, piece: bytes) -> None:
        if self.budget is not None:
            self.budget.take(len(piece))
        self.body_bytes += len(piece)
        self._body.append(piece)

    def arrived(self) -> Arrived:
        """The request, whole; its body is joined where it is answered (answering.answer)."""
        if self._decoder is not None:
            try:
                self._decoder.finish()
            except ApiError as exc:
                raise Rejection(exc.status, exc.message) from None
        head = Request(
            self.method, self.target, self._headers, b"", self.peer, self.client, self.operator, self.listener
        )
        return Arrived(head, self._body, self.body_bytes)

    def quiet_since(self, moment: float) -> bool:
        return self.last_heard < moment

    def reading_resumed(self) -> None:
        """The server stopped reading this connection (its pipeline was full) and reads it again: the
        time it did not read is not the client's, so the head's and the body's clocks start again."""
        self.started = self.last_heard = self.clock()

    def overdue(self, now: float) -> Rejection | None:
        """A head not complete within header_timeout_s, or a body that went quiet for body_timeout_s."""
        if not self.head_complete and now - self.started > self.limits.header_timeout_s:
            return limit_bit(408, f"request head not complete within {self.limits.header_timeout_s:g} s")
        if self.head_complete and now - self.last_heard > self.limits.body_timeout_s:
            return limit_bit(408, f"request body stalled for {self.limits.body_timeout_s:g} s")
        return None

    def received_in_head(self, count: int) -> None:
        """Raw bytes read while this head was incomplete: the parser buffers a partial line before any
        callback sees it, so the head's limit holds for them too, and a huge line is refused as it arrives."""
        self._raw_head_bytes += count
        if self._raw_head_bytes > self.limits.max_header_bytes:
            raise self._head_too_large()

    def _count_header_bytes(self, count: int) -> None:
        self._header_bytes += count
        if self._header_bytes > self.limits.max_header_bytes:
            raise self._head_too_large()

    def _head_too_large(self) -> Rejection:
        return limit_bit(431, f"request line and headers exceed {self.limits.max_header_bytes} bytes")
