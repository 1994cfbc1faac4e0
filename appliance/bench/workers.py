"""Protocol workers against the transports in one process: one-frame VAD requests per second over the
Unix socket and over QUIC at 16 and 64 concurrent streams, server.workers = 2 against 1, side by side;
then the default (server.workers = 0) against 1 on the Unix socket, in alternating rounds.

The load comes from LOAD_PROCESSES processes, so that the client side is not one Python process's
ceiling: Unix streams are one HTTP/1.1 connection each; QUIC streams are spread over connections
(STREAMS_PER_QUIC_CONNECTION each), since a connection is always served by one worker."""

from __future__ import annotations

import asyncio
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import stats_us, timed
from appliance.client import AsyncClient, Call, Client, infer_call
from appliance.client.quic import QuicSession

LOAD_PROCESSES = 2
STREAMS = (16, 64)
STREAMS_PER_QUIC_CONNECTION = 4
RATIO_TARGET = 1.3
DEFAULT_ROUNDS = 3  # the default against workers = 1, in turn


async def _load(transport: str, address: str, cafile: str, streams: int, frame: np.ndarray, seconds: float) -> int:
    """Requests answered by `streams` request loops within `seconds`."""
    call = infer_call("silero_vad", frame)
    senders: list[Any] = []
    if transport == "unix":
        senders = [AsyncClient(address) for _ in range(streams)]
        for sender in senders:
            await sender.send(Call("GET", "/v2/health/ready"))
        sends = [s.send for s in senders]
    else:
        connections = max(1, streams // STREAMS_PER_QUIC_CONNECTION)
        senders = [QuicSession(address, cafile) for _ in range(connections)]
        for sender in senders:
            await sender.send(Call("GET", "/v2/health/ready"))
        sends = [senders[i % connections].send for i in range(streams)]
    deadline, answered = time.perf_counter() + seconds, 0

    async def loop(send: Any) -> None:
        nonlocal answered
        while time.perf_counter() < deadline:
            response = await send(call)
            assert response.status == 200, response.body[:200]
            answered += 1

    await asyncio.gather(*(loop(send) for send in sends))
    for sender in senders:
        await sender.close()
    return answered


def _load_process(transport: str, address: str, cafile: str, streams: int, frame: np.ndarray, seconds: float) -> int:
    return asyncio.run(_load(transport, address, cafile, streams, frame, seconds))


def requests_per_s(daemon: DaemonProcess, transport: str, streams: int, frame: np.ndarray, seconds: float) -> float:
    address = str(daemon.socket) if transport == "unix" else daemon.quic
    share = streams // LOAD_PROCESSES
    with ProcessPoolExecutor(LOAD_PROCESSES) as pool:
        started = time.perf_counter()
        counts = list(
            pool.map(
                _load_process,
                *zip(*[(transport, address, str(daemon.cert), share, frame, seconds)] * LOAD_PROCESSES, strict=True),
            )
        )
        elapsed = time.perf_counter() - started
    return sum(counts) / elapsed


def workers_scaling(bundle: Path, trusted: Path, workdir: Path, seconds: float) -> dict[str, Any]:
    """{"workers1": {"unix_16": rps, ...}, "workers2": {...}, "ratio": {"unix_16": x, ...}, ...}."""
    frame = (np.random.default_rng(1).standard_normal(512) * 0.1).astype(np.float32)  # one VAD frame
    out: dict[str, Any] = {}
    for workers in (1, 2):
        daemon = DaemonProcess(bundle, trusted, workdir / f"workers{workers}", workers=workers)
        try:
            with Client(str(daemon.socket)) as client:  # one stream: what crossing to the engine costs
                client.speech_probs(frame)
                latency = stats_us(timed(lambda: client.speech_probs(frame), seconds / 2))
            out[f"workers{workers}_one_frame_us"] = latency["median_us"]
            figures = {}
            for transport in ("unix", "quic"):
                for streams in STREAMS:
                    figures[f"{transport}_{streams}"] = round(
                        requests_per_s(daemon, transport, streams, frame, seconds)
                    )
            out[f"workers{workers}"] = figures
            if workers == 2:
                out["status"] = daemon.status()
        finally:
            daemon.stop()
    out["ratio"] = {k: round(out["workers2"][k] / out["workers1"][k], 2) for k in out["workers1"]}
    out["crossing_us"] = round(out["workers2_one_frame_us"] - out["workers1_one_frame_us"], 1)
    # the default (server.workers = 0: by this machine's cores) against workers = 1 on the Unix socket: both
    # daemons up at once and measured in alternating rounds, so the machine's drift falls on both alike
    default = DaemonProcess(bundle, trusted, workdir / "workers-default", workers=0)
    single = DaemonProcess(bundle, trusted, workdir / "workers-single", workers=1)
    try:
        out["default_workers"] = len(default.status().get("workers") or []) or 1
        rounds: dict[str, dict[str, list[float]]] = {"default": {}, "single": {}}
        for _ in range(DEFAULT_ROUNDS):
            for name, daemon in (("single", single), ("default", default)):
                for streams in STREAMS:
                    rate = requests_per_s(daemon, "unix", streams, frame, seconds)
                    rounds[name].setdefault(f"unix_{streams}", []).append(rate)
        out["default_rounds"] = {name: {k: [round(r) for r in v] for k, v in by.items()} for name, by in rounds.items()}
    finally:
        default.stop()
        single.stop()
    return out


def report(r: dict[str, Any]) -> list[str]:
    quic = r["status"].get("quic") or {}
    lines = [
        f"  protocol workers: one-frame requests/s, server.workers = 2 against 1 "
        f"(QUIC in {quic.get('workers', '?')} workers{': ' + quic['reason'] if quic.get('reason') else ''}):"
    ]
    lines.append(
        f"    one stream, one frame over the Unix socket: median {r['workers1_one_frame_us']} us in one process, "
        f"{r['workers2_one_frame_us']} us through a worker: the crossing costs {r['crossing_us']} us"
    )
    for key, ratio in r["ratio"].items():
        transport, streams = key.split("_")
        mark = "ok" if ratio >= RATIO_TARGET else "MISSED"
        lines.append(
            f"    {transport:4} {streams:>2} streams   workers 1: {r['workers1'][key]:6} req/s   workers 2: "
            f"{r['workers2'][key]:6} req/s   = {ratio:.2f}x   target >= {RATIO_TARGET}x   {mark}"
        )
    for key, default in r["default_rounds"]["default"].items():
        single = r["default_rounds"]["single"][key]
        default_rate, single_rate = statistics.median(default), statistics.median(single)
        ratio = default_rate / single_rate
        lines.append(
            f"    unix {key.split('_')[1]:>2} streams   default workers ({r['default_workers']} on this machine): "
            f"{default_rate:6.0f} req/s against workers 1 {single_rate:6.0f} = "
            f"{ratio:.2f}x   target >= 1.0x   {'ok' if ratio >= 1.0 else 'MISSED'}   (medians of {len(default)} "
            f"alternating rounds: {', '.join(map(str, default))} against {', '.join(map(str, single))})"
        )
    for worker in r["status"].get("workers") or []:
        lines.append(
            f"    worker {worker['worker']}: {worker.get('quic_datagrams', 0)} QUIC datagrams, "
            f"{worker.get('quic_stray_datagrams', 0)} stray; restarts {worker['restarts']}"
        )
    return lines
