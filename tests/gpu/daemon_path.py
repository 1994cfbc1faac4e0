"""The GPU figures from the path the daemon serves (tests/gpu/check.py runs these).

1. Live VAD streams: the daemon (its default workers) on the GPU firmware as built, so its CUDA
   engine runs behind its batcher at the baked max_batch, and client processes each keeping many
   sequences of 256 ms PCM16 chunks, paced in real time, on the Unix socket. A count of streams is
   served in real time when 99% of chunks are answered within one chunk's time (256 ms) of being
   sent and every stream kept its pace. The same counts on engine.device = "cpu" in the same run.
2. Whisper on CUDA: what CTranslate2 loads (cuBLAS 12 and cuDNN 9 from the gpu extra's wheels),
   then tiny.en and base on the interpreter firmware, one 60 s recording and eight 10 s clips at
   once, engine.device = "cuda" against "cpu" in the same run.
"""

from __future__ import annotations

import asyncio
import os
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from appliance.audio import encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import concurrently
from appliance.client import AsyncClient, Client, tensors_call

CHUNK_S, RATE = 0.256, 16000
CHUNK = int(CHUNK_S * RATE)  # 4096 samples: 8 VAD frames
STREAM_COUNTS = (64, 256, 1024, 2048, 4096, 8192)


async def _paced(socket_path: str, first_id: int, streams: int, pcm: np.ndarray, seconds: float) -> list[float]:
    """`streams` sequences, each sending a chunk every CHUNK_S (the next one as soon as it is due, or at
    once when it fell behind); the lag of each answer after its chunk was due."""
    lags: list[float] = []
    started = time.perf_counter() + 0.5
    count = int(seconds / CHUNK_S)

    async def stream(i: int) -> None:
        client = AsyncClient(socket_path)
        offset = (i * 997) % (len(pcm) - CHUNK * count)
        await asyncio.sleep(max(0.0, started + (i % 64) * CHUNK_S / 64 - time.perf_counter()))  # spread in phase
        begin = time.perf_counter()
        try:
            for n in range(count):
                due = begin + n * CHUNK_S
                await asyncio.sleep(max(0.0, due - time.perf_counter()))
                chunk = pcm[offset + n * CHUNK : offset + (n + 1) * CHUNK]
                call = tensors_call("silero_vad", {"audio": chunk}, first_id + i, n == 0, n == count - 1)
                response = await client.send(call)
                assert response.status == 200, response.body[:200]
                lags.append(time.perf_counter() - due)
        finally:
            await client.close()

    await asyncio.gather(*(stream(i) for i in range(streams)))
    return lags


def _load_process(socket_path: str, first_id: int, streams: int, pcm: np.ndarray, seconds: float) -> list[float]:
    return asyncio.run(_paced(socket_path, first_id, streams, pcm, seconds))


def paced_streams(daemon: DaemonProcess, streams: int, pcm: np.ndarray, seconds: float) -> dict[str, Any]:
    processes = max(1, min(streams, (os.cpu_count() or 2) // 2))
    shares = [streams // processes + (1 if i < streams % processes else 0) for i in range(processes)]
    firsts = [1_000_000 * (i + 1) for i in range(processes)]
    with ProcessPoolExecutor(processes) as pool:
        lags = [
            lag
            for part in pool.map(
                _load_process,
                [str(daemon.socket)] * processes,
                firsts,
                shares,
                [pcm] * processes,
                [seconds] * processes,
            )
            for lag in part
        ]
    expected = streams * int(seconds / CHUNK_S)
    p99 = float(np.percentile(lags, 99)) if lags else float("inf")
    return {
        "streams": streams,
        "chunks": len(lags),
        "p50_ms": round(statistics.median(lags) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "real_time": len(lags) == expected and p99 <= CHUNK_S,
    }


def mean_batch(metrics: str) -> str:
    """appliance_batch_size's mean for the VAD, from /metrics."""
    total = count = 0.0
    for line in metrics.splitlines():
        if line.startswith("appliance_batch_size_sum") and "silero_vad" in line:
            total = float(line.split()[-1])
        if line.startswith("appliance_batch_size_count") and "silero_vad" in line:
            count = float(line.split()[-1])
    return f"{total / count:.1f}" if count else "n/a"


def live_streams(bundle_dir: Path, trusted: Path, work: Path, pcm: np.ndarray, seconds: float) -> list[str]:
    """The table rows: for each device, the stream counts until one is not served in real time."""
    rows = []
    for device in ("cuda", "cpu"):
        daemon = DaemonProcess(
            bundle_dir, trusted, work / f"streams-{device}", f'backend = "user"\n[engine]\ndevice = "{device}"\n', 0
        )
        try:
            for streams in STREAM_COUNTS:
                found = paced_streams(daemon, streams, pcm, seconds)
                with Client(str(daemon.socket)) as client:
                    batch = mean_batch(client.metrics())
                workers = len(daemon.status().get("workers") or []) or 1
                rows.append(
                    f"| {device} | {workers} | {streams} | {found['chunks']} | {found['p50_ms']} | {found['p99_ms']} "
                    f"| {batch} | {'yes' if found['real_time'] else 'no'} |"
                )
                print(rows[-1], flush=True)
                if not found["real_time"]:
                    break
        finally:
            daemon.stop()
    return rows


def cuda_libraries() -> str:
    """What CTranslate2's CUDA build finds: the wheels' libraries loaded, and its CUDA device count."""
    import ctranslate2

    from appliance.engine import nvidia_libs

    loaded, failed = nvidia_libs.preload()
    return (
        f"ctranslate2 {ctranslate2.__version__}: {ctranslate2.get_cuda_device_count()} CUDA devices; "
        f"loaded {', '.join(loaded) or 'nothing (no nvidia-cublas-cu12 / nvidia-cudnn-cu12 installed)'}"
        + (f"; not loaded: {'; '.join(failed)}" if failed else "")
    )


def whisper_cuda_vs_cpu(
    bundle_dir: Path,
    trusted: Path,
    work: Path,
    speech: np.ndarray,
    devices: tuple[str, ...] = ("cuda", "cpu"),
    clients: int = 8,
) -> list[str]:
    """60 s and `clients` x 10 s through the daemon, tiny.en and base, on each engine.device in turn."""
    recording = np.resize(speech, 60 * RATE).astype(np.float32)
    clips = [np.roll(recording, -i * 7 * RATE)[: 10 * RATE] for i in range(clients)]
    rows = []
    for device in devices:
        daemon = DaemonProcess(bundle_dir, trusted, work / f"whisper-{device}", f'[engine]\ndevice = "{device}"\n')
        try:
            with Client(str(daemon.socket), timeout=600) as client:
                for model in ("whisper_tiny_en", "whisper_base"):
                    client.transcribe(encode_wav(clips[0], RATE), model)  # warm
                    t = time.perf_counter()
                    client.transcribe(encode_wav(recording, RATE), model)
                    one = time.perf_counter() - t

                    def ask(i: int, model: str = model) -> None:
                        with Client(str(daemon.socket), timeout=600) as own:
                            own.transcribe(encode_wav(clips[i], RATE), model)

                    many = concurrently(clients, ask)
                    rows.append(f"| {model} | {device} | {one:.3f} | {many:.3f} |")
                    print(rows[-1], flush=True)
        finally:
            daemon.stop()
    return rows
