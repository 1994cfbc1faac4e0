"""Home Assistant's Wyoming as a transport of the listener table: the pump on each connection (api/wyoming.py:
admission and the events' loop, on wyoming_codec.py's sans-I/O reader), on the Unix socket beside the
API's and on TCP for the LAN (its peers from wyoming.allow). Its sessions use the models themselves (the
same batches as the API's), so it is served in the engine process (Serving.engine), whatever
server.workers; the stop and the drain are the table's, as for every transport. The Wyoming modules
are imported when it is served: a protocol worker, which never serves it, loads no model code."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from appliance.api.wyoming_codec import MAX_HEADER_BYTES  # asyncio's stream buffer is sized by it
from appliance.transport.serving import Serving

if TYPE_CHECKING:
    from appliance.api.wyoming import Sessions

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class WyomingServer:
    """Wyoming served on one listening socket: its connections, admitted by its own slots."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.connections: set[asyncio.StreamWriter] = set()  # the refused, lingering, too: close_all ends them
        self.server: asyncio.Server | None = None

    @classmethod
    async def serve_unix(cls, serving: Serving, sock: socket.socket) -> WyomingServer:
        """The Unix socket: max_connections, max_connections_per_peer of one user."""
        served = cls(_sessions(serving, "the Unix socket"))
        served.server = await asyncio.start_unix_server(
            served.tracked(served.sessions.client), sock=sock, limit=MAX_HEADER_BYTES
        )
        return served

    @classmethod
    async def serve_tcp(cls, serving: Serving, sock: socket.socket) -> WyomingServer:
        """TCP: slots apart from the Unix socket's (the LAN cannot take a local Home Assistant's), its
        peers from wyoming.allow only."""
        from appliance.api.access import wyoming_allow

        served = cls(_sessions(serving, "TCP"))
        metrics = served.sessions.metrics
        allowed = wyoming_allow.guard(served.sessions.client, serving.live, metrics, serving.clock)
        served.server = await asyncio.start_server(served.tracked(allowed), sock=sock, limit=MAX_HEADER_BYTES)
        return served

    def tracked(self, serve: Serve) -> Serve:
        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections.add(writer)
            try:
                await serve(reader, writer)
            finally:
                self.connections.discard(writer)

        return client

    @property
    def in_flight(self) -> int:
        """Sessions open: each closes once idle after the stop (a recording under way gets its transcript)."""
        return self.sessions.connections

    @property
    def delivering(self) -> int:
        return 0  # an event is written within its write deadline before the session goes on

    def check_timeouts(self, now: float) -> None:
        """Each connection's pump holds its own deadlines on Serving.clock (api/wyoming_events.py), woken
        by the loop's time: here each asks the clock at once."""
        for wake in list(self.sessions.wakes):
            wake.now()

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    def close_all(self) -> None:
        for writer in list(self.connections):
            writer.transport.abort()


def _sessions(serving: Serving, listener: str) -> Sessions:
    """A listener's sessions: on the Unix socket max_connections, on TCP max_tcp_connections apart."""
    from appliance.api.wyoming import Admission, Sessions

    engine = serving.engine
    if engine is None:
        raise ValueError("Wyoming is served where the models are: the engine process")
    limit = (lambda s: s.max_connections) if listener != "TCP" else (lambda s: s.max_tcp_connections)
    return Sessions(
        Admission(listener, limit),
        engine.models,
        serving.live,
        engine.metrics,
        engine.draining,
        serving.budget,
        engine.stopping,
        serving.clock,
    )
