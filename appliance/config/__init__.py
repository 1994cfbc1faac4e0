"""Runtime config: one typed structure, loaded from local TOML files once and validated strictly.

Files: /etc/appliance/appliance.toml, then /etc/appliance/conf.d/*.toml in name order (or the
files given with --config). A later file overrides keys of an earlier one. Every error names
the file, the key and the reason. Baked shard parameters live in the firmware, never here.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
import typing
from pathlib import Path
from typing import Any

from appliance.config.sections import (
    VAD_MAX_MS,
    AccessConfig,
    Config,
    ConnCacheConfig,
    EngineConfig,
    FirmwareConfig,
    FleetConfig,
    HttpsConfig,
    LogConfig,
    ModelQueueConfig,
    QuicConfig,
    RealtimeConfig,
    SequenceConfig,
    ServerConfig,
    VadConfig,
    WebSocketConfig,
    WyomingConfig,
)
from appliance.errors import ApplianceError
from appliance.firmware import BAKED_PARAMETERS, read_unverified_name
from appliance.networks import cidrs

__all__ = [
    "VAD_MAX_MS",
    "AccessConfig",
    "Config",
    "ConnCacheConfig",
    "EngineConfig",
    "FirmwareConfig",
    "FleetConfig",
    "HttpsConfig",
    "LogConfig",
    "ModelQueueConfig",
    "QuicConfig",
    "RealtimeConfig",
    "SequenceConfig",
    "ServerConfig",
    "VadConfig",
    "WebSocketConfig",
    "WyomingConfig",
    "Live",
    "SECTIONS",
    "load",
    "check_model_names",
    "apply_reload",
    "worker_count",
]

DEFAULT_FILE = Path("/etc/appliance/appliance.toml")
DEFAULT_DROPINS = Path("/etc/appliance/conf.d")


CHOICES = {
    ("engine", "device"): ("cpu", "cuda", "auto"),
    ("conncache", "backend"): ("auto", "ebpf", "user"),
    ("log", "level"): ("debug", "info", "warning", "error"),
}
SECTIONS = {f.name: f.type for f in dataclasses.fields(Config) if f.name != "sources"}
_SECTION_TYPES = typing.get_type_hints(Config)


def default_files() -> list[Path]:
    files = [DEFAULT_FILE] if DEFAULT_FILE.exists() else []
    if DEFAULT_DROPINS.is_dir():
        files += sorted(DEFAULT_DROPINS.glob("*.toml"))
    return files


def load(paths: list[Path] | None = None) -> Config:
    """Merge the given files (or the default ones) over the defaults; raise on the first error."""
    files = default_files() if paths is None else paths
    merged: dict[str, dict[str, Any]] = {}
    for path in files:
        for section, values in _read_file(path).items():
            merged.setdefault(section, {}).update(values)
    sections = {name: _SECTION_TYPES[name](**values) for name, values in merged.items()}
    config = Config(sources=tuple(files), **sections)
    _check_values(config)
    return config


def _read_file(path: Path) -> dict[str, dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ApplianceError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ApplianceError(f"{path}: cannot read: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ApplianceError(f"{path}: not valid TOML: {exc}") from None
    out: dict[str, dict[str, Any]] = {}
    for section, table in data.items():
        if section in BAKED_PARAMETERS:
            raise ApplianceError(_baked_message(path, section, data))
        if section not in SECTIONS:
            raise ApplianceError(f"{path}: [{section}]: unknown section (known: {', '.join(SECTIONS)})")
        if not isinstance(table, dict):
            raise ApplianceError(f"{path}: {section}: expected a table")
        hints = typing.get_type_hints(_SECTION_TYPES[section])
        values: dict[str, Any] = {}
        for key, value in table.items():
            if key in BAKED_PARAMETERS:
                raise ApplianceError(_baked_message(path, f"{section}.{key}", data))
            if key not in hints:
                raise ApplianceError(f"{path}: {section}.{key}: unknown key (known: {', '.join(hints)})")
            if (section, key) == ("engine", "models"):
                values[key] = _model_queues(path, value)
                continue
            default = getattr(_SECTION_TYPES[section](), key)
            values[key] = _coerce(path, f"{section}.{key}", hints[key], value, optional=default == Path(""))
        out[section] = values
    return out


def _model_queues(path: Path, value: Any) -> dict[str, ModelQueueConfig]:
    """[engine.models.NAME] tables: each model's own queue policy (the model names are checked
    against the firmware once it is loaded, `check_model_names`)."""
    if not isinstance(value, dict):
        raise ApplianceError(f"{path}: engine.models: expected tables [engine.models.NAME]")
    known = [f.name for f in dataclasses.fields(ModelQueueConfig)]
    out = {}
    for model, table in value.items():
        if not isinstance(table, dict):
            raise ApplianceError(f"{path}: engine.models.{model}: expected a table")
        settings = {}
        for key, setting in table.items():
            if key not in known:
                raise ApplianceError(f"{path}: engine.models.{model}.{key}: unknown key (known: {', '.join(known)})")
            kind = int if key == "max_queue_size" else float
            settings[key] = _coerce(path, f"engine.models.{model}.{key}", kind, setting)
        out[model] = ModelQueueConfig(**settings)
    return out


def check_model_names(config: Config, models: set[str]) -> None:
    """Every [engine.models.NAME] names a model of the running firmware."""
    source = ", ".join(str(p) for p in config.sources) or "defaults"
    for name in sorted(set(config.engine.models) - models):
        raise ApplianceError(
            f"{source}: engine.models.{name}: the firmware has no model {name!r} (its models: {', '.join(sorted(models))})"
        )


def _coerce(path: Path, key: str, kind: type, value: Any, optional: bool = False) -> Any:
    if kind is Path:
        if not isinstance(value, str):
            raise ApplianceError(f"{path}: {key}: expected a path string, got {value!r}")
        if value == "":  # unset, for the paths that may be (client_ca); never "the config file's directory"
            if optional:
                return Path("")
            raise ApplianceError(f"{path}: {key}: must not be empty")
        p = Path(value)
        return p if p.is_absolute() else (path.parent / p).resolve()
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, kind):
        raise ApplianceError(f"{path}: {key}: expected {kind.__name__}, got {value!r}")
    return value


def _baked_message(path: Path, key: str, data: dict[str, Any]) -> str:
    bundle = data.get("firmware", {}).get("bundle") if isinstance(data.get("firmware"), dict) else None
    name = read_unverified_name(path.parent / bundle) if isinstance(bundle, str) else None
    which = f"firmware {name!r}" if name else "the firmware"
    return (
        f"{path}: {key}: '{key.split('.')[-1]}' is baked into {which} at build time and cannot be set "
        "in config; build a new firmware to change it"
    )


MAX_WORKERS = 16
# server.workers = 0 runs workers only on a machine with at least this many cores: a worker's crossing
# costs each request a round trip to the engine process (about 0.5 ms), which pays only where spare
# cores parse and encrypt while the engine computes. On 2 cores workers = 2 served the Unix socket at
# 0.58x workers = 1 (docs/performance.md).
MIN_CORES_FOR_WORKERS = 8


def worker_count(server: ServerConfig, cores: int | None = None) -> int:
    """How many protocol workers `server.workers` asks for on a machine of `cores` usable cores (this
    process's, by default): 0 means one per core, at most MAX_WORKERS, where there are at least
    MIN_CORES_FOR_WORKERS; else 1 (the transports in the engine process)."""
    if server.workers:
        return server.workers
    usable = cores if cores is not None else len(os.sched_getaffinity(0))
    return min(usable, MAX_WORKERS) if usable >= MIN_CORES_FOR_WORKERS else 1


def _check_values(config: Config) -> None:
    source = ", ".join(str(p) for p in config.sources) or "defaults"
    for (section, key), allowed in CHOICES.items():
        value = getattr(getattr(config, section), key)
        if value not in allowed:
            raise ApplianceError(f"{source}: {section}.{key}: {value!r} is not one of {', '.join(allowed)}")
    try:
        mode = int(config.server.socket_mode, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise ApplianceError(
            f"{source}: server.socket_mode: {config.server.socket_mode!r} is not an octal mode like '0660'"
        )
    positive = {
        "server.max_body_bytes": config.server.max_body_bytes,
        "server.max_header_bytes": config.server.max_header_bytes,
        "server.max_connections": config.server.max_connections,
        "server.max_connections_per_peer": config.server.max_connections_per_peer,
        "quic.max_connections_per_address": config.quic.max_connections_per_address,
        "server.shutdown_grace_s": config.server.shutdown_grace_s,
        "server.max_buffered_bytes": config.server.max_buffered_bytes,
        "server.header_timeout_s": config.server.header_timeout_s,
        "server.body_timeout_s": config.server.body_timeout_s,
        "server.keepalive_timeout_s": config.server.keepalive_timeout_s,
        "server.write_timeout_s": config.server.write_timeout_s,
        "server.pipeline_depth": config.server.pipeline_depth,
        "server.stream_window_bytes": config.server.stream_window_bytes,
        "server.request_timeout_s": config.server.request_timeout_s,
        "engine.max_queue_size": config.engine.max_queue_size,
        "quic.idle_timeout_s": config.quic.idle_timeout_s,
        "quic.max_connections": config.quic.max_connections,
        "quic.stream_idle_timeout_s": config.quic.stream_idle_timeout_s,
        "quic.handshake_timeout_s": config.quic.handshake_timeout_s,
        "quic.max_handshakes_per_source": config.quic.max_handshakes_per_source,
        "quic.max_streams_per_connection": config.quic.max_streams_per_connection,
        "https.max_connections": config.https.max_connections,
        "https.max_connections_per_address": config.https.max_connections_per_address,
        "https.handshake_timeout_s": config.https.handshake_timeout_s,
        "https.max_handshakes": config.https.max_handshakes,
        "https.max_handshakes_per_address": config.https.max_handshakes_per_address,
        "engine.threads": config.engine.threads,
        "sequences.max_live": config.sequences.max_live,
        "sequences.max_per_client": config.sequences.max_per_client,
        "sequences.max_per_address": config.sequences.max_per_address,
        "sequences.max_per_key": config.sequences.max_per_key,
        "realtime.max_ahead_s": config.realtime.max_ahead_s,
        "realtime.max_turn_s": config.realtime.max_turn_s,
        "conncache.max_entries": config.conncache.max_entries,
        "conncache.max_unvalidated": config.conncache.max_unvalidated,
        "conncache.peer_rate": config.conncache.peer_rate,
        "conncache.peer_burst": config.conncache.peer_burst,
        "conncache.idle_timeout_s": config.conncache.idle_timeout_s,
        "sequences.idle_timeout_s": config.sequences.idle_timeout_s,
        "websocket.max_message_bytes": config.websocket.max_message_bytes,
        "websocket.buffered_bytes": config.websocket.buffered_bytes,
        "websocket.idle_timeout_s": config.websocket.idle_timeout_s,
        "websocket.ping_interval_s": config.websocket.ping_interval_s,
        "wyoming.max_payload_bytes": config.wyoming.max_payload_bytes,
        "wyoming.max_connections": config.wyoming.max_connections,
        "wyoming.max_tcp_connections": config.wyoming.max_tcp_connections,
        "wyoming.max_connections_per_peer": config.wyoming.max_connections_per_peer,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ApplianceError(f"{source}: {key}: must be positive, got {value}")
    if not 0 <= config.server.workers <= MAX_WORKERS:
        raise ApplianceError(
            f"{source}: server.workers: {config.server.workers} is not from 0 (by cores) to {MAX_WORKERS}"
        )
    if not 0 < config.quic.port < 65536:
        raise ApplianceError(f"{source}: quic.port: {config.quic.port} is not a UDP port")
    if not 0 < config.https.port < 65536:
        raise ApplianceError(f"{source}: https.port: {config.https.port} is not a TCP port")
    for key, address in (("wyoming.tcp", config.wyoming.tcp), ("fleet.agent_address", config.fleet.agent_address)):
        host, _, port = address.rpartition(":")
        if address and not (host and port.isdigit() and 0 < int(port) < 65536):
            raise ApplianceError(f"{source}: {key}: {address!r} is not HOST:PORT")
    for key, setting in (("wyoming.allow", config.wyoming.allow), ("fleet.proxies", config.fleet.proxies)):
        try:
            cidrs(setting)
        except ValueError as exc:
            raise ApplianceError(f"{source}: {key}: {exc}") from None
    if config.engine.queue_delay_us < 0:
        raise ApplianceError(f"{source}: engine.queue_delay_us: must not be negative")
    if config.engine.queue_timeout_s < 0:
        raise ApplianceError(f"{source}: engine.queue_timeout_s: must not be negative (0: no timeout)")
    for model, own in config.engine.models.items():
        if own.max_queue_size is not None and own.max_queue_size <= 0:
            raise ApplianceError(
                f"{source}: engine.models.{model}.max_queue_size: must be positive, got {own.max_queue_size}"
            )
        if own.queue_timeout_s is not None and own.queue_timeout_s < 0:
            raise ApplianceError(
                f"{source}: engine.models.{model}.queue_timeout_s: must not be negative (0: no timeout)"
            )
    if not 0.0 < config.vad.threshold < 1.0:
        raise ApplianceError(f"{source}: vad.threshold: must be between 0 and 1")
    for key in ("min_speech_ms", "min_silence_ms", "speech_pad_ms"):  # as a request's own values are checked
        if not 0 <= getattr(config.vad, key) <= VAD_MAX_MS:
            raise ApplianceError(f"{source}: vad.{key}: must be between 0 and {VAD_MAX_MS}")


# What SIGHUP can change in a running daemon; every other key needs a restart.
RELOADABLE_KEYS = frozenset(
    {
        "server.max_body_bytes",
        "server.max_header_bytes",
        "server.max_connections",
        "server.max_connections_per_peer",
        "server.shutdown_grace_s",
        "server.max_buffered_bytes",
        "server.header_timeout_s",
        "server.body_timeout_s",
        "server.keepalive_timeout_s",
        "server.write_timeout_s",
        "server.pipeline_depth",
        "server.stream_window_bytes",
        "server.request_timeout_s",
        "https.max_connections",
        "https.max_connections_per_address",
        "https.handshake_timeout_s",
        "https.max_handshakes",
        "https.max_handshakes_per_address",
        "https.alt_svc",
        "engine.queue_delay_us",
        "engine.max_queue_size",
        "engine.queue_timeout_s",
        "engine.models",
        "sequences.idle_timeout_s",
        "sequences.max_live",
        "sequences.max_per_client",
        "sequences.max_per_address",
        "sequences.max_per_key",
        "realtime.max_ahead_s",
        "realtime.max_turn_s",
        "conncache.idle_timeout_s",
        "vad.threshold",
        "vad.min_speech_ms",
        "vad.min_silence_ms",
        "vad.speech_pad_ms",
        "websocket.max_message_bytes",
        "websocket.buffered_bytes",
        "websocket.idle_timeout_s",
        "wyoming.max_payload_bytes",
        "wyoming.max_connections",
        "wyoming.max_tcp_connections",
        "wyoming.max_connections_per_peer",
        "wyoming.allow",
        "fleet.proxies",
        "access.keys",
        "access.origins",
        "websocket.ping_interval_s",
        "log.level",
    }
)


def apply_reload(old: Config, new: Config) -> tuple[Config, list[str], list[str]]:
    """The running config with every changed RELOADABLE_KEYS value taken from `new`; and the keys that
    changed and were reloaded, and those that changed and need a restart."""
    reloaded, restart, sections = [], [], {}
    for section in SECTIONS:
        before, after = getattr(old, section), getattr(new, section)
        changes = {}
        for f in dataclasses.fields(before):
            if getattr(before, f.name) != getattr(after, f.name):
                name = f"{section}.{f.name}"
                if name in RELOADABLE_KEYS:
                    reloaded.append(name)
                    changes[f.name] = getattr(after, f.name)
                else:
                    restart.append(name)
        sections[section] = dataclasses.replace(before, **changes)
    return dataclasses.replace(old, **sections), reloaded, restart


class Live:
    """The running config, one holder for the whole daemon. SIGHUP replaces `config` as a whole (keys
    that need a restart keep their running values, see apply_reload); each component reads the setting
    it needs when it uses it, so none keeps a stale copy."""

    def __init__(self, config: Config) -> None:
        self.config = config
