"""The daemon under real systemd tools: systemd-socket-activate hands it the socket, a NOTIFY_SOCKET
the test listens on receives READY/STATUS/WATCHDOG/STOPPING/RELOADING, and the units verify."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, Keys, needs, terminate
from promtext import sample
from test_hostile_clients import read_all, responses
from waits import wait_until

from appliance.audio import encode_wav
from appliance.client import Client, ClientError

pytestmark = needs(shutil.which("systemd-socket-activate") is None, "systemd is not installed (make deps)")


class NotifyListener:
    """A NOTIFY_SOCKET: collects (time, message) as the daemon sends them."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(str(path))
        self.sock.settimeout(0.2)
        self.messages: list[tuple[float, str]] = []
        self._stop = False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop:
            try:
                data = self.sock.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            self.messages.append((time.monotonic(), data.decode()))

    def wait_for(self, line: str, after: float = 0.0, timeout: float = 60.0) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for t, message in list(self.messages):
                if t >= after and line in message.split("\n"):
                    return t
            time.sleep(0.01)
        raise AssertionError(f"no {line!r} in {self.messages}")

    def times(self, line: str) -> list[float]:
        return [t for t, m in list(self.messages) if line in m.split("\n")]

    def statuses(self) -> list[str]:
        return [line[7:] for _, m in list(self.messages) for line in m.split("\n") if line.startswith("STATUS=")]

    def close(self) -> None:
        self._stop = True
        self.sock.close()


def listening(path: Path) -> bool:
    """The Unix socket at `path` takes connections: its file appears at bind(), before listen(), and a
    connect between the two is refused (the kernel's table marks a listening socket __SO_ACCEPTCON)."""
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split()
        if len(fields) == 8 and fields[7] == str(path) and int(fields[3], 16) & 0x10000:
            return True
    return False


class Activated:
    """`appliance run` launched by systemd-socket-activate on the first connection."""

    def __init__(self, workdir: Path, bundle: Path, trusted: Path, extra: str = "", watchdog_usec: int = 0) -> None:
        self.socket = workdir / "api.sock"
        self.config = workdir / "appliance.toml"
        self.config.write_text(
            f'[server]\nsocket = "{workdir}/unused.sock"\nshutdown_grace_s = 20.0\n'
            f'[firmware]\nbundle = "{bundle}"\ntrusted_keys = "{trusted}"\n' + extra
        )
        self.notify = NotifyListener(workdir / "notify.sock")
        self.hang_trigger = workdir / "hang"
        self.log = workdir / "daemon.log"
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        args = [
            "systemd-socket-activate",
            "-l",
            str(self.socket),
            "-E",
            f"NOTIFY_SOCKET={self.notify.path}",
            "-E",
            f"APPLIANCE_FAILPOINT_ENGINE_HANG={self.hang_trigger}",
            "-E",
            f"PYTHONPATH={ROOT}",
        ]
        if watchdog_usec:
            args += ["-E", f"WATCHDOG_USEC={watchdog_usec}"]
        args += [sys.executable, "-m", "appliance", "run", "--config", str(self.config)]
        self.proc = subprocess.Popen(args, env=env, cwd=ROOT, stdout=self.log.open("wb"), stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 10
        while not listening(self.socket):
            assert time.monotonic() < deadline, self.log.read_text()
            time.sleep(0.01)

    def client(self) -> Client:
        return Client(str(self.socket), timeout=60)

    def stop(self) -> int:
        code = terminate(self.proc)
        self.notify.close()
        return code


@pytest.fixture
def activate(tmp_path: Path, keys: Keys, bundle: Path):
    started: list[Activated] = []

    def start(extra: str = "", watchdog_usec: int = 0, bundle_dir: Path | None = None) -> Activated:
        workdir = tmp_path / f"a{len(started)}"
        workdir.mkdir()
        d = Activated(workdir, bundle_dir or bundle, keys.trusted, extra, watchdog_usec)
        started.append(d)
        return d

    yield start
    for d in started:
        d.hang_trigger.unlink(missing_ok=True)
        d.stop()


def noise(frames: int) -> np.ndarray:
    return (np.random.default_rng(frames).standard_normal(frames * 512) * 0.1).astype(np.float32)


def test_ready_only_when_serving_with_status_on_the_handed_socket(activate) -> None:
    d = activate()
    with d.client() as client:
        assert client.health()["ready"]  # this first connection launched the daemon and waited in the backlog
    d.notify.wait_for("READY=1")
    with d.client() as client:  # the moment READY arrived, an inference answers
        assert client.speech_probs(noise(2)).shape == (2,)
    log = d.log.read_text()
    assert log.index("warmed up") < log.index("ready: serving") and "(socket from systemd)" in log
    assert any("firmware voice-vad 1.0.0, engine onnxruntime-cpu" in s for s in d.notify.statuses())
    assert d.stop() == 0
    assert d.socket.exists(), "a socket handed over by systemd must not be unlinked by the daemon"


def test_watchdog_pings_come_from_engine_probes_and_stop_when_the_engine_hangs(activate) -> None:
    """Pings follow READY while the engine answers its probes; none comes once the engine is held (a
    small VAD batch runs on the event loop, so a wedged call there stops the loop, the watchdog with
    it); released, the engine pings again. No verdict here is taken from a clock: how often, and the
    order against a probe that times out on a thread, are test_watchdog.py's, in process."""
    d = activate(watchdog_usec=1_000_000)  # ping every 0.5 s
    with d.client() as client:
        client.health()
    ready = d.notify.wait_for("READY=1")
    wait_until(lambda: len([t for t in d.notify.times("WATCHDOG=1") if t > ready]) >= 4, "four pings")
    d.hang_trigger.touch()  # the engine's next call stalls, as a wedged driver call would
    wait_until(lambda: "held by the test's hang failpoint" in d.log.read_text(), "the engine held", log=d.log)
    held = time.monotonic()
    time.sleep(3.0)  # a window to see a ping in, were there one: six intervals
    assert not [t for t in d.notify.times("WATCHDOG=1") if t > held], "pings went on with a hung engine"
    d.hang_trigger.unlink()
    d.notify.wait_for("WATCHDOG=1", after=time.monotonic(), timeout=60)  # a recovered engine pings again


def test_sigterm_during_16_in_flight_requests_completes_all_of_them(activate) -> None:
    """Sixteen uploads under way when SIGTERM comes (each but its last byte sent, all held by the
    daemon): the stop waits for them, and each, sent whole after the signal, is decoded and answered
    in full; then the daemon exits 0. The order of events decides, not how fast the machine reads."""
    d = activate()
    with d.client() as client:
        client.health()
    d.notify.wait_for("READY=1")
    uploads = []
    for i in range(16):
        wav = encode_wav(noise(600 + i), 16000)  # ~20 s of audio each
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(60)
        sock.connect(str(d.socket))
        head = b"POST /v2/models/silero_vad/segments HTTP/1.1\r\nhost: box\r\ncontent-length: %d\r\n\r\n" % len(wav)
        sock.sendall(head + wav[:-1])
        uploads.append((sock, wav))
    held = sum(len(wav) - 1 for _, wav in uploads)
    with d.client() as client:
        wait_until(lambda: sample(client.metrics(), "appliance_buffered_bytes") >= held, "the 16 uploads held")
    d.proc.send_signal(signal.SIGTERM)
    d.notify.wait_for("STOPPING=1")
    for sock, wav in uploads:
        sock.sendall(wav[-1:])
    answers = [responses(read_all(sock)) for sock, _ in uploads]
    assert [[(status, json.loads(body)["duration"]) for status, body in a] for a in answers] == [
        [(200, (600 + i) * 512 / 16000)] for i in range(16)
    ], answers
    assert d.proc.wait(60) == 0
    assert "stopping: 16 requests in flight, 0 sequences open" in d.notify.statuses()


def test_sighup_applies_a_changed_setting_on_open_connections(activate) -> None:
    d = activate("[sequences]\nmax_live = 2\n")
    client = d.client()
    client.health()
    d.notify.wait_for("READY=1")
    client.speech_probs(noise(1), sequence_id=1, start=True)
    client.speech_probs(noise(1), sequence_id=2, start=True)
    connection = client.transport._sock
    d.config.write_text(
        d.config.read_text()
        .replace("max_live = 2", "max_live = 1")
        .replace("shutdown_grace_s = 20.0", 'shutdown_grace_s = 20.0\nsocket_mode = "0600"')
    )
    hup_at = time.monotonic()
    d.proc.send_signal(signal.SIGHUP)
    d.notify.wait_for("RELOADING=1", after=hup_at)
    d.notify.wait_for("READY=1", after=hup_at)
    client.speech_probs(noise(1), sequence_id=2, end=True)  # the open sequence carries on
    client.speech_probs(noise(1), sequence_id=1, end=True)
    client.speech_probs(noise(1), sequence_id=3, start=True)
    with pytest.raises(ClientError) as err:
        client.speech_probs(noise(1), sequence_id=4, start=True)
    assert err.value.status == 429 and "(1 live sequences)" in err.value.message
    assert client.transport._sock is connection, "the reload dropped the connection"
    assert any("needs restart for server.socket_mode" in s for s in d.notify.statuses())
    client.close()


def test_failed_start_reports_why_in_status(activate, tmp_path: Path, bundle: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(bundle, broken)
    (broken / "manifest.sig").write_bytes(b"\0" * 64)
    d = activate(bundle_dir=broken)
    with pytest.raises(OSError):
        with d.client() as client:
            client.health()
    assert d.proc.wait(30) == 3
    assert any(s.startswith("start failed:") and "signature does not verify" in s for s in d.notify.statuses())


def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    for name in ("appliance.service", "appliance.socket"):
        text = (ROOT / "image" / name).read_text()
        # installed units run the venv under /opt/appliance; here, the checkout's
        (tmp_path / name).write_text(
            text.replace(
                "/opt/appliance/.venv/bin/appliance",
                shutil.which("appliance") or str(Path(sys.executable).parent / "appliance"),
            )
        )
    result = subprocess.run(
        ["systemd-analyze", "verify", str(tmp_path / "appliance.socket"), str(tmp_path / "appliance.service")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    service = (ROOT / "image" / "appliance.service").read_text()
    for line in (
        "Type=notify",
        "WatchdogSec=",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "CapabilityBoundingSet=CAP_BPF CAP_PERFMON CAP_NET_ADMIN",
        "DeviceAllow=/dev/nvidiactl rw",
        "TemporaryFileSystem=/dev/shm:",
    ):
        assert line in service


def test_each_start_step_extends_systemds_start_timeout(activate) -> None:
    """EXTEND_TIMEOUT_USEC with every step of the start (loading, each model loaded, each warm-up),
    all before READY=1: a slow machine making progress is not killed at TimeoutStartSec."""
    d = activate()
    with d.client() as client:
        assert client.health()["ready"]
    ready = d.notify.wait_for("READY=1")
    extends = [t for t in d.notify.times("EXTEND_TIMEOUT_USEC=600000000") if t <= ready]
    assert len(extends) >= 3, d.notify.messages  # loading, silero_vad loaded, warming up silero_vad
    assert "warming up model silero_vad" in d.notify.statuses()
