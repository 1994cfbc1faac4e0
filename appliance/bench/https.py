"""HTTPS on TCP against QUIC and the Unix socket, in one run: one-frame binary VAD infer at 1 and 16
connections (HTTP/1.1 over TLS: one request at a time per connection); Hypercorn over TLS (the same
ASGI peer as the QUIC figures, h11 behind TLS) as the peer, measured with the same client and calls,
in alternating rounds with the daemon's HTTPS."""

from __future__ import annotations

import asyncio
import importlib.util
import socket
import ssl
import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.bench.daemon import DaemonProcess, free_tcp_port
from appliance.bench.hypercorn_peer import start_hypercorn
from appliance.bench.measure import compare_transports, load
from appliance.client import Call, infer_call
from appliance.client.http import HttpResponse, ResponseReader

CONNECTIONS = (1, 16)
ROUNDS = 2


class HttpsSender:
    """One keep-alive HTTPS/1.1 connection, one request at a time (the bench's client, not an API)."""

    def __init__(self, port: int, cafile: str) -> None:
        self.port, self.context = port, ssl.create_default_context(cafile=cafile)
        self.streams: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
        self.reader = ResponseReader()

    async def send(self, call: Call) -> HttpResponse:
        if self.streams is None:
            self.streams = await asyncio.open_connection("127.0.0.1", self.port, ssl=self.context, limit=1 << 22)
        stream_in, stream_out = self.streams
        stream_out.write(call.encode())
        while not self.reader.done:
            data = await stream_in.read(1 << 20)
            if not data:
                raise ConnectionError("the server closed the connection before it answered")
            self.reader.feed(data)
        return self.reader.done.pop(0)

    async def close(self) -> None:
        if self.streams is not None:
            self.streams[1].close()
            self.streams = None


async def https_load(port: int, cafile: str, call: Call, seconds: float) -> dict[str, Any]:
    """https_1 and https_16: one connection per stream, as the Unix socket's figures are taken."""
    out: dict[str, Any] = {}
    for count in CONNECTIONS:
        senders = [HttpsSender(port, cafile) for _ in range(count)]
        for sender in senders:  # handshakes before the clock starts
            assert (await sender.send(call)).status == 200
        results = await asyncio.gather(*(load(s.send, call, 1, seconds / 2) for s in senders))
        merged = _merged(list(results))
        out[f"https_{count}"] = {**merged, "rps": sum(r["rps"] for r in results)}
        for sender in senders:
            await sender.close()
    return out


def https_bench(bundle_dir: Path, trusted: Path, workdir: Path, seconds: float) -> dict[str, Any]:
    """The daemon's transports, then its HTTPS and Hypercorn's in alternating rounds (the machine's load
    drifts: each gets the same share of every stretch of it)."""
    bundle = firmware.verify(bundle_dir, trusted)
    model = bundle.artifact(next(m for m in bundle.manifest.models if m.kind == "vad").file)
    frame = (np.random.default_rng(1).standard_normal(512) * 0.1).astype(np.float32)
    call = infer_call("silero_vad", frame)
    daemon = DaemonProcess(bundle_dir, trusted, workdir, https=True, label="https")
    peer = None
    try:
        assert daemon.https_port is not None
        out: dict[str, Any] = {"daemon": asyncio.run(compare_transports(daemon, frame, seconds))}
        ports = {"daemon": daemon.https_port}
        if importlib.util.find_spec("hypercorn") is None:
            out["hypercorn"] = "not installed (pip install 'hypercorn[h3]')"
        else:
            ports["hypercorn"] = free_tcp_port()
            peer = start_hypercorn(model, daemon, workdir, bind=f"127.0.0.1:{ports['hypercorn']}")
            _wait_listening(ports["hypercorn"])
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in ports}
        for _ in range(ROUNDS):
            for name, port in ports.items():
                rounds[name].append(asyncio.run(https_load(port, str(daemon.cert), call, seconds / ROUNDS)))
        for name, measured in rounds.items():
            out.setdefault(name, {})
            out[name].update({key: _merged([r[key] for r in measured]) for key in measured[0]})
    finally:
        if peer is not None:
            peer.terminate()
            peer.wait(10)
        daemon.stop()
    return out


def _merged(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "median_us": round(float(np.median([r["median_us"] for r in rounds])), 1),
        "p99_us": max(r["p99_us"] for r in rounds),
        "rps": round(float(np.mean([r["rps"] for r in rounds]))),
    }


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 30
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def report(r: dict[str, Any]) -> list[str]:
    lines = ["  one-frame binary infer by transport, one run (median / p99 latency, requests per second):"]
    rows = [(f"daemon {k.replace('_', ', ')}", v) for k, v in r["daemon"].items()]
    if isinstance(r["hypercorn"], dict):
        rows += [(f"Hypercorn {k.replace('_', ', ')}", v) for k, v in r["hypercorn"].items()]
    else:
        lines.append(f"    Hypercorn peer: {r['hypercorn']}")
    for name, v in rows:
        lines.append(f"    {name:24} median {v['median_us']:8.1f} us  p99 {v['p99_us']:8.1f} us  {v['rps']:6} req/s")
    if isinstance(r["hypercorn"], dict):
        for count in CONNECTIONS:
            key = f"https_{count}"
            ratio = r["daemon"][key]["rps"] / max(1, r["hypercorn"][key]["rps"])
            lines.append(f"    HTTPS, {count:2} connections: the daemon {ratio:.2f}x Hypercorn over TLS")
    return lines
