"""`appliance call transcribe FILE` and `appliance call live FILE`: a speech_to_text model's text."""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from appliance.client import Client
from appliance.errors import ApiError, ApplianceError

CHUNK_SAMPLES = 4096  # 256 ms at 16 kHz: a live stream's chunk
RATE = 16000
TINY, BASE = "whisper_tiny_en", "whisper_base"  # the voice firmware's models (firmware/voice.toml)
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")  # the daemon's answers (OpenAI's response formats)


def model_for(args: argparse.Namespace) -> str:
    """--model, else the voice firmware's: base translates and knows every language, tiny.en English only."""
    if args.model:
        return str(args.model)
    return BASE if args.translate or (args.language or "en") != "en" else TINY


def transcribe(client: Client, args: argparse.Namespace, audio: bytes) -> None:
    params = {"task": "translate" if args.translate else "transcribe", "response_format": args.format or "text"}
    if args.language:
        params["language"] = args.language
    if args.stream:
        for line in client.stream_transcribe(audio, model_for(args), **params):
            print(json.dumps(line), flush=True)
        return
    body = client.transcribe(audio, model_for(args), **params).body.decode()
    print(body if not body.endswith("\n") else body[:-1])


def live(client: Client, args: argparse.Namespace, audio: bytes) -> None:
    """Sends the file as a live stream, in real time, 256 ms at a time; prints each segment when final."""
    from appliance.audio import decode_audio  # lazy: libsndfile and soxr load only for the calls that decode

    try:
        samples = decode_audio(audio, RATE)
    except ApiError as exc:
        raise ApplianceError(f"{args.args[0]}: {exc.message}") from None
    samples = np.pad(samples, (0, -len(samples) % CHUNK_SAMPLES))
    model, sequence = model_for(args), int(time.time() * 1000) % (1 << 62) or 1
    extra = {"task": "translate"} if args.translate else {}
    if args.language:
        extra["language"] = args.language
    started = time.monotonic()
    count = len(samples) // CHUNK_SAMPLES
    for i in range(count):
        due = started + (i + 1) * CHUNK_SAMPLES / RATE  # a chunk is sent once it has been "heard"
        time.sleep(max(0.0, due - time.monotonic()))
        chunk = samples[i * CHUNK_SAMPLES : (i + 1) * CHUNK_SAMPLES]
        out = client.live(chunk, model, sequence, start=i == 0, end=i == count - 1, **extra)
        for text, start, end in zip(out["text"], out["start"], out["end"]):
            print(f"[{float(start):8.2f} -> {float(end):8.2f}] {bytes(text).decode()}", flush=True)
