"""`appliance run` (the daemon in the foreground) and `appliance bench` (the daemon against raw ONNX Runtime)."""

from __future__ import annotations

import argparse
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from appliance.bench.report import report
from appliance.cli.options import add_config, add_trusted_keys, command
from appliance.errors import ApplianceError


def cmd_run(args: argparse.Namespace) -> int:
    from appliance import daemon  # lazy: ONNX Runtime and the engines load only for `run`

    return daemon.run(args.config)


# The bench's parts and the model kinds each needs in the firmware.
BENCH_PARTS = {
    "vad": {"vad"},
    "workers": {"vad"},
    "https": {"vad"},
    "hostile": {"vad"},
    "loop": {"language_identification"},
    "transcription": {"speech_to_text"},
    "live": {"speech_to_text"},
    "speech": {"speech_synthesis", "text_translation", "speech_pipeline"},
    "voices": {"kokoro_speech"},
    "memory": {"speech_pipeline"},
    "wake": {"wake_word"},
    "diarization": {"speaker_embedding"},
}
# Parts that take an hour or more run only when named.
LONG_PARTS = {"memory"}


def cmd_bench(args: argparse.Namespace) -> int:
    # lazy: the bench loads ONNX Runtime and aioquic in this process
    from appliance import firmware
    from appliance.bench.daemon import MEMORY_AT_STOP
    from appliance.bench.run import run

    kinds = {m.kind for m in firmware.verify(args.bundle, args.trusted_keys).manifest.models}
    parts = set(args.part.split(","))
    unknown = parts - {"all", *BENCH_PARTS}
    if unknown:
        raise ApplianceError(f"--part: no part {sorted(unknown)[0]!r} (parts: all, {', '.join(BENCH_PARTS)})")
    wanted = {
        part
        for part, part_kinds in BENCH_PARTS.items()
        if (part in parts or ("all" in parts and part not in LONG_PARTS)) and kinds & part_kinds
    }
    results: dict[str, Any] = {}
    if "vad" in wanted:  # the VAD's figures are the document's top level, as they always were
        results = run(args.bundle, args.trusted_keys, args.seconds)
        print("\n".join(report(results)))
    for part, (title, measure, report_of) in _measured_parts(args).items():
        if part in wanted:
            with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
                results[part] = measure(Path(tmp))
            print(f"appliance bench: {args.bundle}, {title}")
            print("\n".join(report_of(results[part])))
    print("appliance bench: resident memory of every process as each daemon stopped (MiB)")
    for label, processes in MEMORY_AT_STOP:
        print(f"  {label}: " + ", ".join(f"{name} {mib}" for name, mib in processes.items()))
    results["memory_at_stop"] = [{"daemon": label, **processes} for label, processes in MEMORY_AT_STOP]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


Part = tuple[str, Callable[[Path], Any], Callable[[Any], list[str]]]


def _measured_parts(args: argparse.Namespace) -> dict[str, Part]:
    """Each part after the VAD's: its title, its measurement in a work directory, its report."""
    from appliance.bench import (
        diarization,
        hostile,
        https,
        live,
        loop,
        memory,
        speech,
        transcription,
        voices,
        wake,
        workers,
    )
    from appliance.config import EngineConfig

    bundle, trusted, seconds, threads = args.bundle, args.trusted_keys, args.seconds, EngineConfig().threads
    return {
        "workers": (
            "protocol workers",
            lambda tmp: workers.workers_scaling(bundle, trusted, tmp, seconds),
            workers.report,
        ),
        "https": (
            "HTTPS on TCP against QUIC and the Unix socket",
            lambda tmp: https.https_bench(bundle, trusted, tmp, seconds),
            https.report,
        ),
        "hostile": (
            "good clients under attack",
            lambda tmp: hostile.hostile_bench(bundle, trusted, tmp, max(3.0, seconds)),
            hostile.report,
        ),
        "loop": (
            "the event loop kept free",
            lambda tmp: loop.loop_bench(bundle, trusted, tmp, max(3.0, seconds)),
            loop.report,
        ),
        "transcription": (
            "speech to text",
            lambda tmp: transcription.transcription_bench(bundle, trusted, tmp, threads),
            transcription.report,
        ),
        "live": (
            "live speech over Realtime and Wyoming",
            lambda tmp: live.live_bench(bundle, trusted, tmp, threads),
            live.report,
        ),
        "speech": ("speech and translation", lambda tmp: speech.run(bundle, trusted, tmp), speech.report),
        "voices": ("Kokoro voices", lambda tmp: voices.run(bundle, trusted, tmp), voices.report),
        "memory": (
            f"resident memory over {args.minutes} min of mixed use",
            lambda tmp: memory.memory_soak(bundle, trusted, tmp, args.minutes),
            memory.report,
        ),
        "wake": ("wake words over Wyoming", lambda tmp: wake.wake_bench(bundle, trusted, tmp), wake.report),
        "diarization": (
            "who spoke (diarization)",
            lambda tmp: diarization.diarization_bench(bundle, trusted, tmp),
            diarization.report,
        ),
    }


def add_run(sub: Any) -> None:
    run = command(sub, "run", "run the daemon in the foreground")
    add_config(run)
    run.set_defaults(func=cmd_run)


def add_bench(sub: Any) -> None:
    bench = command(sub, "bench", "benchmark the daemon against raw ONNX Runtime, side by side")
    bench.add_argument(
        "--bundle", type=Path, default=Path("build/firmware/default"), help="the firmware bundle to serve"
    )
    add_trusted_keys(bench, default=Path("keys/trusted"))
    bench.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    bench.add_argument("--json", type=Path, help="also write the figures here")
    bench.add_argument("--minutes", type=float, default=120.0, help="memory: how long the mixed use runs")
    bench.add_argument(
        "--part",
        default="all",
        help="what to measure, by the firmware's models: all, or a comma-separated list of vad (the VAD, the "
        "transports, one's own model), workers (protocol workers, 2 against 1), https (HTTPS against QUIC, the "
        "Unix socket and Hypercorn over TLS), hostile (good clients' latency under each attack), transcription (speech to text against faster-whisper), live (Realtime and Wyoming against "
        "wyoming-faster-whisper), speech (speech, "
        "translation and the pipeline), voices (Kokoro), wake (wake words over Wyoming against pymicro-wakeword), "
        "diarization (who spoke, against the same pipeline in process), memory (resident memory over --minutes of "
        "mixed use; only when named)",
    )
    bench.set_defaults(func=cmd_bench)
