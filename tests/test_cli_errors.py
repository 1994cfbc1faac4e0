"""The `appliance` command's failures: one line on stderr that says what to do, the documented exit
code (appliance/exitcodes.py), never a traceback. Each case runs the real CLI as a subprocess; the last
checks the Python client's error types that the CLI maps to those codes."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import wave
from pathlib import Path

import numpy as np
import pytest
from conftest import APPLIANCE, ROOT, Daemon, cli

from appliance import exitcodes
from appliance.audio import encode_wav
from appliance.bench.daemon import free_udp_port
from appliance.client import Call

HINT = "point at the daemon's socket with --socket PATH or APPLIANCE_SOCKET=PATH"


def run(*args: object, env: dict[str, str] | None = None, stdin: str = "") -> subprocess.CompletedProcess[str]:
    environ = {k: v for k, v in os.environ.items() if k != "APPLIANCE_SOCKET"}
    return subprocess.run(
        [*APPLIANCE, *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**environ, **(env or {})},
        timeout=60,
        check=False,
        input=stdin,
    )


def one_line(result: subprocess.CompletedProcess[str]) -> str:
    """stderr, asserted to be exactly one line and no traceback."""
    assert "Traceback" not in result.stderr, result.stderr
    assert result.stderr.endswith("\n") and result.stderr.count("\n") == 1, result.stderr
    return result.stderr.rstrip("\n")


def unreachable(path: Path, what: str) -> str:
    return f"appliance: error: cannot reach the daemon at {path}: {what}; {HINT}"


# --- the Unix socket: nothing there, a stale socket, something else there ------------------------------------------


def test_no_file_at_the_socket_path(tmp_path: Path) -> None:
    result = run("call", "health", "--socket", tmp_path / "api.sock")
    assert result.returncode == exitcodes.UNREACHABLE == 4
    assert one_line(result) == unreachable(
        tmp_path / "api.sock", "no such file (is the daemon running, and is this its socket?)"
    )


@pytest.mark.parametrize("listened", [False, True], ids=["bound", "listened"])
def test_stale_socket(tmp_path: Path, listened: bool) -> None:
    path = tmp_path / "api.sock"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listened:
        sock.listen()
    sock.close()  # the file stays; nothing listens on it: ECONNREFUSED
    result = run("call", "health", "--socket", path)
    assert result.returncode == exitcodes.UNREACHABLE
    assert one_line(result) == unreachable(
        path, "a socket file is there but nothing listens on it (stale: the daemon is not running)"
    )


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_something_else_at_the_socket_path(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "api.sock"
    if kind == "file":
        path.write_bytes(b"not a socket")
    else:
        path.mkdir()
    result = run("status", "--socket", path)  # `status` fails the same way as `call`
    assert result.returncode == exitcodes.UNREACHABLE
    there = "a regular file (12 bytes)" if kind == "file" else "a directory"
    assert one_line(result) == unreachable(path, f"{there} is there, not a socket")


def test_appliance_socket_environment_variable_is_honoured(tmp_path: Path, daemon: Daemon) -> None:
    missing = tmp_path / "elsewhere.sock"
    result = run("call", "health", env={"APPLIANCE_SOCKET": str(missing)})
    assert result.returncode == exitcodes.UNREACHABLE
    assert one_line(result) == unreachable(missing, "no such file (is the daemon running, and is this its socket?)")
    ok = run("call", "health", env={"APPLIANCE_SOCKET": str(daemon.socket)})
    assert ok.returncode == exitcodes.OK and '"ready": true' in ok.stdout and ok.stderr == ""


# --- the daemon answers with an error -----------------------------------------------------------------------------


def test_early_413_is_shown_not_a_broken_pipe(tmp_path: Path, daemon: Daemon) -> None:
    """The daemon (max_body_bytes = 8 MiB in conftest) answers 413 from the headers and closes while the
    client is still sending the body; the client reads and shows that answer."""
    limit = 8 << 20
    big = tmp_path / "big.wav"
    with wave.open(str(big), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(bytes(limit))
    with daemon.client() as client:  # the Python client reads the early answer too: the daemon's own words
        response = client.send(Call("POST", "/v2/models/silero_vad/segments", big.read_bytes()))
    assert response.status == 413 and str(big.stat().st_size) in response.json()["error"]
    for stream in ((), ("--stream",)):
        result = run("call", "vad", big, *stream, "--socket", daemon.socket)
        assert result.returncode == exitcodes.DAEMON_ERROR == 1
        assert one_line(result) == f"appliance: error: the daemon answered HTTP 413: {response.json()['error']}"


# --- QUIC: no answer, a certificate refused, an address without a port --------------------------------------------


def test_quic_no_answer_fails_within_seconds(tls: tuple[Path, Path]) -> None:
    port = free_udp_port()  # nothing listens there
    result = run("call", "--quic", f"127.0.0.1:{port}", "--cafile", tls[0], "health")
    assert result.returncode == exitcodes.UNREACHABLE
    assert one_line(result) == (
        f"appliance: error: no answer from 127.0.0.1:{port} over QUIC within 5 s (is the "
        "daemon running with QUIC on that address and UDP port?); --timeout SECONDS waits longer"
    )


def test_quic_wrong_cafile_is_told_apart_from_no_answer(tmp_path: Path, daemon: Daemon) -> None:
    other = tmp_path / "other.pem"
    cli("tls", "init", "--cert", other, "--key", tmp_path / "other.key")  # a certificate the daemon does not use
    result = run("call", "--quic", f"127.0.0.1:{daemon.quic_port}", "--cafile", other, "health")
    assert result.returncode == exitcodes.UNREACHABLE
    assert one_line(result) == (
        f"appliance: error: the server at 127.0.0.1:{daemon.quic_port} presented a certificate "
        f"that the CA file {other} does not accept (self-signed certificate); pass the "
        "server's certificate (or its CA) with --cafile FILE"
    )


def test_quic_cafile_that_holds_no_certificate_is_one_line_before_any_handshake(tmp_path: Path, daemon: Daemon) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("not a certificate\n")
    result = run("call", "--quic", f"127.0.0.1:{daemon.quic_port}", "--cafile", notes, "health")
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert one_line(result) == (
        f"appliance: error: CA file {notes}: no PEM certificate in it; pass the server's certificate or its CA"
    )


def test_quic_address_without_port_is_a_usage_error() -> None:
    result = run("call", "--quic", "127.0.0.1", "health")
    assert result.returncode == exitcodes.USAGE == 2
    assert "Traceback" not in result.stderr
    lines = result.stderr.splitlines()
    assert lines[0].startswith("usage: appliance call ")  # argparse's usage, then its one error line
    assert lines[-1] == (
        "appliance call: error: argument --quic: '127.0.0.1' is not HOST:PORT "
        "(an IPv6 address goes in brackets: [::1]:4433)"
    )


# --- local input: the file argument ----------------------------------------------------------------------------------


def test_vad_without_a_file(tmp_path: Path) -> None:
    result = run("call", "vad", "--socket", tmp_path / "unused.sock")
    assert result.returncode == exitcodes.USAGE
    assert one_line(result) == (
        "appliance: error: usage: appliance call vad FILE [--model NAME] [--stream] (WAV, FLAC, Ogg, MP3, M4A, WebM)"
    )


def test_vad_with_a_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "missing.wav"
    result = run("call", "vad", missing, "--socket", tmp_path / "unused.sock")  # read before any call
    assert result.returncode == exitcodes.USAGE
    assert one_line(result) == f"appliance: error: cannot read {missing}: no such file"


def test_vad_with_an_unreadable_file(tmp_path: Path) -> None:
    unreadable = tmp_path / "speech.wav"
    unreadable.mkdir()  # root reads any mode; a directory it cannot read as a file
    result = run("call", "vad", unreadable, "--socket", tmp_path / "unused.sock")
    assert result.returncode == exitcodes.USAGE
    assert one_line(result) == f"appliance: error: cannot read {unreadable}: it is a directory, not a file"


# --- stdout closed -------------------------------------------------------------------------------------------------


def test_broken_pipe_on_stdout(daemon: Daemon) -> None:
    """`appliance call metrics | head -0`: the reader is gone before the first write."""
    read_end, write_end = os.pipe()
    proc = subprocess.Popen(
        [*APPLIANCE, "call", "metrics", "--socket", str(daemon.socket)],
        cwd=ROOT,
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    os.close(read_end)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == exitcodes.BROKEN_PIPE == 141
    assert "Traceback" not in stderr and stderr.count("\n") == 1, stderr
    assert stderr == "appliance: error: stdout was closed before all output was written (broken pipe)\n"


# --- the Python client: the types the CLI maps -----------------------------------------------------------------------


def test_python_client_raises_distinct_types(tmp_path: Path, daemon: Daemon) -> None:
    from appliance.client import (
        Client,
        ClientError,
        ConnectError,
        NoAnswer,
        ServerError,
        SocketUnreachable,
    )

    with pytest.raises(SocketUnreachable) as unreachable_error:
        Client(str(tmp_path / "none.sock")).health()
    assert isinstance(unreachable_error.value, (ConnectError, ConnectionError, ClientError))
    assert unreachable_error.value.path == str(tmp_path / "none.sock") and unreachable_error.value.status == 0
    with daemon.client() as client, pytest.raises(ServerError) as server_error:
        client.model("nope")
    assert (
        server_error.value.status == 404
        and "Request for unknown model: 'nope' is not found" in server_error.value.message
    )
    assert isinstance(server_error.value, ClientError) and not isinstance(server_error.value, OSError)
    quiet = Client(quic=f"127.0.0.1:{free_udp_port()}", cafile=daemon.cafile, connect_timeout=0.5)
    with quiet, pytest.raises(NoAnswer) as no_answer:
        quiet.send(Call("GET", "/v2/health/ready"))
    assert isinstance(no_answer.value, (ConnectError, TimeoutError)) and "within 0.5 s" in str(no_answer.value)


def test_keys_new_over_an_existing_key_is_one_line(tmp_path: Path) -> None:
    key = tmp_path / "signing.key"
    assert run("keys", "new", "--out", key).returncode == 0
    before = key.read_bytes()
    again = run("keys", "new", "--out", key)
    assert again.returncode == exitcodes.USAGE and one_line(again) == (
        f"appliance: error: {key} exists: a new key would replace the one firmware may be signed with; "
        "remove it or give another path"
    )
    assert key.read_bytes() == before


def test_health_while_the_daemon_starts_says_still_starting_naming_its_socket(tmp_path: Path) -> None:
    path = tmp_path / "api.sock"
    (tmp_path / "api.sock.starting").write_text(f"{os.getpid()}\n")  # what a starting daemon keeps there
    result = run("call", "health", "--socket", path)
    assert result.returncode == exitcodes.DAEMON_ERROR and one_line(result) == (
        f"appliance: error: the daemon at {path} is still starting (pid {os.getpid()}): "
        "it serves once its models are loaded and warm"
    )
    (tmp_path / "api.sock.starting").write_text("999999999\n")  # a daemon that died while starting
    assert one_line(run("call", "health", "--socket", path)) == unreachable(
        path, "no such file (is the daemon running, and is this its socket?)"
    )


def test_a_starting_daemon_keeps_its_marker_until_the_socket_is_bound(tmp_path: Path, bundle: Path, keys) -> None:
    daemon = Daemon(tmp_path, bundle, keys.trusted)
    marker = daemon.socket.with_name(daemon.socket.name + ".starting")
    seen = False
    deadline = time.monotonic() + 60
    while not daemon.socket.exists() and time.monotonic() < deadline:
        if marker.exists() and not daemon.socket.exists():
            seen = True
            if "still starting" in run("call", "health", "--socket", daemon.socket).stderr:
                break
        time.sleep(0.01)
    daemon.wait_ready()
    assert seen and not marker.exists()
    assert daemon.stop() == 0


def test_call_live_with_no_audio_says_so(tmp_path: Path) -> None:
    """Nothing on standard input (a microphone's pipe that ended at once), or a WAV of no samples: one line
    naming it, before any call (exit 0 with nothing printed looked like a silence that was heard)."""
    empty = tmp_path / "empty.wav"
    empty.write_bytes(encode_wav(np.zeros(0, np.float32), 16000))
    for source, named in (("-", "standard input"), (empty, str(empty))):
        result = run("call", "live", source, "--socket", tmp_path / "api.sock")
        assert result.returncode == exitcodes.USAGE, result.stderr
        assert one_line(result) == f"appliance: error: {named}: no audio in it: nothing to send"
