"""Wyoming under attack, on a real daemon serving the interpreter firmware, driven by the `wyoming`
package's own client: impossible audio formats, text past the bounds or that the voice says nothing
for, a client that leaves mid-synthesis. Each attack gets its `error` event (never a traceback in the
log), and a good client is served beside (an on-box app) and after it."""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import ifaddr
import pytest
from conftest import Daemon, good_unix_client_beside
from mdns import MDNS_GROUP, srv_ports
from speech import RATE, recording
from test_speech_to_text import CLEAR, wer
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncUnixClient
from wyoming.event import Event
from wyoming.ping import Ping
from wyoming.tts import Synthesize, SynthesizeChunk, SynthesizeStart

from appliance.audio import to_pcm16
from appliance.bench.daemon import free_tcp_port
from appliance.kinds.text import MAX_TEXT_CHARS

TINY = "whisper_tiny_en"


@pytest.fixture(scope="module")
def espeak_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with a wrapper of the real espeak-ng that counts each run: its file `runs`."""
    tools = tmp_path_factory.mktemp("tools")
    wrapper = tools / "espeak-ng"
    wrapper.write_text(f'#!/bin/sh\necho run >> {tools / "runs"}\nexec {shutil.which("espeak-ng")} "$@"\n')
    wrapper.chmod(0o755)
    return tools / "runs"


def runs(espeak_runs: Path) -> int:
    return len(espeak_runs.read_text().splitlines()) if espeak_runs.exists() else 0


@pytest.fixture(scope="module")
def daemon(interpreter_bundle, keys, espeak_runs: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    """The daemon runs espeak-ng through the counting wrapper, first on its PATH."""
    extra = f'[wyoming]\ntcp = "127.0.0.1:{free_tcp_port()}"\n'
    env = {"PATH": f"{espeak_runs.parent}:{os.environ['PATH']}"}
    d = Daemon(tmp_path_factory.mktemp("daemon"), interpreter_bundle, keys.trusted, extra=extra, env=env)
    d.wait_ready(240)
    yield d
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


async def exchange(daemon: Daemon, events: list[Event], *until: str) -> list[Event]:
    """Send `events`, then every event the box answers until one of a type in `until` or the close."""
    async with AsyncUnixClient(daemon.socket.with_name("wyoming.sock")) as client:
        for event in events:
            await client.write_event(event)
        answers = []
        while (answer := await asyncio.wait_for(client.read_event(), 120)) is not None:
            answers.append(answer)
            if answer.type in until:
                break
        return answers


def good_transcription(daemon: Daemon) -> str:
    """A good client's recording, sent as Home Assistant sends one: its transcript."""
    samples, _ = recording(CLEAR[:1], gap_s=0.3, lead_s=0.3)
    pcm = to_pcm16(samples)
    chunks = [AudioChunk(RATE, 2, 1, pcm[i : i + 6400]).event() for i in range(0, len(pcm), 6400)]
    start = [Transcribe(name=TINY, language="en").event(), AudioStart(RATE, 2, 1).event()]
    answers = asyncio.run(exchange(daemon, [*start, *chunks, AudioStop().event()], "transcript"))
    assert answers and answers[-1].type == "transcript", answers
    return Transcript.from_event(answers[-1]).text


IMPOSSIBLE = [  # (rate, width, channels) no recording can have, or that the box does not take
    (RATE, 2, 0),
    (RATE, 2, -1),
    (RATE, 2, 10**9),
    (0, 2, 1),
    (-16000, 2, 1),
    (10**12, 2, 1),
    (RATE, 0, 1),
    (RATE, 5, 1),
    (RATE, 2, "2"),
    (RATE, 2, None),
    (16000.5, 2, 1),
]


@pytest.mark.parametrize("event", ["audio-start", "audio-chunk"])
def test_an_impossible_audio_format_is_an_error_event_and_the_next_client_is_served(daemon: Daemon, event) -> None:
    """`channels: 0` in a chunk was a ZeroDivisionError: a traceback in the log, no error event, the
    connection gone. Each impossible format is one `error` event naming the format the box takes; the
    connection goes on (a good chunk after it is heard), and the next client is served."""
    good = AudioChunk(RATE, 2, 1, bytes(3200)).event()
    with good_unix_client_beside(daemon):
        for rate, width, channels in IMPOSSIBLE:
            bad = Event("audio-start" if event == "audio-start" else "audio-chunk", {"rate": rate, "width": width})
            bad.data["channels"] = channels
            if event == "audio-chunk":
                bad = Event(bad.type, bad.data, payload=bytes(6400))
            leading = [Transcribe(name=TINY).event()]
            leading += [AudioStart(RATE, 2, 1).event()] if event == "audio-chunk" else []
            sent = [*leading, bad, AudioStart(RATE, 2, 1).event(), good, AudioStop().event()]
            answers = asyncio.run(exchange(daemon, sent, "transcript"))
            types = [a.type for a in answers]
            assert types[0] == "error" and types[-1] == "transcript", (rate, width, channels, types)
            text = answers[0].data["text"]
            assert f"{event}: send 16-bit PCM (width 2), 1 to 8 channels, 8 to 192 kHz" in text, text
        assert wer(CLEAR[0], good_transcription(daemon)) <= 0.10


def spoken(answers: list[Event]) -> list[str]:
    return [a.type for a in answers if a.type != "audio-chunk"]


def test_synthesize_text_is_bounded_as_the_http_apis_speech_input(daemon: Daemon) -> None:
    """`synthesize` took a million characters; the HTTP API's input takes MAX_TEXT_CHARS. A text over
    that is one error naming the bound, and the connection goes on."""
    over = Synthesize(text="Where is the station? " * (MAX_TEXT_CHARS // 22 + 1)).event()
    answers = asyncio.run(exchange(daemon, [over], "error", "audio-start"))
    assert spoken(answers) == ["error"], spoken(answers)
    assert f"the most one request takes is {MAX_TEXT_CHARS}" in answers[0].data["text"], answers[0].data
    answers = asyncio.run(exchange(daemon, [over, Synthesize(text="Where is it?").event()], "audio-stop"))
    assert spoken(answers) == ["error", "audio-start", "audio-stop"]  # the same connection goes on


def test_streamed_text_is_bounded_as_a_whole_synthesis(daemon: Daemon) -> None:
    """Streamed synthesize-chunk text grew without bound (and was rescanned at each chunk). A streamed
    synthesis is a text as one synthesize is: past MAX_TEXT_CHARS it gets one error and the close."""
    words = [SynthesizeChunk(text="one two three four five six seven ").event()] * (MAX_TEXT_CHARS // 34 + 1)
    with good_unix_client_beside(daemon):
        answers = asyncio.run(exchange(daemon, [SynthesizeStart().event(), *words, Ping().event()], "pong"))
    assert [a.type for a in answers] == ["error"], answers
    assert f"a streamed synthesis over {MAX_TEXT_CHARS} characters" in answers[0].data["text"]
    assert "limit: Wyoming client" in daemon.log.read_text()


def test_a_text_the_voice_says_nothing_for_is_refused_after_one_espeak_run(daemon: Daemon, espeak_runs) -> None:
    """espeak-ng says nothing for U+1D7E0 (a digit): the box ran espeak-ng once more per clause, 21,000
    runs a request, going on for minutes after the client left. Now one run: a text of nothing else
    is one error, and beside other words it is left out. A client that leaves at once leaves no runs
    behind: at most the one begun before the box saw it leave (none where it saw that first), and those
    that follow are the next client's."""
    odd = "\U0001d7e0. " * 2000
    before = runs(espeak_runs)
    with good_unix_client_beside(daemon):
        answers = asyncio.run(exchange(daemon, [Synthesize(text=odd).event()], "audio-stop", "error"))
    assert [a.type for a in answers] == ["error"] and "nothing to say" in answers[0].data["text"], answers
    assert runs(espeak_runs) == before + 1
    answers = asyncio.run(exchange(daemon, [Synthesize(text=f"Good morning. {odd}Where is it?").event()], "audio-stop"))
    assert spoken(answers) == ["audio-start", "audio-stop"] and runs(espeak_runs) == before + 2

    async def send_and_leave() -> None:
        async with AsyncUnixClient(daemon.socket.with_name("wyoming.sock")) as client:
            await client.write_event(Synthesize(text=odd * 10).event())

    asyncio.run(send_and_leave())
    answers = asyncio.run(exchange(daemon, [Synthesize(text="Where is it?").event()], "audio-stop"))
    assert spoken(answers) == ["audio-start", "audio-stop"] and before + 3 <= runs(espeak_runs) <= before + 4


def test_zeroconf_answers_only_on_the_address_wyoming_is_served_on(daemon: Daemon) -> None:
    """Served on 127.0.0.1, the box answered a unicast mDNS query sent to any of its addresses (its
    wildcard socket on 0.0.0.0:5353), so another network could learn its host name and port. Now a
    query to another of its addresses gets nothing, and one to the mDNS group on the served interface
    its SRV record (Home Assistant's discovery there is test_wyoming's)."""
    others = sorted(
        a.ip for adapter in ifaddr.get_adapters() for a in adapter.ips if isinstance(a.ip, str) and a.ip[:4] != "127."
    )
    if not others:
        pytest.skip("this host has no address but loopback to ask on")
    name = re.search(r"announced as (\S+) \(", daemon.log.read_text())[1]  # type: ignore[index]
    port = int(re.search(r'tcp = "127.0.0.1:(\d+)"', daemon.config.read_text())[1])  # type: ignore[index]
    assert srv_ports(name, MDNS_GROUP) == [port]  # asked where it serves: its port
    for other in others:
        assert srv_ports(name, other, tries=16) == [], other
