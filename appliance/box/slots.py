"""The running box's A/B slots: which one booted, whether on trial, and writing the inactive one on trial."""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from appliance.box.disk import run_tool, size_of, write_region
from appliance.box.layout import INITRD_IN_ROOT, KERNEL_IN_ROOT, SLOTS, TRIAL_TRIES, loader_entry, slot_partition
from appliance.box.manifest import check_regions, open_disk, verify
from appliance.durable import fsync_path, make_directories, replace_file
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Progress


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
        run_tool("debugfs", "-R", f"dump {inside} {out}", str(device))
        if not out.exists() or out.stat().st_size == 0:
            raise ApplianceError(f"{device}: no {inside} in the new root")
        return out.read_bytes()


def update_slot(image_dir: Path, trust_dir: Path, box: Box = Box(), progress: Progress = QUIET) -> str:
    """Write a verified image's root to the inactive slot and make it the next boot, on trial.

    Order matters for power loss and kill -9: the inactive slot's entry goes first, the new entry
    comes last, so at every moment the loader has a complete slot to boot. Returns the trial slot.
    """
    running = box.running_slot()
    trial = next(s for s in SLOTS if s != running)
    manifest = verify(image_dir, trust_dir, names=("root-a",), progress=progress)
    region = manifest.region("root-a")
    device = box.slot_device(trial)
    if size_of(device) < region.size:
        raise ApplianceError(f"{device}: smaller than the image's root ({region.size} bytes)")
    version = box.entry_version(running) + 1
    for entry in box.entries(trial):
        entry.unlink()
    fsync_path(box.esp / "loader/entries")
    with open_disk(image_dir) as disk:
        write_region(disk, region.offset, region.size, device, 0, f"write slot {trial}", progress)
    check_regions(device, -region.offset, (region,), f"{device} (read back)", progress, f"read back slot {trial}")
    kernel_dir = box.esp / "appliance" / f"slot-{trial}"
    make_directories(kernel_dir)
    replace_file(kernel_dir / "vmlinuz", _dump_from_ext4(device, KERNEL_IN_ROOT))
    replace_file(kernel_dir / "initrd.img", _dump_from_ext4(device, INITRD_IN_ROOT))
    replace_file(box.esp / "loader/entries" / f"slot-{trial}+{TRIAL_TRIES}.conf", loader_entry(trial, version).encode())
    progress.note(f"slot {trial} ({manifest.name} {manifest.version}) is the next boot, on trial")
    return trial


def slot_name(box: Box) -> str:
    """ "slot a, " on the appliance's disk; empty where the daemon runs elsewhere (a firmware-only test)."""
    try:
        return f"slot {box.running_slot()}, "
    except ApplianceError:
        return ""
