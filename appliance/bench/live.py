"""Live speech over the protocols voice apps speak, side by side in one run, on the interpreter firmware:

    realtime     OpenAI's Realtime API (a transcription session, 20 ms frames at 24 kHz, the box's own
                 VAD as the server VAD), a recording of sentences streamed at real-time pace: from the
                 end of each spoken sentence to its `completed` transcript, p50 and max; with OpenAI's
                 default turn_detection, and with a quicker one (QUICK_TURNS)
    wyoming      each sentence sent as a Wyoming client does (transcribe, audio-start, 100 ms chunks at
                 real-time pace, audio-stop when the sentence ends): audio-stop to the transcript,
                 the box against wyoming-faster-whisper on the same CTranslate2 model directory
    wyoming_ha   the same as Home Assistant's voice pipeline sends it: audio-stop once its segmenter has
                 heard HA_SILENCE_S of silence after the sentence (the silence sent too)
    window       the yardstick: one window's encode+decode of the same model (faster-whisper on a
                 sentence, median), measured in the same run
    clients8     8 Wyoming clients at once, a 10 s clip each sent at once: the total time, the box
                 against wyoming-faster-whisper serving the same 8
    interpreter  the interpreter session (`?model=<the speech pipeline>&target=pt`): from the end of each
                 spoken sentence to the first audio of its translation, p50 and max

wyoming-faster-whisper and faster-whisper are the bench's (dev) dependencies; the daemon never imports them.
"""

from __future__ import annotations

import asyncio
import base64
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import soxr
from wyoming.asr import Transcribe, Transcript, TranscriptChunk, TranscriptStop
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncClient
from wyoming.info import Describe

from appliance import firmware
from appliance.audio import to_pcm16
from appliance.bench.daemon import DaemonProcess
from appliance.bench.transcription import MODEL, RATE, SENTENCES, speech, spoken, words

WYOMING_CHUNK_S = 0.1
# Home Assistant's voice pipeline ends the audio it streams to speech-to-text once its segmenter
# (assist_pipeline's VoiceCommandSegmenter) has heard this much silence after the command
HA_SILENCE_S = 0.7
REALTIME_FRAME_S = 0.02
OUTPUT_RATE = 24000
COMPLETED = "conversation.item.input_audio_transcription.completed"
# a voice app that wants its turns closed sooner than OpenAI's defaults (500 ms of silence, 300 ms padding)
QUICK_TURNS = {"type": "server_vad", "silence_duration_ms": 200, "prefix_padding_ms": 100}


def percentiles(delays: list[float], wanted: int) -> dict[str, Any]:
    """p50, p95 and max in ms of the delays measured, and how many of the `wanted` were."""
    return {
        "count": len(delays),
        "wanted": wanted,
        "p50_ms": round(statistics.median(delays) * 1000) if delays else None,
        "p95_ms": round(statistics.quantiles(delays, n=20, method="inclusive")[18] * 1000) if len(delays) > 1 else None,
        "max_ms": round(max(delays) * 1000) if delays else None,
    }


async def paced(send: Callable[[bytes], Awaitable[None]], audio: bytes, step: int, step_s: float) -> float:
    """`audio` sent in pieces of `step` bytes, each once it has been "heard"; when the sending began."""
    began = time.monotonic()
    for index, offset in enumerate(range(0, len(audio), step)):
        await asyncio.sleep(max(0.0, began + index * step_s - time.monotonic()))
        await send(audio[offset : offset + step])
    return began


async def realtime_session(socket: Path, query: str, session: dict[str, Any], until: str) -> dict[str, Any]:
    """A recording of sentences streamed to /v1/realtime?`query` at real-time pace: from the end of each
    spoken sentence to its turn's `until` event (its completed transcript, or the first audio of the
    response that follows it). A turn is the sentence whose end is nearest its speech_stopped."""
    from websockets.asyncio.client import unix_connect

    samples, ends = speech(40)
    audio = to_pcm16(soxr.resample(np.concatenate([samples, np.zeros(RATE, np.float32)]), RATE, OUTPUT_RATE))
    sentence_of: dict[str, int] = {}  # a turn's item: the sentence it heard
    arrived: dict[int, float] = {}  # a sentence: when its `until` event came
    transcribed: dict[int, float] = {}  # and its completed transcript
    async with unix_connect(str(socket), f"ws://appliance/v1/realtime?{query}", max_size=None) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": session}))

        async def receive() -> None:
            answering: dict[str, str] = {}  # a response: the turn it answers (the session goes on meanwhile)
            answered = set()
            async for message in ws:
                event, now = json.loads(message), time.monotonic()
                kind, turn = event["type"], event.get("item_id")
                if kind == "error":
                    raise RuntimeError(f"realtime error: {event['error']}")
                if kind == "input_audio_buffer.speech_stopped":
                    end_s = event["audio_end_ms"] / 1000
                    sentence_of[turn] = min(range(len(ends)), key=lambda i: abs(ends[i] - end_s))
                elif kind == "conversation.item.input_audio_transcription.completed" and turn in sentence_of:
                    transcribed.setdefault(sentence_of[turn], now)
                elif kind == "response.created":
                    answering[event["response"]["id"]] = event["response"]["metadata"]["input_item_id"]
                elif kind == "response.output_audio.delta":
                    turn = answering.get(event["response_id"])
                if kind == until and turn in sentence_of and turn not in answered:
                    answered.add(turn)
                    arrived.setdefault(sentence_of[turn], now)
                    if len(arrived) == len(ends):
                        return

        async def send(piece: bytes) -> None:
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(piece).decode()}))

        receiver = asyncio.create_task(receive())
        began = await paced(send, audio, int(OUTPUT_RATE * 2 * REALTIME_FRAME_S), REALTIME_FRAME_S)
        try:
            await asyncio.wait_for(receiver, 60)
        except TimeoutError:
            receiver.cancel()
    figures = percentiles([at - (began + ends[i]) for i, at in arrived.items()], len(ends))
    if until != COMPLETED:  # where the time goes: the transcript, then the rest
        figures["transcript"] = percentiles([at - (began + ends[i]) for i, at in transcribed.items()], len(ends))
    return figures


async def wyoming_transcript(
    uri: str, samples: np.ndarray, real_time: bool, speech_s: float | None = None
) -> tuple[str, float, dict[str, float]]:
    """One transcription as a Wyoming client asks it: its text, seconds from audio-stop to it, and
    seconds from the end of the speech (`speech_s` into the audio; else its end) to the first
    transcript-chunk ("chunk") and to transcript-stop ("stop"), where the server streams them."""
    async with AsyncClient.from_uri(uri) as client:
        arrived: dict[str, float] = {}

        async def read() -> str:  # beside the sender: a chunk streamed while the audio still comes is seen then
            while (event := await client.read_event()) is not None:
                now = time.monotonic()
                if TranscriptChunk.is_type(event.type):
                    arrived.setdefault("chunk", now)
                elif TranscriptStop.is_type(event.type):
                    arrived.setdefault("stop", now)
                elif Transcript.is_type(event.type):
                    arrived["transcript"] = now
                    return Transcript.from_event(event).text
            raise RuntimeError(f"{uri}: closed before the transcript")

        reader = asyncio.create_task(read())
        await client.write_event(Transcribe(language="en").event())
        await client.write_event(AudioStart(rate=RATE, width=2, channels=1).event())

        async def send(piece: bytes) -> None:
            await client.write_event(AudioChunk(rate=RATE, width=2, channels=1, audio=piece).event())

        # at real-time pace, or all at once (a pace of 0)
        step = int(RATE * 2 * WYOMING_CHUNK_S)
        began = await paced(send, to_pcm16(samples), step, WYOMING_CHUNK_S if real_time else 0.0)
        await client.write_event(AudioStop().event())
        stopped = time.monotonic()
        text = await reader
        spoken = began + (speech_s if speech_s is not None else len(samples) / RATE)
        streamed: dict[str, float] = {k: arrived[k] - spoken for k in ("chunk", "stop") if k in arrived}
        return text, arrived["transcript"] - stopped, streamed


def wyoming_sentences(
    uri: str, sentences: list[np.ndarray], silence_s: float = 0.0
) -> tuple[dict[str, Any], list[str]]:
    """Each sentence at real-time pace, one after another, `silence_s` of silence after it: audio-stop
    to transcript, and (where the server streams it) the end of the speech to the first transcript-chunk
    and to transcript-stop; and the texts."""
    delays, texts, streamed = [], [], []
    for samples in sentences:
        then = np.concatenate([samples, np.zeros(int(silence_s * RATE), np.float32)])
        text, delay, timed = asyncio.run(wyoming_transcript(uri, then, True, len(samples) / RATE))
        delays.append(delay)
        texts.append(text)
        streamed.append(timed)
    figures = percentiles(delays, len(sentences))
    for name in ("chunk", "stop"):
        figures[f"speech_end_to_{name}"] = percentiles([t[name] for t in streamed if name in t], len(sentences))
    return figures, texts


def wyoming_together(uri: str, clips: list[np.ndarray]) -> tuple[float, list[str]]:
    """Every clip from a client of its own at once: the seconds until the last transcript; the texts."""

    async def run() -> list[tuple[str, float, dict[str, float]]]:
        return await asyncio.gather(*(wyoming_transcript(uri, clip, real_time=False) for clip in clips))

    began = time.monotonic()
    done = asyncio.run(run())
    return time.monotonic() - began, [text for text, _, _ in done]


class WyomingPeer:
    """wyoming-faster-whisper on a Unix socket, on the bundle's CTranslate2 model directory."""

    def __init__(self, model_dir: Path, workdir: Path, threads: int, beam_size: int) -> None:
        self.socket = workdir / "peer.sock"
        self.uri = f"unix://{self.socket}"
        args = ["--uri", self.uri, "--model", str(model_dir), "--data-dir", str(workdir), "--language", "en"]
        args += ["--compute-type", "int8", "--cpu-threads", str(threads), "--beam-size", str(beam_size)]
        self.log = (workdir / "peer.log").open("w")  # its INFO lines (every transcript) kept out of the report
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "wyoming_faster_whisper", *args, "--local-files-only"], stderr=self.log
        )
        deadline = time.monotonic() + 120
        while not self._answers():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("wyoming-faster-whisper did not start")
            time.sleep(0.2)

    def _answers(self) -> bool:
        async def describe() -> bool:
            async with AsyncClient.from_uri(self.uri) as client:
                await client.write_event(Describe().event())
                return await client.read_event() is not None

        try:
            return self.socket.exists() and asyncio.run(describe())
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def live_bench(bundle_dir: Path, trusted_keys: Path, workdir: Path, threads: int) -> dict[str, Any]:
    import jiwer
    from faster_whisper import WhisperModel

    bundle = firmware.verify(bundle_dir, trusted_keys)
    by_kind = {m.kind: m for m in bundle.manifest.models}
    whisper = next(m for m in bundle.manifest.models if m.name == MODEL)
    beam_size = int(str(whisper.parameters.get("beam_size", 5)))
    sentences = [spoken(s) for s in SENTENCES]
    clips = [speech(10, first=i)[0] for i in range(8)]
    results: dict[str, Any] = {"model": MODEL, "threads": threads, "beam_size": beam_size}

    # the yardstick: one window's encode+decode (a sentence is one window), faster-whisper, median
    window = WhisperModel(str(bundle_dir / "models" / MODEL), device="cpu", compute_type="int8", cpu_threads=threads)
    list(window.transcribe(sentences[0], language="en", beam_size=beam_size)[0])
    each = []
    for samples in sentences:
        t = time.perf_counter()
        list(window.transcribe(samples, language="en", beam_size=beam_size)[0])
        each.append(time.perf_counter() - t)
    results["window_ms"] = round(statistics.median(each) * 1000)
    del window

    daemon = DaemonProcess(bundle_dir, trusted_keys, workdir / "box", f"[engine]\nthreads = {threads}\n", label="live")
    try:
        box = f"unix://{daemon.socket.parent / 'wyoming.sock'}"
        asyncio.run(wyoming_transcript(box, sentences[0], real_time=False))  # warm once

        def transcription(turn_detection: dict[str, Any] | None = None) -> dict[str, Any]:
            given = {"turn_detection": turn_detection} if turn_detection else {}
            audio_in = {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}, "transcription": {"model": MODEL}}
            return {"type": "transcription", "audio": {"input": {**audio_in, **given}}}

        results["realtime"] = asyncio.run(
            realtime_session(daemon.socket, "intent=transcription", transcription(), COMPLETED)
        )
        results["realtime_quick"] = asyncio.run(
            realtime_session(daemon.socket, "intent=transcription", transcription(QUICK_TURNS), COMPLETED)
        )
        results["wyoming"], box_texts = wyoming_sentences(box, sentences)
        results["wyoming_ha"], box_ha_texts = wyoming_sentences(box, sentences, HA_SILENCE_S)
        results["clients8_s"], box_clip_texts = wyoming_together(box, clips)
        if "speech_pipeline" in by_kind:
            interpreter = {
                "type": "realtime",
                "audio": {"output": {"format": {"type": "audio/pcm", "rate": OUTPUT_RATE}}},
            }
            pipeline = by_kind["speech_pipeline"].name
            for key, query in (("interpreter", f"model={pipeline}&target=pt"), ("conversation", f"model={pipeline}")):
                # one way to Portuguese; conversation mode: each turn's language identified, into the other
                results[key] = asyncio.run(
                    realtime_session(daemon.socket, query, interpreter, "response.output_audio.delta")
                )
        results["rss_mib"] = round(daemon.rss_mib(), 1)
    finally:
        daemon.stop()

    peer = WyomingPeer(bundle_dir / "models" / MODEL, workdir, threads, beam_size)
    try:
        asyncio.run(wyoming_transcript(peer.uri, sentences[0], real_time=False))
        results["peer_wyoming"], peer_texts = wyoming_sentences(peer.uri, sentences)
        results["peer_wyoming_ha"], peer_ha_texts = wyoming_sentences(peer.uri, sentences, HA_SILENCE_S)
        results["peer_clients8_s"], peer_clip_texts = wyoming_together(peer.uri, clips)
    finally:
        peer.stop()
    reference = words(" ".join(SENTENCES))
    results["wer"] = {
        "box": round(float(jiwer.wer(reference, words(" ".join(box_texts)))), 3),
        "peer": round(float(jiwer.wer(reference, words(" ".join(peer_texts)))), 3),
        "box_ha": round(float(jiwer.wer(reference, words(" ".join(box_ha_texts)))), 3),
        "peer_ha": round(float(jiwer.wer(reference, words(" ".join(peer_ha_texts)))), 3),
        "clients8_box_vs_peer": round(
            float(jiwer.wer(words(" ".join(peer_clip_texts)), words(" ".join(box_clip_texts)))), 3
        ),
    }
    results["clients8_speedup"] = round(results["peer_clients8_s"] / results["clients8_s"], 2)
    for key in ("clients8_s", "peer_clients8_s"):
        results[key] = round(results[key], 3)
    return results


def report(r: dict[str, Any]) -> list[str]:
    """The figures of live_bench, each against its target."""
    mark = {True: "ok", False: "MISSED"}
    window = r["window_ms"]

    def latency(name: str, m: dict[str, Any], target: str = "") -> str:
        ok = m["p50_ms"] is not None and m["p50_ms"] <= window and m["count"] == m["wanted"]
        spread = f"p50 {m['p50_ms']} ms, p95 {m.get('p95_ms')} ms, max {m['max_ms']} ms"
        return f"    {name}: {spread} ({m['count']} of {m['wanted']} sentences)" + (
            f"   target p50 <= one window ({window} ms)   {mark[ok]}" if target else ""
        )

    lines = [
        f"  live protocols: {r['model']}, {r['threads']} threads, beam {r['beam_size']}; one window's "
        f"encode+decode (faster-whisper, a sentence, median) {window} ms",
        latency("Realtime, end of a spoken sentence to its completed transcript", r["realtime"], "target")
        + "   (OpenAI's default turn_detection: 500 ms of silence, 300 ms padding)",
        latency("the same, turn_detection of 200 ms of silence, 100 ms padding", r["realtime_quick"], "target"),
        latency("Wyoming, audio-stop to transcript: box", r["wyoming"], "target")
        + f"   (WER {r['wer']['box']} against the known text)",
        latency("Wyoming, audio-stop to transcript: wyoming-faster-whisper", r["peer_wyoming"])
        + f"   (WER {r['wer']['peer']})",
        latency(
            f"Wyoming as Home Assistant sends it ({HA_SILENCE_S} s of silence, then audio-stop): box",
            r["wyoming_ha"],
            "target",
        )
        + f"   (WER {r['wer']['box_ha']})",
        latency("the same: wyoming-faster-whisper", r["peer_wyoming_ha"]) + f"   (WER {r['wer']['peer_ha']})",
        latency(
            "the box's streamed transcript there, end of the speech to its first transcript-chunk",
            r["wyoming_ha"]["speech_end_to_chunk"],
        ),
        latency("and to transcript-stop", r["wyoming_ha"]["speech_end_to_stop"]),
        f"    8 Wyoming clients x 10 s at once: box {r['clients8_s']} s, wyoming-faster-whisper "
        f"{r['peer_clients8_s']} s = {r['clients8_speedup']}x   target >= 2x   {mark[r['clients8_speedup'] >= 2]}"
        f"   (texts differ by WER {r['wer']['clients8_box_vs_peer']})",
    ]
    for key, mode in (("interpreter", "one way (target=pt)"), ("conversation", "conversation mode (no target)")):
        if interpreter := r.get(key):
            heard = interpreter["transcript"]
            lines.append(
                latency(
                    f"interpreter session, {mode}, end of a spoken sentence to its first translated audio", interpreter
                )
                + f"   (to its transcript: p50 {heard['p50_ms']} ms, max {heard['max_ms']} ms)"
            )
    lines.append(f"    resident memory of the daemon at the end: {r['rss_mib']} MiB")
    return lines
