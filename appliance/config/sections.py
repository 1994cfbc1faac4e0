"""The config's sections: one typed, frozen structure per TOML table, with its defaults
(docs/config.md says what each key does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

VAD_MAX_MS = 60_000  # min_speech_ms, min_silence_ms, speech_pad_ms: here and in a request, 0 to this


@dataclass(frozen=True, slots=True)
class ServerConfig:
    socket: Path = Path("/run/appliance/api.sock")
    socket_mode: str = "0660"
    socket_group: str = ""
    max_body_bytes: int = 64 << 20
    max_header_bytes: int = 16 << 10
    max_connections: int = 512
    max_connections_per_peer: int = 128  # one user's share of max_connections (Unix socket; the daemon's)
    max_buffered_bytes: int = 256 << 20  # bodies, Realtime buffers and Wyoming recordings the whole daemon holds
    header_timeout_s: float = 10.0  # a request head must be whole this soon after it starts
    body_timeout_s: float = 30.0  # a request body may go quiet this long
    keepalive_timeout_s: float = 75.0  # an idle HTTP/1.1 connection is closed after this
    write_timeout_s: float = (
        30.0  # a connection whose writes make no progress this long is closed (HTTP/1.1, HTTPS, HTTP/3, Wyoming)
    )
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
    max_connections_per_address: int = 64  # one address's share of max_connections (the daemon's)
    handshake_timeout_s: float = 5.0  # a TLS handshake not complete by then is dropped, its descriptor freed
    max_handshakes: int = 128  # TLS handshakes in flight (the daemon's); a connection past it is closed at once
    max_handshakes_per_address: int = 16  # one address's share of them
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
class ModelQueueConfig:
    """One model's own queue policy, [engine.models.NAME]: a key it does not set is [engine]'s."""

    max_queue_size: int | None = None
    queue_timeout_s: float | None = None


@dataclass(frozen=True, slots=True)
class EngineConfig:
    device: str = "cpu"
    # ONNX Runtime's intra-op threads for large batches (small ones run on one); the number of Whisper
    # decodes that run side by side and the threads each may use; Bergamot translators (a process
    # each, one thread) side by side
    threads: int = 2
    queue_delay_us: int = 0
    # each model's queue, as Triton's dynamic_batching.default_queue_policy: requests waiting past
    # max_queue_size are refused, and those waiting longer than queue_timeout_s get a 503 (0: no timeout)
    max_queue_size: int = 128
    queue_timeout_s: float = 0.0
    models: dict[str, ModelQueueConfig] = field(default_factory=dict)  # per model, as Triton sets it per model

    def queue_policy(self, model: str) -> tuple[int, float]:
        """`model`'s max_queue_size and queue_timeout_s: its own where [engine.models.NAME] sets them."""
        own = self.models.get(model, ModelQueueConfig())
        size = own.max_queue_size if own.max_queue_size is not None else self.max_queue_size
        timeout = own.queue_timeout_s if own.queue_timeout_s is not None else self.queue_timeout_s
        return size, timeout


@dataclass(frozen=True, slots=True)
class SequenceConfig:
    idle_timeout_s: float = 60.0
    max_live: int = 1024
    max_per_client: int = 256  # one client's share of max_live
    max_per_address: int = 256  # one address's: all its clients (connections) together; a Unix user is one
    max_per_key: int = 256  # one API key's (or room's): all the sessions and connections that present it


@dataclass(frozen=True, slots=True)
class VadConfig:
    """Defaults for turning speech probabilities into segments (a request may override them)."""

    threshold: float = 0.5
    # a brisk one-word answer ("Yes.", "No.") holds 160 to 224 ms above the threshold; Silero gave no
    # run of 64 ms or more on silence, noise, hum, clicks, knocks, breaths or beeps (docs/config.md)
    min_speech_ms: int = 100
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
class RealtimeConfig:
    """A Realtime session's share of the live batches (/v1/realtime, docs/live.md)."""

    # the audio a session with server VAD may send ahead of real time (a burst); past it the session is
    # read no faster than real time, so one client's upload cannot hold the live batches' urgent lane
    max_ahead_s: float = 10.0
    max_turn_s: float = 30.0  # a turn the VAD has not closed by then is committed (one Whisper window)


@dataclass(frozen=True, slots=True)
class WyomingConfig:
    """Home Assistant's Wyoming protocol (api/wyoming.py); it has no authentication."""

    enabled: bool = True
    socket: Path = Path("")  # "" (unset): wyoming.sock beside server.socket, with its mode and group
    max_payload_bytes: int = 1 << 20  # an event's data or payload; a bigger one is an error and a close
    max_connections: int = 64  # clients at once on the Unix socket (TCP has its own: max_tcp_connections)
    max_tcp_connections: int = 64  # clients at once on TCP: the LAN cannot take the Unix socket's
    max_connections_per_peer: int = 16  # one user's share of the Unix socket's, one host's of TCP's
    tcp: str = ""  # "HOST:PORT": also on TCP for the LAN, announced by zeroconf (off when empty)
    allow: str = ""  # TCP peers taken: CIDRs, comma-separated ("": the box's own subnets and loopback)


@dataclass(frozen=True, slots=True)
class AccessConfig:
    """Who may use the box over QUIC and HTTPS (api/access): keys once the file holds one."""

    keys: Path = Path("/var/lib/appliance/api-keys.toml")  # `appliance keys add`; absent or empty: open
    origins: str = ""  # browser origins taken besides the box's own, comma-separated ("https://kiosk.lan")


@dataclass(frozen=True, slots=True)
class FleetConfig:
    """The box behind a load balancer (docs/operations.md, "Many boxes behind HAProxy")."""

    agent_address: str = ""  # "HOST:PORT": HAProxy's agent check reads the box's weight or drain here (off when empty)
    proxies: str = ""  # balancers (CIDRs) whose TCP connections begin with a PROXY v2 header naming the client


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
    access: AccessConfig = field(default_factory=AccessConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    sequences: SequenceConfig = field(default_factory=SequenceConfig)
    vad: VadConfig = field(default_factory=VadConfig)
    websocket: WebSocketConfig = field(default_factory=WebSocketConfig)
    realtime: RealtimeConfig = field(default_factory=RealtimeConfig)
    wyoming: WyomingConfig = field(default_factory=WyomingConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    log: LogConfig = field(default_factory=LogConfig)
    sources: tuple[Path, ...] = field(default=(), compare=False)  # where it came from, not what it is
