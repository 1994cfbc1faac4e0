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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.firmware import BAKED_PARAMETERS, read_unverified_name

VAD_MAX_MS = 60_000  # min_speech_ms, min_silence_ms, speech_pad_ms: here and in a request, 0 to this
DEFAULT_FILE = Path("/etc/appliance/appliance.toml")
DEFAULT_DROPINS = Path("/etc/appliance/conf.d")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: Path = Path("/run/appliance/api.sock")
    socket_mode: str = "0660"
    socket_group: str = ""
    max_body_bytes: int = 64 << 20
    max_header_bytes: int = 16 << 10
    max_connections: int = 512
    max_connections_per_peer: int = 128  # one user's share of max_connections (Unix socket; per worker)
    max_buffered_bytes: int = 256 << 20  # request bodies held by all clients of both transports together
    header_timeout_s: float = 10.0  # a request head must be whole this soon after it starts
    body_timeout_s: float = 30.0  # a request body may go quiet this long
    keepalive_timeout_s: float = 75.0  # an idle HTTP/1.1 connection is closed after this
    pipeline_depth: int = 32  # requests read ahead on one HTTP/1.1 connection; then reading pauses
    shutdown_grace_s: float = 30.0
    # protocol worker processes running the transports (0: chosen by the machine's cores, see
    # worker_count); 1: the transports run in the engine process itself
    workers: int = 0
    # of one streamed answer, the bytes held for a client that has not taken them, at each hop (the
    # worker channel's credit, HTTP/3's stream send buffer, HTTP/1.1's write buffer): see protocol/flow.py
    stream_window_bytes: int = 256 << 10
    request_timeout_s: float = 3600.0  # a worker waits this long for the engine's answer to a request


@dataclass(frozen=True, slots=True)
class QuicConfig:
    """The HTTP/3 listener for LAN clients; TLS certificate and key from local files."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 4433
    # the box's own identity, made at first start (`appliance tls init`) and kept with its state
    certificate: Path = Path("/var/lib/appliance/tls/cert.pem")
    private_key: Path = Path("/var/lib/appliance/tls/key.pem")
    client_ca: Path = Path("")  # "" (unset): no client certificates; set: mutual TLS, clients need one this CA signed
    # set: clients whose certificate this CA signed are operators (/status, /metrics); others get 403 there
    operator_ca: Path = Path("")
    idle_timeout_s: float = 30.0
    stream_idle_timeout_s: float = 10.0  # a request stream that goes quiet this long gets a 408
    max_connections: int = 256
    max_streams_per_connection: int = 128
    retry: bool = False  # always make clients prove their address; else only under pressure (below)
    retry_when_handshaking: int = 64  # this many handshakes in progress switch Retry on by itself (0: never)
    handshake_timeout_s: float = 5.0  # a handshake not complete by then is dropped, its slot freed
    max_handshakes_per_source: int = 16  # handshakes in progress from one address
    max_connections_per_address: int = 64  # one address's share of max_connections (per worker)


@dataclass(frozen=True, slots=True)
class HttpsConfig:
    """HTTPS on TCP for LAN clients and browsers (HTTP/1.1 over TLS). TLS from [quic]'s certificate,
    private_key and client_ca: the box has one identity, whichever transport reaches it."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 8443
    max_connections: int = 256  # TLS connections, apart from the Unix socket's server.max_connections
    alt_svc: bool = True  # where QUIC serves, every answer says so (Alt-Svc: h3=":PORT"): browsers move to it


@dataclass(frozen=True, slots=True)
class ConnCacheConfig:
    """The QUIC listener's per-peer table (eBPF in the kernel, or user space) and flood budget."""

    backend: str = "auto"  # "ebpf": failing to load the BPF program is a start-up error; "user": never try
    max_entries: int = 65536  # validated peers (address and port: their handshake completed) kept
    # sources that have not completed a handshake, in a table of their own: a flood churns only this one
    max_unvalidated: int = 4096
    peer_rate: float = 5000.0  # packets per second each peer may send ...
    peer_burst: float = 10000.0  # ... with bursts up to this many; the rest are dropped
    idle_timeout_s: float = 60.0  # a peer silent this long is forgotten and its sequences released
    pin_dir: Path = Path("/sys/fs/bpf/appliance")


@dataclass(frozen=True, slots=True)
class FirmwareConfig:
    bundle: Path = Path("/var/lib/appliance/firmware/current")
    trusted_keys: Path = Path("/etc/appliance/trusted-keys")


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = "cpu"
    threads: int = 2  # intra-op threads for large batches; small ones run on one
    queue_delay_us: int = 0
    # each model's queue, as Triton's dynamic_batching.default_queue_policy: requests waiting past
    # max_queue_size are refused, and those waiting longer than queue_timeout_s get a 503 (0: no timeout)
    max_queue_size: int = 128
    queue_timeout_s: float = 0.0


@dataclass(frozen=True, slots=True)
class SequenceConfig:
    idle_timeout_s: float = 60.0
    max_live: int = 1024
    max_per_client: int = 256  # one client's share of max_live


@dataclass(frozen=True, slots=True)
class VadConfig:
    """Defaults for turning speech probabilities into segments (a request may override them)."""

    threshold: float = 0.5
    min_speech_ms: int = 250
    min_silence_ms: int = 100
    speech_pad_ms: int = 30


@dataclass(frozen=True, slots=True)
class WebSocketConfig:
    """Limits of every WebSocket (/v1/realtime), on both transports."""

    max_message_bytes: int = 1 << 20  # a bigger message from the client closes it with 1009
    buffered_bytes: int = 4 << 20  # a connection's messages held in each direction; then reading pauses
    idle_timeout_s: float = 120.0  # no message from the client this long closes it with 1001
    ping_interval_s: float = 20.0  # the box pings a quiet client this often; a pong not back by the next closes it


@dataclass(frozen=True, slots=True)
class WyomingConfig:
    """Home Assistant's Wyoming protocol (api/wyoming.py); it has no authentication."""

    enabled: bool = True
    socket: Path = Path("")  # "" (unset): wyoming.sock beside server.socket, with its mode and group
    max_payload_bytes: int = 1 << 20  # an event's data or payload; a bigger one is an error and a close
    tcp: str = ""  # "HOST:PORT": also on TCP for the LAN, announced by zeroconf (off when empty)


@dataclass(frozen=True, slots=True)
class LogConfig:
    level: str = "info"


@dataclass(frozen=True, slots=True)
class Config:
    server: ServerConfig = field(default_factory=ServerConfig)
    quic: QuicConfig = field(default_factory=QuicConfig)
    https: HttpsConfig = field(default_factory=HttpsConfig)
    conncache: ConnCacheConfig = field(default_factory=ConnCacheConfig)
    firmware: FirmwareConfig = field(default_factory=FirmwareConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sequences: SequenceConfig = field(default_factory=SequenceConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    websocket: WebSocketConfig = field(default_factory=WebSocketConfig)
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sources: tuple[Path, ...] = field(default=(), compare=False)  # where it came from, not what it is


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
            default = getattr(_SECTION_TYPES[section](), key)
            values[key] = _coerce(path, f"{section}.{key}", hints[key], value, optional=default == Path(""))
        out[section] = values
    return out


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
        "engine.threads": config.engine.threads,
        "sequences.max_live": config.sequences.max_live,
        "sequences.max_per_client": config.sequences.max_per_client,
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
    host, _, port = config.wyoming.tcp.rpartition(":")
    if config.wyoming.tcp and not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ApplianceError(f"{source}: wyoming.tcp: {config.wyoming.tcp!r} is not HOST:PORT")
    if config.engine.queue_delay_us < 0:
        raise ApplianceError(f"{source}: engine.queue_delay_us: must not be negative")
    if config.engine.queue_timeout_s < 0:
        raise ApplianceError(f"{source}: engine.queue_timeout_s: must not be negative (0: no timeout)")
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
        "server.pipeline_depth",
        "server.stream_window_bytes",
        "server.request_timeout_s",
        "https.max_connections",
        "https.alt_svc",
        "engine.queue_delay_us",
        "engine.max_queue_size",
        "engine.queue_timeout_s",
        "sequences.idle_timeout_s",
        "sequences.max_live",
        "sequences.max_per_client",
        "conncache.idle_timeout_s",
        "vad.threshold",
        "vad.min_speech_ms",
        "vad.min_silence_ms",
        "vad.speech_pad_ms",
        "websocket.max_message_bytes",
        "websocket.buffered_bytes",
        "websocket.idle_timeout_s",
        "wyoming.max_payload_bytes",
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
