"""Home Assistant's Wyoming protocol (PyPI `wyoming`: its event classes and writer) on a Unix socket
next to the API socket, served from the engine process: the same models, the same batches.

    describe                                   -> info: every speech_to_text model (its languages)
                                                  in one asr program, every voice of every speech
                                                  model (its language) in one tts program, every
                                                  wake word in one wake program per wake_word model
    transcribe, audio-start, audio-chunk..., audio-stop
                                               -> voice-started / voice-stopped and transcript-start,
                                                  transcript-chunk while the speech comes (where the
                                                  recording comes as it is spoken: wyoming_voice.py),
                                                  the rest as chunks at audio-stop, transcript-stop,
                                                  then transcript (made ahead where the recording
                                                  ended in silence: LiveTranscriber.hear)
    detect, (audio-start,) audio-chunk..., audio-stop
                                               -> detection per wake word heard, or not-detected at
                                                  audio-stop (wyoming_wake.py)
    synthesize (or synthesize-start/-chunk.../-stop), its voice by name or by language
                                               -> audio-start, audio-chunk per sentence as it is
                                                  made, audio-stop (the streamed form: each sentence
                                                  spoken once its chunks complete it, then
                                                  synthesize-stopped)

Wyoming has no authentication: whoever reaches the socket may use it (its mode and group are the API
socket's); on TCP, the peers of wyoming.allow (api/access/wyoming_allow.py). Events are read with bounds of our own (the package's reader has none): a header line of at
most MAX_HEADER_BYTES, data and payload of at most [wyoming] max_payload_bytes, a recording of at most
the API's body limit; in time as the API's HTTP/1.1 (an idle connection, a header line, a stalled
payload), and what the box sends as well (server.write_timeout_s: a client that takes nothing of it
is cut off, its slot freed); a recording's audio held against the daemon's byte budget
(server.max_buffered_bytes, shared with the API's request bodies); and [wyoming] max_connections
clients at once on the Unix socket, max_tcp_connections apart from them on TCP (the LAN cannot take a
local Home Assistant's slots), max_connections_per_peer of one user (Unix socket) or host (TCP). A
broken or oversized event, a bound in time, a full budget or a connection past the count is answered
by one `error` event and the connection closes; a client that disconnects mid-stream cancels its work.
Concurrent clients' recordings share engine calls (the speech_to_text batch queue), where
wyoming-faster-whisper holds a lock per model.

Here the connections: their admission and each one's loop. Events read from bytes with their bounds
and deadlines (sans I/O): wyoming_codec.py; its pump, writes and the error that closes a connection:
wyoming_events.py; each event's answer: wyoming_handler.py (a
stream's PCM in: wyoming_audio.py); TCP and its mDNS announcement: wyoming_lan.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from wyoming.audio import AudioChunk, AudioStop
from wyoming.error import Error
from wyoming.event import Event
from zeroconf.asyncio import AsyncZeroconf

from appliance.api.metrics import Metrics
from appliance.api.wyoming_codec import Bounds, EventReader, WyomingError
from appliance.api.wyoming_events import (
    Wake,
    WriteTimeout,
    answered,
    close_with_error,
    cut_off,
    read_event,
    write_event,
)
from appliance.api.wyoming_handler import WyomingHandler
from appliance.api.wyoming_lan import announce, tcp_socket
from appliance.config import Config, Live, WyomingConfig
from appliance.errors import ApiError
from appliance.kinds.base import ServedModel
from appliance.protocol.flow import received
from appliance.protocol.limits import ByteBudget, over_bound
from appliance.protocol.proxied import ORIGIN
from appliance.protocol.unix_peer import unix_peer

log = logging.getLogger("appliance.wyoming")


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
    wake: Wake,
) -> None:
    """The connection's events until it ends, read within their deadlines on `clock` (`wake`: its listener's
    deadline check asks the clock at once); at the daemon's stop it closes with an error event once
    nothing is under way (a wake word's listening is not: it only waits for speech)."""

    async def send(event: Event) -> None:
        await write_event(event, writer, bounds.write_s, clock, wake)  # drains: one that reads nothing is cut off

    reading: asyncio.Future[Event | None] | None = None
    events = EventReader(bounds, clock())
    try:
        while True:
            reading = asyncio.ensure_future(read_event(reader, events, clock, wake))
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
                for answer in await (answered(handling, reader, writer, events, clock) if watched else handling):
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
        if reading is not None and not reading.done():  # the stop's: the goodbye's linger reads next
            reading.cancel()
            await asyncio.wait([reading])
        await close_with_error(exc, client, reader, writer, bounds.write_s, clock=clock)
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


def unix_socket_path(config: Config) -> Path:
    """Where Wyoming's Unix socket is: [wyoming] socket, else wyoming.sock beside the API's."""
    socket_setting = str(config.wyoming.socket)
    return Path(socket_setting) if socket_setting != "." else config.server.socket.with_name("wyoming.sock")


def listening_sockets(config: Config, bind: Callable[[Path], socket.socket]) -> dict[str, socket.socket]:
    """[wyoming]'s sockets by their names in the listener table (transport/listening.py): the Unix socket
    (`bind` makes it as the API's is made), and TCP where asked for (announced once served: wyoming_lan)."""
    settings = config.wyoming
    if not settings.enabled:
        return {}
    path = unix_socket_path(config)
    sockets = {"wyoming": bind(path)}
    log.info("Wyoming on %s", path)
    if settings.tcp:
        try:
            sockets["wyoming-tcp"] = tcp_socket(settings.tcp)
        except BaseException:  # the start fails: the socket made for it goes too
            sockets["wyoming"].close()
            path.unlink(missing_ok=True)
            raise
    return sockets


async def announced(config: Config, sockets: dict[str, socket.socket]) -> AsyncZeroconf | None:
    """Wyoming on TCP announced on the LAN once it serves (closing it says goodbye); None without TCP.
    The announcement's TXT record carries the HTTPS port (`appliance fleet targets`)."""
    if "wyoming-tcp" not in sockets:
        return None
    properties = {"https": str(config.https.port)} if config.https.enabled else {}
    return await announce(config.wyoming.tcp, sockets["wyoming-tcp"].getsockname()[1], properties)


async def goodbye(announcement: AsyncZeroconf | None) -> None:
    """The announcement withdrawn (zeroconf's goodbye on the LAN), where there is one."""
    if announcement is not None:
        await announcement.async_close()


@dataclass
class Sessions:
    """What every Wyoming connection of one listener is served with. While `draining()`, a new client
    gets an error event and a close (a drain, api/fleet_routes.py). Recordings are held against
    `budget`, the engine process's bytes held for clients. At `stopping` each connection closes with an
    error event once nothing is under way."""

    admission: Admission
    models: dict[str, ServedModel]
    live: Live
    metrics: Metrics
    draining: Callable[[], bool]
    budget: ByteBudget
    stopping: asyncio.Event  # set at the daemon's stop (api/core.py's)
    clock: Callable[[], float] = time.monotonic  # times every connection's deadlines
    connections: int = 0  # admitted and served now: a stop waits for them (each closes once idle)
    wakes: set[Wake] = field(default_factory=set)  # each served connection's: check_timeouts ends its wait

    async def client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection, admitted by the listener's admission or refused with an error event."""
        config, peer = self.live.config, _peer(writer)  # as the config is now: a reload bounds new connections
        bounds, admission = Bounds.of(config), self.admission
        refusal = (
            WyomingError("draining: new sessions go to another box", code="draining")
            if self.draining()
            else admission.refusal(peer, config.wyoming)
        )
        if refusal:
            try:
                with admission.refusing(config.wyoming) as linger:
                    await close_with_error(refusal, peer, reader, writer, bounds.write_s, linger, self.clock)
            finally:
                writer.close()
            return
        self.connections += 1
        wake = Wake()
        self.wakes.add(wake)
        try:
            with admission.held(peer):
                handler = self._handler(bounds, peer)
                await serve_client(handler, bounds, peer, reader, writer, self.stopping, self.clock, wake)
        finally:
            self.connections -= 1
            self.wakes.discard(wake)

    def _handler(self, bounds: Bounds, client: str) -> WyomingHandler:
        observe = lambda model, s: self.metrics.observe_live(model, "wyoming", s)  # noqa: E731
        return WyomingHandler(self.models, bounds.max_samples, self.budget, client, observe)
