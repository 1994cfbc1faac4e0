"""Hypercorn serving the same endpoint over HTTP/3 (asgi_peer), measured with the same client and calls."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np

from appliance.bench.daemon import DaemonProcess, free_udp_port
from appliance.bench.measure import load
from appliance.client import infer_call
from appliance.client.quic import QuicSession


def start_hypercorn(
    model: Path, daemon: DaemonProcess, workdir: Path, quic: str = "", bind: str = "127.0.0.1:0"
) -> subprocess.Popen[bytes]:
    """Hypercorn serving asgi_peer with the daemon's certificate: HTTP/3 on `quic` (where given), and
    HTTPS (HTTP/1.1 and HTTP/2 over TLS) on the TCP address `bind`. Its connections are kept however
    many requests they carry (Hypercorn closes one after 1000 by default; the daemon never does)."""
    config = workdir / "hypercorn.toml"
    config.write_text("keep_alive_max_requests = 1000000000\n")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypercorn",
            "--config",
            str(config),
            *(["--quic-bind", quic] if quic else []),
            "--bind",
            bind,
            "--certfile",
            str(daemon.cert),
            "--keyfile",
            str(workdir / "key.pem"),
            "--log-level",
            "warning",
            "appliance.bench.asgi_peer:app",
        ],
        env={**os.environ, "APPLIANCE_BENCH_MODEL": str(model)},
    )


def hypercorn_peer(
    model: Path, daemon: DaemonProcess, frame: np.ndarray, seconds: float, workdir: Path
) -> dict[str, Any] | str:
    """quic_1 and quic_16 against Hypercorn, as the daemon's are measured; a reason when it is not installed."""
    if importlib.util.find_spec("hypercorn") is None:
        return "not installed (pip install 'hypercorn[h3]')"
    address = f"127.0.0.1:{free_udp_port()}"
    proc = start_hypercorn(model, daemon, workdir, quic=address)
    try:

        async def run() -> dict[str, Any]:
            session = QuicSession(address, str(daemon.cert))
            for _ in range(200):
                try:
                    await session.open()
                    break
                except ConnectionError:
                    await asyncio.sleep(0.05)
            call = infer_call("silero_vad", frame)
            out = {f"quic_{n}": await load(session.send, call, n, seconds / 2) for n in (1, 16)}
            await session.close()
            return out

        return asyncio.run(run())
    finally:
        proc.terminate()
        proc.wait(10)
