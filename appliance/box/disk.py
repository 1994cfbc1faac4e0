"""Bytes of disks and image files: read and hash in blocks, write a region and sync it, sizes; the disk tools.

An image's disk.raw is update media and comes as a `keys.Medium` (opened by `keys.open_medium`: a regular
file reached without links, its size bounded); a path is a target (a block device, a file being written)."""

from __future__ import annotations

import hashlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from appliance import keys
from appliance.errors import ApplianceError
from appliance.progress import Advance, Progress, ignore

BLOCK = 4 << 20


def read_range(path: Path | keys.Medium, offset: int, size: int) -> Iterator[bytes]:
    if isinstance(path, keys.Medium):
        yield from path.blocks(offset, size, BLOCK)
        return
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left:
            block = f.read(min(BLOCK, left))
            if not block:
                raise ApplianceError(f"{path}: ends before byte {offset + size} (truncated)")
            left -= len(block)
            yield block


def sha256_range(path: Path | keys.Medium, offset: int, size: int, advance: Advance = ignore) -> str:
    digest = hashlib.sha256()
    for block in read_range(path, offset, size):
        digest.update(block)
        advance(len(block))
    return digest.hexdigest()


def enumerate_blocks(path: Path) -> Iterator[tuple[int, bytes]]:
    position = 0
    for block in read_range(path, 0, path.stat().st_size):
        yield position, block
        position += len(block)


def write_region(
    source: Path | keys.Medium,
    source_offset: int,
    size: int,
    target: Path,
    target_offset: int,
    what: str,
    progress: Progress,
) -> None:
    """Copy size bytes from source to target, fsync, and drop the target's cached pages for a read-back."""
    fd = os.open(target, os.O_WRONLY)
    try:
        written = 0
        with progress.phase(what, size) as advance:
            for block in read_range(source, source_offset, size):
                os.pwrite(fd, block, target_offset + written)
                written += len(block)
                advance(len(block))
        progress.note(f"sync {target}")
        os.fsync(fd)
        # Drop the cached pages so that the read-back that follows reads the medium.
        os.posix_fadvise(fd, target_offset, size, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def size_of(target: Path) -> int:
    """The size of a file or a block device."""
    with target.open("rb") as f:
        return f.seek(0, os.SEEK_END)


def run_tool(*argv: str) -> None:
    """An external disk tool (mkfs.vfat, mtools, debugfs); its own message when it fails."""
    result = subprocess.run(argv, capture_output=True, text=True)
    if result.returncode != 0:
        raise ApplianceError(f"{argv[0]} failed: {result.stderr.strip() or result.stdout.strip()}")
