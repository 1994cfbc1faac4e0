"""The `appliance` command: run the daemon, call it, build and check firmware, keys, config, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from appliance import exitcodes
from appliance.config import QuicConfig
from appliance.errors import ApplianceError
from appliance.firmware import store as firmware_store

DEV_SOCKET = Path("run/api.sock")
INSTALLED_SOCKET = Path("/run/appliance/api.sock")


def default_socket() -> str:
    if env := os.environ.get("APPLIANCE_SOCKET"):
        return env
    return str(DEV_SOCKET if DEV_SOCKET.exists() else INSTALLED_SOCKET)


def _print(doc: Any) -> None:
    print(json.dumps(doc, indent=2))


def cmd_run(args: argparse.Namespace) -> int:
    from appliance import config, daemon, systemd

    try:
        cfg = config.load(args.config)
    except ApplianceError as exc:
        daemon.configure_logging("info")
        daemon.log.error("start failed: %s", exc)
        systemd.status(f"start failed: {exc}")
        return daemon.EXIT_START_FAILED
    return daemon.run(cfg, args.config)


def cmd_call(args: argparse.Namespace) -> int:
    """Errors are raised and told in main(): ServerError exits 1, ConnectError 4, local input 2."""
    if args.quic:
        import logging

        logging.getLogger("quic").addHandler(logging.NullHandler())  # aioquic's own warning; main() tells it once
    for option, path in (("--cafile", args.cafile), ("--cert", args.cert), ("--key", args.key)):
        if path is not None:
            _check_readable(path, option)
    return _call(args)


def quic_address(text: str) -> str:
    """argparse type of --quic: HOST:PORT, checked before anything is sent (a usage error, exit 2)."""
    from appliance.client import parse_quic_address

    try:
        parse_quic_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_readable(path: str, what: str = "") -> None:
    """A file argument that cannot be read is a local input error (exit 2) naming it and why."""
    _read_input(path, what, size=0)


def _read_input(path: str, what: str = "", size: int = -1) -> bytes:
    """A file argument's bytes; ApplianceError (exit 2) naming the file and why it cannot be read."""
    from appliance.client import describe_path

    name = f"{what} {path}" if what else path
    try:
        with open(path, "rb") as file:
            return file.read(size)
    except IsADirectoryError:
        raise ApplianceError(f"cannot read {name}: it is a directory, not a file") from None
    except FileNotFoundError:
        raise ApplianceError(f"cannot read {name}: {describe_path(path)}") from None
    except OSError as exc:
        raise ApplianceError(f"cannot read {name}: {(exc.strerror or str(exc)).lower()}") from None


def _call(args: argparse.Namespace) -> int:
    from appliance.audio import decode_audio
    from appliance.client import DEFAULT_CONNECT_TIMEOUT_S, Client
    from appliance.errors import ApiError

    certificate = (args.cert, args.key) if args.cert else None
    timeout = getattr(args, "timeout", DEFAULT_CONNECT_TIMEOUT_S)
    client = (
        Client(quic=args.quic, cafile=args.cafile, certificate=certificate, connect_timeout=timeout)
        if args.quic
        else Client(args.socket, connect_timeout=timeout)
    )
    with client:
        if args.what == "health":
            health = client.health()
            _print(health)
            return exitcodes.OK if health["ready"] else exitcodes.DAEMON_ERROR
        if args.what == "server":
            _print(client.server())
        elif args.what == "models":
            _print(client.models())
        elif args.what == "model":
            _print(client.model(args.args[0] if args.args else "silero_vad"))
        elif args.what == "metrics":
            print(client.metrics(), end="")
        elif args.what == "vad":
            if not args.args:
                raise ApplianceError("usage: appliance call vad FILE [--model NAME] [--stream]  (WAV, FLAC or Ogg)")
            audio = _read_input(args.args[0])
            if args.stream:
                for line in client.stream_segments(audio, model=args.model):
                    print(json.dumps(line), flush=True)
            else:
                _print(client.segments(audio, model=args.model))
        elif args.what == "probs":
            if not args.args:
                raise ApplianceError("usage: appliance call probs FILE [--model NAME]  (WAV, FLAC or Ogg)")
            rate = client.model(args.model)["parameters"]["sample_rate"]
            try:  # decoded here, as the daemon decodes for segments, and sent as tensors
                samples = decode_audio(_read_input(args.args[0]), rate)
            except ApiError as exc:
                raise ApplianceError(f"{args.args[0]}: {exc.message}") from None
            _print([round(float(p), 4) for p in client.infer(samples, model=args.model)])
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    """The daemon's state and its QUIC peers, as `systemctl status` would want them."""
    from appliance.client import Client

    with Client(args.socket) as client:
        status = client.status()
    if args.json:
        _print(status)
        return 0
    firmware = status["firmware"]
    print(
        f"firmware {firmware['name']} {firmware['version']} (key {firmware['signing_key_id']}), "
        f"{'ready' if status['ready'] else 'not ready'}"
    )
    for model in status["models"]:
        print(f"model {model['name']} on {model['engine']}: {model['live_sequences']} live sequences")
    cache = status["conncache"]
    if cache is None:
        print("quic: off")
        return 0
    totals = cache["totals"]
    reason = f" ({cache['reason']})" if cache["reason"] else ""
    print(
        f"conncache {cache['backend']}{reason}: {len(cache['peers'])} peers, {totals['packets']} packets, "
        f"{totals['bytes']} bytes, {totals['drops']} dropped"
    )
    print(f"{'PEER':<46} {'PACKETS':>9} {'BYTES':>11} {'DROPS':>8} {'IDLE_S':>8}  DCID")
    for peer in cache["peers"]:
        print(
            f"{peer['peer']:<46} {peer['packets']:>9} {peer['bytes']:>11} {peer['drops']:>8} {peer['idle_s']:>8.1f}  "
            f"{peer['dcid']}"
        )
    return 0


def cmd_firmware(args: argparse.Namespace) -> int:
    from appliance import firmware
    from appliance.firmware.build import build
    from appliance.progress import Progress

    if args.action == "build":
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
        return _firmware_store_action(args)
    return 0


def _inspect(bundle: Path, trusted_keys: Path) -> int:
    """One JSON document on stdout, verified or not; when not, exit 2 and one warning line on stderr."""
    from appliance import firmware

    manifest_path = bundle / firmware.MANIFEST
    doc: dict[str, Any] = {
        "bundle": str(bundle),
        "trusted_keys": str(trusted_keys),
        "verified": False,
        "error": None,
        "manifest": None,
    }
    try:
        doc["manifest"] = json.loads(manifest_path.read_bytes())
    except (OSError, ValueError) as exc:  # ValueError: not JSON, or not UTF-8
        doc["error"] = f"{manifest_path}: cannot read the manifest: {exc}"
    if doc["error"] is None:
        try:
            firmware.verify(bundle, trusted_keys)
            doc["verified"] = True
        except (ApplianceError, OSError) as exc:
            doc["error"] = str(exc)
    _print(doc)
    if doc["verified"]:
        return 0
    reason = " ".join(doc["error"].split())  # one line, whatever the reason's text
    print(f"appliance: warning: NOT VERIFIED against {trusted_keys}: {reason}", file=sys.stderr)
    return 2


def _firmware_store_action(args: argparse.Namespace) -> int:
    store = firmware_store.Store(args.store)
    if args.action == "install":
        from appliance.progress import Progress

        release = firmware_store.install(store, args.bundle, args.trusted_keys, Progress())
        firmware_store.switch(store, release)
        print(f"installed {release.name} in {store.root}, current on trial: the next self-test commits it")
    elif args.action == "store":
        print(f"current  {firmware_store.describe(store.current)}{' (on trial)' if store.on_trial else ''}")
        print(f"previous {firmware_store.describe(store.previous)}")
    elif args.action == "rollback":
        back = firmware_store.revert(store)
        print(f"back on {back.name}; restarting {UNIT}", flush=True)
        print(_try_firmware(args, store))
    return 0


def cmd_keys(args: argparse.Namespace) -> int:
    from appliance import keys

    kid = keys.new_key_pair(args.out, args.trust_dir)
    print(
        f"key {kid}: private {args.out}, public {args.out.with_suffix('.pub')}"
        + (f", trusted in {args.trust_dir}" if args.trust_dir else "")
    )
    return 0


def cmd_config(args: argparse.Namespace) -> int:
    from appliance import config

    print(config.to_toml(config.load(args.config)), end="")
    return 0


def cmd_tls(args: argparse.Namespace) -> int:
    from appliance.tls import init_self_signed

    if args.cert.exists() and args.key.exists() and not args.force:
        print(f"{args.cert} exists (use --force to replace it)")
        return 0
    fingerprint = init_self_signed(args.cert, args.key, args.name)
    print(f"certificate {args.cert}, key {args.key}, sha256 fingerprint {fingerprint}")
    return 0


def cmd_image(args: argparse.Namespace) -> int:
    from appliance import image
    from appliance.progress import Progress

    if args.action == "assemble":
        image.assemble(args.out, args.root, args.data, args.boot_efi, args.kernel, args.initrd, Progress())
        print(f"assembled {args.out / image.DISK} ({image.DISK_SIZE} bytes)")
    elif args.action == "sign":
        manifest = image.sign(args.image, args.key, args.name, args.version, Progress())
        print(f"signed {args.image} {manifest.name} {manifest.version} (key {manifest.signing_key_id})")
    elif args.action == "verify":
        manifest = image.verify(args.image, args.trusted_keys, progress=Progress())
        print(f"{args.image}: {manifest.name} {manifest.version} verified (key {manifest.signing_key_id})")
    elif args.action == "selftest":
        print(image.selftest(args.socket, args.timeout), flush=True)
        store = firmware_store.Store(args.store)
        if store.on_trial:
            firmware_store.commit(store)
            print(f"appliance-selftest: firmware {firmware_store.describe(store.current)} committed", flush=True)
    return 0


def cmd_flash(args: argparse.Namespace) -> int:
    from appliance import image
    from appliance.progress import Progress

    manifest = image.flash(args.image, args.target, args.trusted_keys, Progress())
    print(f"flashed {manifest.name} {manifest.version} to {args.target}: written, synced, read back and verified")
    return 0


UNIT = "appliance.service"


def _restart_daemon() -> None:
    """Restart the unit; systemctl waits for READY=1 (Type=notify) or reports the failed start."""
    import subprocess

    result = subprocess.run(["systemctl", "restart", UNIT], capture_output=True, text=True)
    if result.returncode != 0:
        status = subprocess.run(
            ["systemctl", "show", "-p", "StatusText", "--value", UNIT], capture_output=True, text=True
        ).stdout.strip()
        raise ApplianceError(f"{UNIT} did not start: {status or result.stderr.strip()}")


def _try_firmware(args: argparse.Namespace, store: firmware_store.Store) -> str:
    from appliance import image

    return firmware_store.try_current(store, _restart_daemon, lambda: image.selftest(args.socket, args.timeout))


def cmd_update(args: argparse.Namespace) -> int:
    """An image (disk.raw) goes to the inactive slot; a firmware bundle goes to the data partition."""
    import subprocess

    from appliance import firmware, image
    from appliance.progress import Progress

    if (args.source / image.DISK).exists():
        trial = image.update(args.source, args.trusted_keys, progress=Progress())
        if args.reboot:
            print(f"slot {trial} written and verified; rebooting into it, on trial", flush=True)
            subprocess.run(["systemctl", "reboot"], check=True)
        else:
            print(f"slot {trial} written and verified; reboot to try slot {trial} (on trial: one boot)")
        return 0
    if not (args.source / firmware.MANIFEST).exists():
        raise ApplianceError(
            f"{args.source}: neither a disk image ({image.DISK}) nor a firmware bundle ({firmware.MANIFEST})"
        )
    store = firmware_store.Store(args.store)
    release = firmware_store.install(store, args.source, args.trusted_keys, Progress())
    if release == store.current:
        print(f"firmware {release.name} is already current")
        return 0
    firmware_store.switch(store, release)
    print(f"installed {release.name}; restarting {UNIT} on it, on trial", flush=True)
    print(_try_firmware(args, store))
    print(f"firmware {release.name} committed; previous {firmware_store.describe(store.previous)} kept for rollback")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """After a failed boot self-test: firmware on trial goes back to the previous one; a trial slot reboots."""
    import subprocess

    from appliance import image

    store = firmware_store.Store(args.store)
    if store.on_trial:
        failed = firmware_store.describe(store.current)
        back = firmware_store.revert(store)
        print(f"appliance-rollback: firmware {failed} failed its self-test; back on {back.name}", flush=True)
        if not image.booted_on_trial():
            subprocess.run(["systemctl", "restart", "--no-block", UNIT, "appliance-selftest.service"], check=True)
            return 0
    if image.booted_on_trial():
        print("appliance-rollback: trial boot failed its self-test, rebooting into the previous slot", flush=True)
        subprocess.run(["systemctl", "reboot"], check=True)
        return 0
    print("appliance-rollback: the self-test failed on a committed slot and firmware: nothing to return to")
    return 1


def cmd_bench(args: argparse.Namespace) -> int:
    from appliance.bench import main as bench

    return bench(args)


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Descriptions and epilogs as written; "(default: X)" after each option whose default says something
    (not after required options, flags that are off, or options that are simply absent by default)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.required or action.default in (None, False, [], argparse.SUPPRESS):
            return action.help or ""
        return super()._get_help_string(action) or ""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("appliance")
    except PackageNotFoundError:  # run from a checkout that was never installed
        return "unknown (not installed)"


def _command(sub: Any, name: str, help: str, description: str | None = None, **kwargs: Any) -> argparse.ArgumentParser:
    """A subcommand or sub-action: its help line in the parent's list, the same text atop its own --help."""
    return sub.add_parser(name, help=help, description=description or help, formatter_class=_HelpFormatter, **kwargs)


# `appliance call WHAT`: what each does (the choices and the help text come from here).
CALL_ACTIONS = {
    "health": "liveness and readiness (GET /v2/health/live, /v2/health/ready); exits 1 when not ready",
    "server": "server metadata: name, version, extensions and the firmware served (GET /v2)",
    "models": "the models served, with their versions and state (GET /v2/models)",
    "model": "one model's metadata: tensors, baked parameters, signing key id (GET /v2/models/NAME; "
    "NAME defaults to silero_vad)",
    "metrics": "the Prometheus metrics text (GET /metrics)",
    "vad": "speech segments of an audio FILE (WAV, FLAC or Ogg) as JSON (POST /v2/models/MODEL/segments); "
    "with --stream one line per segment as soon as it is final",
    "probs": "the speech probability of every 512-sample frame of an audio FILE (POST /v2/models/MODEL/infer)",
}


def _call_epilog() -> str:
    import shutil
    import textwrap

    width = max(map(len, CALL_ACTIONS)) + 4
    columns = max(min(shutil.get_terminal_size().columns - 2, 100), width + 30)
    lines = ["actions:"]
    for name, text in CALL_ACTIONS.items():
        lines += textwrap.wrap(
            text,
            columns,
            initial_indent=f"  {name:<{width - 2}}",
            subsequent_indent=" " * width,
            break_on_hyphens=False,
        )
    lines += [
        "",
        "examples:",
        "  appliance call health",
        "  appliance call vad speech.wav --stream",
        "  appliance call --quic 127.0.0.1:4433 --cafile run/tls/cert.pem models",
    ]
    return "\n".join(lines)


TRUSTED_KEYS = Path("/etc/appliance/trusted-keys")
TRUSTED_KEYS_HELP = "directory of trusted public keys (*.pub); the signature must verify against one of them"


def _add_selftest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=str(INSTALLED_SOCKET), help="the daemon's socket, for the self-test")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds the self-test waits for the daemon")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description=__doc__, formatter_class=_HelpFormatter)
    p.add_argument(
        "--version",
        action="version",
        version=f"%(prog)s {_version()}",
        help="print the installed package's version and exit",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = _command(sub, "run", "run the daemon in the foreground")
    run.add_argument(
        "--config",
        type=Path,
        action="append",
        help="config file (repeatable, merged in order; without it /etc/appliance/appliance.toml, "
        "then /etc/appliance/conf.d/*.toml)",
    )
    run.set_defaults(func=cmd_run)

    call = _command(
        sub,
        "call",
        "call the daemon over its Unix socket (or QUIC with --quic)",
        description="Call the daemon's API and print the answer (JSON, or the metrics text).",
        epilog=_call_epilog(),
    )
    call.add_argument(
        "what",
        choices=list(CALL_ACTIONS),
        metavar="ACTION",
        help=f"what to ask: {', '.join(CALL_ACTIONS)} (see actions below)",
    )
    call.add_argument("args", nargs="*", metavar="ARG", help="model: NAME; vad, probs: the audio FILE")
    call.add_argument(
        "--socket",
        default=default_socket(),
        help="the daemon's Unix socket ($APPLIANCE_SOCKET, else ./run/api.sock if present)",
    )
    call.add_argument("--model", default="silero_vad", help="vad, probs: the model to run")
    call.add_argument("--stream", action="store_true", help="vad: print each segment as soon as it is final")
    call.add_argument(
        "--quic", metavar="HOST:PORT", type=quic_address, help="call over QUIC/HTTP3 instead of the Unix socket"
    )
    call.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long connecting (the QUIC handshake) may take before the call fails (exit 4)",
    )
    call.add_argument("--cafile", help="pinned server certificate or CA file for --quic")
    call.add_argument("--cert", help="client certificate for servers that require mutual TLS")
    call.add_argument("--key", help="the client certificate's private key")
    call.set_defaults(func=cmd_call)

    status = _command(sub, "status", "the daemon's firmware, engines and QUIC peers (connection cache)")
    status.add_argument(
        "--socket",
        default=default_socket(),
        help="the daemon's Unix socket ($APPLIANCE_SOCKET, else ./run/api.sock if present)",
    )
    status.add_argument("--json", action="store_true", help="print the daemon's status document as JSON")
    status.set_defaults(func=cmd_status)

    fw = _command(sub, "firmware", "build, verify, inspect a firmware bundle; the box's firmware store")
    fw_sub = fw.add_subparsers(dest="action", required=True, metavar="ACTION")
    build = _command(fw_sub, "build", "build and sign a bundle from a firmware spec (TOML)")
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
        action = _command(fw_sub, name, text)
        action.add_argument("bundle", type=Path, help="the bundle directory")
        action.add_argument("--trusted-keys", type=Path, default=TRUSTED_KEYS, metavar="DIR", help=TRUSTED_KEYS_HELP)
    install = _command(
        fw_sub,
        "install",
        "verify a bundle and make it the store's current, on trial (the daemon loads it at its next start)",
    )
    install.add_argument("bundle", type=Path, help="the bundle directory")
    install.add_argument("--trusted-keys", type=Path, default=TRUSTED_KEYS, metavar="DIR", help=TRUSTED_KEYS_HELP)
    store_help = {
        "store": "the store's current and previous firmware",
        "rollback": "on the box: back to the previous firmware, restart and self-test",
    }
    for name in ("install", *store_help):
        action = install if name == "install" else _command(fw_sub, name, store_help[name])
        action.add_argument(
            "--store", type=Path, default=firmware_store.STORE, help="the firmware store (on the box's data partition)"
        )
        if name == "rollback":
            _add_selftest_arguments(action)
    fw.set_defaults(func=cmd_firmware)

    keys = _command(sub, "keys", "signing keys for firmware bundles and images")
    keys_sub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = _command(keys_sub, "new", "make an Ed25519 signing key pair")
    new.add_argument("--out", type=Path, required=True, help="private key path; the public key goes next to it as .pub")
    new.add_argument("--trust-dir", type=Path, help="also trust the public key there")
    keys.set_defaults(func=cmd_keys)

    cfg = _command(sub, "config", "check config files")
    cfg_sub = cfg.add_subparsers(dest="action", required=True, metavar="ACTION")
    check = _command(
        cfg_sub,
        "check",
        "load the config strictly and print the merged result as TOML (which loads again to the same config)",
    )
    check.add_argument(
        "--config",
        type=Path,
        action="append",
        help="config file (repeatable, merged in order; without it /etc/appliance/appliance.toml, "
        "then /etc/appliance/conf.d/*.toml)",
    )
    cfg.set_defaults(func=cmd_config)

    tls = _command(sub, "tls", "TLS material for the QUIC listener, made offline")
    tls_sub = tls.add_subparsers(dest="action", required=True, metavar="ACTION")
    init = _command(tls_sub, "init", "make a self-signed certificate and key for this box")
    init.add_argument("--cert", type=Path, default=QuicConfig().certificate, help="the certificate (PEM) to write")
    init.add_argument("--key", type=Path, default=QuicConfig().private_key, help="the private key (PEM) to write")
    init.add_argument("--name", action="append", default=[], help="extra DNS name or IP address (repeatable)")
    init.add_argument("--force", action="store_true", help="replace an existing certificate and key")
    tls.set_defaults(func=cmd_tls)

    img = _command(sub, "image", "build, sign, verify the disk image; the box's boot self-test")
    img_sub = img.add_subparsers(dest="action", required=True, metavar="ACTION")
    assemble = _command(img_sub, "assemble", "GPT disk.raw from root and data file systems (make image)")
    assemble.add_argument("--out", type=Path, required=True, help="the image directory; disk.raw is written there")
    for name, text in (
        ("root", "the root file system image (ext4), written to root-a"),
        ("data", "the data file system image (ext4), written to data"),
        ("boot-efi", "systemd-boot's EFI binary, for the ESP"),
        ("kernel", "the kernel slot A boots, for the ESP"),
        ("initrd", "the initrd slot A boots, for the ESP"),
    ):
        assemble.add_argument(f"--{name}", type=Path, required=True, help=text)
    sign = _command(img_sub, "sign", "hash every region of IMAGE/disk.raw and sign the manifest")
    sign.add_argument("image", type=Path, help="the image directory (holding disk.raw)")
    sign.add_argument("--key", type=Path, required=True, help="the Ed25519 signing key")
    sign.add_argument("--name", default="appliance", help="the image's name in the manifest")
    sign.add_argument("--version", required=True, help="the image's version in the manifest")
    verify = _command(img_sub, "verify", "check an image's signature and the sha256 of every region of disk.raw")
    verify.add_argument("image", type=Path, help="the image directory (disk.raw, manifest.json, manifest.sig)")
    verify.add_argument("--trusted-keys", type=Path, default=TRUSTED_KEYS, metavar="DIR", help=TRUSTED_KEYS_HELP)
    selftest = _command(
        img_sub,
        "selftest",
        "wait for the daemon and run one inference (boot assessment); commits firmware on trial when it passes",
    )
    _add_selftest_arguments(selftest)
    selftest.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="the firmware store whose trial a pass commits"
    )
    img.set_defaults(func=cmd_image)

    flash = _command(sub, "flash", "verify a signed image, write it to a disk or file, read it back")
    flash.add_argument("image", type=Path, help="the image directory (disk.raw, manifest.json, manifest.sig)")
    flash.add_argument("--target", type=Path, required=True, help="block device or existing file")
    flash.add_argument("--trusted-keys", type=Path, default=Path("keys/trusted"), metavar="DIR", help=TRUSTED_KEYS_HELP)
    flash.set_defaults(func=cmd_flash)

    upd = _command(
        sub,
        "update",
        "on the box: a signed image to the inactive slot (booted on trial), or a "
        "signed firmware bundle to the data partition (restarted on trial)",
    )
    upd.add_argument(
        "source",
        type=Path,
        metavar="IMAGE_OR_BUNDLE",
        help="an image directory (with disk.raw) or a firmware bundle directory",
    )
    upd.add_argument("--trusted-keys", type=Path, default=TRUSTED_KEYS, metavar="DIR", help=TRUSTED_KEYS_HELP)
    upd.add_argument("--reboot", action="store_true", help="image: reboot into the trial slot when written")
    upd.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="firmware: the store on the data partition"
    )
    _add_selftest_arguments(upd)
    upd.set_defaults(func=cmd_update)

    recover = _command(sub, "recover", "on the box, after a failed boot self-test (appliance-rollback.service)")
    recover.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="the firmware store whose trial is undone"
    )
    recover.set_defaults(func=cmd_recover)

    bench = _command(sub, "bench", "benchmark the daemon against raw ONNX Runtime, side by side")
    bench.add_argument(
        "--bundle", type=Path, default=Path("build/firmware/default"), help="the firmware bundle to serve"
    )
    bench.add_argument("--trusted-keys", type=Path, default=Path("keys/trusted"), metavar="DIR", help=TRUSTED_KEYS_HELP)
    bench.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    bench.add_argument("--json", type=Path, help="also write the figures here")
    bench.set_defaults(func=cmd_bench)
    return p


def _error(message: str, code: int) -> int:
    """The one line on stderr that every failure gets (no traceback), and its exit code."""
    print(f"appliance: error: {' '.join(message.split())}", file=sys.stderr)
    return code


def _stdout_closed() -> bool:
    """Whether stdout's reader has gone (a pipe or socket polls as an error or hang-up then)."""
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))
    except (OSError, ValueError):
        return True


def _stdout_gone() -> int:
    """stdout was closed early (`appliance call metrics | head -1`): say so once, exit 141 as SIGPIPE would."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())  # what is still buffered goes nowhere, not into a second error at exit
    os.close(devnull)
    return _error("stdout was closed before all output was written (broken pipe)", exitcodes.BROKEN_PIPE)


def _client_failure(exc: BaseException, args: argparse.Namespace) -> tuple[str, int] | None:
    """A client error as its line and exit code: the daemon answered with an error (1), or it could not
    be reached (4), with what to do about it; None for anything else."""
    client = sys.modules.get("appliance.client")
    if client is None or not isinstance(exc, client.ClientError):
        return None
    if isinstance(exc, client.ServerError):
        return f"the daemon answered {exc}", exitcodes.DAEMON_ERROR
    message = str(exc)
    if isinstance(exc, client.SocketUnreachable):
        message += "; point at the daemon's socket with --socket PATH or APPLIANCE_SOCKET=PATH"
    elif isinstance(exc, client.CertificateRejected):
        message += (
            "; give a client certificate it trusts with --cert FILE --key FILE"
            if exc.by_server
            else "; pass the server's certificate (or its CA) with --cafile FILE"
        )
    elif isinstance(exc, client.NoAnswer) and getattr(args, "quic", None):
        message += "; --timeout SECONDS waits longer"
    return message, exitcodes.UNREACHABLE


def main(argv: list[str] | None = None) -> int:
    """Exit codes (appliance/exitcodes.py; README, "Calling the daemon"): 0 ok, 1 the daemon answered with an
    error, 2 usage or local input, 3 the daemon could not start, 4 the daemon could not be reached,
    141 stdout closed; each failure is one line on stderr."""
    args = parser().parse_args(argv)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a closed stdout shows here, not as a traceback at exit
        return code
    except BrokenPipeError as exc:
        if _stdout_closed():
            return _stdout_gone()
        return _error(str(exc), exitcodes.USAGE)
    except ApplianceError as exc:
        return _error(str(exc), exitcodes.USAGE)
    except KeyboardInterrupt:
        return exitcodes.INTERRUPTED
    except Exception as exc:
        if (failure := _client_failure(exc, args)) is not None:
            return _error(*failure)
        if isinstance(exc, OSError):  # a local file or device: not the daemon's doing
            return _error(str(exc), exitcodes.USAGE)
        raise
