"""Where the daemon serves: the transports in the engine process (server.workers = 1), or protocol
worker processes that it supervises (more); the sockets they share; what they hold at the stop."""

from __future__ import annotations

import asyncio
import grp
import logging
import os
import socket
import stat
from pathlib import Path

from appliance import durable
from appliance.api.core import Api
from appliance.config import Config, Live, ServerConfig
from appliance.errors import ApplianceError
from appliance.front.quic_sockets import quic_sockets, worker_keys
from appliance.front.supervisor import QuicSlot, ReportedPeers, Supervisor
from appliance.transport.assembler import BodyBudget
from appliance.transport.conncache import ConnectionCache
from appliance.transport.conncache_choice import opened_cache
from appliance.transport.h3 import H3Server
from appliance.transport.http1 import Http1Server
from appliance.transport.https import HttpsServer
from appliance.transport.tls_accept import TlsAcceptor

log = logging.getLogger("appliance")


def bind_unix_socket(server: ServerConfig) -> socket.socket:
    path = server.socket
    durable.make_directories(path.parent)  # 0755 whatever the umask
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ApplianceError(f"{path}: exists and is not a socket; refusing to replace it")
        probe_socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe_socket.connect(str(path))
            raise ApplianceError(f"{path}: another daemon is already serving on this socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale socket of a daemon that died
        finally:
            probe_socket.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, int(server.socket_mode, 8))
    if server.socket_group:
        try:
            os.chown(path, -1, grp.getgrnam(server.socket_group).gr_gid)
        except KeyError:
            sock.close()
            path.unlink()
            raise ApplianceError(f"server.socket_group: no group named {server.socket_group!r}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Listeners:
    def __init__(self, api: Api, live: Live, config_paths: list[Path] | None) -> None:
        self.api, self.live, self.config_paths = api, live, config_paths
        self.http: Http1Server | None = None
        self.h3: H3Server | None = None
        self.https: HttpsServer | None = None  # server.workers = 1: the TLS listener in this process
        self.servers: list[asyncio.base_events.Server | TlsAcceptor] = []  # this process's listeners (workers = 1)
        self.supervisor: Supervisor | None = None
        self.cache: ConnectionCache | None = None  # the QUIC listener's (all QUIC workers share its pins)
        self.quic_reason = ""  # why QUIC runs in one worker where more were asked for

    @property
    def config(self) -> Config:
        return self.live.config

    async def serve_here(
        self, sock: socket.socket, quic_sock: socket.socket | None, tcp_sock: socket.socket | None
    ) -> None:
        """server.workers = 1: the transports run in this process, on its event loop."""
        config = self.config
        budget = self.api.budget  # one for both transports and the Realtime sessions' buffers
        assert isinstance(budget, BodyBudget)
        self.http = Http1Server(self.api, self.live, budget)
        self.servers.append(await asyncio.get_running_loop().create_unix_server(self.http.protocol, sock=sock))
        if config.quic.enabled:
            try:
                self.h3 = H3Server(self.api, self.live, budget)
                await self.h3.start(quic_sock)
            except (OSError, ValueError) as exc:
                raise _quic_start_error(config, quic_sock, exc) from None
            log.info("quic: HTTP/3 on UDP port %d%s", self.h3.port, " (socket from systemd)" if quic_sock else "")
            self.api.peer_table = self.cache = self.h3.cache
            self.api.quic = {"workers": 1, "reason": "server.workers = 1: QUIC runs in the engine process"}
            self._log_conncache()
        elif quic_sock is not None:
            log.warning("systemd passed a UDP socket but quic.enabled is false: not serving QUIC")
        if tcp_sock is not None:
            self.https = HttpsServer(self.api, self.live, budget, self.h3.port if self.h3 else None)
            self.servers.append(await self.https.start(tcp_sock))

    async def start_workers(
        self,
        sock: socket.socket,
        quic_sock: socket.socket | None,
        tcp_sock: socket.socket | None,
        workers: int,
        firmware_label: str,
    ) -> None:
        """server.workers > 1: protocol worker processes run the transports; this process serves them."""
        config, quic_slots, conncache, quic_port = self.config, [], "user:", None
        if config.quic.enabled:
            try:
                socks, self.quic_reason = quic_sockets(config.quic, quic_sock, workers)
                keys = worker_keys(len(socks))
                self.cache = await opened_cache(
                    lambda: self.live.config.conncache, socks, keys if len(socks) > 1 else None
                )
            except (OSError, ValueError) as exc:
                raise _quic_start_error(config, quic_sock, exc) from None
            if len(socks) > 1 and self.cache.steering_reason:
                self.quic_reason = f"the steering program did not load: {self.cache.steering_reason}"
                for extra in socks[1:]:
                    extra.close()
                socks = socks[:1]
            if self.quic_reason:
                log.warning("quic: one QUIC worker (of %d): %s", workers, self.quic_reason)
            quic_slots = [QuicSlot(s, k) for s, k in zip(socks, keys, strict=False)]
            self.api.quic = {"workers": len(socks), "reason": self.quic_reason}
            quic_port = socks[0].getsockname()[1]
            log.info(
                "quic: HTTP/3 on UDP port %d%s, read by %d QUIC workers",
                quic_port,
                " (socket from systemd)" if quic_sock else "",
                len(socks),
            )
            self._log_conncache()
            # user space: the one QUIC worker keeps the table; the engine shows what it reports
            conncache = "ebpf" if self.cache.backend == "ebpf" else f"user:{self.cache.reason}"
        elif quic_sock is not None:
            log.warning("systemd passed a UDP socket but quic.enabled is false: not serving QUIC")
        self.supervisor = Supervisor(
            self.api, self.config_paths, sock, quic_slots, workers, conncache, firmware_label, tcp_sock, quic_port
        )
        self.api.workers = self.supervisor.status
        if self.cache is not None:
            self.api.peer_table = (
                self.cache if self.cache.backend == "ebpf" else ReportedPeers(self.supervisor, self.cache.reason)
            )
        self.api.ready = True  # the models are warm: whatever a worker accepts is served (systemd hears READY later)
        try:
            await self.supervisor.start()
        except OSError as exc:
            raise ApplianceError(f"server.workers: {exc}") from None

    def _log_conncache(self) -> None:
        cache, config = self.cache, self.config
        assert cache is not None
        log.info(
            "conncache: %s backend, up to %d peers, %g packets/s per peer (burst %g)",
            cache.backend,
            config.conncache.max_entries,
            config.conncache.peer_rate,
            config.conncache.peer_burst,
        )

    def summary(self) -> str:
        """The workers and the connection cache, for systemd's STATUS= line."""
        text = ""
        if self.supervisor is not None:
            text += f", {len(self.supervisor.slots)} workers"
            text += f" (one QUIC worker: {self.quic_reason})" if self.quic_reason else ""
        if self.cache is not None:
            cache = self.cache
            text += f", conncache {cache.backend}" + (f" ({cache.reason})" if cache.reason else "")
        return text

    def unheard_workers(self) -> list[int]:
        return self.supervisor.unheard() if self.supervisor is not None else []

    @property
    def in_flight(self) -> int:
        in_flight = sum(t.in_flight for t in (self.http, self.h3, self.https) if t is not None)
        return in_flight + (self.supervisor.in_flight if self.supervisor else 0)

    async def stop_accepting(self, grace_s: float) -> None:
        """Workers drain their own connections within the grace time; this process's listeners close."""
        if self.supervisor is not None:
            await self.supervisor.stop(grace_s + 1.0)
        for server in self.servers:
            server.close()

    def close(self) -> None:
        """Drained: every connection closed, the connection cache let go."""
        for http in (self.http, self.https):
            if http is not None:
                http.close_all()
        if self.h3 is not None:
            self.h3.close()
        elif self.cache is not None:
            self.cache.close()

    def abort(self) -> None:
        """A failed start: the workers are killed at once."""
        if self.supervisor is not None:
            self.supervisor.abort()


def _quic_start_error(config: Config, quic_sock: socket.socket | None, exc: Exception) -> ApplianceError:
    where = "the UDP socket from systemd" if quic_sock else f"{config.quic.host}:{config.quic.port}"
    return ApplianceError(f"quic: cannot listen on {where} with {config.quic.certificate}: {exc}")
