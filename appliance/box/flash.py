"""`appliance flash`: a verified image onto a block device or an existing file, synced and read back."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from appliance.box.disk import size_of, write_region
from appliance.box.layout import DISK_SIZE
from appliance.box.manifest import ImageManifest, check_regions, open_disk, verify
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Progress


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
    size = size_of(target)
    if size < DISK_SIZE:
        raise ApplianceError(f"{target}: {size} bytes, too small for the image ({DISK_SIZE} bytes)")
    manifest = verify(image_dir, trust_dir, progress=progress)
    with open_disk(image_dir) as disk:
        write_region(disk, 0, DISK_SIZE, target, 0, f"write {target}", progress)
    # On a larger target the backup GPT stays where the image has it; the kernel reads the primary one.
    check_regions(target, 0, manifest.regions, f"{target} (read back)", progress, f"read back {target}")
    return manifest
