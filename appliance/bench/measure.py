"""The measurements: the raw model as its wrapper calls it, timing loops, concurrent streams, the same
call over each transport, QUIC handshakes, and speech-like test audio made offline."""

from __future__ import annotations

import asyncio
import io
import subprocess
import threading
import time
import wave
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.bench.daemon import DaemonProcess
from appliance.client import AsyncClient, Call, Client, infer_call
from appliance.client.quic import QuicSession
from appliance.engine.onnx_cpu import session


class RawVad:
    """The model called the way its own wrapper calls it: one stream, one frame, context and state carried."""

    def __init__(self, model_path: Path, spec: firmware.ModelSpec) -> None:
        self.session = session(model_path, threads=1)
        self.audio = spec.vad_audio
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


def concurrently(count: int, work: Callable[[int], object]) -> float:
    """Seconds for `count` threads to each do `work(i)`, started together."""
    start = threading.Barrier(count + 1)

    def run(i: int) -> None:
        start.wait()
        work(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    start.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return time.perf_counter() - t0


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


async def concurrent_streams(socket_path: str, streams: int, chunk: np.ndarray, seconds: float) -> tuple[int, float]:
    clients = [AsyncClient(socket_path) for _ in range(streams)]
    for i, c in enumerate(clients):
        await c.speech_probs(chunk, sequence_id=10_000 + i, start=True)
    frames, deadline = 0, time.perf_counter() + seconds
    frames_per_chunk = len(chunk) // 512

    async def run(i: int) -> int:
        n = 0
        while time.perf_counter() < deadline:
            await clients[i].speech_probs(chunk, sequence_id=10_000 + i)
            n += frames_per_chunk
        return n

    started = time.perf_counter()
    counts = await asyncio.gather(*(run(i) for i in range(streams)))
    elapsed = time.perf_counter() - started
    for i, c in enumerate(clients):
        await c.speech_probs(chunk[:512], sequence_id=10_000 + i, end=True)
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
        quic = QuicSession(daemon.quic, str(daemon.cert))
        await quic.send(Call("GET", "/v2/health/ready"))
        out[f"quic_{streams}"] = await load(quic.send, call, streams, seconds / 2)
        await quic.close()
    return out


async def handshakes(address: str, cafile: str, rounds: int = 20) -> dict[str, float]:
    """A full handshake plus one GET, against a resumed session whose GET rides in 0-RTT."""
    full, resumed = [], []
    quic = QuicSession(address, cafile)
    for _ in range(rounds):
        quic.ticket = None
        t = time.perf_counter()
        await quic.open()
        await quic.send(Call("GET", "/v2/health/ready"))
        full.append(time.perf_counter() - t)
        for _ in range(100):
            if quic.ticket is not None:
                break
            await asyncio.sleep(0.001)
        await quic.close()
        t = time.perf_counter()
        await quic.open(wait_connected=False)
        await quic.send(Call("GET", "/v2/health/ready"))
        resumed.append(time.perf_counter() - t)
        assert quic.handshake is not None and quic.handshake.early_data_accepted
        await quic.close()
    return {"full_median_us": stats_us(full)["median_us"], "resumed_0rtt_median_us": stats_us(resumed)["median_us"]}


def live_during_recording(socket_path: str, frame: np.ndarray, wav: bytes, frame_s: float) -> dict[str, float]:
    """A one-frame live stream in real time (a frame every `frame_s`) while another client segments a
    long recording in one call (its JSON answer made off the event loop): the stream's latency, which
    the batcher's live-first order bounds, and a health check's, every 20 ms from a third client."""
    finished = threading.Event()
    took: list[float] = []
    health: list[float] = []

    def check_health() -> None:
        with Client(socket_path) as checker:
            while not finished.is_set():
                t = time.perf_counter()
                checker.health()
                health.append(time.perf_counter() - t)
                time.sleep(0.02)

    def segment() -> None:
        with Client(socket_path, timeout=600) as recording:
            t = time.perf_counter()
            recording.segments(wav)
            took.append(time.perf_counter() - t)
        finished.set()

    latencies = []
    with Client(socket_path) as live:
        live.speech_probs(frame, sequence_id="live-during-recording", start=True)
        lag_before = live.metrics()
        threading.Thread(target=segment, daemon=True).start()
        health_checks = threading.Thread(target=check_health, daemon=True)
        health_checks.start()
        while not finished.is_set():
            t = time.perf_counter()
            live.speech_probs(frame, sequence_id="live-during-recording")
            latencies.append(time.perf_counter() - t)
            time.sleep(max(0.0, frame_s - latencies[-1]))
        live.speech_probs(frame, sequence_id="live-during-recording", end=True)
        lag_ms = loop_lag_p99_ms(lag_before, live.metrics())
    health_checks.join()
    ms, health_ms = np.asarray(latencies) * 1e3, np.asarray(health) * 1e3
    return {
        "health_p99_ms": round(float(np.percentile(health_ms, 99)), 1),
        "health_checks": len(health_ms),
        "p99_ms": round(float(np.percentile(ms, 99)), 1),
        "max_ms": round(float(ms.max()), 1),
        "frames": len(ms),
        "recording_s": round(took[0], 2),
        "loop_lag_p99_ms": lag_ms,
    }


LAG_BUCKET = "appliance_event_loop_lag_duration_seconds_bucket"


def loop_lags(before: str, after: str) -> dict[float, float]:
    """The engine process's event-loop lags between two /metrics scrapes: how many were at most each
    of the histogram's bounds (cumulative, as Prometheus keeps them; inf: all of them)."""

    def buckets(text: str) -> dict[float, float]:
        out = {}
        for line in text.splitlines():
            if line.startswith(LAG_BUCKET):
                bound = line.split('le="', 1)[1].split('"', 1)[0]
                out[float(bound)] = float(line.rsplit(" ", 1)[1])
        return out

    start, end = buckets(before), buckets(after)
    return {bound: end[bound] - start.get(bound, 0.0) for bound in sorted(end)}


def loop_lag_p99_ms(before: str, after: str) -> float:
    """The event-loop lag between two /metrics scrapes, 99th percentile: the upper bound of the
    histogram bucket it falls in (inf past the last)."""
    counts = loop_lags(before, after)
    total = counts.get(float("inf"), 0.0)
    for bound, cumulative in counts.items():
        if total and cumulative >= 0.99 * total:
            return round(bound * 1e3, 1)
    return 0.0
