"""Good clients under attack against the same clients on a quiet daemon, in one run (issue 23). On a
daemon with two protocol workers, a client on the Unix socket and one over QUIC (from 127.0.0.3) each
alternate /v2/health/ready and a one-frame VAD infer, one every 20 ms, through these phases of
`seconds` each:

    quiet     nothing else
    qpack     8 QUIC peers sending QPACK bombs (a 4 KB entry referenced 16,000 times: 64 MB if
              expanded) until each is closed, then again
    headers   QUIC peers announcing 16 MB HEADERS frames, one after another
    flood     junk short-header datagrams from 127.0.0.2, as fast as one process sends them
    bodies    two local clients posting JSON nested 100,000 deep and a 60 MiB JSON list to infer

Each phase: the good clients' p50, p99 and max latency per transport, their failed requests, and the
daemon's CPU seconds (the engine and its workers).
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from aioquic.buffer import encode_uint_var
from aioquic.h3.connection import FrameType, encode_frame

from appliance.bench.attacks import ENTRY, attacker, bomb
from appliance.bench.conncache import FLOODER
from appliance.bench.daemon import DaemonProcess
from appliance.client import Call, Client, infer_call
from appliance.client.quic import QuicSession

PHASES = ("quiet", "qpack", "headers", "flood", "bodies")
PACE_S = 0.02


class GoodClients:
    """The Unix and QUIC clients, each timing its requests under the phase they were sent in:
    /v2/health/ready and a one-frame VAD infer in turn."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon, self.phase = daemon, "quiet"
        self.times: dict[tuple[str, str], list[float]] = {}
        self.failed: dict[tuple[str, str], int] = {}
        self.stopping = threading.Event()
        frame = np.zeros(512, np.float32)
        self.calls = [Call("GET", "/v2/health/ready"), infer_call("silero_vad", frame)]
        self.threads = [
            threading.Thread(target=self._unix, daemon=True),
            threading.Thread(target=lambda: asyncio.run(self._quic()), daemon=True),
        ]

    def __enter__(self) -> GoodClients:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        for thread in self.threads:
            thread.join(30)

    def _record(self, transport: str, phase: str, took: float, ok: bool) -> None:
        self.times.setdefault((transport, phase), []).append(took)
        if not ok:
            self.failed[(transport, phase)] = self.failed.get((transport, phase), 0) + 1

    def _unix(self) -> None:
        with Client(str(self.daemon.socket), timeout=30) as client:
            for i in range(1 << 62):
                if self.stopping.is_set():
                    return
                phase, started = self.phase, time.perf_counter()
                try:
                    ok = client.send(self.calls[i % 2]).status == 200
                except OSError:
                    ok = False
                self._record("unix", phase, time.perf_counter() - started, ok)
                time.sleep(PACE_S)

    async def _quic(self) -> None:
        session = QuicSession(self.daemon.quic, str(self.daemon.cert), local_host="127.0.0.3")
        try:
            for i in range(1 << 62):
                if self.stopping.is_set():
                    return
                phase, started = self.phase, time.perf_counter()
                try:
                    ok = (await asyncio.wait_for(session.send(self.calls[i % 2]), 30)).status == 200
                except (OSError, TimeoutError, ConnectionError):
                    ok = False
                self._record("quic", phase, time.perf_counter() - started, ok)
                await asyncio.sleep(PACE_S)
        finally:
            await session.close()


def until(seconds: float, attack: Callable[[], Any]) -> int:
    """`attack()` (an async one's coroutine, run here) again and again for `seconds`: how many times."""
    deadline, count = time.monotonic() + seconds, 0
    while time.monotonic() < deadline:
        result = attack()
        if asyncio.iscoroutine(result):
            asyncio.run(result)
        count += 1
    return count


async def qpack_bombs(daemon: DaemonProcess) -> None:
    async def one() -> None:
        async with attacker(daemon.quic, str(daemon.cert)) as a:
            await a.settings()
            await a.insert(b"x-bomb", ENTRY)
            while not a.closed.done():
                a.send_raw(encode_frame(FrameType.HEADERS, bomb(16_000)))
                await asyncio.wait([a.closed], timeout=0.05)

    await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), 30)


async def huge_headers(daemon: DaemonProcess) -> None:
    async with attacker(daemon.quic, str(daemon.cert)) as a:
        await a.settings()
        announced = encode_uint_var(FrameType.HEADERS) + encode_uint_var(16 << 20) + b"\0" * 60_000
        for _ in range(8):
            a.send_raw(announced, end_stream=False)
        await asyncio.sleep(0.2)


# made once: the bench's own good clients share this process, and building them is its work, not the box's
HOSTILE_BODIES = (
    b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"inputs": [' + b"0," * (30 << 20) + b"0]}",
)


def hostile_bodies(daemon: DaemonProcess) -> None:
    with Client(str(daemon.socket), timeout=60) as client:
        for body in HOSTILE_BODIES:
            client.send(Call("POST", "/v2/models/silero_vad/infer", body, (("content-type", "application/json"),)))


def hostile_bench(bundle: Path, trusted: Path, workdir: Path, seconds: float) -> dict[str, Any]:
    daemon = DaemonProcess(
        bundle, trusted, workdir, "peer_rate = 1000.0\npeer_burst = 2000.0\n", workers=2, label="hostile"
    )
    results: dict[str, Any] = {"workers": 2, "seconds": seconds, "phases": {}}
    try:
        with GoodClients(daemon) as good:
            for phase in PHASES:
                good.phase, cpu, attacks = phase, daemon.tree_cpu_s(), 0
                if phase == "quiet":
                    time.sleep(seconds)
                elif phase == "qpack":
                    attacks = until(seconds, lambda: qpack_bombs(daemon))
                elif phase == "headers":
                    attacks = until(seconds, lambda: huge_headers(daemon))
                elif phase == "flood":
                    port = daemon.quic.split(":")[1]
                    flooder = subprocess.run(
                        [sys.executable, "-c", FLOODER, port, str(seconds)], capture_output=True, text=True, check=True
                    )
                    attacks = int(flooder.stdout.split()[-1])
                else:
                    workers = [threading.Thread(target=until, args=(seconds, lambda: hostile_bodies(daemon)))]
                    workers.append(threading.Thread(target=until, args=(seconds, lambda: hostile_bodies(daemon))))
                    for worker in workers:
                        worker.start()
                    for worker in workers:
                        worker.join()
                    attacks = -1  # not counted across the two threads
                time.sleep(0.5)  # requests sent during the phase come back
                results["phases"][phase] = {
                    "attacks": attacks,
                    "daemon_cpu_s": round(daemon.tree_cpu_s() - cpu, 2),
                    **{
                        transport: latency(
                            good.times.get((transport, phase), []), good.failed.get((transport, phase), 0)
                        )
                        for transport in ("unix", "quic")
                    },
                }
    finally:
        daemon.stop()
    return results


def latency(times: list[float], failed: int) -> dict[str, Any]:
    ms = np.asarray(times) * 1e3 if times else np.zeros(1)
    return {
        "requests": len(times),
        "failed": failed,
        "p50_ms": round(float(np.percentile(ms, 50)), 1),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
    }


def report(r: dict[str, Any]) -> list[str]:
    quiet = r["phases"]["quiet"]
    lines = [
        f"  good clients under attack ({r['workers']} workers, {r['seconds']} s a phase; a request every 20 ms "
        "on each transport): p50 / p99 / max ms, failed; p99 against the quiet phase's"
    ]
    for phase, m in r["phases"].items():
        cells = []
        for transport in ("unix", "quic"):
            t, base = m[transport], quiet[transport]["p99_ms"] or 1.0
            cells.append(
                f"{transport} {t['p50_ms']} / {t['p99_ms']} / {t['max_ms']}, {t['failed']} of {t['requests']} failed "
                f"({t['p99_ms'] / base:.1f}x)"
            )
        sent = f", {m['attacks']} attacks" if m["attacks"] > 0 else ""
        lines.append(f"    {phase:8} {'; '.join(cells)}; daemon CPU {m['daemon_cpu_s']} s{sent}")
    return lines
