"""What a call could not do, as types the CLI maps to exit codes; and the words that say where a
Unix socket path leads, for the one-line error."""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat

STARTING = ".starting"  # beside the socket while the daemon starts (appliance/durable.py starting_marker)


class ClientError(Exception):
    """Anything a call could not do; `ServerError` and `ConnectError` below say which.

    `status` is the HTTP status the daemon answered with, 0 when it did not answer.
    """

    status: int = 0

    @property
    def message(self) -> str:
        return str(self)


class ServerError(ClientError):
    """The daemon answered with an error status; `message` is its {"error": ...} text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self._message = message

    @property
    def message(self) -> str:
        return self._message


class ConnectError(ClientError, ConnectionError):
    """The daemon could not be reached, or the connection to it broke: nothing was answered.

    Also a ConnectionError (an OSError), as it was before this type existed.
    """


class SocketUnreachable(ConnectError):
    """Connecting to the Unix socket failed; the message names `path` and what is there, and
    `starting` is the pid of a daemon that is still starting there (0: none is)."""

    def __init__(self, message: str, path: str, starting: int = 0) -> None:
        super().__init__(message)
        self.path, self.starting = path, starting


class NoAnswer(ConnectError, TimeoutError):
    """Nobody answered in time: no QUIC handshake, or no response before the timeout."""


class CertificateRejected(ConnectError):
    """QUIC: the server's certificate does not verify against the client's CA file (or the reverse:
    the server refused the client's certificate, `by_server`)."""

    def __init__(self, message: str, by_server: bool = False) -> None:
        super().__init__(message)
        self.by_server = by_server


def parse_quic_address(address: str) -> tuple[str, int]:
    """'HOST:PORT' or '[IPv6]:PORT' -> (host, port); ValueError saying what is wrong otherwise."""
    host, colon, port = address.rpartition(":")
    if not colon or not host or (":" in host and not (host.startswith("[") and host.endswith("]"))):
        raise ValueError(f"{address!r} is not HOST:PORT (an IPv6 address goes in brackets: [::1]:4433)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{address!r}: {port!r} is not a UDP port (1-65535)")
    return host.strip("[]"), int(port)


def describe_path(path: str) -> str:
    """What is at `path`, in words: 'no such file', 'a regular file (12 bytes)', 'a socket', ..."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            return f"a symbolic link to {os.readlink(path)}, which does not exist"
        parent = os.path.dirname(os.path.abspath(path))
        return "no such file" if os.path.isdir(parent) else f"no such file, nor its directory {parent}"
    except OSError as exc:
        return f"cannot look ({(exc.strerror or str(exc)).lower()})"
    kinds = {
        stat.S_ISSOCK: "a socket",
        stat.S_ISDIR: "a directory",
        stat.S_ISFIFO: "a FIFO",
        stat.S_ISCHR: "a character device",
        stat.S_ISBLK: "a block device",
    }
    for test, kind in kinds.items():
        if test(st.st_mode):
            return kind
    return f"a regular file ({st.st_size} bytes)"


def _owner(st: os.stat_result) -> str:
    try:
        user = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        user = str(st.st_uid)
    try:
        group = grp.getgrgid(st.st_gid).gr_name
    except KeyError:
        group = str(st.st_gid)
    return f"{user}:{group}"


def starting_daemon(path: str) -> int:
    """The pid of a daemon still starting on this socket (its marker, durable.starting_marker), or 0."""
    try:
        with open(path + STARTING, encoding="ascii") as marker:
            pid = int(marker.read().strip())
        os.kill(pid, 0)
    except PermissionError:
        return pid  # alive, another user's
    except (OSError, ValueError):
        return 0
    return pid


def unix_connect_error(path: str, exc: OSError, timeout: float) -> SocketUnreachable:
    """Why connecting to the daemon's Unix socket failed, naming the path and what is there."""
    there = describe_path(path)
    if isinstance(exc, (TimeoutError, BlockingIOError)):
        reason = f"{there} is there but did not accept the connection within {timeout:g} s (the daemon is overloaded?)"
    elif there == "a socket" and exc.errno == errno.ECONNREFUSED:
        reason = "a socket file is there but nothing listens on it (stale: the daemon is not running)"
    elif there == "a socket" and exc.errno in (errno.EACCES, errno.EPERM):
        st = os.stat(path)
        reason = (
            f"a socket is there but this user may not connect to it (permission denied: owner {_owner(st)}, "
            f"mode {stat.S_IMODE(st.st_mode):04o}; the daemon's socket_group may)"
        )
    elif there.startswith("no such file") and (pid := starting_daemon(path)):
        message = f"the daemon at {path} is still starting (pid {pid}): it serves once its models are loaded and warm"
        return SocketUnreachable(message, path, pid)
    elif there.startswith("no such file") or there.endswith("which does not exist"):
        reason = f"{there} (is the daemon running, and is this its socket?)"
    elif there.startswith("a ") and there != "a socket":
        reason = f"{there} is there, not a socket"
    else:
        reason = f"{there}: {(exc.strerror or str(exc)).lower()}"
    return SocketUnreachable(f"cannot reach the daemon at {path}: {reason}", path)
