"""Pinned BPF maps read and written with the bpf() system call itself (ctypes), so the daemon
can use the connection cache's maps without importing bcc (LLVM costs it over 100 MiB of RSS);
bcc runs only in the short-lived loader (appliance.transport.conncache_loader). And the pin directory's
lock: one daemon to a pin_dir."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import platform
from collections.abc import Iterator
from pathlib import Path

from appliance.errors import ApplianceError

SYS_BPF = {"x86_64": 321, "aarch64": 280}[platform.machine()]
BPF_MAP_LOOKUP_ELEM, BPF_MAP_UPDATE_ELEM, BPF_MAP_DELETE_ELEM, BPF_MAP_GET_NEXT_KEY, BPF_OBJ_GET = 1, 2, 3, 4, 7

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _ElemAttr(ctypes.Structure):  # union bpf_attr, the map element commands
    _fields_ = [
        ("map_fd", ctypes.c_uint32),
        ("pad", ctypes.c_uint32),
        ("key", ctypes.c_uint64),
        ("value", ctypes.c_uint64),
        ("flags", ctypes.c_uint64),
    ]


class _ObjAttr(ctypes.Structure):  # union bpf_attr, BPF_OBJ_GET
    _fields_ = [("pathname", ctypes.c_uint64), ("bpf_fd", ctypes.c_uint32), ("file_flags", ctypes.c_uint32)]


def _bpf(command: int, attr: ctypes.Structure) -> int:
    result = _libc.syscall(SYS_BPF, command, ctypes.byref(attr), ctypes.sizeof(attr))
    if result < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))
    return result


def possible_cpus() -> int:
    """Per-CPU maps hold one value per possible CPU (/sys/devices/system/cpu/possible: "0-3")."""
    count = 0
    for part in Path("/sys/devices/system/cpu/possible").read_text().strip().split(","):
        low, _, high = part.partition("-")
        count += int(high or low) - int(low) + 1
    return count


class PinnedMap:
    """A map pinned on bpffs, by its key and value sizes (as the BPF C declares them)."""

    def __init__(self, path: Path, key_size: int, value_size: int) -> None:
        self.path, self.key_size, self.value_size = path, key_size, value_size
        name = ctypes.create_string_buffer(str(path).encode())
        self.fd = _bpf(BPF_OBJ_GET, _ObjAttr(ctypes.addressof(name), 0, 0))

    def keys(self, limit: int) -> Iterator[bytes]:
        """Every key, at most `limit` of them (a key deleted meanwhile restarts the kernel's walk)."""
        current, following = None, ctypes.create_string_buffer(self.key_size)
        for _ in range(limit):
            attr = _ElemAttr(
                self.fd, 0, ctypes.addressof(current) if current is not None else 0, ctypes.addressof(following), 0
            )
            try:
                _bpf(BPF_MAP_GET_NEXT_KEY, attr)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    return
                raise
            current = ctypes.create_string_buffer(following.raw, self.key_size)
            yield current.raw

    def lookup(self, key: bytes) -> bytes | None:
        key_buffer, value = (
            ctypes.create_string_buffer(key, self.key_size),
            ctypes.create_string_buffer(self.value_size),
        )
        try:
            _bpf(BPF_MAP_LOOKUP_ELEM, _ElemAttr(self.fd, 0, ctypes.addressof(key_buffer), ctypes.addressof(value), 0))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return None
            raise
        return value.raw

    def update(self, key: bytes, value: bytes) -> None:
        key_buffer = ctypes.create_string_buffer(key, self.key_size)
        value_buffer = ctypes.create_string_buffer(value, self.value_size)
        attr = _ElemAttr(self.fd, 0, ctypes.addressof(key_buffer), ctypes.addressof(value_buffer), 0)  # BPF_ANY
        _bpf(BPF_MAP_UPDATE_ELEM, attr)

    def delete(self, key: bytes) -> bool:
        key_buffer = ctypes.create_string_buffer(key, self.key_size)
        try:
            _bpf(BPF_MAP_DELETE_ELEM, _ElemAttr(self.fd, 0, ctypes.addressof(key_buffer), 0, 0))
        except OSError as exc:
            if exc.errno == errno.ENOENT:
                return False
            raise
        return True

    def close(self) -> None:
        os.close(self.fd)


def own_pin_dir(pin_dir: Path) -> int:
    """Lock pin_dir for this daemon's lifetime (flock on the directory: bpffs holds no plain files, and
    the kernel drops the lock when the process dies). A second daemon on the same pins is a start error,
    never a fallback: it would replace the live daemon's maps. OSError: bpffs is not usable there."""
    try:
        pin_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OSError(f"cannot create {pin_dir}: {exc} (is bpffs mounted on /sys/fs/bpf?)") from None
    fd = os.open(pin_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ApplianceError(
            f"conncache.pin_dir {pin_dir} belongs to another running daemon; give each daemon its own pin_dir"
        ) from None
    return fd
