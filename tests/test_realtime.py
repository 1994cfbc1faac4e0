"""OpenAI's Realtime API at /v1/realtime (GA event format), transcription session: a `websockets`
client on the Unix socket streams real espeak-ng speech at real-time pace, in 20 ms and 100 ms frames;
the box's VAD finds the turns and Whisper's transcripts are checked against the known sentences.
Both with the transports in the engine process (workers = 1) and in a protocol worker (workers = 2)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import soxr
from conftest import Daemon, Keys
from speech import RATE, recording
from tcp_forward import tcp_to_unix
from test_speech_to_text import CLEAR, wer, words
from test_workers import UnixConnection
from websockets.asyncio.client import ClientConnection, unix_connect
from websockets.exceptions import ConnectionClosed

from appliance.client import Call

TINY = "whisper_tiny_en"
URI = "ws://appliance/v1/realtime?intent=transcription"
TURN_DETECTION = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 200, "silence_duration_ms": 400}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory, keys: Keys, voice_bundle: Path) -> Iterator[Daemon]:
    """The Realtime API's sessions in the engine process (a small box's layout); through protocol workers
    they run in test_realtime_interpreter.py (Unix socket) and test_realtime_h3.py (HTTP/3)."""
    workdir = tmp_path_factory.mktemp("daemon")
    extra = "[websocket]\nmax_message_bytes = 262144\n"
    d = Daemon(workdir, voice_bundle, keys.trusted, extra=extra).wait_ready(180)
    yield d
    assert d.stop() == 0, d.log.read_text()


async def next_event(ws: ClientConnection, kind: str, timeout: float = 30.0) -> dict[str, Any]:
    while True:
        event = json.loads(await asyncio.wait_for(ws.recv(), timeout))
        if event["type"] == kind:
            return event


async def configure(ws: ClientConnection, rate: int, turn_detection: dict[str, Any] | None = TURN_DETECTION) -> None:
    created = await next_event(ws, "session.created")
    assert created["session"]["type"] == "transcription"
    session = {
        "type": "transcription",
        "audio": {
            "input": {
                "format": {"type": "audio/pcm", "rate": rate},
                "transcription": {"model": TINY, "language": "en"},
                "turn_detection": turn_detection,
            }
        },
    }
    await ws.send(json.dumps({"type": "session.update", "session": session}))
    updated = await next_event(ws, "session.updated")
    assert updated["session"]["audio"]["input"]["format"]["rate"] == rate


def pcm(samples: np.ndarray, rate: int) -> bytes:
    resampled = soxr.resample(samples, RATE, rate) if rate != RATE else samples
    return np.clip(np.round(resampled * 32768), -32768, 32767).astype("<i2").tobytes()


async def stream_live(socket: Path, sentences: list[str], frame_ms: int, rate: int) -> tuple[list[dict], list]:
    """The sentences' recording sent at real-time pace in frames of frame_ms; every event until each
    turn completed, and when each sentence was said."""
    samples, spans = recording(sentences, gap_s=1.2, lead_s=0.5)
    return await live_session(socket, samples, frame_ms, rate, len(sentences)), spans


async def live_session(
    socket: Path,
    samples: np.ndarray,
    frame_ms: int,
    rate: int,
    turns: int,
    turn_detection: dict[str, Any] | None = TURN_DETECTION,
) -> list[dict]:
    """16 kHz `samples` and a second of silence sent as `rate` PCM at real-time pace in frames of
    frame_ms; every event until `turns` turns completed."""
    audio = pcm(np.concatenate([samples, np.zeros(RATE, np.float32)]), rate)  # the last turn's silence
    step = rate * 2 * frame_ms // 1000
    events: list[dict] = []
    async with unix_connect(str(socket), URI) as ws:
        await configure(ws, rate, turn_detection)

        async def receive() -> None:
            while sum(e["type"].endswith("transcription.completed") for e in events) < turns:
                events.append(json.loads(await ws.recv()))

        receiver = asyncio.create_task(receive())
        began = time.monotonic()
        for index, offset in enumerate(range(0, len(audio), step)):
            piece = base64.b64encode(audio[offset : offset + step]).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": piece}))
            await asyncio.sleep(max(0.0, began + (index + 1) * frame_ms / 1000 - time.monotonic()))
        await asyncio.wait_for(receiver, 60)
    return events


@pytest.mark.parametrize(("frame_ms", "rate"), [(20, 24000), (100, 16000)])
def test_live_turns_and_transcripts(daemon: Daemon, frame_ms: int, rate: int) -> None:
    sentences = CLEAR[:2] if frame_ms == 20 else CLEAR[2:4]
    events, spans = asyncio.run(stream_live(daemon.socket, sentences, frame_ms, rate))
    errors = [e for e in events if e["type"] == "error"]
    assert not errors, errors
    started = [e for e in events if e["type"] == "input_audio_buffer.speech_started"]
    stopped = [e for e in events if e["type"] == "input_audio_buffer.speech_stopped"]
    committed = [e for e in events if e["type"] == "input_audio_buffer.committed"]
    completed = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed"]
    assert len(started) == len(stopped) == len(committed) == len(completed) == len(sentences), events
    for sentence, (start, end), began, ended, done in zip(sentences, spans, started, stopped, completed, strict=True):
        assert abs(began["audio_start_ms"] / 1000 - start) < 0.5, (began, start)
        assert abs(ended["audio_end_ms"] / 1000 - end) < 0.8, (ended, end)
        assert began["item_id"] == ended["item_id"] == done["item_id"]
        assert wer(sentence, done["transcript"]) == 0.0, done["transcript"]
    assert committed[1]["previous_item_id"] == committed[0]["item_id"]
    # the event order a client relies on: started < stopped < committed < completed for each item
    order = [e["type"].rsplit(".", 1)[-1] for e in events if e.get("item_id") == completed[0]["item_id"]]
    assert order[0] == "speech_started" and order[-1] == "completed", order
    count, total = live_latency(daemon, "realtime")
    assert count >= len(sentences) and 0 < total / count < 10, (count, total)
    print(f"realtime: end of sentence to completed, mean {total / count:.3f} s over {count} turns")


LONG_TURN = (
    "I would like to order a cup of coffee and a sandwich, and please call me back when you get home tonight, "
    "because the lights in the kitchen are still on."
)


def test_an_open_turn_sends_its_text_so_far_as_deltas(daemon: Daemon) -> None:
    """A turn of about nine seconds: while it is open, the words heard so far come as transcription
    deltas of its item before its completed event, and they are the start of the known sentence."""
    events, _ = asyncio.run(stream_live(daemon.socket, [LONG_TURN], 100, 16000))
    completed = next(e for e in events if e["type"] == "conversation.item.input_audio_transcription.completed")
    deltas = [e for e in events if e["type"] == "conversation.item.input_audio_transcription.delta"]
    assert deltas, [e["type"] for e in events]
    assert all(d["item_id"] == completed["item_id"] and d["content_index"] == 0 for d in deltas), deltas
    assert events.index(deltas[-1]) < events.index(completed)
    so_far, known = words("".join(d["delta"] for d in deltas)).split(), words(LONG_TURN).split()
    assert len(so_far) >= 5 and so_far == known[: len(so_far)], (so_far, known)
    assert wer(LONG_TURN, completed["transcript"]) <= 0.1, completed["transcript"]
    print(f"deltas: {len(deltas)}, {len(so_far)} of {len(known)} words before the turn closed")


def live_latency(daemon: Daemon, protocol: str) -> tuple[int, float]:
    """The box's own end-of-sentence to final-transcript histogram: its count and sum."""
    with daemon.client() as client:
        text = client.metrics()
    labels = f'{{model="{TINY}",protocol="{protocol}",until="transcript"}}'
    count = re.search(rf"appliance_live_latency_seconds_count{re.escape(labels)} (\d+)", text)
    total = re.search(rf"appliance_live_latency_seconds_sum{re.escape(labels)} ([0-9.]+)", text)
    assert count and total, text[-2000:]
    return int(count[1]), float(total[1])


def test_manual_commit_and_clear(daemon: Daemon) -> None:
    async def run() -> list[dict]:
        samples, _ = recording(CLEAR[4:5], gap_s=0.3, lead_s=0.3)
        async with unix_connect(str(daemon.socket), URI) as ws:
            await configure(ws, 16000, turn_detection=None)
            await ws.send(json.dumps({"type": "input_audio_buffer.commit", "event_id": "empty"}))
            empty = await next_event(ws, "error")
            noise = base64.b64encode(pcm(np.full(RATE, 0.3, np.float32), 16000)).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": noise}))
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            await next_event(ws, "input_audio_buffer.cleared")
            audio = base64.b64encode(pcm(samples, 16000)).decode()
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": audio}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            committed = await next_event(ws, "input_audio_buffer.committed")
            completed = await next_event(ws, "conversation.item.input_audio_transcription.completed", 60)
            return [empty, committed, completed]

    empty, committed, completed = asyncio.run(run())
    assert empty["error"]["code"] == "input_audio_buffer_commit_empty" and empty["error"]["event_id"] == "empty"
    assert completed["item_id"] == committed["item_id"]
    assert wer(CLEAR[4], completed["transcript"]) == 0.0, completed["transcript"]


def test_bad_events_are_errors_and_the_session_goes_on(daemon: Daemon) -> None:
    async def run() -> list[dict]:
        async with unix_connect(str(daemon.socket), URI) as ws:
            await next_event(ws, "session.created")
            answers = []
            for bad in [
                "not json",
                json.dumps({"type": "no.such.event", "event_id": "e1"}),
                json.dumps({"type": "input_audio_buffer.append", "audio": "***"}),
                json.dumps({"type": "session.update", "session": {"audio": {"input": {"format": {"rate": 44100}}}}}),
            ]:
                await ws.send(bad)
                answers.append(await next_event(ws, "error"))
            await ws.send(b"\x00binary")
            answers.append(await next_event(ws, "error"))
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription"}}))
            answers.append(await next_event(ws, "session.updated"))
            pong = await ws.ping()
            await asyncio.wait_for(pong, 10)  # the box answers pings
            return answers

    answers = asyncio.run(run())
    codes = [a["error"]["code"] for a in answers[:5]]
    assert codes == ["invalid_json", "invalid_event", "invalid_value", "invalid_value", "invalid_event"], answers
    assert answers[1]["error"]["event_id"] == "e1" and answers[1]["error"]["type"] == "invalid_request_error"
    assert answers[3]["error"]["param"] == "session.audio.input.format.rate"
    assert answers[5]["type"] == "session.updated"


def test_message_over_the_bound_closes_with_1009_and_others_go_on(daemon: Daemon) -> None:
    async def run() -> int | None:
        async with unix_connect(str(daemon.socket), URI, max_size=None) as ws:
            await next_event(ws, "session.created")
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": "A" * 300_000}))
            try:
                while True:
                    await asyncio.wait_for(ws.recv(), 10)
            except ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd else None

    assert asyncio.run(run()) == 1009
    with daemon.client() as client:  # the daemon serves on
        assert client.health()["ready"]


def test_plain_get_and_a_head_asking_to_upgrade_are_426(daemon: Daemon) -> None:
    with daemon.client() as client:
        answer = client.send(Call("GET", "/v1/realtime"))
    assert answer.status == 426 and b"WebSocket" in answer.body
    connection = UnixConnection(str(daemon.socket))  # a WebSocket opens by GET alone (RFC 6455 4.1)
    upgrade = {"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13"}
    connection.request("HEAD", "/v1/realtime", headers={**upgrade, "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ=="})
    assert connection.getresponse().status == 426
    connection.close()


def test_openai_realtime_client_over_a_tcp_bridge(daemon: Daemon) -> None:
    """The `openai` package's own realtime client (its websockets connection, its event models)."""
    samples, _ = recording(CLEAR[5:6], gap_s=1.2, lead_s=0.5)
    audio = pcm(np.concatenate([samples, np.zeros(RATE, np.float32)]), 24000)
    step = 24000 * 2 // 10  # 100 ms appends, sent as fast as the client goes

    async def run() -> str:
        with tcp_to_unix(daemon.socket) as address:
            client = openai.AsyncOpenAI(api_key="on-box", base_url=f"http://{address}/v1", max_retries=0)
            async with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
                await connection.session.update(
                    session={"type": "transcription", "audio": {"input": {"turn_detection": TURN_DETECTION}}}
                )
                for offset in range(0, len(audio), step):
                    piece = base64.b64encode(audio[offset : offset + step]).decode()
                    await connection.input_audio_buffer.append(audio=piece)
                async for event in connection:
                    if event.type == "conversation.item.input_audio_transcription.completed":
                        return event.transcript
                    assert event.type != "error", event
        raise AssertionError("no transcript")

    transcript = asyncio.run(asyncio.wait_for(run(), 120))
    assert wer(CLEAR[5], transcript) == 0.0, transcript
