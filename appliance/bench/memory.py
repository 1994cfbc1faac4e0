"""Resident memory over hours of mixed use on the interpreter firmware: what a room does to a box.

Four clients at once, each in a loop, each call a different size from the one before: Realtime
interpreter sessions in conversation mode (40 s of speech at real-time pace), recordings of 5 to 60 s
transcribed by both Whispers in every response format, speech of 1 to 60 words in the Piper and Kokoro
voices, translations both ways and recordings through the speech pipeline, plus the room page. The
engine process and the processes it started are sampled every `sample_s`; the figures are the tree's
resident memory at ready, after one hour, and its slope over the second hour."""

from __future__ import annotations

import asyncio
import random
import statistics
import threading
import time
from pathlib import Path
from typing import Any

from appliance.audio import encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.live import OUTPUT_RATE, realtime_session
from appliance.bench.transcription import RATE, SENTENCES, speech
from appliance.client import Client
from appliance.client.http import Call, checked
from appliance.engine.heap import TRIM_INTERVAL_S

WORDS = " ".join(SENTENCES).replace(".", "").replace("?", "").replace(",", "").split()
FORMATS = ["json", "verbose_json", "srt", "vtt", "text"]


def sentence(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count)).capitalize() + "."


def calls(socket: str, rng: random.Random, stop: threading.Event, done: list[int]) -> None:
    """One client's loop of stateless calls, a new size each time."""
    with Client(socket, timeout=600) as client:
        while not stop.is_set():
            choice = rng.randrange(5)
            if choice == 0:
                audio = encode_wav(speech(rng.uniform(5, 60), first=rng.randrange(8))[0], RATE)
                model = rng.choice(["whisper_tiny_en", "whisper_base"])
                client.transcribe(audio, model, response_format=rng.choice(FORMATS))
            elif choice == 1:
                voice = rng.choice(["joe", "pf_dora", "pm_alex"])
                text = sentence(rng, rng.randint(1, 60))
                client.speech(text, voice, response_format=rng.choice(["wav", "mp3", "flac", "pcm"]))
            elif choice == 2:
                texts = [sentence(rng, rng.randint(1, 40)) for _ in range(rng.randint(1, 16))]
                client.translate(texts, "en", "pt")
            elif choice == 3:
                audio = encode_wav(speech(rng.uniform(5, 30), first=rng.randrange(8))[0], RATE)
                list(client.stream_interpret(audio, "interpreter"))
            else:
                checked(client.send(Call("GET", "/")))  # the room page
                client.health()
            done[0] += 1


def sessions(socket: Path, stop: threading.Event, done: list[int]) -> None:
    """Realtime interpreter sessions in conversation mode, one after another."""
    interpreter = {"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}}}
    while not stop.is_set():
        asyncio.run(realtime_session(socket, "model=interpreter", interpreter, "response.output_audio.delta"))
        done[0] += 1


def memory_soak(
    bundle_dir: Path, trusted_keys: Path, workdir: Path, minutes: float, sample_s: float = 30.0
) -> dict[str, Any]:
    daemon = DaemonProcess(bundle_dir, trusted_keys, workdir / "box", label="memory")
    samples: list[tuple[float, float]] = []
    stop, done = threading.Event(), [0]
    try:
        began = time.monotonic()

        def sample() -> None:
            samples.append((round((time.monotonic() - began) / 60, 2), round(sum(daemon.rss_by_process().values()), 1)))

        sample()
        workers = [threading.Thread(target=sessions, args=(daemon.socket, stop, done), daemon=True)]
        workers += [
            threading.Thread(target=calls, args=(str(daemon.socket), random.Random(i), stop, done), daemon=True)
            for i in range(3)
        ]
        for worker in workers:
            worker.start()
        while time.monotonic() - began < minutes * 60:
            time.sleep(sample_s)
            sample()
            print(f"memory: {samples[-1][0]} min, {daemon.rss_by_process()}, {done[0]} calls", flush=True)
        stop.set()
        for worker in workers:
            worker.join(600)
        time.sleep(TRIM_INTERVAL_S + 5)  # idle: what the daemon keeps after the work, past its next heap trim
        retained = round(sum(daemon.rss_by_process().values()), 1)
    finally:
        daemon.stop()
    return {"minutes": minutes, "calls": done[0], "samples": samples, "retained": retained}


def report(r: dict[str, Any]) -> list[str]:
    samples = r["samples"]
    ready = samples[0][1]

    def window(minute: float) -> list[float]:
        """The samples of the ten minutes before `minute`: one sample under load is noise (a batch's peak)."""
        return [rss for at, rss in samples if minute - 10 < at <= minute]

    lines = [
        f"  {r['calls']} calls in {r['minutes']} min; the daemon's processes at ready: {ready} MiB, idle after the "
        f"load: {r['retained']} MiB ({r['retained'] / ready:.2f}x); under load (calls under way), the median and "
        "range of the ten minutes before:"
    ]
    for minute in (15, 30, 60, 90, 120):
        if samples[-1][0] >= minute and (held := window(minute)):
            median = statistics.median(held)
            lines.append(
                f"    {minute} min: {median:.0f} MiB ({median / ready:.2f}x ready), {min(held):.0f} to {max(held):.0f}"
            )
    second_hour = [(at, rss) for at, rss in samples if 60 <= at <= 120]
    if samples[-1][0] >= 120 and len(second_hour) > 2:
        slope = statistics.linear_regression(*zip(*second_hour)).slope
        lines.append(
            f"    second hour: {slope:+.2f} MiB per minute (least squares)   target 1 h <= 1.3x ready, flat after"
        )
    return lines
