"""`appliance run` (the daemon in the foreground) and `appliance bench` (the daemon against raw ONNX Runtime)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from appliance.bench.report import report
from appliance.cli.options import add_config, add_trusted_keys, command


def cmd_run(args: argparse.Namespace) -> int:
    from appliance import daemon  # lazy: ONNX Runtime and the engines load only for `run`

    return daemon.run(args.config)


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.bench.run import run  # lazy: the bench loads ONNX Runtime and aioquic in this process

    results = run(args.bundle, args.trusted_keys, args.seconds, args.only)
    print("\n".join(report(results)))
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
        "--only",
        choices=("all", "speech"),
        default="all",
        help="speech: only speech to text against faster-whisper (a bundle with Whisper, firmware/voice.toml)",
    )
    bench.set_defaults(func=cmd_bench)
