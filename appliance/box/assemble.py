"""disk.raw on the build host (`make image`): the GPT, the ESP made here, slot A filled, slot B empty."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

from appliance.box.disk import enumerate_blocks, run_tool
from appliance.box.layout import DISK, DISK_GUID, DISK_SIZE, LAYOUT, LOADER_CONF, loader_entry, partition
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Advance, Progress, ignore


def _make_esp(path: Path, boot_efi: Path, kernel: Path, initrd: Path) -> None:
    esp = partition("esp")
    run_tool("mkfs.vfat", "-F", "32", "-n", "ESP", "-C", str(path), str(esp.size // 1024))
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
            run_tool("mmd", "-i", str(path), d)
        copies = [
            (boot_efi, "::/EFI/BOOT/BOOTX64.EFI"),
            (boot_efi, "::/EFI/systemd/systemd-bootx64.efi"),
            (Path(tmp) / "loader.conf", "::/loader/loader.conf"),
            (Path(tmp) / "slot-a.conf", "::/loader/entries/slot-a.conf"),
            (kernel, "::/appliance/slot-a/vmlinuz"),
            (initrd, "::/appliance/slot-a/initrd.img"),
        ]
        for source, dest in copies:
            run_tool("mcopy", "-i", str(path), str(source), dest)


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
