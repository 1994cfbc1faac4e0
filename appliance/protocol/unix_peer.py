"""Who is at the other end of a Unix-socket connection, from the kernel's word (SO_PEERCRED)."""

from __future__ import annotations

import os
import socket
import struct
from pathlib import Path


def unix_peer(sock: socket.socket | None) -> tuple[str, bool]:
    """The connecting process's user, as Request.client names it ("uid:N"), and whether it is an
    operator: root, the daemon's own user, or a member of the group that owns the socket file (its
    primary group or a supplementary one). Processes of one user can already read each other's memory,
    so the user, not the process, is who owns a sequence on the Unix socket."""
    try:
        pid, uid, gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))  # type: ignore[union-attr]
        path = sock.getsockname()  # type: ignore[union-attr]
    except (OSError, AttributeError):  # not a Unix socket (a test's socketpair, another family)
        return "unix", False
    return f"uid:{uid}", uid in (0, os.geteuid()) or _in_group(pid, gid, path)


def _in_group(pid: int, gid: int, path: object) -> bool:
    try:
        group = os.stat(path).st_gid if isinstance(path, str) and path else None
    except OSError:
        return False
    return group is not None and (gid == group or group in _supplementary_groups(pid))


def _supplementary_groups(pid: int) -> set[int]:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:  # gone already, or /proc hides it
        return set()
    for line in status.splitlines():
        if line.startswith("Groups:"):
            return {int(g) for g in line.split()[1:]}
    return set()
