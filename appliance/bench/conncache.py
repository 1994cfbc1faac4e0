"""The eBPF connection cache against the user-space one: QUIC throughput with each, and a flood from
127.0.0.2 while a client on 127.0.0.3 keeps calling (p99 with and without it)."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import load
from appliance.client import Call, Client, infer_call
from appliance.client.quic import QuicSession

FLOODER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("127.0.0.2", 0))
print(s.getsockname()[1], flush=True)
datagram, sent, end = b"\\x40" + bytes(1199), 0, time.monotonic() + float(sys.argv[2])
while time.monotonic() < end:
    s.sendto(datagram, ("127.0.0.1", int(sys.argv[1])))
    sent += 1
print(sent, flush=True)
"""


def connection_cache(bundle: Path, trusted: Path, workdir: Path, frame: np.ndarray, seconds: float) -> dict[str, Any]:
    """Per backend ("ebpf", "user"): quic_16, quiet_1, flooded_1 and the flood's counts; or why it did not start."""
    out: dict[str, Any] = {}
    call = infer_call("silero_vad", frame)
    for backend in ("ebpf", "user"):
        settings = (
            f'backend = "{backend}"\npeer_rate = 10000.0\npeer_burst = 20000.0\n'
            f'pin_dir = "/sys/fs/bpf/appliance-bench-{os.getpid()}"\n'
        )
        try:
            daemon = DaemonProcess(bundle, trusted, workdir / backend, settings, label=f"conncache {backend}")
        except RuntimeError as exc:
            out[backend] = f"cannot start ({exc}; the eBPF backend needs root)"
            continue
        try:

            async def measure() -> dict[str, Any]:
                session = QuicSession(daemon.quic, str(daemon.cert), local_host="127.0.0.3")
                await session.send(Call("GET", "/v2/health/ready"))
                result = {
                    "quic_16": await load(session.send, call, 16, seconds / 2),
                    "quiet_1": await load(session.send, call, 1, seconds / 2),
                }
                flooder = await asyncio.create_subprocess_exec(
                    sys.executable,
                    "-c",
                    FLOODER,
                    daemon.quic.split(":")[1],
                    str(seconds / 2),
                    stdout=asyncio.subprocess.PIPE,
                )
                assert flooder.stdout is not None
                port = int(await flooder.stdout.readline())
                result["flooded_1"] = await load(session.send, call, 1, seconds / 2)
                sent = int(await flooder.stdout.readline())
                await flooder.wait()
                await session.close()
                with Client(str(daemon.socket)) as local:
                    peers = local.status()["conncache"]["peers"]
                peer = next(p for p in peers if p["peer"] == f"127.0.0.2:{port}")
                result["flood"] = {"sent": sent, "admitted": peer["packets"], "dropped": peer["drops"]}
                return result

            out[backend] = asyncio.run(measure())
        finally:
            daemon.stop()
    return out
