"""The daemon: verify firmware, load engines, warm up, bind the socket, serve, reload, stop gracefully.

Start-up failures (bad config, a bundle that does not verify, a socket in use) log one line
naming the file and the reason, tell systemd in STATUS=, and exit with EXIT_START_FAILED.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import time
from pathlib import Path
from typing import Any

from appliance import config as config_files
from appliance import durable, exitcodes, firmware, signals, systemd
from appliance.api.core import Api, streaming
from appliance.api.fleet import BoxState, Capacity, agent_reply
from appliance.api.fleet_routes import GPU_ENGINES, DrainOrder
from appliance.config import Config, Live, worker_count
from appliance.daemon.agent import Agent
from appliance.daemon.listeners import Listeners, bind_unix_socket
from appliance.daemon.watchdog import Watchdog
from appliance.engine import cuda
from appliance.engine.heap import fix_mmap_threshold, trim_heap_forever
from appliance.engine.loop_first import keep_the_loop_first
from appliance.engine.stats import ModelStats
from appliance.errors import ApplianceError
from appliance.kinds import ServedModel, load_models
from appliance.logs import FIRMWARE_FIELD, configure_logging
from appliance.networks import Listening
from appliance.tasks import LOOP_LAG, arm_failpoints, freeze_start_up, run_loop, spawn
from appliance.tls import tls_identity
from appliance.transport.assembler import BodyBudget
from appliance.transport.budget_ledger import BudgetLedger
from appliance.transport.listening import open_listeners, remove_files, withdraw_announcements

log = logging.getLogger("appliance")

EXIT_START_FAILED = exitcodes.START_FAILED
EXIT_ABANDONED = 1  # stopped, but work was abandoned in a wedged engine
EXIT_TASK_FAILED = 1  # stopped because a task it needs crashed (logged)
EXPIRY_INTERVAL_S = 1.0
STATUS_INTERVAL_S = 5.0
ENGINE_STOP_S = 2.0  # after the grace time: how long a busy engine gets to finish its batch, at least
ENGINE_STOP_MAX_S = 10.0  # and at most (the grace time, this and the margin fit the unit's TimeoutStopSec)
STOP_MARGIN_S = 2.0  # after that: then the process exits, blocked or not
START_STEP_S = 600.0  # each step of the start (a model loaded, one warmed up) extends systemd's timeout this much
STOP_WHILE_STARTING_S = 1.0  # a stop during start-up: the process exits this soon, loading or not


class Daemon:
    def __init__(self, config: Config, config_paths: list[Path] | None) -> None:
        self.live, self.config_paths = Live(config), config_paths
        self.stopping = asyncio.Event()
        self.api: Api | None = None
        self.listeners: Listeners | None = None
        self.models: dict[str, ServedModel] = {}
        self.abandoned: list[str] = []  # models whose engine was still busy when the daemon stopped
        self.bound_socket: Path | None = None  # the socket file this daemon made, removed when it ends
        self.tasks: list[asyncio.Task[Any]] = []  # its background tasks while it serves
        self.failed = False  # a task it needs died: it stops and exits EXIT_TASK_FAILED
        self.listening: dict[str, Listening] = {}  # the listener table's sockets the config turns on (HTTPS, Wyoming)
        self.agent: Agent | None = None  # HAProxy's agent check, from the start of the start
        self.stopped_starting = False  # the stop signal came before anything was served: no drain

    @property
    def config(self) -> Config:
        return self.live.config

    # --- start ---
    async def start(self) -> None:
        config = self.config
        starting = durable.starting_marker(config.server.socket)
        with contextlib.suppress(OSError):  # only a hint for `call health`: a read-only /run goes without
            durable.make_directories(starting.parent)
            starting.write_text(f"{os.getpid()}\n")
        if config.fleet.agent_address:  # says "down" while the models load
            self.agent = Agent(config.fleet.agent_address, self._agent_reply)
        bundle = firmware.verify(config.firmware.bundle, config.firmware.trusted_keys)
        manifest = bundle.manifest
        config_files.check_model_names(config, {m.name for m in manifest.models})
        FIRMWARE_FIELD.firmware = f"{manifest.name} {manifest.version}"
        log.info("firmware %s %s verified (key %s)", manifest.name, manifest.version, manifest.signing_key_id)
        systemd.extend_start(START_STEP_S, "loading models")
        fix_mmap_threshold()
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
        # bodies where the transports run here, Realtime's buffers, Wyoming's recordings; with protocol workers
        # what they hold too, in the ledger they share
        workers = worker_count(config.server)
        ledger = BudgetLedger.create(workers) if workers > 1 else None
        budget = BodyBudget(lambda: self.live.config.server, workers, ledger)
        self.api = Api(manifest, self.models, self.live, budget)
        fleet = self.api.fleet
        fleet.busy, fleet.stop = self._under_way, self.stopping.set
        if any(engine in m.engine_name for m in self.models.values() for engine in GPU_ENGINES):
            fleet.gpu_memory = cuda.memory_used
        bind = lambda path: bind_unix_socket(dataclasses.replace(config.server, socket=path))  # noqa: E731
        sock, quic_sock = systemd.listen_sockets()
        if sock is None:
            sock = bind_unix_socket(config.server)
            self.bound_socket = config.server.socket
        if config.https.enabled or config.quic.enabled:  # /status and /tls/certificate.pem show who the box is
            self.api.certificate_pem, self.api.tls = tls_identity(config)
        self.listening = await open_listeners(config, bind)  # announced before they serve, as they have a port
        starting.unlink(missing_ok=True)  # `call health` says "starting" until here (an announcement takes seconds)
        sockets = {name: listening.sock for name, listening in self.listening.items()}
        self.listeners = Listeners(self.api, self.live, self.config_paths, self._fail)
        label = f"{manifest.name} {manifest.version}"
        await self.listeners.start({"unix": sock, **sockets}, quic_sock, workers, label)
        freeze_start_up()
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

    def status_text(self, rate: float | None = None) -> str:
        assert self.api is not None
        manifest = self.api.manifest
        engines = ", ".join(sorted({m.engine_name for m in self.models.values()}))
        text = f"firmware {manifest.name} {manifest.version}, engine {engines}"
        text += self.listeners.summary() if self.listeners is not None else ""
        return text if rate is None else f"{text}, {rate:.1f} req/s"

    # --- run ---
    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        overdue = functools.partial(exit_overdue, self)
        signals.watch(loop, self.stopping.set, self.reload, self._stop_deadline_s, overdue, self.drain)
        starting = loop.create_task(self.start())  # awaited below: its failure is a failed start, one line
        stop = spawn(self.stopping.wait(), "the stop signal")
        await asyncio.wait([starting, stop], return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()  # a stop during start-up: no need to finish warming up or starting workers
        try:
            await starting
            signals.allow_reloads()  # one held during the start is applied now
        except BaseException as exc:
            if not (isinstance(exc, asyncio.CancelledError) and self.stopping.is_set()):
                await abandon_start(self)
                raise
            if self.stopped_starting:
                log.info("stopped during start-up")
                await abandon_start(self)
            else:  # the workers that started already serve (Listeners.start): drained as at any stop
                log.info("stop signal while protocol workers were starting: draining what the started ones serve")
                await self.shutdown()
            return 0
        # idle sequences keep expiring while we drain, so a vanished client cannot hold the stop
        tasks = self.tasks = [
            spawn(self._expire_idle_sequences(), "the idle sequence expiry", self._fail),
            spawn(self._report_status(), "the status report", self._fail),
            spawn(LOOP_LAG.run(), "the event loop lag probe", self._fail),
            spawn(trim_heap_forever(), "the heap trim", self._fail),
            spawn(keep_the_loop_first(), "the loop's priority", self._fail),
        ]
        assert self.listeners is not None
        if (interval := systemd.watchdog_interval()) is not None:
            watchdog = Watchdog(self.models, self.listeners.unheard_workers)
            tasks.append(spawn(watchdog.run(interval), "the watchdog", self._fail))
        await stop
        await self.shutdown()  # which cancels the tasks
        return EXIT_TASK_FAILED if self.failed else 0

    def _fail(self, error: BaseException) -> None:
        """A task the daemon cannot serve without died (spawn logged it): stop, and exit non-zero so
        that systemd restarts the daemon. Liveness fails meanwhile."""
        self.failed = True
        if self.api is not None:
            self.api.fleet.broken = f"a task it needs crashed ({type(error).__name__}, logged); restarting"
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

    # --- in a fleet ---
    def drain(self) -> None:
        """SIGUSR2: refuse new work, let work under way finish within the grace time, hold."""
        if self.api is None or not self.api.started:
            log.info("SIGUSR2 during the start: nothing to drain")
            return
        self.api.fleet.start_drain(DrainOrder("hold", False, self.config.server.shutdown_grace_s))

    def _under_way(self) -> tuple[int, int]:
        return self.in_flight(), sum(len(m.sequences) for m in self.models.values())

    def _agent_reply(self) -> bytes:
        starting = BoxState(True, self.stopping.is_set(), False, Capacity())
        return agent_reply(self.api.fleet.state() if self.api is not None else starting)

    # --- reload ---
    def reload(self) -> None:
        """SIGHUP: re-read config, apply what can change live, report what needs a restart."""
        systemd.reloading()
        try:
            new = config_files.load(self.config_paths)
            config_files.check_model_names(new, set(self.models))
        except ApplianceError as exc:
            log.error("reload failed, keeping the running config: %s", exc)
            systemd.ready(f"{self.status_text()}; last reload failed: {exc}")
            return
        running, reloaded, restart = config_files.apply_reload(self.config, new)
        self.live.config = running  # every component reads its settings from here at its next use
        logging.getLogger().setLevel(running.log.level.upper())
        if self.api is not None:
            self.api.access.reload()  # the API key file, read again whether or not the config changed
        if reloaded or not restart:
            log.info("reload: applied %s", ", ".join(reloaded) or "nothing: no setting changed")
        if restart:
            log.warning("reload: %s changed but needs a restart to apply", ", ".join(restart))
        if self.listeners is not None and self.listeners.supervisor is not None:
            self.listeners.supervisor.reload()
        note = f"; needs restart for {', '.join(restart)}" if restart else ""
        systemd.ready(self.status_text() + note)

    # --- stop ---
    async def shutdown(self) -> None:
        """Stop accepting; let accepted requests and open sequences finish within the grace time."""
        assert self.api is not None and self.listeners is not None
        api, listeners = self.api, self.listeners
        live = lambda: sum(len(m.sequences) for m in self.models.values())  # noqa: E731
        log.info("stopping: %d requests in flight, %d sequences open", self.in_flight(), live())
        systemd.stopping(f"stopping: {self.in_flight()} requests in flight, {live()} sequences open")
        api.ready = False
        api.fleet.stopping = True
        api.stopping.set()  # a session only waiting for speech closes now (1001); work under way has the grace
        grace = self.config.server.shutdown_grace_s
        deadline = time.monotonic() + grace
        goodbyes = asyncio.ensure_future(withdraw_announcements(self.listening))  # as it stops accepting
        await listeners.stop_accepting(grace)
        await goodbyes
        drained = lambda: not (self.in_flight() or listeners.delivering or streaming(self.models.values()))  # noqa: E731
        while not drained() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if not drained():
            undelivered = f", {listeners.delivering} answers not all taken" if listeners.delivering else ""
            log.warning(
                "grace time over: %d requests%s and %d sequences abandoned", self.in_flight(), undelivered, live()
            )
        elif idle := live():
            log.info("stopping: %d idle sequences ended", idle)
        for task in self.tasks:  # drained: the expiry, the status and the rest must not outlive the listeners
            task.cancel()
        listeners.close()
        if self.agent is not None:
            self.agent.close()
        self.abandoned += await stop_models(self.models)
        self.remove_socket()
        log.info("stopped")

    def in_flight(self) -> int:  # requests under way, Wyoming's sessions among them (the signal thread reads it)
        return self.listeners.in_flight if self.listeners is not None else 0

    def remove_socket(self) -> None:
        if self.bound_socket is not None:
            self.bound_socket.unlink(missing_ok=True)
        remove_files(self.listening)

    def _stop_deadline_s(self) -> float:
        if self.api is None or not self.api.started:  # still starting: nothing is served yet, nothing to drain
            self.stopped_starting = True  # decided here, from the signal thread, once: run() abandons the start
            return STOP_WHILE_STARTING_S
        models = tuple(self.models.values())  # at once: the signal thread asks this
        engines_s = max((engine_stop_s(m.stats) for m in models), default=ENGINE_STOP_S)
        return self.config.server.shutdown_grace_s + engines_s + STOP_MARGIN_S


async def abandon_start(daemon: Daemon) -> None:
    """A start that failed, or a stop before anything was served: the listeners and workers go at once
    (what a worker that started had taken goes with it: the start failed), then the engines."""
    if daemon.listeners is not None:
        daemon.listeners.abort()
    if daemon.agent is not None:
        daemon.agent.close()
    await withdraw_announcements(daemon.listening)
    daemon.abandoned += await stop_models(daemon.models)
    daemon.remove_socket()  # a failed start leaves nothing a client could mistake for a daemon


def exit_overdue(daemon: Daemon, again: bool) -> None:
    """From the signal thread: a second stop signal (stop now), or the stop did not end in time, so the
    event loop itself is blocked (an engine call that never returns, run on the loop), or a stop came
    during start-up (models loading or warming up, the eBPF loader, the listeners: nothing served yet). Say
    what is lost and exit."""
    if daemon.stopped_starting:
        log.info("stopped during start-up, before anything was served (what was starting is abandoned)")
        logging.shutdown()
        os._exit(0)
    in_flight = daemon.in_flight()
    sequences = sum(len(m.sequences) for m in daemon.models.values())
    why = (
        "a second stop signal"
        if again
        else f"still running {daemon._stop_deadline_s():.0f} s after the stop signal (the event loop is blocked, "
        "an engine call is wedged)"
    )
    log.error("stopping: %s; abandoned %d requests in flight and %d open sequences, exiting", why, in_flight, sequences)
    logging.shutdown()
    os._exit(EXIT_ABANDONED if in_flight or sequences or daemon.abandoned or not again else 0)


async def stop_models(models: dict[str, ServedModel]) -> list[str]:
    """Each model's engine stopped; the names of those whose batch did not end in time (abandoned)."""
    abandoned = []
    for model in models.values():
        timeout_s = engine_stop_s(model.stats)
        if not await model.stop(timeout_s):
            abandoned.append(model.name)
            log.error(
                "stopping: the engine of model %s did not finish its batch within %.1f s (twice its longest "
                "call so far, %.0f to %.0f s: wedged); abandoned it",
                model.name,
                timeout_s,
                ENGINE_STOP_S,
                ENGINE_STOP_MAX_S,
            )
    return abandoned


def engine_stop_s(stats: ModelStats) -> float:
    """How long a stop waits for a model's engine call under way: twice its longest so far, within
    ENGINE_STOP_S and ENGINE_STOP_MAX_S. A call as long as those it has made is work, not a wedge (a
    batch of whole Whisper windows takes seconds on a slow CPU)."""
    return min(ENGINE_STOP_MAX_S, max(ENGINE_STOP_S, 2 * stats.longest_execution_ns / 1e9))


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
        code = run_loop(daemon.run())
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
