"""Wyoming under attack, on a real daemon serving the interpreter firmware, driven by the `wyoming`
package's own client: impossible audio formats, text past the bounds or that the voice says nothing
for, a client that leaves mid-synthesis. Each attack gets its `error` event (never a traceback in the
log), and a good client is served beside and after it."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from conftest import Daemon
from speech import RATE, recording
from test_speech_to_text import CLEAR, wer
from wyoming.asr import Transcribe, Transcript
from wyoming.audio import AudioChunk, AudioStart, AudioStop
from wyoming.client import AsyncUnixClient
from wyoming.event import Event

from appliance.audio import to_pcm16
from appliance.bench.daemon import free_tcp_port

TINY = "whisper_tiny_en"


@pytest.fixture(scope="module")
def daemon(interpreter_bundle, keys, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    extra = f'[wyoming]\ntcp = "127.0.0.1:{free_tcp_port()}"\n'
    d = Daemon(tmp_path_factory.mktemp("daemon"), interpreter_bundle, keys.trusted, extra=extra).wait_ready(240)
    yield d
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


async def exchange(daemon: Daemon, events: list[Event], until: str = "transcript") -> list[Event]:
    """Send `events`, then every event the box answers until one of type `until` or the close."""
    async with AsyncUnixClient(daemon.socket.with_name("wyoming.sock")) as client:
        for event in events:
            await client.write_event(event)
        answers = []
        while (answer := await asyncio.wait_for(client.read_event(), 120)) is not None:
            answers.append(answer)
            if answer.type == until:
                break
        return answers


def good_transcription(daemon: Daemon) -> str:
    """A good client's recording, sent as Home Assistant sends one: its transcript."""
    samples, _ = recording(CLEAR[:1], gap_s=0.3, lead_s=0.3)
    pcm = to_pcm16(samples)
    chunks = [AudioChunk(RATE, 2, 1, pcm[i : i + 6400]).event() for i in range(0, len(pcm), 6400)]
    start = [Transcribe(name=TINY, language="en").event(), AudioStart(RATE, 2, 1).event()]
    answers = asyncio.run(exchange(daemon, [*start, *chunks, AudioStop().event()]))
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
    for rate, width, channels in IMPOSSIBLE:
        bad = Event("audio-start" if event == "audio-start" else "audio-chunk", {"rate": rate, "width": width})
        bad.data["channels"] = channels
        if event == "audio-chunk":
            bad = Event(bad.type, bad.data, payload=bytes(6400))
        leading = [Transcribe(name=TINY).event()] + ([AudioStart(RATE, 2, 1).event()] if event == "audio-chunk" else [])
        answers = asyncio.run(
            exchange(daemon, [*leading, bad, AudioStart(RATE, 2, 1).event(), good, AudioStop().event()])
        )
        types = [a.type for a in answers]
        assert types[0] == "error" and types[-1] == "transcript", (rate, width, channels, types)
        text = answers[0].data["text"]
        assert f"{event}: send 16-bit PCM (width 2), 1 to 8 channels, 8 to 192 kHz" in text, text
    assert wer(CLEAR[0], good_transcription(daemon)) <= 0.10
