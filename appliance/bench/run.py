"""The bench in order: raw against the daemon for one frame, 16 streams, a 10-minute recording, memory,
transports, QUIC handshakes, Hypercorn, the connection cache; one dict of figures (report.py prints it)."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.audio import encode_wav, to_frames
from appliance.bench.conncache import connection_cache
from appliance.bench.daemon import DaemonProcess
from appliance.bench.generic import generic_batching
from appliance.bench.hypercorn_peer import hypercorn_peer
from appliance.bench.measure import (
    RawVad,
    compare_transports,
    concurrent_streams,
    handshakes,
    live_during_recording,
    stats_us,
    test_audio,
    timed,
)
from appliance.client import Client


def run(bundle_dir: Path, trusted_keys: Path, seconds: float) -> dict[str, Any]:
    """Every figure, with `seconds` per measurement."""
    bundle = firmware.verify(bundle_dir, trusted_keys)
    spec = next(m for m in bundle.manifest.models if m.kind == "vad")
    raw = RawVad(bundle.artifact(spec.file), spec)
    frame_samples, rate = spec.vad_audio.frame_samples, spec.vad_audio.sample_rate
    rng = np.random.default_rng(1)
    frame = (rng.standard_normal(frame_samples) * 0.1).astype(np.float32)
    results: dict[str, Any] = {
        "firmware": f"{bundle.manifest.name} {bundle.manifest.version}",
        "cpu_count": os.cpu_count(),
    }
    with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
        daemon = DaemonProcess(bundle_dir, trusted_keys, Path(tmp), label="vad")
        try:
            client = Client(str(daemon.socket))
            client.speech_probs(frame, sequence_id=1, start=True)
            # 1. one stream, one frame per request: raw and daemon in alternating rounds
            polling = Client(str(daemon.socket), busy_poll_s=0.005)
            raw_times, daemon_times, polled_times = [], [], []
            for _ in range(4):
                raw_times += timed(lambda: raw(frame), seconds / 4)
                daemon_times += timed(lambda: client.speech_probs(frame, sequence_id=1), seconds / 4)
                polled_times += timed(lambda: polling.speech_probs(frame, sequence_id=1), seconds / 4)
            polling.speech_probs(frame, sequence_id=1, end=True)  # an open sequence would hold the daemon's stop
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
            frames, elapsed = asyncio.run(concurrent_streams(str(daemon.socket), 16, chunk, seconds))
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
            client.speech_probs(audio)
            sharded = time.perf_counter() - t
            results["recording_600s"] = {"one_sequence_s": round(sequential, 3), "daemon_sharded_s": round(sharded, 3)}
            results["recording_ratio"] = round(sequential / sharded, 2)
            # 4. a live stream while a 34-minute recording is segmented (the largest that fits the body limit)
            wav = encode_wav(test_audio(34 * 60, rate), rate)
            results["live_during_recording"] = live_during_recording(
                str(daemon.socket), frame, wav, frame_samples / rate
            )
            results["rss_mib"] = round(daemon.rss_mib(), 1)
            client.close()
            results["transports"] = asyncio.run(compare_transports(daemon, frame, seconds))
            results["quic_handshake"] = asyncio.run(handshakes(daemon.quic, str(daemon.cert)))
            results["hypercorn"] = hypercorn_peer(bundle.artifact(spec.file), daemon, frame, seconds, Path(tmp))
        finally:
            daemon.stop()
        results["conncache"] = connection_cache(bundle_dir, trusted_keys, Path(tmp) / "conncache", frame, seconds)
    results["generic"] = generic_batching(seconds)
    return results
