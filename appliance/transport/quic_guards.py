"""What the QUIC listener adds to aioquic's server: single-use session tickets for 0-RTT, a budget
on Version Negotiation replies (no reflector), and the client-certificate check of mutual TLS."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from aioquic import tls
from aioquic.asyncio.server import QuicServer
from aioquic.quic.connection import QuicConnection
from aioquic.quic.retry import QuicRetryTokenHandler
from cryptography import x509
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError

from appliance.protocol.peers import TokenBucket
from appliance.transport.conncache import HOST_CID_LENGTH

log = logging.getLogger("appliance.h3")


class Tickets(Protocol):
    """Where session tickets are kept: this process's TicketStore, or a worker's view of the engine's."""

    def add(self, ticket: tls.SessionTicket) -> None: ...

    def pop(self, label: bytes) -> tls.SessionTicket | None: ...


class TicketStore:
    """Session tickets for 0-RTT resumption, in memory, each usable once (replay protection)."""

    def __init__(self, capacity: int = 4096) -> None:
        self.capacity = capacity
        self._tickets: dict[bytes, tls.SessionTicket] = {}

    def add(self, ticket: tls.SessionTicket) -> None:
        if len(self._tickets) >= self.capacity:
            self._tickets.pop(next(iter(self._tickets)))
        self._tickets[ticket.ticket] = ticket

    def pop(self, label: bytes) -> tls.SessionTicket | None:
        return self._tickets.pop(label, None)


class GuardedQuicServer(QuicServer):
    """aioquic's server with a budget on Version Negotiation replies, and Retry under pressure.

    Any datagram with a long header and an unknown version earns a reply, so spoofed floods
    turn the box into a reflector (reported upstream). Real clients with another version are
    rare; a small global budget serves them and starves the reflection.

    Retry (the client proves its address before the server keeps any state for it) costs a round
    trip, so it is on always only where configured; otherwise `under_pressure` switches it on while
    many handshakes are in progress, as nginx and quiche do, and off again below half of that.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # the connection cache's: counts each datagram, False when over the peer's budget
        self.admit: Callable[[bytes, Any], bool] = lambda data, addr: True
        self.handshaking: Callable[[], int] = lambda: 0
        self.retry_when_handshaking = 0
        self.version_negotiation = TokenBucket(rate=20.0, burst=40.0)
        self.supported = {v.to_bytes(4, "big") for v in self._configuration.supported_versions}
        self._always_retry = self._retry is not None
        self._retry_handler = self._retry or QuicRetryTokenHandler()  # one key: tokens stay valid across switches
        # datagrams received, and those with a short header whose connection is not here: with workers,
        # the steering program sends a connection's packets to its own worker, so these stay at zero
        self.datagrams = self.stray_datagrams = 0
        self.accepting = True  # False from the stop on: no new connections

    def datagram_received(self, data: bytes | str, addr: Any) -> None:
        self.datagrams += 1
        if data and not data[0] & 0x80 and data[1 : 1 + HOST_CID_LENGTH] not in self._protocols:  # type: ignore[operator]
            self.stray_datagrams += 1
        if not self.admit(data, addr):  # type: ignore[arg-type]
            return
        if not self.accepting and isinstance(data, bytes) and self._opens_a_connection(data):
            return
        if not self._always_retry and self.retry_when_handshaking:
            self._switch_retry(self.handshaking())
        if (
            isinstance(data, bytes)
            and len(data) >= 5
            and data[0] & 0x80
            and data[1:5] not in self.supported
            and data[1:5] != b"\0\0\0\0"
            and not self.version_negotiation.take()
        ):
            return
        super().datagram_received(data, addr)

    def _opens_a_connection(self, data: bytes) -> bool:
        """A long header (RFC 9000, 17.2) whose destination connection ID no connection here has."""
        return len(data) >= 6 and bool(data[0] & 0x80) and data[6 : 6 + data[5]] not in self._protocols

    def _switch_retry(self, handshaking: int) -> None:
        if self._retry is None and handshaking >= self.retry_when_handshaking:
            self._retry = self._retry_handler
            log.warning("quic: %d handshakes in progress: Retry on (clients prove their address first)", handshaking)
        elif self._retry is not None and handshaking < self.retry_when_handshaking // 2:
            self._retry = None  # type: ignore[assignment]  # aioquic sets None itself when retry is off
            log.info("quic: %d handshakes in progress: Retry off", handshaking)


class CertificateAuthority:
    """The client certificates one CA file vouches for."""

    def __init__(self, ca_file: Path) -> None:
        try:
            cas = x509.load_pem_x509_certificates(ca_file.read_bytes())
        except (OSError, ValueError) as exc:
            raise ValueError(f"client CA file {ca_file}: {exc}") from None
        self._verifier = PolicyBuilder().store(Store(cas)).build_client_verifier()

    def signed(self, leaf: Any, chain: list[Any]) -> bool:
        try:
            self._verifier.verify(leaf, chain)
        except VerificationError:
            return False
        return True


class ClientCertificates:
    """Client certificates, asked for in the handshake: with `clients` (quic.client_ca, mutual TLS)
    every client needs one it or `operators` signed; with only `operators` (quic.operator_ca) a client
    may send none (an ordinary client) or one the operator CA signed (an operator). Any other is a TLS
    alert.

    aioquic's server side can ask for a client certificate but does not check it (upstream marks
    it "for test purposes"), so each connection's TLS context is given the request and a check
    that runs inside the handshake.
    """

    def __init__(self, clients: CertificateAuthority | None, operators: CertificateAuthority | None) -> None:
        self.clients, self.operators = clients, operators

    @classmethod
    def of(cls, client_ca: Path, operator_ca: Path) -> ClientCertificates | None:
        """None where neither CA is configured: no certificate is asked for."""
        if not client_ca.name and not operator_ca.name:
            return None
        return cls(
            CertificateAuthority(client_ca) if client_ca.name else None,
            CertificateAuthority(operator_ca) if operator_ca.name else None,
        )

    def require(self, quic: QuicConnection) -> None:
        initialize = quic._initialize

        def initialize_with_client_auth(peer_cid: bytes) -> None:
            initialize(peer_cid)
            context = quic.tls
            context._request_client_certificate = True
            handle_certificate = context._server_handle_certificate

            def handle_and_verify(input_buf: Any) -> None:
                handle_certificate(input_buf)
                self.verify(context._peer_certificate, context._peer_certificate_chain)

            context._server_handle_certificate = handle_and_verify  # type: ignore[method-assign]
            handle_hello = context._server_handle_hello

            def hello_then_no_certificate_when_resumed(*args: Any) -> None:
                # aioquic then expects a certificate even from a client resuming a session (PSK), which
                # sends none (RFC 8446 4.3.2: no CertificateRequest with a PSK): expect its Finished. Its
                # ticket came from a handshake where its certificate passed.
                handle_hello(*args)
                if context.session_resumed and context.state == tls.State.SERVER_EXPECT_CERTIFICATE:
                    context._server_expect_finished()

            context._server_handle_hello = hello_then_no_certificate_when_resumed  # type: ignore[method-assign,assignment]

        quic._initialize = initialize_with_client_auth  # type: ignore[method-assign]

    def verify(self, leaf: Any, chain: list[Any]) -> None:
        if leaf is None:
            if self.clients is not None:
                raise tls.AlertHandshakeFailure("a client certificate is required")
            return
        if not (self.clients is not None and self.clients.signed(leaf, chain)) and not self.is_operator(leaf, chain):
            raise tls.AlertBadCertificate("client certificate not signed by the configured CA")

    def is_operator(self, leaf: Any, chain: list[Any]) -> bool:
        return leaf is not None and self.operators is not None and self.operators.signed(leaf, chain)
