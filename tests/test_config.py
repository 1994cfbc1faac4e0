"""Config files: strict, merged in order, every error naming file, key and reason."""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, Keys, cli

from appliance.config import Config, EngineConfig, ModelQueueConfig, ServerConfig, worker_count
from appliance.config.text import to_toml
from appliance.engine.queue_policy import triton_queue_policy


def check(*files: Path):
    args = []
    for f in files:
        args += ["--config", f]
    return cli("config", "check", *args, check=False)


def test_merged_in_order_and_relative_paths_resolved(tmp_path: Path) -> None:
    (tmp_path / "a.toml").write_text(
        '[server]\nsocket = "run/a.sock"\nmax_connections = 10\n[engine]\nqueue_delay_us = 200\n'
    )
    (tmp_path / "b.toml").write_text("[server]\nmax_connections = 20\n")
    result = check(tmp_path / "a.toml", tmp_path / "b.toml")
    assert result.returncode == 0, result.stderr
    assert f'socket = "{tmp_path}/run/a.sock"' in result.stdout
    assert "max_connections = 20" in result.stdout and "queue_delay_us = 200" in result.stdout


@pytest.mark.parametrize(
    "text, expected",
    [
        ('[server]\nsockett = "x"\n', "server.sockett: unknown key"),
        ('[server]\nmax_connections = "ten"\n', "server.max_connections: expected int, got 'ten'"),
        ("[nonsense]\na = 1\n", "[nonsense]: unknown section"),
        ("[engine]\nmax_batch = 8\n", "engine.max_batch: 'max_batch' is baked into"),
        ("max_tokens_per_shard = 99\n", "max_tokens_per_shard: 'max_tokens_per_shard' is baked into"),
        ('[engine]\ndevice = "tpu"\n', "engine.device: 'tpu' is not one of"),
        ('[server]\nsocket_mode = "rw"\n', "server.socket_mode"),
        ("[server\n", "not valid TOML"),
        ('[conncache]\nbackend = "xdp"\n', "conncache.backend: 'xdp' is not one of auto, ebpf, user"),
        ("[conncache]\npeer_rate = 0\n", "conncache.peer_rate: must be positive"),
        ('[quic]\nretry = "yes"\n', "quic.retry: expected bool"),
        ("[server]\nworkers = 17\n", "server.workers: 17 is not from 0 (by cores) to 16"),
        ("[server]\nworkers = -1\n", "server.workers: -1 is not from 0 (by cores) to 16"),
        ("[https]\nport = 70000\n", "https.port: 70000 is not a TCP port"),
        ("[https]\nmax_connections = 0\n", "https.max_connections: must be positive"),
        ('[https]\nalt_svc = "h3"\n', "https.alt_svc: expected bool"),
        ("[engine]\nmodels = 3\n", "engine.models: expected tables [engine.models.NAME]"),
        ("[engine.models.vad]\nmax_queue_size = 0\n", "engine.models.vad.max_queue_size: must be positive, got 0"),
        ("[engine.models.vad]\nqueue_timeout_s = -1\n", "engine.models.vad.queue_timeout_s: must not be negative"),
        ('[engine.models.vad]\nqueue_timeout_s = "1"\n', "engine.models.vad.queue_timeout_s: expected float"),
        ("[engine.models.vad]\nmax_batch = 4\n", "engine.models.vad.max_batch: unknown key"),
    ],
)
def test_bad_config_names_file_key_and_reason(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text)
    result = check(path)
    assert result.returncode == 2
    assert str(path) in result.stderr and expected in result.stderr


def test_baked_parameter_error_names_the_firmware(tmp_path: Path, bundle: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text(f'[firmware]\nbundle = "{bundle}"\n[engine]\nsplit_algorithm = "fixed"\n')
    result = check(path)
    assert "baked into firmware 'voice-vad'" in result.stderr and "build a new firmware" in result.stderr


def test_missing_file_is_named(tmp_path: Path) -> None:
    result = check(tmp_path / "nope.toml")
    assert result.returncode == 2 and f"{tmp_path}/nope.toml: config file not found" in result.stderr


def test_daemon_refuses_bad_config_with_one_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[sequences]\nmax_live = -1\n")
    result = cli("run", "--config", path, check=False)
    assert result.returncode == 3
    assert result.stderr.strip().count("\n") == 0 and "sequences.max_live: must be positive" in result.stderr


def test_a_queue_policy_for_a_model_the_firmware_lacks_stops_the_start_with_one_line(
    tmp_path: Path, bundle: Path, keys: Keys
) -> None:
    path = tmp_path / "c.toml"
    path.write_text(
        f'[server]\nsocket = "{tmp_path}/api.sock"\n[firmware]\nbundle = "{bundle}"\ntrusted_keys = "{keys.trusted}"\n'
        "[engine.models.whisper_large]\nmax_queue_size = 4\n"
    )
    result = cli("run", "--config", path, check=False)
    assert result.returncode != 0 and result.stderr.strip().count("\n") == 0, result.stderr
    assert "engine.models.whisper_large: the firmware has no model 'whisper_large' (its models: silero_vad)" in (
        result.stderr
    )


def test_a_models_own_queue_policy_overrides_the_engines() -> None:
    engine = EngineConfig(max_queue_size=64, models={"whisper_base": ModelQueueConfig(max_queue_size=8)})
    assert engine.queue_policy("whisper_base") == (8, 0.0) and engine.queue_policy("silero_vad") == (64, 0.0)
    policy = triton_queue_policy(engine, "whisper_base")
    assert policy["max_queue_size"] == 8 and policy["default_timeout_microseconds"] == 0


@pytest.mark.parametrize(
    ("workers", "cores", "expected"),
    [(0, 2, 1), (0, 7, 1), (0, 8, 8), (0, 16, 16), (0, 64, 16), (2, 2, 2), (1, 16, 1)],
    ids=[
        "default-2-cores",
        "default-7-cores",
        "default-8-cores",
        "default-16-cores",
        "default-64-cores",
        "set-2-on-2-cores",
        "set-1-on-16-cores",
    ],
)
def test_default_worker_count_is_the_documented_one(workers: int, cores: int, expected: int) -> None:
    """docs/performance.md: server.workers = 0 is 1 below 8 cores (the crossing slows a small box's
    Unix socket), one per core from 8, at most 16; a set count is kept as it is."""
    assert worker_count(ServerConfig(workers=workers), cores) == expected


def test_default_worker_count_reads_this_process_cores() -> None:
    usable = len(os.sched_getaffinity(0))
    assert worker_count(ServerConfig()) == (min(usable, 16) if usable >= 8 else 1)


def test_docs_config_lists_every_key_with_its_default() -> None:
    """docs/config.md's example is every key of every section with its true default (a key left
    commented out there is one whose default is unset); a section or key added to the config without
    its line in the docs fails here, as does a default changed in one place only."""
    block = re.search(r"```toml\n(.*?)```", (ROOT / "docs" / "config.md").read_text(), re.S)
    assert block, "docs/config.md has no toml block"
    given = tomllib.loads(block[1])
    documented = tomllib.loads(re.sub(r"^# (\w+ = )", r"\1", block[1], flags=re.M))  # with the commented-out
    for section, keys in tomllib.loads(to_toml(Config())).items():
        assert section in documented, f"docs/config.md has no [{section}]"
        for key, default in keys.items():
            assert key in documented[section], f"docs/config.md has no {section}.{key}"
            if key in given[section]:  # a commented-out key shows an example value: its default is unset
                assert given[section][key] == default, (section, key, given[section][key], default)
