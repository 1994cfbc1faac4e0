"""Hostile update media: bundles whose files are links, FIFOs, oversized or deeply nested, whose signed
names are paths, and files written under a careless umask. Through the real CLI and the real daemon.

Each CLI run here has a deadline and an address-space limit, so a reader that follows /dev/zero or
waits on a FIFO fails the test (a traceback, or killed at the deadline) instead of taking the machine.
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import APPLIANCE, DEFAULT_SPEC, ROOT, Daemon, Keys, terminate

from appliance import firmware
from appliance import keys as signing
from appliance.errors import ApplianceError
from appliance.firmware import store as firmware_store

MODEL = "models/silero_vad.onnx"
ADDRESS_SPACE = 1 << 30  # the CLI verifying a bundle needs well under this
DEADLINE_S = 60.0  # a hang guard: a command that hangs is killed (-9) and fails


@dataclass
class Run:
    returncode: int | None  # None: killed at the deadline
    stdout: str
    stderr: str
    seconds: float
    max_rss_kib: int

    def error_line(self) -> str:
        """The one line of a failure (the CLI's exit 2): asserted to be one line, without a traceback."""
        assert self.returncode == 2, f"exit {self.returncode} after {self.seconds:.1f} s: {self.stderr[-2000:]}"
        assert "Traceback" not in self.stderr and self.stderr.count("\n") == 1, self.stderr[-2000:]
        return self.stderr


# The command runs as the child of this small process, which reports the child's own peak RSS on a pipe.
# (The peak of a child forked from pytest itself starts at pytest's resident size: fork shares its pages.)
PEAK_RSS = """
import os, sys
report, command = int(sys.argv[1]), sys.argv[2:]
pid = os.fork()
if pid == 0:
    os.close(report)
    os.execvp(command[0], command)
_, status, usage = os.wait4(pid, 0)
os.write(report, str(usage.ru_maxrss).encode())
sys.exit(os.waitstatus_to_exitcode(status))
"""


def run(*args: object, umask: int | None = None, deadline_s: float = DEADLINE_S) -> Run:
    """`appliance ARGS` with a deadline and at most ADDRESS_SPACE of memory; its own peak RSS."""

    def limits() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
        if umask is not None:
            os.umask(umask)

    peak_read, peak_write = os.pipe()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        start = time.monotonic()
        proc = subprocess.Popen(
            ["/usr/bin/python3", "-c", PEAK_RSS, str(peak_write), *APPLIANCE, *map(str, args)],
            cwd=ROOT,
            stdout=out,
            stderr=err,
            stdin=subprocess.DEVNULL,
            preexec_fn=limits,
            pass_fds=(peak_write,),
            start_new_session=True,
        )
        os.close(peak_write)
        returncode: int | None = None
        while True:
            pid, status, _ = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                returncode = os.waitstatus_to_exitcode(status)
                break
            if time.monotonic() - start > deadline_s:
                os.killpg(proc.pid, 9)
                os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        with os.fdopen(peak_read, "rb") as peak:
            max_rss_kib = int(peak.read() or 0)
        proc.returncode = -9 if returncode is None else returncode  # reaped here: Popen must not wait again
        seconds = time.monotonic() - start
        out.seek(0)
        err.seek(0)
        return Run(returncode, out.read().decode(), err.read().decode(), seconds, max_rss_kib)


def copy_bundle(bundle: Path, tmp_path: Path, name: str = "bundle") -> Path:
    target = tmp_path / name
    shutil.copytree(bundle, target)
    return target


def replace_with_fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def resign(bundle: Path, private_key: Path, data: bytes) -> None:
    """Write manifest bytes and a valid signature by the test key: the vendor signed it."""
    (bundle / firmware.MANIFEST).write_bytes(data)
    (bundle / signing.SIGNATURE).write_bytes(signing.load_private_key(private_key).sign(data))


# --- a link to /dev/zero -------------------------------------------------------------------------


@pytest.mark.parametrize("target", ["manifest.json", "manifest.sig", MODEL])
def test_link_to_dev_zero_is_refused_quickly_without_reading_it(
    bundle: Path, keys: Keys, tmp_path: Path, target: str
) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    (hostile / target).unlink()
    (hostile / target).symlink_to("/dev/zero")
    result = run("firmware", "verify", hostile, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{hostile / target}: is a symbolic link" in line and "never through links" in line
    assert result.max_rss_kib < 256 << 10, result.max_rss_kib  # a read of /dev/zero grows to its RLIMIT_AS


def test_oversized_manifest_is_refused_naming_the_limit(bundle: Path, keys: Keys, tmp_path: Path) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    with (hostile / firmware.MANIFEST).open("ab") as f:
        f.truncate(64 << 20)  # sparse: 64 MiB that cost nothing to make
    result = run("firmware", "verify", hostile, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{hostile / firmware.MANIFEST}: {64 << 20} bytes, over the 1 MiB limit for a manifest" in line
    assert result.max_rss_kib < 256 << 10


# --- a FIFO --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "target, command",
    [("manifest.json", "verify"), ("manifest.json", "inspect"), ("manifest.sig", "verify"), (MODEL, "verify")],
)
def test_fifo_in_a_bundle_does_not_hang_firmware_commands(
    bundle: Path, keys: Keys, tmp_path: Path, target: str, command: str
) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    replace_with_fifo(hostile / target)
    result = run("firmware", command, hostile, "--trusted-keys", keys.trusted)
    assert result.returncode == 2, (result.returncode, result.stderr)  # a hang is killed at the deadline: -9
    assert f"{hostile / target}: is a FIFO, not a regular file" in result.stderr.splitlines()[-1]
    assert "Traceback" not in result.stderr


def test_fifo_manifest_does_not_hang_update(bundle: Path, keys: Keys, tmp_path: Path) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    replace_with_fifo(hostile / firmware.MANIFEST)
    store = tmp_path / "store"
    result = run("update", hostile, "--store", store, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{hostile / firmware.MANIFEST}: is a FIFO" in line
    assert not store.exists(), "nothing is written for a bundle that does not verify"


def test_fifo_manifest_makes_the_daemon_exit_3_promptly(bundle: Path, keys: Keys, tmp_path: Path) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    replace_with_fifo(hostile / firmware.MANIFEST)
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    daemon = Daemon(workdir, hostile, keys.trusted)
    try:
        assert daemon.proc.wait(120) == 3  # opening the FIFO for reading would block for ever
    finally:
        terminate(daemon.proc)
    log = daemon.log.read_text()
    assert f"{hostile / firmware.MANIFEST}: is a FIFO" in log and "Traceback" not in log, log
    assert not daemon.socket.exists()


# --- a deeply nested manifest, properly signed ---------------------------------------------------


@pytest.mark.parametrize("command", ["verify", "inspect"])
def test_deeply_nested_signed_manifest_is_one_line(bundle: Path, keys: Keys, tmp_path: Path, command: str) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    original = (bundle / firmware.MANIFEST).read_bytes().rstrip()
    assert original.endswith(b"}")
    depth = 100_000
    resign(hostile, keys.private, original[:-1] + b', "nested": ' + b"[" * depth + b"]" * depth + b"}\n")
    result = run("firmware", command, hostile, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{hostile / firmware.MANIFEST}: not valid JSON: nested deeper than {signing.JSON_DEPTH_MAX} levels" in line
    if command == "inspect":
        doc = json.loads(result.stdout)
        assert doc["verified"] is False and doc["manifest"] is None


def test_manifest_nesting_is_bounded_below_what_a_printer_or_a_walk_can_take(tmp_path: Path) -> None:
    """A manifest nests 5 deep; JSON that the parser takes but that `inspect` would print as megabytes of
    brackets (960 deep) is refused like JSON the parser cannot take."""
    path = tmp_path / "manifest.json"
    assert isinstance(signing.parse_json(b"[" * signing.JSON_DEPTH_MAX + b"]" * signing.JSON_DEPTH_MAX, path), list)
    for depth in (signing.JSON_DEPTH_MAX + 1, 960):
        with pytest.raises(
            ApplianceError, match=f"manifest.json: not valid JSON: nested deeper than {signing.JSON_DEPTH_MAX}"
        ):
            signing.parse_json(b"[" * depth + b"]" * depth, path)


# --- links inside a bundle -----------------------------------------------------------------------


def _link_artifact_outside(hostile: Path, outside: Path) -> Path:
    """The model, byte for byte, but outside the bundle: its hash matches, the bytes are not the bundle's."""
    outside.mkdir()
    shutil.copy(hostile / MODEL, outside / "silero_vad.onnx")
    (hostile / MODEL).unlink()
    (hostile / MODEL).symlink_to(outside / "silero_vad.onnx")
    return hostile / MODEL


def _link_directory_outside(hostile: Path, outside: Path) -> Path:
    shutil.move(hostile / "models", outside)
    (hostile / "models").symlink_to(outside)
    return hostile / "models"


def _link_unlisted_file(hostile: Path, outside: Path) -> Path:
    (hostile / "models" / "extra.onnx").symlink_to("/etc/passwd")
    return hostile / "models" / "extra.onnx"


@pytest.mark.parametrize("make_link", [_link_artifact_outside, _link_directory_outside, _link_unlisted_file])
def test_link_inside_a_bundle_pointing_outside_is_refused(bundle: Path, keys: Keys, tmp_path: Path, make_link) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    link = make_link(hostile, tmp_path / "outside")
    result = run("firmware", "verify", hostile, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{link}: is a symbolic link" in line, line
    store = tmp_path / "store"
    result = run("update", hostile, "--store", store, "--trusted-keys", keys.trusted)
    assert f"{link}: is a symbolic link" in result.error_line() and not store.exists()


def test_daemon_refuses_a_bundle_whose_model_is_a_link(bundle: Path, keys: Keys, tmp_path: Path) -> None:
    """Verified through the link, then loaded through it (where it may change): the daemon never starts."""
    hostile = copy_bundle(bundle, tmp_path)
    link = _link_artifact_outside(hostile, tmp_path / "outside")
    workdir = tmp_path / "daemon"
    workdir.mkdir()
    daemon = Daemon(workdir, hostile, keys.trusted)
    try:
        assert daemon.proc.wait(60) == 3
    finally:
        terminate(daemon.proc)
    assert f"{link}: is a symbolic link" in daemon.log.read_text()


# --- signed names that are paths ----------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [("name", "../../../../tmp/x"), ("version", "1.0.0/../../../../../tmp/x"), ("name", "x" * 65), ("name", "..")],
)
def test_signed_name_that_is_a_path_does_not_verify_and_nothing_leaves_the_store(
    bundle: Path, keys: Keys, tmp_path: Path, field: str, value: str
) -> None:
    hostile = copy_bundle(bundle, tmp_path)
    doc = json.loads((hostile / firmware.MANIFEST).read_text())
    doc[field] = value
    signing.write_signed(hostile, doc, signing.load_private_key(keys.private))
    result = run("firmware", "verify", hostile, "--trusted-keys", keys.trusted)
    line = result.error_line()
    assert f"{hostile / firmware.MANIFEST}.{field}: " in line and "is not a safe name" in line, line

    store = tmp_path / "deep" / "er" / "store"
    escape = (store / firmware_store.RELEASES / "../../../../tmp").resolve()  # where the review saw it land
    before = set(escape.glob("x*")) if escape.is_dir() else set()
    result = run("update", hostile, "--store", store, "--trusted-keys", keys.trusted)
    assert "is not a safe name" in result.error_line()
    assert not store.exists()
    assert (set(escape.glob("x*")) if escape.is_dir() else set()) == before
    assert not list(Path("/tmp").glob("x-1.0.0-*"))


def test_store_confines_every_release_path(bundle: Path, keys: Keys, tmp_path: Path, monkeypatch) -> None:
    """Behind verify's check, the store's own: a release outside releases/ is refused before any write."""
    store = firmware_store.Store(tmp_path / "store")
    for name in ("../x", "..", "a/../../x", ""):
        with pytest.raises(ApplianceError, match="would leave the store"):
            firmware_store.release_path(store, name)
    with pytest.raises(ApplianceError, match="would leave the store"):
        firmware_store.confined(store, tmp_path / "elsewhere")
    real = firmware.verify(bundle, keys.trusted)
    unchecked = dataclasses.replace(real.manifest, name="../../../x")  # as if verify had let it through
    monkeypatch.setattr(firmware_store, "verify", lambda *_: firmware.Bundle(bundle, unchecked))
    with pytest.raises(ApplianceError, match="would leave the store"):
        firmware_store.install(store, bundle, keys.trusted)
    assert not store.root.exists() and not list(tmp_path.glob("x-*"))


# --- modes, whatever the umask -------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.mark.parametrize("umask", [0o000, 0o077])
def test_what_the_cli_and_the_store_write_has_explicit_modes(
    bundle: Path, keys: Keys, tmp_path: Path, umask: int
) -> None:
    made = tmp_path / "made"
    key = made / "keys" / "dev.key"
    trusted = made / "trusted"
    assert run("keys", "new", "--out", key, "--trust-dir", trusted, umask=umask).returncode == 0
    (kid_file,) = trusted.iterdir()
    assert {p: mode(p) for p in (key.parent, key, key.with_suffix(".pub"), trusted, kid_file)} == {
        key.parent: 0o755,
        key: 0o600,
        key.with_suffix(".pub"): 0o644,
        trusted: 0o755,
        kid_file: 0o644,
    }

    store = made / "store"
    result = run("firmware", "install", bundle, "--store", store, "--trusted-keys", keys.trusted, umask=umask)
    assert result.returncode == 0, result.stderr
    written = [store, *sorted(store.rglob("*"))]
    modes = {p.relative_to(made).as_posix(): mode(p) for p in written if not p.is_symlink()}
    expected = {p: 0o755 if (made / p).is_dir() else 0o644 for p in modes}
    assert modes == expected and len(modes) == 8, modes  # store, releases, release, models, 4 files

    built = made / "firmware" / "default"
    result = run("firmware", "build", DEFAULT_SPEC, "--key", keys.private, "--out", built, umask=umask, deadline_s=120)
    assert result.returncode == 0, result.stderr
    modes = {p.relative_to(made).as_posix(): mode(p) for p in [built.parent, built, *sorted(built.rglob("*"))]}
    assert modes == {p: 0o755 if (made / p).is_dir() else 0o644 for p in modes} and len(modes) == 6, modes

    cert, tls_key = made / "tls" / "certs" / "cert.pem", made / "tls" / "private" / "key.pem"
    assert run("tls", "init", "--cert", cert, "--key", tls_key, umask=umask).returncode == 0
    assert [mode(p) for p in (made / "tls", cert.parent, cert, tls_key.parent, tls_key)] == [
        0o755,
        0o755,
        0o644,
        0o755,
        0o600,
    ]
