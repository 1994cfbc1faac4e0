"""`appliance bench`: the daemon measured against raw in-process ONNX Runtime, side by side in one run.

Figures: one stream one frame per request (median, p99, overhead over the raw call); 16 concurrent
streams of 256 ms chunks (frames/s against the raw single-stream rate); a 10-minute recording in
one call (against the same audio run as one sequence, in-process); the daemon's resident memory.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.audio import to_frames
from appliance.client import AsyncClient, Call, Client, infer_call
from appliance.client.quic import QuicSession
from appliance.engine.onnx_cpu import session
from appliance.tls import init_self_signed

TARGETS = {"overhead_us": 200.0, "streams16_ratio": 1.5, "recording_ratio": 1.5, "rss_mib": 250.0}


class RawVad:
    """The model called the way its own wrapper calls it: one stream, one frame, context and state carried."""

    def __init__(self, model_path: Path, spec: firmware.ModelSpec) -> None:
        self.session = session(model_path, threads=1)
        self.audio = spec.audio
        self.reset()

    def reset(self) -> None:
        self.state = np.zeros((2, 1, 128), np.float32)
        self.context = np.zeros((1, self.audio.context_samples), np.float32)
        self.sr = np.array(self.audio.sample_rate, np.int64)

    def __call__(self, frame: np.ndarray) -> float:
        x = np.concatenate([self.context, frame[None, :]], axis=1)
        out, self.state = self.session.run(None, {"input": x, "state": self.state, "sr": self.sr})
        self.context = x[:, -self.audio.context_samples :]
        return float(out[0, 0])


def timed(fn: Callable[[], Any], seconds: float) -> list[float]:
    samples, deadline = [], time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return samples


def stats_us(samples: list[float]) -> dict[str, float]:
    arr = np.asarray(samples) * 1e6
    return {
        "median_us": round(float(np.median(arr)), 1),
        "p99_us": round(float(np.percentile(arr, 99)), 1),
        "count": len(arr),
    }


def test_audio(seconds: float, rate: int) -> np.ndarray:
    """Speech-like audio without a network: espeak-ng where installed, else noise bursts; random pauses."""
    rng = np.random.default_rng(0)
    try:
        raw = subprocess.run(
            ["espeak-ng", "--stdout", "The appliance measures its own speed on real speech."],
            capture_output=True,
            check=True,
        ).stdout
        with wave.open(io.BytesIO(raw)) as w:
            src_rate, pcm = w.getframerate(), w.readframes(w.getnframes())
        voice = np.frombuffer(pcm, "<i2").astype(np.float32) / 32768
        voice = np.interp(np.arange(int(len(voice) * rate / src_rate)) * src_rate / rate, np.arange(len(voice)), voice)
    except (OSError, subprocess.CalledProcessError):
        voice = rng.standard_normal(rate * 2) * 0.2
    pieces, total = [], 0
    while total < seconds * rate:
        gap = np.zeros(int(rate * rng.uniform(0.3, 2.0)))
        pieces += [voice, gap]
        total += len(voice) + len(gap)
    return np.concatenate(pieces)[: int(seconds * rate)].astype(np.float32)


def free_udp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    def __init__(self, bundle: Path, trusted: Path, workdir: Path, conncache: str = "") -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = workdir / "api.sock"
        self.cert, key = workdir / "cert.pem", workdir / "key.pem"
        init_self_signed(self.cert, key, [])
        self.quic = f"127.0.0.1:{free_udp_port()}"
        config = workdir / "bench.toml"
        config.write_text(
            f'[server]\nsocket = "{self.socket}"\nmax_body_bytes = {256 << 20}\n'
            f"[quic]\nenabled = true\nport = {self.quic.split(':')[1]}\n"
            f'certificate = "{self.cert}"\nprivate_key = "{key}"\n'
            f'[firmware]\nbundle = "{bundle.resolve()}"\ntrusted_keys = "{trusted.resolve()}"\n'
            f'[log]\nlevel = "warning"\n[conncache]\n{conncache}'
        )
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                with Client(str(self.socket), timeout=5) as c:
                    if c.health()["ready"]:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError("daemon did not become ready")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


async def concurrent_streams(socket_path: str, streams: int, chunk: np.ndarray, seconds: float) -> tuple[int, float]:
    clients = [AsyncClient(socket_path) for _ in range(streams)]
    for i, c in enumerate(clients):
        await c.infer(chunk, sequence_id=10_000 + i, start=True)
    frames, deadline = 0, time.perf_counter() + seconds
    frames_per_chunk = len(chunk) // 512

    async def run(i: int) -> int:
        n = 0
        while time.perf_counter() < deadline:
            await clients[i].infer(chunk, sequence_id=10_000 + i)
            n += frames_per_chunk
        return n

    started = time.perf_counter()
    counts = await asyncio.gather(*(run(i) for i in range(streams)))
    elapsed = time.perf_counter() - started
    for i, c in enumerate(clients):
        await c.infer(chunk[:512], sequence_id=10_000 + i, end=True)
        await c.close()
    frames = sum(counts)
    return frames, elapsed


async def load(send: Callable[[Call], Any], call: Call, streams: int, seconds: float) -> dict[str, float]:
    """`streams` concurrent request loops for `seconds`: latency median/p99 and requests per second."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def loop() -> None:
        while time.perf_counter() < deadline:
            t = time.perf_counter()
            response = await send(call)
            latencies.append(time.perf_counter() - t)
            assert response.status == 200, response.body[:200]

    started = time.perf_counter()
    await asyncio.gather(*(loop() for _ in range(streams)))
    elapsed = time.perf_counter() - started
    return {**stats_us(latencies), "rps": round(len(latencies) / elapsed)}


async def compare_transports(daemon: DaemonProcess, frame: np.ndarray, seconds: float) -> dict[str, Any]:
    """The same one-frame binary infer over the Unix socket and over QUIC, at 1 and 16 streams."""
    call = infer_call("silero_vad", frame)
    out: dict[str, Any] = {}
    for streams in (1, 16):
        # one connection per stream on the socket (HTTP/1.1); one QUIC connection carrying all streams
        unix = [AsyncClient(str(daemon.socket)) for _ in range(streams)]
        results = await asyncio.gather(*(load(c.send, call, 1, seconds / 2) for c in unix))
        out[f"unix_{streams}"] = {
            "median_us": round(float(np.median([r["median_us"] for r in results])), 1),
            "p99_us": max(r["p99_us"] for r in results),
            "rps": sum(r["rps"] for r in results),
        }
        for c in unix:
            await c.close()
        session = QuicSession(daemon.quic, str(daemon.cert))
        await session.send(Call("GET", "/v2/health/ready"))
        out[f"quic_{streams}"] = await load(session.send, call, streams, seconds / 2)
        await session.close()
    return out


async def handshakes(address: str, cafile: str, rounds: int = 20) -> dict[str, float]:
    """A full handshake plus one GET, against a resumed session whose GET rides in 0-RTT."""
    full, resumed = [], []
    session = QuicSession(address, cafile)
    for _ in range(rounds):
        session.ticket = None
        t = time.perf_counter()
        await session.open()
        await session.send(Call("GET", "/v2/health/ready"))
        full.append(time.perf_counter() - t)
        for _ in range(100):
            if session.ticket is not None:
                break
            await asyncio.sleep(0.001)
        await session.close()
        t = time.perf_counter()
        await session.open(wait_connected=False)
        await session.send(Call("GET", "/v2/health/ready"))
        resumed.append(time.perf_counter() - t)
        assert session.handshake is not None and session.handshake.early_data_accepted
        await session.close()
    return {"full_median_us": stats_us(full)["median_us"], "resumed_0rtt_median_us": stats_us(resumed)["median_us"]}


def hypercorn_peer(
    model: Path, daemon: DaemonProcess, frame: np.ndarray, seconds: float, workdir: Path
) -> dict[str, Any] | str:
    """Hypercorn serving the same endpoint over HTTP/3, measured with the same client and calls."""
    try:
        import hypercorn  # noqa: F401
    except ImportError:
        return "not installed (pip install 'hypercorn[h3]')"
    address = f"127.0.0.1:{free_udp_port()}"
    key = workdir / "key.pem"
    env = {**os.environ, "APPLIANCE_BENCH_MODEL": str(model)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "hypercorn",
            "--quic-bind",
            address,
            "--bind",
            "127.0.0.1:0",
            "--certfile",
            str(daemon.cert),
            "--keyfile",
            str(key),
            "--log-level",
            "warning",
            "appliance.bench_peer:app",
        ],
        env=env,
    )
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
    """The eBPF connection cache against the user-space one: QUIC throughput with each, and a
    flood from 127.0.0.2 while a client on 127.0.0.3 keeps calling (p99 with and without it)."""
    out: dict[str, Any] = {}
    call = infer_call("silero_vad", frame)
    for backend in ("ebpf", "user"):
        settings = (
            f'backend = "{backend}"\npeer_rate = 10000.0\npeer_burst = 20000.0\n'
            f'pin_dir = "/sys/fs/bpf/appliance-bench-{os.getpid()}"\n'
        )
        try:
            daemon = DaemonProcess(bundle, trusted, workdir / backend, settings)
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


def main(args: argparse.Namespace) -> int:
    bundle = firmware.verify(args.bundle, args.trusted_keys)
    spec = bundle.manifest.models[0]
    raw = RawVad(bundle.artifact(spec.file), spec)
    frame_samples, rate = spec.audio.frame_samples, spec.audio.sample_rate
    rng = np.random.default_rng(1)
    frame = (rng.standard_normal(frame_samples) * 0.1).astype(np.float32)
    results: dict[str, Any] = {
        "firmware": f"{bundle.manifest.name} {bundle.manifest.version}",
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
        daemon = DaemonProcess(args.bundle, args.trusted_keys, Path(tmp))
        try:
            client = Client(str(daemon.socket))
            client.infer(frame, sequence_id=1, start=True)
            # 1. one stream, one frame per request: raw and daemon in alternating rounds
            polling = Client(str(daemon.socket), busy_poll_s=0.005)
            raw_times, daemon_times, polled_times = [], [], []
            for _ in range(4):
                raw_times += timed(lambda: raw(frame), args.seconds / 4)
                daemon_times += timed(lambda: client.infer(frame, sequence_id=1), args.seconds / 4)
                polled_times += timed(lambda: polling.infer(frame, sequence_id=1), args.seconds / 4)
            polling.infer(frame, sequence_id=1, end=True)  # an open sequence would hold the daemon's stop
            polling.close()
            results["raw_one_frame"] = stats_us(raw_times)
            results["daemon_one_frame"] = stats_us(daemon_times)
            results["daemon_one_frame_busy_poll"] = stats_us(polled_times)
            results["overhead_us"] = round(
                results["daemon_one_frame"]["median_us"] - results["raw_one_frame"]["median_us"], 1
            )
            results["overhead_busy_poll_us"] = round(
                results["daemon_one_frame_busy_poll"]["median_us"] - results["raw_one_frame"]["median_us"], 1
            )
            raw_rate = len(raw_times) / sum(raw_times)
            results["raw_frames_per_s"] = round(raw_rate)

            # 2. sixteen streams of 256 ms chunks
            chunk = (rng.standard_normal(8 * frame_samples) * 0.1).astype(np.float32)
            frames, elapsed = asyncio.run(concurrent_streams(str(daemon.socket), 16, chunk, args.seconds))
            results["streams16_frames_per_s"] = round(frames / elapsed)
            results["streams16_ratio"] = round(frames / elapsed / raw_rate, 2)

            # 3. a ten-minute recording in one call, against the same audio as one sequence in-process
            audio = test_audio(600, rate)
            frames_all = to_frames(audio, frame_samples)
            raw.reset()
            t = time.perf_counter()
            for f in frames_all:
                raw(f)
            sequential = time.perf_counter() - t
            t = time.perf_counter()
            client.infer(audio)
            sharded = time.perf_counter() - t
            results["recording_600s"] = {"one_sequence_s": round(sequential, 3), "daemon_sharded_s": round(sharded, 3)}
            results["recording_ratio"] = round(sequential / sharded, 2)
            results["rss_mib"] = round(daemon.rss_mib(), 1)
            client.close()
            results["transports"] = asyncio.run(compare_transports(daemon, frame, args.seconds))
            results["quic_handshake"] = asyncio.run(handshakes(daemon.quic, str(daemon.cert)))
            results["hypercorn"] = hypercorn_peer(bundle.artifact(spec.file), daemon, frame, args.seconds, Path(tmp))
        finally:
            daemon.stop()
        results["conncache"] = connection_cache(
            args.bundle, args.trusted_keys, Path(tmp) / "conncache", frame, args.seconds
        )
    report(results)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


def report(r: dict[str, Any]) -> None:
    ok = {
        "overhead_us": r["overhead_us"] <= TARGETS["overhead_us"],
        "streams16_ratio": r["streams16_ratio"] >= TARGETS["streams16_ratio"],
        "recording_ratio": r["recording_ratio"] >= TARGETS["recording_ratio"],
        "rss_mib": r["rss_mib"] < TARGETS["rss_mib"],
    }
    mark = {True: "ok", False: "MISSED"}
    print(f"appliance bench: {r['firmware']} on {r['cpu_count']} CPUs")
    print(
        f"  raw ONNX Runtime, 1 frame/call     median {r['raw_one_frame']['median_us']:8.1f} us  p99 {r['raw_one_frame']['p99_us']:8.1f} us  ({r['raw_frames_per_s']} frames/s)"
    )
    print(
        f"  daemon, 1 frame/request, binary    median {r['daemon_one_frame']['median_us']:8.1f} us  p99 {r['daemon_one_frame']['p99_us']:8.1f} us"
    )
    print(
        f"  overhead (median)                  {r['overhead_us']:8.1f} us   target <= {TARGETS['overhead_us']:.0f} us   {mark[ok['overhead_us']]}"
    )
    polled = r["daemon_one_frame_busy_poll"]
    print(
        f"  same, client busy-polling 5 ms     median {polled['median_us']:8.1f} us  p99 {polled['p99_us']:8.1f} us  overhead {r['overhead_busy_poll_us']:.1f} us"
    )
    print(
        f"  16 streams x 256 ms chunks         {r['streams16_frames_per_s']} frames/s = {r['streams16_ratio']}x raw   target >= 1.5x   {mark[ok['streams16_ratio']]}"
    )
    rec = r["recording_600s"]
    print(
        f"  10 min recording, one call         {rec['daemon_sharded_s']} s vs one sequence {rec['one_sequence_s']} s = {r['recording_ratio']}x   target >= 1.5x   {mark[ok['recording_ratio']]}"
    )
    print(f"  daemon resident memory             {r['rss_mib']} MiB   target < 250 MiB   {mark[ok['rss_mib']]}")
    print("  one-frame binary infer, by transport (median / p99 latency, requests per second):")
    rows = [(f"daemon {name.replace('_', ', ')} streams", v) for name, v in r["transports"].items()]
    if isinstance(r["hypercorn"], dict):
        rows += [(f"Hypercorn {name.replace('_', ', ')} streams", v) for name, v in r["hypercorn"].items()]
    else:
        print(f"    Hypercorn peer: {r['hypercorn']}")
    for label, v in rows:
        print(f"    {label:30} {v['median_us']:8.1f} us  {v['p99_us']:8.1f} us  {v['rps']:6} req/s")
    hs = r["quic_handshake"]
    print(
        f"  QUIC full handshake + GET {hs['full_median_us']:.0f} us; resumed, GET in 0-RTT {hs['resumed_0rtt_median_us']:.0f} us"
    )
    if isinstance(r["hypercorn"], dict):
        for n in (1, 16):
            ours, peer = r["transports"][f"quic_{n}"], r["hypercorn"][f"quic_{n}"]
            print(
                f"  QUIC vs Hypercorn at {n:2} streams: {ours['rps'] / peer['rps']:.2f}x throughput, "
                f"p99 {ours['p99_us']:.0f} vs {peer['p99_us']:.0f} us"
            )
    print("  connection cache (QUIC, 16 streams; then 1 stream on 127.0.0.3 without and with a flood from 127.0.0.2):")
    for backend, c in r["conncache"].items():
        if isinstance(c, str):
            print(f"    {backend}: {c}")
            continue
        f = c["flood"]
        print(
            f"    {backend:5} {c['quic_16']['rps']:6} req/s; p99 {c['quiet_1']['p99_us']:.0f} us quiet, "
            f"{c['flooded_1']['p99_us']:.0f} us flooded ({c['flooded_1']['rps']} req/s); flood {f['sent']} sent, "
            f"{f['admitted']} admitted, {f['dropped']} dropped"
        )
    both = r["conncache"]
    if all(isinstance(both.get(b), dict) for b in ("ebpf", "user")):
        print(
            f"  eBPF filter vs user-space table: {both['ebpf']['quic_16']['rps'] / both['user']['quic_16']['rps']:.2f}x "
            "QUIC throughput"
        )
