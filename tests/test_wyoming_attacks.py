"""Wyoming's connections under attack (issue 47, items 1 and 10), on a real daemon with the voice firmware,
good clients driven by the `wyoming` package's own client beside the attackers (which speak its events
over sockets of their own, from LAN addresses 127.0.0.X):

- recordings held against the daemon's byte budget (server.max_buffered_bytes), refused past it and
  given back when they end or their connection goes;
- a client that stops reading cut off after server.write_timeout_s, its slot freed;
- the Unix socket's slots apart from TCP's, and one LAN host's share of TCP's.

Impossible audio formats and the text bounds are tests/test_hostile_wyoming.py's."""

from __future__ import annotations

import asyncio
import contextlib
import io
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

import numpy as np
import pytest
from conftest import Daemon, good_unix_client_beside
from speech import RATE, recording
from test_speech_to_text import CLEAR, wer
from test_wyoming import TINY, tcp_port, wyoming_socket
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncClient, AsyncUnixClient
from wyoming.event import Event, async_read_event, async_write_event, write_event
from wyoming.ping import Ping

from appliance.audio import to_pcm16
from appliance.bench.daemon import free_tcp_port

MIB = 1 << 20
HELD = 8 * MIB  # what one attacker's recording holds in the box (16 kHz samples, kept as PCM16)
BUDGET = 7 * HELD // 2  # server.max_buffered_bytes: three such recordings and half of a fourth
TCP_SLOTS, SHARE = 64, 3  # [wyoming] max_tcp_connections (its default), max_connections_per_peer
CHUNK = 1 << 16  # the attackers' chunks of 8 kHz audio
WRITE_TIMEOUT_S = 1.0

CONFIG = f"""[wyoming]
tcp = "127.0.0.1:{{port}}"
max_connections = 4
max_tcp_connections = {TCP_SLOTS}
max_connections_per_peer = {SHARE}
"""


@pytest.fixture(scope="module")
def daemon(voice_bundle, keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """Recordings of up to 524 s (16 MiB bodies as 16 kHz PCM16), a budget of 28 MiB, a write deadline
    of 1 s; four Unix socket slots, 64 on TCP, three for one user or host."""
    d = Daemon(
        tmp_path_factory.mktemp("daemon"),
        voice_bundle,
        keys.trusted,
        extra=CONFIG.format(port=free_tcp_port()),
        extra_server=f"max_buffered_bytes = {BUDGET}\nwrite_timeout_s = {WRITE_TIMEOUT_S}\n",
        max_body_bytes=16 * MIB,
    )
    d.wait_ready(240)
    yield d
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


SPEECH = recording(CLEAR[:1], gap_s=0.3, lead_s=0.3)[0]


async def transcript(client: AsyncClient, samples: np.ndarray = SPEECH, step: int = RATE * 2 // 10) -> str:
    """A recording sent as Home Assistant sends one (100 ms chunks unless told), and its transcript; an
    `error` or a close instead fails."""
    async with client:
        await client.write_event(Transcribe(name=TINY, language="en").event())
        await client.write_event(AudioStart(RATE, 2, 1).event())
        pcm = to_pcm16(samples)
        for offset in range(0, len(pcm), step):
            await client.write_event(AudioChunk(RATE, 2, 1, pcm[offset : offset + step]).event())
        await client.write_event(AudioStop().event())
        while (event := await asyncio.wait_for(client.read_event(), 120)) is not None:
            assert event.type != "error", event.data
            if Transcript.is_type(event.type):
                return Transcript.from_event(event).text
    raise AssertionError("closed without a transcript")


class GoodHomeAssistant(threading.Thread):
    """A Home Assistant beside the attack (its client from `connect`): the known sentence transcribed
    again and again, each transcript judged against its text. None of them may fail."""

    def __init__(self, connect: Callable[[], AsyncClient]) -> None:
        super().__init__(daemon=True)
        self.connect, self.heard, self.errors = connect, 0, []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                text = asyncio.run(transcript(self.connect()))
                assert wer(CLEAR[0], text) <= 0.10, text
                self.heard += 1
            except Exception as exc:  # noqa: BLE001 - asserted at the end
                self.errors.append(exc)


@contextlib.contextmanager
def home_assistant_beside(connect: Callable[[], AsyncClient]) -> Iterator[GoodHomeAssistant]:
    """A good Home Assistant transcribing while the body attacks, and once more after it if the attack
    was over before its first transcript: 0 failures."""
    good = GoodHomeAssistant(connect)
    good.start()
    try:
        yield good
        deadline = time.monotonic() + 120  # a hang guard: a busy machine's first transcript may be slow
        while not good.heard and not good.errors and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        good.stopping.set()
        good.join(180)
    assert not good.errors and good.heard, (good.heard, good.errors[:3])


async def lan(daemon: Daemon, host: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A TCP connection to the box's Wyoming from `host` (an address of 127.0.0.0/8: a LAN host)."""
    return await asyncio.open_connection("127.0.0.1", tcp_port(daemon), local_addr=(host, 0))


async def answer(connection: tuple[asyncio.StreamReader, asyncio.StreamWriter], event: Event) -> Event | None:
    """`event` sent, and the box's next event (None where it closed)."""
    reader, writer = connection
    with contextlib.suppress(ConnectionError):
        await async_write_event(event, writer)
    return await asyncio.wait_for(async_read_event(reader), 60)


async def ping_from(daemon: Daemon, host: str) -> Event | None:
    """A new connection from `host`: its answer to a ping (a pong where it is served, an error where
    it is refused); then it closes."""
    connection = await lan(daemon, host)
    try:
        return await answer(connection, Ping(text="hello").event())
    finally:
        connection[1].close()


async def served_from(daemon: Daemon, hosts: list[str]) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection from each of `hosts`, each answering a ping. Tried again while one is refused: the
    box counts a connection a client closed (an earlier test's) gone once it reads its end."""
    deadline = time.monotonic() + 60
    while True:
        connections = [await lan(daemon, host) for host in hosts]
        answers = [await answer(connection, Ping().event()) for connection in connections]
        if all(a is not None and a.type == "pong" for a in answers):
            return connections
        for _, writer in connections:
            writer.close()
        assert time.monotonic() < deadline, answers
        await asyncio.sleep(0.2)


async def record(daemon: Daemon, host: str) -> tuple[Event | None, tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """An attacker's recording of 8 kHz audio that would hold HELD bytes in the box, sent at once and
    never stopped, then a ping: the pong where the box holds it all, else the error it was refused with."""
    connection = await lan(daemon, host)
    await async_write_event(Transcribe(name=TINY).event(), connection[1])
    await async_write_event(AudioStart(8000, 2, 1).event(), connection[1])
    chunk = AudioChunk(8000, 2, 1, bytes(CHUNK)).event()  # 8 kHz PCM16 made 16 kHz PCM16: 2 bytes held a byte
    with contextlib.suppress(ConnectionError):  # refused: the box reads on a while, then closes
        for _ in range(HELD // 2 // CHUNK):
            await async_write_event(chunk, connection[1])
    return await answer(connection, Ping(text="all sent").event()), connection


class PeakResidentMemory(threading.Thread):
    """The daemon's resident memory sampled every 20 ms until stopped: its peak, in KiB."""

    def __init__(self, daemon: Daemon) -> None:
        super().__init__(daemon=True)
        self.target, self.peak_kib = daemon, daemon.rss_kib()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.wait(0.02):
            self.peak_kib = max(self.peak_kib, self.target.rss_kib())

    def __enter__(self) -> PeakResidentMemory:
        self.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stopping.set()
        self.join(10)


def test_64_lan_connections_recording_at_once_are_held_to_the_byte_budget(daemon: Daemon) -> None:
    """32 LAN hosts' recordings added 4.35 GB: no budget counted them. Here 64 connections (every TCP
    slot, from 22 hosts) send at once recordings that would hold 8 MiB each in the box (an 8 kHz
    stream made 16 kHz PCM16: 512 MiB in all) and keep them open. At most three fit the 28 MiB budget;
    every other one is refused with one `error` naming server.max_buffered_bytes once it passes it,
    and its bytes are given back (so that others get as far). The daemon's resident memory, sampled
    throughout, grows by at most the budget plus 64 MiB. A Home Assistant's recording fits beside
    those held, and once they go, one of 12 MiB, which fits only where theirs were given back."""
    hosts = [f"127.0.0.{10 + index // SHARE}" for index in range(TCP_SLOTS)]

    async def attack() -> tuple[list[str], int]:
        # one transcript first: the model's first run takes memory of its own, and is not the attack's
        assert wer(CLEAR[0], await transcript(AsyncUnixClient(wyoming_socket(daemon)))) <= 0.10
        rss_before = daemon.rss_kib()
        with PeakResidentMemory(daemon) as memory:
            answers = await asyncio.gather(*(record(daemon, host) for host in hosts))
        outcomes = []
        for answered, connection in answers:
            assert answered is not None
            outcomes.append(answered.type)
            if answered.type == "error":
                assert f"at the limit of {BUDGET} bytes (server.max_buffered_bytes)" in answered.data["text"]
                assert answered.data["code"] == "max_buffered_bytes", answered.data
        assert wer(CLEAR[0], await transcript(AsyncUnixClient(wyoming_socket(daemon)))) <= 0.10
        for _, (_, writer) in answers:
            writer.close()
        return outcomes, memory.peak_kib - rss_before

    with good_unix_client_beside(daemon):
        outcomes, grown_kib = asyncio.run(attack())
    held = outcomes.count("pong")
    assert 1 <= held <= 3 and outcomes.count("error") == TCP_SLOTS - held, outcomes
    grown_mib = grown_kib // 1024
    assert grown_mib < (BUDGET + 64 * MIB) // MIB, f"grew {grown_mib} MiB at its peak with a budget of 28 MiB"
    long_speech = np.concatenate([SPEECH, np.zeros(12 * MIB // 2 - len(SPEECH), np.float32)])  # 12 MiB held

    def given_back() -> str:  # those held closed: the box counts them gone as it reads their ends
        deadline = time.monotonic() + 30
        while True:
            try:
                return asyncio.run(transcript(AsyncUnixClient(wyoming_socket(daemon)), long_speech, RATE * 2))
            except AssertionError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    assert wer(CLEAR[0], given_back()) <= 0.10
    refusal = r"limit: Wyoming client 127\.0\.0\.\d+: busy: request bodies, audio buffers and recordings held"
    assert re.search(refusal, daemon.log.read_text())


def pings_unread(count: int, size: int) -> bytes:
    """`count` pings whose pongs carry `size` bytes of text back: what a client that never reads sends."""
    out = io.BytesIO()
    for _ in range(count):
        write_event(Ping(text="x" * size).event(), out)
    return out.getvalue()


async def until(attempt: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 60.0) -> None:
    """A hang guard: `attempt` again until it holds; fails only where it never does."""
    deadline = time.monotonic() + timeout_s
    while not await attempt():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.2)


def test_a_client_that_stops_reading_is_cut_off_and_its_slot_freed(daemon: Daemon) -> None:
    """A client that stopped reading was held for ever (the box blocked writing to it, reading nothing,
    so no time bound ran). A LAN host's three connections each send 6 MiB of pings and read none of
    the pongs: its share is taken, a fourth is refused; each is cut off once it has taken nothing for
    server.write_timeout_s, and three new connections of the host are served while the stalled ones
    are still open on its side. A Home Assistant on the Unix socket beside it is served throughout."""
    host = "127.0.0.5"

    async def attack() -> None:
        stalled = [await lan(daemon, host) for _ in range(SHARE)]
        for _, writer in stalled:
            # no drain: this client's own buffer holds them. 24 MiB of pongs each: more than the kernel
            # holds on a connection whose reader reads nothing (the box's send buffer grows to
            # tcp_wmem's 4 MiB, the receiver's buffer as well): with 6 MiB, two of three connections
            # once took all their pongs into kernel buffers, so the box never waited on them
            writer.write(pings_unread(96, 256 << 10))
        refused = await ping_from(daemon, host)
        assert refused is not None and f"its share is {SHARE}" in refused.data["text"], refused

        async def served() -> bool:  # its whole share again: each stalled connection was cut off
            connections = [await lan(daemon, host) for _ in range(SHARE)]
            try:
                answers = [await answer(connection, Ping(text="again").event()) for connection in connections]
            finally:
                for _, writer in connections:
                    writer.close()
            return all(a is not None and a.type == "pong" for a in answers)

        await until(served, "the stalled connections still hold the host's share")
        for reader, writer in stalled:  # each was closed by the box: what reached it, then its end
            with contextlib.suppress(ConnectionError):
                while await asyncio.wait_for(reader.read(1 << 20), 30):
                    pass
            writer.close()

    with home_assistant_beside(lambda: AsyncUnixClient(wyoming_socket(daemon))):
        asyncio.run(attack())
    log = daemon.log.read_text()
    assert f"limit: Wyoming client {host}: it took nothing the box sent for 1 s; connection cut off" in log


def test_lan_hosts_cannot_take_the_unix_sockets_slots_nor_one_host_all_of_tcps(daemon: Daemon) -> None:
    """Four LAN hosts held all 64 shared slots, and a local Home Assistant was refused 40 times in 49.
    Now the Unix socket has slots of its own: LAN hosts fill TCP's 64 (one host past its share of
    three is refused while TCP has room; a host past the 64 is refused too), and a local Home
    Assistant is served throughout, on a second connection as well."""

    async def attack() -> None:
        first = await served_from(daemon, ["127.0.0.2"] * SHARE)
        over_share = await ping_from(daemon, "127.0.0.2")
        assert over_share is not None and "from 127.0.0.2 (its share is 3)" in over_share.data["text"], over_share
        others = await served_from(daemon, [f"127.0.0.{3 + index // SHARE}" for index in range(TCP_SLOTS - SHARE)])
        full = await ping_from(daemon, "127.0.0.250")
        assert full is not None and f"Wyoming connections on TCP (limit {TCP_SLOTS})" in full.data["text"], full
        async with AsyncUnixClient(wyoming_socket(daemon)) as local:  # beside Home Assistant's
            await local.write_event(Ping(text="local").event())
            pong = await asyncio.wait_for(local.read_event(), 60)
            assert pong is not None and pong.type == "pong", pong
        for _, writer in first + others:
            writer.close()

    with home_assistant_beside(lambda: AsyncUnixClient(wyoming_socket(daemon))):
        asyncio.run(attack())
