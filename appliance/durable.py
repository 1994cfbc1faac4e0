"""Writes that survive a power cut (sync a file or directory, replace a file in one rename), with explicit
modes: what the CLI and the store write has the mode it should have whatever the caller's umask."""

from __future__ import annotations

import os
from pathlib import Path

PARTIAL = ".partial"  # what is being written, before its rename into place
FILE_MODE, DIRECTORY_MODE = 0o644, 0o755


def starting_marker(socket: Path) -> Path:
    """The file a starting daemon keeps beside its socket-to-be, holding its pid, until the socket is
    bound: `appliance call health` tells "still starting" from "not running" by it."""
    return socket.with_name(socket.name + ".starting")


def fsync_path(path: Path) -> None:
    """fsync a file, or a directory (which makes the renames and links in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_directories(path: Path, mode: int = DIRECTORY_MODE) -> None:
    """mkdir -p; each directory it makes gets `mode` whatever the umask (those that exist are left alone)."""
    missing = []
    while not path.is_dir() and path.parent != path:
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir(mode)
        except FileExistsError:
            if directory.is_dir():  # made by someone else meanwhile
                continue
            raise
        os.chmod(directory, mode)


def create_file(path: Path, mode: int = FILE_MODE) -> int:
    """A new file (never an existing one, never through a link) with exactly `mode`: its fd, for writing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    os.fchmod(fd, mode)
    return fd


def replace_file(path: Path, data: bytes, mode: int = FILE_MODE) -> None:
    """Write, sync, then rename into place: a reader sees the old file or the whole new one."""
    partial = path.with_name(path.name + PARTIAL)
    partial.unlink(missing_ok=True)  # a leftover would keep its own mode
    with os.fdopen(create_file(partial, mode), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    partial.rename(path)
    fsync_path(path.parent)
