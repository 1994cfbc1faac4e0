"""The event loop kept free (issue 42): a client on the Unix socket asks /v2/health/ready every 20 ms,
timed, while each piece of work that once ran on the daemon's event loop runs back to back, on a daemon
whose transports are in the engine process (server.workers = 1: the loop that answers the health check
is the one that takes the work). Phases of `seconds` each:

    quiet        nothing else
    language     language ID over 65,536 texts in one infer, its bound (fastText, off the loop past 64 texts)
    language-json  the same as JSON both ways (Triton's default without the binary extension): 65,536
                 strings read and 65,536 texts and confidences written as JSON, on threads
    bodies       a JSON infer body nested 100,000 deep and a 60 MiB JSON list (parsed off the loop)
    whisper      20 s of speech transcribed by the largest Whisper, one after another: no work on the loop,
                 but its threads take every core (the loop's thread against them for a core)
    realtime-events  a Realtime session's events of 99,000 strings each (under the WebSocket's 1 MiB and
                 the JSON reader's 100,000 values), read off the loop, each answered with an error event
    peer-walk    the QUIC listener's validated-peer table (the eBPF map) full, 65,536 peers each seen at
                 the phase's start: the sweep walks it in a thread every second (0.7 to 0.8 s of bpf()
                 calls); where the kernel backend did not load, the phase is left out and says so
    live-bytes   a live stream's 2 s chunks sent as encoded WAV files (BYTES), decoded off the loop
    bodies-2-workers  the same bodies on a daemon with server.workers = 2: each crosses from the worker
                 that reads it to the engine through shared memory (copied on threads), and the health
                 check is a worker's

Each phase: the health check's p50, p99 and max latency, its failed requests, the work done, the
daemon's CPU seconds, the engine's own loop lags over 10 ms (its /metrics histogram) and how long the
loop's thread waited for a core. The health check is timed from a process of its own: in the bench's
process, the work's client (a 60 MiB body made and sent, 65,536 texts encoded) held its GIL for tens
of milliseconds, which the check's timing took for the daemon's. On 2 cores the work's threads
contend with the loop for the CPU and the GIL: a phase's latency is that contention and any stall
together.
"""

from __future__ import annotations

import json
import multiprocessing
import socket
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.audio import encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.hostile import PACE_S, hostile_bodies, latency, until
from appliance.bench.measure import loop_lags
from appliance.bench.transcription import RATE, speech
from appliance.client import Call, Client, tensors_call
from appliance.config import ConnCacheConfig
from appliance.transport.bpfmaps import PinnedMap
from appliance.transport.conncache import KernelCache

TEXTS = np.array([b"a"] * 65_536, dtype=object)  # the most texts one infer takes: 65,536 characters in all
STALL_S = 0.01  # issue 42's bound on a stall of the event loop
CHUNK_SAMPLES = 64 * 512  # 2.048 s at 16 kHz: whole VAD frames, as a live stream's chunks must be


def loop_bench(bundle: Path, trusted: Path, workdir: Path, seconds: float) -> dict[str, Any]:
    models = firmware.verify(bundle, trusted).manifest.models
    speech_model = next(m.name for m in models if m.kind == "speech_to_text")
    whisper = [m.name for m in models if m.kind == "speech_to_text"][-1]  # the largest: base on the interpreter
    language_model = next(m.name for m in models if m.kind == "language_identification")
    daemon = DaemonProcess(bundle, trusted, workdir / "engine", workers=1, label="loop")
    results: dict[str, Any] = {"workers": 1, "seconds": seconds, "phases": {}}
    rng = np.random.default_rng(2)
    quiet_wav = encode_wav((rng.standard_normal(CHUNK_SAMPLES) * 1e-3).astype(np.float32), 16_000)
    spoken_wav = encode_wav(speech(20.0)[0], RATE)
    try:
        with Client(str(daemon.socket), timeout=120) as client:
            live = _LiveBytes(client, speech_model, quiet_wav)
            events = _LongEvents(daemon.socket)
            work = {
                "quiet": lambda: time.sleep(0.1),
                "language": lambda: _ok(client.send(tensors_call(language_model, {"text": TEXTS}))),
                "language-json": lambda: _ok(client.send(tensors_call(language_model, {"text": TEXTS}, binary=False))),
                "bodies": lambda: hostile_bodies(daemon),
                "realtime-events": events.send,
                "whisper": lambda: client.transcribe(spoken_wav, whisper),
            }
            table = _FullPeerTable.of(daemon)
            if table is None:
                results["peer_walk"] = "no peer-walk phase: the daemon's connection cache is not the kernel's (eBPF)"
            else:
                work["peer-walk"] = table.step
            work["live-bytes"] = live.chunk  # last: its stream ends right after (60 s idle closes it)
            results["phases"] = _phases(daemon, work, seconds)
            if table is not None:
                table.empty()
            live.end()
            if events.ws is not None:
                events.ws.close()
    finally:
        daemon.stop()
    daemon = DaemonProcess(bundle, trusted, workdir / "workers", workers=2, label="loop-workers")
    try:
        results["phases"] |= _phases(daemon, {"bodies-2-workers": lambda: hostile_bodies(daemon)}, seconds)
    finally:
        daemon.stop()
    return results


def _phases(daemon: DaemonProcess, work: dict[str, Callable[[], Any]], seconds: float) -> dict[str, Any]:
    """Each phase's work again and again for `seconds`, the health checked throughout, and the engine's
    own event-loop lag (its /metrics histogram, sampled every 0.1 s: a stall there is the loop's, where
    the check's latency also holds the checker's and the CPU's share of 2 cores)."""
    phases: dict[str, Any] = {}
    with (
        HealthChecks(str(daemon.socket), daemon.serving_loops()) as checks,
        Client(str(daemon.socket), timeout=60) as scraper,
    ):
        for phase, step in work.items():
            started, cpu, lags, waited = time.monotonic(), daemon.tree_cpu_s(), scraper.metrics(), _waits(daemon)
            done = until(seconds, step)
            time.sleep(0.5)  # requests sent during the phase come back
            lagged, (wait_s, runs) = loop_lags(lags, scraper.metrics()), np.subtract(_waits(daemon), waited)
            phases[phase] = {
                "work": done if phase != "quiet" else 0,
                "daemon_cpu_s": round(daemon.tree_cpu_s() - cpu, 2),
                "window": (started, time.monotonic()),
                "loop_lags": int(lagged[float("inf")]),
                "loop_lags_over_10ms": int(lagged[float("inf")] - lagged[STALL_S]),
                "loop_thread_wait_ms": round(wait_s * 1e3),
                "loop_thread_runs": int(runs),
            }
    for figures in phases.values():
        figures["unix"] = checks.latency(*figures.pop("window"))
    return phases


def _waits(daemon: DaemonProcess) -> tuple[float, int]:
    """How long the engine's main thread (its event loop's) has waited, runnable, for a CPU, in seconds,
    and how many times it ran (the kernel's schedstat): on 2 cores shared by the engine, the work's
    client and the checker, a late health check can be the loop's stall or its wait for a core."""
    pid = daemon.proc.pid
    return _schedstat(f"/proc/{pid}/task/{pid}")


def _schedstat(task: str) -> tuple[float, int]:
    """A thread's wait, runnable, for a CPU so far in seconds, and how many times it ran."""
    _, waited_ns, runs = Path(task, "schedstat").read_text().split()
    return int(waited_ns) / 1e9, int(runs)


class HealthChecks:
    """/v2/health/ready on the Unix socket every PACE_S, from a process of its own (see above); each
    check kept with the moment it was sent, on the clock every process shares (CLOCK_MONOTONIC)."""

    def __init__(self, socket: str, loops: list[int]) -> None:
        context = multiprocessing.get_context("spawn")
        self.stop = context.Event()
        # sent at, took, answered 200, and how long of it the checker, and the serving loops' threads
        # (the longest of their waits), waited, runnable, for a core
        self.checks: list[tuple[float, float, bool, float, float]] = []
        self._receiver, sender = context.Pipe(duplex=False)
        loop_tasks = [f"/proc/{pid}/task/{pid}" for pid in loops]
        self._process = context.Process(target=_check_health, args=(socket, loop_tasks, self.stop, sender), daemon=True)

    def __enter__(self) -> HealthChecks:
        self._process.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        if self._receiver.poll(60):
            self.checks = self._receiver.recv()
        self._process.join(30)
        if not self.checks:
            raise RuntimeError(f"the health checker sent nothing back (exit code {self._process.exitcode})")

    def latency(self, start: float, end: float) -> dict[str, Any]:
        """The checks sent from `start` to `end`, as hostile.latency reports them; and how many took over
        10 ms, in all, once the checker's own wait for a core is taken out (a late check that is late no
        more was the checker's wait), and once the serving loop's thread's wait is taken out too (what is
        left is the daemon's time on a core: its stalls)."""
        within = [check[1:] for check in self.checks if start <= check[0] < end]
        figures = latency([took for took, *_ in within], sum(not ok for _, ok, *_ in within))
        figures["over_10ms"] = sum(took > STALL_S for took, *_ in within)
        figures["over_10ms_not_waiting"] = sum(took - mine > STALL_S for took, _, mine, _ in within)
        figures["over_10ms_on_a_core"] = sum(took - mine - loop > STALL_S for took, _, mine, loop in within)
        return figures


def _check_health(socket: str, loop_tasks: list[str], stop: Event, sender: Connection) -> None:
    checks = []

    def waits() -> list[float]:
        return [_schedstat(task)[0] for task in ["/proc/thread-self", *loop_tasks]]

    with Client(socket, timeout=30) as client:
        while not stop.is_set():
            sent, before = time.monotonic(), waits()
            try:
                ok = client.send(Call("GET", "/v2/health/ready")).status == 200
            except Exception:  # any failure is a failed check, never the checker's end
                ok = False
            took, (mine, *loops) = time.monotonic() - sent, np.subtract(waits(), before)
            checks.append((sent, took, ok, float(mine), float(max(loops))))
            time.sleep(PACE_S)
    sender.send(checks)


class _LongEvents:
    """One Realtime session on the Unix socket, sent long events of an unknown type: each is read whole
    (99,000 strings: the JSON reader's work) and answered with an `error` event."""

    EVENT = json.dumps({"type": "bench.long", "texts": ["a"] * 99_000})

    def __init__(self, socket: Path) -> None:
        self.socket = socket
        self.ws: Any = None  # websockets' ClientConnection, once its phase begins

    def send(self) -> None:
        if self.ws is None:  # opened in its phase: earlier, it would pass the session's idle timeout
            from websockets.sync.client import unix_connect  # the bench's client (a dev dependency)

            self.ws = unix_connect(str(self.socket), "ws://appliance/v1/realtime?intent=transcription", max_size=None)
        self.ws.send(self.EVENT)
        while json.loads(self.ws.recv())["type"] != "error":
            pass


class _FullPeerTable:
    """The engine's validated-peer map filled from the bench (root, as the daemon's loader): fake peers
    on 127.0.0.0/8, each seen when the phase began, so that none is idle before it ends."""

    def __init__(self, table: PinnedMap, entries: int) -> None:
        self.table, self.entries, self.keys = table, entries, list[bytes]()

    @classmethod
    def of(cls, daemon: DaemonProcess) -> _FullPeerTable | None:
        """The table at its default size (conncache.max_entries), or None where it is not the kernel's."""
        if daemon.pin_dir is None or not (daemon.pin_dir / "peers").exists():
            return None
        peers = PinnedMap(daemon.pin_dir / "peers", KernelCache.KEY.size, KernelCache.STATS_SIZE)
        return cls(peers, ConnCacheConfig().max_entries)

    def step(self) -> None:
        if not self.keys:  # the phase's first step fills it
            now = time.monotonic_ns()
            value = KernelCache.STATS.pack(now, now, 1, 1200, 0, 0, 0, 8, bytes(20)).ljust(
                KernelCache.STATS_SIZE, b"\0"
            )
            for i in range(self.entries):
                address = bytes([127, 1 + i // 60000 % 250, 0, 1]).ljust(16, b"\0")
                key = KernelCache.KEY.pack(4, 0, socket.htons(1024 + i % 60000), address)
                self.table.update(key, value)
                self.keys.append(key)
        time.sleep(0.1)  # the daemon's sweep does the work

    def empty(self) -> None:
        for key in self.keys:
            self.table.delete(key)
        self.table.close()


class _LiveBytes:
    """One live stream of the speech model, each chunk an encoded WAV file (near silence: the VAD closes
    nothing, so no decode of speech joins the measure)."""

    def __init__(self, client: Client, model: str, wav: bytes) -> None:
        self.client, self.model, self.wav, self.sent = client, model, wav, 0

    def chunk(self, end: bool = False) -> None:
        audio = {"audio": np.array([self.wav], dtype=object)}
        call = tensors_call(self.model, audio, sequence_id="loop-bench", start=not self.sent, end=end)
        _ok(self.client.send(call))
        self.sent += 1

    def end(self) -> None:
        if self.sent:
            self.chunk(end=True)


def _ok(response: Any) -> None:
    if response.status != 200:
        raise RuntimeError(f"the bench's work was refused: {response.status} {response.body[:200]!r}")


def report(r: dict[str, Any]) -> list[str]:
    quiet = r["phases"]["quiet"]["unix"]
    lines = [
        f"  the health check while work once on the event loop runs ({r['workers']} worker: the engine's loop "
        f"serves the socket; {r['seconds']} s a phase, a check every 20 ms): p50 / p99 / max ms, failed;"
        " the engine's loop lags (every 0.1 s) over 10 ms"
    ]
    if "peer_walk" in r:
        lines.append(f"    {r['peer_walk']}")
    for phase, m in r["phases"].items():
        t = m["unix"]
        lines.append(
            f"    {phase:16} {t['p50_ms']} / {t['p99_ms']} / {t['max_ms']} ms ({t['p99_ms'] / (quiet['p99_ms'] or 1.0):.1f}x"
            f" quiet's p99), {t['failed']} of {t['requests']} failed; {m['work']} done; daemon CPU {m['daemon_cpu_s']} s;"
            f" loop lags over 10 ms: {m['loop_lags_over_10ms']} of {m['loop_lags']}; the loop's thread waited"
            f" {m['loop_thread_wait_ms']} ms for a core over {m['loop_thread_runs']} runs; checks over 10 ms:"
            f" {t['over_10ms']}, {t['over_10ms_not_waiting']} without the checker's own wait for a core,"
            f" {t['over_10ms_on_a_core']} without the serving loop's either"
        )
    return lines
