"""The `appliance` command as people expect it: --version, a help line with its default for every
option of every subcommand, JSON from `firmware inspect`, a `config check` that loads again as it is,
and progress on long jobs (a tqdm bar on a terminal, one line per phase elsewhere)."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import io
import json
import os
import pty
import select
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
from conftest import APPLIANCE, ROOT, Keys, cli

from appliance import cli as appliance_cli
from appliance import config
from appliance.cli.call import CALL_ACTIONS
from appliance.progress import Progress

SOCKET = "/run/test-cli/api.sock"  # APPLIANCE_SOCKET for the help tests, so both sides see the same default
NO_DEFAULT = (None, False, [], argparse.SUPPRESS)


def copy_bundle(bundle: Path, tmp_path: Path) -> Path:
    shutil.copytree(bundle, tmp_path / "bundle")
    return tmp_path / "bundle"


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*APPLIANCE, *map(str, args)], capture_output=True, text=True, cwd=ROOT, env={**os.environ, **(env or {})}
    )


# --- --version and --help ------------------------------------------------------------------------------


def test_version_is_the_package_metadata() -> None:
    result = cli("--version")
    assert result.stdout == f"appliance {importlib.metadata.version('appliance')}\n"


def _walk(p: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _walk(child, (*path, name))


PATHS = [path for path, _ in _walk(appliance_cli.parser())]


def test_the_walk_finds_every_sub_action() -> None:
    assert {
        ("firmware", "build"),
        ("firmware", "inspect"),
        ("keys", "new"),
        ("config", "check"),
        ("tls", "init"),
        ("image", "assemble"),
        ("image", "sign"),
        ("image", "verify"),
        ("image", "selftest"),
        ("flash",),
        ("update",),
        ("call",),
    } <= set(PATHS)


def help_entries(*path: str) -> list[str]:
    """`appliance PATH --help`, one line per entry (a help text argparse put under a long invocation joins it)."""
    result = run(*path, "--help", env={"APPLIANCE_SOCKET": SOCKET, "COLUMNS": "1000"})  # wide: no wrapped lines
    assert result.returncode == 0, result.stderr
    lines: list[str] = []
    indent = 0
    for raw in result.stdout.splitlines():
        here = len(raw) - len(raw.lstrip())
        if lines and raw.strip() and here > indent + 2:
            lines[-1] += " " + raw.strip()
        else:
            lines.append(" ".join(raw.split()))
            indent = here
    return lines


@pytest.mark.parametrize("path", PATHS, ids=lambda path: " ".join(path) or "appliance")
def test_every_command_option_and_sub_action_says_what_it_does(
    path: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing is added without help: a description for each command, a help text for each option and
    sub-action, each option listed in the printed help, and (by options.py's formatter) its default."""
    monkeypatch.setenv("APPLIANCE_SOCKET", SOCKET)  # as the printed help sees it
    parser = dict(_walk(appliance_cli.parser()))[path]
    assert parser.description and parser.description.strip(), f"{' '.join(path)}: no description"
    entries = help_entries(*path)
    for action in parser._actions:
        choices = action._choices_actions if isinstance(action, argparse._SubParsersAction) else [action]
        for entry in choices:
            assert entry.help and entry.help != argparse.SUPPRESS and entry.help.strip(), (
                f"{path} {entry.dest}: no help"
            )
        if isinstance(action, argparse._SubParsersAction):
            continue
        start = action.option_strings[0] if action.option_strings else action.metavar or action.dest
        found = [line for line in entries if line == start or line.startswith((f"{start} ", f"{start},"))]
        assert found, f"{' '.join(path)}: {start} not in the printed help:\n" + "\n".join(entries)
        if action.option_strings and not action.required and action.default not in NO_DEFAULT:
            assert found[0].endswith(f"(default: {action.default})"), found[0]


@pytest.mark.parametrize(
    "path, expected",
    [  # written out by hand, as a user reads them
        (
            ("call",),
            [
                "--socket SOCKET the daemon's Unix socket ($APPLIANCE_SOCKET, else ./run/api.sock if present) "
                f"(default: {SOCKET})",
                "--speed SPEED speak: 0.25 to 4.0 (default: 1.0)",
                "--timeout SECONDS how long connecting (the QUIC handshake) may take before the call fails (exit 4) "
                "(default: 5.0)",
                "--cafile CAFILE pinned server certificate or CA file for --quic",
            ],
        ),
        (
            ("firmware", "build"),
            [
                "spec the firmware spec, e.g. firmware/default.toml",
                "--key KEY the Ed25519 signing key (appliance keys new)",
                "--out OUT the bundle directory to write (replaced whole)",
            ],
        ),
        (
            ("run",),
            [
                "--config CONFIG config file (repeatable, merged in order; without it /etc/appliance/appliance.toml, "
                "then /etc/appliance/conf.d/*.toml)"
            ],
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, tuple) else "",
)
def test_help_lines_as_a_user_reads_them(path: tuple[str, ...], expected: list[str]) -> None:
    entries = help_entries(*path)
    for line in expected:
        assert line in entries, f"{line!r} not in:\n" + "\n".join(entries)


def test_call_help_lists_every_action_with_what_it_does() -> None:
    text = " ".join(run("call", "--help").stdout.split())
    assert list(CALL_ACTIONS) == [
        "health",
        "server",
        "models",
        "model",
        "metrics",
        "vad",
        "probs",
        "speak",
        "translate",
        "interpret",
        "transcribe",
        "live",
    ]
    for name, what in CALL_ACTIONS.items():
        assert f"{name} {what}" in text, name


def test_an_unknown_call_action_is_a_usage_error() -> None:
    result = run("call", "nonsense")
    assert result.returncode == 2 and "invalid choice: 'nonsense'" in result.stderr


# --- firmware inspect ------------------------------------------------------------------------------------


def test_inspect_prints_json_that_says_verified(bundle: Path, keys: Keys) -> None:
    result = cli("firmware", "inspect", bundle, "--trusted-keys", keys.trusted)
    doc = json.loads(result.stdout)
    assert doc["verified"] is True and doc["error"] is None and result.stderr == ""
    assert doc["trusted_keys"] == str(keys.trusted) and doc["bundle"] == str(bundle)
    assert doc["manifest"] == json.loads((bundle / "manifest.json").read_text())


@pytest.mark.parametrize(
    "target, offset, reason",
    [
        ("models/silero_vad.onnx", 1000, "sha256 does not match"),
        ("manifest.json", 40, "signature does not verify"),
        ("manifest.sig", 5, "signature does not verify"),
    ],
)
def test_inspect_of_a_tampered_bundle_is_json_exit_2_and_one_warning(
    bundle: Path, keys: Keys, tmp_path: Path, target: str, offset: int, reason: str
) -> None:
    tampered = copy_bundle(bundle, tmp_path)
    flip_byte(tampered / target, offset)
    result = run("firmware", "inspect", tampered, "--trusted-keys", keys.trusted)
    assert result.returncode == 2
    doc = json.loads(result.stdout)
    assert doc["verified"] is False and reason in doc["error"] and doc["trusted_keys"] == str(keys.trusted)
    assert doc["manifest"]["name"] == "voice-vad"
    assert result.stderr.count("\n") == 1, result.stderr
    assert "warning" in result.stderr and reason in result.stderr and str(tampered) in result.stderr
    assert target.split("/")[-1] in result.stderr


def test_inspect_of_a_manifest_that_is_not_json_is_still_json(bundle: Path, keys: Keys, tmp_path: Path) -> None:
    broken = copy_bundle(bundle, tmp_path)
    (broken / "manifest.json").write_text("{not json")
    result = run("firmware", "inspect", broken, "--trusted-keys", keys.trusted)
    doc = json.loads(result.stdout)
    assert result.returncode == 2 and doc["verified"] is False and doc["manifest"] is None
    assert str(broken / "manifest.json") in result.stderr and result.stderr.count("\n") == 1


# --- config check round trip -----------------------------------------------------------------------------

EVERY_FIELD = {  # a value other than the default for every key; `client_ca`, `operator_ca` = "": the unset ones
    "server": {
        "socket": "run/x.sock",
        "socket_mode": "0600",
        "socket_group": 'odd "group" \\ name',
        "max_body_bytes": 1 << 20,
        "max_header_bytes": 4096,
        "max_connections": 7,
        "max_connections_per_peer": 5,
        "max_buffered_bytes": 3 << 20,
        "header_timeout_s": 2.5,
        "body_timeout_s": 3.5,
        "keepalive_timeout_s": 4.5,
        "write_timeout_s": 5.5,
        "pipeline_depth": 5,
        "shutdown_grace_s": 0.1,
        "workers": 3,
        "stream_window_bytes": 4097,
        "request_timeout_s": 12.5,
    },
    "quic": {
        "enabled": True,
        "host": "::",
        "port": 4443,
        "certificate": "tls/c.pem",
        "private_key": "/k/ey.pem",
        "client_ca": "",
        "operator_ca": "",
        "idle_timeout_s": 12.5,
        "stream_idle_timeout_s": 1e-07,
        "max_connections": 3,
        "max_streams_per_connection": 9,
        "retry": True,
        "retry_when_handshaking": 6,
        "handshake_timeout_s": 1.5,
        "max_handshakes_per_source": 2,
        "max_connections_per_address": 2,
    },
    "https": {
        "enabled": True,
        "host": "::1",
        "port": 9443,
        "max_connections": 4,
        "max_connections_per_address": 3,
        "handshake_timeout_s": 2.5,
        "max_handshakes": 5,
        "max_handshakes_per_address": 2,
        "alt_svc": False,
    },
    "websocket": {"max_message_bytes": 4096, "buffered_bytes": 8192, "idle_timeout_s": 9.5, "ping_interval_s": 2.5},
    "wyoming": {
        "enabled": False,
        "socket": "",
        "max_payload_bytes": 4096,
        "max_connections": 5,
        "max_tcp_connections": 6,
        "max_connections_per_peer": 2,
        "tcp": "127.0.0.1:10300",
        "allow": "10.0.0.0/8, 127.0.0.2",
    },
    "access": {"keys": "keys dir/api-keys.toml", "origins": "https://kiosk.lan"},
    "fleet": {"agent_address": "127.0.0.1:8444", "proxies": "10.0.0.5/32"},
    "conncache": {
        "backend": "user",
        "max_entries": 10,
        "max_unvalidated": 6,
        "peer_rate": 1e20,
        "peer_burst": 3,
        "idle_timeout_s": 2.0,
        "pin_dir": "bpf/pins",
    },
    "firmware": {"bundle": "../fw/current", "trusted_keys": "keys dir/trusted"},
    "engine": {
        "device": "auto",
        "threads": 8,
        "queue_delay_us": 250,
        "max_queue_size": 7,
        "queue_timeout_s": 0.5,
        "models": {"whisper_base": {"max_queue_size": 3}, "odd model": {"queue_timeout_s": 1.5}},
    },
    "sequences": {
        "idle_timeout_s": 0.3333333333333333,
        "max_live": 5,
        "max_per_client": 3,
        "max_per_address": 4,
        "max_per_key": 2,
    },
    "realtime": {"max_ahead_s": 2.5, "max_turn_s": 12.5},
    "vad": {"threshold": 0.123456789012345, "min_speech_ms": 1, "min_silence_ms": 2, "speech_pad_ms": 0},
    "log": {"level": "debug"},
}


def _toml(doc: dict[str, dict[str, object]]) -> str:
    out, tables = [], []
    for section, values in doc.items():
        out.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, dict):  # [section.key.NAME] tables, after the section's keys
                for name, table in value.items():
                    tables += [f"[{section}.{key}.{json.dumps(name)}]", _toml({"": table}).split("\n", 1)[1]]
            else:
                out.append(f"{key} = {_toml_value(value)}")
    return "\n".join(out + tables) + "\n"


def _toml_value(value: object) -> str:
    return (
        json.dumps(value) if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
    )


def _round_trip(source: Path, tmp_path: Path) -> tuple[config.Config, config.Config]:
    first = cli("config", "check", "--config", source).stdout
    printed = tmp_path / "printed.toml"
    printed.write_text(first)
    again = cli("config", "check", "--config", printed).stdout
    assert again.splitlines()[1:] == first.splitlines()[1:]  # the same text, but for the "merged from" comment
    return config.load([source]), config.load([printed])


@pytest.mark.parametrize("source", [ROOT / "etc" / "dev.toml", ROOT / "image" / "appliance.toml"], ids=["dev", "image"])
def test_config_check_output_loads_again_as_it_is(source: Path, tmp_path: Path) -> None:
    before, after = _round_trip(source, tmp_path)
    assert after == before and after.quic.client_ca == Path("")


def test_config_check_round_trips_a_config_with_every_field_set(tmp_path: Path) -> None:
    sections = {f.name: f.type for f in dataclasses.fields(config.Config) if f.name != "sources"}
    for section, values in EVERY_FIELD.items():  # every key of every section, none left at its default
        fields = dataclasses.fields(getattr(config.Config(), section))
        assert set(values) == {f.name for f in fields}, section
    assert set(EVERY_FIELD) == set(sections)
    source = tmp_path / "every.toml"
    source.write_text(_toml(EVERY_FIELD))
    before, after = _round_trip(source, tmp_path)
    assert after == before
    assert before.quic.client_ca == Path("") and before.server.socket == tmp_path / "run/x.sock"
    assert before.server.socket_group == 'odd "group" \\ name' and before.quic.stream_idle_timeout_s == 1e-07
    with_ca = tmp_path / "ca.toml"
    with_ca.write_text('[quic]\nclient_ca = "clients-ca.pem"\n')
    before, after = _round_trip(with_ca, tmp_path)
    assert after == before and before.quic.client_ca == tmp_path / "clients-ca.pem"


def test_an_empty_path_is_unset_where_it_may_be_and_an_error_elsewhere(tmp_path: Path) -> None:
    path = tmp_path / "empty.toml"
    path.write_text('[server]\nsocket = ""\n')
    result = run("config", "check", "--config", path)
    assert result.returncode == 2 and f"{path}: server.socket: must not be empty" in result.stderr


# --- progress --------------------------------------------------------------------------------------------


def _under_a_terminal(*args: object, timeout: float = 120.0) -> tuple[int, str, str]:
    """Run the CLI with stderr on a pseudo-terminal; (exit status, what the terminal showed, stdout)."""
    primary, secondary = pty.openpty()
    proc = subprocess.Popen(
        [*APPLIANCE, *map(str, args)], cwd=ROOT, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=secondary
    )
    os.close(secondary)
    shown, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([primary], [], [], 0.2)
            if ready:
                try:
                    data = os.read(primary, 65536)
                except OSError:  # EIO: the child closed the terminal
                    break
                if not data:
                    break
                shown += data
            elif proc.poll() is not None:
                break
        stdout = proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0]
    finally:
        os.close(primary)
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, shown.decode(errors="replace"), stdout.decode()


def test_firmware_build_on_a_terminal_shows_a_bar_with_rate_and_time_left(keys: Keys, tmp_path: Path) -> None:
    rc, shown, stdout = _under_a_terminal(
        "firmware", "build", ROOT / "firmware" / "default.toml", "--key", keys.private, "--out", tmp_path / "fw"
    )
    assert rc == 0 and stdout.startswith("built voice-vad"), shown
    bars = [part for part in shown.replace("\n", "\r").split("\r") if "hash artifacts" in part]
    final = bars[-1]
    assert "100%|" in final and "B/s" in final and "<" in final, shown  # [elapsed<left, rate]
    assert any("copy models/silero_vad.onnx" in part and "B/s" in part for part in shown.split("\r")), shown


def test_firmware_build_and_install_without_a_terminal_print_one_line_per_phase(
    keys: Keys, tmp_path: Path, bundle: Path
) -> None:
    result = cli(
        "firmware", "build", ROOT / "firmware" / "default.toml", "--key", keys.private, "--out", tmp_path / "fw"
    )
    lines = result.stderr.splitlines()
    assert "\r" not in result.stderr and len(lines) == 2, result.stderr
    assert lines[0].startswith("copy models/silero_vad.onnx: 100%, ") and "MiB" in lines[0] and lines[0].endswith("/s)")
    assert lines[1].startswith("hash artifacts: 100%, ")
    store = tmp_path / "store"
    result = cli("firmware", "install", bundle, "--store", store, "--trusted-keys", keys.trusted)
    phases = [line.split(": 100%")[0] for line in result.stderr.splitlines()]
    partial = next((store / "releases").iterdir()).name + ".partial"
    assert phases == [
        f"verify {bundle}",
        f"copy {bundle} to {store / 'releases' / partial}",
        f"verify {store / 'releases' / partial}",
    ], result.stderr
    assert result.stdout.startswith("installed voice-vad-1.0.0-")


def test_plain_lines_every_ten_percent_for_large_phases() -> None:
    """The lines the image tests watch for on the box's console ("write slot b: 40%")."""
    out = io.StringIO()
    progress = Progress(stream=out)
    assert not progress.bar  # a StringIO is no terminal
    with progress.phase("write slot b", 100 << 20) as advance:
        for _ in range(100):
            advance(1 << 20)
    lines = out.getvalue().splitlines()
    assert lines[:-1] == [f"write slot b: {p}%" for p in range(10, 100, 10)]
    assert lines[-1].startswith("write slot b: 100%, 100.0 MiB in ")
    quiet = io.StringIO()
    with Progress(stream=quiet, enabled=False).phase("x", 1 << 30) as advance:
        advance(1 << 30)
    assert quiet.getvalue() == ""


def test_call_live_sends_each_chunk_once_it_has_been_heard() -> None:
    """`call live`'s pace on an injected clock: the n-th chunk goes once n chunks' time (256 ms each) has
    passed, however fast the daemon answers; after an answer slower than that, the chunks heard meanwhile
    go at once, one after another."""
    from appliance.cli.speech import CHUNK_SAMPLES, as_heard

    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds

    chunks = (np.full(CHUNK_SAMPLES, i, np.float32) for i in range(6))
    sent = []
    for chunk, last in as_heard(chunks, clock=lambda: now[0], sleep=sleep):
        sent.append((round(now[0], 3), int(chunk[0]), last))
        now[0] += 1.0 if chunk[0] == 2 else 0.05  # the daemon's answer: quick, once slow
    assert sent == [
        (0.256, 0, False), (0.512, 1, False), (0.768, 2, False),  # at speech pace
        (1.768, 3, False), (1.818, 4, False), (1.868, 5, True),  # heard while the third was answered
    ]  # fmt: skip
