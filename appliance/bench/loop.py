"""The event loop kept free (issue 42): a client on the Unix socket asks /v2/health/ready every 20 ms,
timed, while each piece of work that once ran on the daemon's event loop runs back to back, on a daemon
whose transports are in the engine process (server.workers = 1: the loop that answers the health check
is the one that takes the work). Phases of `seconds` each:

    quiet        nothing else
    language     language ID over 65,536 texts in one infer, its bound (fastText, off the loop past 64 texts)
    live-bytes   a live stream's 2 s chunks sent as encoded WAV files (BYTES), decoded off the loop
    bodies       a JSON infer body nested 100,000 deep and a 60 MiB JSON list (parsed off the loop)

Each phase: the health check's p50, p99 and max latency, its failed requests, the work done and the
daemon's CPU seconds. On 2 cores the work's threads contend with the loop for the CPU and the GIL: a
phase's latency is that contention and any stall together.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from appliance import firmware
from appliance.audio import encode_wav
from appliance.bench.daemon import DaemonProcess
from appliance.bench.hostile import GoodClients, hostile_bodies, latency, until
from appliance.client import Call, Client, tensors_call

PHASES = ("quiet", "language", "live-bytes", "bodies")
TEXTS = np.array([b"a"] * 65_536, dtype=object)  # the most texts one infer takes: 65,536 characters in all
CHUNK_SAMPLES = 64 * 512  # 2.048 s at 16 kHz: whole VAD frames, as a live stream's chunks must be


def loop_bench(bundle: Path, trusted: Path, workdir: Path, seconds: float) -> dict[str, Any]:
    models = firmware.verify(bundle, trusted).manifest.models
    speech_model = next(m.name for m in models if m.kind == "speech_to_text")
    language_model = next(m.name for m in models if m.kind == "language_identification")
    daemon = DaemonProcess(bundle, trusted, workdir, workers=1, label="loop")
    results: dict[str, Any] = {"workers": 1, "seconds": seconds, "phases": {}}
    rng = np.random.default_rng(2)
    quiet_wav = encode_wav((rng.standard_normal(CHUNK_SAMPLES) * 1e-3).astype(np.float32), 16_000)
    try:
        with Client(str(daemon.socket), timeout=120) as client:
            live = _LiveBytes(client, speech_model, quiet_wav)
            work = {
                "quiet": lambda: time.sleep(0.1),
                "language": lambda: _ok(client.send(tensors_call(language_model, {"text": TEXTS}))),
                "live-bytes": live.chunk,
                "bodies": lambda: hostile_bodies(daemon),
            }
            with GoodClients(daemon, Call("GET", "/v2/health/ready"), quic=False) as good:
                for phase in PHASES:
                    good.phase, cpu = phase, daemon.tree_cpu_s()
                    done = until(seconds, work[phase])
                    time.sleep(0.5)  # requests sent during the phase come back
                    unix = latency(good.times.get(("unix", phase), []), good.failed.get(("unix", phase), 0))
                    results["phases"][phase] = {
                        "work": done if phase != "quiet" else 0,
                        "daemon_cpu_s": round(daemon.tree_cpu_s() - cpu, 2),
                        "unix": unix,
                    }
            live.end()
    finally:
        daemon.stop()
    return results


class _LiveBytes:
    """One live stream of the speech model, each chunk an encoded WAV file (near silence: the VAD closes
    nothing, so no decode of speech joins the measure)."""

    def __init__(self, client: Client, model: str, wav: bytes) -> None:
        self.client, self.model, self.wav, self.sent = client, model, wav, 0

    def chunk(self, end: bool = False) -> None:
        audio = {"audio": np.array([self.wav], dtype=object)}
        call = tensors_call(self.model, audio, sequence_id="loop-bench", start=not self.sent, end=end)
        _ok(self.client.send(call))
        self.sent += 1

    def end(self) -> None:
        if self.sent:
            self.chunk(end=True)


def _ok(response: Any) -> None:
    if response.status != 200:
        raise RuntimeError(f"the bench's work was refused: {response.status} {response.body[:200]!r}")


def report(r: dict[str, Any]) -> list[str]:
    quiet = r["phases"]["quiet"]["unix"]
    lines = [
        f"  the health check while work once on the event loop runs ({r['workers']} worker: the engine's loop "
        f"serves the socket; {r['seconds']} s a phase, a check every 20 ms): p50 / p99 / max ms, failed"
    ]
    for phase, m in r["phases"].items():
        t = m["unix"]
        lines.append(
            f"    {phase:10} {t['p50_ms']} / {t['p99_ms']} / {t['max_ms']} ms ({t['p99_ms'] / (quiet['p99_ms'] or 1.0):.1f}x"
            f" quiet's p99), {t['failed']} of {t['requests']} failed; {m['work']} done; daemon CPU {m['daemon_cpu_s']} s"
        )
    return lines
