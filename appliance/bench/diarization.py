"""Diarization (who spoke when) on the daemon against the same pipeline run in this process: the VAD
frame by frame on ONNX Runtime (bench/measure.py RawVad) with the daemon's segment tracker, the GE2E
graph of the bundle on every window, the same clustering (kinds/diarize.py). On a conversation of two
espeak-ng voices taking turns: one minute of audio, four clients with a minute each at once (against
four in turn in process), and the daemon's resident memory while it diarizes a 30-minute recording."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.audio import decode_audio, encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import RawVad, concurrently
from appliance.client import Call, Client
from appliance.client.http import checked
from appliance.config import EngineConfig, VadConfig
from appliance.engine.onnx_cpu import session
from appliance.kinds import diarize, speaker_mels
from appliance.kinds.segments import SegmentTracker

RATE = 16000
VOICES = ("en+f2", "en-us+m3")
SENTENCES = [
    "Please call me back when you get home tonight.",
    "I would like to order a cup of coffee and a sandwich.",
    "Turn off the lights in the kitchen please.",
    "We are going to the beach this weekend, if the weather holds.",
    "Where is the nearest pharmacy?",
    "Dinner is ready, please wash your hands.",
]
BATCH = 32  # windows per graph call in process, as the firmware's max_batch


def conversation(seconds: float) -> np.ndarray:
    """Two voices taking turns of one sentence, 0.4 s apart, `seconds` long."""
    turns = [
        decode_audio(
            subprocess.run(["espeak-ng", "-v", v, "--stdout", s], capture_output=True, check=True).stdout, RATE
        )
        for i, s in enumerate(SENTENCES)
        for v in (VOICES[i % 2],)
    ]
    gap = np.zeros(int(0.4 * RATE), np.float32)
    one = np.concatenate([piece for turn in turns for piece in (turn, gap)])
    return np.tile(one, int(np.ceil(seconds * RATE / len(one))))[: int(seconds * RATE)]


class InProcess:
    """The daemon's diarization pipeline, called directly."""

    def __init__(self, bundle_dir: Path, trusted: Path) -> None:
        bundle = firmware.verify(bundle_dir, trusted)
        vad = next(m for m in bundle.manifest.models if m.kind == "vad")
        speakers = next(m for m in bundle.manifest.models if m.kind == "speaker_embedding")
        self.vad, self.frame = RawVad(bundle.artifact(vad.file), vad), vad.vad_audio.frame_samples
        self.graph = session(bundle.artifact(speakers.file), EngineConfig().threads)  # as the daemon's default
        self.window = int(speakers.parameters["window_frames"]) * speaker_mels.HOP  # type: ignore[arg-type]
        self.step = int(speakers.parameters["step_frames"]) * speaker_mels.HOP  # type: ignore[arg-type]

    def __call__(self, samples: np.ndarray) -> int:
        """The recording's speaker count."""
        self.vad.reset()
        tracker = SegmentTracker(self.frame, RATE, VadConfig())
        usable = len(samples) // self.frame * self.frame
        spans = tracker.feed(np.array([self.vad(f) for f in samples[:usable].reshape(-1, self.frame)]))
        spans += tracker.finish(len(samples))
        bounds = diarize.windows(spans, self.window, self.step, RATE)
        prints = []
        for at in range(0, len(bounds), BATCH):
            mels = [speaker_mels.mels(speaker_mels.louder(samples[s:e]))[:-1] for s, e, _ in bounds[at : at + BATCH]]
            for length in sorted({len(m) for m in mels}):  # one length per call, as the daemon's queue groups them
                prints.append(self.graph.run(None, {"mels": np.stack([m for m in mels if len(m) == length])})[0])
        labels = diarize.clusters(
            np.concatenate(prints), [b[2] for b in bounds], self.step / RATE, diarize.SpeakerCount()
        )
        return int(labels.max()) + 1


def _diarize(client: Client, model: str, wav: bytes) -> dict[str, Any]:
    return dict(checked(client.send(Call("POST", f"/v2/models/{model}/diarize", wav))).json())


def diarization_bench(bundle_dir: Path, trusted: Path, workdir: Path) -> dict[str, Any]:
    model = next(m.name for m in firmware.verify(bundle_dir, trusted).manifest.models if m.kind == "speaker_embedding")
    minute = conversation(60)
    wav = encode_wav(minute, RATE)
    local = InProcess(bundle_dir, trusted)
    daemon = DaemonProcess(bundle_dir, trusted, workdir, label="diarization")
    results: dict[str, Any] = {"model": model}
    try:
        client = Client(str(daemon.socket), timeout=1800)
        _diarize(client, model, wav)  # warm both once
        local(minute)
        ours, theirs, counts = [], [], set()
        for _ in range(3):
            t = time.perf_counter()
            counts.add(_diarize(client, model, wav)["speakers"])
            ours.append(time.perf_counter() - t)
            t = time.perf_counter()
            counts.add(local(minute))
            theirs.append(time.perf_counter() - t)
        results["minute"] = {
            "daemon_s": round(min(ours), 2),
            "in_process_s": round(min(theirs), 2),
            "speakers": sorted(counts),
        }

        def ask(i: int) -> None:
            with Client(str(daemon.socket), timeout=1800) as own:
                _diarize(own, model, wav)

        together = concurrently(4, ask)
        t = time.perf_counter()
        for _ in range(4):
            local(minute)
        results["clients4"] = {
            "daemon_s": round(together, 2),
            "in_process_in_turn_s": round(time.perf_counter() - t, 2),
        }
        results["memory_30min"] = _memory(daemon, client, model, encode_wav(conversation(30 * 60), RATE))
        client.close()
    finally:
        daemon.stop()
    return results


def _memory(daemon: DaemonProcess, client: Client, model: str, wav: bytes) -> dict[str, float]:
    """The daemon's resident memory before and at its peak while it diarizes the recording (sampled
    every 50 ms), and how long it took."""
    before, peak, done = daemon.rss_mib(), [0.0], threading.Event()

    def watch() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], daemon.rss_mib())
            time.sleep(0.05)

    watcher = threading.Thread(target=watch)
    watcher.start()
    t = time.perf_counter()
    try:
        _diarize(client, model, wav)
    finally:
        done.set()
        watcher.join()
    return {
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(peak[0], 1),
        "seconds": round(time.perf_counter() - t, 1),
    }


def report(s: dict[str, Any]) -> list[str]:
    minute, many, memory = s["minute"], s["clients4"], s["memory_30min"]
    return [
        f"  diarization ({s['model']}, GE2E on ONNX Runtime) against the same pipeline in process",
        f"    1 min of two voices: daemon {minute['daemon_s']} s, in process {minute['in_process_s']} s "
        f"(speaker counts found: {minute['speakers']})",
        f"    4 clients x 1 min at once: daemon {many['daemon_s']} s, in process in turn {many['in_process_in_turn_s']} s",
        f"    30 min recording: {memory['seconds']} s; resident memory {memory['rss_before_mib']} MiB before, "
        f"{memory['rss_peak_mib']} MiB at its peak",
    ]
