"""The `appliance` command: run the daemon, call it, build and check firmware, keys, config, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from appliance.config import QuicConfig
from appliance.errors import ApplianceError
from appliance import firmware_store

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
    from appliance.client import ClientError

    try:
        return _call(args)
    except ClientError as exc:
        print(f"appliance: {exc}", file=sys.stderr)
        return 1


def _call(args: argparse.Namespace) -> int:
    from appliance.audio import decode_wav
    from appliance.client import Client

    certificate = (args.cert, args.key) if args.cert else None
    client = Client(quic=args.quic, cafile=args.cafile, certificate=certificate) if args.quic else Client(args.socket)
    with client:
        if args.what == "health":
            health = client.health()
            _print(health)
            return 0 if health["ready"] else 1
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
                raise ApplianceError("usage: appliance call vad FILE.wav [--model NAME] [--stream]")
            wav = Path(args.args[0]).read_bytes()
            if args.stream:
                for line in client.stream_segments(wav, model=args.model):
                    print(json.dumps(line), flush=True)
            else:
                _print(client.segments(wav, model=args.model))
        elif args.what == "probs":
            samples = decode_wav(Path(args.args[0]).read_bytes(), 16000)
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
    print(f"firmware {firmware['name']} {firmware['version']} (key {firmware['signing_key_id']}), "
          f"{'ready' if status['ready'] else 'not ready'}")
    for model in status["models"]:
        print(f"model {model['name']} on {model['engine']}: {model['live_sequences']} live sequences")
    cache = status["conncache"]
    if cache is None:
        print("quic: off")
        return 0
    totals = cache["totals"]
    reason = f" ({cache['reason']})" if cache["reason"] else ""
    print(f"conncache {cache['backend']}{reason}: {len(cache['peers'])} peers, {totals['packets']} packets, "
          f"{totals['bytes']} bytes, {totals['drops']} dropped")
    print(f"{'PEER':<46} {'PACKETS':>9} {'BYTES':>11} {'DROPS':>8} {'IDLE_S':>8}  DCID")
    for peer in cache["peers"]:
        print(f"{peer['peer']:<46} {peer['packets']:>9} {peer['bytes']:>11} {peer['drops']:>8} {peer['idle_s']:>8.1f}  "
              f"{peer['dcid']}")
    return 0


def cmd_firmware(args: argparse.Namespace) -> int:
    from appliance import firmware

    if args.action == "build":
        manifest = firmware.build(args.spec, args.key, args.out)
        print(f"built {manifest.name} {manifest.version} in {args.out} (signed by {manifest.signing_key_id})")
    elif args.action == "verify":
        bundle = firmware.verify(args.bundle, args.trusted_keys)
        print(f"ok: {bundle.manifest.name} {bundle.manifest.version}, signed by {bundle.manifest.signing_key_id}, "
              f"{len(bundle.manifest.artifacts)} artifacts match")
    elif args.action == "inspect":
        print((args.bundle / firmware.MANIFEST).read_text(), end="")
        try:
            firmware.verify(args.bundle, args.trusted_keys)
            print(f"# verified against {args.trusted_keys}")
        except ApplianceError as exc:
            print(f"# NOT VERIFIED: {exc}")
    else:
        return _firmware_store_action(args)
    return 0


def _firmware_store_action(args: argparse.Namespace) -> int:
    store = firmware_store.Store(args.store)
    if args.action == "install":
        release = firmware_store.install(store, args.bundle, args.trusted_keys)
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
    print(f"key {kid}: private {args.out}, public {args.out.with_suffix('.pub')}"
          + (f", trusted in {args.trust_dir}" if args.trust_dir else ""))
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

    if args.action == "assemble":
        image.assemble(args.out, args.root, args.data, args.boot_efi, args.kernel, args.initrd)
        print(f"assembled {args.out / image.DISK} ({image.DISK_SIZE} bytes)")
    elif args.action == "sign":
        manifest = image.sign(args.image, args.key, args.name, args.version)
        print(f"signed {args.image} {manifest.name} {manifest.version} (key {manifest.signing_key_id})")
    elif args.action == "verify":
        manifest = image.verify(args.image, args.trusted_keys)
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

    manifest = image.flash(args.image, args.target, args.trusted_keys)
    print(f"flashed {manifest.name} {manifest.version} to {args.target}")
    return 0


UNIT = "appliance.service"


def _restart_daemon() -> None:
    """Restart the unit; systemctl waits for READY=1 (Type=notify) or reports the failed start."""
    import subprocess

    result = subprocess.run(["systemctl", "restart", UNIT], capture_output=True, text=True)
    if result.returncode != 0:
        status = subprocess.run(["systemctl", "show", "-p", "StatusText", "--value", UNIT],
                                capture_output=True, text=True).stdout.strip()
        raise ApplianceError(f"{UNIT} did not start: {status or result.stderr.strip()}")


def _try_firmware(args: argparse.Namespace, store: firmware_store.Store) -> str:
    from appliance import image

    return firmware_store.try_current(store, _restart_daemon, lambda: image.selftest(args.socket, args.timeout))


def cmd_update(args: argparse.Namespace) -> int:
    """An image (disk.raw) goes to the inactive slot; a firmware bundle goes to the data partition."""
    import subprocess

    from appliance import firmware, image

    if (args.source / image.DISK).exists():
        trial = image.update(args.source, args.trusted_keys)
        if args.reboot:
            subprocess.run(["systemctl", "reboot"], check=True)
        else:
            print(f"reboot to try slot {trial}")
        return 0
    if not (args.source / firmware.MANIFEST).exists():
        raise ApplianceError(f"{args.source}: neither a disk image ({image.DISK}) nor a firmware bundle "
                             f"({firmware.MANIFEST})")
    store = firmware_store.Store(args.store)
    release = firmware_store.install(store, args.source, args.trusted_keys)
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


def _add_selftest_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", default=str(INSTALLED_SOCKET), help="the daemon's socket, for the self-test")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds the self-test waits for the daemon")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="appliance", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the daemon in the foreground")
    run.add_argument("--config", type=Path, action="append", help="config file (repeatable; default /etc/appliance)")
    run.set_defaults(func=cmd_run)

    call = sub.add_parser("call", help="call the daemon over its Unix socket")
    call.add_argument("what", choices=["health", "server", "models", "model", "metrics", "vad", "probs"])
    call.add_argument("args", nargs="*")
    call.add_argument("--socket", default=default_socket())
    call.add_argument("--model", default="silero_vad")
    call.add_argument("--stream", action="store_true", help="vad: print each segment as soon as it is final")
    call.add_argument("--quic", metavar="HOST:PORT", help="call over QUIC/HTTP3 instead of the Unix socket")
    call.add_argument("--cafile", help="pinned server certificate or CA file for --quic")
    call.add_argument("--cert", help="client certificate for servers that require mutual TLS")
    call.add_argument("--key", help="the client certificate's private key")
    call.set_defaults(func=cmd_call)

    status = sub.add_parser("status", help="the daemon's firmware, engines and QUIC peers (connection cache)")
    status.add_argument("--socket", default=default_socket())
    status.add_argument("--json", action="store_true")
    status.set_defaults(func=cmd_status)

    fw = sub.add_parser("firmware", help="build, verify or inspect a firmware bundle")
    fw_sub = fw.add_subparsers(dest="action", required=True)
    build = fw_sub.add_parser("build")
    build.add_argument("spec", type=Path)
    build.add_argument("--key", type=Path, required=True)
    build.add_argument("--out", type=Path, required=True)
    for name in ("verify", "inspect"):
        action = fw_sub.add_parser(name)
        action.add_argument("bundle", type=Path)
        action.add_argument("--trusted-keys", type=Path, default=Path("/etc/appliance/trusted-keys"))
    install = fw_sub.add_parser("install", help="verify a bundle and make it the store's current, on trial "
                                                "(the daemon loads it at its next start)")
    install.add_argument("bundle", type=Path)
    install.add_argument("--trusted-keys", type=Path, default=Path("/etc/appliance/trusted-keys"))
    store_help = {"store": "the store's current and previous firmware",
                  "rollback": "on the box: back to the previous firmware, restart and self-test"}
    for name in ("install", *store_help):
        action = install if name == "install" else fw_sub.add_parser(name, help=store_help[name])
        action.add_argument("--store", type=Path, default=firmware_store.STORE)
        if name == "rollback":
            _add_selftest_arguments(action)
    fw.set_defaults(func=cmd_firmware)

    keys = sub.add_parser("keys", help="make a signing key pair")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    new = keys_sub.add_parser("new")
    new.add_argument("--out", type=Path, required=True, help="private key path; the public key goes next to it as .pub")
    new.add_argument("--trust-dir", type=Path, help="also trust the public key there")
    keys.set_defaults(func=cmd_keys)

    cfg = sub.add_parser("config", help="check config files")
    cfg_sub = cfg.add_subparsers(dest="action", required=True)
    check = cfg_sub.add_parser("check")
    check.add_argument("--config", type=Path, action="append")
    cfg.set_defaults(func=cmd_config)

    tls = sub.add_parser("tls", help="TLS material for the QUIC listener, made offline")
    tls_sub = tls.add_subparsers(dest="action", required=True)
    init = tls_sub.add_parser("init", help="make a self-signed certificate and key for this box")
    init.add_argument("--cert", type=Path, default=QuicConfig().certificate)
    init.add_argument("--key", type=Path, default=QuicConfig().private_key)
    init.add_argument("--name", action="append", default=[], help="extra DNS name or IP address (repeatable)")
    init.add_argument("--force", action="store_true")
    tls.set_defaults(func=cmd_tls)

    img = sub.add_parser("image", help="build, sign, verify the disk image; the box's boot self-test")
    img_sub = img.add_subparsers(dest="action", required=True)
    assemble = img_sub.add_parser("assemble", help="GPT disk.raw from root and data file systems (make image)")
    assemble.add_argument("--out", type=Path, required=True)
    for name in ("root", "data", "boot-efi", "kernel", "initrd"):
        assemble.add_argument(f"--{name}", type=Path, required=True)
    sign = img_sub.add_parser("sign", help="hash every region of IMAGE/disk.raw and sign the manifest")
    sign.add_argument("image", type=Path)
    sign.add_argument("--key", type=Path, required=True)
    sign.add_argument("--name", default="appliance")
    sign.add_argument("--version", required=True)
    verify = img_sub.add_parser("verify")
    verify.add_argument("image", type=Path)
    verify.add_argument("--trusted-keys", type=Path, default=Path("/etc/appliance/trusted-keys"))
    selftest = img_sub.add_parser("selftest", help="wait for the daemon and run one inference (boot assessment); "
                                                   "commits firmware on trial when it passes")
    _add_selftest_arguments(selftest)
    selftest.add_argument("--store", type=Path, default=firmware_store.STORE)
    img.set_defaults(func=cmd_image)

    flash = sub.add_parser("flash", help="verify a signed image, write it to a disk or file, read it back")
    flash.add_argument("image", type=Path)
    flash.add_argument("--target", type=Path, required=True, help="block device or existing file")
    flash.add_argument("--trusted-keys", type=Path, default=Path("keys/trusted"))
    flash.set_defaults(func=cmd_flash)

    upd = sub.add_parser("update", help="on the box: a signed image to the inactive slot (booted on trial), or a "
                                        "signed firmware bundle to the data partition (restarted on trial)")
    upd.add_argument("source", type=Path, metavar="IMAGE_OR_BUNDLE")
    upd.add_argument("--trusted-keys", type=Path, default=Path("/etc/appliance/trusted-keys"))
    upd.add_argument("--reboot", action="store_true", help="image: reboot into the trial slot when written")
    upd.add_argument("--store", type=Path, default=firmware_store.STORE, help="firmware: the store on the data partition")
    _add_selftest_arguments(upd)
    upd.set_defaults(func=cmd_update)

    recover = sub.add_parser("recover", help="on the box, after a failed boot self-test (appliance-rollback.service)")
    recover.add_argument("--store", type=Path, default=firmware_store.STORE)
    recover.set_defaults(func=cmd_recover)

    bench = sub.add_parser("bench", help="benchmark the daemon against raw ONNX Runtime, side by side")
    bench.add_argument("--bundle", type=Path, default=Path("build/firmware/default"))
    bench.add_argument("--trusted-keys", type=Path, default=Path("keys/trusted"))
    bench.add_argument("--seconds", type=float, default=5.0, help="time per measurement")
    bench.add_argument("--json", type=Path, help="also write the figures here")
    bench.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        return int(args.func(args))
    except ApplianceError as exc:
        print(f"appliance: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"appliance: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
