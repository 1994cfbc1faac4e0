"""The engine process's side of the protocol workers: start them, answer their requests with the one
API core, restart one that dies, and stop them all.

Every worker accepts on the one Unix socket (systemd's, or the daemon's own) and on the one HTTPS TCP
socket where that is served, and, where QUIC is served across workers, reads its own UDP socket of the
SO_REUSEPORT group: each passed as `--listen NAME=FD`, served by transport/listening.py's table. The engine process keeps every socket open, so a restarted worker gets the same
ones back: a crash loses only that worker's connections, and datagrams for its QUIC connections wait in
its socket meanwhile. Sequences live in the engine process: a sequence opened through one worker
continues through any other."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from appliance import signals
from appliance.api.core import Api
from appliance.exitcodes import exit_text
from appliance.front.bodies import Body, discard, pack_body, packed, remove_leftovers, unpack_request
from appliance.front.channel import Channel, WorkerReport, serve_tickets
from appliance.front.sessions import EngineEnd, run_session, to_session
from appliance.protocol.flow import SendWindow, send_stream
from appliance.protocol.messages import Request, Response, error_response
from appliance.protocol.peers import Peer, Totals
from appliance.tasks import spawn
from appliance.transport.budget_ledger import BudgetLedger
from appliance.transport.quic_guards import TicketStore

log = logging.getLogger("appliance.workers")

STARTUP_S = 60.0  # a worker that has not reported by then failed to start
REPORT_STALE_S = 5.0  # a worker silent this long is wedged: the watchdog withholds its ping
RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0)  # by crashes in a row (within a minute)
KEEP_INTERVAL_S = 0.05  # while draining: how often the workers learn whether sequences still stream


@dataclass
class QuicSlot:
    sock: socket.socket
    key: int  # the first 4 bytes of this worker's connection IDs (the steering program's key)


@dataclass
class WorkerSlot:
    index: int
    quic: QuicSlot | None
    process: subprocess.Popen[bytes] | None = None
    channel: Channel | None = None
    report: WorkerReport | None = None
    heard: float = 0.0  # time.monotonic() of its last message
    reported: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: dict[int, asyncio.Task[None]] = field(default_factory=dict)  # its requests being served
    windows: dict[int, SendWindow] = field(default_factory=dict)  # its streams' bytes not yet credited back
    sessions: dict[int, EngineEnd] = field(default_factory=dict)  # its WebSocket sessions, by request
    crashes: list[float] = field(default_factory=list)
    restarts: int = 0
    last_exit: str = ""  # how its last process ended

    def status(self) -> dict[str, Any]:
        """/status's entry: the slot as its worker last reported, and how often it was replaced."""
        doc: dict[str, Any] = {"worker": self.index, "up": self.report is not None, "restarts": self.restarts}
        if self.report is not None:
            report = dataclasses.asdict(self.report)
            for internal in ("peers", "totals", "slot"):
                report.pop(internal)
            doc.update(report)
        return doc


@dataclass
class Launch:
    """What each protocol worker is started with besides its slot."""

    sockets: dict[str, socket.socket]  # by listening.py's name: the sockets every worker accepts on
    conncache: str  # "ebpf" (the engine's pins), or "user:REASON"
    firmware_label: str
    quic_port: int | None = None  # where QUIC serves, for HTTPS's Alt-Svc
    ledger: BudgetLedger | None = None  # what each process holds of the byte budget (a worker's slot: its index + 1)


class Supervisor:
    def __init__(
        self, api: Api, config_paths: list[Path] | None, launch: Launch, count: int, quic: list[QuicSlot]
    ) -> None:
        """`count` workers; the first len(`quic`) read a QUIC socket each."""
        self.api, self.config_paths, self.launch = api, config_paths, launch
        self.slots = [WorkerSlot(i, quic[i] if i < len(quic) else None) for i in range(count)]
        self.stopping = False
        self.tickets = TicketStore()  # QUIC session tickets, for every worker (0-RTT resumes anywhere)
        self._runners: list[asyncio.Task[None]] = []
        self._watcher: asyncio.Task[None] | None = None

    # --- start ---
    async def start(self) -> None:
        """Start every worker; return once each has reported (it accepts on its sockets)."""
        self._runners = [spawn(self._keep_running(s), f"the supervision of worker {s.index}") for s in self.slots]
        self._watcher = spawn(self._kill_wedged(), "the wedged-worker watch")
        deadline = time.monotonic() + STARTUP_S
        while not all(s.reported.is_set() for s in self.slots):
            failed = [s for s in self.slots if s.restarts and not s.reported.is_set()]
            if failed:
                raise OSError(f"protocol worker {failed[0].index} exited before serving: {failed[0].last_exit}")
            if time.monotonic() > deadline:
                silent = [str(s.index) for s in self.slots if not s.reported.is_set()]
                raise OSError(f"protocol worker {', '.join(silent)} did not start within {STARTUP_S:g} s")
            await asyncio.sleep(0.02)

    async def _keep_running(self, slot: WorkerSlot) -> None:
        while not self.stopping:
            code = await self._run_once(slot)
            if self.stopping:
                return
            now = time.monotonic()
            slot.crashes = [t for t in slot.crashes if now - t < 60.0] + [now]
            slot.restarts += 1
            slot.last_exit = exit_text(code)
            pause = RESTART_BACKOFF_S[min(len(slot.crashes), len(RESTART_BACKOFF_S)) - 1]
            log.error(
                "worker %d (pid %s) exited with %s; restarting it%s (the other workers keep serving)",
                slot.index,
                slot.process.pid if slot.process else "-",
                exit_text(code),
                f" in {pause:g} s" if pause else "",
            )
            await asyncio.sleep(pause)

    async def _run_once(self, slot: WorkerSlot) -> int:
        engine_end, worker_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        loop = asyncio.get_running_loop()
        launch = self.launch
        sockets = {**launch.sockets, **({"quic": slot.quic.sock} if slot.quic is not None else {})}
        fds = [worker_end.fileno(), *(sock.fileno() for sock in sockets.values())]
        args = [
            sys.executable,
            "-m",
            "appliance.front.worker",
            f"--slot={slot.index}",
            f"--channel-fd={worker_end.fileno()}",
            *(f"--listen={name}={sock.fileno()}" for name, sock in sockets.items()),
            f"--conncache={launch.conncache}",
            f"--firmware={launch.firmware_label}",
            *(f"--config={p}" for p in self.config_paths or []),
        ]
        args += [f"--quic-port={launch.quic_port}"] if launch.quic_port is not None else []
        if launch.ledger is not None:
            fds.append(launch.ledger.fd)
            args.append(f"--ledger-fd={launch.ledger.fd}")
        tickets: socket.socket | None = None  # the engine's end of a QUIC worker's ticket lookups
        tickets_worker: socket.socket | None = None
        if slot.quic is not None:
            tickets, tickets_worker = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            tickets.setblocking(False)
            loop.add_reader(tickets, serve_tickets, tickets, self.tickets)
            fds.append(tickets_worker.fileno())
            args += [f"--worker-key={slot.quic.key}", f"--tickets-fd={tickets_worker.fileno()}"]
        slot.heard = time.monotonic()  # a starting worker has until STARTUP_S from now to report (_kill_wedged)
        try:
            slot.process = signals.spawn_holding_reloads(args, fds)
        finally:
            worker_end.close()
            if tickets_worker is not None:
                tickets_worker.close()
        slot.channel = await Channel.open(engine_end.detach())
        try:
            await self._serve(slot, slot.channel)
        finally:
            slot.channel.close()
            slot.channel = None
            slot.report = None
            for task in slot.tasks.values():  # its clients are gone with it: nobody reads the answers
                task.cancel()
            slot.tasks.clear()
        code = await _exited(slot.process)
        if self.launch.ledger is not None:
            self.launch.ledger.clear(slot.index + 1)  # what it held for its clients went with it
        if tickets is not None:
            loop.remove_reader(tickets)
            tickets.close()
        remove_leftovers(str(slot.process.pid))
        remove_leftovers(f"{os.getpid()}.{slot.process.pid}")
        return code

    # --- serve one worker ---
    async def _serve(self, slot: WorkerSlot, channel: Channel) -> None:
        assert slot.process is not None
        owner = f"{os.getpid()}.{slot.process.pid}"  # the shared-memory bodies this process writes to it
        while (message := await channel.receive()) is not None:
            slot.heard = time.monotonic()
            kind = message[0]
            if kind == "request":
                _, rid, request, body = message
                task = spawn(
                    self._answer(slot, channel, owner, rid, request, body), f"request {rid} of worker {slot.index}"
                )
                slot.tasks[rid] = task
                task.add_done_callback(partial(_forget, slot.tasks, rid))
                task.add_done_callback(partial(_discard, body))
            elif kind == "credit":
                if (window := slot.windows.get(message[1])) is not None:
                    window.taken(message[2])
            elif kind in ("session_in", "session_ack"):
                to_session(slot.sessions, message)
            elif kind == "cancel":
                if (running := slot.tasks.get(message[1])) is not None:
                    running.cancel()
            elif kind == "end_opened":
                self.api.end_opened(message[1])
            elif kind == "still_open":
                channel.send(("open", message[1], await self.api.still_open(message[2])))
            elif kind == "report":
                if slot.report is None:
                    log.info("protocol worker %d (pid %d) serving", slot.index, slot.process.pid)
                slot.report = message[1]
                slot.reported.set()

    async def _answer(
        self, slot: WorkerSlot, channel: Channel, owner: str, rid: int, request: Request, body: Body
    ) -> None:
        """Answer one request; a streamed body moves by the worker's credit: the next piece is pulled
        from the engine side only once the worker's transport took all but a window of it."""
        stream: AsyncGenerator[bytes, None] | None = None
        answered = False
        window = slot.windows[rid] = SendWindow(self.api.live.config.server.stream_window_bytes)
        try:
            whole = await unpack_request(request, body)  # or the 500 where its body cannot be read
            response = whole if isinstance(whole, Response) else await self.api.handle(whole)
            response, body = await packed(response, owner)  # or the 500 where its body cannot cross
            stream, session = response.stream, response.session
            reply = dataclasses.replace(response, body=b"", stream=None, session=None)
            mode = "stream" if stream is not None else "session" if session is not None else ""
            channel.send(("response", rid, reply, body, mode, self.api.keep_connections()))
            answered = True
            if session is not None:
                await run_session(slot.sessions, channel, rid, session)
            if stream is None:
                return

            async def send(piece: bytes) -> int:  # held: what the worker has not given credit for
                channel.send(("chunk", rid, piece))
                window.add(len(piece))  # before any credit for it can come
                await channel.drain()
                return window.held

            await send_stream(stream, window, send)
        except Exception:  # not the API's errors (it answers those): ours, logged; the worker waits no longer
            log.exception("request %d of worker %d crashed", rid, slot.index)
            if not answered:
                failed = error_response(500, "internal error (logged)")
                channel.send(("response", rid, failed, pack_body(failed.body, owner), "", True))
        finally:
            window.close()
            slot.windows.pop(rid, None)
            if stream is not None:
                channel.send(("end", rid))  # also after a failure or a cancel: nobody waits for more

    # --- what the daemon asks ---
    def reports(self) -> list[WorkerReport]:
        return [s.report for s in self.slots if s.report is not None]

    def status(self) -> list[dict[str, Any]]:
        """/status's `workers`."""
        return [slot.status() for slot in self.slots]

    @property
    def in_flight(self) -> int:
        """Per worker, its last report or the requests the engine answers for it, whichever is more: the
        report counts those too (once it is sent: it comes every second)."""
        return sum(max(s.report.in_flight if s.report else 0, len(s.tasks)) for s in self.slots)

    def unheard(self) -> list[int]:
        """Workers not serving now: starting, restarting, or silent. The watchdog pings only when none is."""
        now = time.monotonic()
        return [s.index for s in self.slots if s.report is None or now - s.heard > REPORT_STALE_S]

    async def _kill_wedged(self) -> None:
        """A worker silent for REPORT_STALE_S has a blocked event loop: kill it, and it is restarted as
        if it had crashed, while the other workers keep serving. One not yet serving has STARTUP_S (on a
        loaded machine its imports alone can take seconds)."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for slot in self.slots:
                allowed = REPORT_STALE_S if slot.report is not None else STARTUP_S  # importing is not wedged
                if slot.channel is not None and slot.process is not None and now - slot.heard > allowed:
                    silent = now - slot.heard
                    log.error("worker %d (pid %d) silent for %.0f s: killing it", slot.index, slot.process.pid, silent)
                    with contextlib.suppress(ProcessLookupError):
                        slot.process.kill()
                    slot.heard = now  # killed once; its exit restarts it

    def pids(self) -> list[int]:
        return [s.process.pid for s in self.slots if s.process is not None and s.process.returncode is None]

    def signal_all(self, sig: signal.Signals) -> None:
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def reload(self) -> None:
        """SIGHUP reaches every worker: each re-reads the same config files and applies what it can."""
        self.signal_all(signal.SIGHUP)

    def abort(self) -> None:
        """A start that failed: the workers go at once."""
        self.stopping = True
        self.signal_all(signal.SIGKILL)

    async def stop(self, deadline_s: float) -> None:
        """SIGTERM: each worker stops accepting and drains its requests and streaming connections;
        those still running at the deadline are killed."""
        self.stopping = True
        if self._watcher is not None:
            self._watcher.cancel()  # a draining worker may be slow to report; the deadline below bounds it
        self.signal_all(signal.SIGTERM)
        deadline = time.monotonic() + deadline_s
        while self.pids() and time.monotonic() < deadline:
            keep = self.api.keep_connections()
            for slot in self.slots:
                if slot.channel is not None:
                    slot.channel.send(("keep", 0, keep))
            await asyncio.sleep(KEEP_INTERVAL_S)
        if self.pids():
            log.warning("workers %s still running at the deadline: killed", ", ".join(map(str, self.pids())))
            self.signal_all(signal.SIGKILL)
        await asyncio.gather(*self._runners, return_exceptions=True)


class ReportedPeers:
    """The QUIC peers where the workers keep the connection cache in user space, as each last reported:
    its validated peers and its last peers over budget (the unvalidated sources stay in the worker)."""

    backend = "user"

    def __init__(self, supervisor: Supervisor, reason: str) -> None:
        self.supervisor, self.reason = supervisor, reason

    def peers(self) -> dict[str, Peer]:
        return self.validated_peers()

    def validated_peers(self) -> dict[str, Peer]:
        return {k: v for r in self.supervisor.reports() if r.peers for k, v in r.peers.items()}

    def validated_count(self) -> int:
        return len(self.validated_peers())

    def droppers(self) -> dict[str, int]:
        return {k: v for r in self.supervisor.reports() if r.droppers for k, v in r.droppers.items()}

    def totals(self) -> Totals:
        return _sum_totals(r.totals for r in self.supervisor.reports())


def _sum_totals(totals: Iterable[Totals]) -> Totals:
    out = Totals()
    for t in totals:
        out = Totals(out.packets + t.packets, out.bytes + t.bytes, out.drops + t.drops, out.peers_seen + t.peers_seen)
    return out


async def _exited(process: subprocess.Popen[bytes]) -> int:
    """Wait for the worker's exit on a pidfd (readable once it exits): no child-watcher thread."""
    pidfd = os.pidfd_open(process.pid)
    loop = asyncio.get_running_loop()
    exited: asyncio.Future[None] = loop.create_future()

    def readable() -> None:
        if not exited.done():
            exited.set_result(None)

    loop.add_reader(pidfd, readable)
    try:
        await exited
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
    return process.wait()


def _discard(body: Body, _: asyncio.Task[None]) -> None:
    """A request's shared-memory body goes once its task ends, read or not (a cancel can come first)."""
    discard(body)


def _forget(tasks: dict[int, asyncio.Task[None]], rid: int, _: object) -> None:
    tasks.pop(rid, None)
