"""HTTP/3 over QUIC for LAN clients (aioquic): the same Api.handle as the Unix socket.

aioquic's QuicConnection and H3Connection are sans-I/O; this module only pumps their events
into Requests and the API's Responses back into frames. Per RFC 8470, a request that arrives
as 0-RTT early data is served at once only if it is safe to replay (GET, HEAD); any other
waits until the handshake completes (with mutual TLS, every request waits for the client's
certificate to be verified).

Flow control and cancellation as protocol/flow.py says: a streamed answer's next piece is pulled only
once the stream's send buffer (what the peer has not acknowledged, held by aioquic) is within
server.stream_window_bytes, as HTTP/1.1 waits for its socket; a stream reset or STOP_SENDING by the
client, or its connection's end, cancels the request being served on it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from functools import partial
from typing import TYPE_CHECKING, Any

from aioquic.asyncio import QuicConnectionProtocol
from aioquic.h3.connection import H3_ALPN, ErrorCode
from aioquic.h3.events import DataReceived, H3Event, HeadersReceived
from aioquic.quic.events import (
    ConnectionTerminated,
    HandshakeCompleted,
    ProtocolNegotiated,
    QuicEvent,
    StopSendingReceived,
    StreamReset,
)
from aioquic.quic.packet import QuicErrorCode, QuicFrameType
from cryptography.hazmat.primitives import hashes

from appliance.protocol.flow import SendWindow, send_stream
from appliance.tasks import spawn
from appliance.transport.answering import answer
from appliance.transport.assembler import LIMITS_BITTEN, Arrived, Rejection, RequestAssembler, limit_bit
from appliance.transport.conncache import peer_name
from appliance.transport.h3_answers import StreamAnswers
from appliance.transport.h3_bounds import BoundedH3Connection, HeadersRefused
from appliance.transport.h3_websocket import WebSocketStreams, is_websocket_connect
from appliance.transport.steering_ids import tag_connection_ids

if TYPE_CHECKING:
    from appliance.transport.h3_server import H3Server

log = logging.getLogger("appliance.h3")

SAFE_TO_REPLAY = frozenset({"GET", "HEAD"})
# a refusal is a transport close (a frame type given) with CONNECTION_REFUSED: aioquic turns an application
# close during the handshake into APPLICATION_ERROR and drops its reason, so the client would not learn why
REFUSED, PADDING = QuicErrorCode.CONNECTION_REFUSED, QuicFrameType.PADDING


class H3Protocol(QuicConnectionProtocol):
    server: H3Server

    def __init__(self, *args: object, server: H3Server, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.server = server
        if server.worker_key is not None:
            tag_connection_ids(self._quic, server.worker_key)
        self._http: BoundedH3Connection | None = None
        self._incoming: dict[int, RequestAssembler | None] = {}  # None: rejected, the rest is ignored
        self.handshake_done = False
        self.operator = False  # its certificate is one the operator CA signed (known once the handshake is done)
        self.created = server.clock()
        self._waiting_for_handshake: list[tuple[int, Arrived]] = []
        self.in_flight = 0
        self._serving: dict[int, asyncio.Task[None]] = {}  # request streams being answered
        self._started: set[int] = set()  # of those, the ones whose task began (see _served)
        self.peer, self._addr = "", None
        self._terminated = False
        self.answers = StreamAnswers(
            self._quic, lambda: self._http, self.transmit, lambda: self._terminated, self.created
        )
        self.websockets = WebSocketStreams(
            server, self.answers, lambda: self._http, self._reset_stream, self.transmit, lambda: self._terminated
        )
        if server.client_certificates is not None:
            server.client_certificates.require(self._quic)
        if len(server.connections) >= server.config.max_connections:
            self._quic.close(REFUSED, PADDING, f"too many connections (limit {server.config.max_connections})")
        else:
            server.connections.add(self)

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        first = not self.peer
        if first:
            self.peer, self._addr = peer_name(addr), addr
        super().datagram_received(data, addr)
        if first and self._quic._retry_source_connection_id is not None and self.server.cache is not None:
            self.server.cache.validate(addr)  # it passed Retry: its address is proven already
        host, quic = self.peer.rpartition(":")[0], self.server.live.config.quic
        if first and self.server.handshaking_from(host) > quic.max_handshakes_per_source:  # this one counts too
            self._refuse(
                "handshakes", f"more than {quic.max_handshakes_per_source} QUIC handshakes in progress from {host}"
            )
        elif first and self.server.connections_from(host) > quic.max_connections_per_address:
            self._refuse("connections", f"more than {quic.max_connections_per_address} QUIC connections from {host}")

    def _refuse(self, limit: str, reason: str) -> None:
        """This connection would exceed its address's share: CONNECTION_REFUSED, logged (rate-limited)."""
        LIMITS_BITTEN.bit(limit, reason)
        self._quic.close(REFUSED, PADDING, reason)
        self.transmit()
        self.server.connections.discard(self)

    def close_quietly(self, reason: str) -> None:
        """Close a connection whose peer went silent: no one is listening for the reply."""
        self._quic.close(error_code=0x0, reason_phrase=reason)
        self.transmit()
        self.server.connections.discard(self)

    def cut_off(self, timeout_s: float) -> None:
        """The write deadline passed (h3_server.py): closed, and the work for it ended at once."""
        LIMITS_BITTEN.bit("write timeout", f"a QUIC client took nothing for {timeout_s:g} s: connection closed")
        self._quic.close(ErrorCode.H3_NO_ERROR, reason_phrase=f"took nothing for {timeout_s:g} s")
        self.transmit()
        self._ended()

    def _ended(self) -> None:
        """The connection is over: what it asked for is cancelled, what it held given back."""
        self._terminated = True
        for serving in self._serving.values():
            serving.cancel()
        self.websockets.gone(None)
        self.server.connections.discard(self)
        held = sum(a.body_bytes for a in self._incoming.values() if a is not None)
        self.server.budget.give(held + sum(arrived.size for _, arrived in self._waiting_for_handshake))
        self._incoming.clear()
        self._waiting_for_handshake.clear()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, ProtocolNegotiated) and event.alpn_protocol in H3_ALPN:
            self._http = BoundedH3Connection(self._quic, self.server.limits.max_header_bytes)
        elif isinstance(event, HandshakeCompleted):
            self.handshake_done = True
            if self.server.cache is not None and self._addr is not None:
                self.server.cache.validate(self._addr)  # its address proven: into the long-lived table
            if (certificates := self.server.client_certificates) is not None:
                context = self._quic.tls
                self.operator = certificates.is_operator(context._peer_certificate, context._peer_certificate_chain)
            waiting, self._waiting_for_handshake = self._waiting_for_handshake, []
            for stream_id, arrived in waiting:
                self._dispatch(stream_id, arrived)
        elif isinstance(event, (StreamReset, StopSendingReceived)):
            if (serving := self._serving.get(event.stream_id)) is not None:
                serving.cancel()  # the client gave up on this request: stop working for it
            self.websockets.gone(event.stream_id)
        elif isinstance(event, ConnectionTerminated):
            self._ended()
        if self._http is None:
            return
        # A peer that breaks HTTP/3 is handled inside aioquic: handle_event closes its connection with
        # the protocol error's code and returns no events; nobody else's connection is touched.
        for h3_event in self._http.handle_event(event):
            self._h3_event_received(h3_event)

    def _h3_event_received(self, event: H3Event) -> None:
        if isinstance(event, HeadersRefused):
            if (dropped := self._incoming.pop(event.stream_id, None)) is not None:  # trailers over the limit
                self.server.budget.give(dropped.body_bytes)
            self.answers.respond(event.stream_id, limit_bit(431, event.reason).response)
            return
        if not isinstance(event, (HeadersReceived, DataReceived)):
            return
        stream_id = event.stream_id
        if isinstance(event, DataReceived) and self.websockets.data(event):
            return
        if isinstance(event, DataReceived) and stream_id not in self._incoming:
            return
        try:
            if isinstance(event, HeadersReceived):
                if stream_id not in self._incoming:
                    self._incoming[stream_id] = self._start(event)
                    if is_websocket_connect(event.headers):  # its request is whole: what follows is the WebSocket's
                        self.websockets.register(stream_id)
                        self._complete(stream_id)
                        return
            elif (assembler := self._incoming[stream_id]) is not None:
                assembler.add_body(event.data)
        except Rejection as rejection:
            if (dropped := self._incoming.get(stream_id)) is not None:
                self.server.budget.give(dropped.body_bytes)
            self._incoming[stream_id] = None
            self.answers.respond(stream_id, rejection.response)
        if event.stream_ended:
            self._complete(stream_id)

    def _start(self, event: HeadersReceived) -> RequestAssembler:
        if (
            len(self._incoming) + self.in_flight + len(self.websockets.streams)
            >= self.server.config.max_streams_per_connection
        ):
            raise limit_bit(
                429, f"too many open streams on this connection (limit {self.server.config.max_streams_per_connection})"
            )
        server = self.server
        assembler = RequestAssembler(
            server.limits, peer=self.peer, budget=server.budget, clock=server.clock, listener="quic"
        )
        method = ""
        for name, value in event.headers:
            if name == b":method":
                method = value.decode("latin-1")
            elif name == b":path":
                assembler.add_target(value)
            elif name == b":protocol":  # RFC 9220's extended CONNECT is the API's GET with Upgrade
                assembler.add_header(b"upgrade", value)
                method = "GET"
            elif name != b":scheme":  # :authority is HTTP/1.1's Host (RFC 9114 4.3.1): a browser's Origin meets it
                assembler.add_header(b"host" if name == b":authority" else name, value)
        assembler.headers_complete(method)
        return assembler

    def reap_quiet_streams(self, now: float, heard_before: float) -> None:
        """Answer 408 on request streams that went quiet, and forget what they sent; a WebSocket's own
        timeouts (pings, idle) are checked here too."""
        self.websockets.check_timeouts(now)
        for stream_id, assembler in list(self._incoming.items()):
            if assembler is None:  # rejected and answered: nothing more is read from it
                del self._incoming[stream_id]
            elif assembler.quiet_since(heard_before):
                del self._incoming[stream_id]
                self.server.budget.give(assembler.body_bytes)
                self.answers.respond(stream_id, limit_bit(408, "request stream went quiet before its end").response)

    def _complete(self, stream_id: int) -> None:
        assembler = self._incoming.pop(stream_id)
        if assembler is None:
            return
        try:
            arrived = assembler.arrived()
        except Rejection as rejection:  # a compressed body that ends before its end
            self.server.budget.give(assembler.body_bytes)
            self.answers.respond(stream_id, rejection.response)
            return
        method = arrived.head.method
        if not self.handshake_done and (method not in SAFE_TO_REPLAY or self.server.client_certificates):
            self._waiting_for_handshake.append((stream_id, arrived))  # RFC 8470: no replayable side effects
        else:
            self._dispatch(stream_id, arrived)

    def _dispatch(self, stream_id: int, arrived: Arrived) -> None:
        self.in_flight += 1
        head = dataclasses.replace(arrived.head, client=self._client(), operator=self.operator)
        arrived = dataclasses.replace(arrived, head=head)
        task = self._serving[stream_id] = spawn(
            self._serve(stream_id, arrived), f"HTTP/3 stream {stream_id} of {self.peer}"
        )
        task.add_done_callback(lambda _: self._served(stream_id, arrived.size))

    def _served(self, stream_id: int, size: int) -> None:
        """A stream's task is done. One cancelled before it began (the connection ended in the same
        events as the request) ran none of its own cleanup: its body's `size` is given back here."""
        self._serving.pop(stream_id, None)
        self.in_flight -= 1
        if stream_id not in self._started:
            self.server.budget.give(size)
        self._started.discard(stream_id)

    def _client(self) -> str:
        """Who this connection is (Request.client): its verified certificate where mutual TLS is on (client_ca;
        an operator's alone names no one), else the connection. Taken at dispatch: after the handshake."""
        certificates = self.server.client_certificates
        certificate = self._quic.tls._peer_certificate if certificates and certificates.clients else None
        if certificate is not None:
            return f"cert:{certificate.fingerprint(hashes.SHA256()).hex()[:32]}"
        return f"quic:{self._quic.original_destination_connection_id.hex()}"

    async def _serve(self, stream_id: int, arrived: Arrived) -> None:
        self._started.add(stream_id)
        try:
            response = await answer(self.server, arrived, partial(self.server.opened, self.peer))
            if self.websockets.answer(stream_id, response):
                return
            head_only = arrived.head.method == "HEAD"
            if self.answers.respond(stream_id, response, head_only) and response.stream is not None:
                window = self.answers.windows[stream_id] = SendWindow(self.server.limits.stream_window_bytes)

                async def send(piece: bytes) -> int | None:  # held: what the peer has not acknowledged
                    sent = not self._terminated and self.answers.send_data(stream_id, piece, end_stream=False)
                    return self.answers.unacknowledged(stream_id) if sent else None

                if await send_stream(response.stream, window, send):
                    self.answers.send_data(stream_id, b"", end_stream=True)
        finally:
            if (held := self.answers.windows.pop(stream_id, None)) is not None:
                held.close()

    def transmit(self) -> None:
        """Send what is due; the answers and WebSockets that wait for their peer learn what it took."""
        super().transmit()
        self.answers.transmitted()
        self.websockets.transmitted()

    def _reset_stream(self, stream_id: int) -> None:
        """RESET_STREAM and STOP_SENDING: aioquic sends nothing more of what it holds, the peer nothing more."""
        if self._quic._streams.get(stream_id) is not None:
            self._quic.reset_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
            self._quic.stop_stream(stream_id, ErrorCode.H3_REQUEST_CANCELLED)
        self.transmit()
