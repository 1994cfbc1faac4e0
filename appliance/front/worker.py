"""A protocol worker's main (`python -m appliance.front.worker`, started by the engine process's
supervisor): the transports on the sockets it inherits, every request sent to the engine process.

It reads the same config files as the engine process, and re-reads them on SIGHUP; SIGTERM drains
it (no new connections; requests in flight and streaming sequences finish within the grace time).
It exits when the engine process goes away."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
import time
from pathlib import Path

from appliance import config as config_files
from appliance import signals
from appliance.config import Live, worker_count
from appliance.errors import ApplianceError
from appliance.front.channel import Channel, RemoteApi, RemoteTickets, WorkerReport
from appliance.logs import FIRMWARE_FIELD, configure_logging
from appliance.protocol import flow
from appliance.protocol.peers import Totals
from appliance.tasks import LOOP_LAG, freeze_start_up, run_loop, spawn
from appliance.transport.assembler import BodyBudget
from appliance.transport.budget_ledger import BudgetLedger
from appliance.transport.conncache import KernelCache, UserSpaceCache
from appliance.transport.h3_server import H3Server
from appliance.transport.listening import TRANSPORTS, Transports
from appliance.transport.serving import Serving

log = logging.getLogger("appliance.worker")

REPORT_INTERVAL_S = 1.0
STOP_MARGIN_S = 2.0
# A failpoint for tests, read from the environment only: while this file exists, every worker but the
# first holds its start (before it accepts), as one slow to import would; a stop signal ends the hold.
START_HOLD_FAILPOINT = "APPLIANCE_FAILPOINT_WORKER_START_HOLD"


class Worker:
    def __init__(self, args: argparse.Namespace, live: Live) -> None:
        self.args, self.live = args, live
        self.stopping = asyncio.Event()
        self.failed = False
        self.transports = Transports()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        signals.watch(loop, self.stopping.set, self.reload, self._deadline_s, self._overdue)
        await self._held_at_start()
        if self.stopping.is_set():  # stopped while starting: nothing accepted, nothing to drain
            return 0
        channel = await Channel.open(self.args.channel_fd)
        api = RemoteApi(channel, lambda: self.live.config.server.request_timeout_s)
        server_limits = lambda: self.live.config.server  # noqa: E731
        ledger_fd = self.args.ledger_fd
        ledger = BudgetLedger.attached(ledger_fd, self.args.slot + 1) if ledger_fd is not None else None
        budget = BodyBudget(server_limits, worker_count(server_limits()), ledger)  # held against the daemon's
        serving = Serving(api, self.live, budget, self._stop_on_failure, quic_port=self.args.quic_port)
        sockets = {name: socket.socket(fileno=fd) for name, fd in self.args.listen}
        if "quic" in sockets:
            settings = lambda: self.live.config.conncache  # noqa: E731
            backend, _, reason = self.args.conncache.partition(":")
            serving.cache = KernelCache.attached(settings) if backend == "ebpf" else UserSpaceCache(settings, reason)
            serving.worker_key, serving.tickets = self.args.worker_key, RemoteTickets(self.args.tickets_fd)
        await self.transports.serve(serving, sockets)
        tasks = [
            spawn(self._report(channel), f"worker {self.args.slot}'s report", self._stop_on_failure),
            spawn(LOOP_LAG.run(), "the event loop lag probe"),
        ]
        freeze_start_up()  # as the engine process does
        signals.allow_reloads()  # held since the engine spawned it (signals.py): one sent meanwhile applies now
        engine_gone = loop.create_task(self._receive(channel, api))
        stop = loop.create_task(self.stopping.wait())
        await asyncio.wait([engine_gone, stop], return_when=asyncio.FIRST_COMPLETED)
        if engine_gone.done():
            log.error("worker %d: the engine process is gone; exiting", self.args.slot)
            return 1
        self.transports.stop_accepting()
        await self._drain(api)
        for task in (*tasks, engine_gone):
            task.cancel()
        return 1 if self.failed else 0

    async def _held_at_start(self) -> None:
        named = os.environ.get(START_HOLD_FAILPOINT)
        if not (named and self.args.slot and Path(named).exists()):
            return
        log.warning("worker %d: start held by the test's failpoint (%s)", self.args.slot, named)
        while Path(named).exists() and not self.stopping.is_set():
            await asyncio.sleep(0.05)

    async def _receive(self, channel: Channel, api: RemoteApi) -> None:
        while (message := await channel.receive()) is not None:
            api.deliver(message)
        api.fail_all()

    async def _report(self, channel: Channel) -> None:
        """The heartbeat: in flight, connections, and the peers where the cache is in user space."""
        transports = self.transports
        h3 = transports.served.get("quic")
        assert h3 is None or isinstance(h3, H3Server)
        cache = h3.cache if h3 is not None else None
        peers = cache if isinstance(cache, UserSpaceCache) else None
        while True:
            held = flow.held()
            report = WorkerReport(
                slot=self.args.slot,
                pid=os.getpid(),
                in_flight=transports.in_flight,
                connections=transports.connections("unix"),
                tcp_connections=transports.connections("https"),
                quic_peers=sorted(c.peer for c in h3.connections) if h3 is not None else [],
                quic_datagrams=h3.datagrams if h3 is not None else 0,
                quic_stray_datagrams=h3.stray_datagrams if h3 is not None else 0,
                peers=peers.validated_peers() if peers is not None else None,
                droppers=peers.droppers() if peers is not None else None,
                totals=peers.totals() if peers is not None else Totals(),
                held_bytes=held.total,
                held_largest_bytes=held.largest,
                loop_lag_s=LOOP_LAG.last,
            )
            channel.send(("report", report))
            await asyncio.sleep(REPORT_INTERVAL_S)

    def _stop_on_failure(self, _: BaseException) -> None:
        """A task the worker cannot serve without died (logged): stop, and the supervisor starts a new one."""
        self.failed = True
        self.stopping.set()

    async def _drain(self, api: RemoteApi) -> None:
        deadline = time.monotonic() + self.live.config.server.shutdown_grace_s
        transports = self.transports
        while (transports.in_flight or transports.delivering or api.keep_connections()) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self.transports.close_all()

    def reload(self) -> None:
        try:
            new = config_files.load(self.args.config or None)
        except ApplianceError as exc:
            log.error("worker %d: reload failed, keeping the running config: %s", self.args.slot, exc)
            return
        self.live.config, reloaded, _ = config_files.apply_reload(self.live.config, new)
        logging.getLogger().setLevel(self.live.config.log.level.upper())
        if reloaded:  # the engine process reports what needs a restart
            log.info("worker %d: reload: applied %s", self.args.slot, ", ".join(reloaded))

    def _deadline_s(self) -> float:
        return self.live.config.server.shutdown_grace_s + STOP_MARGIN_S

    def _overdue(self, again: bool) -> None:
        why = "a second stop signal" if again else f"still running {self._deadline_s():.0f} s after the stop signal"
        log.error("worker %d: %s; exiting", self.args.slot, why)
        logging.shutdown()
        os._exit(1)


def _listen(text: str) -> tuple[str, int]:
    name, _, fd = text.partition("=")
    names = [n for n, transport in TRANSPORTS.items() if not transport.in_engine]  # the others need the models
    if name not in names or not fd.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: not NAME=FD with NAME one of {', '.join(names)}")
    return name, int(fd)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--channel-fd", type=int, required=True)
    parser.add_argument(
        "--listen", type=_listen, action="append", default=[], help="NAME=FD: serve transport NAME on socket FD"
    )
    parser.add_argument("--quic-port", type=int, help="where QUIC serves, for HTTPS's Alt-Svc")
    parser.add_argument("--worker-key", type=int)
    parser.add_argument("--tickets-fd", type=int)
    parser.add_argument("--ledger-fd", type=int, help="the byte budget's ledger (the engine's memfd)")
    parser.add_argument("--conncache", default="user:", help="ebpf (the engine's pins), or user:REASON")
    parser.add_argument("--firmware", default="-")
    parser.add_argument("--config", type=Path, action="append", default=[])
    args = parser.parse_args()
    try:
        config = config_files.load(args.config or None)
    except ApplianceError as exc:
        print(f"appliance worker {args.slot}: {exc}", file=sys.stderr)
        return 1
    configure_logging(config.log.level, f"appliance worker {args.slot}")
    FIRMWARE_FIELD.firmware = args.firmware
    return run_loop(Worker(args, Live(config)).run())


if __name__ == "__main__":
    sys.exit(main())
