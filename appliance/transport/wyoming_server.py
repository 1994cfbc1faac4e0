"""Home Assistant's Wyoming as a transport of the listener table (the protocol: api/wyoming.py): each
listener's admission and the pump on each connection, its events read by api/wyoming_codec.py's sans-I/O
reader and answered by api/wyoming_handler.py, on the Unix socket beside the API's and on TCP for the
LAN (its peers from wyoming.allow). Its sessions use the models themselves (the
same batches as the API's), so it is served in the engine process (Serving.engine), whatever
server.workers; the stop and the drain are the table's, as for every transport. The Wyoming modules
are imported when it is served: a protocol worker, which never serves it, loads no model code."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from wyoming.audio import AudioChunk, AudioStop
from wyoming.error import Error
from wyoming.event import Event

from appliance.api.wyoming_codec import MAX_HEADER_BYTES, Bounds, EventReader, WyomingError
from appliance.api.wyoming_events import (
    Nudge,
    WriteTimeout,
    answered,
    close_with_error,
    cut_off,
    read_event,
    write_event,
)
from appliance.config import WyomingConfig
from appliance.errors import ApiError
from appliance.protocol.flow import received
from appliance.protocol.limits import over_bound
from appliance.protocol.proxied import ORIGIN
from appliance.protocol.unix_peer import unix_peer
from appliance.tasks import spawn
from appliance.transport.serving import EngineSide, Serving, checking_timeouts

if TYPE_CHECKING:
    from appliance.api.wyoming_handler import WyomingHandler

log = logging.getLogger("appliance.wyoming")
Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Admission:
    """The Wyoming clients connected now on one listener, per peer (a user on the Unix socket, a host on
    TCP), against the listener's limit and [wyoming] max_connections_per_peer: one user or host cannot
    take them all, and each listener has its own slots (max_connections on the Unix socket,
    max_tcp_connections on TCP), so LAN hosts cannot take a local Home Assistant's. A refused connection
    lingers a moment so its client reads why (_linger): at most the limit of those at once, the rest
    closed at once, so a flood of them holds no more sockets than that."""

    def __init__(self, listener: str, limit: Callable[[WyomingConfig], int]) -> None:
        self.listener, self.limit = listener, limit
        self.peers: Counter[str] = Counter()
        self.refused = 0  # refused connections lingering now

    def refusal(self, peer: str, settings: WyomingConfig) -> WyomingError | None:
        """Why `peer` may not connect now (None where it may): the bound every listener's admission asks."""
        what = f"Wyoming connections on {self.listener}"
        found = over_bound(
            self.peers.elements(), peer, self.limit(settings), settings.max_connections_per_peer, 1, what
        )
        if found is None:
            return None
        bound, message = found
        return WyomingError(message, "too_many_connections" if bound == "limit" else "too_many_connections_from_peer")

    @contextlib.contextmanager
    def held(self, peer: str) -> Iterator[None]:
        self.peers[peer] += 1
        try:
            yield
        finally:
            self.peers[peer] -= 1
            if not self.peers[peer]:
                del self.peers[peer]

    @contextlib.contextmanager
    def refusing(self, settings: WyomingConfig) -> Iterator[bool]:
        """Whether a refused connection may linger, counted while it does."""
        lingers = self.refused < self.limit(settings)
        self.refused += lingers
        try:
            yield lingers
        finally:
            self.refused -= lingers


async def serve_client(
    handler: WyomingHandler,
    bounds: Bounds,
    client: str,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    stopping: asyncio.Event,
    clock: Callable[[], float],
    nudge: Nudge,
) -> None:
    """The connection's events until it ends, read within their deadlines on `clock` (`nudge`: its listener's
    deadline check asks the clock at once); at the daemon's stop it closes with an error event once
    nothing is under way (a wake word's listening is not: it only waits for speech)."""

    async def send(event: Event) -> None:
        await write_event(event, writer, bounds.write_s, clock, nudge)  # drains: one that reads nothing is cut off

    reading: asyncio.Future[Event | None] | None = None
    events = EventReader(bounds, clock())
    try:
        while True:
            reading = asyncio.ensure_future(read_event(reader, events, clock, nudge))
            if not await received(reading, stopping, handler.idle):
                raise WyomingError(
                    "the box is stopping: connect again, to another box if there is one", code="stopping"
                )
            if (event := reading.result()) is None:
                break
            try:
                handling = handler.handle(event, send)
                # an audio chunk's answer is at once, and the next read sees a client gone: no watch for it
                watched = not AudioChunk.is_type(event.type)
                for answer in await (answered(handling, reader, writer, events, clock, nudge) if watched else handling):
                    await send(answer)
            except ApiError as exc:  # the client's: a bad event's fields (wyoming_events.read_as), one error, go on
                message = exc.message
                if AudioStop.is_type(event.type):
                    # no transcript will come, and a client may wait for one (Home Assistant's does,
                    # ignoring errors): the connection closes, which it takes as the end
                    raise WyomingError(message, code=type(exc).__name__) from None
                await send(Error(text=message, code=type(exc).__name__).event())
                # the connection goes on: not at info, where one client could repeat it without end
                log.debug("Wyoming client %s: %s", client, message)
    except WyomingError as exc:
        if reading is not None and not reading.done():  # the stop's
            reading.cancel()
            await asyncio.wait([reading])
        # the stop's goodbye does not linger for the client's close: the drain would wait for it (5 s
        # where a client keeps its connection open, as Home Assistant's does after an error)
        linger = exc.code != "stopping"
        await close_with_error(exc, client, reader, writer, bounds.write_s, linger, clock)
    except WriteTimeout as exc:
        cut_off(exc, client, writer)
    except (ConnectionError, asyncio.IncompleteReadError):
        pass  # the client left; what it asked for is cancelled with this task
    except Exception:
        log.exception("Wyoming client crashed")
    finally:
        if reading is not None:
            reading.cancel()
        handler.end()
        writer.close()


def _peer(writer: asyncio.StreamWriter) -> str:
    """Who owns the connection's VAD sequence: the user on the Unix socket, the host on TCP (behind a
    balancer, the client's its PROXY header named)."""
    if (origin := ORIGIN.get()) is not None:
        return origin[0]
    peername = writer.get_extra_info("peername")
    if isinstance(peername, tuple) and peername:
        return str(peername[0])
    return unix_peer(writer.get_extra_info("socket"))[0]


@dataclass
class Sessions:
    """The Wyoming connections of one listener: admitted by `admission`, served with the engine process's
    models (`engine`; while it drains, a new client gets an error event and a close: api/fleet_routes.py;
    at its stop each connection closes with an error event once nothing is under way), recordings held
    against the process's byte budget, deadlines on its clock (`serving`)."""

    admission: Admission
    engine: EngineSide
    serving: Serving
    nudges: set[Nudge] = field(default_factory=set)  # one per session being served: a stop waits for them

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, admitted by the listener's admission or refused with an error event."""
        serving, admission = self.serving, self.admission
        config, peer = serving.live.config, _peer(writer)  # as the config is now: a reload bounds new connections
        bounds = Bounds.of(config)
        refusal = (
            WyomingError("draining: new sessions go to another box", code="draining")
            if self.engine.draining()
            else admission.refusal(peer, config.wyoming)
        )
        if refusal:
            try:
                with admission.refusing(config.wyoming) as linger:
                    await close_with_error(refusal, peer, reader, writer, bounds.write_s, linger, serving.clock)
            finally:
                writer.close()
            return
        nudge = Nudge()  # check_timeouts ends the wait its pump is in
        self.nudges.add(nudge)
        try:
            with admission.held(peer):
                handler = self._handler(bounds, peer)
                stopping = self.engine.stopping
                await serve_client(handler, bounds, peer, reader, writer, stopping, serving.clock, nudge)
        finally:
            self.nudges.discard(nudge)

    def _handler(self, bounds: Bounds, client: str) -> WyomingHandler:
        from appliance.api.wyoming_handler import WyomingHandler  # the models' code: the engine's alone

        metrics = self.engine.metrics
        observe = lambda model, s: metrics.observe_live(model, "wyoming", s)  # noqa: E731
        return WyomingHandler(self.engine.models, bounds.max_samples, self.serving.budget, client, observe)


class WyomingServer:
    """Wyoming served on one listening socket: its connections, admitted by its own slots."""

    def __init__(self, sessions: Sessions, serving: Serving) -> None:
        self.sessions = sessions
        self.connections: set[asyncio.StreamWriter] = set()  # the refused, lingering, too: close_all ends them
        self.server: asyncio.Server | None = None
        self._serving = serving
        self._timeouts: asyncio.Task[None] | None = None

    @classmethod
    async def serve_unix(cls, serving: Serving, sock: socket.socket) -> WyomingServer:
        """The Unix socket: max_connections, max_connections_per_peer of one user."""
        sessions = Sessions(Admission("the Unix socket", lambda s: s.max_connections), _engine(serving), serving)
        served = cls(sessions, serving)
        served.server = await asyncio.start_unix_server(
            served.tracked(served.sessions.client), sock=sock, limit=MAX_HEADER_BYTES
        )
        return served

    @classmethod
    async def serve_tcp(cls, serving: Serving, sock: socket.socket) -> WyomingServer:
        """TCP: slots apart from the Unix socket's (the LAN cannot take a local Home Assistant's), its
        peers from wyoming.allow only."""
        from appliance.api.access import wyoming_allow

        engine = _engine(serving)
        served = cls(Sessions(Admission("TCP", lambda s: s.max_tcp_connections), engine, serving), serving)
        allowed = wyoming_allow.guard(served.sessions.client, serving.live, engine.metrics, serving.clock)
        served.server = await asyncio.start_server(served.tracked(allowed), sock=sock, limit=MAX_HEADER_BYTES)
        return served

    def tracked(self, serve: Serve) -> Serve:
        async def client(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self._timeouts is None:  # as HTTP/1.1's: each pump asks its clock, a half-closed client's close seen
                serving = self._serving
                self._timeouts = spawn(
                    checking_timeouts(self, serving.clock), "the Wyoming timeouts", serving.on_failure
                )
            self.connections.add(writer)
            try:
                await serve(reader, writer)
            finally:
                self.connections.discard(writer)

        return client

    @property
    def in_flight(self) -> int:
        """Sessions open: each closes once idle after the stop (a recording under way gets its transcript)."""
        return len(self.sessions.nudges)

    @property
    def delivering(self) -> int:
        return 0  # an event is written within its write deadline before the session goes on

    def check_timeouts(self, now: float) -> None:
        """Each connection's pump holds its own deadlines on Serving.clock (api/wyoming_events.py), woken
        by the loop's time: here each asks the clock at once."""
        for nudge in list(self.sessions.nudges):
            nudge.now()

    def stop_accepting(self) -> None:
        if self.server is not None:
            self.server.close()

    def close_all(self) -> None:
        if self._timeouts is not None:
            self._timeouts.cancel()
        for writer in list(self.connections):
            writer.transport.abort()


def _engine(serving: Serving) -> EngineSide:
    if serving.engine is None:
        raise ValueError("Wyoming is served where the models are: the engine process")
    return serving.engine
