"""HTTPS on TCP for LAN clients and browsers: the Unix socket's HTTP/1.1 (http1.py) over asyncio's TLS.

The same parser, limits, body budget, flow control and cancellation as the Unix socket; what differs
is said here: TLS from [quic]'s certificate and key (mutual TLS with its client_ca), the client's
identity (its verified certificate, else the connection itself), its own connection limit
(https.max_connections) and one address's share of it (https.max_connections_per_address), and `Alt-Svc: h3=":PORT"` on every answer where QUIC serves, so browsers
and other capable clients move to HTTP/3. Handshakes are admitted, bounded and timed in tls_accept.py.
Without mutual TLS a sequence belongs to the connection that opened it: when that connection ends,
nobody can continue it, so its sequences end with it. With mutual TLS it belongs to the certificate,
as on QUIC, and outlives the connection (idle expiry ends it).

TLS has no half-close in asyncio: a client that ends its side (close_notify, or a TCP FIN) closes the
connection, and answers not yet written are dropped (the Unix socket answers them).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import socket
import ssl
import time
from collections.abc import Callable, Iterable

from cryptography import x509

from appliance.config import Config, Live, QuicConfig
from appliance.errors import ApplianceError
from appliance.networks import Bind, Listening, tcp_listener
from appliance.protocol.messages import Handler, Opened
from appliance.protocol.proxied import Address
from appliance.tasks import spawn
from appliance.transport.assembler import BodyBudget
from appliance.transport.http1 import Http1Server, HttpConnection
from appliance.transport.owners import SequenceOwners
from appliance.transport.quic_guards import ClientCertificates
from appliance.transport.serving import Serving
from appliance.transport.tls_accept import TlsAcceptor

log = logging.getLogger("appliance.https")
ALPN = ["http/1.1"]
FORGET_ENDED_S = 10.0  # how often sequences ended by other ways leave the owners table


def server_context(quic: QuicConfig) -> ssl.SSLContext:
    """TLS 1.2 or later with the box's certificate; a client certificate required where client_ca is set,
    and asked for where operator_ca is (one it signed makes an operator), as on QUIC."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(quic.certificate, quic.private_key)
    context.set_alpn_protocols(ALPN)
    authorities = [ca for ca in (quic.client_ca, quic.operator_ca) if ca.name]
    if authorities:
        context.verify_mode = ssl.CERT_REQUIRED if quic.client_ca.name else ssl.CERT_OPTIONAL
        for ca in authorities:
            context.load_verify_locations(ca)
    return context


async def open_https(config: Config, bind: Bind) -> Listening | None:
    """The TCP listening socket on https.host and https.port, which every protocol worker accepts on
    (None where [https] is off); the TLS files are read once here too, so that a bad key is a start-up
    error, not a worker's crash."""
    if not config.https.enabled:
        return None
    host, port = config.https.host, config.https.port
    try:
        ClientCertificates.of(config.quic.client_ca, config.quic.operator_ca)  # names a CA file it cannot read
    except ValueError as exc:
        raise ApplianceError(f"https: {exc}") from None
    try:
        server_context(config.quic)
    except (OSError, ValueError) as exc:
        raise ApplianceError(
            f"https: cannot use {config.quic.certificate} and {config.quic.private_key}: {exc}"
        ) from None
    sock = tcp_listener("https", host, port)
    sock.setblocking(False)
    log.info("https: HTTP/1.1 over TLS on TCP %s:%d", host, sock.getsockname()[1])
    return Listening(sock)


def certificate_client(der: bytes | None) -> str:
    """ "cert:FINGERPRINT" of a verified client certificate, as QUIC names it: one owner on both."""
    return f"cert:{hashlib.sha256(der).hexdigest()[:32]}" if der else ""


class HttpsServer(Http1Server):
    """Shared state of all TLS connections of one process (the engine's, or a protocol worker's)."""

    half_close = False
    listener = "https"

    def __init__(
        self,
        api: Handler,
        live: Live,
        budget: BodyBudget,
        quic_port: int | None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`quic_port`: where QUIC serves (advertised in Alt-Svc), or None; `clock` as Http1Server's."""
        super().__init__(api, live, budget, clock)
        self.quic_port = quic_port
        quic = live.config.quic  # the listener's TLS changes only with a restart
        self.mutual = bool(quic.client_ca.name)
        self.certificates = ClientCertificates.of(quic.client_ca, quic.operator_ca)
        self.owners = SequenceOwners()  # without mutual TLS: the sequences each open connection opened
        self._forget: asyncio.Task[None] | None = None

    @classmethod
    async def serve(cls, serving: Serving, sock: socket.socket) -> HttpsServer:
        """The TLS listener on TCP (listening.py's table); its Alt-Svc names QUIC's port where it serves."""
        server = cls(serving.api, serving.live, serving.budget, serving.quic_port, serving.clock)
        server.on_failure = serving.on_failure
        await server.listen(sock)
        return server

    async def listen(self, sock: socket.socket) -> None:
        self._forget = spawn(self._forget_ended(), "the HTTPS connections' sequence sweep")
        context = server_context(self.live.config.quic)
        self._listener = TlsAcceptor(
            sock,
            context,
            lambda: self.live.config.https,
            self.proxied_protocol,
            self.budget.workers,
            lambda: self.live.config.fleet.proxies,
        )

    def proxied_protocol(self, origin: Address | None) -> HttpConnection:
        """A connection whose client is `origin` where its balancer's PROXY header named one."""
        connection = self.protocol()
        connection.origin = origin
        return connection

    @property
    def connection_limits(self) -> tuple[int, int]:
        https = self.live.config.https
        return https.max_connections, https.max_connections_per_address

    def share_key(self, client: str, peer: str) -> str:
        """An address's share, whatever the connection or certificate: one LAN host cannot take all slots."""
        return peer.rpartition(":")[0]

    def identify(self, transport: asyncio.BaseTransport, origin: Address | None) -> tuple[str, str, bool]:
        host, port = origin or transport.get_extra_info("peername")[:2]
        peer = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        ssl_object = transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object is not None else None  # verified by the handshake
        client = certificate_client(der) if self.mutual else ""
        certificates = self.certificates
        operator = bool(der and certificates and certificates.is_operator(x509.load_der_x509_certificate(der), []))
        return client or f"tcp:{secrets.token_hex(8)}", peer, operator

    def extra_headers(self) -> Iterable[tuple[str, str]]:
        if self.quic_port is None or not self.live.config.https.alt_svc:
            return ()
        return (("alt-svc", f'h3=":{self.quic_port}"; ma=86400'),)

    def opened(self, client: str, opened: Opened) -> None:
        if not self.mutual:
            self.owners.record(client, opened)

    def closed(self, client: str) -> None:
        if not self.mutual:
            self.api.end_opened(self.owners.release(client))

    async def _forget_ended(self) -> None:
        """Sequences ended by sequence_end or idle expiry leave the table while their connection lives on."""
        while True:
            await asyncio.sleep(FORGET_ENDED_S)
            held = self.owners.held()
            ended = {o for o, is_open in zip(held, await self.api.still_open(held), strict=True) if not is_open}
            self.owners.forget_ended(lambda opened: opened not in ended)  # one opened meanwhile stays

    def close_all(self) -> None:
        if self._forget is not None:
            self._forget.cancel()
        super().close_all()
