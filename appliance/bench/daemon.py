"""The daemon under test, in a process of its own with a config of its own; free UDP and TCP ports."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from appliance.client import Client
from appliance.tls import init_self_signed

# every daemon's processes and their resident memory (MiB) as it was stopped, in order: what each part
# of the bench left behind (`appliance bench` prints them last)
MEMORY_AT_STOP: list[tuple[str, dict[str, float]]] = []


def free_udp_port() -> int:
    return _free_port(socket.SOCK_DGRAM)


def free_tcp_port() -> int:
    return _free_port(socket.SOCK_STREAM)


def _free_port(kind: socket.SocketKind) -> int:
    with socket.socket(socket.AF_INET, kind) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    def __init__(
        self,
        bundle: Path,
        trusted: Path,
        workdir: Path,
        conncache: str = "",
        workers: int = 1,
        https: bool = False,
        label: str = "",
    ) -> None:
        """`conncache`: lines of its [conncache] table, then any tables of its own ([engine] ...);
        `workers`: server.workers (1: the transports in the engine process, as the older figures);
        `https`: HTTPS on a free TCP port too (`https_port`); `label`: its name in MEMORY_AT_STOP
        (its workdir's name by default)."""
        self.label = label or workdir.name
        workdir.mkdir(parents=True, exist_ok=True)
        self.socket = workdir / "api.sock"
        self.cert, key = workdir / "cert.pem", workdir / "key.pem"
        init_self_signed(self.cert, key, [])
        self.quic = f"127.0.0.1:{free_udp_port()}"
        self.pin_dir: Path | None = None  # where its eBPF maps are pinned, where the bench chose it
        if "pin_dir" not in conncache:  # its own: a daemon already serving here (make run) holds the default
            self.pin_dir = Path(f"/sys/fs/bpf/appliance-bench-{os.getpid()}-{workdir.name}")
            conncache = f'pin_dir = "{self.pin_dir}"\n{conncache}'
        self.https_port = free_tcp_port() if https else None
        if https:
            conncache += f"[https]\nenabled = true\nport = {self.https_port}\n"
        config = workdir / "bench.toml"
        config.write_text(
            f'[server]\nsocket = "{self.socket}"\nmax_body_bytes = {256 << 20}\nworkers = {workers}\n'
            f"[quic]\nenabled = true\nport = {self.quic.split(':')[1]}\n"
            f'certificate = "{self.cert}"\nprivate_key = "{key}"\n'
            f'[firmware]\nbundle = "{bundle.resolve()}"\ntrusted_keys = "{trusted.resolve()}"\n'
            f'[log]\nlevel = "warning"\n[conncache]\n{conncache}'
        )
        self.proc = subprocess.Popen([sys.executable, "-m", "appliance", "run", "--config", str(config)])
        deadline = time.monotonic() + 120  # the voice firmware loads three models
        while time.monotonic() < deadline:
            try:
                with Client(str(self.socket), timeout=5) as c:
                    if c.health()["ready"]:
                        return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"daemon exited {self.proc.returncode}") from None
                time.sleep(0.05)
        raise RuntimeError("daemon did not become ready")

    def rss_mib(self) -> float:
        """The engine process's resident memory."""
        return _rss_mib(self.proc.pid)

    def rss_by_process(self) -> dict[str, float]:
        """Resident memory of the engine process and of each process it started: its protocol workers
        and its translator processes (engine/bergamot_process.py)."""
        out = {"engine": round(_rss_mib(self.proc.pid), 1)}
        count: dict[str, int] = {}
        for child in self._children():
            if (role := _role(child)) is None:
                continue
            count[role] = count.get(role, 0) + 1
            out[f"{role} {count[role]}"] = round(_rss_mib(child), 1)
        return out

    def serving_loops(self) -> list[int]:
        """The processes whose event loop answers its sockets: the protocol workers where it has them,
        else the engine process (each loop on its process's main thread)."""
        workers = [child for child in self._children() if _role(child) == "worker"]
        return workers or [self.proc.pid]

    def _children(self) -> list[int]:
        """Every thread's children: the translators are started by the engine's translation threads."""
        found = []
        for children in Path(f"/proc/{self.proc.pid}/task").glob("*/children"):
            try:
                found += [int(p) for p in children.read_text().split()]
            except OSError:
                continue
        return found

    def cpu_s(self) -> float:
        """CPU seconds the daemon's process has used (all its threads): the work a request cost it,
        steadier than wall time on a machine others share."""
        return _cpu_s(self.proc.pid)

    def tree_cpu_s(self) -> float:
        """CPU seconds of the engine process and the processes it started (workers, translators) together."""
        return self.cpu_s() + sum(_cpu_s(pid) for pid in self._children())

    def status(self) -> Any:
        with Client(str(self.socket)) as client:
            return client.status()

    def stop(self) -> None:
        if self.proc.poll() is None:
            MEMORY_AT_STOP.append((self.label, self.rss_by_process()))
        self.proc.send_signal(signal.SIGTERM)
        self.proc.wait(30)


def _rss_mib(pid: int) -> float:
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:  # gone meanwhile
        return float("nan")
    return next((int(line.split()[1]) / 1024 for line in lines if line.startswith("VmRSS:")), float("nan"))


def _cpu_s(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _role(pid: int) -> str | None:
    """A child's role, by its command line: a translator (engine/bergamot_process.py) or a protocol
    worker; None if it has ended."""
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return "translator" if b"bergamot_process" in command else "worker"
