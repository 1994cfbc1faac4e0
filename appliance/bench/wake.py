"""The wake-word bench: how many satellites' streams the box hears in real time over Wyoming, against
pymicro-wakeword run alone per stream (its own frontend and detector, as a wake service per satellite
runs it), on the same audio (espeak-ng talk with "okay nabu" said once per stream).

    capacity     N streams sent as fast as the box takes them (each connection sends its next chunk once
                 the box read the last): audio seconds heard per second of wall time, which is how many
                 real-time streams it could serve. The peer: N threads, each one stream on pymicro-wakeword.
    paced        the firmware's bound of streams at the pace of speech, 64 ms chunks (wyoming-satellite's
                 1024 samples): from each stream's audio-stop to the box's answer to a ping after it (how far
                 behind real time the box is at the end), and whether each heard its wake word.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncClient
from wyoming.ping import Ping, Pong
from wyoming.wake import Detect, Detection

from appliance import firmware
from appliance.audio import to_pcm16
from appliance.bench.daemon import DaemonProcess
from appliance.bench.live import paced
from appliance.bench.transcription import RATE, SENTENCES, spoken
from appliance.client import Client

WAKE = "okay_nabu"
STREAM_S = 10.0
CHUNK = 1024 * 2  # bytes: wyoming-satellite's 1024 samples a chunk
COUNTS = (8, 32)


def stream_audio(index: int) -> bytes:
    """STREAM_S of talk with "Okay Nabu" said once between pauses, at a place of its own per stream."""
    pause = np.zeros(int(0.4 * RATE), np.float32)
    talk = np.concatenate([spoken(SENTENCES[(index + i) % len(SENTENCES)]) for i in range(4)])
    at = int((0.5 + index % 5) * RATE)
    audio = np.concatenate([talk[:at], pause, spoken("Okay Nabu."), pause, talk[at:]])
    audio = np.concatenate([audio, np.zeros(int(STREAM_S * RATE), np.float32)])[: int(STREAM_S * RATE)]
    return to_pcm16(audio)


async def box_stream(uri: str, audio: bytes, step_s: float) -> tuple[bool, float]:
    """One satellite: whether it heard its wake word, and the wait from audio-stop to the pong after it."""
    async with AsyncClient.from_uri(uri) as client:
        await client.write_event(Detect(names=[WAKE]).event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())

        async def send(piece: bytes) -> None:
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=piece).event())

        heard = False

        async def read() -> None:
            nonlocal heard
            while (event := await client.read_event()) is not None and not Pong.is_type(event.type):
                heard |= Detection.is_type(event.type)

        reader = asyncio.create_task(read())
        await paced(send, audio, CHUNK, step_s)
        await client.write_event(AudioStop().event())
        stopped = time.perf_counter()
        await client.write_event(Ping().event())
        await asyncio.wait_for(reader, 120)
        return heard, time.perf_counter() - stopped


def box_run(uri: str, audios: list[bytes], step_s: float) -> tuple[float, list[tuple[bool, float]]]:
    async def run() -> list[tuple[bool, float]]:
        return await asyncio.gather(*(box_stream(uri, audio, step_s) for audio in audios))

    began = time.perf_counter()
    found = asyncio.run(run())
    return time.perf_counter() - began, found


def peer_run(audios: list[bytes]) -> tuple[float, int]:
    """pymicro-wakeword alone per stream: a thread each, as fast as it goes; the wall time and how many
    streams heard their wake word."""
    from pymicro_wakeword import MicroWakeWord, MicroWakeWordFeatures, Model

    heard = [False] * len(audios)

    def one(index: int) -> None:
        detector, features = MicroWakeWord.from_builtin(Model(WAKE)), MicroWakeWordFeatures()
        audio = audios[index]
        for offset in range(0, len(audio), CHUNK):
            for frame in features.process_streaming(audio[offset : offset + CHUNK]):
                heard[index] |= bool(detector.process_streaming(frame))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(audios))]
    began = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - began, sum(heard)


def wake_bench(bundle_dir: Path, trusted_keys: Path, workdir: Path) -> dict[str, Any]:
    bundle = firmware.verify(bundle_dir, trusted_keys)
    model = next(m for m in bundle.manifest.models if m.kind == "wake_word")
    bound = int(str(model.parameters["max_streams"]))
    audios = [stream_audio(i) for i in range(max(*COUNTS, bound))]
    results: dict[str, Any] = {"model": model.name, "stream_s": STREAM_S, "bound": bound, "capacity": {}}
    satellites = f"[wyoming]\nmax_connections = {2 * bound}\nmax_connections_per_peer = {2 * bound}\n"  # all from here
    daemon = DaemonProcess(bundle_dir, trusted_keys, workdir / "box", satellites, label="wake")
    try:
        uri = f"unix://{daemon.socket.parent / 'wyoming.sock'}"
        box_run(uri, audios[:1], 0.0)  # warm once
        client = Client(str(daemon.socket))
        for count in COUNTS:
            calls = engine_calls(client, model.name)
            wall, found = box_run(uri, audios[:count], 0.0)
            batched = engine_calls(client, model.name)
            peer_wall, peer_heard = peer_run(audios[:count])
            results["capacity"][count] = {
                "box_streams": round(count * STREAM_S / wall, 1),
                "peer_streams": round(count * STREAM_S / peer_wall, 1),
                "box_heard": sum(heard for heard, _ in found),
                "box_mean_batch": round((batched[1] - calls[1]) / max(1, batched[0] - calls[0]), 1),
                "peer_heard": peer_heard,
            }
        _, found = box_run(uri, audios[:bound], CHUNK / 2 / RATE)
        lags = sorted(lag for _, lag in found)
        results["paced"] = {
            "streams": bound,
            "heard": sum(heard for heard, _ in found),
            "lag_p50_ms": round(statistics.median(lags) * 1000),
            "lag_max_ms": round(lags[-1] * 1000),
        }
        results["rss_mib"] = round(daemon.rss_mib(), 1)
        client.close()
    finally:
        daemon.stop()
    return results


def engine_calls(client: Client, model: str) -> tuple[int, int]:
    """The model's engine calls and the streams' chunks they heard, so far (from /metrics)."""
    text = client.metrics()
    found = [
        re.search(rf'appliance_batch_size_{part}\{{model="{model}"[^}}]*\}} ([0-9.e+]+)', text)
        for part in ("count", "sum")
    ]
    return int(float(found[0][1])) if found[0] else 0, int(float(found[1][1])) if found[1] else 0


def report(r: dict[str, Any]) -> list[str]:
    lines = [f"  wake words ({r['model']}, {WAKE}), {r['stream_s']:.0f} s streams of talk with the wake word once:"]
    for count, c in r["capacity"].items():
        lines.append(
            f"    {count} streams as fast as taken: box {c['box_streams']} real-time streams' worth "
            f"(heard {c['box_heard']} of {count}; {c['box_mean_batch']} streams an engine call), pymicro-wakeword alone per stream (a thread each) "
            f"{c['peer_streams']} (heard {c['peer_heard']})"
        )
    p = r["paced"]
    lines.append(
        f"    {p['streams']} streams (the firmware's bound) at the pace of speech: audio-stop to the answer after it "
        f"p50 {p['lag_p50_ms']} ms, max {p['lag_max_ms']} ms; heard {p['heard']} of {p['streams']}"
    )
    lines.append(f"    resident memory of the daemon at the end: {r['rss_mib']} MiB")
    return lines
