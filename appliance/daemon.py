"""The daemon: verify firmware, load engines, warm up, bind the socket, serve, reload, stop gracefully.

Start-up failures (bad config, a bundle that does not verify, a socket in use) log one line
naming the file and the reason, tell systemd in STATUS=, and exit with EXIT_START_FAILED.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import grp
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

from appliance import config as config_files
from appliance import durable, exitcodes, firmware, signals, systemd
from appliance.api import wyoming
from appliance.api.core import Api, streaming
from appliance.config import Config, Live, ServerConfig, worker_count
from appliance.errors import ApplianceError
from appliance.front.quic_sockets import quic_sockets, worker_keys
from appliance.front.supervisor import QuicSlot, ReportedPeers, Supervisor
from appliance.kinds import ServedModel, load_models
from appliance.logs import FIRMWARE_FIELD, configure_logging
from appliance.tasks import LOOP_LAG, arm_failpoints, spawn
from appliance.tls import tls_identity
from appliance.transport.assembler import BodyBudget
from appliance.transport.conncache import ConnectionCache, open_cache
from appliance.transport.h3 import H3Server
from appliance.transport.http1 import Http1Server
from appliance.transport.https import HttpsServer, listen_https

log = logging.getLogger("appliance")

EXIT_START_FAILED = exitcodes.START_FAILED
EXIT_ABANDONED = 1  # stopped, but work was abandoned in a wedged engine
EXIT_TASK_FAILED = 1  # stopped because a task it needs crashed (logged)
EXPIRY_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 5.0
ENGINE_STOP_S = 2.0  # after the grace time: how long a busy engine gets to finish its batch
STOP_MARGIN_S = ENGINE_STOP_S + 2.0  # after the grace time: then the process exits, blocked or not
START_STEP_S = 600.0  # each step of the start (a model loaded, one warmed up) extends systemd's timeout this much
STOP_WHILE_STARTING_S = 1.0  # a stop during start-up: the process exits this soon, loading or not


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


PROBE_SHARE = 0.02  # the most of its time an idle model spends on the watchdog's probes


class Daemon:
    def __init__(self, config: Config, config_paths: list[Path] | None) -> None:
        self.live, self.config_paths = Live(config), config_paths
        self.stopping = asyncio.Event()
        self.api: Api | None = None
        self.http: Http1Server | None = None
        self.h3: H3Server | None = None
        self.https: HttpsServer | None = None  # server.workers = 1: the TLS listener in this process
        self.https_listener: asyncio.base_events.Server | None = None
        self.supervisor: Supervisor | None = None
        self.cache: ConnectionCache | None = None  # the QUIC listener's (all QUIC workers share its pins)
        self.quic_reason = ""  # why QUIC runs in one worker where more were asked for
        self.models: dict[str, ServedModel] = {}
        self.abandoned: list[str] = []  # models whose engine was still busy when the daemon stopped
        self.bound_socket: Path | None = None  # the socket file this daemon made, removed when it ends
        self.tasks: list[asyncio.Task[Any]] = []  # its background tasks while it serves
        self.failed = False  # a task it needs died: it stops and exits EXIT_TASK_FAILED
        self.wyoming: wyoming.Listeners | None = None

    @property
    def config(self) -> Config:
        return self.live.config

    # --- start ---
    async def start(self) -> asyncio.base_events.Server | None:
        config = self.config
        starting = durable.starting_marker(config.server.socket)
        with contextlib.suppress(OSError):  # only a hint for `call health`: a read-only /run goes without
            durable.make_directories(starting.parent)
            starting.write_text(f"{os.getpid()}\n")
        bundle = firmware.verify(config.firmware.bundle, config.firmware.trusted_keys)
        manifest = bundle.manifest
        FIRMWARE_FIELD.firmware = f"{manifest.name} {manifest.version}"
        log.info("firmware %s %s verified (key %s)", manifest.name, manifest.version, manifest.signing_key_id)
        systemd.extend_start(START_STEP_S, "loading models")
        self.models = load_models(
            bundle, self.live, lambda name: systemd.extend_start(START_STEP_S, f"model {name} loaded; loading the next")
        )
        for model in self.models.values():
            systemd.extend_start(START_STEP_S, f"warming up model {model.name}")
            model.start()
            try:
                await model.probe()
            except ApplianceError:
                raise
            except Exception as exc:  # whatever the engine raises: a start that cannot serve, in one line
                first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
                raise ApplianceError(f"model {model.name}: warm-up inference failed: {first_line[:300]}") from None
            log.info("model %s loaded on %s and warmed up", model.name, model.engine_name)
        arm_failpoints()  # warmed up: a test's failpoints may fire from now on
        self.api = Api(manifest, self.models, self.live)
        bind = lambda path: bind_unix_socket(dataclasses.replace(config.server, socket=path))  # noqa: E731
        self.wyoming = await wyoming.start(config, bind, self.models, self.live, self.api.metrics)
        sock, quic_sock = systemd.listen_sockets()
        if sock is None:
            sock = bind_unix_socket(config.server)
            self.bound_socket = config.server.socket
        starting.unlink(missing_ok=True)
        if config.https.enabled or config.quic.enabled:  # /status and /tls/certificate.pem show who the box is
            self.api.certificate_pem, self.api.tls = tls_identity(config)
        tcp_sock = listen_https(config) if config.https.enabled else None
        workers = worker_count(config.server)
        if workers == 1:
            server = await self._serve_here(sock, quic_sock, tcp_sock)
        else:
            await self._start_workers(sock, quic_sock, tcp_sock, workers, f"{manifest.name} {manifest.version}")
            server = None
        self.api.ready = True
        where = str(sock.getsockname() or config.server.socket)
        log.info(
            "ready: serving %s on %s%s%s",
            ", ".join(self.models),
            where,
            "" if self.bound_socket else " (socket from systemd)",
            f" with {workers} protocol workers" if workers > 1 else "",
        )
        systemd.ready(self.status_text())
        return server

    async def _serve_here(
        self, sock: socket.socket, quic_sock: socket.socket | None, tcp_sock: socket.socket | None
    ) -> asyncio.base_events.Server:
        """server.workers = 1: the transports run in this process, on its event loop."""
        assert self.api is not None
        config = self.config
        budget = BodyBudget(lambda: self.live.config.server)  # one for both transports
        self.http = Http1Server(self.api, self.live, budget)
        server = await asyncio.get_running_loop().create_unix_server(self.http.protocol, sock=sock)
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
            self.https_listener = await self.https.start(tcp_sock)
        return server

    async def _start_workers(
        self,
        sock: socket.socket,
        quic_sock: socket.socket | None,
        tcp_sock: socket.socket | None,
        workers: int,
        firmware_label: str,
    ) -> None:
        """server.workers > 1: protocol worker processes run the transports; this process serves them."""
        assert self.api is not None
        config, quic_slots, conncache, quic_port = self.config, [], "user:", None
        if config.quic.enabled:
            try:
                socks, self.quic_reason = quic_sockets(config.quic, quic_sock, workers)
                keys = worker_keys(len(socks))
                self.cache = open_cache(lambda: self.live.config.conncache, socks, keys if len(socks) > 1 else None)
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

    def status_text(self, rate: float | None = None) -> str:
        assert self.api is not None
        manifest = self.api.manifest
        engines = ", ".join(sorted({m.engine_name for m in self.models.values()}))
        text = f"firmware {manifest.name} {manifest.version}, engine {engines}"
        if self.supervisor is not None:
            text += f", {len(self.supervisor.slots)} workers"
            text += f" (one QUIC worker: {self.quic_reason})" if self.quic_reason else ""
        if self.cache is not None:
            cache = self.cache
            text += f", conncache {cache.backend}" + (f" ({cache.reason})" if cache.reason else "")
        return text if rate is None else f"{text}, {rate:.1f} req/s"

    # --- run ---
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        signals.watch(loop, self.stopping.set, self.reload, self._stop_deadline_s, self._overdue)
        starting = loop.create_task(self.start())  # awaited below: its failure is a failed start, one line
        stop = spawn(self.stopping.wait(), "the stop signal")
        await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()  # a stop during start-up: no need to finish warming up
            log.info("stopped during start-up")
        try:
            server = await starting
            signals.allow_reloads()  # one held during the start is applied now
        except BaseException as exc:
            if self.supervisor is not None:
                self.supervisor.abort()
            await self._stop_models()
            self._remove_socket()  # a failed start leaves nothing a client could mistake for a daemon
            if isinstance(exc, asyncio.CancelledError) and self.stopping.is_set():
                return 0
            raise
        # idle sequences keep expiring while we drain, so a vanished client cannot hold the stop
        tasks = self.tasks = [
            spawn(self._expire_idle_sequences(), "the idle sequence expiry", self._fail),
            spawn(self._report_status(), "the status report", self._fail),
            spawn(LOOP_LAG.run(), "the event loop lag probe", self._fail),
        ]
        if self.h3 is not None:
            tasks.append(spawn(self.h3.sweep_connection_cache(), "the connection cache sweep", self._fail))
        if (interval := systemd.watchdog_interval()) is not None:
            tasks.append(spawn(self._watchdog(interval), "the watchdog", self._fail))
        await stop
        if self.failed:
            await self.shutdown(server)
            return EXIT_TASK_FAILED
        await self.shutdown(server)
        for task in tasks:
            task.cancel()
        return 0

    def _fail(self, _: BaseException) -> None:
        """A task the daemon cannot serve without died (spawn logged it): stop, and exit non-zero so
        that systemd restarts the daemon."""
        self.failed = True
        self.stopping.set()

    async def _expire_idle_sequences(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            for model in self.models.values():
                if count := model.expire_idle():
                    log.info("model %s: %d idle sequences expired", model.name, count, extra={"MODEL": model.name})

    async def _report_status(self) -> None:
        assert self.api is not None
        last_count, last_time = self.api.metrics.total_requests, time.monotonic()
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            count, now = self.api.metrics.total_requests, time.monotonic()
            systemd.status(self.status_text((count - last_count) / (now - last_time)))
            last_count, last_time = count, now

    async def _watchdog(self, interval: float) -> None:
        """Ping only when every engine proved itself lately: a wedged engine stops the pings.

        A model proves itself by completing engine calls for requests, or else by a probe (a real
        inference). A heavy model's probe (Whisper: a 30 s window) is run at most PROBE_SHARE of the
        time, so an idle box does not spend a core on proofs; a cheap one (the VAD) runs every interval."""
        log.info("watchdog: probing the engines every %.2f s at the most", interval)
        proven: dict[str, tuple[float, int]] = {}  # model -> (when it last proved itself, its executions then)
        cost: dict[str, float] = {}  # model -> how long its last probe took
        while True:
            started = time.monotonic()
            due = []
            for name, model in self.models.items():
                when, executions = proven.get(name, (0.0, -1))
                if model.stats.execution_count != executions and executions >= 0:
                    proven[name] = (started, model.stats.execution_count)  # requests ran on it since
                elif started - when >= max(interval, cost.get(name, 0.0) / PROBE_SHARE):
                    due.append(name)
            if self.supervisor is not None and (unheard := self.supervisor.unheard()):
                log.error("watchdog: protocol workers %s are not serving (restarting); withholding the ping", unheard)
                await asyncio.sleep(interval)
                continue
            try:
                await asyncio.wait_for(asyncio.gather(*(self._probe(n, cost, proven) for n in due)), interval)
            except TimeoutError:
                log.error("watchdog: an engine did not complete a probe within %.2f s; withholding the ping", interval)
                continue  # the probes stay queued: a recovering engine answers them and pings resume
            except ApplianceError as exc:
                log.error("watchdog: %s; withholding the ping", exc)
            else:
                systemd.watchdog_ping()
            await asyncio.sleep(max(0.0, interval - (time.monotonic() - started)))

    async def _probe(self, name: str, cost: dict[str, float], proven: dict[str, tuple[float, int]]) -> None:
        model, started = self.models[name], time.monotonic()
        await model.probe()
        done = time.monotonic()
        cost[name] = done - started
        proven[name] = (done, model.stats.execution_count)

    # --- reload ---
    def reload(self) -> None:
        """SIGHUP: re-read config, apply what can change live, report what needs a restart."""
        systemd.reloading()
        try:
            new = config_files.load(self.config_paths)
        except ApplianceError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            systemd.ready(f"{self.status_text()}; last reload failed: {exc}")
            return
        running, reloaded, restart = config_files.apply_reload(self.config, new)
        self.live.config = running  # every component reads its settings from here at its next use
        logging.getLogger().setLevel(running.log.level.upper())
        if reloaded or not restart:
            log.info("reload: applied %s", ", ".join(reloaded) or "nothing: no setting changed")
        if restart:
            log.warning("reload: %s changed but needs a restart to apply", ", ".join(restart))
        if self.supervisor is not None:
            self.supervisor.reload()
        note = f"; needs restart for {', '.join(restart)}" if restart else ""
        systemd.ready(self.status_text() + note)

    # --- stop ---
    async def shutdown(self, server: asyncio.base_events.Server | None) -> None:
        """Stop accepting; let accepted requests and open sequences finish within the grace time."""
        assert self.api is not None
        api = self.api
        live = lambda: sum(len(m.sequences) for m in self.models.values())  # noqa: E731
        log.info("stopping: %d requests in flight, %d sequences open", self._in_flight(), live())
        systemd.stopping(f"stopping: {self._in_flight()} requests in flight, {live()} sequences open")
        api.ready = False
        api.draining = True
        grace = self.config.server.shutdown_grace_s
        deadline = time.monotonic() + grace
        if self.supervisor is not None:  # each worker drains its own connections within the grace time
            await self.supervisor.stop(grace + 1.0)
        for listener in (server, self.https_listener):
            if listener is not None:
                listener.close()
        if self.wyoming is not None:
            await self.wyoming.close()
        while (self._in_flight() or streaming(self.models.values())) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self._in_flight() or streaming(self.models.values()):
            log.warning("grace time over: %d requests and %d sequences abandoned", self._in_flight(), live())
        elif idle := live():
            log.info("stopping: %d idle sequences ended", idle)
        for task in self.tasks:  # drained: the sweep and the rest must not outlive the sockets they read
            task.cancel()
        for http in (self.http, self.https):
            if http is not None:
                http.close_all()
        if self.h3 is not None:
            self.h3.close()
        elif self.cache is not None:
            self.cache.close()
        await self._stop_models()
        self._remove_socket()
        log.info("stopped")

    def _in_flight(self) -> int:
        in_flight = sum(t.in_flight for t in (self.http, self.h3, self.https) if t is not None)
        return in_flight + (self.supervisor.in_flight if self.supervisor else 0)

    def _remove_socket(self) -> None:
        for path in (self.bound_socket, self.wyoming.path if self.wyoming else None):
            if path is not None:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()

    def _stop_deadline_s(self) -> float:
        if self.api is None or not self.api.ready:  # still starting: nothing is served yet, nothing to drain
            return STOP_WHILE_STARTING_S
        return self.config.server.shutdown_grace_s + STOP_MARGIN_S

    def _overdue(self) -> None:
        """From the signal thread: the stop did not end in time, so the event loop itself is blocked
        (an engine call that never returns, run on the loop), or a stop came while models were still
        loading or warming up (nothing served yet). Say what is lost and exit."""
        if self.api is None or not self.api.ready:
            log.info("stopped during start-up (models were loading or warming up)")
            logging.shutdown()
            os._exit(0)
        in_flight = self._in_flight()
        sequences = sum(len(m.sequences) for m in self.models.values())
        log.error(
            "stopping: still running %.0f s after the stop signal (the event loop is blocked, an engine "
            "call is wedged); abandoned %d requests in flight and %d open sequences, exiting",
            self._stop_deadline_s(),
            in_flight,
            sequences,
        )
        logging.shutdown()
        os._exit(EXIT_ABANDONED)

    async def _stop_models(self) -> None:
        for model in self.models.values():
            if not await model.stop(ENGINE_STOP_S):
                self.abandoned.append(model.name)
                log.error(
                    "stopping: the engine of model %s did not finish its batch within %.0f s (wedged); abandoned it",
                    model.name,
                    ENGINE_STOP_S,
                )


def _quic_start_error(config: Config, quic_sock: socket.socket | None, exc: Exception) -> ApplianceError:
    where = "the UDP socket from systemd" if quic_sock else f"{config.quic.host}:{config.quic.port}"
    return ApplianceError(f"quic: cannot listen on {where} with {config.quic.certificate}: {exc}")


def run(config_paths: list[Path] | None) -> int:
    """`appliance run`: load the config, serve until stopped; the exit code for systemd."""
    try:
        config = config_files.load(config_paths)
    except ApplianceError as exc:
        configure_logging("info")
        return _start_failed(exc)
    configure_logging(config.log.level)
    daemon = Daemon(config, config_paths)
    try:
        code = asyncio.run(daemon.run())
    except ApplianceError as exc:
        code = _start_failed(exc)
    if daemon.abandoned:  # the interpreter's exit would join the wedged engine thread forever
        logging.shutdown()
        os._exit(EXIT_ABANDONED)
    return code


def _start_failed(exc: ApplianceError) -> int:
    log.error("start failed: %s", exc)
    systemd.status(f"start failed: {exc}")
    return EXIT_START_FAILED
