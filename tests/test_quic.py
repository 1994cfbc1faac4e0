"""QUIC specifics: certificate pinning, 0-RTT resumption, limits, and garbage datagrams.

The API itself runs over QUIC in test_api.py and test_vad.py (the `client` fixture's two transports).
"""

from __future__ import annotations

import asyncio
import signal
import socket
import threading
import time

import numpy as np
import pytest
from aioquic import tls
from aioquic.h3.connection import H3_ALPN
from aioquic.quic import connection as quic_connection
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.packet import push_ack_frame
from aioquic.quic.rangeset import RangeSet
from conftest import Bystander, Daemon, cli, make_ca_and_client
from waits import wait_until

from appliance.client import Call, Client, infer_call, speech_call
from appliance.client.quic import QuicSession
from appliance.engine.failpoints import HANG_FAILPOINT


def test_quic_client_refuses_a_server_it_cannot_verify(daemon) -> None:
    result = cli("call", "--quic", f"127.0.0.1:{daemon.quic_port}", "health", check=False)
    assert result.returncode != 0 and "certificate" in result.stderr
    ok = cli("call", "--quic", f"127.0.0.1:{daemon.quic_port}", "--cafile", daemon.cafile, "health")
    assert '"ready": true' in ok.stdout


def test_resumed_session_sends_get_as_0rtt_and_post_waits_for_the_handshake(daemon) -> None:
    async def scenario() -> None:
        session = QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile)
        assert (await session.send(Call("GET", "/v2/health/ready"))).status == 200
        assert not session.handshake.session_resumed
        for _ in range(100):  # the ticket follows the handshake
            if session.ticket is not None:
                break
            await asyncio.sleep(0.01)
        assert session.ticket is not None and session.ticket.max_early_data_size
        await session.close()

        await session.open(wait_connected=False)  # send before the handshake completes: early data
        get = await session.send(Call("GET", "/v2/health/ready"))
        assert get.status == 200
        assert session.handshake.session_resumed and session.handshake.early_data_accepted
        await session.close()

        await session.open(wait_connected=False)
        post = await session.send(infer_call("silero_vad", np.zeros(1024, np.float32)))
        assert post.status == 200  # served once the handshake completed, never from replayable data
        await session.close()

    asyncio.run(scenario())


def test_body_over_the_limit_gets_413_over_quic(daemon) -> None:
    with daemon.client("quic") as client:
        body = b"\0" * ((8 << 20) + 1)
        response = client.send(Call("POST", "/v2/models/silero_vad/infer", body))
        assert response.status == 413 and "exceeds the limit" in response.json()["error"]
        assert client.health()["ready"]


def test_sighup_applies_a_lower_body_limit_to_quic_too(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls)
    body = b"\0" * (4 << 20)
    with daemon.client("quic") as client:
        assert client.send(Call("POST", "/v2/models/silero_vad/infer", body)).status == 400  # not a tensor
        daemon.config.write_text(
            daemon.config.read_text().replace(f"max_body_bytes = {8 << 20}", f"max_body_bytes = {1 << 20}")
        )
        daemon.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while "reload: applied" not in daemon.log.read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        response = client.send(Call("POST", "/v2/models/silero_vad/infer", body))
        assert response.status == 413 and f"limit of {1 << 20} bytes" in response.json()["error"]


def test_a_request_the_engine_holds_past_the_idle_timeout_keeps_its_connection(
    start_daemon, tls, speech_bundle, tmp_path
) -> None:
    """Neither side sends while the engine works on an answer: the server PINGs a connection that waits
    on one, so a request held for three of its idle timeouts is answered on the same connection."""
    hold = tmp_path / "hold"
    quic = "idle_timeout_s = 1.0\n"
    daemon = start_daemon(bundle_dir=speech_bundle, tls=tls, extra_quic=quic, env={HANG_FAILPOINT: str(hold)})
    answered: list[int] = []
    with daemon.client("quic") as client:
        assert client.health()["ready"]
        hold.write_text("0")  # the engine's next call stalls
        call = speech_call("Held past the idle timeout.", "tts-1", "joe")
        sender = threading.Thread(target=lambda: answered.append(client.send(call).status))
        sender.start()
        wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the engine held")
        time.sleep(3.0)  # three idle timeouts with nothing to say but the PINGs
        hold.unlink()
        sender.join(60)
        assert answered == [200], daemon.log.read_text()[-2000:]
        assert client.health()["ready"]


def test_connection_limit(start_daemon, tls) -> None:
    daemon = start_daemon("", tls=tls, extra_quic="max_connections = 2\n")
    clients = [daemon.client("quic") for _ in range(2)]
    for c in clients:
        assert c.health()["ready"]
    with pytest.raises((ConnectionError, TimeoutError)):
        with daemon.client("quic") as third:
            third.health()
    for c in clients:
        c.close()


def mutated_datagrams(count: int, seed: int = 7) -> list[bytes]:
    """Random bytes, QUIC-looking long headers with junk, version negotiation bait, truncations."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        kind = i % 4
        body = rng.integers(0, 256, int(rng.integers(1, 1350)), dtype=np.uint8).tobytes()
        if kind == 0:
            out.append(body)
        elif kind == 1:  # long header, version 1, random connection id lengths
            out.append(bytes([0xC0 | int(rng.integers(0, 64))]) + b"\x00\x00\x00\x01" + body)
        elif kind == 2:  # unknown version: must not become a reflection amplifier
            out.append(
                bytes([0xC0]) + b"\x1a\x2a\x3a\x4a" + bytes([8]) + body[:8] + bytes([8]) + body[8:16] + b"\0" * 1180
            )
        else:  # short header
            out.append(bytes([0x40 | int(rng.integers(0, 64))]) + body[:40])
    return out


def test_garbage_datagrams_do_not_disturb_other_clients(daemon) -> None:
    rss_before = daemon.rss_kib()
    sent = 0
    replies = 0
    with Bystander(daemon) as bystander, socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as attacker:
        attacker.bind(("127.0.0.2", 0))
        attacker.setblocking(False)
        deadline = time.monotonic() + 20
        for datagram in mutated_datagrams(5000):
            if time.monotonic() > deadline:
                break
            attacker.sendto(datagram, ("127.0.0.1", daemon.quic_port))
            sent += 1
            if sent % 200 == 0:
                time.sleep(0.01)
            try:
                while attacker.recv(65536):
                    replies += 1
            except BlockingIOError:
                pass
    assert not bystander.errors, bystander.errors
    assert bystander.answered >= 10
    assert sent >= 2000
    assert replies <= sent // 10, f"{replies} replies to {sent} garbage datagrams"
    with daemon.client("quic") as client:
        assert client.health()["ready"]
    assert daemon.rss_kib() - rss_before < 64 * 1024, "memory grew by more than 64 MiB under garbage"


def test_ack_range_flood_from_a_connected_peer_does_not_disturb_other_clients(daemon, monkeypatch) -> None:
    """An authenticated peer sends 1-RTT packets, each one ACK frame with hundreds of ranges
    for packets never sent (the ACK-range flood reported against aioquic)."""
    rss_before = daemon.rss_kib()
    pushed = [0]

    def counting_push_ack_frame(*args, **kwargs) -> int:
        ranges = push_ack_frame(*args, **kwargs)
        pushed[0] += ranges
        return ranges

    monkeypatch.setattr(quic_connection, "push_ack_frame", counting_push_ack_frame)

    async def flood(packets: int) -> None:
        session = QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile)
        assert (await session.send(Call("GET", "/v2/health/ready"))).status == 200
        protocol = session._protocol
        space = protocol._quic._spaces[tls.Epoch.ONE_RTT]
        for i in range(packets):
            top = 1_000_000 + 2_000 * i
            space.ack_queue = RangeSet(range(n, n + 1) for n in range(top, top - 2_000, -2))  # 1000 gaps
            space.ack_at = 0.0  # due now: the next packet carries it
            protocol.transmit()
            if i % 20 == 0:
                await asyncio.sleep(0.001)
        await session.close()

    with Bystander(daemon) as bystander:
        asyncio.run(flood(2000))
    assert pushed[0] >= 2000 * 100, f"only {pushed[0]} ACK ranges went out"
    assert not bystander.errors, bystander.errors
    assert bystander.answered >= 10
    with daemon.client("quic") as client:
        assert client.health()["ready"]
    assert daemon.rss_kib() - rss_before < 64 * 1024, "memory grew by more than 64 MiB under the ACK flood"


def test_mutual_tls_accepts_signed_clients_and_refuses_others_in_the_handshake(start_daemon, tls, tmp_path) -> None:
    ca, cert, key = make_ca_and_client(tmp_path, "good")
    _, rogue_cert, rogue_key = make_ca_and_client(tmp_path, "rogue", signed=False)
    daemon = start_daemon(tls=tls, extra_quic=f'client_ca = "{ca}"\n')
    address = f"127.0.0.1:{daemon.quic_port}"
    with Client(quic=address, cafile=daemon.cafile, certificate=(cert, key), timeout=20) as good:
        assert good.health()["ready"]
        assert good.speech_probs(np.zeros(1024, np.float32)).shape == (2,)
    for certificate in (None, (rogue_cert, rogue_key)):
        with pytest.raises((ConnectionError, TimeoutError)):
            with Client(quic=address, cafile=daemon.cafile, certificate=certificate, timeout=20) as refused:
                refused.health()
    with daemon.client() as local:  # the Unix socket is unaffected
        assert local.health()["ready"]


def test_quiet_streams_get_408_and_open_streams_are_bounded(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls, extra_quic="stream_idle_timeout_s = 1.0\nmax_streams_per_connection = 4\n")

    async def scenario() -> tuple[list[int], int]:
        session = QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile)
        await session.send(Call("GET", "/v2/health/ready"))
        protocol = session._protocol
        quiet = []
        for _ in range(5):  # open request streams that never finish their body
            stream_id = protocol._quic.get_next_available_stream_id()
            parts = protocol._streams[stream_id] = asyncio.Queue()
            protocol.http.send_headers(
                stream_id,
                [
                    (b":method", b"POST"),
                    (b":scheme", b"https"),
                    (b":authority", b"x"),
                    (b":path", b"/v2/models/silero_vad/infer"),
                ],
            )
            protocol.transmit()
            quiet.append(parts)

        async def status_of(parts: asyncio.Queue) -> int:
            return int((await parts.get())[":status"])

        statuses = await asyncio.wait_for(asyncio.gather(*map(status_of, quiet)), 10)
        after = (await session.send(Call("GET", "/v2/health/ready"))).status  # the connection still serves
        await session.close()
        return statuses, after

    statuses, after = asyncio.run(scenario())
    assert sorted(statuses) == [408, 408, 408, 408, 429], statuses
    assert after == 200


def test_retry_validates_addresses_and_refuses_forged_tokens(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls, extra_quic="retry = true\n")

    async def scenario(token: bytes) -> tuple[int, int]:
        session = QuicSession(f"127.0.0.1:{daemon.quic_port}", daemon.cafile)
        configuration = session._configuration

        def with_token():
            c = configuration()
            c.token = token  # a token the server never issued rides in the first Initial
            return c

        session._configuration = with_token
        try:
            status = (await asyncio.wait_for(session.send(Call("GET", "/v2/health/ready")), 5)).status
            return status, session._protocol._quic._retry_count
        finally:
            await session.close()

    # no token: the server answers the first Initial with a Retry, the client echoes the token
    assert asyncio.run(scenario(b"")) == (200, 1)
    with pytest.raises((ConnectionError, TimeoutError, asyncio.TimeoutError)):
        asyncio.run(scenario(b"\x00" * 12 + b"forged token from nowhere"))
    with daemon.client("quic") as client:
        assert client.health()["ready"]


def abandoned_hello(port: int, local_host: str = "127.0.0.1") -> socket.socket:
    """A ClientHello in a real QUIC Initial from its own address, never followed up: what an attacker
    sends to hold a handshake slot. The socket stays open so the server's answers can be read."""
    connection = quic_connection.QuicConnection(configuration=QuicConfiguration(is_client=True, alpn_protocols=H3_ALPN))
    connection.connect(("127.0.0.1", port), now=time.time())
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((local_host, 0))
    for data, addr in connection.datagrams_to_send(now=time.time()):
        sock.sendto(data, addr)
    return sock


def test_abandoned_handshakes_free_their_slots_in_seconds(start_daemon, tls) -> None:
    # the handshakes' time (5 s) is longer than a refused client's try (1 s) takes on a slow machine
    daemon = start_daemon(tls=tls, extra_quic="max_connections = 3\nhandshake_timeout_s = 5.0\n")
    hellos = [abandoned_hello(daemon.quic_port) for _ in range(3)]  # every slot held
    with pytest.raises((ConnectionError, TimeoutError)):
        with Client(quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, connect_timeout=1.0) as refused:
            refused.health()
    wait_until(lambda: "limit: QUIC handshake not complete within 5 s" in daemon.log.read_text(), "a slot freed")
    with daemon.client("quic") as client:
        assert client.health()["ready"]
    for sock in hellos:
        sock.close()


def test_one_address_holds_at_most_its_share_of_handshakes(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls, extra_quic="max_handshakes_per_source = 3\nhandshake_timeout_s = 30.0\n")
    hellos = [abandoned_hello(daemon.quic_port, "127.0.0.7") for _ in range(10)]
    wait_until(lambda: seen(daemon, "127.0.0.7:") == 10, "all ten seen")
    wait_until(  # ... 7 refused
        lambda: "limit: more than 3 QUIC handshakes in progress from 127.0.0.7" in daemon.log.read_text(), "refused"
    )
    with daemon.client("quic") as client:  # another address is served
        assert client.health()["ready"]
    for sock in hellos:
        sock.close()


def seen(daemon: Daemon, prefix: str) -> int:
    """Peers from addresses that start with `prefix` in the daemon's QUIC peer table."""
    with daemon.client() as unix:
        return sum(p["peer"].startswith(prefix) for p in unix.status()["conncache"]["peers"])


def test_retry_switches_on_by_itself_under_pressure(start_daemon, tls) -> None:
    daemon = start_daemon(tls=tls, extra_quic="retry_when_handshaking = 3\nhandshake_timeout_s = 30.0\n")
    hellos = [abandoned_hello(daemon.quic_port, f"127.0.0.{10 + i}") for i in range(3)]
    wait_until(
        lambda: seen(daemon, "127.0.0.1") == 3, "the three handshakes in progress"
    )  # the next datagram meets them
    probe = abandoned_hello(daemon.quic_port, "127.0.0.20")
    probe.settimeout(5)
    answer, _ = probe.recvfrom(2048)
    assert answer[0] & 0x80 and (answer[0] & 0x30) >> 4 == 3  # a long-header Retry packet, not a handshake
    with daemon.client("quic") as client:  # a real client follows the Retry and is served
        assert client.health()["ready"]
    assert "quic: 3 handshakes in progress: Retry on" in daemon.log.read_text()
    for sock in [*hellos, probe]:
        sock.close()
