"""Speech to text against faster-whisper, side by side in one run, on the same CTranslate2 model (the
bundle's Whisper tiny.en directory), compute type (int8) and thread count, on espeak-ng speech:
one 60 s recording (the daemon vs BatchedInferencePipeline), 8 clients of a 10 s clip at once (vs
WhisperModel.transcribe on each clip in turn), a live stream's final-text latency, and the daemon's
resident memory with the VAD and both Whisper models loaded.

faster-whisper and jiwer are the bench's (dev) dependencies; the daemon never imports them."""

from __future__ import annotations

import re
import statistics
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance.audio import decode_audio, encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import concurrently
from appliance.client import Client

RATE, CHUNK = 16000, 4096  # 256 ms live chunks
MODEL = "whisper_tiny_en"
SENTENCES = [
    "Please call me back when you get home tonight.",
    "I would like to order a cup of coffee and a sandwich.",
    "Turn off the lights in the kitchen please.",
    "We are going to the beach this weekend.",
    "Where is the nearest pharmacy?",
    "Dinner is ready, please wash your hands.",
    "The children are playing football in the park.",
    "I forgot my umbrella at the office.",
]


def spoken(text: str) -> np.ndarray:
    """espeak-ng speech at 16 kHz, trimmed to where the voice is (so a sentence's end is known)."""
    samples = decode_audio(
        subprocess.run(["espeak-ng", "--stdout", text], capture_output=True, check=True).stdout, RATE
    )
    loud = np.flatnonzero(np.abs(samples) > 0.01)
    return samples[loud[0] : loud[-1] + 1]


def speech(seconds: float, first: int = 0, gap_s: float = 1.0) -> tuple[np.ndarray, list[float]]:
    """Sentences in turn with pauses, `seconds` long; and where each sentence ends (seconds)."""
    parts, ends, position, i = [np.zeros(int(0.5 * RATE), np.float32)], [], int(0.5 * RATE), first
    while position < seconds * RATE:
        voice = spoken(SENTENCES[i % len(SENTENCES)])
        position += len(voice)
        ends.append(position / RATE)
        parts += [voice, np.zeros(int(gap_s * RATE), np.float32)]
        position += int(gap_s * RATE)
        i += 1
    return np.concatenate(parts)[: int(seconds * RATE)], [e for e in ends if e < seconds]


def words(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9' ]", " ", text.lower()).split())


def transcription_bench(bundle_dir: Path, trusted_keys: Path, workdir: Path, threads: int) -> dict[str, Any]:
    import jiwer
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    peer = WhisperModel(str(bundle_dir / "models" / MODEL), device="cpu", compute_type="int8", cpu_threads=threads)
    batched = BatchedInferencePipeline(peer)
    recording, _ = speech(60)
    clips = [speech(10, first=i)[0] for i in range(8)]
    daemon = DaemonProcess(bundle_dir, trusted_keys, workdir, f"[engine]\nthreads = {threads}\n", label="transcription")
    results: dict[str, Any] = {"model": MODEL, "threads": threads, "compute_type": "int8"}
    try:
        client = Client(str(daemon.socket), timeout=600)
        wav = encode_wav(recording, RATE)
        client.transcribe(encode_wav(clips[0], RATE), MODEL)  # warm both once
        list(batched.transcribe(clips[0], language="en")[0])
        # 1. one 60 s recording: alternate, best of 3 each
        ours, theirs, our_text, their_text = [], [], "", ""
        our_cpu, their_cpu = [], []
        for _ in range(3):
            t, c = time.perf_counter(), daemon.cpu_s()
            our_text = client.transcribe(wav, MODEL, response_format="text").body.decode()
            ours.append(time.perf_counter() - t)
            our_cpu.append(daemon.cpu_s() - c)
            t, c = time.perf_counter(), time.process_time()
            their_text = " ".join(s.text for s in batched.transcribe(recording, language="en", batch_size=8)[0])
            theirs.append(time.perf_counter() - t)
            their_cpu.append(time.process_time() - c)
        results["recording_60s"] = {
            "daemon_s": round(min(ours), 3),
            "batched_pipeline_s": round(min(theirs), 3),
            "speedup": round(min(theirs) / min(ours), 2),
            "daemon_cpu_s": round(min(our_cpu), 2),
            "batched_pipeline_cpu_s": round(min(their_cpu), 2),
            "text_difference_wer": round(float(jiwer.wer(words(their_text), words(our_text))), 3),
        }

        # 2. eight clients with a 10 s clip each, at once; the peer transcribes them one after another
        def ask(i: int) -> None:
            with Client(str(daemon.socket), timeout=600) as own:
                own.transcribe(encode_wav(clips[i], RATE), MODEL)

        c = daemon.cpu_s()
        together = concurrently(8, ask)
        together_cpu = daemon.cpu_s() - c
        each = []
        c = time.process_time()
        for clip in clips:  # a 10 s clip is one window: its encode and decode
            t = time.perf_counter()
            list(peer.transcribe(clip, language="en")[0])
            each.append(time.perf_counter() - t)
        in_turn, in_turn_cpu = sum(each), time.process_time() - c
        results["clients8_10s"] = {
            "daemon_s": round(together, 3),
            "transcribe_in_turn_s": round(in_turn, 3),
            "speedup": round(in_turn / together, 2),
            "daemon_cpu_s": round(together_cpu, 2),
            "transcribe_in_turn_cpu_s": round(in_turn_cpu, 2),
        }
        # 3. a live stream in real time: when each sentence's final text arrives after the sentence ended,
        # against one window's encode and decode (faster-whisper's, a 10 s clip, median) in this run
        results["live"] = live_latency(client, *speech(40))
        results["live"]["window_ms"] = round(statistics.median(each) * 1000)
        results["rss_mib"] = round(daemon.rss_mib(), 1)
        client.close()
    finally:
        daemon.stop()
    return results


def live_latency(client: Client, samples: np.ndarray, ends: list[float]) -> dict[str, Any]:
    samples = np.pad(samples, (0, -len(samples) % CHUNK))
    count, started = len(samples) // CHUNK, time.monotonic()
    delays: list[float] = []
    for i in range(count):
        sent = started + (i + 1) * CHUNK / RATE  # the chunk is sent once it has been "heard"
        time.sleep(max(0.0, sent - time.monotonic()))
        out = client.live(samples[i * CHUNK : (i + 1) * CHUNK], MODEL, 77, start=i == 0, end=i == count - 1)
        arrived = time.monotonic() - started
        for end in out["end"]:  # a final segment: how long after the sentence it closes had ended
            spoken_end = min(ends, key=lambda e: abs(e - float(end)))
            delays.append(arrived - spoken_end)
    return {
        "segments": len(delays),
        "p50_ms": round(statistics.median(delays) * 1000) if delays else None,
        "max_ms": round(max(delays) * 1000) if delays else None,
    }


def report(s: dict[str, Any]) -> list[str]:
    """The figures of transcription_bench, each against its target."""
    mark = {True: "ok", False: "MISSED"}
    rec, many, live = s["recording_60s"], s["clients8_10s"], s["live"]
    p50 = live["p50_ms"]
    return [
        f"  speech to text: {s['model']}, {s['compute_type']}, {s['threads']} threads, against faster-whisper on the same model",
        f"    60 s recording: daemon {rec['daemon_s']} s, BatchedInferencePipeline {rec['batched_pipeline_s']} s = "
        f"{rec['speedup']}x   target >= 1.2x   {mark[rec['speedup'] >= 1.2]}   (texts differ by WER {rec['text_difference_wer']}; "
        f"CPU {rec['daemon_cpu_s']} s against {rec['batched_pipeline_cpu_s']} s)",
        f"    8 clients x 10 s at once: daemon {many['daemon_s']} s, WhisperModel.transcribe in turn "
        f"{many['transcribe_in_turn_s']} s = {many['speedup']}x   target >= 2x   {mark[many['speedup'] >= 2]}   "
        f"(CPU {many['daemon_cpu_s']} s against {many['transcribe_in_turn_cpu_s']} s)",
        f"    live stream: final text {p50} ms (p50, max {live['max_ms']} ms, {live['segments']} segments) after the "
        f"sentence ended; one window's encode+decode {live['window_ms']} ms   target p50 <= 0.8x that = "
        f"{0.8 * live['window_ms']:.0f} ms   {mark[p50 is not None and p50 <= 0.8 * live['window_ms']]}",
        f"    resident memory, VAD + both Whisper models: {s['rss_mib']} MiB   target <= 1024 MiB   "
        f"{mark[s['rss_mib'] <= 1024]}",
    ]
