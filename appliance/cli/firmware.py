"""`appliance firmware`: build, verify, inspect a bundle; install, show and roll back the box's firmware store."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from appliance import firmware
from appliance.box.update import rollback_firmware
from appliance.cli.options import add_selftest_arguments, add_trusted_keys, command, print_json, tell
from appliance.firmware import store as firmware_store
from appliance.firmware.inspect import inspect
from appliance.progress import Progress


def cmd_firmware(args: argparse.Namespace) -> int:
    if args.action == "build":
        from appliance.firmware_build.bundle import build  # lazy: onnx (and nvcc, TensorRT) only for a build

        manifest = build(args.spec, args.key, args.out, Progress())
        print(f"built {manifest.name} {manifest.version} in {args.out} (signed by {manifest.signing_key_id})")
    elif args.action == "verify":
        bundle = firmware.verify(args.bundle, args.trusted_keys, Progress())
        print(
            f"ok: {bundle.manifest.name} {bundle.manifest.version}, signed by {bundle.manifest.signing_key_id}, "
            f"{len(bundle.manifest.artifacts)} artifacts match"
        )
    elif args.action == "inspect":
        return _inspect(args.bundle, args.trusted_keys)
    else:
        return _store_action(args)
    return 0


def _inspect(bundle: Path, trusted_keys: Path) -> int:
    """One JSON document on stdout, verified or not; when not, exit 2 and one warning line on stderr."""
    doc = inspect(bundle, trusted_keys)
    print_json(doc)
    if doc["verified"]:
        return 0
    reason = " ".join(doc["error"].split())  # one line, whatever the reason's text
    print(f"appliance: warning: NOT VERIFIED against {trusted_keys}: {reason}", file=sys.stderr)
    return 2


def _store_action(args: argparse.Namespace) -> int:
    store = firmware_store.Store(args.store)
    if args.action == "install":
        release = firmware_store.install(store, args.bundle, args.trusted_keys, Progress())
        firmware_store.switch(store, release)
        print(f"installed {release.name} in {store.root}, current on trial: the next self-test commits it")
    elif args.action == "store":
        print(f"current  {firmware_store.describe(store.current)}{' (on trial)' if store.on_trial else ''}")
        print(f"previous {firmware_store.describe(store.previous)}")
    elif args.action == "rollback":
        rollback_firmware(store, args.socket, args.timeout, tell)
    return 0


def add_parsers(sub: Any) -> None:
    fw = command(sub, "firmware", "build, verify, inspect a firmware bundle; the box's firmware store")
    fw_sub = fw.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = command(fw_sub, "build", "build and sign a bundle from a firmware spec (TOML)")
    build.add_argument("spec", type=Path, help="the firmware spec, e.g. firmware/default.toml")
    build.add_argument("--key", type=Path, required=True, help="the Ed25519 signing key (appliance keys new)")
    build.add_argument("--out", type=Path, required=True, help="the bundle directory to write (replaced whole)")
    for name, text in (
        ("verify", "check a bundle's signature and every artifact's sha256"),
        (
            "inspect",
            "print a bundle's manifest as JSON, with whether and against what it verified (exit 2 when it does not)",
        ),
    ):
        action = command(fw_sub, name, text)
        action.add_argument("bundle", type=Path, help="the bundle directory")
        add_trusted_keys(action)
    install = command(
        fw_sub,
        "install",
        "verify a bundle and make it the store's current, on trial (the daemon loads it at its next start)",
    )
    install.add_argument("bundle", type=Path, help="the bundle directory")
    add_trusted_keys(install)
    store_help = {
        "store": "the store's current and previous firmware",
        "rollback": "on the box: back to the previous firmware, restart and self-test",
    }
    for name in ("install", *store_help):
        action = install if name == "install" else command(fw_sub, name, store_help[name])
        action.add_argument(
            "--store", type=Path, default=firmware_store.STORE, help="the firmware store (on the box's data partition)"
        )
        if name == "rollback":
            add_selftest_arguments(action)
    fw.set_defaults(func=cmd_firmware)
