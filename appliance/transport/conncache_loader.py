"""Compile bpf/conncache.c with bcc, attach it to an inherited UDP socket and pin its maps; then
exit. Run by the daemon as a child process (`python -m appliance.conncache_loader`), so that bcc
and LLVM never live in the daemon: the filter stays attached to the shared socket and the maps
stay reachable through their pins after this process is gone.

Exit 0 on success; otherwise one line on stderr saying why, for the daemon to log or report.
"""

from __future__ import annotations

import argparse
import socket
import sys
from pathlib import Path

from bcc import BPF, libbcc  # Debian's python3-bpfcc, through the venv's system site packages

from appliance.transport.conncache import MAPS

BPF_SOURCE = Path(__file__).resolve().parents[2] / "bpf" / "conncache.c"
SO_ATTACH_BPF = 50


def explain(exc: BaseException) -> str:
    text = str(exc) or type(exc).__name__
    if isinstance(exc, ImportError):
        return f"bcc is not installed ({text}); install python3-bpfcc"
    if "Failed to compile" in text:
        return "the BPF C did not compile (kernel headers missing for this kernel?)"
    if "Failed to load" in text or "Operation not permitted" in text or isinstance(exc, PermissionError):
        return f"the kernel refused the program: no CAP_BPF/CAP_SYS_ADMIN? ({text.splitlines()[0]})"
    return text.splitlines()[0]


def load(fd: int, pin_dir: Path, defines: list[str]) -> None:
    bpf = BPF(src_file=str(BPF_SOURCE).encode(), cflags=[f"-D{d}" for d in defines])
    program = bpf.load_func(b"conncache_filter", BPF.SOCKET_FILTER)
    for name in MAPS:
        path = pin_dir / name
        path.unlink(missing_ok=True)  # a dead daemon's map (the parent holds the pin_dir lock)
        if libbcc.lib.bpf_obj_pin(bpf[name.encode()].map_fd, str(path).encode()) != 0:
            raise OSError(f"cannot pin the map at {path} (is bpffs mounted on /sys/fs/bpf?)")
    sock = socket.socket(fileno=fd)
    try:
        sock.setsockopt(socket.SOL_SOCKET, SO_ATTACH_BPF, program.fd)
    finally:
        sock.detach()  # the daemon's socket: leave it open


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--fd", type=int, required=True, help="the UDP socket, inherited")
    parser.add_argument("--pin-dir", type=Path, required=True)
    parser.add_argument("--define", action="append", default=[], help="NAME=VALUE for the BPF C")
    args = parser.parse_args()
    try:
        load(args.fd, args.pin_dir, args.define)
    except Exception as exc:  # noqa: BLE001 - bcc raises plain Exceptions; the daemon gets the reason
        print(explain(exc), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
