"""What the daemon says to and takes from systemd: readiness, status, watchdog, sockets, journal.

Every function is a no-op outside systemd (no NOTIFY_SOCKET, no LISTEN_FDS, no JOURNAL_STREAM),
so the same daemon runs in a terminal, under systemd-socket-activate and as a unit.
"""

from __future__ import annotations

import logging
import os
import socket
import time

try:  # Debian's python3-systemd, seen through the venv's system site packages
    from systemd import daemon as sd_daemon
    from systemd import journal as sd_journal
except ImportError:  # pragma: no cover - a machine without python3-systemd
    sd_daemon = sd_journal = None


def notify(*lines: str) -> None:
    if sd_daemon is not None and os.environ.get("NOTIFY_SOCKET"):
        sd_daemon.notify("\n".join(lines))


def ready(status: str) -> None:
    notify("READY=1", f"STATUS={status}")


def status(text: str) -> None:
    notify(f"STATUS={text}")


def stopping(text: str) -> None:
    notify("STOPPING=1", f"STATUS={text}")


def reloading() -> None:
    notify(
        "RELOADING=1",
        f"MONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}",
        "STATUS=reloading config",
    )


def extend_start(seconds: float, text: str) -> None:
    """The start made progress: systemd waits up to `seconds` more for the next step (or READY=1)."""
    notify(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}", f"STATUS={text}")


def watchdog_ping() -> None:
    notify("WATCHDOG=1")


def watchdog_interval() -> float | None:
    """Seconds between pings (half of WATCHDOG_USEC), or None when systemd wants none from us."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and int(pid) != os.getpid()):
        return None
    return int(usec) / 2e6


def listen_sockets() -> tuple[socket.socket | None, socket.socket | None]:
    """The sockets systemd handed us (socket activation): the API's stream Unix socket and the
    QUIC listener's UDP socket, each None where we bind our own."""
    api = quic = None
    if sd_daemon is None:
        return api, quic
    for fd in sd_daemon.listen_fds(unset_environment=True):
        if sd_daemon.is_socket_unix(fd, socket.SOCK_STREAM, 1):
            api = socket.socket(fileno=fd)
        elif sd_daemon.is_socket_inet(fd, 0, socket.SOCK_DGRAM):
            quic = socket.socket(fileno=fd)
    for sock in (api, quic):
        if sock is not None:
            sock.setblocking(False)
    return api, quic


def stderr_is_journal() -> bool:
    stream = os.environ.get("JOURNAL_STREAM")
    if not stream or sd_journal is None:
        return False
    st = os.fstat(2)
    return stream == f"{st.st_dev}:{st.st_ino}"


def journal_handler() -> logging.Handler:
    """Structured records: PRIORITY from the level; fields from the record (FIRMWARE, MODEL, REQUEST_ID)."""
    return sd_journal.JournalHandler(SYSLOG_IDENTIFIER="appliance")
