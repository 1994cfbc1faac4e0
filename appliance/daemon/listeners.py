"""Where the daemon serves: the transports of transport/listening.py's table in the engine process
(server.workers = 1), or in protocol worker processes that it supervises (more); the sockets they share;
what they hold at the stop."""

from __future__ import annotations

import grp
import logging
import os
import socket
import stat
from collections.abc import Callable
from pathlib import Path

from appliance import durable
from appliance.api.core import Api
from appliance.config import Config, Live, ServerConfig
from appliance.errors import ApplianceError
from appliance.front.quic_sockets import quic_sockets, worker_keys
from appliance.front.supervisor import Launch, QuicSlot, ReportedPeers, Supervisor
from appliance.transport.assembler import BodyBudget
from appliance.transport.conncache import ConnectionCache
from appliance.transport.conncache_choice import opened_cache
from appliance.transport.h3_server import quic_configuration
from appliance.transport.listening import TRANSPORTS, Transports
from appliance.transport.quic_guards import ClientCertificates
from appliance.transport.serving import EngineSide, Serving

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
    def __init__(
        self, api: Api, live: Live, config_paths: list[Path] | None, on_failure: Callable[[BaseException], None]
    ) -> None:
        """`on_failure`: a background task a transport needs died (server.workers = 1): the daemon stops."""
        self.api, self.live, self.config_paths, self.on_failure = api, live, config_paths, on_failure
        self.transports = Transports()  # this process's (every one where server.workers = 1)
        self.supervisor: Supervisor | None = None
        self.cache: ConnectionCache | None = None  # the QUIC listener's (all QUIC workers share its pins)
        self.quic_reason = ""  # why QUIC runs in one worker where more were asked for
        self.quic_slots: list[QuicSlot] = []  # the QUIC port's sockets, one per QUIC worker

    @property
    def config(self) -> Config:
        return self.live.config

    async def start(
        self, sockets: dict[str, socket.socket], quic_sock: socket.socket | None, workers: int, firmware_label: str
    ) -> None:
        """The transports of listening.py's table on `sockets` (by name; QUIC's apart): in this process
        where server.workers = 1, else in protocol worker processes that this process serves, but for
        those that serve the models themselves, which are served here."""
        api = self.api
        engine = EngineSide(api.models, api.metrics, lambda: api.fleet.order is not None, api.stopping)
        here = {name: sock for name, sock in sockets.items() if TRANSPORTS[name].in_engine}
        sockets = {name: sock for name, sock in sockets.items() if name not in here}
        quic_slots = self.quic_slots = await self._open_quic(quic_sock, workers) if self.config.quic.enabled else []
        if quic_sock is not None and not self.config.quic.enabled:
            log.warning("systemd passed a UDP socket but quic.enabled is false: not serving QUIC")
        quic_port = quic_slots[0].sock.getsockname()[1] if quic_slots else None
        budget = api.budget  # the transports', Realtime's and Wyoming's (with workers, its ledger theirs too)
        assert isinstance(budget, BodyBudget)
        serving = Serving(self.api, self.live, budget, self.on_failure, quic_port, self.cache, engine=engine)
        if workers == 1:
            await self.transports.serve(serving, here | sockets | ({"quic": quic_slots[0].sock} if quic_slots else {}))
            return
        await self.transports.serve(serving, here)
        cache = self.cache  # the workers attach to its pins (ebpf), or the one QUIC worker keeps its own table
        conncache = "user:" if cache is None else "ebpf" if cache.backend == "ebpf" else f"user:{cache.reason}"
        launch = Launch(sockets, conncache, firmware_label, quic_port, budget.ledger)
        self.supervisor = Supervisor(self.api, self.config_paths, launch, workers, quic_slots)
        self.api.workers = self.supervisor.status
        if self.cache is not None and self.cache.backend != "ebpf":
            # user space: the one QUIC worker keeps the table; the engine shows what it reports
            self.api.peer_table = ReportedPeers(self.supervisor, self.cache.reason)
        self.api.ready = True  # the models are warm: whatever a worker accepts is served (systemd hears READY later)
        try:
            await self.supervisor.start()
        except OSError as exc:
            raise ApplianceError(f"server.workers: {exc}") from None

    async def _open_quic(self, quic_sock: socket.socket | None, workers: int) -> list[QuicSlot]:
        """The QUIC port's sockets (one per QUIC worker, steered by the eBPF program where it loads) and
        the connection cache on them; the certificate checked here, so that a bad one fails the start."""
        config = self.config
        try:
            quic_configuration(config.quic)  # the files read here, so that a bad one is the start's one line
            ClientCertificates.of(config.quic.client_ca, config.quic.operator_ca)
            socks, self.quic_reason = quic_sockets(config.quic, quic_sock, workers)
            keys = worker_keys(len(socks))
            self.cache = await opened_cache(lambda: self.live.config.conncache, socks, keys if len(socks) > 1 else None)
        except (OSError, ValueError) as exc:
            raise _quic_start_error(config, quic_sock, exc) from None
        if len(socks) > 1 and self.cache.steering_reason:
            self.quic_reason = f"the steering program did not load: {self.cache.steering_reason}"
            for extra in socks[1:]:
                extra.close()
            socks = socks[:1]
        if workers == 1:
            self.quic_reason = "server.workers = 1: QUIC runs in the engine process"
        elif self.quic_reason:
            log.warning("quic: one QUIC worker (of %d): %s", workers, self.quic_reason)
        self.api.quic = {"workers": len(socks), "reason": self.quic_reason}
        self.api.peer_table = self.cache
        log.info(
            "quic: HTTP/3 on UDP port %d%s%s",
            socks[0].getsockname()[1],
            " (socket from systemd)" if quic_sock else "",
            f", read by {len(socks)} QUIC workers" if workers > 1 else "",
        )
        self._log_conncache()
        return [QuicSlot(s, k) for s, k in zip(socks, keys, strict=False)]

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
        return self.transports.in_flight + (self.supervisor.in_flight if self.supervisor else 0)

    @property
    def delivering(self) -> int:
        """Answers sent here but not all taken (HTTP/3): the drain waits for them (workers drain their own)."""
        return self.transports.delivering

    async def stop_accepting(self, grace_s: float) -> None:
        """This process's listeners close (Wyoming's where workers serve the rest); workers drain their own
        connections within the grace time."""
        self.transports.stop_accepting()
        if self.supervisor is not None:
            await self.supervisor.stop(grace_s + 1.0)

    def close(self) -> None:
        """Drained: every connection closed, the connection cache let go (with QUIC's listener, where it
        served here)."""
        self.transports.close_all()
        if self.cache is not None and "quic" not in self.transports.served:
            self.cache.close()

    def abort(self) -> None:
        """A failed start: the workers are killed at once; what was opened for them is closed."""
        if self.supervisor is not None:
            self.supervisor.abort()
        self.transports.stop_accepting()
        self.close()
        for slot in self.quic_slots:
            slot.sock.close()


def _quic_start_error(config: Config, quic_sock: socket.socket | None, exc: Exception) -> ApplianceError:
    where = "the UDP socket from systemd" if quic_sock else f"{config.quic.host}:{config.quic.port}"
    return ApplianceError(f"quic: cannot listen on {where} with {config.quic.certificate}: {exc}")
