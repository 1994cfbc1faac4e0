"""`appliance call transcribe FILE` and `appliance call live FILE`: a speech_to_text model's text."""

from __future__ import annotations

import argparse
import base64
import io
import json
import sys
import time
import wave
from collections.abc import Callable, Iterator
from typing import cast

import numpy as np

from appliance.cli.options import read_input
from appliance.client import Client
from appliance.client.http import checked, form_call
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
    if args.speakers is not None:
        return speakers(client, args, audio)
    params = {"task": "translate" if args.translate else "transcribe", "response_format": args.format or "text"}
    if args.language:
        params["language"] = args.language
    if args.stream:
        for line in client.stream_transcribe(audio, model_for(args), **params):
            print(json.dumps(line), flush=True)
        return
    body = client.transcribe(audio, model_for(args), **params).body.decode()
    print(body if not body.endswith("\n") else body[:-1])


def speakers(client: Client, args: argparse.Namespace, audio: bytes) -> None:
    """Who said what, through OpenAI's diarized transcription: `--speakers` alone finds how many, `N`
    asks for N; `--known NAME=CLIP` (2 to 10 s of that voice alone) names a speaker. Text: a line per
    turn ("A  1.20-4.05  text"); --format verbose_json, srt or vtt: the daemon's answer."""
    fields = [("model", model_for(args)), ("response_format", args.format or "text")]
    if args.format in (None, "text", "json"):
        fields[1] = ("response_format", "diarized_json")
    if args.language:
        fields.append(("language", args.language))
    if args.speakers:
        fields += [("min_speakers", args.speakers), ("max_speakers", args.speakers)]
    else:
        fields.append(("min_speakers", "1"))  # a diarization with its count found
    for known in args.known or []:
        name, _, path = known.partition("=")
        if not name or not path:
            raise ApplianceError(f"--known {known!r}: give NAME=CLIP (a 2 to 10 s recording of that voice)")
        clip = base64.b64encode(read_input(path)).decode()
        fields += [("known_speaker_names[]", name), ("known_speaker_references[]", f"data:audio/wav;base64,{clip}")]
    answer = checked(client.send(form_call("/v1/audio/transcriptions", fields, {"file": audio})))
    if fields[1][1] != "diarized_json":
        print(answer.body.decode().rstrip("\n"))
        return
    for segment in answer.json()["segments"]:
        print(f"{segment['speaker']}  {segment['start']:.2f}-{segment['end']:.2f}  {segment['text']}")


def live(client: Client, args: argparse.Namespace, source: str) -> None:
    """Sends a recording as a live stream, in real time, 256 ms at a time; prints each segment when
    final. `source` is a file, or `-`: standard input as it arrives, a WAV (16-bit PCM, any rate and
    channels) or raw 16-bit mono PCM at 16 kHz (`arecord -f S16_LE -r 16000 -c 1 | appliance call live -`)."""
    model, sequence = model_for(args), int(time.time() * 1000) % (1 << 62) or 1
    extra = {"task": "translate"} if args.translate else {}
    if args.language:
        extra["language"] = args.language
    chunks = stdin_chunks(cast(io.BufferedReader, sys.stdin.buffer)) if source == "-" else file_chunks(source)
    sent = 0
    for sent, (chunk, last) in enumerate(as_heard(chunks), 1):
        out = client.live(chunk, model, sequence, start=sent == 1, end=last, **extra)
        for text, start, end in zip(out["text"], out["start"], out["end"]):
            print(f"[{float(start):8.2f} -> {float(end):8.2f}] {bytes(text).decode()}", flush=True)
    if not sent:
        raise ApplianceError(f"{'standard input' if source == '-' else source}: no audio in it: nothing to send")


def as_heard(
    chunks: Iterator[np.ndarray],
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> Iterator[tuple[np.ndarray, bool]]:
    """Each chunk with whether it is the last, once it has been "heard": the n-th not before n chunks'
    time has passed since the first was asked for (a file goes at speech pace, as a microphone's would;
    standard input that arrives at that pace waits no more)."""
    started, sent = clock(), 0
    chunk = next(chunks, None)
    while chunk is not None:
        following = next(chunks, None)  # one ahead: the last chunk ends the sequence
        sent += 1
        sleep(max(0.0, started + sent * CHUNK_SAMPLES / RATE - clock()))
        yield chunk, following is None
        chunk = following


def file_chunks(path: str) -> Iterator[np.ndarray]:
    from appliance.audio import decode_audio  # lazy: libsndfile and soxr load only for the calls that decode

    try:
        samples = decode_audio(read_input(path), RATE)
    except ApiError as exc:
        raise ApplianceError(f"{path}: {exc.message}") from None
    samples = np.pad(samples, (0, -len(samples) % CHUNK_SAMPLES))
    for i in range(len(samples) // CHUNK_SAMPLES):
        yield samples[i * CHUNK_SAMPLES : (i + 1) * CHUNK_SAMPLES]


def stdin_chunks(reader: io.BufferedReader) -> Iterator[np.ndarray]:
    """Standard input as 16 kHz chunks of CHUNK_SAMPLES, each as soon as it has arrived."""
    import soxr  # lazy: as decode_audio

    rate, channels = RATE, 1
    read: Callable[[int], bytes] = lambda frames: reader.read(frames * 2)  # noqa: E731 raw PCM16 mono at 16 kHz
    if reader.peek(4)[:4] == b"RIFF":
        try:
            wav = wave.open(reader, "rb")
        except (wave.Error, EOFError) as exc:
            raise ApplianceError(f"standard input: not a WAV this can read ({exc}); send 16-bit PCM") from None
        if wav.getsampwidth() != 2:
            raise ApplianceError(f"standard input: a {8 * wav.getsampwidth()}-bit WAV; send 16-bit PCM")
        rate, channels = wav.getframerate(), wav.getnchannels()
        read = wav.readframes
    resampler = None if rate == RATE else soxr.ResampleStream(rate, RATE, 1)
    frames = int(rate * CHUNK_SAMPLES / RATE)
    pending = np.zeros(0, np.float32)
    while data := read(frames):
        pcm = np.frombuffer(data[: len(data) // (2 * channels) * 2 * channels], "<i2").astype(np.float32) / 32768.0
        mono = pcm.reshape(-1, channels).mean(axis=1, dtype=np.float32)
        pending = np.concatenate([pending, mono if resampler is None else resampler.resample_chunk(mono)])
        while len(pending) >= CHUNK_SAMPLES:
            yield pending[:CHUNK_SAMPLES]
            pending = pending[CHUNK_SAMPLES:]
    if resampler is not None:
        pending = np.concatenate([pending, resampler.resample_chunk(np.zeros(0, np.float32), last=True)])
    if len(pending):
        yield np.pad(pending, (0, CHUNK_SAMPLES - len(pending)))
