"""Kokoro's voices and the interpreter's Portuguese, the daemon against Kokoro on plain ONNX Runtime
(default session options, as kokoro-onnx loads it) one request at a time, on the same token ids.

    speech       8 concurrent requests of a 3-sentence Portuguese paragraph: requests/s against the peer's
    lanes        the engine alone: 8 sentences one after another on one session of every thread, against
                 side by side on single-threaded sessions (what the daemon does with a batch): the graph
                 takes one shard per call, so side by side is its only batching
    first audio  a 5-sentence paragraph streamed as PCM: time to its first audio bytes (median of 5),
                 against the peer on that first sentence alone
    interpreter  English speech streamed live in real time (256 ms chunks) to the pipeline, target pt:
                 from the end of each spoken sentence to its first Portuguese audio, p50 and max; the
                 daemon's resident memory with the interpreter firmware loaded
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from appliance import firmware
from appliance.bench.daemon import DaemonProcess
from appliance.bench.measure import concurrently
from appliance.bench.speech import pipeline, timed_once
from appliance.client import Client
from appliance.firmware.voices import STYLE_DIM, STYLE_ROWS, language_of, voice_file
from appliance.kinds.kokoro import kokoro_ids
from appliance.kinds.phonemes import phonemize
from appliance.kinds.text import clauses, grouped_by_sentence

PARAGRAPH = (
    "O tempo vai estar ensolarado amanhã de manhã. Visitamos o museu no fim de semana e vimos muitas pinturas. "
    "Por favor, apague as luzes quando sair da sala."
)
FIVE = PARAGRAPH + " A reunião foi transferida para quinta-feira à tarde. Ela lê um livro todas as noites."
CLIENTS = 8
ROUNDS = 2  # of each measurement, the peer's and the daemon's alternating; the best of each counts
TARGETS = {"speech_ratio": 1.0, "first_audio_ratio": 1.3}


class Peer:
    """Kokoro on ONNX Runtime as a program would call it: one session, one sentence per run."""

    def __init__(self, bundle: firmware.Bundle, model: firmware.ModelSpec, threads: int | None = None) -> None:
        params = model.parameters
        options = ort.SessionOptions()
        if threads is not None:
            options.intra_op_num_threads = threads
        graph = str(bundle.artifact(f"{model.file}/{params['graph']}"))
        self.session = ort.InferenceSession(graph, options, providers=["CPUExecutionProvider"])
        vocab = json.loads(bundle.artifact(f"{model.file}/{params['vocab']}").read_text(encoding="utf-8"))["vocab"]
        self.vocab = {str(k): int(v) for k, v in vocab.items()}
        voices = params["voices"]
        assert isinstance(voices, list)
        self.voice = str(voices[0])
        self.espeak_voice = language_of(self.voice, model.name).espeak_voice
        styles = np.fromfile(bundle.artifact(f"{model.file}/{voice_file(self.voice)}"), "<f4")
        self.styles = styles.reshape(STYLE_ROWS, STYLE_DIM)

    def sentences(self, text: str) -> list[list[int]]:
        phonemes = asyncio.run(phonemize(clauses(text), self.espeak_voice, tie=True))
        grouped = grouped_by_sentence(phonemes, lambda p: p.ends_sentence)
        return [kokoro_ids(self.vocab, [x for p in s for x in p.phonemes]) for s in grouped]

    def __call__(self, ids: list[int]) -> int:
        """One sentence's audio made; its sample count."""
        style = self.styles[min(len(ids) - 2, STYLE_ROWS - 1)].reshape(1, STYLE_DIM)
        feeds = {"tokens": np.array([ids], np.int64), "style": style, "speed": np.array([1.0], np.float32)}
        return int(self.session.run(None, feeds)[0].size)


def speech(bundle: firmware.Bundle, socket: str, model: firmware.ModelSpec, threads: int) -> dict[str, Any]:
    peer = Peer(bundle, model)
    ids = peer.sentences(PARAGRAPH)
    first_ids = peer.sentences(FIVE)[0]
    failed: list[str] = []

    def daemon_first() -> float:
        with Client(socket, timeout=300) as client:
            t0 = time.perf_counter()
            pieces = client.stream_speech(FIVE, voice=peer.voice, model=model.name, response_format="pcm")
            next(iter(pieces))
            took = time.perf_counter() - t0
            for _ in pieces:
                pass
        return took

    def say(i: int) -> None:
        # a connection per request: the peer's turn outlasts an idle keep-alive connection on a loaded machine
        try:
            with Client(socket, timeout=300) as client:
                if not client.speech(PARAGRAPH, voice=peer.voice, model=model.name, response_format="pcm"):
                    failed.append("no audio")
        except Exception as exc:  # a failed request must not count as a fast one
            failed.append(repr(exc))

    for sentence in ids:
        peer(sentence)
    say(0)
    peer_s, daemon_s, peer_first, first = [], [], [], []
    for _ in range(ROUNDS):  # alternating, so a busy moment of this machine hits both alike
        peer_s.append(timed_once(lambda: [peer(s) for _ in range(CLIENTS) for s in ids]))
        daemon_s.append(concurrently(CLIENTS, say))
        peer_first.append(timed_once(lambda: peer(first_ids)))
        first.append(daemon_first())
    if failed:
        raise RuntimeError(f"{len(failed)} daemon requests failed: {failed[0]}")
    return {
        "voice": peer.voice,
        "peer_requests_per_s": round(CLIENTS / min(peer_s), 2),
        "daemon_requests_per_s": round(CLIENTS / min(daemon_s), 2),
        "speech_ratio": round(min(peer_s) / min(daemon_s), 2),
        "first_audio_ms": round(statistics.median(first) * 1000, 1),
        "peer_first_sentence_ms": round(statistics.median(peer_first) * 1000, 1),
        "first_audio_ratio": round(statistics.median(first) / statistics.median(peer_first), 2),
        "lanes": lanes(bundle, model, ids * 3, threads),
    }


def lanes(bundle: firmware.Bundle, model: firmware.ModelSpec, ids: list[list[int]], threads: int) -> dict[str, Any]:
    """The graph alone: shards one after another on a session of every thread, against `threads`
    single-threaded sessions side by side (the daemon's batch on the CPU)."""
    shared = Peer(bundle, model, threads)
    singles = [Peer(bundle, model, 1) for _ in range(threads)]
    shared(ids[0])
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:

        def side_by_side() -> None:
            list(pool.map(lambda i: singles[i % threads](ids[i]), range(len(ids))))

        side_by_side()
        one_after_another = min(timed_once(lambda: [shared(x) for x in ids]) for _ in range(2))
        beside = min(timed_once(side_by_side) for _ in range(2))
    return {
        "shards": len(ids),
        "one_after_another_s": round(one_after_another, 2),
        "side_by_side_s": round(beside, 2),
        "threads": threads,
    }


def run(bundle_dir: Path, trusted_keys: Path, workdir: Path) -> dict[str, Any]:
    bundle = firmware.verify(bundle_dir, trusted_keys)
    by_kind = {m.kind: m for m in reversed(bundle.manifest.models)}
    threads = os.cpu_count() or 1
    results: dict[str, Any] = {"engine_threads": threads}
    daemon = DaemonProcess(bundle_dir, trusted_keys, workdir, f"[engine]\nthreads = {threads}\n", label="voices")
    try:
        results["rss_mib"] = round(daemon.rss_mib(), 1)  # every model loaded and warmed up
        results["kokoro"] = speech(bundle, str(daemon.socket), by_kind["kokoro_speech"], threads)
        if "speech_pipeline" in by_kind:
            results["interpreter_pt"] = pipeline(str(daemon.socket), by_kind["speech_pipeline"].name, {"target": "pt"})
    finally:
        daemon.stop()
    return results


def report(r: dict[str, Any]) -> list[str]:
    mark = {True: "ok", False: "MISSED"}
    k = r["kokoro"]
    lanes_ = k["lanes"]
    lines = [
        f"  kokoro ({k['voice']}), {CLIENTS} concurrent 3-sentence requests  {k['daemon_requests_per_s']} req/s vs "
        f"Kokoro on ONNX Runtime one at a time {k['peer_requests_per_s']} req/s = {k['speech_ratio']}x   target >= "
        f"{TARGETS['speech_ratio']}x   {mark[k['speech_ratio'] >= TARGETS['speech_ratio']]}",
        f"  kokoro, the graph alone on {lanes_['shards']} sentences: one after another on {lanes_['threads']} threads "
        f"{lanes_['one_after_another_s']} s, side by side on single-threaded sessions {lanes_['side_by_side_s']} s",
        f"  kokoro, first audio of a 5-sentence paragraph  median {k['first_audio_ms']} ms vs the engine on its first "
        f"sentence {k['peer_first_sentence_ms']} ms = {k['first_audio_ratio']}x   target <= "
        f"{TARGETS['first_audio_ratio']}x   {mark[k['first_audio_ratio'] <= TARGETS['first_audio_ratio']]}",
        f"  resident memory of the daemon with this firmware loaded: {r['rss_mib']} MiB",
    ]
    if p := r.get("interpreter_pt"):
        lines.append(
            f"  interpreter en->pt, live in real time: end of a spoken sentence to its first Portuguese audio  p50 "
            f"{p['end_to_audio_p50_ms']} ms, max {p['end_to_audio_max_ms']} ms ({p['answered']} of {p['sentences']})"
        )
    return lines
