"""The HTTP/3 listener's shared state (h3.py pumps each connection): the API, the live settings, who is
connected, the QUIC socket with its guards (quic_guards.py) and connection cache, and the deadlines of
every connection on the clock it was given: handshakes and quiet request streams, and the write
deadline (server.write_timeout_s: a peer that takes nothing of the answers waiting for it is cut off,
and the work for it cancelled)."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import Callable
from functools import partial

from aioquic.h3.connection import H3_ALPN
from aioquic.quic.configuration import QuicConfiguration

from appliance.config import Live, QuicConfig, ServerConfig
from appliance.protocol.messages import Handler, Opened
from appliance.tasks import spawn
from appliance.transport.assembler import LIMITS_BITTEN, BodyBudget
from appliance.transport.conncache import ConnectionCache
from appliance.transport.h3 import H3Protocol
from appliance.transport.owners import SequenceOwners
from appliance.transport.quic_guards import ClientCertificates, GuardedQuicServer, Tickets, TicketStore
from appliance.transport.serving import Serving

log = logging.getLogger("appliance.h3")

CONNCACHE_SWEEP_S = 1.0
KEEP_ALIVE_PING = -1  # the uid of the PINGs that keep a waiting connection alive (aioquic's own count from 0)


def quic_configuration(quic: QuicConfig) -> QuicConfiguration:
    """The server's QUIC settings and its certificate (an unreadable one raises OSError or ValueError)."""
    configuration = QuicConfiguration(is_client=False, alpn_protocols=H3_ALPN, idle_timeout=quic.idle_timeout_s)
    configuration.load_cert_chain(quic.certificate, quic.private_key)
    return configuration


class H3Server:
    """Shared state of all QUIC connections: the API, the live settings, and who is connected."""

    def __init__(
        self,
        api: Handler,
        live: Live,
        budget: BodyBudget,
        worker_key: int | None = None,
        tickets: Tickets | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`worker_key`: a QUIC worker's; `tickets`: the store shared by all workers (the engine's), so
        that a client resumes in 0-RTT whichever worker its new connection reaches; `clock` times every
        connection's deadlines (a test may hold it)."""
        self.api, self.live, self.budget, self.clock = api, live, budget, clock
        self.worker_key = worker_key  # every host connection ID starts with it (QUIC steering)
        self.config: QuicConfig = live.config.quic  # the listener's own settings change only with a restart
        self.connections: set[H3Protocol] = set()
        self._waiting_since: dict[H3Protocol, float] = {}  # connections with answers in the work: since or last PING
        self.tickets = tickets or TicketStore()
        self.client_certificates = ClientCertificates.of(self.config.client_ca, self.config.operator_ca)
        self.cache: ConnectionCache | None = None
        self.owners = SequenceOwners()  # the sequences each peer opened
        self._quic_server: GuardedQuicServer | None = None
        self._reaper: asyncio.Task[None] | None = None
        self._sweep: asyncio.Task[None] | None = None

    @property
    def in_flight(self) -> int:
        return sum(c.in_flight for c in self.connections)

    @property
    def delivering(self) -> int:
        """Connections whose answers the peer has not all acknowledged: a drain that closed them at once
        would cut off what aioquic still holds for the peer."""
        return sum(c.answers.delivering for c in self.connections)

    @property
    def limits(self) -> ServerConfig:
        return self.live.config.server

    @classmethod
    async def serve(cls, serving: Serving, sock: socket.socket) -> H3Server:
        """The QUIC listener (listening.py's table), with its connection cache swept while it serves."""
        assert serving.cache is not None, "QUIC is served with its connection cache"
        server = cls(serving.api, serving.live, serving.budget, serving.worker_key, serving.tickets, serving.clock)
        await server.start(sock, serving.cache, serving.on_failure)
        server._sweep = spawn(server.sweep_connection_cache(), "the connection cache sweep", serving.on_failure)
        return server

    async def start(
        self, sock: socket.socket, cache: ConnectionCache, on_failure: Callable[[BaseException], None] | None = None
    ) -> None:
        """Serve QUIC on `sock` with `cache` attached (the engine's, or a worker's view of its pins;
        closed with this server); `on_failure` hears of a reaper that died (our bug), as Http1Server's."""
        configuration = quic_configuration(self.config)
        _, self._quic_server = await asyncio.get_running_loop().create_datagram_endpoint(
            lambda: GuardedQuicServer(
                configuration=configuration,
                create_protocol=partial(H3Protocol, server=self),
                session_ticket_fetcher=self.tickets.pop,
                session_ticket_handler=self.tickets.add,
                retry=self.config.retry,
            ),
            sock=sock,
        )
        self.cache = cache
        self._quic_server.admit = cache.admit
        self._quic_server.handshaking = self.handshaking
        self._quic_server.retry_when_handshaking = self.config.retry_when_handshaking
        self._reaper = spawn(self._reap(), "the HTTP/3 stream reaper", on_failure)

    @property
    def datagrams(self) -> int:
        return self._quic_server.datagrams if self._quic_server else 0

    @property
    def stray_datagrams(self) -> int:
        return self._quic_server.stray_datagrams if self._quic_server else 0

    def handshaking(self) -> int:
        return sum(not c.handshake_done for c in self.connections)

    def handshaking_from(self, host: str) -> int:
        return sum(not c.handshake_done and c.peer.rpartition(":")[0] == host for c in self.connections)

    def connections_from(self, host: str) -> int:
        return sum(c.peer.rpartition(":")[0] == host for c in self.connections)

    def peers_held(self) -> set[str]:  # peers with an open connection
        return {c.peer for c in self.connections if c.peer}

    def opened(self, peer: str, opened: Opened) -> None:
        """A request of `peer` opened a sequence: ended when the peer is gone (sweep_connection_cache)."""
        if peer:
            self.owners.record(peer, opened)

    def close_peer(self, peer: str, reason: str) -> list[Opened]:
        """Close a vanished peer's connections; the sequences it opened, for the API to end."""
        for connection in [c for c in self.connections if c.peer == peer]:
            connection.close_quietly(reason)
        return self.owners.release(peer)

    async def sweep_connection_cache(self) -> None:
        """Forever: release what vanished QUIC peers held (peers idle past the timeout, or evicted)."""
        assert self.cache is not None
        while True:
            await asyncio.sleep(CONNCACHE_SWEEP_S)
            held = self.owners.held()
            try:
                still = {o for o, is_open in zip(held, await self.api.still_open(held), strict=True) if is_open}
            except TimeoutError:
                log.warning("conncache: the engine did not say which sequences are open; next sweep retries")
                continue
            self.owners.forget_ended(still.__contains__)
            for peer in await self.cache.swept(self.peers_held() | self.owners.peers(), self.peers_held()):
                opened = self.close_peer(peer, "peer idle or evicted from the connection cache")
                self.api.end_opened(opened)
                log.info("conncache: peer %s idle or evicted: closed, %d sequences released", peer, len(opened))

    async def _reap(self) -> None:
        while True:
            quic = self.live.config.quic
            ticks = (quic.stream_idle_timeout_s / 2, quic.handshake_timeout_s / 2, self.config.idle_timeout_s / 3)
            await asyncio.sleep(min(1.0, *ticks))
            self.check_timeouts(self.clock())

    def check_timeouts(self, now: float) -> None:
        """Handshakes not complete in time lose their slot; a peer that took nothing of the answers
        waiting for it for server.write_timeout_s is cut off; quiet request streams get a 408; a
        connection waiting on its answers is kept alive."""
        quic, write_timeout_s = self.live.config.quic, self.limits.write_timeout_s
        for gone in self._waiting_since.keys() - self.connections:
            del self._waiting_since[gone]
        for connection in list(self.connections):
            self._keep_alive(connection, now)
            if not connection.handshake_done and now - connection.created > quic.handshake_timeout_s:
                LIMITS_BITTEN.bit("handshake", f"QUIC handshake not complete within {quic.handshake_timeout_s:g} s")
                connection.close_quietly("handshake not complete in time")
            elif connection.answers.write_overdue(now, write_timeout_s):
                connection.cut_off(write_timeout_s)
            else:
                connection.reap_quiet_streams(now, now - quic.stream_idle_timeout_s)

    def _keep_alive(self, connection: H3Protocol, now: float) -> None:
        """Neither side sends while the engine works on an answer, so a request that takes longer than
        quic.idle_timeout_s would lose its connection: a PING a third of that apart keeps it (RFC 9000
        10.1.2). The peer's acknowledgement keeps the server's side."""
        if not connection.in_flight:
            self._waiting_since.pop(connection, None)
        elif now - self._waiting_since.setdefault(connection, now) >= self.config.idle_timeout_s / 3:
            connection._quic.send_ping(KEEP_ALIVE_PING)
            connection.transmit()
            self._waiting_since[connection] = now

    def stop_accepting(self) -> None:
        """No new connections (their first packets are dropped); those open go on on the same socket."""
        if self._quic_server is not None:
            self._quic_server.accepting = False

    def close_all(self) -> None:
        for connection in self.connections:
            connection.websockets.going_away()
        for task in (self._reaper, self._sweep):
            if task is not None:
                task.cancel()
        if self._quic_server is not None:
            self._quic_server.close()
        if self.cache is not None:
            self.cache.close()
