"""The listener table: every transport the daemon serves, by the name its socket carries from the engine
process to a protocol worker (`--listen NAME=FD`) and that Request.listener says. The engine process
(server.workers = 1) and each worker serve the table alike, so adding a transport is its module (a
sans-I/O codec and a pump with a `serve`, and the `open` that makes its socket from the config) and
one line here. A transport that serves the models themselves (Wyoming) is served by the engine process
whatever server.workers."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from appliance.config import Config
from appliance.networks import Bind, Listening
from appliance.transport.h3_server import H3Server
from appliance.transport.http1 import Http1Server
from appliance.transport.https import HttpsServer, open_https
from appliance.transport.serving import Served, Serving
from appliance.transport.wyoming_server import WyomingServer


@dataclass(frozen=True)
class Transport:
    serve: Callable[[Serving, socket.socket], Awaitable[Served]]
    in_engine: bool = False  # it serves the models themselves (Serving.engine): the engine process runs it
    # its socket made from the config at the start, announced where it is (None where the config turns it
    # off); the API's Unix socket and QUIC's are the daemon's own, as systemd may hand them over
    open: Callable[[Config, Bind], Awaitable[Listening | None]] | None = None


TRANSPORTS: dict[str, Transport] = {
    "unix": Transport(Http1Server.serve),  # HTTP/1.1 and WebSocket for on-box apps
    "https": Transport(HttpsServer.serve, open=open_https),  # the same over TLS on TCP, for the LAN
    "quic": Transport(H3Server.serve),  # HTTP/3 and its WebSockets, for the LAN
    # Home Assistant's, beside the API socket; and the same for the LAN (wyoming.allow)
    "wyoming": Transport(WyomingServer.serve_unix, in_engine=True, open=lambda c, b: _open_wyoming("unix", c, b)),
    "wyoming-tcp": Transport(WyomingServer.serve_tcp, in_engine=True, open=lambda c, b: _open_wyoming("tcp", c, b)),
}


async def _open_wyoming(kind: str, config: Config, bind: Bind) -> Listening | None:
    """Wyoming's sockets and announcement: imported where they are opened, the engine process (a protocol
    worker loads no zeroconf)."""
    from appliance.api.wyoming import open_tcp, open_unix

    return await (open_unix if kind == "unix" else open_tcp)(config, bind)


async def open_listeners(config: Config, bind: Bind) -> dict[str, Listening]:
    """The sockets of the table's entries that the config turns on, by name; where one cannot be made,
    those made are undone and the start fails."""
    made: dict[str, Listening] = {}
    try:
        for name, transport in TRANSPORTS.items():
            if transport.open is not None and (listening := await transport.open(config, bind)) is not None:
                made[name] = listening
    except BaseException:
        for listening in made.values():
            listening.sock.close()
        await withdraw_announcements(made)
        remove_files(made)
        raise
    return made


async def withdraw_announcements(made: dict[str, Listening]) -> None:
    """Their announcements withdrawn on the LAN, zeroconf's goodbye (as the daemon stops accepting)."""
    await asyncio.gather(*(listening.goodbye() for listening in made.values() if listening.goodbye is not None))


def remove_files(made: dict[str, Listening]) -> None:
    """Their socket files removed (the daemon ends)."""
    for listening in made.values():
        if listening.path is not None:
            listening.path.unlink(missing_ok=True)


class Transports:
    """The transports one process serves, on the sockets it was given."""

    def __init__(self) -> None:
        self.served: dict[str, Served] = {}
        # each is done once: a failed start cleans up what it started, and the daemon's abort asks again
        self._accepting = self._open = True

    async def serve(self, serving: Serving, sockets: dict[str, socket.socket]) -> None:
        """Serve each socket by its name; where one cannot start, those started are closed again."""
        try:
            for name, sock in sockets.items():
                self.served[name] = await TRANSPORTS[name].serve(serving, sock)
        except BaseException:
            self.stop_accepting()
            self.close_all()
            raise

    def connections(self, name: str) -> int:
        return len(self.served[name].connections) if name in self.served else 0

    @property
    def in_flight(self) -> int:
        return sum(served.in_flight for served in self.served.values())

    @property
    def delivering(self) -> int:
        """Connections whose answers are not all taken yet: a drain waits for them too."""
        return sum(served.delivering for served in self.served.values())

    def stop_accepting(self) -> None:
        if self._accepting:
            self._accepting = False
            for served in self.served.values():
                served.stop_accepting()

    def close_all(self) -> None:
        if self._open:
            self._open = False
            for served in self.served.values():
                served.close_all()
