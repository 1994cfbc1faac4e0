"""One contract for every transport of the listener table (appliance/transport/listening.py), as uvicorn
runs one suite against each of its HTTP implementations: each transport is served in process by its
table entry, exactly as the engine process and the protocol workers serve it, on a real socket, with a
stand-in API (for Wyoming, which serves the models themselves, a stand-in voice), and talked to by a
real client (HTTP/1.1 and HTTP/3: the box's own; Wyoming: the `wyoming` package's). The contract: a
request is answered; a client that goes away cancels the work it asked for; the daemon-wide byte budget
refuses a body that does not fit, naming the budget; a peer past its share is refused naming it; the
stop takes no new connection while the request under way is answered, and close_all ends the
connections. Verdicts are the order of events, never seconds."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from test_wyoming_codec import encoded
from wyoming.asr import Transcribe
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncClient, AsyncTcpClient, AsyncUnixClient
from wyoming.error import Error
from wyoming.event import async_read_event
from wyoming.info import Describe, Info
from wyoming.tts import Synthesize, SynthesizeVoice

from appliance.api import wyoming_events
from appliance.api.metrics import Metrics
from appliance.client import Call, ConnectError, NoAnswer
from appliance.client.quic import QuicSession
from appliance.config import Config, Live, QuicConfig, ServerConfig
from appliance.kinds.capabilities import SpokenVoice
from appliance.protocol.messages import Request, Response
from appliance.transport import h3, http1
from appliance.transport.assembler import Arrived, BodyBudget
from appliance.transport.conncache import UserSpaceCache
from appliance.transport.listening import TRANSPORTS, Transports
from appliance.transport.serving import EngineSide, Served, Serving

BUDGET = 64 << 10  # server.max_buffered_bytes here: a body of BUDGET + 1 fits max_body_bytes, not the budget
WRITE_TIMEOUT_S = 5.0  # server.write_timeout_s here, on the test's clock
LARGE = 32 << 20  # an answer more than the kernel's socket buffers hold for a client that reads nothing
HELD_ANSWER = 256 << 10  # /held's answer, and the stand-in voice's speech: more than one QUIC flight
WYOMING = ("wyoming", "wyoming-tcp")  # served where the models are: their stand-in here is HeldVoice
HTTP = ("https", "quic", "unix")


class HeldApi:
    """/held waits until the test releases it and records how it ended; anything else is answered at once."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.events: list[str] = []
        self.pieces = 0  # of the endless answer, produced so far

    async def handle(self, request: Request) -> Response:
        if request.target == "/large":
            return Response(200, b"x" * LARGE, "application/octet-stream")
        if request.target == "/endless":
            return Response(200, b"", "application/octet-stream", stream=self._endless())
        if request.target != "/held":  # a HEAD too: the transport sends its head alone
            return Response(200, b"answered", "text/plain")
        self.events.append("held")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.events.append("cancelled")
            raise
        self.events.append("released")
        return Response(200, b"x" * HELD_ANSWER, "application/octet-stream")

    async def _endless(self) -> AsyncIterator[bytes]:
        """A streamed answer that goes on while the client takes it: flow control alone holds it."""
        try:
            while True:
                self.pieces += 1
                yield b"x" * (64 << 10)
                await asyncio.sleep(0)
        finally:
            self.events.append("answer ended")

    def keep_connections(self) -> bool:
        return True

    def end_opened(self, opened: object) -> None:
        pass

    async def still_open(self, opened: list[Any]) -> list[bool]:
        return [False] * len(opened)


class HeldVoice:
    """Wyoming's /held: a voice (a Speaker to the box) whose speech waits until the test releases the
    API's event, recorded in the API's events as /held's are."""

    voice_name, language, sample_rate = "held", "en", 16000
    voices = {name: SpokenVoice(name, "en", "en") for name in ("held", "endless")}  # "endless": /endless

    def __init__(self, api: HeldApi) -> None:
        self.api = api
        self.spec = dataclasses.make_dataclass("Spec", [("kind", str)])("speech_synthesis")

    @property
    def name(self) -> str:
        return "held_voice"

    def voice(self, name: object | None) -> SpokenVoice:
        return self.voices["held"]

    def listing(self) -> list[dict[str, Any]]:
        return []

    async def prepare(self, text: str, voice: str | None = None) -> list[list[int]]:
        return [[1]]

    async def synthesize(
        self, shards: list[list[int]], speed: float, times: object = None, voice: str | None = None
    ) -> AsyncIterator[np.ndarray]:
        path = "/endless" if voice == "endless" else "/held"  # held, cancelled or released as /held is
        answer = await self.api.handle(Request("POST", path, {}, b""))
        if answer.stream is None:
            yield np.zeros(HELD_ANSWER // 2, np.int16)
            return
        async with contextlib.aclosing(answer.stream) as pieces:  # as /endless, pulled while it is taken
            async for piece in pieces:
                yield np.frombuffer(piece, np.int16)


async def open_stream(name: str, address: Any, cafile: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to a stream transport: the Unix socket, or TLS to the HTTPS port."""
    if name == "unix":
        return await asyncio.open_unix_connection(address)
    context = ssl.create_default_context(cafile=cafile)
    context.check_hostname = False
    return await asyncio.open_connection("127.0.0.1", address, ssl=context)


class Peer:
    """A real client of one transport: HTTP/1.1 on the Unix socket or over TLS, HTTP/3 over QUIC."""

    def __init__(self, name: str, address: Any, cafile: str) -> None:
        self.name, self.address, self.cafile = name, address, cafile
        self._session: QuicSession | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def send(self, path: str, body: bytes = b"") -> tuple[int, bytes]:
        if self.name == "quic":
            self._session = QuicSession(f"127.0.0.1:{self.address}", self.cafile, connect_timeout=5)
            answer = await self._session.send(Call("POST" if body else "GET", path, body))
            return answer.status, answer.body
        reader, self._writer = await open_stream(self.name, self.address, self.cafile)
        method = "POST" if body else "GET"
        head = f"{method} {path} HTTP/1.1\r\nhost: box\r\ncontent-length: {len(body)}\r\n\r\n"
        self._writer.write(head.encode() + body)
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            length = int(value) if name.lower() == "content-length" else length
        return status, await reader.readexactly(length)

    async def go_away(self) -> None:
        if self._session is not None:
            await self._session.close()
        if self._writer is not None:
            self._writer.close()

    # the contract's requests, as each protocol asks them
    async def ask(self) -> str:
        """A request answered at once: what came back (its body, or why it was refused)."""
        status, body = await self.send("/")
        return body.decode() if status == 200 else f"{status} {body.decode()}"

    async def past_budget(self) -> str:
        status, body = await self.send("/", b"\0" * (BUDGET + 1))  # fits max_body_bytes, not the budget
        return f"{status} {body.decode()}"

    async def held(self) -> int:
        """/held: the length of its answer once released."""
        status, body = await self.send("/held")
        assert status == 200, (status, body[:200])
        return len(body)


class WyomingPeer:
    """The contract's requests as a Home Assistant asks them, with the `wyoming` package's client: describe
    (answered at once), a recording past the byte budget, a synthesis in the held voice."""

    def __init__(self, name: str, address: Any) -> None:
        self.client: AsyncClient = (
            AsyncUnixClient(address) if name == "wyoming" else AsyncTcpClient("127.0.0.1", address)
        )
        self._connected = False

    async def _exchange(self, *events: Any) -> Any:
        """The events sent, then the first answer that is not audio (audio's length kept in self.audio)."""
        if not self._connected:
            await self.client.connect()
            self._connected = True
        for event in events:
            await self.client.write_event(event.event())
        self.audio = 0
        while (answer := await self.client.read_event()) is not None:
            if AudioChunk.is_type(answer.type):
                self.audio += len(AudioChunk.from_event(answer).audio)
            elif not AudioStart.is_type(answer.type):
                return answer
        raise ConnectionError("the box closed the connection")

    async def ask(self) -> str:
        answer = await self._exchange(Describe())
        return "answered" if Info.is_type(answer.type) else Error.from_event(answer).text

    async def past_budget(self) -> str:
        audio = AudioChunk(rate=16000, width=2, channels=1, audio=b"\0" * (BUDGET + 2))
        answer = await self._exchange(Transcribe(), AudioStart(rate=16000, width=2, channels=1), audio)
        return f"{answer.type} {Error.from_event(answer).text}"

    async def held(self) -> int:
        answer = await self._exchange(Synthesize(text="Hold on.", voice=SynthesizeVoice(name="held")))
        assert AudioStop.is_type(answer.type), answer
        return self.audio

    async def go_away(self) -> None:
        if self._connected:
            await self.client.disconnect()


def peer_of(transport: str, address: Any, cafile: str) -> Peer | WyomingPeer:
    return WyomingPeer(transport, address) if transport in WYOMING else Peer(transport, address, cafile)


# each transport's share of one peer (a user on the Unix socket, an address on TCP and QUIC), as config names it
PEER_SHARES = {
    "unix": ("server", "max_connections_per_peer"),
    "https": ("https", "max_connections_per_address"),
    "quic": ("quic", "max_connections_per_address"),
    "wyoming": ("wyoming", "max_connections_per_peer"),
    "wyoming-tcp": ("wyoming", "max_connections_per_peer"),
}


def serving_for(
    tls: tuple[Path, Path],
    settings: dict[str, dict[str, Any]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_failure: Callable[[BaseException], None] = lambda error: None,
) -> tuple[Serving, HeldApi]:
    """What a process serves the table with: the stand-in API, this config (`settings`: keys by section
    that differ from the defaults), a budget of BUDGET bytes."""
    quic = QuicConfig(enabled=True, certificate=tls[0], private_key=tls[1])
    config = Config(server=ServerConfig(max_buffered_bytes=BUDGET, write_timeout_s=WRITE_TIMEOUT_S), quic=quic)
    for section, values in (settings or {}).items():
        config = dataclasses.replace(config, **{section: dataclasses.replace(getattr(config, section), **values)})
    live = Live(config)
    api = HeldApi()
    engine = EngineSide({"held_voice": HeldVoice(api)}, Metrics(), lambda: False, asyncio.Event())  # type: ignore[dict-item]
    budget = BodyBudget(lambda: live.config.server)
    serving = Serving(api, live, budget, on_failure, clock=clock, engine=engine)  # type: ignore[arg-type]
    return serving, api


@contextlib.asynccontextmanager
async def served(
    name: str,
    tls: tuple[Path, Path],
    tmp_path: Path,
    settings: dict[str, dict[str, Any]] | None = None,
    clock: Callable[[], float] = time.monotonic,
    on_failure: Callable[[BaseException], None] = lambda error: None,
) -> AsyncIterator[tuple[Served, HeldApi, Any]]:
    """Transport `name` served by its table entry on a fresh socket (`settings`: config keys by section
    that differ from the defaults; `clock`: its deadlines'); yields it, the API and its address."""
    serving, api = serving_for(tls, settings, clock, on_failure)
    live = serving.live
    if name in ("unix", "wyoming"):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(address := str(tmp_path / f"{name}.sock"))
    else:
        kind = socket.SOCK_DGRAM if name == "quic" else socket.SOCK_STREAM
        sock = socket.socket(socket.AF_INET, kind)
        sock.bind(("127.0.0.1", 0))
        address = sock.getsockname()[1]
        serving.cache = UserSpaceCache(lambda: live.config.conncache, "in-process test")
    if kind_listens := sock.type == socket.SOCK_STREAM:
        sock.listen(16)
    sock.setblocking(False)
    transport = await TRANSPORTS[name].serve(serving, sock)
    try:
        yield transport, api, address
        transport.close_all()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(until(lambda: serving.budget.held == 0), 10)
        assert serving.budget.held == 0, f"{serving.budget.held} bytes held for clients were never given back"
    finally:
        transport.close_all()
        if kind_listens:
            sock.close()


async def until(condition: Any) -> None:
    while not condition():
        await asyncio.sleep(0.01)


@pytest.fixture(params=sorted(TRANSPORTS))
def transport(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture(params=HTTP)
def http_transport(request: pytest.FixtureRequest) -> str:
    """The transports whose requests are HTTP's (the deadlines' and the answers' tests below speak it)."""
    return str(request.param)


def test_a_request_is_answered_and_a_body_past_the_budget_is_refused_naming_it(transport: str, tls, tmp_path) -> None:
    async def run() -> list[str]:
        async with served(transport, tls, tmp_path) as (_, _, address):
            answers = []
            for past_budget in (False, True):
                peer = peer_of(transport, address, str(tls[0]))
                answers.append(await asyncio.wait_for(peer.past_budget() if past_budget else peer.ask(), 30))
                await peer.go_away()
            return answers

    answered, refused = asyncio.run(run())
    assert answered == "answered"
    refusal = "error" if transport in WYOMING else "503"  # Wyoming's error event, then the close
    assert refused.startswith(refusal) and f"at the limit of {BUDGET} bytes (server.max_buffered_bytes)" in refused


def test_a_client_that_goes_away_cancels_its_work(transport: str, tls, tmp_path) -> None:
    async def run() -> list[str]:
        async with served(transport, tls, tmp_path) as (served_transport, api, address):
            peer = peer_of(transport, address, str(tls[0]))
            asking = asyncio.create_task(peer.held())
            await asyncio.wait_for(until(lambda: api.events), 30)
            assert served_transport.in_flight == 1
            await peer.go_away()
            await asyncio.wait_for(until(lambda: "cancelled" in api.events), 30)
            asking.cancel()
            await asyncio.wait_for(until(lambda: served_transport.in_flight == 0), 30)
            return api.events

    assert asyncio.run(run()) == ["held", "cancelled"]


def test_a_quic_connection_that_ends_with_its_request_gives_its_body_back(tls, tmp_path, monkeypatch) -> None:
    """A peer's last packet can carry a request's end and the connection's close: the request's task
    is cancelled before it begins, so none of its own cleanup runs. Its body's bytes and its place in
    in_flight are given back all the same (they were kept for good: enough such peers took the whole
    budget). Made here by ending the connection where the request is dispatched, as that packet does."""
    original = h3.H3Protocol._dispatch
    ended: list[h3.H3Protocol] = []

    def dispatch_then_end(protocol: h3.H3Protocol, stream_id: int, arrived: Arrived) -> None:
        original(protocol, stream_id, arrived)
        protocol._ended()
        ended.append(protocol)

    monkeypatch.setattr(h3.H3Protocol, "_dispatch", dispatch_then_end)

    async def run() -> tuple[int, int, list[str]]:
        async with served("quic", tls, tmp_path) as (_, api, address):
            peer = Peer("quic", address, str(tls[0]))
            asking = asyncio.create_task(peer.send("/held", b"x" * 1000))
            await asyncio.wait_for(until(lambda: ended), 30)
            await asyncio.sleep(0.1)  # the cancelled task's end (no verdict from it: the counts below)
            asking.cancel()
            await peer.go_away()
            return ended[0].in_flight, ended[0].server.budget.held, api.events

    assert asyncio.run(run()) == (0, 0, [])


def test_the_stop_takes_no_new_connection_and_answers_the_one_under_way(
    transport: str, tls, tmp_path, monkeypatch
) -> None:
    """As the daemon stops: the stop is announced (sessions that only wait close: Wyoming's), then no
    new connection is taken; the request under way is answered; drained, close_all ends the rest. A
    goodbye does not wait for its client's close (Wyoming's linger after an error is made an hour here:
    a client that keeps its connection open, as Home Assistant's does, held the drain for it)."""
    monkeypatch.setattr(wyoming_events, "LINGER_S", 3600.0)

    async def run() -> list[str]:
        events: list[str] = []
        async with served(transport, tls, tmp_path) as (served_transport, api, address):
            early = peer_of(transport, address, str(tls[0]))
            asking = asyncio.create_task(early.held())
            await asyncio.wait_for(until(lambda: api.events), 30)
            stopping(served_transport).set()
            served_transport.stop_accepting()
            late = peer_of(transport, address, str(tls[0]))
            try:
                await asyncio.wait_for(late.ask(), 10)
                events.append("late answered")
            except (ConnectionRefusedError, NoAnswer):  # the stream listeners closed; QUIC: no handshake
                events.append("late refused")
            await late.go_away()
            api.release.set()
            drained = lambda: not (served_transport.in_flight or served_transport.delivering)  # noqa: E731
            await asyncio.wait_for(until(drained), 30)
            served_transport.close_all()  # drained, as the daemon's stop sees it: the answer is not cut off
            events.append(f"early answered {await asyncio.wait_for(asking, 30)} bytes")
            await asyncio.wait_for(until(lambda: not len(served_transport.connections)), 30)
            events.append("closed")
            await early.go_away()
        return events

    assert asyncio.run(run()) == ["late refused", f"early answered {HELD_ANSWER} bytes", "closed"]


def stopping(served_transport: Served) -> asyncio.Event:
    """The daemon's stop announced to a transport's sessions (Wyoming's close once idle; HTTP's requests
    need no word: the listener's close is the stop)."""
    sessions = getattr(served_transport, "sessions", None)
    return sessions.engine.stopping if sessions is not None else asyncio.Event()


def test_a_peer_past_its_share_is_refused_naming_it_and_admitted_again_once_under(
    transport: str, tls, tmp_path
) -> None:
    """Admission: with one connection per peer, a second one while the first is held gets the
    protocol's refusal (503 on HTTP/1.1, CONNECTION_REFUSED on QUIC, an error event on Wyoming) naming the
    share; once the first is gone, the peer is admitted again."""

    async def run() -> tuple[str, str]:
        section, key = PEER_SHARES[transport]
        async with served(transport, tls, tmp_path, {section: {key: 1}}) as (served_transport, api, address):
            early = peer_of(transport, address, str(tls[0]))
            asking = asyncio.create_task(early.held())
            await asyncio.wait_for(until(lambda: api.events), 30)
            second = peer_of(transport, address, str(tls[0]))
            try:
                refusal = await asyncio.wait_for(second.ask(), 30)
            except ConnectError as refused:
                refusal = str(refused)
            await second.go_away()
            api.release.set()
            await asyncio.wait_for(asking, 30)
            await early.go_away()
            await asyncio.wait_for(until(lambda: not len(served_transport.connections)), 30)
            again = peer_of(transport, address, str(tls[0]))
            answer = await asyncio.wait_for(again.ask(), 30)
            await again.go_away()
            return refusal, answer

    refusal, answer = asyncio.run(run())
    assert re.search(r"too many .*connections.* from \S+ \(its share is 1\)|closed the QUIC .*more than 1", refusal), (
        refusal
    )
    assert answer == "answered"


def test_a_wyoming_client_that_only_shuts_its_sending_side_is_answered(tls, tmp_path, monkeypatch) -> None:
    """A half-close (shutdown(SHUT_WR)) on the Unix socket is not leaving, as on HTTP/1.1: the kernel
    tells it from a close, and the synthesis asked before it is spoken whole (released only once the box
    has judged the end of what the client sends)."""
    verdicts: list[bool] = []
    judge = wyoming_events._left
    monkeypatch.setattr(wyoming_events, "_left", lambda writer: verdicts.append(judge(writer)) or verdicts[-1])

    async def run() -> tuple[list[str], list[str]]:
        async with served("wyoming", tls, tmp_path) as (_, api, address):
            reader, writer = await asyncio.open_unix_connection(address)
            writer.write(encoded(Synthesize(text="Hold on.", voice=SynthesizeVoice(name="held")).event()))
            writer.write_eof()
            await asyncio.wait_for(until(lambda: api.events and verdicts), 30)
            api.release.set()
            answers = []
            while (event := await asyncio.wait_for(async_read_event(reader), 30)) is not None:
                answers.append(event.type)
            writer.close()
            return api.events, answers

    events, answers = asyncio.run(run())
    assert verdicts == [False]  # seen, and judged a half-close
    assert events == ["held", "released"]
    assert answers[0] == "audio-start" and answers[-1] == "audio-stop" and "audio-chunk" in answers, answers


HELD_ASKED = {  # /held asked of each transport on the Unix socket, as its clients ask it
    "unix": b"GET /held HTTP/1.1\r\nhost: box\r\n\r\n",
    "wyoming": encoded(Synthesize(text="Hold on.", voice=SynthesizeVoice(name="held")).event()),
}


@pytest.mark.parametrize("transport", HELD_ASKED)
def test_a_client_that_closes_after_a_half_close_cancels_its_work(transport: str, tls, tmp_path, monkeypatch) -> None:
    """A half-close on the Unix socket is not leaving (above); a close after it is, though the box reads
    no new end of the stream then: the listener's next check_timeouts asks the kernel again (POLLHUP)
    and the work for it is cancelled. It ran on for no one until its answer's first write."""
    verdicts: list[bool] = []
    module = http1 if transport == "unix" else wyoming_events
    judge = module.peer_closed
    monkeypatch.setattr(module, "peer_closed", lambda transport: verdicts.append(judge(transport)) or verdicts[-1])

    async def run() -> list[str]:
        async with served(transport, tls, tmp_path) as (served_transport, api, address):
            _, writer = await asyncio.open_unix_connection(address)
            writer.write(HELD_ASKED[transport])
            writer.write_eof()
            await asyncio.wait_for(until(lambda: api.events and verdicts), 30)  # held, and judged a half-close
            writer.close()
            await writer.wait_closed()
            events = [*api.events, "closed"]
            served_transport.check_timeouts(time.monotonic())  # the listener's periodic check
            await asyncio.wait_for(until(lambda: len(api.events) > 1), 30)
            return events + api.events[1:]

    assert asyncio.run(run()) == ["held", "closed", "cancelled"]
    assert verdicts == [False, True]


def test_the_contract_covers_every_transport_of_the_table() -> None:
    """A transport added to the table is either HTTP's (every test here runs on it) or named among
    those served where the models are: none is left out of the contract."""
    assert set(HTTP) | set(WYOMING) == set(TRANSPORTS)
    assert {name for name, entry in TRANSPORTS.items() if entry.in_engine} == set(WYOMING)


class Clock:
    now = 100.0

    def __call__(self) -> float:
        return self.now


async def stop_reading(
    transport: str, address: Any, cafile: str, arrived: Callable[[], bool], path: str = "/endless"
) -> Any:
    """A client that asks for the endless answer and then takes nothing: a stream socket with a small
    receive buffer that is never read; over QUIC, a client whose socket closes without a word (no
    acknowledgement ever comes back). Returns what to close at the end."""
    if transport == "quic":
        session = QuicSession(f"127.0.0.1:{address}", cafile, connect_timeout=5)
        await session.open()
        asking = asyncio.create_task(session.send(Call("GET", "/endless")))
        await asyncio.wait_for(until(arrived), 30)  # the request is being answered: now the socket goes
        assert session._transport is not None
        session._transport.close()
        return asking
    if transport in ("unix", "wyoming"):
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        target: Any = address
    else:
        raw = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        target = ("127.0.0.1", address)
    raw.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    raw.setblocking(False)
    await asyncio.get_running_loop().sock_connect(raw, target)
    if transport in WYOMING:  # the endless voice: its speech goes on while the client takes it
        raw.send(encoded(Synthesize(text="On and on.", voice=SynthesizeVoice(name="endless")).event()))
        return raw
    if transport == "https":
        context = ssl.create_default_context(cafile=cafile)
        context.check_hostname = False
        _, writer = await asyncio.open_connection(sock=raw, ssl=context, server_hostname="box")
        writer.write(f"GET {path} HTTP/1.1\r\nhost: box\r\n\r\n".encode())
        return writer
    raw.send(f"GET {path} HTTP/1.1\r\nhost: box\r\n\r\n".encode())
    return raw


def test_a_client_that_takes_nothing_is_cut_off_at_the_write_deadline_and_its_work_ends(
    transport: str, tls, tmp_path
) -> None:
    """The write deadline (server.write_timeout_s, 5 s here) on a clock the test holds: the answer's
    bytes wait for a client that takes none; 4.9 s on, the connection is open; at 5.1 s it is cut off,
    and the answer's production ends."""

    async def run() -> list[tuple[str, object]]:
        clock, events = Clock(), []
        async with served(transport, tls, tmp_path, clock=clock) as (served_transport, api, address):
            client = await stop_reading(transport, address, str(tls[0]), lambda: api.pieces > 0)
            # flow control holds the answer: its production stops where the client stopped taking
            produced = -1
            while produced != (produced := api.pieces) or not served_transport.in_flight:
                await asyncio.sleep(0.2)
            served_transport.check_timeouts(clock())  # the client holds bytes it has not taken: the deadline runs
            for step in (WRITE_TIMEOUT_S - 0.1, 0.2):
                clock.now += step
                served_transport.check_timeouts(clock())
                for _ in range(10):  # a cut-off connection is gone within a few turns of the loop
                    await asyncio.sleep(0)
                events.append((f"{clock.now - 100:.1f} s on", len(served_transport.connections)))
            await asyncio.wait_for(until(lambda: "answer ended" in api.events), 30)
            events.append(("answer ended", served_transport.in_flight))
            if isinstance(client, asyncio.Task):
                client.cancel()
            else:
                client.close()
        return events

    assert asyncio.run(run()) == [("4.9 s on", 1), ("5.1 s on", 0), ("answer ended", 0)]


# server.body_timeout_s and quic.stream_idle_timeout_s here, on the test's clock: far past the test's own
# hang guards, so an answer that came by the loop's time rather than the clock's would never come in time
READ_TIMEOUT_S = 600.0
READ_TIMEOUTS = {"server": {"body_timeout_s": READ_TIMEOUT_S}, "quic": {"stream_idle_timeout_s": READ_TIMEOUT_S}}


async def stall(transport: str, address: Any, cafile: str) -> Callable[[], Awaitable[str]]:
    """A request begun and then quiet: a body (Wyoming: a payload) announced and never sent whole; over
    QUIC a request stream whose body never ends. Returns what reads the box's answer to it."""
    if transport == "quic":
        session = QuicSession(f"127.0.0.1:{address}", cafile, connect_timeout=5)
        await session.open()
        protocol = session._protocol
        assert protocol is not None
        stream_id = protocol._quic.get_next_available_stream_id()
        parts = protocol._streams[stream_id] = asyncio.Queue()
        head = [(b":method", b"POST"), (b":scheme", b"https"), (b":authority", b"box"), (b":path", b"/")]
        protocol.http.send_headers(stream_id, head)
        protocol.transmit()

        async def status() -> str:
            answer = str((await parts.get())[":status"])
            await session.close()
            return answer

        return status
    if transport in WYOMING:
        reader, writer = await (
            asyncio.open_unix_connection(address)
            if transport == "wyoming"
            else asyncio.open_connection("127.0.0.1", address)
        )
        writer.write(json.dumps({"type": "audio-chunk", "payload_length": 10}).encode() + b"\n" + bytes(3))

        async def error() -> str:
            event = await async_read_event(reader)
            writer.close()
            return "no answer" if event is None else f"{event.type}: {Error.from_event(event).text}"

        return error
    reader, writer = await open_stream(transport, address, cafile)
    writer.write(b"POST / HTTP/1.1\r\nhost: box\r\ncontent-length: 10\r\n\r\nabc")

    async def status_line() -> str:
        line = (await reader.readline()).decode().strip()
        writer.close()
        return line

    return status_line


def test_a_request_that_goes_quiet_is_answered_when_the_clock_passes_its_read_deadline(
    transport: str, tls, tmp_path
) -> None:
    """The read deadline (server.body_timeout_s; QUIC's quic.stream_idle_timeout_s), 600 s here, on a
    clock the test holds: 599.9 s on, the request is still waited for; at 600.1 s the protocol's own
    timeout answers it (a 408; Wyoming's error event)."""

    async def run() -> tuple[bool, str]:
        clock = Clock()
        async with served(transport, tls, tmp_path, READ_TIMEOUTS, clock=clock) as (served_transport, _, address):
            answer = asyncio.create_task((await stall(transport, address, str(tls[0])))())
            await asyncio.wait_for(until(lambda: len(served_transport.connections) == 1), 30)
            for _ in range(20):  # what the client sent has arrived
                await asyncio.sleep(0.01)
            clock.now += READ_TIMEOUT_S - 0.1
            served_transport.check_timeouts(clock())
            for _ in range(20):
                await asyncio.sleep(0.01)
            waited = not answer.done()
            clock.now += 0.2
            served_transport.check_timeouts(clock())
            return waited, await asyncio.wait_for(answer, 30)

    waited, answer = asyncio.run(run())
    assert waited, answer
    if transport in WYOMING:
        assert answer == f"error: an event's data or payload stalled for {READ_TIMEOUT_S:g} s", answer
    else:
        assert answer.startswith("HTTP/1.1 408") or answer == "408", answer


def test_a_tls_handshake_not_done_in_time_is_closed_and_the_operator_told(tls, tmp_path, caplog) -> None:
    """https.handshake_timeout_s: a client that opens TCP and never sends its ClientHello is closed, with
    the limit's log line (a good client whose handshake a stalled process cannot finish meets the same)."""

    async def run() -> bytes:
        async with served("https", tls, tmp_path, {"https": {"handshake_timeout_s": 0.2}}) as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            said = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            return said

    assert asyncio.run(run()) == b""
    assert "limit: a TLS handshake of 127.0.0.1 not done in 0.2 s (https.handshake_timeout_s): closed" in caplog.text, (
        caplog.text
    )


@pytest.mark.parametrize("transport", ["unix", "https"])
def test_an_answer_the_client_has_not_taken_yet_holds_the_drain(transport: str, tls, tmp_path) -> None:
    """A whole answer written while its client reads nothing is no longer in flight, but asyncio still
    holds it: `delivering` says so until the client has taken it (a worker that returned at its stop
    would drop it with its loop). HTTP/3 counts its unacknowledged answers the same way (h3_answers.py)."""

    async def run() -> list[tuple[str, int]]:
        events = []
        async with served(transport, tls, tmp_path) as (served_transport, _, address):
            reader, writer = await open_stream(transport, address, str(tls[0]))
            writer.write(b"GET /large HTTP/1.1\r\nhost: box\r\n\r\n")
            await asyncio.wait_for(until(lambda: len(served_transport.connections) == 1), 30)
            await asyncio.wait_for(until(lambda: not served_transport.in_flight), 30)
            events.append(("answered, not taken", served_transport.delivering))
            await reader.readuntil(b"\r\n\r\n")
            await reader.readexactly(LARGE)
            await asyncio.wait_for(until(lambda: not served_transport.delivering), 30)
            events.append(("taken", served_transport.delivering))
            writer.close()
        return events

    assert asyncio.run(run()) == [("answered, not taken", 1), ("taken", 0)]


def test_a_failed_start_closes_what_it_started_once_however_often_it_is_asked(tls) -> None:
    """HTTPS started, then QUIC cannot (a stream socket where a datagram socket belongs): the table
    closes what started, and the daemon's abort asking again finds nothing left to close twice."""

    async def run() -> str:
        serving, _ = serving_for(tls)
        serving.cache = UserSpaceCache(lambda: serving.live.config.conncache, "in-process test")
        https = socket.create_server(("127.0.0.1", 0))
        https.setblocking(False)
        transports = Transports()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as not_datagrams:
            with pytest.raises(ValueError) as failed:
                await transports.serve(serving, {"https": https, "quic": not_datagrams})
        assert https.fileno() == -1  # the listener that had started is closed
        transports.stop_accepting()
        transports.close_all()
        return str(failed.value)

    assert "UDP" in asyncio.run(run())


@pytest.mark.parametrize("transport", ["unix", "https"])
def test_a_whole_answer_not_taken_is_cut_off_at_the_write_deadline(transport: str, tls, tmp_path) -> None:
    """An answer written at once (not streamed), its client taking none of it: the request is no longer
    in flight, but the write deadline still runs on what the client has not taken (over TLS, what asyncio's
    TCP transport holds under the TLS one): open 4.9 s on, cut off at 5.1 s."""

    async def run() -> list[tuple[str, int]]:
        clock, events = Clock(), []
        async with served(transport, tls, tmp_path, clock=clock) as (served_transport, _, address):
            client = await stop_reading(transport, address, str(tls[0]), lambda: True, path="/large")
            await asyncio.wait_for(until(lambda: served_transport.delivering), 30)
            served_transport.check_timeouts(clock())
            for step in (WRITE_TIMEOUT_S - 0.1, 0.2):
                clock.now += step
                served_transport.check_timeouts(clock())
                for _ in range(10):
                    await asyncio.sleep(0)
                events.append((f"{clock.now - 100:.1f} s on", len(served_transport.connections)))
            client.close()
        return events

    assert asyncio.run(run()) == [("4.9 s on", 1), ("5.1 s on", 0)]


def test_a_deadline_check_that_crashes_stops_the_process(http_transport: str, tls, tmp_path) -> None:
    """Our bug in the periodic deadline check ends the task that holds every connection to its deadlines:
    the process's failure callback hears of it (the daemon stops and is started again) rather than
    serving on with no deadlines."""

    def crash(now: float) -> None:
        raise RuntimeError("a bug in a deadline check")

    async def run() -> list[str]:
        failures: list[BaseException] = []
        async with served(http_transport, tls, tmp_path, on_failure=failures.append) as (served_transport, _, address):
            served_transport.check_timeouts = crash  # type: ignore[method-assign]
            peer = Peer(http_transport, address, str(tls[0]))
            assert await asyncio.wait_for(peer.send("/"), 30) == (200, b"answered")
            await asyncio.wait_for(until(lambda: failures), 30)
            await peer.go_away()
        return [str(failure) for failure in failures]

    assert asyncio.run(run()) == ["a bug in a deadline check"]


def test_plain_http_to_the_https_port_is_told_to_use_https(tls, tmp_path) -> None:
    """http:// to the HTTPS port: a 400 that names the mistake (as nginx answers), not a silent close;
    the port goes on serving TLS."""

    async def run() -> tuple[int, bytes, int]:
        async with served("https", tls, tmp_path) as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /v2/health/ready HTTP/1.1\r\nhost: box\r\n\r\n")
            said = await asyncio.wait_for(reader.read(), 30)
            writer.close()
            context = ssl.create_default_context(cafile=str(tls[0]))
            context.check_hostname = False
            reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
            writer.write(b"GET /large HTTP/1.1\r\nhost: box\r\n\r\n")
            status = int((await asyncio.wait_for(reader.readline(), 30)).split()[1])
            writer.close()
        return port, said, status

    port, said, status = asyncio.run(run())
    head, body = said.split(b"\r\n\r\n")
    assert head.split(b"\r\n")[0] == b"HTTP/1.1 400 Bad Request", said
    assert body.decode() == f"this port speaks HTTPS only: plain HTTP was sent to it; use https:// (port {port})\n"
    assert status == 200


def test_plain_http_whose_body_comes_after_the_answer_still_gets_a_clean_close(tls, tmp_path) -> None:
    """The 400 is sent as soon as the first byte shows plain HTTP; what the client sends after it (a
    body written apart from its head) is read to its end, so the close is a FIN: closed with it unread,
    the kernel resets the connection, and a client may lose the answer."""

    async def run() -> tuple[bytes, bytes]:
        async with served("https", tls, tmp_path) as (_, _, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /v1/audio/speech HTTP/1.1\r\nhost: box\r\ncontent-length: 262144\r\n\r\n")
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            writer.write(b"x" * 262144)
            writer.write_eof()
            rest = await asyncio.wait_for(reader.read(), 30)  # a reset raises ConnectionResetError here
            writer.close()
        return head, rest

    head, rest = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 400 Bad Request\r\n"), head
    assert rest.startswith(b"this port speaks HTTPS only") and rest.endswith(b")\n"), rest


def test_a_head_is_answered_with_the_length_of_the_body_and_without_it(http_transport: str, tls, tmp_path) -> None:
    """RFC 9110 9.3.2: the head alone, whose content-length (on HTTP/1.1) is the GET's body's; the next
    answer on the connection is read right after it (a body sent anyway would be read as its start)."""

    async def run() -> Any:
        async with served(http_transport, tls, tmp_path) as (_, _, address):
            if http_transport == "quic":
                session = QuicSession(f"127.0.0.1:{address}", str(tls[0]), connect_timeout=5)
                try:
                    answers = [await asyncio.wait_for(session.send(Call(m, "/")), 30) for m in ("HEAD", "GET")]
                finally:
                    await session.close()
                return [(a.status, a.headers.get("content-length"), a.body) for a in answers]
            reader, writer = await open_stream(http_transport, address, str(tls[0]))
            writer.write(
                b"HEAD / HTTP/1.1\r\nhost: box\r\n\r\nGET / HTTP/1.1\r\nhost: box\r\nconnection: close\r\n\r\n"
            )
            answer = await asyncio.wait_for(reader.read(-1), 30)
            writer.close()
            return answer

    answer = asyncio.run(run())
    if http_transport == "quic":
        assert answer == [(200, None, b""), (200, "8", b"answered")]  # (h3_answers.py: why no length)
    else:
        head, get = answer.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 200") and b"content-length: 8" in head, answer
        assert get.startswith(b"HTTP/1.1 200") and get.endswith(b"\r\n\r\nanswered"), answer
