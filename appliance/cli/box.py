"""`appliance image`, `flash`, `update`, `drain`, `fleet`, `recover`: the disk image and the box's update cycle (appliance.box)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from appliance.box import manifest
from appliance.box.assemble import assemble
from appliance.box.drain import drain, resume
from appliance.box.flash import flash
from appliance.box.fleet_targets import write_targets
from appliance.box.layout import DISK, DISK_SIZE
from appliance.box.recover import recover
from appliance.box.selftest import boot_selftest
from appliance.box.update import update
from appliance.cli.options import add_selftest_arguments, add_trusted_keys, command, default_socket, tell
from appliance.firmware import store as firmware_store
from appliance.progress import Progress


def cmd_image(args: argparse.Namespace) -> int:
    if args.action == "assemble":
        assemble(args.out, args.root, args.data, args.boot_efi, args.kernel, args.initrd, Progress())
        print(f"assembled {args.out / DISK} ({DISK_SIZE} bytes)")
    elif args.action == "sign":
        signed = manifest.sign(args.image, args.key, args.name, args.version, Progress())
        print(f"signed {args.image} {signed.name} {signed.version} (key {signed.signing_key_id})")
    elif args.action == "verify":
        verified = manifest.verify(args.image, args.trusted_keys, progress=Progress())
        print(f"{args.image}: {verified.name} {verified.version} verified (key {verified.signing_key_id})")
    elif args.action == "selftest":
        boot_selftest(args.socket, args.timeout, firmware_store.Store(args.store), tell)
    return 0


def cmd_flash(args: argparse.Namespace) -> int:
    flashed = flash(args.image, args.target, args.trusted_keys, Progress())
    print(f"flashed {flashed.name} {flashed.version} to {args.target}: written, synced, read back and verified")
    return 0


def cmd_update(args: argparse.Namespace) -> int:
    store = firmware_store.Store(args.store)
    update(args.source, args.trusted_keys, store, args.socket, args.timeout, args.reboot, tell, Progress())
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    if args.resume:
        resume(args.socket, tell)
    else:
        drain(args.socket, args.then, args.update, args.deadline, tell)
    return 0


def cmd_fleet(args: argparse.Namespace) -> int:
    boxes = write_targets(args.out, args.wait, args.interface or None)
    for name, (addresses, https) in sorted(boxes.items()):
        print(f"{name}: {', '.join(addresses)}" + (f" HTTPS {https}" if https else " (no HTTPS: not a target)"))
    print(f"{sum(1 for _, https in boxes.values() if https)} targets written to {args.out}")
    return 0


def cmd_recover(args: argparse.Namespace) -> int:
    """After a failed boot self-test: firmware on trial goes back to the previous one; a trial slot reboots.
    Exit 1 when there was nothing on trial to return from."""
    return 0 if recover(firmware_store.Store(args.store), tell) else 1


def add_parsers(sub: Any) -> None:
    img = command(sub, "image", "build, sign, verify the disk image; the box's boot self-test")
    img_sub = img.add_subparsers(dest="action", required=True, metavar="ACTION")
    assemble_ = command(img_sub, "assemble", "GPT disk.raw from root and data file systems (make image)")
    assemble_.add_argument("--out", type=Path, required=True, help="the image directory; disk.raw is written there")
    for name, text in (
        ("root", "the root file system image (ext4), written to root-a"),
        ("data", "the data file system image (ext4), written to data"),
        ("boot-efi", "systemd-boot's EFI binary, for the ESP"),
        ("kernel", "the kernel slot A boots, for the ESP"),
        ("initrd", "the initrd slot A boots, for the ESP"),
    ):
        assemble_.add_argument(f"--{name}", type=Path, required=True, help=text)
    sign = command(img_sub, "sign", "hash every region of IMAGE/disk.raw and sign the manifest")
    sign.add_argument("image", type=Path, help="the image directory (holding disk.raw)")
    sign.add_argument("--key", type=Path, required=True, help="the Ed25519 signing key")
    sign.add_argument("--name", default="appliance", help="the image's name in the manifest")
    sign.add_argument("--version", required=True, help="the image's version in the manifest")
    verify = command(img_sub, "verify", "check an image's signature and the sha256 of every region of disk.raw")
    verify.add_argument("image", type=Path, help="the image directory (disk.raw, manifest.json, manifest.sig)")
    add_trusted_keys(verify)
    selftest = command(
        img_sub,
        "selftest",
        "wait for the daemon and run one inference (boot assessment); commits firmware on trial when it passes",
    )
    add_selftest_arguments(selftest)
    selftest.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="the firmware store whose trial a pass commits"
    )
    img.set_defaults(func=cmd_image)

    flash_ = command(sub, "flash", "verify a signed image, write it to a disk or file, read it back")
    flash_.add_argument("image", type=Path, help="the image directory (disk.raw, manifest.json, manifest.sig)")
    flash_.add_argument("--target", type=Path, required=True, help="block device or existing file")
    add_trusted_keys(flash_, default=Path("keys/trusted"))
    flash_.set_defaults(func=cmd_flash)

    upd = command(
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
    add_trusted_keys(upd)
    upd.add_argument("--reboot", action="store_true", help="image: reboot into the trial slot when written")
    upd.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="firmware: the store on the data partition"
    )
    add_selftest_arguments(upd)
    upd.set_defaults(func=cmd_update)

    drn = command(
        sub,
        "drain",
        "refuse new work (503 with Retry-After; HAProxy's agent hears drain) and let work under way finish",
    )
    drn.add_argument("--socket", default=default_socket(), help="the daemon's socket")
    drn.add_argument(
        "--then",
        choices=("hold", "stop", "resume"),
        default="hold",
        help="once the work under way finished: keep refusing, stop the daemon, or take new work again",
    )
    drn.add_argument(
        "--deadline", type=float, help="seconds work under way may take (default: server.shutdown_grace_s)"
    )
    drn.add_argument("--update", action="store_true", help="the agent says maint: an update follows")
    drn.add_argument("--resume", action="store_true", help="end a drain that holds: take new work again")
    drn.set_defaults(func=cmd_drain)

    flt = command(sub, "fleet", "the boxes on the LAN, for the operator's tools")
    flt_sub = flt.add_subparsers(dest="action", required=True, metavar="ACTION")
    targets = command(flt_sub, "targets", "write the boxes the LAN announces (zeroconf) as Prometheus file_sd targets")
    targets.add_argument("--out", type=Path, required=True, help="the file_sd JSON file to write (replaced whole)")
    targets.add_argument("--wait", type=float, default=5.0, help="seconds to listen for announcements")
    targets.add_argument(
        "--interface", action="append", help="an IPv4 address of the interface to listen on (repeatable; default all)"
    )
    flt.set_defaults(func=cmd_fleet)

    rec = command(sub, "recover", "on the box, after a failed boot self-test (appliance-rollback.service)")
    rec.add_argument(
        "--store", type=Path, default=firmware_store.STORE, help="the firmware store whose trial is undone"
    )
    rec.set_defaults(func=cmd_recover)
