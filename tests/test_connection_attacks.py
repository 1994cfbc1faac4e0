"""The connection layer under attack (issue 47, items 2, 5, 6, 14 and 15), on real daemons over raw
sockets and TLS, with real clients beside the attack that must see no failure: one address cannot take
the HTTPS slots (its share, as a Unix user has one); a client that reads nothing is cut off after
server.write_timeout_s on both HTTP/1.1 listeners (the deadline itself on a clock the test holds);
WebSocket pongs wait on the same flow control as every frame; a message that never ends is closed;
TLS handshakes in flight are bounded, and the Unix socket keeps descriptors when TCP is flooded.
Verdicts are the order of events and bounds on memory, never seconds."""

from __future__ import annotations

import asyncio
import json
import select
import socket
import ssl
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from aioquic.asyncio import connect
from aioquic.quic.events import QuicEvent, StopSendingReceived, StreamReset
from conftest import Daemon, Keys, good_unix_client_beside
from test_http1_timeouts import until
from test_realtime_h3 import H3Client, configuration, open_websocket
from waits import wait_until
from websockets.sync.client import unix_connect

from appliance.config import Config, Live, ServerConfig, WebSocketConfig
from appliance.protocol.messages import Close, Request, Response
from appliance.transport.assembler import BodyBudget
from appliance.transport.connection_bounds import FD_RESERVE
from appliance.transport.http1 import Http1Server
from appliance.transport.websocket import MAX_MESSAGE_FRAMES, StreamIO, WebSocketPump

BIG = b"x" * (8 << 20)


# --- the write deadline on a clock the test holds (the Unix socket's server; HTTPS is the same class) ---


class BigAnswers:
    async def handle(self, request: Request) -> Response:
        return Response(200, BIG, "application/octet-stream")

    def keep_connections(self) -> bool:
        return True

    def end_opened(self, opened: object) -> None:
        pass


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_client_that_reads_nothing_is_cut_off_after_the_write_deadline_and_a_slow_one_is_kept(
    tmp_path: Path,
) -> None:
    async def run() -> None:
        clock = Clock()
        live = Live(Config(server=ServerConfig(write_timeout_s=5.0, keepalive_timeout_s=1000.0)))
        server = Http1Server(BigAnswers(), live, BodyBudget(lambda: live.config.server), clock)  # type: ignore[arg-type]
        listening = await asyncio.get_running_loop().create_unix_server(server.protocol, str(tmp_path / "s"))
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        client.setblocking(False)
        await asyncio.get_running_loop().sock_connect(client, str(tmp_path / "s"))
        client.send(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
        try:
            await until(lambda: len(server.connections) == 1 and not next(iter(server.connections)).writable.is_set())
            (connection,) = server.connections
            assert connection.transport is not None
            events = []
            connection.check_timeouts(clock())  # it holds what the client has not taken: the deadline starts
            clock.now += 4.9
            connection.check_timeouts(clock())
            events.append(("within the deadline", connection.transport.is_closing()))
            taken = 0
            while taken < (1 << 20):  # a slow reader: it takes some, then stops again
                await asyncio.sleep(0.01)
                try:
                    taken += len(client.recv(65536))
                except BlockingIOError:
                    pass
            connection.check_timeouts(clock())  # sees the buffer drained: the deadline starts again
            clock.now += 4.9
            connection.check_timeouts(clock())
            events.append(("a slow reader", connection.transport.is_closing()))
            clock.now += 0.2
            connection.check_timeouts(clock())
            events.append(("past the deadline", connection.transport.is_closing()))
            await until(lambda: not server.connections)  # its slot is free: connection_lost came
            assert events == [("within the deadline", False), ("a slow reader", False), ("past the deadline", True)]
        finally:
            client.close()
            server.close_all()
            listening.close()

    asyncio.run(run())


# --- HTTPS: one address's share, and readers that stop, on a real daemon ---


def tls_connection(daemon, source: str, rcvbuf: int = 0) -> ssl.SSLSocket:
    raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf:
        raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    raw.bind((source, 0))
    raw.settimeout(30)
    raw.connect(("127.0.0.1", daemon.https_port))
    return ssl.create_default_context(cafile=daemon.cafile).wrap_socket(raw, server_hostname="localhost")


def refused_at_once(sock: ssl.SSLSocket) -> str:
    """The status line the daemon sent unasked on a connection (a refusal), or "" (it holds the connection)."""
    sock.settimeout(0.5)
    try:
        return sock.recv(4096).decode("latin-1").split("\r\n")[0]
    except TimeoutError:
        return ""
    finally:
        sock.settimeout(30)


def good_https(daemon, source: str) -> httpx2.Client:
    transport = httpx2.HTTPTransport(
        verify=ssl.create_default_context(cafile=daemon.cafile), local_address=source, retries=0
    )
    return httpx2.Client(transport=transport, base_url=f"https://localhost:{daemon.https_port}", timeout=30)


def test_one_address_gets_its_share_of_https_and_a_client_that_stops_reading_is_cut_off(start_daemon, tls) -> None:
    daemon = start_daemon(
        tls=tls,
        https="max_connections = 8\nmax_connections_per_address = 4\n",
        extra_server="write_timeout_s = 1.0\n",
    )
    # an address holds idle connections: it gets its share, and nothing more
    held = [tls_connection(daemon, "127.0.0.1") for _ in range(12)]
    answers = [refused_at_once(s) for s in held]
    assert answers.count("") == 4, answers
    assert answers.count("HTTP/1.1 503 Service Unavailable") == 8, answers
    with good_https(daemon, "127.0.0.2") as good:
        assert [good.get("/v2/health/ready").status_code for _ in range(10)] == [200] * 10

    # another address's clients pipeline answers they never read: they hold its share ...
    stalled = [tls_connection(daemon, "127.0.0.3", rcvbuf=4096) for _ in range(4)]
    for sock in stalled:
        sock.sendall(b"GET /page/app.js HTTP/1.1\r\nhost: x\r\n\r\n" * 400)
    with good_https(daemon, "127.0.0.3") as late:
        assert late.get("/v2/health/ready").status_code == 503
        # ... until the write deadline cuts them off and frees it, while they still read nothing
        wait_until(lambda: late.get("/v2/health/ready").status_code == 200, "the stalled readers' slots freed")
    with good_https(daemon, "127.0.0.2") as good:
        assert [good.get("/v2/health/ready").status_code for _ in range(10)] == [200] * 10
    for sock in stalled:
        assert cut_off(sock)
    for sock in held:
        sock.close()
    assert "read nothing for 1 s: connection closed" in daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()


def cut_off(sock: ssl.SSLSocket) -> bool:
    """Whether the daemon ended the connection before all 400 answers came (read now, at last)."""
    taken = 0
    try:
        while chunk := sock.recv(1 << 16):
            taken += len(chunk)
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        sock.close()
    return taken < 400 * 21000


# --- WebSocket: pongs under flow control, messages that never end (the pump on a clock the test holds) ---


class FakeStream:
    """The byte stream under a pump: what it was sent, whether it is read, how it ended."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []
        self.events: list[str] = []
        self.writable = asyncio.Event()
        self.writable.set()

    def io(self) -> StreamIO:
        return StreamIO(
            self.sent.append,
            lambda: self.events.append("pause"),
            lambda: self.events.append("resume"),
            lambda: self.events.append("close"),
            self.writable,
            lambda: self.events.append("abort"),
        )


def frame(opcode: int, payload: bytes = b"", fin: bool = True) -> bytes:
    """A client's frame (masked with a zero key, so the payload reads as it is)."""
    size = len(payload)
    length = bytes([0x80 | size]) if size < 126 else bytes([0x80 | 126]) + size.to_bytes(2, "big")
    return bytes([(0x80 if fin else 0) | opcode]) + length + b"\0\0\0\0" + payload


PING, TEXT, CONTINUATION = 9, 1, 0


async def quiet_session(io: object) -> Close:
    await asyncio.Event().wait()
    return Close(1000, "")


def test_pongs_wait_while_the_client_reads_nothing_and_a_close_then_drops_the_queue() -> None:
    async def run() -> None:
        stream = FakeStream()
        pump = WebSocketPump(stream.io(), lambda: WebSocketConfig(), quiet_session)
        pump.start()
        stream.writable.clear()  # the client stopped reading: the write buffer is over its window
        pump.data_received(frame(PING, b"a") * 50)
        assert len(stream.sent) == 1 and stream.events == ["pause"]  # one pong, then its pings wait unread
        stream.writable.set()
        await until(lambda: len(stream.sent) == 50)
        assert stream.events == ["pause", "resume"]
        stream.writable.clear()
        pump.data_received(frame(PING, b"b") * 3)
        pump.close(Close(1001, "no message for 120 s"))  # e.g. the idle timeout: nothing more is queued
        assert stream.events[-1] == "abort" and len(stream.sent) == 51 and pump.closed

    asyncio.run(run())


def test_a_message_that_never_ends_is_closed_by_its_frames_or_its_time() -> None:
    async def run() -> None:
        clock = Clock()
        stream = FakeStream()
        pump = WebSocketPump(stream.io(), lambda: WebSocketConfig(idle_timeout_s=60.0), quiet_session, clock)
        pump.start()
        pump.data_received(frame(TEXT, b"{", fin=False) + frame(CONTINUATION, b"", fin=False) * 100)
        clock.now += 59
        pump.data_received(frame(CONTINUATION, b"", fin=False))  # it keeps the connection heard ...
        pump.check_timeouts(clock())
        assert not stream.sent
        clock.now += 2  # ... but the message began 61 s ago
        pump.check_timeouts(clock())
        assert closes(stream.sent) == [(1008, "message not finished within 60 s")]

        stream = FakeStream()
        pump = WebSocketPump(stream.io(), lambda: WebSocketConfig(), quiet_session, clock)
        pump.start()
        pump.data_received(frame(TEXT, b"", fin=False) + frame(CONTINUATION, b"", fin=False) * MAX_MESSAGE_FRAMES)
        assert closes(stream.sent) == [(1008, f"message in over the limit of {MAX_MESSAGE_FRAMES} frames")]
        pump.lost()

    asyncio.run(run())


def closes(sent: list[bytes]) -> list[tuple[int, str]]:
    """The close frames among what the server sent (unmasked: code, then reason)."""
    found = []
    for data in sent:
        if data[0] & 0x0F == 8:
            size = data[1] & 0x7F
            found.append((int.from_bytes(data[2:4], "big"), data[4 : 2 + size].decode()))
    return found


# --- WebSocket attacks on a real daemon, over the Unix socket and HTTPS ---

HANDSHAKE = (
    b"GET /v1/realtime?intent=transcription HTTP/1.1\r\nhost: localhost\r\nupgrade: websocket\r\n"
    b"connection: Upgrade\r\nsec-websocket-key: dGhlIHNhbXBsZSBub25jZQ==\r\nsec-websocket-version: 13\r\n\r\n"
)


@pytest.fixture(scope="module")
def voice_daemon_https(
    tmp_path_factory: pytest.TempPathFactory, keys: Keys, voice_bundle: Path, tls
) -> Iterator[Daemon]:
    """Whisper for /v1/realtime, on the Unix socket and HTTPS, with a write deadline of 10 s."""
    workdir = tmp_path_factory.mktemp("wsd")
    d = Daemon(workdir, voice_bundle, keys.trusted, tls=tls, https="", extra_server="write_timeout_s = 10.0\n")
    yield d.wait_ready(180)
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text()


def websocket_raw(daemon: Daemon, transport: str, rcvbuf: int = 4096) -> socket.socket:
    """A WebSocket opened by hand (101 read), on a socket that reads little: the attacker's."""
    if transport == "unix":
        sock: socket.socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        sock.settimeout(30)
        sock.connect(str(daemon.socket))
    else:
        sock = tls_connection(daemon, "127.0.0.4", rcvbuf=rcvbuf)
    sock.sendall(HANDSHAKE)
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(1)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def good_session(daemon: Daemon) -> str:
    """A real client's Realtime session (the websockets package) on the Unix socket: its first event."""
    with unix_connect(str(daemon.socket), "ws://localhost/v1/realtime?intent=transcription") as ws:
        return json.loads(ws.recv(timeout=60))["type"]


def offered_until_blocked(sock: socket.socket, data: bytes, limit: int) -> int:
    """Bytes of `data`, sent again and again, that the daemon took before it stopped reading (or `limit`)."""
    sock.settimeout(3)  # a send that waits this long: the daemon is not reading
    sent = 0
    try:
        while sent < limit:
            sock.sendall(data)
            sent += len(data)
    except TimeoutError:
        pass
    return sent


@pytest.mark.parametrize("transport", ["unix", "https"])
def test_a_client_that_pings_and_never_reads_holds_no_pongs_and_is_cut_off(
    voice_daemon_https: Daemon, transport: str
) -> None:
    daemon = voice_daemon_https
    pings = frame(PING, b"p" * 125) * 1000
    with good_unix_client_beside(daemon):
        rss_before = daemon.rss_kib()
        attacker = websocket_raw(daemon, transport)
        offered = offered_until_blocked(attacker, pings, 48 << 20)
        growth_mib = (daemon.rss_kib() - rss_before) / 1024
        assert good_session(daemon) == "session.created"
        # still reading nothing, it is cut off by the write deadline: the pongs queued for it are dropped
        wait_until(lambda: hung_up(attacker), "the client that reads nothing cut off")
        attacker.close()
    assert growth_mib < 16, f"the daemon grew by {growth_mib:.0f} MiB of pongs"
    assert offered < 48 << 20, f"the daemon read every ping of a client that reads nothing (grew {growth_mib:.0f} MiB)"


@pytest.mark.parametrize("transport", ["unix", "https"])
def test_a_message_of_empty_frames_that_never_ends_is_closed_naming_the_limit(
    voice_daemon_https: Daemon, transport: str
) -> None:
    daemon = voice_daemon_https
    with good_unix_client_beside(daemon):
        attacker = websocket_raw(daemon, transport, rcvbuf=0)
        attacker.sendall(frame(TEXT, b"", fin=False) + frame(CONTINUATION, b"", fin=False) * (MAX_MESSAGE_FRAMES + 10))
        attacker.settimeout(60)
        received = b""
        while b"\x88" not in received:  # the session's first events, then the close frame
            chunk = attacker.recv(65536)
            assert chunk, "closed without a close frame"
            received += chunk
        close = received[received.index(b"\x88") :]
        assert close[4 : 2 + close[1]].decode() == f"message in over the limit of {MAX_MESSAGE_FRAMES} frames"
        assert int.from_bytes(close[2:4], "big") == 1008
        attacker.close()
        assert good_session(daemon) == "session.created"


def hung_up(sock: socket.socket) -> bool:
    """Whether the daemon ended the connection (closed or reset it), unread data or not."""
    poller = select.poll()
    poller.register(sock.fileno(), select.POLLIN | select.POLLRDHUP)
    return any(events & (select.POLLHUP | select.POLLERR | select.POLLRDHUP) for _, events in poller.poll(0))


# --- TLS handshakes that never finish ---


def silent_tcp(daemon: Daemon, count: int) -> list[socket.socket]:
    """Connections to the HTTPS port that never send a ClientHello (the kernel completes each TCP handshake)."""
    held = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", daemon.https_port), timeout=30)
        held.append(sock)
    return held


def test_unfinished_tls_handshakes_are_bounded_per_address_and_others_are_served(start_daemon, tls) -> None:
    daemon = start_daemon(
        tls=tls, https="max_handshakes = 8\nmax_handshakes_per_address = 4\nhandshake_timeout_s = 60.0\n"
    )
    rss_before = daemon.rss_kib()
    silent = silent_tcp(daemon, 1000)
    # the address's first 4 are in their handshake; every other is closed at once, long before its deadline
    wait_until(lambda: sum(map(hung_up, silent)) >= 996, "the handshakes over the address's share closed")
    growth_mib = (daemon.rss_kib() - rss_before) / 1024
    assert [hung_up(s) for s in silent[:4]] == [False] * 4
    assert sum(map(hung_up, silent)) == 996
    assert growth_mib < 16, f"1000 handshakes begun grew the daemon by {growth_mib:.0f} MiB"
    with good_https(daemon, "127.0.0.2") as good:
        assert [good.get("/v2/health/ready").status_code for _ in range(10)] == [200] * 10
    for sock in silent:
        sock.close()
    assert "too many TLS handshakes from 127.0.0.1 (its share is 4)" in daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()


def unix_health(daemon: Daemon) -> str:
    """One request on a fresh connection to the Unix socket (its accept is what a flood of TCP could starve)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(daemon.socket))
        sock.sendall(b"GET /v2/health/ready HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
        return sock.recv(4096).decode("latin-1").split("\r\n")[0]


def test_a_flood_of_tcp_leaves_the_unix_socket_descriptors_to_accept_with(start_daemon, tls) -> None:
    """As under systemd's LimitNOFILE: the daemon started with 256 descriptors, the handshake bounds set
    out of the way, and 300 silent TCP connections: the TCP listener stops short of the limit."""
    daemon = start_daemon(
        tls=tls,
        https="max_handshakes = 1000\nmax_handshakes_per_address = 1000\nhandshake_timeout_s = 60.0\n",
        prefix=("prlimit", "--nofile=256:256", "--"),
        extra_server="header_timeout_s = 60.0\n",  # asyncio's TLS server gave handshakes this deadline
    )
    silent = silent_tcp(daemon, 300)
    descriptors = Path(f"/proc/{daemon.proc.pid}/fd")
    wait_until(lambda: len(list(descriptors.iterdir())) >= 256 - FD_RESERVE, "the flood taken up to the reserve")
    assert [unix_health(daemon) for _ in range(20)] == ["HTTP/1.1 200 OK"] * 20
    for sock in silent:
        sock.close()
    assert "TCP accepts paused 0.1 s: descriptors" in daemon.log.read_text()
    assert "Traceback" not in daemon.log.read_text()


class NotReadingH3(H3Client):
    """An HTTP/3 client that never grants the box more stream credit (it reads nothing), and notes
    each stream the box resets or stops."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._quic._write_stream_limits = lambda **frame: None  # type: ignore[method-assign]
        self.ended_by_box: set[int] = set()

    def quic_event_received(self, event: QuicEvent) -> None:
        if isinstance(event, StreamReset | StopSendingReceived):
            self.ended_by_box.add(event.stream_id)
        super().quic_event_received(event)


def test_a_client_that_pings_and_never_reads_over_http3_is_closed_within_the_buffer(voice_daemon_https: Daemon) -> None:
    daemon = voice_daemon_https
    pings = frame(PING, b"p" * 125) * 1000

    async def attack() -> tuple[int, bool]:
        config = configuration(daemon)
        config.max_stream_data = 65536
        async with connect("127.0.0.1", daemon.quic_port, configuration=config, create_protocol=NotReadingH3) as client:
            assert isinstance(client, NotReadingH3)
            _, ws = await open_websocket(client, "/v1/realtime?intent=transcription")
            sent = 0
            while sent < 24 << 20 and ws.stream_id not in client.ended_by_box:
                client.h3.send_data(ws.stream_id, pings, end_stream=False)
                client.transmit()
                sent += len(pings)
                while unsent(client, ws.stream_id) > 1 << 20 and ws.stream_id not in client.ended_by_box:
                    await asyncio.sleep(0.01)
            return sent, ws.stream_id in client.ended_by_box

    with good_unix_client_beside(daemon):
        rss_before = daemon.rss_kib()
        sent, ended = asyncio.run(attack())
        growth_mib = (daemon.rss_kib() - rss_before) / 1024
        assert good_session(daemon) == "session.created"
    assert ended and sent < 24 << 20, f"the box took {sent} bytes of pings and kept the stream"
    assert growth_mib < 16, f"the daemon grew by {growth_mib:.0f} MiB of pongs"


def unsent(client: H3Client, stream_id: int) -> int:
    """The client's bytes of this stream that the box has not acknowledged."""
    stream = client._quic._streams.get(stream_id)
    return 0 if stream is None else stream.sender._buffer_stop - stream.sender._buffer_start
