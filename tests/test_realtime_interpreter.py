"""The interpreter session of /v1/realtime (`?model=` the speech pipeline, `&target=` its language):
real espeak-ng speech streamed at real-time pace, each turn answered with the translated speech as
response.output_audio.delta chunks at the session's output rate, and its transcript events."""

from __future__ import annotations

import asyncio
import base64
import itertools
import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import soxr
from conftest import Daemon, Keys
from faster_whisper import WhisperModel
from speech import RATE, recording
from test_long_running import process_tree_rss_kib
from test_realtime import TURN_DETECTION, next_event, pcm
from test_speech_to_text import wait_until_idle, words
from websockets.asyncio.client import unix_connect
from wsproto import ConnectionType, WSConnection
from wsproto.events import CloseConnection, Request, TextMessage

COMPLETED = "conversation.item.input_audio_transcription.completed"
SENTENCES = ["The train leaves at three in the afternoon.", "My brother works at the hospital."]
KEY_WORDS = [{"afternoon"}, {"brother", "hospital"}]  # what Whisper base hears of espeak-ng reliably
LONG_TURNS = [
    "The morning train to the coast leaves from the second platform at half past seven, so please be early.",
    "A light rain is expected in the afternoon, so an umbrella may be useful when you walk to the museum.",
]


@pytest.fixture(scope="module")
def daemon(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon


def interpret(daemon: Daemon, sentences: list[str], target: str = "en", paced: bool = True) -> list[dict]:
    """Every event of an interpreter session fed the sentences' speech at real-time pace (or, not
    `paced`, as fast as the box takes it)."""
    samples, _ = recording(sentences, gap_s=1.2, lead_s=0.5)
    audio = pcm(np.concatenate([samples, np.zeros(RATE, np.float32)]), 24000)

    async def run() -> list[dict]:
        uri = f"ws://appliance/v1/realtime?model=interpreter&target={target}"
        async with unix_connect(str(daemon.socket), uri, max_size=None) as ws:
            created = await next_event(ws, "session.created")
            assert created["session"]["type"] == "realtime", created
            session = {
                "type": "realtime",
                "audio": {
                    "input": {"turn_detection": TURN_DETECTION},
                    "output": {"format": {"type": "audio/pcm", "rate": 24000}},
                },
            }
            await ws.send(json.dumps({"type": "session.update", "session": session}))
            await next_event(ws, "session.updated")
            events: list[dict] = []

            async def receive() -> None:
                while sum(e["type"] == "response.done" for e in events) < len(sentences):
                    events.append(json.loads(await ws.recv()))

            receiver = asyncio.create_task(receive())
            step, began = 24000 * 2 // 10, time.monotonic()
            for index, offset in enumerate(range(0, len(audio), step)):
                piece = base64.b64encode(audio[offset : offset + step]).decode()
                await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
                if paced:
                    await asyncio.sleep(max(0.0, began + (index + 1) * 0.1 - time.monotonic()))
            try:
                await asyncio.wait_for(receiver, 120)
            except TimeoutError:
                raise AssertionError([(e["type"], e.get("error"), e.get("transcript")) for e in events]) from None
            return events

    return asyncio.run(run())


def test_interpreter_session_speaks_each_turn(daemon: Daemon, judge_tiny: WhisperModel) -> None:
    events = interpret(daemon, SENTENCES)
    assert not [e for e in events if e["type"] == "error"], events
    for keys, done in zip(KEY_WORDS, [e for e in events if e["type"] == "response.done"], strict=True):
        rid = done["response"]["id"]
        spoken = b"".join(
            base64.b64decode(e["delta"])
            for e in events
            if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
        )
        transcript = next(
            e for e in events if e["type"] == "response.output_audio_transcript.done" and e["response_id"] == rid
        )
        assert keys <= set(words(transcript["transcript"]).split()), transcript
        assert len(spoken) / 2 / 24000 > 1.0
        # what the voice said, heard by an independent Whisper (faster-whisper, tiny.en's package files)
        heard_audio = soxr.resample(np.frombuffer(spoken, "<i2").astype(np.float32) / 32768, 24000, RATE)
        segments, _ = judge_tiny.transcribe(heard_audio, language="en", beam_size=5)
        heard = " ".join(s.text for s in segments)
        assert keys <= set(words(heard).split()), heard
    with daemon.client() as client:
        metrics = client.metrics()
    first = re.search(
        r'appliance_live_latency_seconds_count\{model="interpreter",protocol="realtime",until="first_audio"\} (\d+)',
        metrics,
    )
    total = re.search(
        r'appliance_live_latency_seconds_sum\{model="interpreter",protocol="realtime",until="first_audio"\} ([0-9.]+)',
        metrics,
    )
    assert first and total and int(first[1]) >= len(SENTENCES), metrics[-2000:]
    print(f"interpreter: end of sentence to first translated audio, mean {float(total[1]) / int(first[1]):.3f} s")


def test_the_session_hears_the_next_turn_while_it_answers_one(daemon: Daemon) -> None:
    """Two turns sent at once, into Portuguese (Bergamot and Kokoro: the slowest answer): the second
    turn's speech is heard before the first turn's answer is ready, and the answers come in the turns'
    order, each after its own transcript."""
    events = interpret(daemon, [LONG_TURNS[0], SENTENCES[1]], target="pt", paced=False)
    assert not [e for e in events if e["type"] == "error"], events
    kinds = [e["type"] for e in events]
    heard = [i for i, kind in enumerate(kinds) if kind == "input_audio_buffer.speech_started"]
    assert len(heard) == 2 and heard[1] < kinds.index("response.output_audio.delta"), kinds
    turns = [e["item_id"] for e in events if e["type"] == COMPLETED]
    answered = [e["response"]["metadata"]["input_item_id"] for e in events if e["type"] == "response.done"]
    assert answered == turns, (turns, answered)
    for turn in turns:
        transcript = next(i for i, e in enumerate(events) if e["type"] == COMPLETED and e["item_id"] == turn)
        done = next(
            i
            for i, e in enumerate(events)
            if e["type"] == "response.done" and e["response"]["metadata"]["input_item_id"] == turn
        )
        assert transcript < done


@pytest.fixture(scope="module")
def patient_daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys, interpreter_bundle: Path) -> Iterator[Daemon]:
    """The interpreter firmware with two protocol workers, as the shared daemon, that waits 10 min instead
    of 30 s on a client that takes nothing ([server] write_timeout_s). The back-pressure test's client
    reads nothing for as long as the engine works through its turns: under 30 s alone, past it beside
    the suite's other workers, where the deadline cut it off. Its subject is the bounds the client is held
    at; the deadline's own tests are test_connection_attacks's and the transport contract's."""
    workdir = tmp_path_factory.mktemp("patient")
    d = Daemon(workdir, interpreter_bundle, keys.trusted, workers=2, extra_server="write_timeout_s = 600.0\n")
    yield d.wait_ready(240)
    assert d.stop() == 0, d.log.read_text()


def test_a_client_that_stops_reading_is_held_at_the_bounds_and_loses_nothing(patient_daemon: Daemon) -> None:
    """A raw WebSocket client (wsproto, a small receive buffer) streams eight long turns and then
    silence as fast as it can without reading the translated speech (some 3 MB of it, more than the
    worker channel's 1 MiB credit and the socket's buffers hold): the session's sends wait for it, the
    box stops reading its messages past [websocket] buffered_bytes (its sends block: about 4 MiB held,
    not the 64 MiB it tries), every process stays within its memory bound and others are served
    meanwhile; once the client reads again, every turn's answer arrives in full."""
    turns = LONG_TURNS * 4
    samples, _ = recording(turns, gap_s=1.2, lead_s=0.5)
    speech = pcm(samples, 24000)
    second_of_silence = json.dumps(
        {"type": "input_audio_buffer.append", "audio": base64.b64encode(bytes(48000)).decode()}
    )
    before = process_tree_rss_kib(patient_daemon)
    ws = WSConnection(ConnectionType.CLIENT)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(str(patient_daemon.socket))
    sock.sendall(ws.send(Request(host="appliance", target="/v1/realtime?model=interpreter&target=en")))
    received: list[dict] = []
    parts: list[str] = []  # of the message being received (wsproto hands frames on as they come)

    def read_until(done: Callable[[], bool]) -> None:
        while not done():
            data = sock.recv(1 << 16)
            assert data, "the box closed the connection"
            ws.receive_data(data)
            for event in ws.events():
                if isinstance(event, TextMessage):
                    parts.append(event.data)
                    if event.message_finished:
                        received.append(json.loads("".join(parts)))
                        parts.clear()
                elif isinstance(event, CloseConnection):
                    raise AssertionError(f"closed: {event.code} {event.reason}")

    sock.settimeout(60)
    read_until(lambda: any(e["type"] == "session.created" for e in received))
    session = {"type": "realtime", "audio": {"input": {"turn_detection": TURN_DETECTION}}}
    sock.sendall(ws.send(TextMessage(json.dumps({"type": "session.update", "session": session}))))
    read_until(lambda: any(e["type"] == "session.updated" for e in received))
    # from here on nothing is read: the speech, then silence until the box stops taking it
    step = 24000 * 2 // 10
    messages = (
        json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(speech[i : i + step]).decode()})
        for i in range(0, len(speech), step)
    )
    pending, sent, blocked = bytearray(), 0, False
    sock.settimeout(15)
    for message in itertools.chain(messages, itertools.repeat(second_of_silence)):
        pending += ws.send(TextMessage(message))
        try:
            while pending:
                n = sock.send(pending)
                del pending[:n]
                sent += n
        except TimeoutError:
            blocked = True
            break
        if sent > 64 << 20:
            break
    assert blocked, f"the box took {sent >> 20} MiB from a client that reads nothing"
    assert sent < 12 << 20, f"{sent >> 20} MiB taken before the box stopped reading"
    with patient_daemon.client() as client:
        assert client.health()["ready"], "others are not served"
    # the turns it had taken are transcribed (up to four wait for their answers, which wait for the
    # client) while the audio it took is read at speech pace ([realtime] max_ahead_s): the engine works
    # in bursts for minutes, so each process is held to its bound at every sample of 5 s, not to none
    wait_until_idle(patient_daemon)
    samples = []
    for _ in range(6):
        samples.append(process_tree_rss_kib(patient_daemon))
        time.sleep(1)
    grown = {pid: max(s.get(pid, 0) for s in samples) - before.get(pid, 0) for pid in samples[-1]}
    # every process but the engine holds at most its WebSocket buffers (4 MiB) and the channel's 1 MiB.
    # What the engine holds for the client is bounded above (under 12 MiB of its audio taken; its answers
    # a few MB of speech); its resident size moves with its models' arenas as the turns' decodes meet:
    # -50 MiB alone, +167 and +181 MiB in full runs, so it is held only to no runaway
    engine = patient_daemon.proc.pid
    assert grown[engine] < 512 << 10 and all(g < 16 << 10 for p, g in grown.items() if p != engine), grown
    # the client reads again (and finishes its last message): every turn's answer comes, whole
    sock.settimeout(180)
    finisher = threading.Thread(target=sock.sendall, args=(bytes(pending),))
    finisher.start()
    read_until(lambda: sum(e["type"] == "response.done" for e in received) == len(turns))
    finisher.join(60)
    assert not [e for e in received if e["type"] == "error"], [e for e in received if e["type"] == "error"]
    for done in [e for e in received if e["type"] == "response.done"]:
        rid = done["response"]["id"]
        spoken = sum(
            len(base64.b64decode(e["delta"]))
            for e in received
            if e["type"] == "response.output_audio.delta" and e["response_id"] == rid
        )
        assert spoken / 2 / 24000 > 1.0, (rid, spoken)
    sock.close()
    print(f"stopped reading: the box took {sent / 2**20:.1f} MiB; resident growth {grown} KiB")
