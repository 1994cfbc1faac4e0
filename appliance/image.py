"""The appliance disk image: a fixed A/B layout, a signed manifest of region hashes, flash and update.

An image is a directory:

    disk.raw        a GPT disk: ESP, root-a, root-b, data (the layout below, fixed for every build)
    manifest.json   name, version, signing key id and the sha256 of every region of disk.raw
    manifest.sig    Ed25519 over the exact bytes of manifest.json (the firmware bundles' scheme and keys)

Booting is systemd-boot's: one Type #1 loader entry per slot on the ESP. A trial slot's entry carries a
boot counter (`slot-b+1.conf`); systemd-boot decrements it at boot and systemd-bless-boot drops it
once boot-complete.target is reached (the self-test passed). An entry with no tries left sorts
below every other, so the next boot takes the previous slot again. Entries sort by `version`
(highest first), which an update raises by one.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance import keys
from appliance.durable import fsync_path, replace_file
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Advance, Progress, ignore

FORMAT_VERSION = 1
DISK = "disk.raw"
MANIFEST, SIGNATURE = keys.MANIFEST, keys.SIGNATURE
MIB = 1 << 20
BLOCK = 4 * MIB
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
ROOT_TYPE = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"  # root (x86-64), Discoverable Partitions Specification
DATA_TYPE = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
DISK_GUID = "6A1C3E80-3F5B-4E4C-9A55-1D2B2C0A0001"
SLOTS = ("a", "b")
TRIAL_TRIES = 1
KERNEL_OPTIONS = "rw console=ttyS0,115200 panic=10"
KERNEL_IN_ROOT = "/boot/vmlinuz"
INITRD_IN_ROOT = "/boot/initrd.img"


@dataclass(frozen=True, slots=True)
class Partition:
    label: str
    type: str
    uuid: str
    start_mib: int
    size_mib: int

    @property
    def offset(self) -> int:
        return self.start_mib * MIB

    @property
    def size(self) -> int:
        return self.size_mib * MIB


def _layout(root_mib: int) -> tuple[Partition, ...]:
    sizes = (
        ("esp", ESP_TYPE, 256),
        ("root-a", ROOT_TYPE, root_mib),
        ("root-b", ROOT_TYPE, root_mib),
        ("data", DATA_TYPE, 256),
    )
    parts, start = [], 1
    for n, (label, kind, size) in enumerate(sizes, 1):
        parts.append(Partition(label, kind, f"6A1C3E80-3F5B-4E4C-9A55-1D2B2C0A{n:04X}", start, size))
        start += size
    return tuple(parts)


LAYOUT = _layout(2048)
DISK_SIZE = (LAYOUT[-1].start_mib + LAYOUT[-1].size_mib + 1) * MIB  # + 1 MiB for the backup GPT


def partition(label: str) -> Partition:
    return next(p for p in LAYOUT if p.label == label)


def slot_partition(slot: str) -> Partition:
    return partition(f"root-{slot}")


@dataclass(frozen=True, slots=True)
class Region:
    """A byte range of disk.raw and its sha256; together the regions cover every byte."""

    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ImageManifest:
    format: int
    name: str
    version: str
    build_time: str
    signing_key_id: str
    disk_size: int
    regions: tuple[Region, ...]

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise ApplianceError(f"image manifest has no region {name!r}")


def _regions() -> list[tuple[str, int, int]]:
    spans = [("gpt", 0, LAYOUT[0].offset)]
    spans += [(p.label, p.offset, p.size) for p in LAYOUT]
    end = LAYOUT[-1].offset + LAYOUT[-1].size
    spans.append(("gpt-backup", end, DISK_SIZE - end))
    return spans


def _read_range(path: Path, offset: int, size: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left:
            block = f.read(min(BLOCK, left))
            if not block:
                raise ApplianceError(f"{path}: ends before byte {offset + size} (truncated)")
            left -= len(block)
            yield block


def sha256_range(path: Path, offset: int, size: int, advance: Advance = ignore) -> str:
    digest = hashlib.sha256()
    for block in _read_range(path, offset, size):
        digest.update(block)
        advance(len(block))
    return digest.hexdigest()


def sign(image_dir: Path, key_path: Path, name: str, version: str, progress: Progress = QUIET) -> ImageManifest:
    """Hash every region of image_dir/disk.raw and write the signed manifest next to it."""
    disk = image_dir / DISK
    if disk.stat().st_size != DISK_SIZE:
        raise ApplianceError(f"{disk}: {disk.stat().st_size} bytes, the layout needs {DISK_SIZE}")
    private = keys.load_private_key(key_path)
    with progress.phase(f"hash {disk}", DISK_SIZE) as advance:
        regions = tuple(Region(n, o, s, sha256_range(disk, o, s, advance)) for n, o, s in _regions())
    manifest = ImageManifest(
        FORMAT_VERSION,
        name,
        version,
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        keys.key_id(private.public_key()),
        DISK_SIZE,
        regions,
    )
    keys.write_signed(image_dir, asdict(manifest), private)
    return manifest


def verify_signature(image_dir: Path, trust_dir: Path) -> ImageManifest:
    """The manifest, if its signature verifies against a trusted key; hashes are checked separately."""
    manifest_path = image_dir / MANIFEST
    doc = keys.read_signed(image_dir, trust_dir, "an image")
    try:
        manifest = ImageManifest(**{**doc, "regions": tuple(Region(**r) for r in doc["regions"])})
    except (TypeError, KeyError) as exc:
        raise ApplianceError(f"{manifest_path}: malformed image manifest: {exc}") from None
    if manifest.format != FORMAT_VERSION or manifest.disk_size != DISK_SIZE:
        raise ApplianceError(
            f"{manifest_path}: format {manifest.format}, disk size {manifest.disk_size}: "
            f"this appliance reads format {FORMAT_VERSION} with disk size {DISK_SIZE}"
        )
    return manifest


def check_regions(
    path: Path, base: int, regions: tuple[Region, ...], what: str, progress: Progress = QUIET, phase: str | None = None
) -> None:
    """Every region's bytes, read from `path` at base + region offset, hash as the manifest says."""
    with progress.phase(phase or f"verify {what}", sum(r.size for r in regions)) as advance:
        for region in regions:
            if sha256_range(path, base + region.offset, region.size, advance) != region.sha256:
                raise ApplianceError(
                    f"{what}: region {region.name} (bytes {region.offset}..{region.offset + region.size})"
                    " does not match the signed manifest (altered or badly written)"
                )


def verify(
    image_dir: Path, trust_dir: Path, names: tuple[str, ...] | None = None, progress: Progress = QUIET
) -> ImageManifest:
    """Signature, then the hash of every region (or of the named ones) of disk.raw."""
    manifest = verify_signature(image_dir, trust_dir)
    disk = image_dir / DISK
    if not disk.is_file() or disk.stat().st_size != manifest.disk_size:
        raise ApplianceError(f"{disk}: missing or not {manifest.disk_size} bytes")
    regions = manifest.regions if names is None else tuple(manifest.region(n) for n in names)
    check_regions(disk, 0, regions, str(disk), progress)
    return manifest


# --- assemble (build host) ------------------------------------------------------------------------


def loader_entry(slot: str, version: int) -> str:
    return (
        f"title Appliance (slot {slot.upper()})\nsort-key appliance\nversion {version}\n"
        f"linux /appliance/slot-{slot}/vmlinuz\ninitrd /appliance/slot-{slot}/initrd.img\n"
        f"options root=PARTUUID={slot_partition(slot).uuid.lower()} {KERNEL_OPTIONS}\n"
    )


LOADER_CONF = "timeout 0\nauto-entries no\nauto-firmware no\nconsole-mode keep\n"


def _run(*argv: str) -> None:
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise ApplianceError(f"{argv[0]} failed: {result.stderr.strip() or result.stdout.strip()}")


def _make_esp(path: Path, boot_efi: Path, kernel: Path, initrd: Path) -> None:
    esp = partition("esp")
    _run("mkfs.vfat", "-F", "32", "-n", "ESP", "-C", str(path), str(esp.size // 1024))
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "loader.conf").write_text(LOADER_CONF)
        (Path(tmp) / "slot-a.conf").write_text(loader_entry("a", 1))
        for d in (
            "::/EFI",
            "::/EFI/BOOT",
            "::/EFI/systemd",
            "::/loader",
            "::/loader/entries",
            "::/appliance",
            "::/appliance/slot-a",
            "::/appliance/slot-b",
        ):
            _run("mmd", "-i", str(path), d)
        copies = [
            (boot_efi, "::/EFI/BOOT/BOOTX64.EFI"),
            (boot_efi, "::/EFI/systemd/systemd-bootx64.efi"),
            (Path(tmp) / "loader.conf", "::/loader/loader.conf"),
            (Path(tmp) / "slot-a.conf", "::/loader/entries/slot-a.conf"),
            (kernel, "::/appliance/slot-a/vmlinuz"),
            (initrd, "::/appliance/slot-a/initrd.img"),
        ]
        for source, dest in copies:
            _run("mcopy", "-i", str(path), str(source), dest)


def assemble(
    out_dir: Path,
    root_img: Path,
    data_img: Path,
    boot_efi: Path,
    kernel: Path,
    initrd: Path,
    progress: Progress = QUIET,
) -> None:
    """disk.raw from the root and data file systems: the ESP made here, slot A filled, slot B empty."""
    for img, label in ((root_img, "root-a"), (data_img, "data")):
        if img.stat().st_size > partition(label).size:
            raise ApplianceError(
                f"{img}: {img.stat().st_size} bytes do not fit partition {label} ({partition(label).size} bytes)"
            )
    out_dir.mkdir(parents=True, exist_ok=True)
    disk = out_dir / DISK
    disk.unlink(missing_ok=True)
    with disk.open("wb") as f:
        f.truncate(DISK_SIZE)
    script = [f"label: gpt\nlabel-id: {DISK_GUID}\nunit: sectors\nfirst-lba: 2048\n"]
    for p in LAYOUT:
        script.append(f"start={p.offset // 512}, size={p.size // 512}, type={p.type}, uuid={p.uuid}, name={p.label}\n")
    result = subprocess.run(
        ["sfdisk", "--no-reread", "--no-tell-kernel", "-q", str(disk)],
        input="".join(script),
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise ApplianceError(f"sfdisk: {result.stderr.strip()}")
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        esp_img = Path(tmp) / "esp.img"
        _make_esp(esp_img, boot_efi, kernel, initrd)
        for img, label in ((esp_img, "esp"), (root_img, "root-a"), (data_img, "data")):
            with progress.phase(f"copy {img.name} into {label}", img.stat().st_size) as advance:
                _copy_into(img, disk, partition(label).offset, advance)


def _copy_into(source: Path, disk: Path, offset: int, advance: Advance = ignore) -> None:
    """Copy a file into disk at offset, leaving holes where the source is all zeros (sparse output)."""
    fd = os.open(disk, os.O_WRONLY)
    try:
        for block_offset, block in enumerate_blocks(source):
            if block.count(0) != len(block):
                os.pwrite(fd, block, offset + block_offset)
            advance(len(block))
    finally:
        os.close(fd)


def enumerate_blocks(path: Path) -> Iterator[tuple[int, bytes]]:
    position = 0
    for block in _read_range(path, 0, path.stat().st_size):
        yield position, block
        position += len(block)


# --- writing to a target (flash and update share this) -------------------------------------------


def _write_region(
    source: Path, source_offset: int, size: int, target: Path, target_offset: int, what: str, progress: Progress
) -> None:
    fd = os.open(target, os.O_WRONLY)
    try:
        written = 0
        with progress.phase(what, size) as advance:
            for block in _read_range(source, source_offset, size):
                os.pwrite(fd, block, target_offset + written)
                written += len(block)
                advance(len(block))
        progress.note(f"sync {target}")
        os.fsync(fd)
        # Drop the cached pages so that the read-back below reads the medium.
        os.posix_fadvise(fd, target_offset, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _size_of(target: Path) -> int:
    with target.open("rb") as f:
        return f.seek(0, os.SEEK_END)


def _mounted_sources() -> set[str]:
    sources = set()
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        fields = line.split(" - ", 1)[1].split()
        if len(fields) >= 2 and fields[1].startswith("/dev/"):
            sources.add(os.path.realpath(fields[1]))
    return sources


def _in_use(target: Path) -> str | None:
    """Why the target may not be overwritten now (mounted, or backing a loop device), or None."""
    mode = target.stat().st_mode
    real = os.path.realpath(target)
    if stat.S_ISBLK(mode):
        name = Path(real).name
        devices = {real} | {f"/dev/{child.name}" for child in Path(f"/sys/class/block/{name}").glob(f"{name}*")}
        mounted = sorted(devices & _mounted_sources())
        if mounted:
            return f"{', '.join(mounted)} is mounted"
        if any(Path(f"/sys/class/block/{name}/holders").glob("*")):
            return "it is held by another device (device-mapper, RAID or LVM)"
        return None
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        if os.path.realpath(backing.read_text().strip()) == real:
            return f"it backs /dev/{backing.parent.parent.name}"
    return None


def flash(image_dir: Path, target: Path, trust_dir: Path, progress: Progress = QUIET) -> ImageManifest:
    """Verify the image, then write it to a block device or an existing file, sync, read back, check."""
    if not target.exists():
        raise ApplianceError(f"{target}: no such device or file (for a file target: truncate -s {DISK_SIZE} {target})")
    mode = target.stat().st_mode
    if not (stat.S_ISBLK(mode) or stat.S_ISREG(mode)):
        raise ApplianceError(f"{target}: neither a block device nor a regular file")
    if (reason := _in_use(target)) is not None:
        raise ApplianceError(f"{target}: refusing to write: {reason}")
    size = _size_of(target)
    if size < DISK_SIZE:
        raise ApplianceError(f"{target}: {size} bytes, too small for the image ({DISK_SIZE} bytes)")
    manifest = verify(image_dir, trust_dir, progress=progress)
    _write_region(image_dir / DISK, 0, DISK_SIZE, target, 0, f"write {target}", progress)
    # On a larger target the backup GPT stays where the image has it; the kernel reads the primary one.
    check_regions(target, 0, manifest.regions, f"{target} (read back)", progress, f"read back {target}")
    return manifest


# --- the running box: self-test and update -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Box:
    """Where a running box keeps what an update touches."""

    esp: Path = Path("/boot/efi")
    partitions: Path = Path("/dev/disk/by-partlabel")
    cmdline: Path = Path("/proc/cmdline")

    def running_slot(self) -> str:
        match = re.search(r"\broot=PARTUUID=(\S+)", self.cmdline.read_text())
        for slot in SLOTS:
            if match and match.group(1).upper() == slot_partition(slot).uuid:
                return slot
        raise ApplianceError(f"{self.cmdline}: root is not one of the appliance's slots")

    def slot_device(self, slot: str) -> Path:
        return self.partitions / f"root-{slot}"

    def entries(self, slot: str) -> list[Path]:
        """The slot's loader entries: slot-b.conf (good) or slot-b+LEFT[-DONE].conf (counting)."""
        return sorted((self.esp / "loader/entries").glob(f"slot-{slot}*.conf"))

    def entry_version(self, slot: str) -> int:
        for entry in self.entries(slot):
            if match := re.search(r"^version\s+(\d+)", entry.read_text(), re.M):
                return int(match.group(1))
        raise ApplianceError(f"{self.esp}/loader/entries: no entry with a version for slot {slot}")


# systemd-boot sets this EFI variable when the booted entry has a boot counter, i.e. a trial boot.
BOOT_COUNT_VARIABLE = Path("/sys/firmware/efi/efivars/LoaderBootCountPath-4a67b082-0a4c-41cf-b6c7-440b29bb8c4f")


def booted_on_trial() -> bool:
    return BOOT_COUNT_VARIABLE.exists()


def _dump_from_ext4(device: Path, inside: str) -> bytes:
    """A file out of an unmounted ext4 file system (debugfs reads it; nothing is mounted)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "file"
        _run("debugfs", "-R", f"dump {inside} {out}", str(device))
        if not out.exists() or out.stat().st_size == 0:
            raise ApplianceError(f"{device}: no {inside} in the new root")
        return out.read_bytes()


def update(image_dir: Path, trust_dir: Path, box: Box = Box(), progress: Progress = QUIET) -> str:
    """Write a verified image's root to the inactive slot and make it the next boot, on trial.

    Order matters for power loss and kill -9: the inactive slot's entry goes first, the new entry
    comes last, so at every moment the loader has a complete slot to boot. Returns the trial slot.
    """
    running = box.running_slot()
    trial = next(s for s in SLOTS if s != running)
    manifest = verify(image_dir, trust_dir, names=("root-a",), progress=progress)
    region = manifest.region("root-a")
    device = box.slot_device(trial)
    if _size_of(device) < region.size:
        raise ApplianceError(f"{device}: smaller than the image's root ({region.size} bytes)")
    version = box.entry_version(running) + 1
    for entry in box.entries(trial):
        entry.unlink()
    fsync_path(box.esp / "loader/entries")
    _write_region(image_dir / DISK, region.offset, region.size, device, 0, f"write slot {trial}", progress)
    check_regions(device, -region.offset, (region,), f"{device} (read back)", progress, f"read back slot {trial}")
    kernel_dir = box.esp / "appliance" / f"slot-{trial}"
    kernel_dir.mkdir(parents=True, exist_ok=True)
    replace_file(kernel_dir / "vmlinuz", _dump_from_ext4(device, KERNEL_IN_ROOT))
    replace_file(kernel_dir / "initrd.img", _dump_from_ext4(device, INITRD_IN_ROOT))
    replace_file(box.esp / "loader/entries" / f"slot-{trial}+{TRIAL_TRIES}.conf", loader_entry(trial, version).encode())
    progress.note(f"slot {trial} ({manifest.name} {manifest.version}) is the next boot, on trial")
    return trial


def _slot_name(box: Box) -> str:
    """ "slot a, " on the appliance's disk; empty where the daemon runs elsewhere (a firmware-only test)."""
    try:
        return f"slot {box.running_slot()}, "
    except ApplianceError:
        return ""


def selftest(socket_path: str, timeout_s: float = 180.0, box: Box = Box()) -> str:
    """Wait for the daemon to be ready, then run a real inference; the line to log, or an error."""
    import numpy as np

    from appliance.client import Client, ClientError

    deadline = time.monotonic() + timeout_s
    last_error = "not ready"
    while time.monotonic() < deadline:
        try:
            with Client(socket_path, timeout=30.0) as client:
                if client.health()["ready"]:
                    seconds = np.arange(16000, dtype=np.float32) / 16000
                    probs = client.infer((0.3 * np.sin(2 * np.pi * 220 * seconds)).astype(np.float32))
                    frames = -(-16000 // 512)  # the last frame is padded
                    if probs.size != frames or not np.all((probs >= 0) & (probs <= 1)):
                        raise ApplianceError(
                            f"self-test inference returned {probs.size} values, not {frames} in [0, 1]"
                        )
                    firmware = client.status()["firmware"]
                    return (
                        f"appliance-selftest: ok {_slot_name(box)}{probs.size} probabilities, "
                        f"firmware {firmware['name']} {firmware['version']}"
                    )
        except (OSError, ClientError) as exc:
            last_error = str(exc)
        time.sleep(1.0)
    raise ApplianceError(
        f"self-test: the daemon on {socket_path} did not serve an inference within {timeout_s:.0f} s ({last_error})"
    )
