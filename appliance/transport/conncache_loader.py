"""Compile bpf/conncache.c with bcc, attach it to inherited UDP sockets and pin its maps; optionally
also steer QUIC across those sockets (bpf/quic_steering.c); then exit. Run by the daemon as a child
process (`python -m appliance.transport.conncache_loader`), so that bcc and LLVM never live in the
daemon: the filter stays attached to the shared sockets, the steering program to their SO_REUSEPORT
group, and the maps stay reachable through their pins after this process is gone.

Exit 0 when the connection cache is loaded; otherwise 1 and one line on stderr saying why, for the
daemon to log or report. Steering is optional: when it was asked for (--steer-key) and did not
load, the connection cache still stands and stdout carries one line saying why.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import sys
from pathlib import Path

from bcc import BPF, libbcc  # Debian's python3-bpfcc, through the venv's system site packages

from appliance.transport.conncache import MAPS, STEERING_MAP

# bpf/ of a source checkout (make venv installs it editable), else the copy a wheel installs as data
CHECKOUT = Path(__file__).resolve().parents[2] / "bpf"
ROOT = CHECKOUT if CHECKOUT.is_dir() else Path(sys.prefix) / "share" / "appliance" / "bpf"
BPF_SOURCE = ROOT / "conncache.c"
STEERING_SOURCE = ROOT / "quic_steering.c"
SO_ATTACH_BPF = 50
SO_ATTACH_REUSEPORT_EBPF = 52
BPF_PROG_TYPE_SK_REUSEPORT = 21  # not in bcc's BPFProgType
BPF_MAP_TYPE_SOCKHASH = 18
PR_SET_PDEATHSIG = 1

libbcc.lib.bcc_create_map.restype = ctypes.c_int
libbcc.lib.bcc_create_map.argtypes = [ctypes.c_int, ctypes.c_char_p] + [ctypes.c_int] * 4


def explain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError):
        return f"bcc is not installed ({text}); install python3-bpfcc"
    if "Failed to compile" in text:
        return "the BPF C did not compile (kernel headers missing for this kernel?)"
    if "Failed to load" in text or "Operation not permitted" in text or isinstance(exc, PermissionError):
        return f"the kernel refused the program: no CAP_BPF/CAP_SYS_ADMIN? ({text.splitlines()[0]})"
    return text.splitlines()[0]


def pin(fd: int, path: Path) -> None:
    path.unlink(missing_ok=True)  # a dead daemon's map (the parent holds the pin_dir lock)
    if libbcc.lib.bpf_obj_pin(fd, str(path).encode()) != 0:
        raise OSError(f"cannot pin the map at {path} (is bpffs mounted on /sys/fs/bpf?)")


def attach(fd: int, option: int, program_fd: int) -> None:
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, option, program_fd)
    finally:
        sock.detach()  # the daemon's socket: leave it open


def load(fds: list[int], pin_dir: Path, defines: list[str]) -> None:
    bpf = BPF(src_file=str(BPF_SOURCE).encode(), cflags=[f"-D{d}" for d in defines])
    program = bpf.load_func(b"conncache_filter", BPF.SOCKET_FILTER)
    for name in MAPS:
        pin(bpf[name.encode()].map_fd, pin_dir / name)
    for fd in fds:  # the same filter, counting into the same maps, on every socket
        attach(fd, SO_ATTACH_BPF, program.fd)


def steer(fds: list[int], keys: list[int], pin_dir: Path, defines: list[str]) -> None:
    """bpf/quic_steering.c on the sockets' SO_REUSEPORT group, each key mapped to its socket."""
    workers = libbcc.lib.bcc_create_map(BPF_MAP_TYPE_SOCKHASH, b"quic_workers", 4, 8, max(len(fds), 1), 0)
    if workers < 0:
        raise OSError(ctypes.get_errno(), f"cannot create the workers map (errno {ctypes.get_errno()})")
    for fd, key in zip(fds, keys, strict=True):
        key_buffer, value = ctypes.create_string_buffer(key.to_bytes(4, "big"), 4), ctypes.c_uint64(fd)
        if libbcc.lib.bpf_update_elem(workers, key_buffer, ctypes.byref(value), 0) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"the kernel refused a socket in the workers map (errno {errno}: UDP in SOCKHASH?)")
    bpf = BPF(src_file=str(STEERING_SOURCE).encode(), cflags=[f"-D{d}" for d in [*defines, f"WORKERS_FD={workers}"]])
    program = bpf.load_func(b"quic_steering", BPF_PROG_TYPE_SK_REUSEPORT)
    pin(workers, pin_dir / STEERING_MAP)
    try:
        attach(fds[0], SO_ATTACH_REUSEPORT_EBPF, program.fd)  # one socket: the program is the group's
    except OSError as exc:
        (pin_dir / STEERING_MAP).unlink(missing_ok=True)
        raise OSError(
            f"the kernel refused the program for the sockets' group ({exc}): one SO_REUSEPORT group?"
        ) from None


def die_with(parent: int) -> None:
    """Killed when the daemon that started it ends: a loader left compiling after a stop during start-up
    would attach to sockets no one reads and pin its maps over those of the daemon that starts next."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it ended before the line above
        sys.exit("the daemon that started the loader has stopped")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--parent", type=int, required=True, help="the daemon's pid: the loader ends with it")
    parser.add_argument("--fd", type=int, action="append", required=True, help="a UDP socket, inherited")
    parser.add_argument("--pin-dir", type=Path, required=True)
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE for the BPF C")
    parser.add_argument(
        "--steer-key", type=int, action="append", default=[], help="a worker's CID key, one per --fd, in order"
    )
    args = parser.parse_args()
    die_with(args.parent)
    try:
        load(args.fd, args.pin_dir, args.define)
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exceptions; the daemon gets the reason
        print(explain(exc), file=sys.stderr)
        return 1
    if args.steer_key:
        try:
            steer(args.fd, args.steer_key, args.pin_dir, args.define)
        except Exception as exc:  # noqa: BLE001 - the cache stands; the daemon gets the reason
            print(f"steering: {explain(exc)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
