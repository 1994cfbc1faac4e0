"""Writes that survive a power cut: sync a file or directory, replace a file in one rename."""

from __future__ import annotations

import os
from pathlib import Path

PARTIAL = ".partial"  # what is being written, before its rename into place


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes the renames and links in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: bytes, mode: int = 0o644) -> None:
    """Write, sync, then rename into place: a reader sees the old file or the whole new one."""
    partial = path.with_name(path.name + PARTIAL)
    partial.unlink(missing_ok=True)  # a leftover would keep its own mode
    with os.fdopen(os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    partial.rename(path)
    fsync_path(path.parent)
