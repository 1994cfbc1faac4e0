"""`appliance run` (the daemon in the foreground) and `appliance bench` (the daemon against raw ONNX Runtime)."""

from __future__ import annotations

import argparse
import json
import tempfile
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
    "transcription": {"speech_to_text"},
    "live": {"speech_to_text"},
    "speech": {"speech_synthesis", "text_translation", "speech_pipeline"},
    "voices": {"kokoro_speech"},
    "diarization": {"speaker_embedding"},
}


def cmd_bench(args: argparse.Namespace) -> int:
    # lazy: the bench loads ONNX Runtime and aioquic in this process
    from appliance import firmware
    from appliance.bench import diarization, hostile, https, live, speech, transcription, voices, workers
    from appliance.bench.daemon import MEMORY_AT_STOP
    from appliance.bench.run import run
    from appliance.config import EngineConfig

    kinds = {m.kind for m in firmware.verify(args.bundle, args.trusted_keys).manifest.models}
    parts = set(args.part.split(","))
    unknown = parts - {"all", *BENCH_PARTS}
    if unknown:
        raise ApplianceError(f"--part: no part {sorted(unknown)[0]!r} (parts: all, {', '.join(BENCH_PARTS)})")
    wanted = {
        part for part, part_kinds in BENCH_PARTS.items() if ("all" in parts or part in parts) and kinds & part_kinds
    }
    results: dict[str, Any] = {}
    if "vad" in wanted:
        results = run(args.bundle, args.trusted_keys, args.seconds)
        print("\n".join(report(results)))
    if "workers" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["workers"] = workers.workers_scaling(args.bundle, args.trusted_keys, Path(tmp), args.seconds)
        print(f"appliance bench: {args.bundle}, protocol workers")
        print("\n".join(workers.report(results["workers"])))
    if "https" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["https"] = https.https_bench(args.bundle, args.trusted_keys, Path(tmp), args.seconds)
        print(f"appliance bench: {args.bundle}, HTTPS on TCP against QUIC and the Unix socket")
        print("\n".join(https.report(results["https"])))
    if "hostile" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["hostile"] = hostile.hostile_bench(
                args.bundle, args.trusted_keys, Path(tmp), max(3.0, args.seconds)
            )
        print(f"appliance bench: {args.bundle}, good clients under attack")
        print("\n".join(hostile.report(results["hostile"])))
    if "transcription" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["transcription"] = transcription.transcription_bench(
                args.bundle, args.trusted_keys, Path(tmp), EngineConfig().threads
            )
        print(f"appliance bench: {args.bundle}, speech to text")
        print("\n".join(transcription.report(results["transcription"])))
    if "live" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["live"] = live.live_bench(args.bundle, args.trusted_keys, Path(tmp), EngineConfig().threads)
        print(f"appliance bench: {args.bundle}, live speech over Realtime and Wyoming")
        print("\n".join(live.report(results["live"])))
    if "speech" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results.update(speech.run(args.bundle, args.trusted_keys, Path(tmp)))
        print(f"appliance bench: {args.bundle}, speech and translation")
        print("\n".join(speech.report(results)))
    if "voices" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["voices"] = voices.run(args.bundle, args.trusted_keys, Path(tmp))
        print(f"appliance bench: {args.bundle}, Kokoro voices")
        print("\n".join(voices.report(results["voices"])))
    if "diarization" in wanted:
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results["diarization"] = diarization.diarization_bench(args.bundle, args.trusted_keys, Path(tmp))
        print(f"appliance bench: {args.bundle}, who spoke (diarization)")
        print("\n".join(diarization.report(results["diarization"])))
    print("appliance bench: resident memory of every process as each daemon stopped (MiB)")
    for label, processes in MEMORY_AT_STOP:
        print(f"  {label}: " + ", ".join(f"{name} {mib}" for name, mib in processes.items()))
    results["memory_at_stop"] = [{"daemon": label, **processes} for label, processes in MEMORY_AT_STOP]
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


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
    bench.add_argument(
        "--part",
        default="all",
        help="what to measure, by the firmware's models: all, or a comma-separated list of vad (the VAD, the "
        "transports, one's own model), workers (protocol workers, 2 against 1), https (HTTPS against QUIC, the "
        "Unix socket and Hypercorn over TLS), hostile (good clients' latency under each attack), transcription (speech to text against faster-whisper), live (Realtime and Wyoming against "
        "wyoming-faster-whisper), speech (speech, "
        "translation and the pipeline), diarization (who spoke, against the same pipeline in process)",
    )
    bench.set_defaults(func=cmd_bench)
