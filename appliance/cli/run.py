"""`appliance run` (the daemon in the foreground) and `appliance bench` (the daemon against raw ONNX Runtime)."""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from appliance.bench.report import report
from appliance.cli.options import add_config, add_trusted_keys, command


def cmd_run(args: argparse.Namespace) -> int:
    from appliance import daemon  # lazy: ONNX Runtime and the engines load only for `run`

    return daemon.run(args.config)


def cmd_bench(args: argparse.Namespace) -> int:
    # lazy: the bench loads ONNX Runtime and aioquic in this process
    from appliance import firmware
    from appliance.bench import speech
    from appliance.bench.run import run

    kinds = {m.kind for m in firmware.verify(args.bundle, args.trusted_keys).manifest.models}
    results: dict[str, Any] = {}
    if "vad" in kinds and args.part in ("all", "vad"):
        results = run(args.bundle, args.trusted_keys, args.seconds)
        print("\n".join(report(results)))
    if kinds & {"speech_synthesis", "text_translation", "speech_pipeline"} and args.part in ("all", "speech"):
        with tempfile.TemporaryDirectory(prefix="appliance-bench-") as tmp:
            results.update(speech.run(args.bundle, args.trusted_keys, Path(tmp)))
        print(f"appliance bench: {args.bundle}, speech and translation")
        print("\n".join(speech.report(results)))
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
        choices=["all", "vad", "speech"],
        default="all",
        help="what to measure of the firmware's models: the VAD, speech and translation (and the speech pipeline), or all",
    )
    bench.set_defaults(func=cmd_bench)
